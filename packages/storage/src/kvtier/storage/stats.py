"""Counters of one StorageManager: what hit where, what was dropped, what failed its checks."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from kvtier.core.keys import ChunkKey


class StorageStats:
    """Thread-safe named counters. Names are ``<event>`` or ``<tier>.<event>``, for example
    ``local_disk.hits``, ``redis.corrupt``, ``redis.reconnects``, ``write_queue.dropped``,
    ``writeback.chunks``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n

    def add_entries(self, tier: str, event: str, keys: Iterable[ChunkKey]) -> None:
        """Count ``keys`` under ``<tier>.<event>`` (chunks: the ``hit_chunks``/``tier_stored_chunks``
        metrics read these) and their alias entries apart, under ``<tier>.alias_<event>``."""
        keys = list(keys)
        aliases = sum(key.is_alias for key in keys)
        self.add(f"{tier}.{event}", len(keys) - aliases)
        self.add(f"{tier}.alias_{event}", aliases)

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        return f"StorageStats({self.snapshot()})"
