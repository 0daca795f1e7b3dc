"""The worker's loader thread: asynchronous loads, while vLLM runs other requests.

A request whose hit is loaded asynchronously waits in vLLM's WAITING_FOR_REMOTE_KVS. The worker
hands its load here in ``start_load_kv`` with a device marker taken on the forward pass's
stream (its blocks may have been freed by a request whose last forward pass is still queued on
the device), and reports it through ``get_finished`` once it is done, together with the blocks
it could not fill. vLLM keeps the blocks of a request aborted meanwhile until that report, so
every load submitted is reported exactly once, whatever happened to its request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.handles import Hold
from kvtier.core.platform import Marker
from kvtier.vllm_integration.metadata import LoadSpec

logger = logging.getLogger("kvtier")

# Performs one load: (spec, hold or None, ready marker) -> the blocks it could not fill.
LoadFn = Callable[[LoadSpec, Hold | None, Marker], set[int]]


@dataclass
class _Load:
    spec: LoadSpec
    hold: Hold | None
    marker: Marker


class Loader:
    """One thread running each submitted load in order; ``take_finished`` reports them."""

    def __init__(self, load: LoadFn, block_ids_of: Callable[[LoadSpec], set[int]]) -> None:
        """``load`` does the work; ``block_ids_of(spec)`` names every block of a load that
        failed outright (an exception), so vLLM recomputes them."""
        self._load = load
        self._block_ids_of = block_ids_of
        self._queue: queue.Queue[_Load | None] = queue.Queue()
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._loop, name="kvtier-loader", daemon=True)
        self._thread.start()

    def submit(self, spec: LoadSpec, hold: Hold | None, marker: Marker) -> None:
        with self._lock:
            self._in_flight += 1
        self._queue.put(_Load(spec, hold, marker))

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                failed = self._load(job.spec, job.hold, job.marker)
            except Exception:  # a failed load is recomputed by vLLM, never a crashed engine
                logger.exception("kvtier: loading request %s failed", job.spec.req_id)
                failed = self._block_ids_of(job.spec)
            finally:
                if job.hold is not None:
                    job.hold.release()
            with self._lock:
                self._finished.add(job.spec.req_id)
                self._failed_blocks |= failed
                self._in_flight -= 1

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose loads ended since the last call, and the blocks those left unfilled."""
        with self._lock:
            done, self._finished = self._finished, set()
            failed, self._failed_blocks = self._failed_blocks, set()
        return done, failed

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def close(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
