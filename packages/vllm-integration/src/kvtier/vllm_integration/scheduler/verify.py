"""The scheduler's part of verification by recompute (``kvtier.core.verify``): which requests
with a kvtier hit are verified instead of loaded, and when their check goes to the workers.

A sampled request is told "no external hit" (its probe's hold is kept for the check), so vLLM
computes its prefix; the step whose forward pass computes the last token of the hit sends a
``VerifySpec`` (the workers compare that KV with the held chunks on their savers, before the
step's saves). Only ``kv_both`` engines sample (a producer never loads, a consumer's prefill is
someone else's), only hits of at most ``verify_max_tokens``, and a request at most once.

vLLM asks for a waiting request's hit every step until it has blocks for it (under memory
pressure, many times), so the draw is a function of the request id, not a new draw per lookup:
a request is sampled with probability ``verify_fraction`` however often it is looked up.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable

from kvtier.core.config import KVTierConfig
from kvtier.vllm_integration.messages import VerifySpec
from kvtier.vllm_integration.scheduler.request_state import PendingVerify, TrackedRequest

logger = logging.getLogger("kvtier")


class VerifySampling:
    """Samples requests for verification and counts what they cost (see the module docstring)."""

    def __init__(
        self,
        config: KVTierConfig,
        role: str,
        block_size: int,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        verifiable: bool = True,
    ) -> None:
        """``verifiable``: the cache's pages can be compared as numbers (else nothing is
        sampled: a sampled request would be computed for nothing)."""
        self.fraction = config.verify_fraction if role == "kv_both" and verifiable else 0.0
        if config.verify_fraction > 0 and not verifiable:
            logger.warning(
                "kvtier: verify_fraction=%s is off: this cache's pages pack scales next to "
                "their values and cannot be compared as numbers",
                config.verify_fraction,
            )
        self.max_tokens = config.verify_max_tokens
        self.block_size = block_size
        self._salt = (rng or random.Random()).getrandbits(64).to_bytes(8, "little")
        self._clock = clock
        self.requests = 0  # sampled
        self.tokens = 0  # hit tokens the sampled requests computed instead of loading
        self._quarantine_ends = 0.0

    def sample(
        self, req: TrackedRequest, computed: int, hit: int, hold_id: int | None
    ) -> PendingVerify | None:
        """The check of the lookup that found ``hit`` tokens (vLLM had ``computed``) if it is
        verified instead of loaded (the request keeps ``hold_id`` for it); else None."""
        new = hit - computed
        if self.fraction <= 0 or new <= 0 or new > self.max_tokens or req.verify_step >= 0:
            return None
        if self._draw(req.rid) >= self.fraction:
            return None
        self.requests += 1
        self.tokens += new
        return PendingVerify(computed, hit, hold_id)

    def _draw(self, rid: str) -> float:
        """The request's draw in [0, 1): the same on every lookup of it (see the module
        docstring); the salt keeps engines from sampling the same request ids."""
        digest = hashlib.blake2b(rid.encode(), digest_size=8, key=self._salt).digest()
        return int.from_bytes(digest, "little") / 2.0**64

    def due(self, req: TrackedRequest, end: int) -> VerifySpec | None:
        """The check to send with a step after whose forward pass the request has KV for
        tokens ``[0, end)``; None before its hit is computed."""
        pending = req.verify
        if pending is None or end < pending.end:
            return None
        n_blocks = -(-pending.end // self.block_size)
        return VerifySpec(
            req.rid,
            req.prompt[: pending.end],
            list(req.block_ids[:n_blocks]),
            req.scope,
            pending.hold_id,
            -(-pending.start // self.block_size) * self.block_size,  # whole blocks computed
        )

    def quarantined(self, seconds: float) -> None:
        """A worker quarantined a tier for ``seconds``: the index's answers may name its chunks."""
        self._quarantine_ends = max(self._quarantine_ends, self._clock() + seconds)

    @property
    def index_trusted(self) -> bool:
        """False while a tier is quarantined: hits are confirmed by probes, not the index."""
        return self._clock() >= self._quarantine_ends
