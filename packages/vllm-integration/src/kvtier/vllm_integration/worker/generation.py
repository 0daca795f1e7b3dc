"""A worker's part of the weights generation (``scheduler/generation.py``).

After a ``reset_cache`` (the scheduler bumps the weights epoch in the step's metadata) the worker
digests the live weights of the model it serves and reports the digest; when the scheduler then
starts a new generation, the worker drops its host-memory chunks and holds: they were computed
with the old weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvtier.vllm_integration.weights import model_digest

if TYPE_CHECKING:
    from kvtier.core.engine import CacheEngine
    from kvtier.vllm_integration.messages import KVTierMetadata
    from kvtier.vllm_integration.worker.feed import PresenceFeed
    from kvtier.vllm_integration.worker.holds import HoldTable

logger = logging.getLogger("kvtier")


class WorkerWeights:
    """The served model, its live digest at start, and the last epoch and generation seen."""

    def __init__(self, count: Callable[..., None]) -> None:
        self._count = count
        self.model: torch.nn.Module | None = None  # what it digests (``weights.py``)
        self.live_at_start = ""  # the digest of the live parameters at start
        self._epoch = 0  # the last reset whose weights this worker digested
        self._generation: str | None = None

    def started(self, model: torch.nn.Module, live: str) -> None:
        self.model, self.live_at_start = model, live

    def digest(self, feed: PresenceFeed, meta: KVTierMetadata) -> None:
        """A ``reset_cache`` since the last step: report the live weights' digest (the
        scheduler decides the generation from every rank's)."""
        if meta.weights_epoch == self._epoch or self.model is None:
            return
        self._epoch = meta.weights_epoch
        t0 = time.perf_counter()
        digest = model_digest(self.model)
        feed.weights(meta.weights_epoch, digest, digest != self.live_at_start)
        logger.info(
            "kvtier: live weights digested for cache reset %d in %.3f s",
            meta.weights_epoch,
            time.perf_counter() - t0,
        )

    def follow(self, engine: CacheEngine, holds: HoldTable, meta: KVTierMetadata) -> None:
        """Drop host-memory chunks of older weights when the scheduler starts a generation."""
        if meta.generation == self._generation:
            return
        self._generation = meta.generation
        holds.close()
        dropped = engine.storage.drop_host()
        self._count(generation_resets=1)
        logger.info(
            "kvtier: new weights generation %s: %d host-memory chunk(s) dropped",
            meta.generation,
            dropped,
        )
