"""The host-memory tier: an LRU by bytes over the objects of the host arena.

The index is core's ``HostObjectLRU`` (shared with core's host-only ``HostMemoryStorageManager``):
when an allocation does not fit the arena, the manager calls ``evict_one`` until it does; it skips
objects that a reader or a pending lower-tier write still holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier.core.memory.lru import HostObjectLRU
from kvtier.storage.backends.base import BackendContext, StorageBackend, refuse_options

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj, MemoryObjMeta


class LocalCPUBackend(StorageBackend):
    """Keeps shared handles on host objects; ``evict_one`` is the arena's eviction callback."""

    name = "local_cpu"
    keeps_host_objects = True

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        refuse_options(ctx, "local_cpu", "see the config key local_cpu_size_gb")
        self._index = HostObjectLRU()

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects this tier indexes (some may also be held by readers)."""
        return self._index.used_bytes

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self._index.contains(keys)

    def batched_get(
        self,
        keys: Sequence[ChunkKey],
        allocate: Callable[[MemoryObjMeta], MemoryObj | None] | None = None,
    ) -> list[MemoryObj | None]:
        return self._index.get(keys)

    def batched_put(self, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> None:
        self._index.put(items)

    def put_chunk(
        self, key: ChunkKey, obj: MemoryObj, aliases: Sequence[tuple[ChunkKey, MemoryObj]]
    ) -> None:
        """A chunk and its alias entries, which age with it (``HostObjectLRU.put_chunk``)."""
        self._index.put_chunk(key, obj, aliases)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        self._index.remove(keys)

    def watch_removals(self, listener: Callable[[list[str]], None]) -> bool:
        self._index.watch_removals(lambda keys: listener([k.digest() for k in keys]))
        return True

    def watch_key_removals(self, listener: Callable[[list[ChunkKey]], None]) -> None:
        """Call ``listener(keys)`` with the keys this tier drops (``HostObjectLRU``)."""
        self._index.watch_removals(listener)

    def digests(self) -> list[str]:
        return [key.digest() for key in self._index.key_list()]

    def clear(self) -> int:
        """Drop every entry (readers keep their handles); returns how many."""
        return self._index.clear()

    def evict_one(self) -> bool:
        """Drop the least recently used entry that only this tier holds; False if there is none."""
        if not self._index.evict_one():
            return False
        self.ctx.stats.add(f"{self.name}.evicted")
        return True

    def close(self) -> None:
        """Release every held object; later puts keep nothing."""
        self._index.close()
