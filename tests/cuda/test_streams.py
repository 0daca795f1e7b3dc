"""Stream and event behaviour on a real GPU: ordering after compute, per-layer readiness, and
store + load running at once. (Speed is measured by ``kvtier bench transfer``, not asserted.)"""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import (
    ON_GPU,
    OPTION_SETS,
    SHAPE,
    Objects,
    as_bytes,
    make_caches,
    make_layout,
    random_slots,
)
from kvtier.core.connector import TorchPagedConnector
from kvtier.core.layout import PagedLayout
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.memory import TABLE_RING

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)"),
]

LENGTHS = [SHAPE.chunk] * 4
# About 50 ms of GPU time: long enough that a copy not ordered after it would read stale KV.
SLEEP_CYCLES = 100_000_000


@pytest.fixture(params=OPTION_SETS)
def setup(request, device, arena):
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=1)
    conn = CUDAPagedConnector(caches, layout, **OPTION_SETS[request.param])
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS, seed=2, holes="none")
    return layout, conn, slots


def _warm_up(conn: CUDAPagedConnector, layout, arena, slots) -> None:  # type: ignore[no-untyped-def]
    """Stores and loads until every staging and table buffer has been used once: a buffer's
    first use allocates it, and an allocation (pinned memory in particular) can synchronise the
    whole device, which would order the next copy after everything by accident and hide a
    missing event."""
    objs = Objects(arena, layout, [len(s) for s in slots], 99)
    for _ in range(TABLE_RING + 1):
        conn.store(objs.transfers(slots))
        conn.load(objs.transfers(slots))
    torch.cuda.synchronize()


def test_store_reads_what_the_compute_stream_wrote_before_it(setup, arena):
    layout, conn, slots = setup
    new_values = [torch.randn_like(c, dtype=torch.float32).to(c.dtype) for c in conn.kv_caches]
    _warm_up(conn, layout, arena, slots)
    objs = Objects(arena, layout, LENGTHS, 3)
    torch.cuda.synchronize()
    # The engine's compute stream, not the legacy default stream: work on that one orders every
    # (blocking) stream after it implicitly, which would hide a missing event.
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(SLEEP_CYCLES)  # the "forward pass" is still running...
        for c, v in zip(conn.kv_caches, new_values, strict=True):
            c.copy_(v)  # ...and writes the KV last
        conn.store(objs.transfers(slots))
    ref = TorchPagedConnector([v.clone() for v in new_values], layout)
    expected = Objects(arena, layout, LENGTHS, 3)
    ref.store(expected.transfers(slots))
    assert all(torch.equal(a, b) for a, b in zip(objs.bytes(), expected.bytes(), strict=True))


def test_layerwise_load_orders_each_layer_before_the_compute_stream_reads_it(setup, arena):
    layout, conn, _ = setup
    objs = Objects(arena, layout, LENGTHS * 2, 5)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS * 2, seed=6, holes="prefix")
    ref = TorchPagedConnector([c.clone() for c in conn.kv_caches], layout)
    ref.load(objs.transfers(slots))
    snapshots = []
    for layer in conn.load_layerwise(objs.transfers(slots)):
        # Read on the compute stream with no host synchronisation: only the event orders it.
        snapshots.append(conn.kv_caches[layer].clone())
    torch.cuda.synchronize()
    for snap, expected in zip(snapshots, ref.kv_caches, strict=True):
        assert torch.equal(as_bytes(snap), as_bytes(expected))


