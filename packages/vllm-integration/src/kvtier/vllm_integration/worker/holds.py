"""Worker-side holds: what a scheduler lookup promised, kept in host memory until the load.

The scheduler asks the worker how long a prefix of a request's prompt is stored; the worker
answers with ``CacheEngine.hold``, which keeps the hit chunks' host objects alive (fetching disk
or Redis hits into host memory now). The load that follows, a step later, reads exactly those
objects, so a chunk evicted in between (another request's save filling the host tier) cannot
make the load come up short.

Each hold is filed under the request id and the scheduler's ``hold_id`` (a number the scheduler
picks per lookup, the same for every rank). vLLM may ask several times for a waiting request: a
lookup with the same ``hold_id``, tokens and scope (salt, adapter, generation) reuses the hold (and
refreshes its age). A hold ends when

- its load takes it (``take``; the caller releases it right after the load),
- the scheduler says it will not load it (``release`` with the hold id, through the per-step
  metadata) or the request finished or was aborted (``release_requests``),
- it is older than ``ttl_s`` without a lookup or load (``expire``, counted in
  ``hold_expiries``): this bounds the host memory a lost hold can pin.

Thread-safe: lookups run on the probe threads (``probes``), the rest on the worker's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.core.engine import CacheEngine
from kvtier.core.keys import Scope
from kvtier.core.memory.handles import Hold

logger = logging.getLogger("kvtier")


@dataclass
class _Entry:
    hold_id: int
    tokens: np.ndarray
    salt: Scope
    hold: Hold
    last_used: float


class HoldTable:
    """The worker's holds by request id (see the module docstring for their life cycle)."""

    def __init__(
        self, engine: CacheEngine, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"hold ttl_s must be > 0, got {ttl_s}")
        self.engine = engine
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._expiries = 0
        self._reuses = 0

    def lookup(self, req_id: str, hold_id: int, tokens: np.ndarray, salt: Scope) -> int:
        """Hold the stored prefix of ``tokens`` for ``req_id``; returns its length in tokens."""
        self.expire()
        with self._lock:
            e = self._entries.get(req_id)
            if (
                e is not None
                and e.hold_id == hold_id
                and e.salt == salt
                and np.array_equal(e.tokens, tokens)
            ):
                e.last_used = self._clock()
                self._reuses += 1
                return e.hold.num_tokens
        # Taken outside the lock: it may read lower tiers.
        hold = self.engine.hold(tokens, salt)
        entry = _Entry(hold_id, np.array(tokens, dtype=np.int64), salt, hold, self._clock())
        with self._lock:
            old = self._entries.get(req_id)
            self._entries[req_id] = entry
        if old is not None:
            old.hold.release()
        return hold.num_tokens

    def take(self, req_id: str, hold_id: int | None) -> Hold | None:
        """Remove and return the hold ``hold_id`` of ``req_id`` (None if it is gone or replaced);
        the caller loads from it and releases it."""
        with self._lock:
            e = self._entries.get(req_id)
            if e is None or e.hold_id != hold_id:
                return None
            del self._entries[req_id]
        return e.hold

    def release(self, req_id: str, hold_id: int) -> None:
        """Drop ``req_id``'s hold if it is still ``hold_id`` (a newer lookup's hold stays)."""
        hold = self.take(req_id, hold_id)
        if hold is not None:
            hold.release()

    def release_requests(self, req_ids: Iterable[str]) -> None:
        """Drop the holds of finished or aborted requests."""
        with self._lock:
            gone = [self._entries.pop(r) for r in req_ids if r in self._entries]
        for e in gone:
            e.hold.release()

    def expire(self) -> int:
        """Release holds unused for longer than ``ttl_s``; returns how many."""
        cutoff = self._clock() - self.ttl_s
        with self._lock:
            old = [r for r, e in self._entries.items() if e.last_used < cutoff]
            gone = [self._entries.pop(r) for r in old]
            self._expiries += len(gone)
        for e in gone:
            e.hold.release()
        if gone:
            logger.warning(
                "kvtier: %d lookup hold(s) expired unused after %.0f s (requests %s)",
                len(gone),
                self.ttl_s,
                ", ".join(old[:5]),
            )
        return len(gone)

    def sources(self, req_id: str) -> list[list[Any]]:
        """``[[start, end, tier], ...]``: where each chunk of ``req_id``'s hold was found
        (``Hold.sources``), for vLLM's hit-source metrics; empty without a hold."""
        with self._lock:
            e = self._entries.get(req_id)
            if e is None:
                return []
            return [
                [sp.start, sp.end, tier]
                for sp, tier in zip(e.hold.spans, e.hold.sources, strict=False)
            ]

    def stats(self) -> dict[str, int]:
        """``holds`` and ``held_objects`` now; ``hold_expiries`` and ``hold_reuses`` so far."""
        with self._lock:
            return {
                "holds": len(self._entries),
                "held_objects": sum(len(e.hold.objs) for e in self._entries.values()),
                "held_tokens": sum(e.hold.num_tokens for e in self._entries.values()),
                "hold_expiries": self._expiries,
                "hold_reuses": self._reuses,
            }

    def close(self) -> None:
        """Release every hold (engine shutdown)."""
        with self._lock:
            gone, self._entries = list(self._entries.values()), {}
        for e in gone:
            e.hold.release()
