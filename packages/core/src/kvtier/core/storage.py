"""The interface the CacheEngine stores through, and a host-memory-only implementation.

The tiered implementation (host memory, disk, Redis, ...) lives in kvtier-storage and is found
through the ``kvtier.storage`` entry-point group (name ``manager``); ``storage_manager_for``
falls back to ``HostMemoryStorageManager`` when kvtier-storage is not installed and only the
``local_cpu`` tier is configured.

Ownership contract (all implementations):
- ``allocate`` returns a new handle owned by the caller.
- ``put(key, obj)`` takes its *own* share of ``obj``; the caller still owns (and releases) its
  handle.
- ``get``/``batched_get`` return new handles owned by the caller (release them); an object a
  reader holds is never freed or reused under it, even if its tier evicts the key.
- No method raises because a tier is slow or down: that is a miss. Only programming errors raise.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.core.memory.lru import HostObjectLRU
from kvtier.core.platform import load_object, plugin_entry_points
from kvtier.core.quarantine import Quarantine

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.layout import KVLayout

logger = logging.getLogger("kvtier")

STORAGE_GROUP = "kvtier.storage"
HOST_TIER = "local_cpu"


def count_leading(hits: Iterable[bool]) -> int:
    """Length of the run of True at the start of ``hits``."""
    n = 0
    for hit in hits:
        if not hit:
            break
        n += 1
    return n


class StorageManager(ABC):
    """Where chunks are kept. See the module docstring for who owns what."""

    @abstractmethod
    def allocate(self, meta: MemoryObjMeta) -> MemoryObj | None:
        """A host object for ``meta``, evicting cold host-tier entries if needed; None if full."""

    @abstractmethod
    def put(self, key: ChunkKey, obj: MemoryObj) -> None:
        """Keep ``obj`` under ``key`` (host tier now, lower tiers asynchronously)."""

    def put_with_aliases(
        self, key: ChunkKey, obj: MemoryObj, aliases: Sequence[tuple[ChunkKey, MemoryObj]]
    ) -> None:
        """``put`` a chunk and its alias entries (``kvtier.core.keys.aliases``): small ordinary
        entries, kept wherever the chunk is. A tiered manager writes them to the lower tiers
        together with the chunk, as one queued write."""
        self.put(key, obj)
        for alias_key, alias_obj in aliases:
            self.put(alias_key, alias_obj)

    def put_last(self, key: ChunkKey, obj: MemoryObj) -> None:
        """``put`` a small record (a hand-over receipt, ``kvtier.core.keys.receipts``) that reaches
        each lower tier only after every chunk put before it has landed there or was dropped. A
        manager without lower tiers puts it at once."""
        self.put(key, obj)

    @abstractmethod
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is held by some tier."""

    def prefix_hits(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, are held (contiguously)."""
        return count_leading(self.contains(keys))

    @abstractmethod
    def batched_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Objects for ``keys`` (None for a miss); the caller releases each returned handle."""

    def get(self, key: ChunkKey) -> MemoryObj | None:
        return self.batched_get([key])[0]

    def host_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Like ``batched_get``, from the host-memory tier only (no lower-tier reads)."""
        return self.batched_get(keys)

    def get_non_blocking(self, key: ChunkKey) -> Future[MemoryObj | None]:
        fut: Future[MemoryObj | None] = Future()
        fut.set_result(self.get(key))
        return fut

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[int]:
        """Bring the contiguous hit prefix of ``keys`` into host memory; resolves to its length."""
        fut: Future[int] = Future()
        fut.set_result(self.prefix_hits(keys))
        return fut

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued lower-tier writes are done; False if ``timeout`` passed first."""
        return True

    @abstractmethod
    def drop_host(self) -> int:
        """Forget every chunk the host-memory tier indexes (lower tiers keep theirs; readers
        keep their handles); returns how many were dropped."""

    def watch_host_removals(self, listener: Callable[[list[ChunkKey]], None]) -> bool:
        """Call ``listener(keys)`` with the keys the host-memory tier drops (evicted, removed,
        or all of them on ``drop_host``); False if this manager cannot tell."""
        return False

    def watch_tiers(self, listener: Callable[[str, list[str], list[str]], None]) -> bool:
        """Call ``listener(tier, stored, dropped)`` (``ChunkKey.digest()`` lists) when a tier
        below host memory writes or drops chunks; False if there is none."""
        return False

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Forget ``keys`` in every tier (a chunk found wrong: ``kvtier.core.verify``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove chunks")

    def quarantine(self, tier: str, seconds: float) -> None:
        """Answer every read of ``tier`` with a miss for ``seconds`` (it served wrong KV)."""
        raise NotImplementedError(f"{type(self).__name__} cannot quarantine a tier")

    def close(self) -> None:
        """Stop background work and release every object this manager holds."""


class HostMemoryStorageManager(StorageManager):
    """One tier: an LRU by bytes over the host arena (``HostObjectLRU``, the same index as
    kvtier-storage's ``local_cpu`` tier). Enough for the engine to run end to end."""

    def __init__(self, arena: HostArena) -> None:
        self.arena = arena
        self._index = HostObjectLRU()
        self.quarantined = Quarantine()

    def allocate(self, meta: MemoryObjMeta) -> MemoryObj | None:
        return self.arena.allocate_evicting(meta, self._index.evict_one)

    def put(self, key: ChunkKey, obj: MemoryObj) -> None:
        self._index.put([(key, obj)])

    def put_with_aliases(
        self, key: ChunkKey, obj: MemoryObj, aliases: Sequence[tuple[ChunkKey, MemoryObj]]
    ) -> None:
        """The chunk and its alias entries, which age with it (``HostObjectLRU.put_chunk``)."""
        self._index.put_chunk(key, obj, aliases)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if self.quarantined.blocked(HOST_TIER):
            return [False] * len(keys)
        return self._index.contains(keys)

    def batched_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        if self.quarantined.blocked(HOST_TIER):
            return [None] * len(keys)
        return self._index.get(keys)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        self._index.remove(keys)

    def quarantine(self, tier: str, seconds: float) -> None:
        self.quarantined.add(tier, seconds)

    def drop_host(self) -> int:
        return self._index.clear()

    def watch_host_removals(self, listener: Callable[[list[ChunkKey]], None]) -> bool:
        self._index.watch_removals(listener)
        return True

    def close(self) -> None:
        self._index.close()


def storage_manager_for(
    config: KVTierConfig, arena: HostArena, layout: KVLayout, namespace: str
) -> StorageManager:
    """The tiered manager from kvtier-storage if installed, else host memory only."""
    eps = [ep for ep in plugin_entry_points(STORAGE_GROUP) if ep.name == "manager"]
    if eps:
        factory = load_object(eps[0].value)
        made = factory(config=config, arena=arena, layout=layout, namespace=namespace)  # type: ignore[operator]
        return made
    extra = [t for t in config.tiers if t != "local_cpu"]
    if extra:
        raise ConfigError(
            "tiers",
            config.tiers,
            f"tier(s) {', '.join(extra)} need kvtier-storage: pip install kvtier-storage "
            "(or kvtier, which includes it)",
        )
    return HostMemoryStorageManager(arena)
