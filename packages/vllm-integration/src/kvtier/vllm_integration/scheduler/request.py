"""A request's life on the scheduler side, top-down: the events vLLM's hooks raise for it, and
what each asks of the policies.

1. **Lookup** (``get_num_new_matched_tokens``, every step the request waits): the index of
   stored chunks or a probe of the workers (``scheduler/lookups.py``) finds the hit; "not yet"
   (``None``) until every rank answered. A consumer waits (bounded) for what its producer
   announced (``handover.py``); a hit may be sampled for verification instead of loaded
   (``scheduler/verify.py``). The hit is the minimum over ranks, cut to whole blocks and at most
   ``n - 1`` tokens (the last prompt token is always recomputed).
2. **Allocation** (``update_state_after_alloc``): a hit loads with the request's first step, or
   on a worker thread while it waits in WAITING_FOR_REMOTE_KVS (``load_async``; a short hit
   already in host memory loads with the first step all the same: ``scheduler/sync_loads.py``).
3. **Each scheduled step** (``build_connector_meta``): its load, a sampled request's check once
   vLLM computed the hit, the save of the chunks this step completes (``scheduler/save_plan.py``;
   a hybrid model's groups and states: ``scheduler/hybrid.py``), a producer's receipt after its
   prompt's saves (``handover.py``). With ``offload: lazy`` nothing is saved while it runs.
4. **Preemption**: its KV is gone; it is looked up again when it resumes.
5. **Finish** (``request_finished``): its blocks are held until its saves are copied
   (``scheduler/frees.py``), or its save is remembered for lazy offload (``scheduler/lazy.py``);
   a producer announces what it stored.

The phases and the changes between them are ``scheduler/request_state.py``'s, the only writer of a
request's state; docs/architecture.md draws them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.core.config import KVTierConfig
from kvtier.vllm_integration import logs
from kvtier.vllm_integration.handover import (
    ConsumerWait,
    Receipts,
    announced,
    announced_receipt,
    producer_params,
)
from kvtier.vllm_integration.identity import adapter_identity, cacheable, identity_tokens
from kvtier.vllm_integration.messages import KVTierMetadata, LoadSpec, ProbeAnswer, SaveSpec
from kvtier.vllm_integration.scheduler.frees import BlockFrees
from kvtier.vllm_integration.scheduler.generation import WeightsGeneration
from kvtier.vllm_integration.scheduler.hybrid import HybridBlocks
from kvtier.vllm_integration.scheduler.lazy import LazyOffload
from kvtier.vllm_integration.scheduler.lookups import Lookups
from kvtier.vllm_integration.scheduler.prompts import Sightings
from kvtier.vllm_integration.scheduler.request_state import Hashing, Phase, TrackedRequest
from kvtier.vllm_integration.scheduler.save_plan import SavePlanner
from kvtier.vllm_integration.scheduler.steps import BlockUpdate
from kvtier.vllm_integration.scheduler.sync_loads import SyncLoads
from kvtier.vllm_integration.scheduler.verify import VerifySampling

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


@dataclass
class Policies:
    """What a request's events ask: each decides one thing and writes no request state."""

    lookups: Lookups
    saves: SavePlanner
    verify: VerifySampling
    hybrid: HybridBlocks
    sightings: Sightings
    weights: WeightsGeneration
    frees: BlockFrees
    sync: SyncLoads
    waits: ConsumerWait | None = None  # a consumer's
    receipts: Receipts | None = None  # a producer's
    lazy: LazyOffload | None = None  # offload: lazy


