"""Pinning a host arena in the background: the host tier is usable while it is page-locked.

Page-locking a large host arena costs time (about 0.6 s per GiB with one ``cudaHostRegister`` on
an H100 host), and a serving engine's arena is tens to hundreds of GiB. ``ArenaGrowth`` pins it
segment by segment on its own thread and grows the arena's capacity as each segment is ready
(``HostArena.grow``): the first store or load is served after the first segment, and the host
tier's capacity (eviction, admission, metrics) is what is ready.

A segment the platform refuses to pin (a memlock limit) is still used, pageable, with one
warning: today's fallback, per segment. ``close()`` stops the growth between segments and
unpins what it pinned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.core.memory import HostArena

logger = logging.getLogger("kvtier")

GiB = 1 << 30
#: Bytes pinned per step: small enough that the first one is ready in a fraction of a second.
SEGMENT_BYTES = 256 << 20


class ArenaGrowth:
    """Pins ``arena``'s bytes past its capacity with ``pin(offset, nbytes) -> bool`` (True:
    page-locked; False: refused, used pageable) on one daemon thread; ``unpin(offset, nbytes)``
    undoes a pinned segment at ``close``."""

    def __init__(
        self,
        arena: HostArena,
        pin: Callable[[int, int], bool],
        unpin: Callable[[int, int], None] | None = None,
        *,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        self.arena = arena
        self._pin = pin
        self._unpin = unpin
        self.segment_bytes = max(
            arena.alignment, segment_bytes // arena.alignment * arena.alignment
        )
        self.pinned: list[tuple[int, int]] = []
        self.refused_bytes = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()  # pinning vs. unpinning at close
        self._thread = threading.Thread(target=self._run, name="kvtier-arena-pin", daemon=True)
        arena.on_close(self.close)

    def start(self) -> ArenaGrowth:
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait until the arena is fully grown (or growth stopped); True if it finished."""
        return self._done.wait(timeout)

    def _run(self) -> None:
        arena = self.arena
        t0 = time.perf_counter()
        warned = False
        try:
            offset = arena.capacity
            while offset < arena.target_bytes and not self._stop.is_set():
                n = min(self.segment_bytes, arena.target_bytes - offset)
                with self._lock:
                    if self._stop.is_set():
                        break
                    try:
                        pinned = self._pin(offset, n)
                    except Exception as e:  # a failing pin degrades to pageable memory
                        logger.warning("kvtier: pinning host memory failed: %s", e)
                        pinned = False
                    if pinned:
                        self.pinned.append((offset, n))
                    else:
                        self.refused_bytes += n
                        if not warned:
                            warned = True
                            logger.warning(
                                "kvtier: host memory could not be page-locked (memlock limit?); "
                                "the host tier uses pageable memory there: copies are slower"
                            )
                    arena.grow(offset + n)
                offset += n
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()
        if not self._stop.is_set():
            logger.info(
                "kvtier: host arena ready: %.1f GiB in %.1f s (%.1f GiB page-locked)",
                arena.capacity / GiB,
                self.seconds,
                sum(n for _, n in self.pinned) / GiB,
            )

    def close(self, timeout: float = 60.0) -> None:
        """Stop growing (a segment being pinned finishes first) and unpin what was pinned."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._unpin is None:
            return
        with self._lock:
            pinned, self.pinned = self.pinned, []
            for offset, n in pinned:
                try:
                    self._unpin(offset, n)
                except Exception as e:  # the process may be shutting the device down
                    logger.debug("kvtier: unpinning host memory failed: %s", e)
