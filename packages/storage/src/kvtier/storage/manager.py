"""The tiered StorageManager: host memory first, then any number of lower tiers.

Contract (on top of ``kvtier.core.storage``):

- ``put`` stores into the host tier synchronously and queues the chunk for every lower tier.
  The queue is bounded (``write_queue_size``); when it is full the lower-tier copy is dropped
  and counted (``write_queue.dropped``), after waiting ``write_queue_wait_s`` for room (0 by
  default: the engine is never blocked; a vLLM kv_producer waits, its chunks are another
  instance's input). ``io_threads`` writer
  threads drain it; ``flush(timeout)`` waits for them and says whether everything put since the
  previous flush landed in every lower tier: False when writes are still queued at the timeout
  or when any chunk did not land (a full queue, a tier that skipped it: disk full or unwritable,
  Redis down); ``last_flush`` says what and where. The writer is ``kvtier.storage.writer``;
  building the tiers from the config, ``kvtier.storage.tiers``.
- ``get``/``batched_get``/``get_non_blocking``/``prefetch`` search tiers in order. A hit in a
  lower tier is written back into the host tier on every one of these paths (counted as
  ``writeback.chunks``); host hits are not written back, nor are hits that are host memory
  already (the node tier's shared mappings: ``MemoryObj.borrowed``).
- ``prefetch`` only brings in a contiguous prefix of hits: at the first chunk no tier has, it
  stops, and nothing past it is used or written back.
- ``contains`` asks each tier only for the keys the tiers above it missed; ``prefix_hits`` asks
  each tier only for keys past the prefix already found.
- A lower tier that raises (it should not: see ``backends.base``) is logged and treated as a
  miss; nothing from a lower tier reaches the caller as an exception.
- ``remove`` forgets keys in every tier; ``quarantine(tier, seconds)`` makes every read of a
  tier (lookups, gets, prefetches) a miss for a while (``kvtier.core.verify``: it served wrong
  KV). Writes still reach a quarantined tier.
- ``close`` stops the threads within a bounded time and releases every object held. Queued
  writes, and tiers a dequeued batch did not reach yet, are dropped and counted
  (``write_queue.dropped_at_close``, ``<tier>.dropped_at_close``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from kvtier.core.errors import ClosedError, ConfigError, OutOfHostMemory
from kvtier.core.quarantine import Quarantine
from kvtier.core.storage import StorageManager
from kvtier.storage._log import warn_throttled
from kvtier.storage.backends.base import StorageBackend
from kvtier.storage.backends.local_cpu import LocalCPUBackend
from kvtier.storage.stats import StorageStats
from kvtier.storage.tiers import BACKEND_GROUP, HOST_TIER, build_tiers, load_backend_class
from kvtier.storage.writer import FlushReport, LowerTierWriter

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta

logger = logging.getLogger("kvtier.storage")
T = TypeVar("T")

# Lower-tier reads fetch at most this many chunks per round trip when prefetching, so a long
# prefix does not pull gigabytes into one pipeline before any of it is usable.
_PREFETCH_BATCH = 8

__all__ = [
    "BACKEND_GROUP",
    "HOST_TIER",
    "FlushReport",
    "TieredStorageManager",
    "build_tiers",
    "load_backend_class",
    "tiered_storage_manager",
]


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
        write_queue_wait_s: float = 0.0,
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
        self._writer = LowerTierWriter(
            self.lower,
            stats,
            queue_size=write_queue_size,
            threads=io_threads,
            wait_s=write_queue_wait_s,
        )
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-reader")
        self.quarantined = Quarantine()

    def readable(self, tiers: Sequence[StorageBackend]) -> list[StorageBackend]:
        """``tiers`` without the quarantined ones (what every read path asks)."""
        return [t for t in tiers if not self.quarantined.blocked(t.name)]

    @property
    def last_flush(self) -> FlushReport:
        """What the latest ``flush`` found (a ``FlushReport``; empty before the first)."""
        return self._writer.last_flush

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, meta: MemoryObjMeta) -> MemoryObj | None:
        return self.arena.allocate_evicting(meta, self.host.evict_one)

    def drop_host(self) -> int:
        return self.host.clear()

    def watch_host_removals(self, listener: Callable[[list[ChunkKey]], None]) -> bool:
        self.host.watch_key_removals(listener)
        return True

    def watch_tiers(self, listener: Callable[[str, list[str], list[str]], None]) -> bool:
        """Call ``listener(tier, stored, dropped)`` (key digests) when a lower tier has written
        chunks or dropped them (tiers that can tell)."""
        self._writer.watch(listener)
        for tier in self.lower:
            tier.watch_removals(partial(_dropped_from, listener, tier.name))
        return True

    def _allocate_for_read(self, meta: MemoryObjMeta) -> MemoryObj | None:
        try:
            return self.allocate(meta)
        except OutOfHostMemory as e:
            warn_throttled(
                "alloc-too-big", "kvtier: a stored chunk does not fit the host arena: %s", e
            )
            return None

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: ChunkKey, obj: MemoryObj) -> None:
        self._check_open()
        self.host.batched_put([(key, obj)])
        self.stats.add("put.chunks")
        if not self.lower:
            return
        self._writer.submit(key, obj)

    def put_with_aliases(
        self, key: ChunkKey, obj: MemoryObj, aliases: Sequence[tuple[ChunkKey, MemoryObj]]
    ) -> None:
        """``put`` a chunk and its alias entries: all into the host tier now, and to the lower
        tiers as one queued write (aliases never take queue room from chunks)."""
        self._check_open()
        self.host.put_chunk(key, obj, aliases)
        self.stats.add("put.chunks")
        if aliases:
            self.stats.add("put.aliases", len(aliases))
        if not self.lower:
            return
        self._writer.submit(key, obj, aliases)

    def put_last(self, key: ChunkKey, obj: MemoryObj) -> None:
        self._check_open()
        self.host.batched_put([(key, obj)])
        if self.lower:
            self._writer.submit_last(key, obj)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (up to ``timeout`` s) for queued lower-tier writes; True only if all of them are
        done and every chunk put since the previous flush landed in every lower tier. The
        details are in ``last_flush`` (a ``FlushReport``) and in a warning."""
        return bool(self._writer.flush(timeout))

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
        for tier in self.readable(self.tiers):
            if not unknown:
                break
            sub = [keys[i] for i in unknown]
            hits = self._tier_call(
                tier, "contains", partial(tier.contains, sub), [False] * len(sub)
            )
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
            for tier in self.readable(self.tiers):
                run = self._prefix_length(tier, keys[pos:])
                if run:
                    break
            if not run:
                break
            pos += run
        return pos

    def _lower_get(self, tier: StorageBackend, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        miss: list[MemoryObj | None] = [None] * len(keys)
        return self._tier_call(
            tier, "get", partial(tier.batched_get, keys, self._allocate_for_read), miss
        )

    def _write_back(self, tier: StorageBackend, items: list[tuple[ChunkKey, MemoryObj]]) -> None:
        """Count ``tier``'s hits and keep them in the host tier; hits that are host memory
        already (borrowed objects: the node tier's shared mappings) are not copied into it."""
        if items:
            self.stats.add_entries(tier.name, "hits", (key for key, _ in items))
            back = [(key, obj) for key, obj in items if obj.arena is not None]
            if back:
                self.host.batched_put(back)
                self.stats.add("writeback.chunks", len(back))

    def batched_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        self._check_open()
        result = self.host_get(keys)
        missing = [i for i, obj in enumerate(result) if obj is None]
        self.stats.add_entries(
            self.host.name,
            "hits",
            (k for k, obj in zip(keys, result, strict=True) if obj is not None),
        )
        for tier in self.readable(self.lower):
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

    def host_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Objects the host tier holds for ``keys`` (no lower tier is asked)."""
        self._check_open()
        if self.quarantined.blocked(self.host.name):
            return [None] * len(keys)
        return self.host.batched_get(keys)

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
            run = 0
            if not self.quarantined.blocked(self.host.name):
                run = self._prefix_length(self.host, keys[pos:])
            if not run:
                for tier in self.readable(self.lower):
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

    # -- verification ------------------------------------------------------------------------
    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Forget ``keys`` in every tier (a tier that fails is logged; its copy ages out)."""
        self._check_open()
        for tier in self.tiers:
            self._tier_call(tier, "remove", partial(tier.remove, list(keys)), None)

    def quarantine(self, tier: str, seconds: float) -> None:
        self.quarantined.add(tier, seconds)

    # -- lifecycle -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the kvtier storage manager is closed: this call came after close()")

    def close(self) -> None:
        """Stop writers and readers (bounded by ``close_timeout_s``) and release every object.

        Writes still queued are dropped (call ``flush`` first to keep them).
        """
        if self._closed:
            return
        self._closed = True
        self._writer.stop(time.monotonic() + self._close_timeout_s)
        # In-flight reads finish within their tiers' timeouts; they must not write back into a
        # host tier that is already closed.
        self._readers.shutdown(wait=True, cancel_futures=True)
        for tier in reversed(self.tiers):
            try:
                tier.close()
            except Exception:
                logger.exception("kvtier: tier %s failed to close", tier.name)
        alive = self._writer.busy_threads()
        if alive:
            logger.warning(
                "kvtier: writer threads %s still busy after close; they exit after their "
                "current write",
                alive,
            )


def tiered_storage_manager(
    *, config: KVTierConfig, arena: HostArena, layout: KVLayout, namespace: str
) -> TieredStorageManager:
    """The manager for ``config.tiers`` (entry point ``kvtier.storage:manager``)."""
    stats = StorageStats()
    tiers = build_tiers(config, arena, layout, namespace, stats)
    return TieredStorageManager(
        tiers,
        arena=arena,
        stats=stats,
        write_queue_size=config.write_queue_size,
        io_threads=config.io_threads,
        close_timeout_s=max(5.0, config.redis_timeout_s + config.redis_connect_timeout_s + 1.0),
        write_queue_wait_s=config.write_queue_wait_s,
    )


def _dropped_from(
    listener: Callable[[str, list[str], list[str]], None], tier: str, digests: list[str]
) -> None:
    listener(tier, [], digests)