class RequestLifecycle:
    """Every live request's life (see the module docstring)."""

    def __init__(
        self,
        config: KVTierConfig,
        block_size: int,
        policies: Policies,
        *,
        loads_enabled: bool = True,
        saves_enabled: bool = True,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.p = policies
        self.loads_enabled = loads_enabled
        self.saves_enabled = saves_enabled
        self._hashing = Hashing(config.chunk_size, block_size, config.save_unfull_chunk)
        self._reqs: dict[str, TrackedRequest] = {}
        self._async_loads: list[LoadSpec] = []  # for the next step's metadata
        self.step = 0  # serial number of the step whose metadata is being built
        self.counts = {"lookups": 0, "hit_tokens": 0, "uncacheable": 0}
        self.transitions: Counter[tuple[Phase, Phase]] = Counter()  # every change of phase seen
        self._preempted_early: set[str] = set()  # preempted before the step that reports it

    def get(self, rid: str) -> TrackedRequest | None:
        return self._reqs.get(rid)

    def __iter__(self) -> Iterator[TrackedRequest]:
        return iter(list(self._reqs.values()))

    def track(self, request: Request) -> TrackedRequest:
        """The request's state, NEW the first time it is seen."""
        req = self._reqs.get(request.request_id)
        if req is None:
            prompt = identity_tokens(request, request.prompt_token_ids or [])
            adapter = adapter_identity(request.lora_request)
            generation = self.p.weights.for_new_requests
            req = TrackedRequest(
                request, adapter, prompt, generation, self._hashing, self.transitions
            )
            self._reqs[request.request_id] = req
            if self.p.sightings.threshold > 1:
                self.p.sightings.see(req.hashes)
        return req

    def current(self, req: TrackedRequest) -> bool:
        """Whether ``req``'s KV is of the weights keys are made under now (no reset pending,
        none that changed them since it arrived)."""
        weights = self.p.weights
        return req.generation == weights.for_new_requests and not weights.pending

    # 1. Lookup.

    def lookup(self, request: Request, computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens to load beyond the ``computed`` ones
        vLLM has, and whether they load while the request waits; ``None``: not yet."""
        known = self._reqs.get(request.request_id)
        if known is not None and known.phase is Phase.RUNNING:
            # Preempted outside ``schedule()`` (vLLM's reset_prefix_cache with running requests
            # reset) and admitted again before the step reports it: its KV is gone (vLLM looks up
            # only requests with nothing computed).
            self._preempt(known)
            self._preempted_early.add(request.request_id)
        if not request.prompt_token_ids or not self.loads_enabled:
            return 0, False  # a producer never looks up
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # prompt logprobs and some pooling tasks: vLLM reads no cache
        new, load_async = self._look(request, computed)
        req = self._reqs.get(request.request_id)
        if new == 0 and req is not None:
            req.answered_nothing()
        return new, load_async

    def _look(self, request: Request, computed: int) -> tuple[int | None, bool]:
        p = self.p
        if not cacheable(request):
            self.counts["uncacheable"] += 1
            return 0, False
        n = len(request.prompt_token_ids or ())
        bs = self.block_size
        most = (n - 1) // bs * bs  # the last prompt token is always recomputed
        if most <= computed:
            return 0, False
        if p.weights.pending:
            # A reset: the next step's metadata asks the workers what weights they serve.
            in_time = p.weights.waited() < self.config.lookup_timeout_s
            return (None, False) if in_time else (0, False)
        req = self.track(request)
        if req.load_failed or req.verify is not None:
            return 0, False  # a failed load is not offered again; a sampled one is computed
        if req.generation != p.weights.for_new_requests:
            return 0, False  # it started under other weights than the cache's now
        rid = request.request_id
        waits = p.waits
        params = request.kv_transfer_params
        expected = min(announced(params), most) if waits else 0
        if waits and expected and req.probe is None and not waits.may_probe(rid):
            return None, False  # waiting for a producer's chunks: probed again shortly
        receipt = announced_receipt(params) if expected else None
        held, probe = p.lookups.look(req, computed, most, receipt)
        if probe is None:
            req.looking_up(held)  # the workers are looking
            return None, False
        hit = min(probe.hit, most) if probe.agreed or not p.hybrid.groups.mambas else 0
        hit -= hit % bs
        settled = probe.settled
        if waits and expected and waits.keep_waiting(rid, hit, expected - expected % bs, settled):
            p.lookups.release(rid, held)  # look again: the producer's writes may land
            req.looking_up(None)
            return None, False
        new = max(0, hit - computed)
        load_async = self.config.loads_async and new > 0
        sync = p.sync.decide(rid, req.hashes, probe, hit, new) if load_async else False
        if sync is None:
            return None, False  # its chunks' saves are still copying: asked again
        self.counts["lookups"] += 1
        hold_id = None if probe.indexed else probe.hold_id
        check = p.verify.sample(req, computed, hit, hold_id)
        if check is not None:
            req.sampled(check)  # its hold now belongs to the check
            logs.verify_sampled(rid, computed, hit)
            return 0, False
        p.lookups.record(rid, hit, probe.sources)
        self.counts["hit_tokens"] += new
        if sync:
            p.sync.take(new)
            load_async = False  # in host memory: loaded before this step's forward pass
        req.answered(held, computed, load_async)
        logs.lookup(rid, n, computed, new, probe, load_async)
        return new, load_async

    # 2. Allocation.

    def allocated(self, request: Request, blocks: KVCacheBlocks, external: int) -> None:
        """vLLM's ``update_state_after_alloc``: blocks for ``external`` hit tokens (0: none)."""
        req = self.track(request)
        if not external:
            self.p.lookups.release(req.rid, req.drop_probe())
            req.allocated_nothing()
            return
        probe = req.drop_probe()
        assert probe is not None, "external tokens without an answered lookup"
        hold_id = None if probe.indexed else probe.hold_id
        if not req.load_async:
            req.allocated(external, hold_id)
            return
        # Not scheduled until the load is reported: it goes out with the next step's metadata.
        start = req.computed_at_lookup
        end = start + external
        groups = blocks.get_block_ids()
        block_ids = list(groups[self.p.hybrid.groups.primary])
        load = LoadSpec(req.rid, req.prompt, list(block_ids), start, end, req.scope, hold_id, True)
        self.p.hybrid.attach(load, groups)
        self._async_loads.append(load)
        req.allocated_async(block_ids, end)

    def take_loads(self) -> list[LoadSpec]:
        """The asynchronous loads allocated since the last step's metadata."""
        out, self._async_loads = self._async_loads, []
        return out

    # 3. Each scheduled step; 4. preemption.

    def step_scheduled(
        self, meta: KVTierMetadata, preempted: list[str], updates: list[BlockUpdate]
    ) -> None:
        """A step's preemptions, then each scheduled request's blocks (``scheduler/steps.py``)
        and what it sends with the step's metadata (``schedule``)."""
        for rid in preempted:
            req = self._reqs.get(rid)
            if rid in self._preempted_early:
                self._preempted_early.discard(rid)  # handled when it was looked up again
            elif req is not None:
                self._preempt(req)
        hybrid = self.p.hybrid if self.p.hybrid.groups.tracked else None
        for u in updates:
            req = self._reqs.get(u.rid)
            if req is None:
                continue
            if u.first:
                req.scheduled_first(u.block_ids, u.computed)
            elif u.resumed:
                req.resumed(u.block_ids)
            elif u.block_ids:
                req.blocks_added(u.block_ids)
            if hybrid is not None:
                req.groups_seen(*hybrid.refresh(u.rid))
            self.schedule(meta, req, u.computed, u.scheduled)

    def _preempt(self, req: TrackedRequest) -> None:
        req.preempted()
        if self.p.receipts is not None:
            self.p.receipts.preempted(req.rid)

    def schedule(
        self, meta: KVTierMetadata, req: TrackedRequest, computed: int, scheduled: int
    ) -> None:
        """What ``req``, scheduled for tokens ``[computed, computed + scheduled)`` in this step,
        sends with the step's metadata."""
        p = self.p
        rid = req.rid
        check = p.verify.due(req, computed + scheduled)
        if check is not None:
            req.check_sent(self.step)
            p.hybrid.attach(check, req.groups)
            end = len(check.tokens)  # a Mamba hybrid's state there, if vLLM offered it
            check.states = [s for s in p.hybrid.states(rid, self.chunk_size, end) if s[0] == end]
            meta.verifies.append(check)
        if req.external:  # a load allocated with its first step (LOADING)
            end = computed
            start = end - req.external
            load = LoadSpec(
                rid, req.prompt, list(req.block_ids), start, end, req.scope, req.hold_id
            )
            p.hybrid.attach(load, req.groups)
            meta.loads.append(load)
            req.load_sent(end)
        if p.lazy is not None:
            return  # saved when it finishes and vLLM is about to evict its blocks
        spec = self._save_spec(req, computed + scheduled)
        if self.saves_enabled and self.current(req):
            spec, states_alone = p.hybrid.with_states(rid, req, spec, self.chunk_size)
            if states_alone:
                req.save_sent(self.step)  # its blocks are held until the save is done
        if spec is not None:
            p.hybrid.attach(spec, req.groups)
            meta.saves.append(spec)
        if p.receipts is not None and self.current(req):
            receipt = p.receipts.due(rid, req.prompt_saved, req.scope)
            if receipt is not None:
                meta.receipts.append(receipt)

    def _save_spec(self, req: TrackedRequest, end: int, *, expect: bool = True) -> SaveSpec | None:
        """The save tokens ``[0, end)`` make possible; the index is told what it will store
        unless ``expect`` is False."""
        weights = self.p.weights
        if not self.saves_enabled or weights.pending:
            return None
        spec, progress = self.p.saves.plan(req, end, weights.for_new_requests)
        if progress is not None:
            req.save_planned(progress)
        if spec is not None:
            req.save_sent(self.step)
            if expect and len(spec.tokens) <= len(req.prompt):
                self.p.saves.expect(req, spec.skip, len(spec.tokens), self.step)
        return spec

    # 5. Finish.

    def finished(
        self, request: Request, block_ids: list[int] | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: whether its blocks wait for the workers' copies, and a
        producer's ``kv_transfer_params`` (what it stored of the prompt: ``handover.py``)."""
        p = self.p
        rid = request.request_id
        params = None
        req = self._reqs.get(rid)
        receipt = p.receipts.finished(rid) if p.receipts else None
        if not self.loads_enabled and req is not None and self.current(req):
            params = producer_params(req.saved_upto, len(req.prompt), p.saves.step, receipt)
        if p.waits is not None:
            p.waits.done(rid)
        return self._free(request, block_ids), params

    def _free(self, request: Request, block_ids: list[int] | None) -> bool:
        p = self.p
        rid = request.request_id
        req = self._reqs.pop(rid, None)
        p.lookups.forget(rid)
        p.sync.forget(rid)
        self._preempted_early.discard(rid)
        if req is None:
            return False
        req.finished()
        p.lookups.release(rid, req.drop_probe())
        if req.hold_id is not None:
            p.lookups.releases.append((rid, req.hold_id))  # loaded never
        if req.verify is not None and req.verify.hold_id is not None:
            p.lookups.releases.append((rid, req.verify.hold_id))  # never checked
        if p.lazy is not None:
            if block_ids is not None:
                req.kept_blocks(block_ids)
            spec = self._save_spec(req, request.num_computed_tokens, expect=False)
            if spec is not None:
                p.lazy.remember(spec, p.saves.step, req)
            logs.finished(rid, "lazy save remembered" if spec else "nothing to save")
            # A check still reading its blocks keeps them (lazy saves are copied later).
            return p.frees.finished(rid, req.verify_step)
        held = p.frees.finished(rid, max(req.last_save_step, req.verify_step))
        logs.finished(rid, "blocks held for its saves" if held else "blocks freed now")
        return held

    # What the workers report (``scheduler/outputs.py``).

    def load_failures(self, blocks: set[int], requests: set[str]) -> list[str]:
        """Requests whose load failed (a block in ``blocks``, or named in ``requests``): vLLM
        recomputes them; they are never offered a hit again. Returns their ids."""
        out = []
        for req in self:
            if req.load_failed:
                continue
            if req.rid in requests or not blocks.isdisjoint(req.block_ids):
                req.failed_load()
                self.p.lookups.release(req.rid, req.drop_probe())
                out.append(req.rid)
        return out

    def answer(self, rank: int, ans: ProbeAnswer) -> None:
        """A rank's answer to a probe (ignored if the request is gone or was probed again)."""
        req = self._reqs.get(ans.req_id)
        self.p.lookups.answer(req, rank, ans)

    def short(self, rank: int, rid: str, found: int) -> None:
        """A load answered by the index found only ``found`` tokens on ``rank``: the index
        forgets the rest; vLLM recomputes it, and it is saved again."""
        req = self._reqs.get(rid)
        self.p.lookups.shortfall(req.hashes if req else None, rank, found)
        if req is not None:
            req.short(found)

    def clear(self) -> None:
        self._reqs.clear()
