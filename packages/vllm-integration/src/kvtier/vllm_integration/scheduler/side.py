"""The scheduler half of ``KVTierConnector`` (EngineCore process, next to vLLM's scheduler).

Nothing here waits: no socket, disk or Redis call runs inside ``schedule()``. A lookup
(``get_num_new_matched_tokens``) asks the index of stored chunks (``scheduler/index.py``, fed by the
workers' per-step reports); a prompt that may hit beyond what vLLM has is *probed* on the workers
(``scheduler/lookups.py``, ``scheduler/prompts.py``) and answered "not yet" (``None``) until every
rank has answered with what it holds for the load (``worker/holds.py``); with ``lookup: index`` a
hit the index knows is answered at once and loaded without a hold (``scheduler/lookups.py``). The
hit is the minimum over ranks, cut to whole blocks and at most ``n - 1`` tokens (the last prompt
token is always recomputed). ``build_connector_meta`` turns each step's schedule into probes, loads,
hold releases and saves (``scheduler/save_plan.py``: chunks completed by this step's forward pass).
With ``load_async`` (the default; not with ``use_layerwise``) a hit loads on a worker thread while
the request waits in WAITING_FOR_REMOTE_KVS. With ``offload: lazy`` nothing is saved while a request
runs: its save is remembered when it finishes and sent once vLLM is about to evict its blocks
(``scheduler/lazy.py``). The whole path, step by step: ``docs/serving.md``.

Every lookup, load and save is keyed by the request's identity (``identity.py``): its scope
(salt, LoRA adapter, weights generation) and its identity tokens (multimodal placeholders
replaced by content-derived ids). Prompt-embedding requests are neither looked up nor saved.
``reset_cache`` asks the workers for a digest of their live weights: if they changed, a new
weights generation starts, chunks of the old weights are never served again, and requests
running across the reset save nothing more (their KV mixes weights) (``generation.py``).
The time kvtier's hooks take in each scheduler step is the ``scheduler_seconds`` metric.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvtier.core.config import KVTierConfig
from kvtier.vllm_integration import logs
from kvtier.vllm_integration.groups import CacheGroups
from kvtier.vllm_integration.handover import (
    ConsumerWait,
    Receipts,
    announced,
    announced_receipt,
    check_role,
    producer_params,
)
from kvtier.vllm_integration.identity import adapter_identity, cacheable, identity_tokens
from kvtier.vllm_integration.messages import (
    KVTierMetadata,
    LoadSpec,
    SaveSpec,
)
from kvtier.vllm_integration.scheduler.events import EventLog
from kvtier.vllm_integration.scheduler.frees import BlockFrees
from kvtier.vllm_integration.scheduler.generation import WeightsGeneration
from kvtier.vllm_integration.scheduler.hybrid import HybridBlocks
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.lazy import LazyOffload, target_blocks
from kvtier.vllm_integration.scheduler.lookups import (
    Lookups,
    RequestState,
    lookup_mode,
    warn_load_failure_policy,
)
from kvtier.vllm_integration.scheduler.outputs import StepOutputs
from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt, Sightings
from kvtier.vllm_integration.scheduler.save_plan import SavePlanner
from kvtier.vllm_integration.scheduler.steps import track_blocks
from kvtier.vllm_integration.scheduler.verify import VerifySampling
from kvtier.vllm_integration.stats import KVTierStats, StatsTracker, StepTimer

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier")


class SchedulerSide:
    """Lookups, loads and saves decided on the scheduler (see the module docstring)."""

    def __init__(
        self,
        config: KVTierConfig,
        *,
        block_size: int,
        num_workers: int,
        load_failure_policy: str,
        kv_events: bool = False,
        max_num_batched_tokens: int = 2048,
        role: str = "kv_both",
        verifiable: bool = True,
        groups: CacheGroups | None = None,
        engine_id: str = "",
    ) -> None:
        self.config = config
        check_role(config, role)  # a producer saves and never loads, a consumer the reverse
        self.loads_enabled = role in ("kv_both", "kv_consumer")
        self.saves_enabled = role in ("kv_both", "kv_producer")
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.hybrid = HybridBlocks(groups or CacheGroups(), block_size)
        self._primary = self.hybrid.groups.primary  # the group whose block ids are tracked
        self._reqs: dict[str, RequestState] = {}
        self.num_workers = num_workers
        self.index = PresenceIndex(num_workers)
        self.verify = VerifySampling(config, role, block_size, verifiable=verifiable)
        # A consumer waits (bounded) for the chunks a producer announced (handover.py).
        self.waits = ConsumerWait(config) if role == "kv_consumer" else None
        # A producer's receipts: written after each request's last save (handover.py).
        self.receipts = Receipts(engine_id) if role == "kv_producer" else None
        self.lookups = Lookups(
            config,
            self.index,
            num_workers,
            # A Mamba hybrid's hit needs a state entry the index does not track: probed.
            "probe" if self.hybrid.groups.mambas else lookup_mode(config, load_failure_policy),
            index_trusted=lambda: self.verify.index_trusted,
            stateful=bool(self.hybrid.groups.mambas),
        )
        self.events = EventLog(
            block_size,
            kv_events,
            lambda h, scope: self.index.digest(0, h, scope),
            self.hybrid.groups.event_specs,
            self.hybrid.groups.mambas,
        )
        self.sightings = Sightings(config.store_threshold)
        self.saves = SavePlanner(
            config, block_size, self.sightings, self._hashes, self.index, self.events
        )
        self.lazy: LazyOffload | None = None
        if config.offload == "lazy" and self.saves_enabled:
            target = target_blocks(max_num_batched_tokens, block_size)
            self.lazy = LazyOffload(block_size, target, num_workers)
        self._async_loads: list[LoadSpec] = []  # for the next step's metadata
        self.frees = BlockFrees(num_workers)
        self.weights = WeightsGeneration(num_workers)
        self.outputs = StepOutputs(
            self._reqs,
            self.index,
            self.lookups,
            self.frees,
            self.events,
            self.verify,
            self.lazy,
            self._hashes,
            self.chunk_size,
            self.weights,
        )
        self._step = 0  # serial number of the step whose metadata is being built
        self._counts = {"lookups": 0, "hit_tokens": 0, "uncacheable": 0}
        self.metrics = StatsTracker()
        self.timer = StepTimer(self.metrics, "scheduler")  # kvtier's time in each step
        warn_load_failure_policy(load_failure_policy, config)

    @property
    def generation(self) -> str | None:
        """The weights generation requests arriving now are keyed under
        (``scheduler/generation.py``)."""
        return self.weights.for_new_requests

    @property
    def stats(self) -> dict[str, int]:
        """Scheduler-process counters."""
        out = dict(self._counts)
        out.update(
            probes=self.lookups.sent,
            indexed_hits=self.lookups.indexed,
            lookup_failures=self.lookups.failures,
            window_drains=self.hybrid.drains,
        )
        if self.waits is not None:
            out.update(
                consumer_wait_timeouts=self.waits.timeouts,
                consumer_waits_settled_short=self.waits.settled_short,
            )
        out.update(self.frees.stats)
        if self.lazy is not None:
            out.update(self.lazy.stats)
        return out

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        """vLLM's block pool (lazy offload walks its free queue and touches blocks)."""
        if self.lazy is not None:
            self.lazy.bind(pool)

    def _state(self, request: Request) -> RequestState:
        state = self._reqs.get(request.request_id)
        if state is None:
            prompt = identity_tokens(request, request.prompt_token_ids or [])
            state = RequestState(
                request, adapter_identity(request.lora_request), prompt, self.generation
            )
            self._reqs[request.request_id] = state
            if self.sightings.threshold > 1:
                self.sightings.see(self._hashes(state))
        return state

    def _hashes(self, state: RequestState) -> IndexedPrompt:
        return self.lookups.hashes(state, self.chunk_size, self.block_size)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids
        if not prompt or not self.loads_enabled:
            return 0, False
        if not cacheable(request):
            self._counts["uncacheable"] += 1
            return 0, False
        n = len(prompt)
        bs = self.block_size
        most = (n - 1) // bs * bs  # the last prompt token is always recomputed
        if most <= num_computed_tokens:
            return 0, False
        if self.weights.pending:
            # A reset: the next step's metadata asks the workers what weights they serve.
            return (
                (None, False)
                if self.weights.waited() < self.config.lookup_timeout_s
                else (0, False)
            )
        state = self._state(request)
        if state.load_failed:
            return 0, False
        if state.generation != self.generation:
            return 0, False  # it started under other weights than the cache's now
        if state.verify is not None:
            return 0, False  # sampled for verification: vLLM computes its prefix
        waits = self.waits
        params = request.kv_transfer_params
        expected = min(announced(params), most) if waits else 0
        if waits and expected and state.probe is None and not waits.may_probe(request.request_id):
            return None, False  # waiting for a producer's chunks: probed again shortly
        receipt = announced_receipt(params) if expected else None
        probe = self.lookups.probe(state, self._hashes(state), num_computed_tokens, most, receipt)
        if probe is None:
            return None, False  # not yet: the workers are looking
        hit = min(probe.hit, most) if probe.agreed or not self.hybrid.groups.mambas else 0
        hit -= hit % bs
        if (
            waits
            and expected
            and waits.keep_waiting(request.request_id, hit, expected - expected % bs, probe.settled)
        ):
            self.lookups.release(state)  # look again: the producer's writes may land
            return None, False
        self._counts["lookups"] += 1
        hold_id = None if probe.indexed else probe.hold_id
        if self.verify.sample(state, num_computed_tokens, hit, hold_id):
            state.probe = None  # its hold now belongs to the check
            logs.verify_sampled(request.request_id, num_computed_tokens, hit)
            return 0, False
        self.lookups.record(request.request_id, hit, probe.sources)
        new = max(0, hit - num_computed_tokens)
        self._counts["hit_tokens"] += new
        state.computed_at_lookup = num_computed_tokens
        state.load_async = self.config.loads_async and new > 0
        logs.lookup(request.request_id, n, num_computed_tokens, new, probe, state.load_async)
        return new, state.load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._state(request)
        if not num_external_tokens:
            state.external = 0
            self.lookups.release(state)
            return
        assert state.probe is not None, "external tokens without an answered lookup"
        probe, state.probe = state.probe, None
        hold_id = None if probe.indexed else probe.hold_id
        if not state.load_async:
            state.external, state.hold_id = num_external_tokens, hold_id
            return
        # Not scheduled until the load is reported: it goes out with the next step's metadata.
        start = state.computed_at_lookup
        end = start + num_external_tokens
        groups = blocks.get_block_ids()
        block_ids = list(groups[self._primary])
        state.block_ids = list(block_ids)  # where a failed load is reported (_load_failures)
        load = LoadSpec(
            request.request_id, state.prompt, block_ids, start, end, state.scope, hold_id, True
        )
        self.hybrid.attach(load, groups)
        self._async_loads.append(load)
        state.external = 0
        state.saved_upto = max(state.saved_upto, end // self.chunk_size * self.chunk_size)

    def _current(self, state: RequestState) -> bool:
        """Whether ``state``'s KV is of the weights keys are made under now (no reset pending,
        none that changed them since it arrived)."""
        return state.generation == self.generation and not self.weights.pending

    def _save_spec(
        self, rid: str, state: RequestState, end: int, *, expect: bool = True
    ) -> SaveSpec | None:
        if not self.saves_enabled or self.weights.pending:
            return None
        return self.saves.spec(rid, state, end, self.generation, self._step, expect=expect)

    def _schedule(self, meta: KVTierMetadata, rid: str, computed: int, scheduled: int) -> None:
        state = self._reqs.get(rid)
        if state is None:
            return
        check = self.verify.due(rid, state, computed + scheduled, self._step)
        if check is not None:
            self.hybrid.attach(check, state.groups)
            end = len(check.tokens)  # a Mamba hybrid's state there, if vLLM offered it
            check.states = [s for s in self.hybrid.states(rid, self.chunk_size, end) if s[0] == end]
            meta.verifies.append(check)
        if state.external:
            end = computed
            start = end - state.external
            load = LoadSpec(
                rid, state.prompt, list(state.block_ids), start, end, state.scope, state.hold_id
            )
            self.hybrid.attach(load, state.groups)
            meta.loads.append(load)
            state.hold_id = None
            # Everything before the loaded chunk's start is stored already.
            state.saved_upto = max(state.saved_upto, end // self.chunk_size * self.chunk_size)
            state.external = 0
        if self.lazy is not None:
            return  # saved when it finishes and vLLM is about to evict its blocks
        spec = self._save_spec(rid, state, computed + scheduled)
        if self.saves_enabled and self._current(state):
            spec = self.hybrid.with_states(rid, state, spec, self.chunk_size, self._step)
        if spec is not None:
            self.hybrid.attach(spec, state.groups)
            meta.saves.append(spec)
        if self.receipts is not None and self._current(state):
            receipt = self.receipts.due(rid, state.prompt_saved, state.scope)
            if receipt is not None:
                meta.receipts.append(receipt)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        releases, probes = self.lookups.take()
        self._step += 1
        meta = KVTierMetadata(
            preempted=set(scheduler_output.preempted_req_ids or ()),
            releases=releases,
            generation=self.weights.current,
            weights_epoch=self.weights.epoch,
            loads=self._async_loads,
            probes=probes,
            step=self._step,
            unheld=self.frees.take_unheld(),
        )
        self._async_loads = []
        if self.receipts is not None:
            for rid in scheduler_output.preempted_req_ids or ():
                self.receipts.preempted(rid)
        self.hybrid.take_offers(scheduler_output)
        for rid, computed, scheduled in track_blocks(
            scheduler_output, self._reqs, self._primary, self.hybrid
        ):
            self._schedule(meta, rid, computed, scheduled)
        if self.lazy is not None:
            for spec, state in self.lazy.due():
                if state.generation == self.generation:
                    self.saves.expect(state, spec.skip, len(spec.tokens))
                meta.lazy_saves.append(spec)
        self.hybrid.fence(meta, scheduler_output, self.frees.copied_through)
        return meta

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        """vLLM's cache manager: a hybrid model's block ids of every group come from it."""
        self.hybrid.bind(manager)

    def finished(
        self, request: Request, block_ids: list[int] | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: whether to keep the blocks (``request_finished``), and
        the request's ``kv_transfer_params``: a producer announces what it stored of the prompt
        (``handover.py``)."""
        params = None
        state = self._reqs.get(request.request_id)
        receipt = self.receipts.finished(request.request_id) if self.receipts else None
        if not self.loads_enabled and state is not None and self._current(state):
            params = producer_params(state.saved_upto, len(state.prompt), self.saves.step, receipt)
        if self.waits is not None:
            self.waits.done(request.request_id)
        return self.request_finished(request, block_ids), params

    def request_finished(self, request: Request, block_ids: list[int] | None = None) -> bool:
        """Whether to keep the request's blocks until the worker's saves of it are done
        (``get_finished``); not when every rank has copied them already
        (``scheduler/frees.py``). A hold still pending for the request is released through the
        next step's metadata. With lazy offload the request's save is remembered instead (its
        blocks stay in vLLM's prefix cache)."""
        rid = request.request_id
        state = self._reqs.pop(rid, None)
        self.lookups.finished(rid, state)
        if state is None:
            return False
        if state.verify is not None and state.verify.hold_id is not None:
            self.lookups.releases.append((rid, state.verify.hold_id))  # never checked
        if self.lazy is not None:
            if block_ids is not None:
                state.block_ids = list(block_ids)
            spec = self._save_spec(rid, state, request.num_computed_tokens, expect=False)
            if spec is not None:
                self.lazy.remember(spec, self.saves.step, state)
            logs.finished(rid, "lazy save remembered" if spec else "nothing to save")
            # A check still reading its blocks keeps them (lazy saves are copied later).
            return self.frees.finished(rid, state.verify_step)
        held = self.frees.finished(rid, max(state.last_save_step, state.verify_step))
        logs.finished(rid, "blocks held for its saves" if held else "blocks freed now")
        return held

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """The scheduler's metrics changed since the last call (``stats.py``)."""
        return self.metrics.delta(
            {
                "lookup_failures": {"": self.lookups.failures},
                "verify_requests": {"": self.verify.requests},
                "verify_tokens": {"": self.verify.tokens},
            }
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A step's results (``scheduler/outputs.py``)."""
        self.outputs.apply(output)

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come back once their saves are copied off the device
        (and lazily saved blocks once their copies are): vLLM waits for them instead of
        preempting a running request."""
        return self.frees.pending or (self.lazy is not None and self.lazy.pending)

    def reset_cache(self) -> bool:
        """After a weight update (or to start over): the workers digest their live weights with
        the next step's metadata, and the generation follows what they find
        (``scheduler/generation.py``): unchanged weights keep their chunks, changed ones start a
        generation no chunk of the old weights is served in (the workers drop their host tier,
        lower tiers' old chunks become unreachable and age out)."""
        self.weights.reset()
        if self.lazy is not None:
            self.lazy.clear()
        logger.info("kvtier: cache reset %d: the workers digest their weights", self.weights.epoch)
        return True

    def shutdown(self) -> None:
        self._reqs.clear()
