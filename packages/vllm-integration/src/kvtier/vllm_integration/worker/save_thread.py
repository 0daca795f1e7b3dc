"""The worker's saver thread: copies finished chunks off the device and into the tiers.

``submit`` (the worker's main thread, in ``wait_for_save``) hands over one step's saves together
with a device *marker* taken on the calling thread's current stream, where vLLM's forward pass
wrote the KV: the saver's copy is ordered after it on the device. Without it, on CUDA the saver
thread's own stream does not wait for vLLM's compute stream and the copy can read the KV before
the forward pass has written it.

A request's blocks stay with kvtier until its saves are done (``pending``). When vLLM is about
to reuse blocks (preemption) the worker drains the saver (``drain``); a drain that times out
*abandons* every save still in flight: a save whose device copy finishes after that is dropped
(a miss later), never stored with blocks that may already hold another request's KV.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.core.keys import KeyScope
from kvtier.core.platform import Marker
from kvtier.vllm_integration.messages import ReceiptSpec, SaveSpec, VerifySpec

logger = logging.getLogger("kvtier")

# A job: a save, a verification (which reads the blocks as a save does), or a hand-over
# receipt (written after the saves before it).
Spec = SaveSpec | VerifySpec | ReceiptSpec
# Runs one job: (spec, ready marker, keep) -> tokens stored.
StoreFn = Callable[[Spec, Marker, Callable[[], bool]], int]


@dataclass(eq=False)
class _Job:
    spec: Spec
    marker: Marker
    step: int  # the scheduler step whose metadata carried it
    abandoned: bool = field(default=False)


class Saver:
    """One thread running ``store`` for each submitted save, in order."""

    def __init__(self, store: StoreFn, on_done: Callable[[int, bool], None]) -> None:
        """``store(spec, marker, keep)`` performs one save; ``on_done(tokens, failed)`` counts."""
        self._store = store
        self._on_done = on_done
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._cv = threading.Condition()
        self._pending: dict[str, int] = {}  # req_id -> saves queued or running
        self._inflight: set[_Job] = set()
        self._latest = -1  # the last step handed over (``submit`` or ``mark``)
        self._thread = threading.Thread(target=self._loop, name="kvtier-saver", daemon=True)
        self._thread.start()

    def submit(self, specs: Sequence[Spec], marker: Marker, step: int = -1) -> None:
        """Queue ``specs``, jobs of scheduler step ``step`` (run in order)."""
        for spec in specs:
            job = _Job(spec, marker, step)
            with self._cv:
                self._pending[spec.req_id] = self._pending.get(spec.req_id, 0) + 1
                self._inflight.add(job)
            self._queue.put(job)
        self.mark(step)

    def mark(self, step: int) -> None:
        """Scheduler step ``step`` has handed over all its saves (maybe none)."""
        with self._cv:
            self._latest = max(self._latest, step)

    @property
    def copied_through(self) -> int:
        """The last step whose saves, and every earlier step's, are done (copied off the
        device, failed or abandoned): none of them reads a block any more."""
        with self._cv:
            oldest = min((j.step for j in self._inflight), default=None)
            return self._latest if oldest is None else oldest - 1

    def pending(self, req_ids: set[str]) -> set[str]:
        """Those of ``req_ids`` that still have a save queued or running."""
        with self._cv:
            return {r for r in req_ids if r in self._pending}

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            failed, stored = False, 0
            try:
                with self._cv:
                    skip = job.abandoned
                if not skip:
                    stored = self._store(job.spec, job.marker, functools.partial(self._keep, job))
            except Exception:  # a failed save is a future miss, never a crashed engine
                logger.exception("kvtier: saving request %s failed", job.spec.req_id)
                failed = True
            finally:
                with self._cv:
                    self._inflight.discard(job)
                    left = self._pending[job.spec.req_id] - 1
                    if left:
                        self._pending[job.spec.req_id] = left
                    else:
                        del self._pending[job.spec.req_id]
                    self._cv.notify_all()
            self._on_done(stored, failed)

    def _keep(self, job: _Job) -> bool:
        with self._cv:
            return not job.abandoned

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued save to finish (nothing is abandoned);
        whether none is left."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending, timeout=timeout_s)

    def drain(self, timeout_s: float) -> bool:
        """Wait for every save; on timeout abandon those still in flight and return False."""
        with self._cv:
            if self._cv.wait_for(lambda: not self._pending, timeout=timeout_s):
                return True
            for job in self._inflight:
                job.abandoned = True
            return False

    def wait_related(
        self, tokens: np.ndarray, scope: KeyScope, chunk_size: int, timeout_s: float
    ) -> bool:
        """Let in-flight saves of the same prefix land before a lookup answers.

        Saves run after the step that computed them, so a request repeated as soon as the
        previous one returned would otherwise miss the chunks being saved. Only saves whose
        first chunk is this prompt's first chunk (same scope) are waited for, and never longer
        than ``timeout_s`` (then the lookup answers with what is stored)."""
        k = min(len(tokens), chunk_size)

        def related() -> bool:
            return any(
                not isinstance(j.spec, ReceiptSpec)
                and j.spec.scope == scope
                and len(j.spec.tokens) >= k
                and np.array_equal(j.spec.tokens[:k], tokens[:k])
                for j in self._inflight
            )

        with self._cv:
            return not k or self._cv.wait_for(lambda: not related(), timeout=timeout_s)

    def close(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
