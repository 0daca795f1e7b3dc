"""Hand-over receipts (``kvtier.core.keys.receipts``): a record that reaches each lower tier only after
every chunk put before it landed there or was dropped, so a consumer that finds it finds every
chunk its producer wrote."""

from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st
from storage_helpers import KEYS, key, put_chunk
from test_acknowledged import build

from kvtier.core.keys.receipts import has_receipt, receipt_id, write_receipt
from kvtier.storage.backends.disk.local_disk import LocalDiskBackend
from kvtier.storage.backends.local_cpu import LocalCPUBackend


class SlowChunksTier(LocalDiskBackend):
    """A real disk tier whose chunk writes wait for a gate; small records pass at once."""

    name = "slow_chunks"
    gate = threading.Event()
    entered = threading.Semaphore(0)

    def batched_put(self, items):
        if any(not k.is_alias for k, _ in items):
            self.entered.release()
            assert self.gate.wait(30)
        return super().batched_put(items)


def _manager(tmp_path, **kw):
    SlowChunksTier.gate.clear()
    SlowChunksTier.entered = threading.Semaphore(0)
    return build(tmp_path, [LocalCPUBackend, SlowChunksTier], **kw)


def _in_lower(m, receipt: bytes) -> bool:
    return m.lower[0].contains([KEYS.alias_key(receipt)])[0]


def test_a_receipt_lands_after_every_chunk_put_before_it(tmp_path):
    """Two chunks are being written by two writer threads when the receipt is put; a third
    writer takes the receipt and waits for both (a plain ``put`` would land it first)."""
    m, _ = _manager(tmp_path, io_threads=4)
    receipt = receipt_id("engine", "request-1")
    try:
        put_chunk(m, 0)
        assert SlowChunksTier.entered.acquire(timeout=10)
        put_chunk(m, 1)
        assert SlowChunksTier.entered.acquire(timeout=10)  # both chunks held by writers
        assert write_receipt(m, KEYS, receipt)
        assert has_receipt(m, KEYS, receipt)  # the producer's own host memory has it at once
        time.sleep(0.3)
        assert not _in_lower(m, receipt), "the receipt overtook chunks still being written"
        SlowChunksTier.gate.set()
        assert m.flush(10)
        assert m.lower[0].contains([key(0), key(1)]) == [True, True]
        assert _in_lower(m, receipt)
    finally:
        SlowChunksTier.gate.set()
        m.close()


def test_a_dropped_chunk_does_not_hold_the_receipt_back(tmp_path):
    """A chunk the full queue dropped is done: the receipt follows the chunks that were
    written, and is itself always admitted (one small record per request)."""
    m, _ = _manager(tmp_path, io_threads=1, write_queue_size=1)
    receipt = receipt_id("engine", "request-2")
    try:
        put_chunk(m, 0)
        assert SlowChunksTier.entered.acquire(timeout=10)  # the writer holds chunk 0
        put_chunk(m, 1)  # queued
        put_chunk(m, 2)  # no room: dropped
        assert write_receipt(m, KEYS, receipt)  # queued although the queue is full
        assert m.stats.get("write_queue.dropped") == 1
        SlowChunksTier.gate.set()
        m.flush(10)
        assert m.lower[0].contains([key(0), key(1), key(2)]) == [True, True, False]
        assert _in_lower(m, receipt)
    finally:
        SlowChunksTier.gate.set()
        m.close()


def test_close_lets_a_waiting_receipt_go(tmp_path):
    """``close`` while a receipt waits for a chunk stuck in a slow tier: nothing hangs."""
    m, _ = _manager(tmp_path, io_threads=2, close_timeout_s=0.5)
    put_chunk(m, 0)
    assert SlowChunksTier.entered.acquire(timeout=10)
    assert write_receipt(m, KEYS, receipt_id("engine", "request-3"))
    t0 = time.monotonic()
    m.close()
    assert time.monotonic() - t0 < 5
    SlowChunksTier.gate.set()


def test_no_receipt_is_found_for_another_request(tmp_path):
    m, _ = _manager(tmp_path)
    try:
        assert write_receipt(m, KEYS, receipt_id("engine", "a"))
        assert not has_receipt(m, KEYS, receipt_id("engine", "b"))
        assert not has_receipt(m, KEYS, receipt_id("other-engine", "a"))
    finally:
        SlowChunksTier.gate.set()
        m.close()


@given(st.text(), st.text(), st.text(), st.text())
def test_receipts_name_the_engine_and_the_request(e1, r1, e2, r2):
    same = receipt_id(e1, r1) == receipt_id(e2, r2)
    assert same == ((e1, r1) == (e2, r2))
    assert len(receipt_id(e1, r1)) == 16