def test_layerwise_store_captures_each_layer_after_the_compute_stream_wrote_it(setup, arena):
    layout, conn, slots = setup
    objs = Objects(arena, layout, LENGTHS, 7)
    written = []
    gen = conn.store_layerwise(objs.transfers(slots))
    for layer, cache in enumerate(conn.kv_caches):
        torch.cuda._sleep(SLEEP_CYCLES // 20)
        value = torch.randn_like(cache, dtype=torch.float32).to(cache.dtype)
        cache.copy_(value)
        written.append(value)
        assert next(gen) == layer
        cache.zero_()  # the engine overwrites the layer right after the yield
    with pytest.raises(StopIteration):
        next(gen)
    ref = TorchPagedConnector(written, layout)
    expected = Objects(arena, layout, LENGTHS, 7)
    ref.store(expected.transfers(slots))
    assert all(torch.equal(a, b) for a, b in zip(objs.bytes(), expected.bytes(), strict=True))


def test_store_and_load_at_once_from_two_threads(setup, arena):
    layout, conn, _ = setup
    all_slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS * 2, seed=8, holes="none")
    store_slots, load_slots = all_slots[: len(LENGTHS)], all_slots[len(LENGTHS) :]
    ref = TorchPagedConnector([c.clone() for c in conn.kv_caches], layout)
    to_store = Objects(arena, layout, LENGTHS, 9)
    to_load = Objects(arena, layout, LENGTHS, 10)
    expected_store = Objects(arena, layout, LENGTHS, 9)
    ref.store(expected_store.transfers(store_slots))
    ref.load(to_load.transfers(load_slots))
    torch.cuda.synchronize()
    errors: list[BaseException] = []

    def run(fn, transfers):
        try:
            for _ in range(5):
                fn(transfers)
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(conn.store, to_store.transfers(store_slots))),
        threading.Thread(target=run, args=(conn.load, to_load.transfers(load_slots))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    torch.cuda.synchronize()
    assert all(
        torch.equal(a, b) for a, b in zip(to_store.bytes(), expected_store.bytes(), strict=True)
    )
    for a, b in zip(conn.kv_caches, ref.kv_caches, strict=True):
        assert torch.equal(as_bytes(a), as_bytes(b))


def test_interleaved_store_and_load_follow_the_caller_and_restore_its_stream(setup, arena):
    layout, conn, _ = setup
    all_slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS * 2, seed=11, holes="none")
    store_slots, load_slots = all_slots[: len(LENGTHS)], all_slots[len(LENGTHS) :]
    to_store, to_load = Objects(arena, layout, LENGTHS, 12), Objects(arena, layout, LENGTHS, 13)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        new_values = [torch.randn_like(c, dtype=torch.float32).to(c.dtype) for c in conn.kv_caches]
        for c, v in zip(conn.kv_caches, new_values, strict=True):
            c.copy_(v)
        pending = conn.store_and_load_async(
            to_store.transfers(store_slots), to_load.transfers(load_slots)
        )
        assert torch.cuda.current_stream() == side
        for p in pending:
            p.wait()
        snapshot = [c.clone() for c in conn.kv_caches]  # ordered after the load by wait()
    torch.cuda.synchronize()
    ref = TorchPagedConnector([v.clone() for v in new_values], layout)
    expected = Objects(arena, layout, LENGTHS, 12)
    ref.store(expected.transfers(store_slots))
    ref.load(to_load.transfers(load_slots))
    assert all(torch.equal(a, b) for a, b in zip(to_store.bytes(), expected.bytes(), strict=True))
    for a, b in zip(snapshot, ref.kv_caches, strict=True):
        assert torch.equal(as_bytes(a), as_bytes(b))


def test_a_store_made_while_another_thread_issues_follows_its_own_threads_stream(device, arena):
    """Thread A issues a long load (one-row staging slots: hundreds of pieces); meanwhile thread B
    writes the KV on its own stream after ~50 ms of GPU work and stores it, so A's thread most
    likely issues B's store (calls from several threads are issued by one of them). The store
    must wait for B's stream, not the issuing thread's. (The load's slots are disjoint from the
    store's; B overwrites the whole cache, so only the stored objects are compared.)"""
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=90)
    conn = CUDAPagedConnector(caches, layout, staging_slots=2, staging_slot_bytes=1)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS * 2, seed=91, holes="none")
    load_slots, store_slots = slots[: len(LENGTHS)], slots[len(LENGTHS) :]
    _warm_up(conn, layout, arena, load_slots)
    fresh, objs = Objects(arena, layout, LENGTHS, 92), Objects(arena, layout, LENGTHS, 93)
    new_values = [torch.randn_like(c, dtype=torch.float32).to(c.dtype) for c in caches]
    torch.cuda.synchronize()
    errors: list[BaseException] = []
    started = threading.Event()

    def load() -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream(device)):
                started.set()
                conn.load(fresh.transfers(load_slots))
        except BaseException as e:
            errors.append(e)

    def store() -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream(device)):
                torch.cuda._sleep(SLEEP_CYCLES)  # the "forward pass" is still running...
                for c, v in zip(caches, new_values, strict=True):
                    c.copy_(v)  # ...and writes the KV last
                conn.store(objs.transfers(store_slots))
        except BaseException as e:
            errors.append(e)

    a = threading.Thread(target=load)
    a.start()
    assert started.wait(30)
    b = threading.Thread(target=store)
    b.start()
    a.join(120)
    b.join(120)
    assert not a.is_alive() and not b.is_alive() and not errors, errors
    expected = Objects(arena, layout, LENGTHS, 94)
    TorchPagedConnector([v.clone() for v in new_values], layout).store(
        expected.transfers(store_slots)
    )
    assert all(torch.equal(x, y) for x, y in zip(objs.bytes(), expected.bytes(), strict=True))


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_without_a_staging_buffer_no_staging_ring_outlives_a_call(device, arena, layerwise):
    """``staging_buffer=False`` (config ``device_staging_buffer``): after each call the device
    memory in use is back to what it was, but for the small table buffers (one 64 MiB ring per
    direction would otherwise stay)."""
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=95)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS, seed=96, holes="none")
    objs = Objects(arena, layout, LENGTHS, 97)
    ring_bytes = 2 * (32 << 20)
    for keep in (True, False):
        conn = CUDAPagedConnector(caches, layout, staging_buffer=keep)
        before = torch.cuda.memory_allocated(device)
        if layerwise:
            assert list(conn.store_layerwise(objs.transfers(slots))) == list(
                range(layout.num_layers)
            )
            assert list(conn.load_layerwise(objs.transfers(slots))) == list(
                range(layout.num_layers)
            )
        else:
            conn.store(objs.transfers(slots))
            conn.load(objs.transfers(slots))
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated(device) - before
        assert (held >= 2 * ring_bytes) if keep else (held < ring_bytes), (keep, held)
        del conn
