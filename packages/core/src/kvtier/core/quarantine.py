"""Tiers whose reads are refused for a while: a tier that served a chunk found wrong by
verification (``kvtier.core.verify``) answers every lookup with a miss until its quarantine
ends. Writes still go to it (fresh KV overwrites what it held)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Quarantine:
    """Tier names and when each one's quarantine ends (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}

    def add(self, tier: str, seconds: float) -> None:
        """Refuse ``tier``'s reads for ``seconds`` from now (a later end is kept)."""
        if seconds <= 0:
            return
        end = self._clock() + seconds
        with self._lock:
            self._until[tier] = max(end, self._until.get(tier, end))

    def blocked(self, tier: str) -> bool:
        """Whether ``tier`` is quarantined now (an ended quarantine is forgotten)."""
        if not self._until:  # every read asks: the usual answer takes no lock
            return False
        with self._lock:
            end = self._until.get(tier)
            if end is None:
                return False
            if self._clock() < end:
                return True
            del self._until[tier]
            return False

    def active(self) -> dict[str, float]:
        """``{tier: seconds left}`` of the quarantines in force."""
        now = self._clock()
        with self._lock:
            return {t: end - now for t, end in self._until.items() if end > now}
