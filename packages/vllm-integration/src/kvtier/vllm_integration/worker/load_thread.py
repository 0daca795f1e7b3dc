"""The worker's loader thread: asynchronous loads, while vLLM runs other requests.

A request whose hit is loaded asynchronously waits in vLLM's WAITING_FOR_REMOTE_KVS. The worker
hands its load here in ``start_load_kv`` with a device marker taken on the forward pass's
stream (its blocks may have been freed by a request whose last forward pass is still queued on
the device), and reports it through ``get_finished`` once it is done, together with the blocks
it could not fill. vLLM keeps the blocks of a request aborted meanwhile until that report, so
every load submitted is reported exactly once, whatever happened to its request.

vLLM starts a step's asynchronous loads after its forward pass and asks for finished ones right
after; a load not done by then is reported by the next step, and its request waits that whole
step. So ``take_finished`` may wait a moment for the loads submitted since the last call: a
load from host memory is done within it and its request runs a step sooner, while a slow one
(disk, Redis, a device still busy) costs at most the wait and is reported when done.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.memory.handles import Hold
from kvtier.core.platform import Marker
from kvtier.vllm_integration.messages import LoadSpec

logger = logging.getLogger("kvtier")

# Performs one load: (spec, hold or None, ready marker) -> the blocks it could not fill.
LoadFn = Callable[[LoadSpec, Hold | None, Marker], set[int]]


@dataclass
class _Load:
    spec: LoadSpec
    hold: Hold | None
    marker: Marker
    seq: int  # submission order


class Loader:
    """One thread running each submitted load in order; ``take_finished`` reports them."""

    def __init__(self, load: LoadFn, block_ids_of: Callable[[LoadSpec], set[int]]) -> None:
        """``load`` does the work; ``block_ids_of(spec)`` names every block of a load that
        failed outright (an exception), so vLLM recomputes them."""
        self._load = load
        self._block_ids_of = block_ids_of
        self._queue: queue.Queue[_Load | None] = queue.Queue()
        self._cv = threading.Condition()
        self._finished: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._running: set[int] = set()  # seqs submitted and not finished
        self._seq = 0
        self._taken_upto = 0  # loads submitted before the last take_finished (their seqs)
        self._thread = threading.Thread(target=self._loop, name="kvtier-loader", daemon=True)
        self._thread.start()

    def submit(self, spec: LoadSpec, hold: Hold | None, marker: Marker) -> None:
        with self._cv:
            self._seq += 1
            seq = self._seq
            self._running.add(seq)
        self._queue.put(_Load(spec, hold, marker, seq))

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
            with self._cv:
                self._finished.add(job.spec.req_id)
                self._failed_blocks |= failed
                self._running.discard(job.seq)
                self._cv.notify_all()

    def take_finished(self, wait_s: float = 0.0) -> tuple[set[str], set[int]]:
        """Requests whose loads ended since the last call, and the blocks those left unfilled;
        first waits up to ``wait_s`` for the loads submitted since the last call (not for older
        ones still running)."""
        with self._cv:
            if wait_s > 0:
                self._cv.wait_for(
                    lambda: all(s <= self._taken_upto for s in self._running), timeout=wait_s
                )
            self._taken_upto = self._seq
            done, self._finished = self._finished, set()
            failed, self._failed_blocks = self._failed_blocks, set()
        return done, failed

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every submitted load to finish; whether none is left
        (they are reported by the next ``take_finished``)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._running, timeout=timeout_s)

    @property
    def in_flight(self) -> int:
        with self._cv:
            return len(self._running)

    def close(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
