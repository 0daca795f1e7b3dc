"""The host tier's index: shared handles on host objects by key, least recently used first.

Used by core's ``HostMemoryStorageManager`` (host memory only, no kvtier-storage installed) and
by kvtier-storage's ``local_cpu`` backend, so both tiers evict the same way. The arena is the
budget: when an allocation does not fit, the owner calls ``evict_one`` until it does. Eviction is
O(1) per object (an ``OrderedDict`` in recency order) and skips objects that a reader or a
pending lower-tier write still holds: dropping them would free no bytes, and a borrowed object is
never freed under its reader anyway (its handle keeps the bytes alive).

A full chunk's alias entries (``kvtier.core.keys.aliases``: a prompt diverging inside the chunk
hits its first blocks through them) age with their chunk: ``put_chunk`` links them, every read
of the chunk marks them recently used too, and none is evicted while its chunk is borrowed. So a
hit does not hash or read each of its chunks' aliases to keep them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj


class HostObjectLRU:
    """Keeps one shared handle per key (thread-safe). Handles are released outside the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[ChunkKey, MemoryObj] = OrderedDict()
        self._bytes = 0
        self._closed = False
        self._on_remove: list[Callable[[list[ChunkKey]], None]] = []
        self._aliases: dict[ChunkKey, tuple[ChunkKey, ...]] = {}  # chunk -> its alias entries
        self._chunk_of: dict[ChunkKey, ChunkKey] = {}  # alias entry -> its chunk

    def watch_removals(self, listener: Callable[[list[ChunkKey]], None]) -> None:
        """Call ``listener(keys)`` with the keys of entries evicted, removed or cleared (after
        the fact, outside the lock; it must be quick and must not raise)."""
        self._on_remove.append(listener)

    def _removed(self, keys: list[ChunkKey]) -> None:
        if keys:
            for listener in self._on_remove:
                listener(keys)

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects indexed (some may also be held by readers)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def key_list(self) -> list[ChunkKey]:
        """The indexed keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """A new handle per key found (the caller releases it), each marked most recently used."""
        out: list[MemoryObj | None] = []
        with self._lock:
            for k in keys:
                obj = self._entries.get(k)
                if obj is not None:
                    self._entries.move_to_end(k)
                    for alias in self._aliases.get(k, ()):
                        if alias in self._entries:
                            self._entries.move_to_end(alias)
                    obj = obj.share()
                out.append(obj)
        return out

    def _unlink(self, key: ChunkKey) -> None:
        """Forget ``key``'s links as a chunk (its aliases then age alone) and as an alias.
        Under the lock."""
        for alias in self._aliases.pop(key, ()):
            self._chunk_of.pop(alias, None)
        chunk = self._chunk_of.pop(key, None)
        if chunk is not None:
            rest = tuple(a for a in self._aliases.get(chunk, ()) if a != key)
            if rest:
                self._aliases[chunk] = rest
            else:
                self._aliases.pop(chunk, None)

    def _borrowed(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Whether a reader holds ``obj``, or the chunk ``key`` is an alias of. Under the lock."""
        if obj.holders > 1:
            return True
        chunk = self._chunk_of.get(key)
        owner = self._entries.get(chunk) if chunk is not None else None
        return owner is not None and owner.holders > 1

    def put(self, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> None:
        """Index a handle of its own on each object (the caller keeps theirs); a key already
        indexed is replaced. After ``close`` nothing is kept."""
        replaced: list[MemoryObj] = []
        with self._lock:
            self._put(items, replaced)
        for old in replaced:
            old.release()

    def put_chunk(
        self, key: ChunkKey, obj: MemoryObj, aliases: Sequence[tuple[ChunkKey, MemoryObj]]
    ) -> None:
        """``put`` a chunk and its alias entries, the aliases linked to it (module doc)."""
        replaced: list[MemoryObj] = []
        with self._lock:
            if self._put([(key, obj), *aliases], replaced):
                keys = tuple(k for k, _ in aliases)
                if keys:
                    self._aliases[key] = keys
                    self._chunk_of.update((k, key) for k in keys)
        for old in replaced:
            old.release()

    def _put(self, items: Sequence[tuple[ChunkKey, MemoryObj]], replaced: list[MemoryObj]) -> bool:
        """``put``'s work, under the lock; False after ``close`` (nothing kept)."""
        if self._closed:
            return False
        for key, obj in items:
            mine = obj.share()
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.meta.nbytes
                replaced.append(old)
                self._unlink(key)
            self._entries[key] = mine
            self._bytes += mine.meta.nbytes
        return True

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        gone: list[tuple[ChunkKey, MemoryObj]] = []
        with self._lock:
            for k in keys:
                obj = self._entries.pop(k, None)
                if obj is not None:
                    self._bytes -= obj.meta.nbytes
                    gone.append((k, obj))
                    self._unlink(k)
        for _, obj in gone:
            obj.release()
        self._removed([k for k, _ in gone])

    def evict_one(self) -> bool:
        """Drop the least recently used entry that only this index holds; False if there is none.

        A borrowed entry (or an alias of a borrowed chunk) met on the way is moved to the
        recent end (it is in use), so each call looks at every entry at most once.
        """
        victim: MemoryObj | None = None
        with self._lock:
            for _ in range(len(self._entries)):
                key, obj = next(iter(self._entries.items()))
                if not self._borrowed(key, obj):
                    del self._entries[key]
                    self._bytes -= obj.meta.nbytes
                    self._unlink(key)
                    victim = obj
                    break
                self._entries.move_to_end(key)
        if victim is None:
            return False
        victim.release()
        self._removed([key])
        return True

    def clear(self) -> int:
        """Release every indexed object (readers keep their own handles); returns how many."""
        with self._lock:
            entries, self._entries = self._entries, OrderedDict()
            self._bytes = 0
            self._aliases.clear()
            self._chunk_of.clear()
        for obj in entries.values():
            obj.release()
        self._removed(list(entries))
        return len(entries)

    def close(self) -> None:
        """Release every indexed object; later puts keep nothing."""
        with self._lock:
            self._closed = True
        self.clear()
