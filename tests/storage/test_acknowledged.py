"""Acknowledged means stored: ``flush()`` says when a chunk did not land in a lower tier, and
``close()`` without ``flush()`` counts every chunk it drops, queued or already dequeued."""

from __future__ import annotations

import shutil
import threading
import time

from storage_helpers import ARENA_BYTES, LAYOUT, NAMESPACE, config, key, put_chunk

from kvtier.core.memory import HostArena
from kvtier.storage.backends.base import BackendContext
from kvtier.storage.backends.disk.local_disk import LocalDiskBackend
from kvtier.storage.backends.local_cpu import LocalCPUBackend
from kvtier.storage.manager import TieredStorageManager
from kvtier.storage.stats import StorageStats


def build(tmp_path, tier_classes, *, close_timeout_s=5.0, write_queue_wait_s=0.0, **kw):
    cfg = config(tmp_path, **kw)
    arena = HostArena.create(ARENA_BYTES)
    stats = StorageStats()
    tiers = []
    for i, cls in enumerate(tier_classes):
        c = cfg.replace(local_disk_path=str(tmp_path / f"disk{i}"))
        tiers.append(
            cls(
                BackendContext(
                    config=c, layout=LAYOUT, namespace=NAMESPACE, arena=arena, stats=stats
                )
            )
        )
    m = TieredStorageManager(
        tiers,
        arena=arena,
        stats=stats,
        write_queue_size=cfg.write_queue_size,
        io_threads=cfg.io_threads,
        close_timeout_s=close_timeout_s,
        write_queue_wait_s=write_queue_wait_s,
    )
    return m, arena


def test_flush_reports_writes_an_unwritable_disk_skipped(make_manager):
    m = make_manager()
    put_chunk(m, 0)
    assert m.flush(10)
    (disk,) = m.lower
    shutil.rmtree(disk.dir)
    disk.dir.write_bytes(b"not a directory")  # every write in it now fails
    put_chunk(m, 1)
    put_chunk(m, 2)
    assert not m.flush(10)
    assert m.last_flush.pending == 0
    assert m.last_flush.not_stored == {"local_disk.store_skipped": 2}
    # reported once: the next flush covers only what was put after this one
    assert m.flush(10)


class GatedTier(LocalDiskBackend):
    """A real disk tier whose writes wait for a gate (a slow medium)."""

    name = "gated"
    gate = threading.Event()
    entered = threading.Event()

    def batched_put(self, items):
        self.entered.set()
        assert self.gate.wait(30)
        return super().batched_put(items)


def test_close_counts_chunks_a_writer_had_dequeued(tmp_path):
    """A writer holds a batch in the first lower tier when ``close`` runs: the tier after it
    never gets the batch, and that is counted, not silent."""
    GatedTier.gate.clear()
    GatedTier.entered.clear()
    m, arena = build(
        tmp_path, [LocalCPUBackend, GatedTier, LocalDiskBackend], io_threads=1, close_timeout_s=0.2
    )
    writers = [t for t in threading.enumerate() if t.name.startswith("kvtier-writer")]
    for i in range(3):
        put_chunk(m, i)
    assert GatedTier.entered.wait(10)
    m.close()  # the writer is stuck in the gated tier past close's bound
    GatedTier.gate.set()
    for t in writers:
        t.join(10)
    disk = m.lower[1]
    written = sum(disk.contains([key(i) for i in range(3)]))
    assert written == 0
    assert (
        m.stats.get("local_disk.dropped_at_close") + m.stats.get("write_queue.dropped_at_close")
        == 3
    ), m.stats
    deadline = time.monotonic() + 10
    while arena.used_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert arena.used_bytes == 0


def _gated_manager(tmp_path, wait_s: float):
    GatedTier.gate.clear()
    GatedTier.entered.clear()
    m, arena = build(
        tmp_path,
        [LocalCPUBackend, GatedTier],
        io_threads=1,
        write_queue_size=1,
        write_queue_wait_s=wait_s,
    )
    return m, arena


def _close(m, arena) -> None:
    GatedTier.gate.set()
    m.close()
    deadline = time.monotonic() + 10
    while arena.used_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert arena.used_bytes == 0


def test_a_full_queue_drops_at_once_by_default(tmp_path):
    m, arena = _gated_manager(tmp_path, 0.0)
    put_chunk(m, 0)
    assert GatedTier.entered.wait(10)  # the writer holds chunk 0 in the slow tier
    put_chunk(m, 1)  # queued
    t0 = time.monotonic()
    put_chunk(m, 2)  # no room: dropped at once
    assert time.monotonic() - t0 < 0.5
    assert m.stats.get("write_queue.dropped") == 1
    _close(m, arena)


def test_a_full_queue_keeps_a_chunk_waiting_without_holding_the_caller(tmp_path):
    """A vLLM kv_producer's setting: its chunks are another instance's input, so a chunk that
    finds the queue full waits for a writer; the caller (the worker's saver, which gates block
    frees and save reports) does not wait with it."""
    m, arena = _gated_manager(tmp_path, 5.0)
    put_chunk(m, 0)
    assert GatedTier.entered.wait(10)
    put_chunk(m, 1)
    t0 = time.monotonic()
    put_chunk(m, 2)  # no room: queued past the limit, the caller goes on
    assert time.monotonic() - t0 < 0.2
    threading.Timer(0.3, GatedTier.gate.set).start()  # the slow tier catches up
    assert m.flush(10)
    assert m.stats.get("write_queue.dropped") == 0
    assert m.lower[0].contains([key(i) for i in range(3)]) == [True] * 3
    _close(m, arena)


def test_the_wait_is_bounded(tmp_path):
    """A waiting chunk no writer took within ``write_queue_wait_s`` is dropped (counted), and
    no more than the queue's size again waits at once."""
    m, arena = _gated_manager(tmp_path, 0.3)
    put_chunk(m, 0)
    assert GatedTier.entered.wait(10)
    put_chunk(m, 1)
    t0 = time.monotonic()
    put_chunk(m, 2)  # waits, queued past the limit
    put_chunk(m, 3)  # twice the queue's size: dropped at once
    assert time.monotonic() - t0 < 0.2
    assert m.stats.get("write_queue.dropped") == 1
    time.sleep(0.5)
    GatedTier.gate.set()
    m.flush(10)
    assert m.stats.get("write_queue.dropped") == 2  # chunk 2's wait was over
    assert m.lower[0].contains([key(i) for i in range(3)]) == [True, True, False]
    _close(m, arena)
