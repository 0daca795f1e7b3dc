"""The tiered StorageManager: host memory first, then any number of lower tiers.

Contract (on top of ``kvtier.core.storage``):

- ``put`` stores into the host tier synchronously and queues the chunk for every lower tier.
  The queue is bounded (``write_queue_size``); when it is full the lower-tier copy is dropped
  and counted (``write_queue.dropped``): the engine is never blocked. ``io_threads`` writer
  threads drain it; ``flush(timeout)`` waits for them and says whether everything put since the
  previous flush landed in every lower tier: False when writes are still queued at the timeout
  or when any chunk did not land (a full queue, a tier that skipped it: disk full or unwritable,
  Redis down); ``last_flush`` says what and where.
- ``get``/``batched_get``/``get_non_blocking``/``prefetch`` search tiers in order. A hit in a
  lower tier is written back into the host tier on every one of these paths (counted as
  ``writeback.chunks``); host hits are not written back.
- ``prefetch`` only brings in a contiguous prefix of hits: at the first chunk no tier has, it
  stops, and nothing past it is used or written back.
- ``contains`` asks each tier only for the keys the tiers above it missed; ``prefix_hits`` asks
  each tier only for keys past the prefix already found.
- A lower tier that raises (it should not: see ``backends.base``) is logged and treated as a
  miss; nothing from a lower tier reaches the caller as an exception.
- ``close`` stops the threads within a bounded time and releases every object held. Queued
  writes, and tiers a dequeued batch did not reach yet, are dropped and counted
  (``write_queue.dropped_at_close``, ``<tier>.dropped_at_close``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from kvtier.core.errors import ConfigError, OutOfHostMemory
from kvtier.core.platform import load_object, plugin_entry_points
from kvtier.core.storage import StorageManager
from kvtier.storage._log import warn_throttled
from kvtier.storage.backends.base import BackendContext, StorageBackend
from kvtier.storage.backends.local_cpu import LocalCPUBackend
from kvtier.storage.sealing import Sealer
from kvtier.storage.stats import StorageStats

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta

logger = logging.getLogger("kvtier.storage")
T = TypeVar("T")

BACKEND_GROUP = "kvtier.backends"
HOST_TIER = "local_cpu"
# Lower-tier reads fetch at most this many chunks per round trip when prefetching, so a long
# prefix does not pull gigabytes into one pipeline before any of it is usable.
_PREFETCH_BATCH = 8
# Writers take up to this many queued chunks at once (one pipeline / one pass per tier).
_WRITE_BATCH = 8
_POLL_S = 0.05


# Counters of chunks that did not land in a lower tier (``<tier>.<suffix>`` or a full name).
_LOSS_SUFFIXES = (".store_skipped", ".write_failed", ".dropped_at_close")
_LOSS_NAMES = ("write_queue.dropped",)


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


def load_backend_class(name: str, allow: Sequence[str] | None = None) -> type[StorageBackend]:
    """The backend class registered as ``name`` in the ``kvtier.backends`` group."""
    eps = {ep.name: ep for ep in plugin_entry_points(BACKEND_GROUP, allow)}
    if name not in eps:
        hint = " (it is not in the plugins allow-list)" if allow else ""
        raise ConfigError(
            "tiers", name,
            f"no storage backend named {name!r}{hint}; installed: {', '.join(sorted(eps)) or 'none'}",
        )
    cls = load_object(eps[name].value)
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ConfigError("tiers", name, f"backend {name!r} points at {eps[name].value!r}, not a StorageBackend")
    return cls


class TieredStorageManager(StorageManager):
    """An ordered list of tiers whose first is the host-memory tier. See the module docstring."""

    def __init__(
        self,
        tiers: Sequence[StorageBackend],
        *,
        arena: HostArena,
        stats: StorageStats,
        write_queue_size: int = 256,
        io_threads: int = 4,
        close_timeout_s: float = 5.0,
    ) -> None:
        if not tiers or not isinstance(tiers[0], LocalCPUBackend):
            raise ConfigError("tiers", [t.name for t in tiers], f"must start with {HOST_TIER!r}")
        self.arena = arena
        self.stats = stats
        self.host: LocalCPUBackend = tiers[0]
        self.lower: list[StorageBackend] = list(tiers[1:])
        self.tiers: list[StorageBackend] = list(tiers)
        self._close_timeout_s = close_timeout_s
        self._closed = False
        self._queue: queue.Queue[tuple[ChunkKey, MemoryObj]] = queue.Queue(maxsize=write_queue_size)
        self._pending = 0
        self._pending_cv = threading.Condition()
        self._stop = threading.Event()
        self._writers: list[threading.Thread] = []
        self._flush_lock = threading.Lock()
        self._loss_base = {n: v for n, v in stats.snapshot().items() if _is_loss(n)}
        self.last_flush = FlushReport()
        if self.lower:
            for i in range(io_threads):
                t = threading.Thread(target=self._writer, name=f"kvtier-writer-{i}", daemon=True)
                t.start()
                self._writers.append(t)
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-reader")

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, meta: MemoryObjMeta) -> MemoryObj | None:
        return self.arena.allocate_evicting(meta, self.host.evict_one)

    def drop_host(self) -> int:
        return self.host.clear()

    def _allocate_for_read(self, meta: MemoryObjMeta) -> MemoryObj | None:
        try:
            return self.allocate(meta)
        except OutOfHostMemory as e:
            warn_throttled("alloc-too-big", "kvtier: a stored chunk does not fit the host arena: %s", e)
            return None

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: ChunkKey, obj: MemoryObj) -> None:
        self._check_open()
        self.host.batched_put([(key, obj)])
        self.stats.add("put.chunks")
        if not self.lower:
            return
        mine = obj.share()
        with self._pending_cv:
            self._pending += 1
        try:
            self._queue.put_nowait((key, mine))
        except queue.Full:
            mine.release()
            self._done_pending(1)
            self.stats.add("write_queue.dropped")
            warn_throttled(
                "write-queue-full",
                "kvtier: lower-tier write queue is full (write_queue_size=%d); chunks are kept in "
                "host memory only",
                self._queue.maxsize,
            )

    def _done_pending(self, n: int) -> None:
        with self._pending_cv:
            self._pending -= n
            if self._pending == 0:
                self._pending_cv.notify_all()

    def _writer(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < _WRITE_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                for tier in self.lower:
                    if self._stop.is_set():
                        self.stats.add(f"{tier.name}.dropped_at_close", len(batch))
                        continue
                    try:
                        tier.batched_put(batch)
                        self.stats.add(f"{tier.name}.put_calls")
                    except Exception:
                        self.stats.add(f"{tier.name}.errors")
                        self.stats.add(f"{tier.name}.write_failed", len(batch))
                        logger.exception("kvtier: tier %s failed a write; chunks skipped", tier.name)
            finally:
                for _, obj in batch:
                    obj.release()
                self._done_pending(len(batch))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (up to ``timeout`` s) for queued lower-tier writes; True only if all of them are
        done and every chunk put since the previous flush landed in every lower tier. The
        details are in ``last_flush`` (a ``FlushReport``) and in a warning."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._flush_lock:
            with self._pending_cv:
                while self._pending:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._pending_cv.wait(left)
                pending = self._pending
            now = {n: v for n, v in self.stats.snapshot().items() if _is_loss(n)}
            lost = {n: v - self._loss_base.get(n, 0) for n, v in now.items()
                    if v != self._loss_base.get(n, 0)}
            self._loss_base = now
            report = FlushReport(pending, lost)
            self.last_flush = report
        if pending:
            logger.warning("kvtier: flush timed out with %d lower-tier write(s) still queued", pending)
        if lost:
            logger.warning("kvtier: flush: chunks not stored in a lower tier since the last flush: %s",
                           ", ".join(f"{n}={v}" for n, v in sorted(lost.items())))
        return bool(report)

    # -- lookups -------------------------------------------------------------------------------
    def _tier_call(self, tier: StorageBackend, what: str, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except Exception:
            self.stats.add(f"{tier.name}.errors")
            logger.exception("kvtier: tier %s failed %s; treated as a miss", tier.name, what)
            return default

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        found = [False] * len(keys)
        unknown = list(range(len(keys)))
        for tier in self.tiers:
            if not unknown:
                break
            sub = [keys[i] for i in unknown]
            hits = self._tier_call(tier, "contains", partial(tier.contains, sub), [False] * len(sub))
            still = []
            for i, hit in zip(unknown, hits, strict=True):
                if hit:
                    found[i] = True
                else:
                    still.append(i)
            unknown = still
        return found

    def _prefix_length(self, tier: StorageBackend, keys: Sequence[ChunkKey]) -> int:
        return self._tier_call(tier, "prefix lookup", partial(tier.prefix_length, keys), 0)

    def prefix_hits(self, keys: Sequence[ChunkKey]) -> int:
        self._check_open()
        pos = 0
        while pos < len(keys):
            run = 0
            for tier in self.tiers:
                run = self._prefix_length(tier, keys[pos:])
                if run:
                    break
            if not run:
                break
            pos += run
        return pos

    def _lower_get(self, tier: StorageBackend, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        miss: list[MemoryObj | None] = [None] * len(keys)
        return self._tier_call(tier, "get", partial(tier.batched_get, keys, self._allocate_for_read), miss)

    def _write_back(self, tier: StorageBackend, items: list[tuple[ChunkKey, MemoryObj]]) -> None:
        if items:
            self.host.batched_put(items)
            self.stats.add(f"{tier.name}.hits", len(items))
            self.stats.add("writeback.chunks", len(items))

    def batched_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        self._check_open()
        result = self.host.batched_get(keys)
        missing = [i for i, obj in enumerate(result) if obj is None]
        self.stats.add(f"{self.host.name}.hits", len(keys) - len(missing))
        for tier in self.lower:
            if not missing:
                break
            got = self._lower_get(tier, [keys[i] for i in missing])
            back: list[tuple[ChunkKey, MemoryObj]] = []
            still: list[int] = []
            for i, obj in zip(missing, got, strict=True):
                if obj is None:
                    still.append(i)
                else:
                    result[i] = obj
                    back.append((keys[i], obj))
            self._write_back(tier, back)
            missing = still
        self.stats.add("misses", len(missing))
        return result

    def get_non_blocking(self, key: ChunkKey) -> Future[MemoryObj | None]:
        """A future of ``get(key)`` run on a reader thread (write-back included).

        The caller owns the handle the future resolves to; a future that is never read leaks
        it, so cancel-or-read every future you take.
        """
        self._check_open()
        return self._readers.submit(self.get, key)

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[int]:
        """Bring the contiguous hit prefix of ``keys`` into host memory, on a reader thread.

        Resolves to the length of that prefix. Chunks past the first one that no tier holds
        are neither read nor written back.
        """
        self._check_open()
        return self._readers.submit(self._prefetch, list(keys))

    def _prefetch(self, keys: list[ChunkKey]) -> int:
        pos = 0
        while pos < len(keys) and not self._closed:
            run = self._prefix_length(self.host, keys[pos:])
            if not run:
                for tier in self.lower:
                    run = self._fetch_run(tier, keys[pos:])
                    if run:
                        break
            if not run:
                break
            pos += run
        self.stats.add("prefetch.chunks", pos)
        return pos

    def _fetch_run(self, tier: StorageBackend, keys: Sequence[ChunkKey]) -> int:
        """Read the run of ``keys`` that ``tier`` holds from the first, write it back; its length."""
        run = self._prefix_length(tier, keys[:_PREFETCH_BATCH])
        if not run:
            return 0
        objs = self._lower_get(tier, keys[:run])
        back: list[tuple[ChunkKey, MemoryObj]] = []
        for key, obj in zip(keys, objs, strict=False):
            if obj is None:
                break
            back.append((key, obj))
        try:
            self._write_back(tier, back)
        finally:
            for obj in objs:
                if obj is not None:
                    obj.release()
        return len(back)

    # -- lifecycle -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("kvtier storage manager is closed")

    def close(self) -> None:
        """Stop writers and readers (bounded by ``close_timeout_s``) and release every object.

        Writes still queued are dropped (call ``flush`` first to keep them).
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = time.monotonic() + self._close_timeout_s
        for t in self._writers:
            t.join(max(0.0, deadline - time.monotonic()))
        dropped = 0
        while True:
            try:
                _, obj = self._queue.get_nowait()
            except queue.Empty:
                break
            obj.release()
            dropped += 1
        if dropped:
            self._done_pending(dropped)
            self.stats.add("write_queue.dropped_at_close", dropped)
            logger.warning("kvtier: close dropped %d queued lower-tier write(s); call flush() "
                           "before close() to keep them", dropped)
        # In-flight reads finish within their tiers' timeouts; they must not write back into a
        # host tier that is already closed.
        self._readers.shutdown(wait=True, cancel_futures=True)
        for tier in reversed(self.tiers):
            try:
                tier.close()
            except Exception:
                logger.exception("kvtier: tier %s failed to close", tier.name)
        alive = [t.name for t in self._writers if t.is_alive()]
        if alive:
            logger.warning("kvtier: writer threads %s still busy after close; they exit after their "
                           "current write", alive)


