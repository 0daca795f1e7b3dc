"""The scheduler half of ``KVTierConnector`` (EngineCore process, next to vLLM's scheduler).

Nothing here waits: no socket, disk or Redis call runs inside ``schedule()``. This module builds
the scheduler side's parts and turns vLLM's hooks into a request's events: a request's life,
top-down (lookup, allocation, each scheduled step, preemption, finish), is
``scheduler/request.py``, which asks one policy per decision (``scheduler/lookups.py``: the
index of stored chunks and probes of the workers; ``save_plan.py``, ``verify.py``, ``hybrid.py``,
``lazy.py``, ``handover.py``), and whose state has one writer (``scheduler/request_state.py``). What each
step's output reports goes to ``scheduler/outputs.py``. The whole path, step by step:
``docs/serving.md``.

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
from kvtier.vllm_integration.groups import CacheGroups
from kvtier.vllm_integration.handover import ConsumerWait, Receipts, check_role
from kvtier.vllm_integration.messages import KVTierMetadata
from kvtier.vllm_integration.scheduler.events import EventLog
from kvtier.vllm_integration.scheduler.frees import BlockFrees
from kvtier.vllm_integration.scheduler.generation import WeightsGeneration
from kvtier.vllm_integration.scheduler.hybrid import HybridBlocks
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.lazy import LazyOffload, target_blocks
from kvtier.vllm_integration.scheduler.lookups import Lookups, lookup_mode, warn_load_failure_policy
from kvtier.vllm_integration.scheduler.outputs import StepOutputs
from kvtier.vllm_integration.scheduler.prompts import Sightings
from kvtier.vllm_integration.scheduler.request import Policies, RequestLifecycle
from kvtier.vllm_integration.scheduler.save_plan import SavePlanner
from kvtier.vllm_integration.scheduler.steps import block_updates
from kvtier.vllm_integration.scheduler.sync_loads import SyncLoads
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
        token_bytes: int = 0,
        async_scheduling: bool = False,
        hash_block_size: int | None = None,
    ) -> None:
        """``block_size``: kvtier's block (``CacheGroups.hit_block``); ``token_bytes``: the KV
        bytes of one token on one rank, every layer (0: unknown); ``async_scheduling``:
        vLLM's (``scheduler/sync_loads.py``); ``hash_block_size``: the tokens of one of a
        request's block hashes (default ``block_size``)."""
        self.config = config
        check_role(config, role)  # a producer saves and never loads, a consumer the reverse
        self.loads_enabled = role in ("kv_both", "kv_consumer")
        self.saves_enabled = role in ("kv_both", "kv_producer")
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.hybrid = HybridBlocks(groups or CacheGroups(), block_size)
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
            trust=self.verify,
            stateful=bool(self.hybrid.groups.mambas),
        )
        self.events = EventLog(
            block_size,
            kv_events,
            lambda h, scope: self.index.digest(0, h, scope),
            self.hybrid.groups.event_specs,
            self.hybrid.groups.mambas,
            self.hybrid.groups.block_sizes,
            hash_block_size,
        )
        self.sightings = Sightings(config.store_threshold)
        self.saves = SavePlanner(config, block_size, self.sightings, self.index, self.events)
        self.lazy: LazyOffload | None = None
        if config.offload == "lazy" and self.saves_enabled:
            target = target_blocks(max_num_batched_tokens, block_size)
            self.lazy = LazyOffload(block_size, target, num_workers)
        self.frees = BlockFrees(num_workers)
        self.weights = WeightsGeneration(num_workers)
        one_group = not (self.hybrid.groups.hybrid or self.hybrid.groups.tracked)
        self.sync_loads = SyncLoads(
            config,
            self.index,
            token_bytes,
            one_group=one_group,
            async_scheduling=async_scheduling,
        )
        policies = Policies(
            self.lookups,
            self.saves,
            self.verify,
            self.hybrid,
            self.sightings,
            self.weights,
            self.frees,
            self.sync_loads,
            self.waits,
            self.receipts,
            self.lazy,
        )
        self.requests = RequestLifecycle(
            config,
            block_size,
            policies,
            loads_enabled=self.loads_enabled,
            saves_enabled=self.saves_enabled,
        )
        self.outputs = StepOutputs(
            self.requests,
            self.index,
            self.frees,
            self.events,
            self.verify,
            self.lazy,
            self.weights,
        )
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
        out = dict(self.requests.counts)
        out.update(
            probes=self.lookups.sent,
            indexed_hits=self.lookups.indexed,
            sync_loads=self.sync_loads.taken,
            sync_loads_deferred=self.sync_loads.deferred,
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

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """A request's lookup (``scheduler/request.py``)."""
        return self.requests.lookup(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.requests.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        """The step's metadata: probes and releases, then what each scheduled request sends
        (``RequestLifecycle.schedule``), lazy saves now due, and the hybrid fence."""
        releases, probes = self.lookups.take()
        self.sync_loads.next_step()
        requests = self.requests
        requests.step += 1
        meta = KVTierMetadata(
            preempted=set(scheduler_output.preempted_req_ids or ()),
            releases=releases,
            generation=self.weights.current,
            weights_epoch=self.weights.epoch,
            loads=requests.take_loads(),
            probes=probes,
            step=requests.step,
            idle=not scheduler_output.total_num_scheduled_tokens,
            unheld=self.frees.take_unheld(),
        )
        self.hybrid.take_offers(scheduler_output)
        updates = block_updates(scheduler_output, self.hybrid.groups.primary)
        requests.step_scheduled(meta, list(scheduler_output.preempted_req_ids or ()), updates)
        if self.lazy is not None:
            for spec, req in self.lazy.due():
                if req.generation == self.generation:
                    self.saves.expect(req, spec.skip, len(spec.tokens), requests.step)
                meta.lazy_saves.append(spec)
        self.hybrid.fence(meta, scheduler_output, self.frees.copied_through)
        return meta

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        """vLLM's cache manager: a hybrid model's block ids of every group come from it."""
        self.hybrid.bind(manager)

    def finished(
        self, request: Request, block_ids: list[int] | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: whether to keep the blocks until the worker's saves
        of them are done (``get_finished``; not when every rank has copied them already:
        ``scheduler/frees.py``), and the request's ``kv_transfer_params`` (a producer
        announces what it stored of the prompt: ``handover.py``)."""
        return self.requests.finished(request, block_ids)

    def request_finished(self, request: Request, block_ids: list[int] | None = None) -> bool:
        return self.finished(request, block_ids)[0]

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
        self.requests.clear()
