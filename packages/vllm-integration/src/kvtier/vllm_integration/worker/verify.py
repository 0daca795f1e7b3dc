"""The worker's part of verification by recompute (``kvtier.core.verify``): on the saver thread,
after the forward pass that computed a sampled request's prefix, compare that KV with the chunks
its lookup held (and, for a Mamba hybrid, the recomputed state at the hit's end with the held
state entry, where vLLM offered that state in the same step), then release the hold.

The hold from the request's lookup is used when it is still there: it names the tier each chunk
was read from, which is the tier a wrong chunk puts in quarantine. A lookup answered by the
scheduler's index had no hold, and a hold can expire during a long prefill: the prefix is then
looked up again here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvtier.core.engine import CacheEngine
from kvtier.core.platform import Marker
from kvtier.core.verify import Verifier
from kvtier.vllm_integration.messages import VerifySpec, spec_slots
from kvtier.vllm_integration.worker.holds import HoldTable

logger = logging.getLogger("kvtier")


class WorkerVerify:
    """Runs the verifications the scheduler sampled (see the module docstring)."""

    def __init__(
        self,
        engine: CacheEngine,
        holds: HoldTable,
        *,
        quarantined: Callable[[list[tuple[str, float]]], None],
    ) -> None:
        """``quarantined(tiers)`` is told the tiers a mismatch put in quarantine (name,
        seconds), for the scheduler's report."""
        cfg = engine.config
        self.engine = engine
        self.holds = holds
        self.verifier = Verifier(
            engine, tolerance=cfg.verify_tolerance, quarantine_s=cfg.verify_quarantine_s
        )
        self._quarantined = quarantined

    def stats(self) -> dict[str, int]:
        """Counters for the control channel's ``stats``: chunks found right and wrong, the
        largest error of a chunk found right and the smallest of one found wrong (-1: none),
        in millionths."""
        v = self.verifier
        least_bad = v.least_bad if v.least_bad != float("inf") else -1e-6
        return {
            "verify_chunks": v.chunks,
            "verify_states": v.states,
            "verify_mismatches": sum(v.mismatches.values()),
            "verify_worst_ok_ppm": round(v.worst_ok * 1e6),
            "verify_least_bad_ppm": round(least_bad * 1e6),
        }

    def run(self, spec: VerifySpec, ready: Marker) -> None:
        """Verify ``spec`` (its KV is written once ``ready`` is reached)."""
        hold = self.holds.take(spec.req_id, spec.hold_id) if spec.hold_id is not None else None
        if not self.verifier.available:  # the scheduler samples none of these (pages_verifiable)
            if hold is not None:
                hold.release()
            return
        if hold is None:
            hold = self.engine.hold(spec.tokens, spec.scope)
        n = len(spec.tokens)
        slots = torch.from_numpy(
            spec_slots(
                spec.block_ids, spec.groups, self.engine.layout.slot_block_sizes, n, spec.start, n
            )
        )
        with hold:
            checks = self.verifier.check(spec.tokens, slots, hold, ready=ready)
            for boundary, blocks in spec.states:  # a Mamba hybrid's state at the hit's end
                if hold.state is not None and hold.state[0] == boundary:
                    state = self.verifier.check_state(
                        spec.tokens, spec.scope, hold, blocks, ready=ready
                    )
                    checks += [state] if state is not None else []
        bad = {c.tier for c in checks if not c.ok}
        if bad:
            self._quarantined([(t, self.verifier.quarantine_s) for t in sorted(bad)])
        logger.debug(
            "kvtier: request %s verified: %d chunk(s), worst error %.3g",
            spec.req_id,
            len(checks),
            max((c.error for c in checks), default=0.0),
        )
