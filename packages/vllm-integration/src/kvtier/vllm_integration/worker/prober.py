"""A worker's probe threads: the asynchronous lookups the scheduler sends, run off the step
thread (``scheduler/prompts.py`` says what a probe is).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.vllm_integration.messages import ProbeAnswer, ProbeSpec

logger = logging.getLogger("kvtier")


# What a probe found: the tokens held, where each held chunk was found, and whether the
# request's hand-over receipt was (``ProbeAnswer``).
Found = tuple[int, list[list[Any]], bool]


class Prober:
    """A worker's probe threads: ``probe(spec) -> (hit, sources, settled)`` runs off the step
    thread and each answer goes to ``answer``; a probe that raises answers 0 (a miss), never
    nothing."""

    def __init__(
        self,
        probe: Callable[[ProbeSpec], Found],
        answer: Callable[[ProbeAnswer], None],
        threads: int = 2,
    ) -> None:
        self._probe = probe
        self._answer = answer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-probe")

    def submit(self, spec: ProbeSpec) -> None:
        self._pool.submit(self._run, spec)

    def _run(self, spec: ProbeSpec) -> None:
        t0 = time.perf_counter()
        try:
            hit, sources, settled = self._probe(spec)
        except Exception:
            logger.exception("kvtier: probe of request %s failed; a miss", spec.req_id)
            hit, sources, settled = 0, [], False
        logger.debug(
            "kvtier: probe of %s: %d tokens in %.1f ms",
            spec.req_id,
            hit,
            1e3 * (time.perf_counter() - t0),
        )
        self._answer(ProbeAnswer(spec.req_id, spec.hold_id, hit, sources, settled))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