def build_tiers(
    config: KVTierConfig, arena: HostArena, layout: KVLayout, namespace: str, stats: StorageStats
) -> list[StorageBackend]:
    if not config.tiers or config.tiers[0] != HOST_TIER:
        raise ConfigError(
            "tiers", config.tiers,
            f"must start with {HOST_TIER!r}: every chunk passes through host memory",
        )
    key = config.encryption_key_bytes()
    sealer = Sealer(key) if key is not None else None
    built: list[StorageBackend] = []
    try:
        for name in config.tiers:
            cls = load_backend_class(name, config.plugins)
            if sealer is not None and not (cls.keeps_host_objects or cls.seals_payloads):
                raise ConfigError(
                    "encryption_key", "***",
                    f"the {name!r} tier cannot seal its payloads yet: payloads would leave the "
                    f"process unencrypted; remove {name!r} from tiers or unset the key",
                )
            ctx = BackendContext(
                config=config, layout=layout, namespace=namespace, arena=arena, stats=stats,
                options=dict(config.backend_options.get(name, {})), sealer=sealer,
            )
            built.append(cls(ctx))
    except BaseException:
        for tier in built:
            tier.close()
        raise
    return built


def create_storage_manager(
    *, config: KVTierConfig, arena: HostArena, layout: KVLayout, namespace: str
) -> TieredStorageManager:
    """The manager for ``config.tiers`` (entry point ``kvtier.storage:manager``)."""
    stats = StorageStats()
    tiers = build_tiers(config, arena, layout, namespace, stats)
    return TieredStorageManager(
        tiers, arena=arena, stats=stats, write_queue_size=config.write_queue_size,
        io_threads=config.io_threads,
        close_timeout_s=max(5.0, config.redis_timeout_s + config.redis_connect_timeout_s + 1.0),
    )
