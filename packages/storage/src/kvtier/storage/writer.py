"""The lower-tier writer: chunks put into host memory are copied down to every lower tier by
background threads, through a bounded queue, and ``flush`` reports what did not land.

- ``submit`` never blocks: when the queue (``write_queue_size``) is full the lower-tier copy is
  dropped and counted (``write_queue.dropped``). With ``write_queue_wait_s`` (a prefill
  producer's, whose chunks another instance waits for) it is queued past the limit instead, up
  to as many again, and dropped (counted the same) if no writer has taken it when its wait is
  over: the caller (the worker's saver thread, which gates block frees and save reports) never
  waits on a lower tier. A chunk's alias entries (``kvtier.core.keys.aliases``)
  ride in its queue slot and are written with it; counters count chunks, not aliases.
- Each writer thread takes up to ``_WRITE_BATCH`` queued chunks and hands them to every lower
  tier in order; a tier that raises is counted (``<tier>.errors``, ``<tier>.write_failed``) and
  the others still get the batch.
- ``submit_last`` queues an entry written only after every entry submitted before it is done
  (written to every lower tier, or dropped): a kv_producer's hand-over receipt
  (``kvtier.core.keys.receipts``), which tells a consumer that nothing more is coming. It is always
  admitted (a small record, one per request) and not counted as a chunk.
- ``flush`` waits for the queue to drain and compares the loss counters (``_LOSS_SUFFIXES``,
  ``_LOSS_NAMES``) with their values at the previous flush.
- ``close`` stops the threads; queued chunks, and tiers a dequeued batch did not reach yet, are
  dropped and counted (``write_queue.dropped_at_close``, ``<tier>.dropped_at_close``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.core.affinity import background
from kvtier.storage._log import warn_throttled

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj
    from kvtier.storage.backends.base import StorageBackend
    from kvtier.storage.stats import StorageStats

logger = logging.getLogger("kvtier.storage")

# Writers take up to this many queued chunks at once (one pipeline / one pass per tier).
_WRITE_BATCH = 8
_POLL_S = 0.05

# Counters of chunks that did not land in a lower tier (``<tier>.<suffix>`` or a full name).
_LOSS_SUFFIXES = (".store_skipped", ".write_failed", ".dropped_at_close")
_LOSS_NAMES = ("write_queue.dropped",)


@dataclass(eq=False)
class _Entry:
    seq: int  # submission order
    deadline: float | None  # dropped if still queued after this (monotonic); None: never
    group: list[tuple[ChunkKey, MemoryObj]]  # a chunk then its alias entries, or one record
    last: bool = False  # written only once every entry submitted before it is done


def _is_loss(name: str) -> bool:
    return name in _LOSS_NAMES or name.endswith(_LOSS_SUFFIXES)


@dataclass(frozen=True)
class FlushReport:
    """What one ``flush`` found. ``pending``: writes still queued or in flight when it returned;
    ``not_stored``: chunks that did not land since the previous flush, by counter name
    (``local_disk.store_skipped``, ``redis.store_skipped``, ``write_queue.dropped``, ...).
    True when everything landed."""

    pending: int = 0
    not_stored: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.pending == 0 and not self.not_stored


class LowerTierWriter:
    """Writes submitted chunks to ``lower`` on ``threads`` threads. See the module docstring."""

    def __init__(
        self,
        lower: Sequence[StorageBackend],
        stats: StorageStats,
        *,
        queue_size: int,
        threads: int,
        wait_s: float = 0.0,
    ) -> None:
        """``wait_s``: how long a chunk submitted to a full queue may wait for a writer before it
        is dropped (0: dropped at once)."""
        self.lower = list(lower)
        self.wait_s = wait_s
        self.stats = stats
        self._capacity = queue_size
        # One entry per chunk (the chunk first, then its alias entries), with the monotonic time
        # after which it is dropped if still queued (None: written whenever its turn comes).
        self._queue: queue.Queue[_Entry] = queue.Queue()
        self._queued = 0  # chunk entries in ``_queue`` (under ``_pending_cv``)
        self._seq = 0
        self._open: set[int] = set()  # entries submitted and not yet done (under ``_pending_cv``)
        self._pending_cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._flush_lock = threading.Lock()
        self._loss_base = {n: v for n, v in stats.snapshot().items() if _is_loss(n)}
        self.last_flush = FlushReport()
        self._listeners: list[Callable[[str, list[str], list[str]], None]] = []
        if self.lower:
            for i in range(threads):
                # off the forward pass's cores where vLLM bound them: nothing waits on a writer
                t = threading.Thread(
                    target=background(self._run), name=f"kvtier-writer-{i}", daemon=True
                )
                t.start()
                self._threads.append(t)

    def watch(self, listener: Callable[[str, list[str], list[str]], None]) -> None:
        """Call ``listener(tier, stored_digests, [])`` after each write with the chunks the tier
        holds now (it is asked: a tier may skip a chunk without raising)."""
        self._listeners.append(listener)

    def submit(
        self,
        key: ChunkKey,
        obj: MemoryObj,
        aliases: Sequence[tuple[ChunkKey, MemoryObj]] = (),
    ) -> None:
        """Queue a share of ``obj`` (and of its ``aliases``' objects) for the lower tiers, or
        drop them (counted as one chunk) when the queue is full (see the module docstring).
        Never blocks."""
        deadline: float | None = None
        with self._pending_cv:
            full = self._queued >= self._capacity
            if full and (self.wait_s <= 0 or self._queued >= 2 * self._capacity):
                admitted = False
            else:
                admitted = True
                deadline = time.monotonic() + self.wait_s if full else None
                self._queued += 1
                seq = self._admit()
        if not admitted:
            self._dropped()
            return
        mine = [(key, obj.share())] + [(k, o.share()) for k, o in aliases]
        self._queue.put_nowait(_Entry(seq, deadline, mine))

    def submit_last(self, key: ChunkKey, obj: MemoryObj) -> None:
        """Queue ``obj`` to be written once every entry submitted before it is done (see the
        module docstring). Never blocks."""
        with self._pending_cv:
            seq = self._admit()
        self._queue.put_nowait(_Entry(seq, None, [(key, obj.share())], last=True))

    def _admit(self) -> int:
        """A new entry's sequence number (under ``_pending_cv``)."""
        seq, self._seq = self._seq, self._seq + 1
        self._open.add(seq)
        return seq

    def _dropped(self) -> None:
        self.stats.add("write_queue.dropped")
        warn_throttled(
            "write-queue-full",
            "kvtier: lower-tier write queue is full (write_queue_size=%d); chunks are kept in "
            "host memory only",
            self._capacity,
        )

    def _done(self, entries: Sequence[_Entry]) -> None:
        with self._pending_cv:
            self._open.difference_update(e.seq for e in entries)
            self._pending_cv.notify_all()

    def _next_batch(self) -> list[_Entry]:
        """Up to ``_WRITE_BATCH`` queued entries; chunks whose wait is over are dropped."""
        try:
            entries = [self._queue.get(timeout=_POLL_S)]
        except queue.Empty:
            return []
        while len(entries) < _WRITE_BATCH:
            try:
                entries.append(self._queue.get_nowait())
            except queue.Empty:
                break
        with self._pending_cv:
            self._queued -= sum(not e.last for e in entries)
        now = time.monotonic()
        expired = [e for e in entries if e.deadline is not None and now > e.deadline]
        for e in expired:
            for _, obj in e.group:
                obj.release()
            self._dropped()
        if expired:
            self._done(expired)
        return [e for e in entries if e.deadline is None or now <= e.deadline]

    def _wait_for_earlier(self, entry: _Entry) -> None:
        """Until every entry submitted before ``entry`` is done (they are all taken by writer
        threads already, which never wait on a later entry), or the writer stops."""
        with self._pending_cv:
            while min(self._open, default=entry.seq) < entry.seq and not self._stop.is_set():
                self._pending_cv.wait(_POLL_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._next_batch()
            # Runs of the batch, each ``last`` entry starting one: it waits for the run before.
            runs: list[list[_Entry]] = []
            for e in batch:
                if e.last or not runs:
                    runs.append([])
                runs[-1].append(e)
            for run in runs:
                if run[0].last:
                    self._wait_for_earlier(run[0])
                items = [item for e in run for item in e.group]
                try:
                    for tier in self.lower:
                        self._write(tier, items, sum(not e.last for e in run))
                finally:
                    for _, obj in items:
                        obj.release()
                    self._done(run)

    def _write(
        self, tier: StorageBackend, batch: list[tuple[ChunkKey, MemoryObj]], chunks: int
    ) -> None:
        """Write ``batch`` (``chunks`` chunks and their aliases) to ``tier``."""
        if self._stop.is_set():
            self.stats.add(f"{tier.name}.dropped_at_close", chunks)
            return
        try:
            tier.batched_put(batch)
            self.stats.add(f"{tier.name}.put_calls")
            if self._listeners:
                keys = [k for k, _ in batch]
                landed = [k.digest() for k, ok in zip(keys, tier.contains(keys), strict=True) if ok]
                for listener in self._listeners:
                    listener(tier.name, landed, [])
        except Exception:
            self.stats.add(f"{tier.name}.errors")
            self.stats.add(f"{tier.name}.write_failed", chunks)
            logger.exception("kvtier: tier %s failed a write; chunks skipped", tier.name)

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait (up to ``timeout`` s) for queued writes; what is still pending and what did not
        land since the previous flush (also kept in ``last_flush`` and logged)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._flush_lock:
            with self._pending_cv:
                while self._open:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._pending_cv.wait(left)
                pending = len(self._open)
            now = {n: v for n, v in self.stats.snapshot().items() if _is_loss(n)}
            lost = {
                n: v - self._loss_base.get(n, 0)
                for n, v in now.items()
                if v != self._loss_base.get(n, 0)
            }
            self._loss_base = now
            report = FlushReport(pending, lost)
            self.last_flush = report
        if pending:
            logger.warning(
                "kvtier: flush timed out with %d lower-tier write(s) still queued", pending
            )
        if lost:
            logger.warning(
                "kvtier: flush: chunks not stored in a lower tier since the last flush: %s",
                ", ".join(f"{n}={v}" for n, v in sorted(lost.items())),
            )
        return report

    def stop(self, deadline: float) -> None:
        """Stop the threads (waiting until the monotonic ``deadline``) and drop what is queued."""
        self._stop.set()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        left: list[_Entry] = []
        while True:
            try:
                left.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for e in left:
            for _, obj in e.group:
                obj.release()
        self._done(left)
        dropped = sum(not e.last for e in left)
        if dropped:
            self.stats.add("write_queue.dropped_at_close", dropped)
            logger.warning(
                "kvtier: close dropped %d queued lower-tier write(s); call flush() "
                "before close() to keep them",
                dropped,
            )

    def busy_threads(self) -> list[str]:
        """Names of writer threads still running (after ``stop``: finishing their current write)."""
        return [t.name for t in self._threads if t.is_alive()]
