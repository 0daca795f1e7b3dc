"""Whole-chunk calls made at once from several threads are issued by one of them
(``kvtier.cuda.issuer.Issuer``), and a store and a load from two threads move exact bytes.

The issuer is tested on plain step generators (its own API): a call made while another thread
issues is stepped by that thread, a handed-over call's error reaches its own thread only, and
waiting for an issuer is bounded. The connector is tested through its public calls.
"""

from __future__ import annotations

import threading
from collections.abc import Generator

import pytest
import torch

from conftest import (
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
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.issuer import Issuer

WAIT_S = 30.0


def _steps(
    log: list[tuple[str, int]],
    name: str,
    n: int,
    hold: threading.Event | None = None,
    started: threading.Event | None = None,
    fail: bool = False,
) -> Generator[None, None, str]:
    """A call of ``n`` steps logging which thread ran each; ``started`` is set at its first
    step, which then waits for ``hold`` (bounded)."""
    for k in range(n):
        log.append((name, threading.get_ident()))
        if k == 0 and started is not None:
            started.set()
        if k == 0 and hold is not None:
            assert hold.wait(WAIT_S)
        if fail and k == 1:
            raise IndexError(f"{name} failed")
        yield
    return name


def _run(fn, out: dict, key: str) -> threading.Thread:  # type: ignore[no-untyped-def]
    def target() -> None:
        out[key + "_thread"] = threading.get_ident()
        try:
            out[key] = fn()
        except BaseException as e:
            out[key] = e

    t = threading.Thread(target=target)
    t.start()
    return t


@pytest.mark.parametrize("second_fails", [False, True])
def test_a_call_made_while_another_issues_is_stepped_by_the_issuing_thread(second_fails):
    issuer = Issuer()
    log: list[tuple[str, int]] = []
    started, hold = threading.Event(), threading.Event()
    out: dict = {}
    a = _run(lambda: issuer.issue([_steps(log, "a", 3, hold, started)]), out, "a")
    assert started.wait(WAIT_S)
    b = _run(lambda: issuer.issue([_steps(log, "b", 3, fail=second_fails)]), out, "b")
    # b is handed over: it waits, and nothing of it runs before a's issuer takes it.
    b.join(0.2)
    assert b.is_alive() and all(name == "a" for name, _ in log)
    hold.set()
    a.join(WAIT_S)
    b.join(WAIT_S)
    assert out["a"] == ["a"]
    if second_fails:
        assert isinstance(out["b"], IndexError) and "b failed" in str(out["b"])
    else:
        assert out["b"] == ["b"]
    assert {thread for name, thread in log if name == "b"} == {out["a_thread"]}
    # Nothing is left issuing: a later call runs in its own thread.
    assert issuer.issue([_steps(log, "c", 2)]) == ["c"]


def test_waiting_for_an_issuer_is_bounded_and_runs_nothing_of_the_call():
    issuer = Issuer(handoff_timeout_s=0.2)
    log: list[tuple[str, int]] = []
    started, hold = threading.Event(), threading.Event()
    out: dict = {}
    a = _run(lambda: issuer.issue([_steps(log, "a", 2, hold, started)]), out, "a")
    assert started.wait(WAIT_S)
    with pytest.raises(TimeoutError, match="nothing of it was enqueued"):
        issuer.issue([_steps(log, "b", 2)])
    hold.set()
    a.join(WAIT_S)
    assert out["a"] == ["a"] and all(name == "a" for name, _ in log)


def test_a_store_and_a_load_from_two_threads_move_exact_bytes(device, arena):
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=60)
    ref = TorchPagedConnector([c.clone() for c in caches], layout)
    lengths = [SHAPE.chunk] * 3
    slots = random_slots(SHAPE.blocks * SHAPE.block, lengths * 2, seed=61, holes="scatter")
    conn = CUDAPagedConnector(caches, layout, staging_slots=2, staging_slot_bytes=1)
    mine, theirs = Objects(arena, layout, lengths, 62), Objects(arena, layout, lengths, 62)
    fresh = Objects(arena, layout, lengths, 63)
    out: dict = {}
    threads = [
        _run(lambda: [conn.store(mine.transfers(slots[:3])) for _ in range(3)], out, "store"),
        _run(lambda: [conn.load(fresh.transfers(slots[3:])) for _ in range(3)], out, "load"),
    ]
    for t in threads:
        t.join(WAIT_S)
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    ref.store(theirs.transfers(slots[:3]))
    ref.load(fresh.transfers(slots[3:]))
    assert_same_objects(mine, theirs)
    assert_same_caches(conn, ref)
