"""The scheduler half of ``KVTierConnector`` (EngineCore process, next to vLLM's scheduler).

Nothing here waits: no socket, disk or Redis call runs inside ``schedule()``.
``get_num_new_matched_tokens`` first asks the scheduler's index of stored chunks
(``presence.py``, fed by the workers' per-step reports) whether the prompt may hit beyond what
vLLM already has. If not, and every tier can be listed, the answer is 0 at once. Otherwise it
sends a *probe* (``probes.py``) to the workers with the next step's metadata and answers
``None`` ("not yet": the request stays waiting while others run); the workers look the prompt
up in every tier on their own threads and *hold* what they find (``holds.py``: lower-tier hits
are read into host memory now), and once every rank has answered, the next call returns the hit
(the minimum over ranks), cut to whole blocks and at most ``n - 1`` tokens (the last prompt
token is always recomputed, to produce the first logits). The load reads exactly the held
chunks, so a chunk evicted in between cannot make it come up short. A probe not answered within
``lookup_timeout_s`` is a miss. Every later decision about a hold (load it, or drop it because
vLLM will not load: no external tokens allocated, request finished or aborted) reaches the
workers in the next step's metadata. ``build_connector_meta`` turns the step's schedule into
probes, loads (tokens vLLM must not compute), hold releases and saves (chunks completed by this
step's forward pass).

Every lookup, load and save is keyed by the request's identity (``identity.py``): its scope
(salt, LoRA adapter, weights generation) and its identity tokens (multimodal placeholders
replaced by content-derived ids). Prompt-embedding requests are neither looked up nor saved.
With ``load_async`` (the default; not with ``use_layerwise``) a hit is loaded while vLLM runs
other requests: the lookup answers ``load_async=True``, vLLM parks the request in
WAITING_FOR_REMOTE_KVS with its blocks allocated, and the load goes to the workers in the next
step's metadata without the request being scheduled; it runs on a worker thread and is reported
in ``get_finished``.

``reset_cache`` starts a new weights generation: chunks of the old weights are never served
again, and requests running across the reset save nothing more (their KV mixes generations).

The time kvtier's hooks take in each scheduler step is the ``scheduler_seconds`` metric.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import KeyScope
from kvtier.vllm_integration.events import EventLog
from kvtier.vllm_integration.identity import (
    adapter_identity,
    cacheable,
    identity_tokens,
)
from kvtier.vllm_integration.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.vllm_integration.presence import KVTierWorkerMeta, PresenceIndex, RankReport
from kvtier.vllm_integration.probes import Probe, ProbeSpec, PromptHashes, Sightings
from kvtier.vllm_integration.stats import KVTierStats, StatsTracker

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier")

HOLD_TTL_MIN_S = 30.0


def hold_ttl_s(config: KVTierConfig) -> float:
    """How long the worker keeps a probe's hold with no load: 10x ``lookup_timeout_s``, at
    least 30 s. A load normally follows its probe within a step or two, and a request waiting
    longer than half of this is probed again, so only a lost hold (a decision the worker never
    heard of) lives this long."""
    return max(HOLD_TTL_MIN_S, 10.0 * config.lookup_timeout_s)


@dataclass
class _Request:
    """What the scheduler side tracks for one live request."""

    request: Request
    adapter: str | None
    prompt: np.ndarray  # identity tokens of the prompt
    generation: str | None  # the generation its KV is computed under
    block_ids: list[int] = field(default_factory=list)
    external: int = 0  # tokens to load in the request's next scheduled step
    hold_id: int | None = None  # the worker's hold those tokens are loaded from
    probe: Probe | None = None  # the lookup in flight or answered, not yet used by a load
    hashes: PromptHashes | None = None
    indexed: tuple[int, int] = (-1, 0)  # (index version, tokens it said) at the last lookup
    computed_at_lookup: int = 0  # tokens vLLM already had (its prefix cache) at the lookup
    load_async: bool = False  # what the last lookup answered
    saved_upto: int = 0  # tokens handed to the worker for saving
    prompt_saved: bool = False
    had_save: bool = False

    @property
    def scope(self) -> KeyScope:
        return KeyScope(self.request.cache_salt, self.adapter, self.generation)


class SchedulerSide:
    """Lookups, loads and saves decided on the scheduler (see the module docstring)."""

    def __init__(
        self,
        config: KVTierConfig,
        *,
        block_size: int,
        engine_id: str,
        num_workers: int,
        load_failure_policy: str,
        kv_events: bool = False,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self._reqs: dict[str, _Request] = {}
        self.num_workers = num_workers
        self.index = PresenceIndex(num_workers)
        self.events = EventLog(
            block_size, kv_events, lambda h, scope: self.index.digest(0, h, scope)
        )
        self.sightings = Sightings(config.store_threshold)
        self._next_hold_id = 0
        self._releases: list[tuple[str, int]] = []
        self._probes: list[ProbeSpec] = []  # for the next step's metadata
        self._async_loads: list[LoadSpec] = []  # for the next step's metadata
        self._saving: set[str] = set()  # finished requests whose blocks wait for their saves
        self._load_async = config.load_async and not config.use_layerwise
        self.generation: str | None = None
        self._step_seconds = 0.0  # kvtier's time in the current scheduler step
        # Scheduler-process counters.
        self.stats = {
            "lookups": 0,
            "lookup_failures": 0,
            "hit_tokens": 0,
            "uncacheable": 0,
            "probes": 0,
        }
        # A request's last lookup: its hit (the minimum over ranks) and where each chunk was found
        # (rank 0's hold: ``[[start, end, tier], ...]``), for ``hit_sources``.
        self._hit_spans: dict[str, tuple[int, list[list[Any]]]] = {}
        self.metrics = StatsTracker()
        if load_failure_policy != "recompute":
            logger.warning(
                "kvtier: kv_load_failure_policy=%r: a load whose lookup hold expired (no load "
                "within %.0f s of the lookup) and whose chunks were evicted meanwhile fails the "
                "request; set kv_load_failure_policy='recompute' to recompute it instead",
                load_failure_policy,
                hold_ttl_s(config),
            )

    def _state(self, request: Request) -> _Request:
        state = self._reqs.get(request.request_id)
        if state is None:
            prompt = identity_tokens(request, request.prompt_token_ids or [])
            state = _Request(
                request, adapter_identity(request.lora_request), prompt, self.generation
            )
            self._reqs[request.request_id] = state
            if self.sightings.threshold > 1:
                self.sightings.see(self._hashes(state))
        return state

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the time spent inside into this step's ``scheduler_seconds``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._step_seconds += time.perf_counter() - t0

    def _hashes(self, state: _Request) -> PromptHashes:
        if state.hashes is None:
            state.hashes = PromptHashes(
                state.prompt,
                state.scope,
                self.chunk_size,
                self.block_size,
                self.config.save_unfull_chunk,
            )
        return state.hashes

    def _may_hit(self, state: _Request, num_computed_tokens: int, most: int) -> bool:
        """Whether a probe may find more than vLLM has: the index says so, or a tier it cannot
        list (or a worker that has not reported yet) might."""
        if not self.index.complete:
            return True
        version, hit = state.indexed
        if version != self.index.version:  # a waiting request is asked every step: hash once
            hit = self._hashes(state).indexed_hit(self.index)
            state.indexed = (self.index.version, hit)
        hit = min(hit, most)
        return hit - hit % self.block_size > num_computed_tokens

    def _release_probe(self, state: _Request) -> None:
        if state.probe is not None:
            self._releases.append((state.request.request_id, state.probe.hold_id))
            state.probe = None

    def _probe(self, state: _Request, num_computed_tokens: int, most: int) -> Probe | None:
        """The request's answered probe; None while there is none yet (one is sent if the
        request may hit) or it is in flight."""
        now = time.monotonic()
        probe = state.probe
        if probe is not None and now - probe.sent_at > hold_ttl_s(self.config) / 2:
            self._release_probe(state)  # its hold is about to expire: look again
            probe = None
        if probe is None:
            if not self._may_hit(state, num_computed_tokens, most):
                return Probe(-1, now, expired=True)  # a miss, nothing held
            rid = state.request.request_id
            probe = state.probe = Probe(self._next_hold_id, now)
            self._next_hold_id += 1
            self._probes.append(ProbeSpec(rid, probe.hold_id, state.prompt, state.scope))
            self.stats["probes"] += 1
            return None
        if probe.answered(self.num_workers):
            return probe
        if now - probe.sent_at < self.config.lookup_timeout_s:
            return None
        self.stats["lookup_failures"] += 1
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

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        if not cacheable(request):
            self.stats["uncacheable"] += 1
            return 0, False
        n = len(prompt)
        bs = self.block_size
        most = (n - 1) // bs * bs  # the last prompt token is always recomputed
        if most <= num_computed_tokens:
            return 0, False
        state = self._state(request)
        if state.generation != self.generation:
            return 0, False  # it started under older weights: nothing of theirs is served
        probe = self._probe(state, num_computed_tokens, most)
        if probe is None:
            return None, False  # not yet: the workers are looking
        self.stats["lookups"] += 1
        hit = min(probe.hit, most)
        hit -= hit % bs
        self._hit_spans[request.request_id] = (hit, probe.sources)
        new = max(0, hit - num_computed_tokens)
        self.stats["hit_tokens"] += new
        state.computed_at_lookup = num_computed_tokens
        state.load_async = self._load_async and new > 0
        return new, state.load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._state(request)
        if not num_external_tokens:
            state.external = 0
            self._release_probe(state)
            return
        assert state.probe is not None, "external tokens without an answered lookup"
        hold_id, state.probe = state.probe.hold_id, None
        if not state.load_async:
            state.external, state.hold_id = num_external_tokens, hold_id
            return
        # Not scheduled until the load is reported: it goes out with the next step's metadata.
        start = state.computed_at_lookup
        end = start + num_external_tokens
        self._async_loads.append(
            LoadSpec(
                request.request_id,
                state.prompt,
                list(blocks.get_block_ids()[0]),
                start,
                end,
                state.scope,
                hold_id,
                load_async=True,
            )
        )
        state.external = 0
        state.saved_upto = max(state.saved_upto, end // self.chunk_size * self.chunk_size)

    def _expect(self, state: _Request, skip: int, end: int) -> None:
        """Tell the index (and the KV event log) what a save just asked for will store."""
        spans = self._hashes(state).saved_spans(skip, end)
        self.index.expect([h for h, _, _ in spans], state.scope)
        self.events.expect(state.request, spans, state.scope)

    def _save_spec(self, rid: str, state: _Request, end: int) -> SaveSpec | None:
        """The save this step's forward pass makes possible (tokens ``[0, end)`` have KV)."""
        req = state.request
        if not cacheable(req) or state.generation != self.generation:
            return None
        prompt_len = req.num_prompt_tokens
        c = self.chunk_size
        if end < prompt_len:
            save_end = end // c * c  # mid-prefill: full chunks only
        elif not state.prompt_saved:
            state.prompt_saved = True
            save_end = prompt_len  # the engine stores the block-aligned tail as a partial chunk
            if self.config.save_decode_cache:
                save_end = max(save_end, min(end, len(req.all_token_ids)) // c * c)
        elif self.config.save_decode_cache:
            save_end = min(end, len(req.all_token_ids)) // c * c
        else:
            return None
        if self.sightings.threshold > 1 and save_end <= len(state.prompt):
            # Only chunks enough requests contained (store_threshold).
            save_end = min(save_end, self.sightings.storable(self._hashes(state)))
        # What the engine will actually store: whole chunks, plus a block-aligned tail when
        # save_unfull_chunk is set. Nothing storable means no save, so no blocks are held.
        step = self.block_size if self.config.save_unfull_chunk else c
        if save_end - save_end % step <= state.saved_upto:
            return None
        skip = state.saved_upto // c * c
        state.saved_upto = save_end
        if save_end <= len(state.prompt):
            self._expect(state, skip, save_end)
        state.had_save = True
        n_blocks = -(-save_end // self.block_size)
        if save_end <= len(state.prompt):
            tokens = state.prompt[:save_end]
        else:
            tokens = identity_tokens(req, req.all_token_ids[:save_end])
        return SaveSpec(rid, tokens, list(state.block_ids[:n_blocks]), skip, state.scope)

    def _schedule(self, meta: KVTierMetadata, rid: str, computed: int, scheduled: int) -> None:
        state = self._reqs.get(rid)
        if state is None:
            return
        if state.external:
            end = computed
            start = end - state.external
            meta.loads.append(
                LoadSpec(
                    rid, state.prompt, list(state.block_ids), start, end, state.scope, state.hold_id
                )
            )
            state.hold_id = None
            # Everything before the loaded chunk's start is stored already.
            state.saved_upto = max(state.saved_upto, end // self.chunk_size * self.chunk_size)
            state.external = 0
        spec = self._save_spec(rid, state, computed + scheduled)
        if spec is not None:
            meta.saves.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(
            preempted=set(scheduler_output.preempted_req_ids or ()),
            releases=self._releases,
            generation=self.generation,
            loads=self._async_loads,
            probes=self._probes,
        )
        self._releases, self._async_loads, self._probes = [], [], []
        for rid in meta.preempted:
            state = self._reqs.get(rid)
            if state is not None:
                # Its KV is gone; what was saved stays saved, the rest is saved again on resume.
                state.block_ids = []
                state.prompt_saved = False
                state.saved_upto = 0
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._schedule(
                meta,
                new.req_id,
                new.num_computed_tokens,
                scheduler_output.num_scheduled_tokens.get(new.req_id, 0),
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._reqs.get(rid)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            self._schedule(
                meta,
                rid,
                cached.num_computed_tokens[i],
                scheduler_output.num_scheduled_tokens.get(rid, 0),
            )
        return meta

    def end_step(self) -> None:
        """Record kvtier's time in the step that just ended (``scheduler_seconds``)."""
        self.metrics.observe("scheduler_seconds", self._step_seconds)
        self._step_seconds = 0.0

    def request_finished(self, request: Request) -> bool:
        """Whether to keep the request's blocks until the worker's saves of it are done
        (``get_finished``). A hold still pending for the request is released through the next
        step's metadata."""
        rid = request.request_id
        state = self._reqs.pop(rid, None)
        self._hit_spans.pop(rid, None)
        if state is not None:
            self._release_probe(state)
            if state.hold_id is not None:
                self._releases.append((rid, state.hold_id))
        keep = state is not None and state.had_save
        if keep:
            self._saving.add(rid)
        return keep

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The tokens vLLM loads for ``request`` by the tier each came from (rank 0's hold at
        the last lookup): ``{tier name: tokens}``; tokens of no known tier under ``""``."""
        hit, spans = self._hit_spans.get(request.request_id, (0, []))
        # The loaded tokens end where the reported hit ends (see get_num_new_matched_tokens).
        end = min(
            hit, (len(request.prompt_token_ids or ()) - 1) // self.block_size * self.block_size
        )
        end -= end % self.block_size
        start = end - num_external_tokens
        out: dict[str, int] = {}
        for s, e, tier in spans:
            n = min(int(e), end) - max(int(s), start)
            if n > 0:
                out[str(tier)] = out.get(str(tier), 0) + n
        rest = num_external_tokens - sum(out.values())
        if rest > 0:
            out[""] = rest
        return out

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """The scheduler's metrics changed since the last call (``stats.py``)."""
        return self.metrics.delta({"lookup_failures": {"": self.stats["lookup_failures"]}})

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A step's results: saves done (vLLM frees those requests' blocks now), and the
        workers' reports (new chunks for the index, probe answers)."""
        self._saving -= set(output.finished_sending or ())
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            for report in meta.reports.values():
                self._apply(report)

    def _apply(self, report: RankReport) -> None:
        self.index.apply(report)
        if report.rank == 0:
            self.events.stored("local_cpu", report.added)
            self.events.removed("local_cpu", report.evicted)
            for tier, stored, dropped in report.tier_events:
                self.events.stored(tier, stored)
                self.events.removed(tier, dropped)
        for ans in report.answers:
            state = self._reqs.get(ans.req_id)
            probe = state.probe if state is not None else None
            if state is None or probe is None or probe.hold_id != ans.hold_id or probe.expired:
                continue  # a request gone or probed again since: its hold was released
            probe.answers[report.rank] = ans.hit
            if report.rank == 0:
                probe.sources = ans.sources
            # What the index promised beyond the hit is gone on that rank: stop promising it.
            hashes = self._hashes(state)
            self.index.forget(report.rank, hashes.missing_after(ans.hit), hashes.scope)

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come back once their saves are copied off the device:
        vLLM waits for them instead of preempting a running request."""
        return bool(self._saving)

    def reset_cache(self) -> bool:
        """Start a new weights generation (after a weight update): no chunk stored so far is
        served again; the workers drop their host tier when the next step's metadata arrives,
        lower tiers' old chunks become unreachable and age out."""
        self.generation = os.urandom(8).hex()
        logger.info("kvtier: cache reset, new weights generation %s", self.generation)
        return True

    def shutdown(self) -> None:
        self._reqs.clear()
