"""The scheduler side's lookups: per-request state, and the probe state machine.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.identity import keyable
from kvtier.vllm_integration.messages import ProbeAnswer, ProbeSpec, hold_ttl_s
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt, Probe

if TYPE_CHECKING:
    from vllm.v1.request import Request

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


@dataclass
class PendingVerify:
    """A request sampled for verification (``scheduler/verify.py``): checked once vLLM has
    computed tokens ``[start, end)`` itself."""

    start: int  # tokens vLLM had already (its prefix cache): not recomputed, not compared
    end: int  # the hit the lookup found
    hold_id: int | None  # the workers' hold of the hit (None: the index answered)


@dataclass
class RequestState:
    """What the scheduler side tracks for one live request."""

    request: Request
    adapter: str | None
    prompt: np.ndarray  # identity tokens of the prompt
    generation: str | None  # the generation its KV is computed under
    block_ids: list[int] = field(default_factory=list)
    external: int = 0  # tokens to load in the request's next scheduled step
    hold_id: int | None = None  # the worker's hold those tokens are loaded from
    probe: Probe | None = None  # the lookup in flight or answered, not yet used by a load
    hashes: IndexedPrompt | None = None
    indexed: tuple[int, int] = (-1, 0)  # (index version, tokens it said) at the last lookup
    computed_at_lookup: int = 0  # tokens vLLM already had (its prefix cache) at the lookup
    load_async: bool = False  # what the last lookup answered
    saved_upto: int = 0  # tokens handed to the worker for saving
    prompt_saved: bool = False
    last_save_step: int = -1  # the step whose metadata carried its last save (-1: none)
    # A load of it failed (vLLM recomputes the blocks): never offered again, so a chunk that
    # cannot be loaded is not retried step after step.
    load_failed: bool = False
    verify: PendingVerify | None = None  # sampled for verification, its check not sent yet
    verify_step: int = -1  # the step whose metadata carried its check (-1: none)
    # A hybrid model's live block ids of every KV cache group this step, and the first token
    # from which every window group still has its blocks (``scheduler/hybrid.py``).
    groups: list[list[int]] | None = None
    live_from: int = 0

    @property
    def cacheable(self) -> bool:
        """Whether it may be looked up and saved (``identity.keyable``, with the adapter
        identity taken when it arrived)."""
        return keyable(self.request, self.adapter)

    @property
    def scope(self) -> KeyScope:
        return KeyScope(self.request.cache_salt, self.adapter, self.generation)


class Lookups:
    """Probes: which to send, which are answered, which holds to release."""

    def __init__(
        self,
        config: KVTierConfig,
        index: PresenceIndex,
        num_workers: int,
        mode: str = "probe",
        index_trusted: Callable[[], bool] = lambda: True,
        stateful: bool = False,
    ) -> None:
        """``index_trusted()``: False while the index's answers must be confirmed by probes
        (a tier is quarantined: ``scheduler/verify.py``). ``stateful``: a Mamba hybrid's, whose
        probes answer where a state entry ends the hit: a shorter answer than the index's says
        nothing of the chunks after it (they are not forgotten)."""
        self.stateful = stateful
        self.config = config
        self._index_trusted = index_trusted
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

    def hashes(self, state: RequestState, chunk_size: int, block_size: int) -> IndexedPrompt:
        if state.hashes is None:
            state.hashes = IndexedPrompt(
                state.prompt, state.scope, chunk_size, block_size, self.config.save_unfull_chunk
            )
        return state.hashes

    def take(self) -> tuple[list[tuple[str, int]], list[ProbeSpec]]:
        """The releases and probes for the step being built."""
        out = (self.releases, self.probes)
        self.releases, self.probes = [], []
        return out

    def _indexed_hit(self, state: RequestState, hashes: IndexedPrompt, most: int) -> int:
        """Whole blocks, at most ``most`` tokens, the index says every rank stores."""
        version, hit = state.indexed
        if version != self.index.version:  # a waiting request is asked every step: hash once
            hit = hashes.indexed_hit(self.index)
            state.indexed = (self.index.version, hit)
        hit = min(hit, most)
        return hit - hit % hashes.block_size

    def _may_hit(
        self, state: RequestState, hashes: IndexedPrompt, computed: int, most: int
    ) -> bool:
        """Whether a probe may find more than vLLM has: the index says so, or a tier it cannot
        list (or a worker that has not reported yet) might. With host memory as the only tier,
        an index still waiting for a worker's first report is an empty one: nothing was stored
        before this process started, and every save is reported with the step that made it (so
        a miss is answered at once, and a sibling connector's hit is not held back)."""
        if not self.index.ready:
            return list(self.config.tiers) != ["local_cpu"]
        if not self.index.complete:
            return True
        return self._indexed_hit(state, hashes, most) > computed

    def record(self, req_id: str, hit: int, sources: list[list[Any]]) -> None:
        """The hit vLLM was given for ``req_id`` and where it was found (for ``sources``)."""
        self.spans[req_id] = (hit, sources)

    def finished(self, rid: str, state: RequestState | None) -> None:
        """Request ``rid`` is done: forget its lookup and release any hold it still has on the
        workers (its probe's, or the one kept for its load)."""
        self.spans.pop(rid, None)
        if state is None:
            return
        self.release(state)
        if state.hold_id is not None:
            self.releases.append((rid, state.hold_id))

    def release(self, state: RequestState) -> None:
        """Let the worker drop the request's probe hold (it will not be loaded)."""
        if state.probe is not None:
            if not state.probe.indexed:
                self.releases.append((state.request.request_id, state.probe.hold_id))
            state.probe = None

    def probe(
        self,
        state: RequestState,
        hashes: IndexedPrompt,
        computed: int,
        most: int,
        receipt: bytes | None = None,
    ) -> Probe | None:
        """The request's answered probe; None while there is none yet (one is sent if the
        request may hit) or it is in flight. ``receipt``: a consumer request's, from its
        producer's announcement (the workers ask for it before the chunks)."""
        now = time.monotonic()
        probe = state.probe
        if probe is None and self.mode == "index" and self.index.complete and self._index_trusted():
            hit = self._indexed_hit(state, hashes, most)
            if hit > computed:
                self.indexed += 1
                answers = dict.fromkeys(range(self.num_workers), hit)
                sources = hashes.indexed_sources(self.index, hit)
                state.probe = Probe(-1, now, answers, sources, indexed=True)
                return state.probe
        if probe is not None and now - probe.sent_at > hold_ttl_s(self.config) / 2:
            self.release(state)  # its hold is about to expire: look again
            probe = None
        if probe is None:
            if not self._may_hit(state, hashes, computed, most):
                return Probe(-1, now, expired=True)  # a miss, nothing held
            rid = state.request.request_id
            probe = state.probe = Probe(self._next_hold_id, now)
            self._next_hold_id += 1
            self.probes.append(ProbeSpec(rid, probe.hold_id, state.prompt, state.scope, receipt))
            self.sent += 1
            logger.debug("kvtier: request %s: probe %d goes to the workers", rid, probe.hold_id)
            return None
        if probe.answered(self.num_workers):
            return probe
        if now - probe.sent_at < self.config.lookup_timeout_s:
            return None
        self.failures += 1
        logger.warning(
            "kvtier: %d of %d worker(s) did not answer the lookup of request %s in "
            "%.1f s (lookup_timeout_s); treating it as a miss",
            self.num_workers - len(probe.answers),
            self.num_workers,
            state.request.request_id,
            self.config.lookup_timeout_s,
        )
        probe.expired = True
        return probe

    def answer(
        self, state: RequestState | None, hashes: IndexedPrompt | None, rank: int, ans: ProbeAnswer
    ) -> None:
        """A rank's answer to a probe (ignored if the request is gone or was probed again)."""
        probe = state.probe if state is not None else None
        if probe is None or probe.hold_id != ans.hold_id or probe.expired or hashes is None:
            return  # a request gone or probed again since: its hold was released
        probe.answers[rank] = ans.hit
        if ans.settled:
            probe.receipts.add(rank)
        if rank == 0:
            probe.sources = ans.sources
        if not self.stateful:
            self.shortfall(hashes, rank, ans.hit)

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
