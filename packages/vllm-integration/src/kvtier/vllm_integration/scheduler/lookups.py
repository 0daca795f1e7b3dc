"""The scheduler side's lookups: which probes to send, and their answers (a policy: it writes
no request state; ``scheduler/request.py`` asks it).

A waiting request is first checked against the index of stored chunks (``scheduler/index.py``); if
it may hit beyond what vLLM already has, a *probe* (``scheduler/prompts.py``) goes to the workers
with the next step's metadata and the lookup answers "not yet" until every rank has answered or
``lookup_timeout_s`` has passed (a miss). The answer is the minimum hit over ranks; each rank's hold
keeps the chunks it found until the load (or a release) reaches it.

With ``lookup: index`` (``lookup_mode``) a hit the index knows on every rank is answered at
once, without a probe or a hold: the load reads the tiers on the worker's loader thread, and a
chunk evicted meanwhile comes up short, is recomputed by vLLM (``kv_load_failure_policy=
"recompute"``) and is forgotten by the index (``shortfall``). Tiers the index cannot list
(Redis) keep the probe: only a probe can see what other engines wrote.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.vllm_integration.messages import ProbeAnswer, ProbeSpec, hold_ttl_s
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt, Probe

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvtier.vllm_integration.scheduler.request_state import TrackedRequest

logger = logging.getLogger("kvtier")


def lookup_mode(config: KVTierConfig, policy: str) -> str:
    """``probe`` or ``index``: how this engine confirms hits (``KVTierConfig.lookup``, resolved
    against vLLM's ``kv_load_failure_policy``)."""
    can_index = config.loads_async and policy == "recompute"
    if config.lookup == "index" and not can_index:
        raise ConfigError(
            "lookup",
            config.lookup,
            f"answers from the index need vLLM's kv_load_failure_policy='recompute' (it is "
            f"{policy!r}): a chunk evicted before its load would fail the request",
        )
    if config.lookup == "auto":
        return "index" if can_index else "probe"
    return config.lookup


def warn_load_failure_policy(policy: str, config: KVTierConfig) -> None:
    """Say what vLLM's ``kv_load_failure_policy`` other than "recompute" risks."""
    if policy != "recompute":
        logger.warning(
            "kvtier: kv_load_failure_policy=%r: a load whose lookup hold expired (no load "
            "within %.0f s of the lookup) and whose chunks were evicted meanwhile fails the "
            "request; set kv_load_failure_policy='recompute' to recompute it instead",
            policy,
            hold_ttl_s(config),
        )


class IndexTrust(Protocol):
    """Whether the index's answers may be served without a probe now."""

    @property
    def index_trusted(self) -> bool: ...


class Lookups:
    """Probes: which to send, which are answered, which holds to release."""

    def __init__(
        self,
        config: KVTierConfig,
        index: PresenceIndex,
        num_workers: int,
        mode: str = "probe",
        trust: IndexTrust | None = None,
        stateful: bool = False,
    ) -> None:
        """``trust``: says when the index's answers must be confirmed by probes (a tier is
        quarantined: ``scheduler/verify.py``); None: always trusted. ``stateful``: a Mamba hybrid's, whose
        probes answer where a state entry ends the hit: a shorter answer than the index's says
        nothing of the chunks after it (they are not forgotten)."""
        self.stateful = stateful
        self.config = config
        self._trust = trust
        self.index = index
        self.num_workers = num_workers
        self.mode = mode  # lookup_mode()
        self.indexed = 0  # hits answered by the index, without a probe
        self._next_hold_id = 0
        self.releases: list[tuple[str, int]] = []  # holds not to be loaded, for the next step
        self.probes: list[ProbeSpec] = []  # lookups for the next step's metadata
        self.sent = 0
        self.failures = 0  # probes not answered within lookup_timeout_s
        # A request's last lookup: its hit (the minimum over ranks) and where each chunk was found
        # (rank 0's hold: ``[[start, end, tier], ...]``), for ``sources``.
        self.spans: dict[str, tuple[int, list[list[Any]]]] = {}

    @property
    def _trusted(self) -> bool:
        return self._trust is None or self._trust.index_trusted

    def take(self) -> tuple[list[tuple[str, int]], list[ProbeSpec]]:
        """The releases and probes for the step being built."""
        out = (self.releases, self.probes)
        self.releases, self.probes = [], []
        return out

    def _indexed_hit(self, req: TrackedRequest, most: int) -> int:
        """Whole blocks, at most ``most`` tokens, the index says every rank stores."""
        hit = min(req.indexed_hit(self.index), most)
        return hit - hit % req.hashes.block_size

    def _may_hit(self, req: TrackedRequest, computed: int, most: int) -> bool:
        """Whether a probe may find more than vLLM has: the index says so, or a tier it cannot
        list (or a worker that has not reported yet) might. With host memory as the only tier,
        an index still waiting for a worker's first report is an empty one: nothing was stored
        before this process started, and every save is reported with the step that made it (so
        a miss is answered at once, and a sibling connector's hit is not held back)."""
        if not self.index.ready:
            return list(self.config.tiers) != ["local_cpu"]
        if not self.index.complete:
            return True
        return self._indexed_hit(req, most) > computed

    def record(self, req_id: str, hit: int, sources: list[list[Any]]) -> None:
        """The hit vLLM was given for ``req_id`` and where it was found (for ``sources``)."""
        self.spans[req_id] = (hit, sources)

    def forget(self, rid: str) -> None:
        """Request ``rid`` is done: forget its lookup."""
        self.spans.pop(rid, None)

    def release(self, rid: str, probe: Probe | None) -> None:
        """Let the workers drop ``probe``'s hold (it will not be loaded)."""
        if probe is not None and not probe.indexed:
            self.releases.append((rid, probe.hold_id))

    def look(
        self,
        req: TrackedRequest,
        computed: int,
        most: int,
        receipt: bytes | None = None,
    ) -> tuple[Probe | None, Probe | None]:
        """``(the probe the request holds now, the answered one)``: the answer is None while
        there is none yet (one is sent if the request may hit) or it is in flight; a miss the
        index rules out is answered without a probe held. ``receipt``: a consumer request's,
        from its producer's announcement (the workers ask for it before the chunks)."""
        now = time.monotonic()
        probe = req.probe
        if probe is None and self.mode == "index" and self.index.complete and self._trusted:
            hit = self._indexed_hit(req, most)
            if hit > computed:
                self.indexed += 1
                answers = dict.fromkeys(range(self.num_workers), hit)
                sources = req.hashes.indexed_sources(self.index, hit)
                probe = Probe(-1, now, answers, sources, indexed=True)
                return probe, probe
        if probe is not None and now - probe.sent_at > hold_ttl_s(self.config) / 2:
            self.release(req.rid, probe)  # its hold is about to expire: look again
            probe = None
        if probe is None:
            if not self._may_hit(req, computed, most):
                return None, Probe(-1, now, expired=True)  # a miss, nothing held
            probe = Probe(self._next_hold_id, now)
            self._next_hold_id += 1
            self.probes.append(ProbeSpec(req.rid, probe.hold_id, req.prompt, req.scope, receipt))
            self.sent += 1
            logger.debug("kvtier: request %s: probe %d goes to the workers", req.rid, probe.hold_id)
            return probe, None
        if probe.answered(self.num_workers):
            return probe, probe
        if now - probe.sent_at < self.config.lookup_timeout_s:
            return probe, None
        self.failures += 1
        logger.warning(
            "kvtier: %d of %d worker(s) did not answer the lookup of request %s in "
            "%.1f s (lookup_timeout_s); treating it as a miss",
            self.num_workers - len(probe.answers),
            self.num_workers,
            req.rid,
            self.config.lookup_timeout_s,
        )
        probe.expired = True
        return probe, probe

    def answer(self, req: TrackedRequest | None, rank: int, ans: ProbeAnswer) -> None:
        """A rank's answer to a probe (ignored if the request is gone or was probed again)."""
        probe = req.probe if req is not None else None
        if req is None or probe is None or probe.hold_id != ans.hold_id or probe.expired:
            return  # a request gone or probed again since: its hold was released
        probe.answers[rank] = ans.hit
        if ans.settled:
            probe.receipts.add(rank)
        if rank == 0:
            probe.sources = ans.sources
        if not self.stateful:
            self.shortfall(req.hashes, rank, ans.hit)

    def sources(
        self, request: Request, num_external_tokens: int, block_size: int
    ) -> dict[str, int]:
        """The tokens vLLM loads for ``request`` by the tier each came from (rank 0's hold at
        the last lookup): ``{tier name: tokens}``; tokens of no known tier under ``""``."""
        hit, spans = self.spans.get(request.request_id, (0, []))
        n = len(request.prompt_token_ids or ())
        return hit_sources(hit, spans, n, block_size, num_external_tokens)

    def shortfall(self, hashes: IndexedPrompt | None, rank: int, found: int) -> None:
        """A probe or a load answered by the index found only the prompt's first ``found``
        tokens on ``rank``: what the index promised after them is gone there."""
        if hashes is not None:
            self.index.forget(rank, hashes.missing_after(found), hashes.scope)


def hit_sources(
    hit: int, spans: list[list[Any]], prompt_len: int, block_size: int, loaded: int
) -> dict[str, int]:
    """The ``loaded`` tokens by the tier each came from (rank 0's hold at the last lookup, whose
    hit was ``hit``): ``{tier name: tokens}``; tokens of no known tier under ``""``."""
    # The loaded tokens end where the reported hit ends (see get_num_new_matched_tokens).
    end = min(hit, (prompt_len - 1) // block_size * block_size)
    end -= end % block_size
    start = end - loaded
    out: dict[str, int] = {}
    for s, e, tier in spans:
        n = min(int(e), end) - max(int(s), start)
        if n > 0:
            out[str(tier)] = out.get(str(tier), 0) + n
    rest = loaded - sum(out.values())
    if rest > 0:
        out[""] = rest
    return out
