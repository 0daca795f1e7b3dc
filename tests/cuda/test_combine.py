"""Whole-chunk calls made at once from several threads are issued by one of them (``_issue``).

vLLM saves from a saver thread while the forward thread loads; two threads issuing at once trade
the GIL at every driver call. These tests force the overlap (the first call holds its first step
until the second call has been handed over) and check that the second call's steps ran in the
first call's thread, that both calls' bytes match core's reference, that a handed-over call's
error reaches its own thread only, and that waiting for an issuer is bounded. On a GPU they also
check that each call stays ordered after its own thread's stream.
"""

from __future__ import annotations

import threading
import time
from unittest.mock import patch

import pytest
import torch

from conftest import (
    ON_GPU,
    SHAPE,
    Objects,
    assert_same_caches,
    assert_same_objects,
    make_caches,
    make_layout,
    random_slots,
)
from kvtier.core.connector import TorchPagedConnector
from kvtier.core.layout import PagedLayout
from kvtier.cuda import connector as connmod
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.kernels import LAUNCHES

pytestmark = pytest.mark.triton

LENGTHS = [SHAPE.chunk] * 3
WAIT_S = 30.0


def _trace(conn: CUDAPagedConnector, hold_store: threading.Event | None, held: str = "store"):  # type: ignore[no-untyped-def]
    """Record which thread first steps each call; with ``hold_store``, the first step of a call
    of kind ``held`` sets it and then holds until another call has been handed over (bounded)."""
    log: list[tuple[str, int]] = []
    orig = conn._call_steps

    def call_steps(lane, transfers, keep, *, store, **kwargs):  # type: ignore[no-untyped-def]
        gen = orig(lane, transfers, keep, store=store, **kwargs)

        def run():  # type: ignore[no-untyped-def]
            kind = "store" if store else "load"
            log.append((kind, threading.get_ident()))
            if kind == held and hold_store is not None:
                hold_store.set()
                deadline = time.monotonic() + WAIT_S
                while not conn._mailbox and time.monotonic() < deadline:
                    time.sleep(0.001)
            return (yield from gen)

        return run()

    conn._call_steps = call_steps  # type: ignore[method-assign]
    return log


def _in_threads(store_call, load_call, issuing: threading.Event, *, one_after_the_other: bool = False) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Run the store in one thread and, once it issues (or, ``one_after_the_other``, once it
    returned), the load in another; outcomes by name."""
    out: dict[str, object] = {}

    def run(name, fn):  # type: ignore[no-untyped-def]
        out[name + "_thread"] = threading.get_ident()
        try:
            out[name] = fn()
        except BaseException as e:
            out[name] = e

    a = threading.Thread(target=run, args=("store", store_call))
    a.start()
    assert issuing.wait(WAIT_S)
    if one_after_the_other:
        a.join(WAIT_S)
    b = threading.Thread(target=run, args=("load", load_call))
    b.start()
    a.join(WAIT_S)
    b.join(WAIT_S)
    assert not a.is_alive() and not b.is_alive()
    return out


def _setup(device, arena, seed):  # type: ignore[no-untyped-def]
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=seed)
    ref = TorchPagedConnector([c.clone() for c in caches], layout)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS * 2, seed=seed + 1, holes="scatter")
    return layout, caches, ref, slots[:3], slots[3:]


@pytest.mark.parametrize("combine", [True, False])
def test_a_call_made_while_another_thread_issues_is_issued_by_that_thread(device, arena, combine):
    layout, caches, ref, store_slots, load_slots = _setup(device, arena, 60)
    conn = CUDAPagedConnector(caches, layout, combine_calls=combine)
    issuing = threading.Event()
    log = _trace(conn, issuing if combine else None)
    if not combine:
        issuing.set()
    mine, theirs = Objects(arena, layout, LENGTHS, 62), Objects(arena, layout, LENGTHS, 62)
    fresh = Objects(arena, layout, LENGTHS, 63)
    # Uncombined on CPU, the two calls would run Triton's interpreter in two threads at once,
    # which is not thread-safe (it keeps the program id in a global): one after the other there.
    out = _in_threads(lambda: conn.store(mine.transfers(store_slots)),
                      lambda: conn.load(fresh.transfers(load_slots)), issuing,
                      one_after_the_other=not combine and device.type != "cuda")
    assert out["store"] is None and out["load"] is None, out
    ref.store(theirs.transfers(store_slots))
    ref.load(fresh.transfers(load_slots))
    assert_same_objects(mine, theirs)
    assert_same_caches(conn, ref)
    steppers = dict(log)
    if combine:
        assert steppers == {"store": out["store_thread"], "load": out["store_thread"]}
    else:
        assert steppers == {"store": out["store_thread"], "load": out["load_thread"]}
    assert not conn._issuing and not conn._mailbox


def test_a_handed_over_calls_error_reaches_its_own_thread_only(device, arena):
    layout, caches, ref, store_slots, load_slots = _setup(device, arena, 70)
    conn = CUDAPagedConnector(caches, layout)
    issuing = threading.Event()
    _trace(conn, issuing)
    bad = [s.clone() for s in load_slots]
    bad[1][0] = SHAPE.blocks * SHAPE.block  # past the cache
    mine, theirs = Objects(arena, layout, LENGTHS, 72), Objects(arena, layout, LENGTHS, 72)
    fresh = Objects(arena, layout, LENGTHS, 73)
    out = _in_threads(lambda: conn.store(mine.transfers(store_slots)),
                      lambda: conn.load(fresh.transfers(bad)), issuing)
    assert out["store"] is None
    assert isinstance(out["load"], IndexError) and "transfer 1: slot values" in str(out["load"])
    ref.store(theirs.transfers(store_slots))
    assert_same_objects(mine, theirs)
    # Nothing is left issuing, and the connector still moves exact bytes from any thread.
    assert not conn._issuing and not conn._mailbox
    conn._call_steps = CUDAPagedConnector._call_steps.__get__(conn)  # type: ignore[method-assign]
    conn.load(fresh.transfers(load_slots))
    ref.load(fresh.transfers(load_slots))
    assert_same_caches(conn, ref)


def test_waiting_for_an_issuer_is_bounded_and_enqueues_nothing(device, arena):
    layout, caches, _, store_slots, _ = _setup(device, arena, 80)
    conn = CUDAPagedConnector(caches, layout)
    objs = Objects(arena, layout, LENGTHS, 81)
    before = objs.bytes()
    conn._issuing = True  # as if another thread were issuing and never took the call
    with patch.object(connmod, "_HANDOFF_TIMEOUT_S", 0.2), pytest.raises(TimeoutError, match="nothing of it was enqueued"):
        conn.store(objs.transfers(store_slots))
    assert not conn._mailbox
    assert all(torch.equal(a, b) for a, b in zip(objs.bytes(), before, strict=True))
    conn._issuing = False
    conn.store(objs.transfers(store_slots))
    assert any(not torch.equal(a, b) for a, b in zip(objs.bytes(), before, strict=True))


def test_combine_calls_must_be_a_bool(device):
    layout = make_layout(PagedLayout.FLASH_NHD, torch.float16)
    with pytest.raises(ValueError, match="combine_calls"):
        CUDAPagedConnector(make_caches(layout, device, seed=1), layout, combine_calls="yes")  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
def test_a_handed_over_store_follows_its_own_threads_stream(device, arena):
    """Thread B writes the KV on its own stream after ~50 ms of GPU work and stores it while
    thread A issues a load: A issues B's store, which must still wait for B's stream (not A's)."""
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=90)
    conn = CUDAPagedConnector(caches, layout)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS * 2, seed=91, holes="none")
    load_slots, store_slots = slots[:3], slots[3:]
    new_values = [torch.randn_like(c, dtype=torch.float32).to(c.dtype) for c in caches]
    fresh, objs = Objects(arena, layout, LENGTHS, 92), Objects(arena, layout, LENGTHS, 93)
    # Every staging and table buffer of both lanes used once first: a first use allocates, and
    # an allocation can synchronise the device, which would order the store after B's stream
    # by accident.
    # Both at once too: a store made while a load DMA runs sends its table up with a small
    # kernel, whose first launch compiles it for longer than B's GPU work lasts.
    warm = Objects(arena, layout, LENGTHS, 94)
    for _ in range(connmod._TABLE_RING + 1):
        conn.store(warm.transfers(store_slots))
        conn.load(warm.transfers(load_slots))
        for pending in conn.store_and_load_async(warm.transfers(store_slots), warm.transfers(load_slots)):
            pending.wait()
    assert any(key[0] == "copy_words" for key in LAUNCHES.compiled) or not LAUNCHES.usable
    issuing = threading.Event()
    log = _trace(conn, issuing, held="load")
    torch.cuda.synchronize()
    errors: list[BaseException] = []
    idents: dict[str, int] = {}

    def load() -> None:
        idents["a"] = threading.get_ident()
        try:
            # Each thread on its own stream: the legacy default stream would order every
            # (blocking) stream after its work implicitly and hide a wrong event.
            with torch.cuda.stream(torch.cuda.Stream(device)):
                conn.load(fresh.transfers(load_slots))
        except BaseException as e:
            errors.append(e)

    def store() -> None:
        idents["b"] = threading.get_ident()
        try:
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(100_000_000)  # the "forward pass" is still running...
                for c, v in zip(caches, new_values, strict=True):
                    c.copy_(v)  # ...and writes the KV last
                conn.store(objs.transfers(store_slots))
        except BaseException as e:
            errors.append(e)

    a = threading.Thread(target=load)
    a.start()
    assert issuing.wait(WAIT_S)
    b = threading.Thread(target=store)
    b.start()
    a.join(WAIT_S)
    b.join(WAIT_S)
    assert not a.is_alive() and not b.is_alive() and not errors, errors
    assert dict(log) == {"load": idents["a"], "store": idents["a"]}
    ref = TorchPagedConnector([v.clone() for v in new_values], layout)
    expected = Objects(arena, layout, LENGTHS, 93)
    ref.store(expected.transfers(store_slots))
    assert_same_objects(objs, expected)
