"""``KVTierConnector``: kvtier as a vLLM KV connector (KV-connector API v1).

vLLM builds two instances: a *scheduler-side* one (in the EngineCore process, next to the
scheduler) and a *worker-side* one (in each worker, next to the KV tensors). They talk only
through vLLM: the per-step metadata the scheduler side builds (``messages.py``) and the reports
each worker sends back after the step (``scheduler/index.py``). This class is the facade vLLM calls;
the work is done by ``SchedulerSide`` (``scheduler/side.py``: the index of stored chunks, probes,
which tokens to load and save, weights generations) and ``WorkerSide`` (``worker/side.py``: the
``CacheEngine``, probes and holds, loads, the saver thread).

What keys a chunk (``identity.py``): the model's identity, the KV layout (with vLLM's cache
dtype string), the engine-local rank, and per request the cache salt, LoRA adapter and weights
generation, over token ids with multimodal placeholders replaced by their items' content
hashes. ``reset_cache`` (``llm.reset_prefix_cache(reset_connector=True)``, vLLM's pause and
weight-update paths) starts a new weights generation.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.core.config import KVTierConfig, load_config
from kvtier.core.engine import CacheEngine
from kvtier.core.errors import ConfigError
from kvtier.vllm_integration import logs
from kvtier.vllm_integration.groups import (
    cache_groups,
    check_hybrid,
    hash_block_size,
    hybrid_chunk_size,
    token_bytes,
)
from kvtier.vllm_integration.identity import refuse_context_parallel
from kvtier.vllm_integration.layout import pages_verifiable
from kvtier.vllm_integration.logs import SLEEP_MODE_REASON
from kvtier.vllm_integration.messages import KVTierMetadata
from kvtier.vllm_integration.plugin import offloading_size_conflict
from kvtier.vllm_integration.scheduler.side import SchedulerSide
from kvtier.vllm_integration.stats import KVTierPromMetrics, KVTierStats
from kvtier.vllm_integration.worker.side import WorkerSide

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


# kvtier tier name -> vLLM's hit source (other tiers, e.g. Redis: EXTERNAL_UNSPECIFIED).
HIT_SOURCES = {
    "local_cpu": CacheHitSource.HOST,
    "node": CacheHitSource.HOST,  # shared memory of the host
    "local_disk": CacheHitSource.DISK,
}


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's vLLM connector; see the module docstring for what each side does.

    ``SupportsHMA``: vLLM keeps its hybrid memory allocator on for hybrid models (sliding-window,
    Mamba and full attention groups, ``groups.py``) and calls ``request_finished_all_groups``."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # vLLM 0.32 replaces kvtier before building it (plugin.py refuses that first); a vLLM
        # that wrapped kvtier instead would build it here, next to its own offloading.
        conflict = offloading_size_conflict(
            self._kv_transfer_config, vllm_config.cache_config, is_kvtier=True
        )
        if conflict is not None:
            size = vllm_config.cache_config.kv_offloading_size
            raise ConfigError("kv_offloading_size", size, conflict)
        refuse_context_parallel(vllm_config.parallel_config)
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):
            # vLLM 0.32 does not ask supports_sleep_mode: refused here, by the same reason.
            raise ConfigError("enable_sleep_mode", True, SLEEP_MODE_REASON)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config: KVTierConfig = load_config(overrides=extra)
        logs.configure(self.config.log_level)
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.config.offload == "lazy" and not vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError(
                "offload",
                self.config.offload,
                "needs vLLM's prefix caching (lazy offload copies blocks vLLM's prefix cache is "
                "about to evict); turn prefix caching on or use offload=eager",
            )
        self.groups = cache_groups(kv_cache_config)
        # kvtier's block: vLLM's, or for groups of several block sizes (Gemma 4) their least
        # common multiple, where vLLM's own hybrid prefix cache hits too.
        self.hit_block = self.groups.hit_block(self.block_size)
        # A Mamba hybrid's block size is raised by vLLM (one block holds a state): the default
        # chunk size follows it; a chunk size the user set must be a multiple.
        explicit = self.config.chunk_size != KVTierConfig().chunk_size
        chunk = hybrid_chunk_size(
            self.config, self.hit_block, explicit, states=bool(self.groups.mambas)
        )
        if chunk != self.config.chunk_size:
            self.config = dataclasses.replace(self.config, chunk_size=chunk)
        check_hybrid(self.config, self.groups, warn=role == KVConnectorRole.SCHEDULER)
        engine_id = str(self._kv_transfer_config.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self.config,
                block_size=self.hit_block,
                num_workers=int(vllm_config.parallel_config.world_size),
                max_num_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
                load_failure_policy=str(self._kv_transfer_config.kv_load_failure_policy),
                kv_events=bool(
                    vllm_config.kv_events_config
                    and vllm_config.kv_events_config.enable_kv_cache_events
                ),
                role=str(self._kv_transfer_config.kv_role),
                verifiable=pages_verifiable(
                    str(vllm_config.cache_config.cache_dtype), kv_cache_config
                ),
                groups=self.groups,
                engine_id=engine_id,
                token_bytes=token_bytes(kv_cache_config),
                async_scheduling=bool(
                    getattr(vllm_config.scheduler_config, "async_scheduling", False)
                ),
                hash_block_size=hash_block_size(vllm_config, kv_cache_config, self.hit_block),
            )
        else:
            self._worker = WorkerSide(
                self.config,
                vllm_config,
                kv_cache_config,
                block_size=self.block_size,
                engine_id=engine_id,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvtier is a cache, a save that does not happen is a later miss. (True would
        make vLLM drop a preempted request's in-flight output under asynchronous scheduling.)"""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads and saves run Python between layers: never inside a full graph."""
        return bool(load_config(overrides=dict(extra_config or {})).use_layerwise)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """False, with the reason logged: vLLM (0.33 on; 0.32 never asks) then refuses to start
        with ``--enable-sleep-mode`` and this connector, by name. Sleep releases the KV memory
        kvtier's saver, loader, probes and lazy copies read from other threads; draining and
        stopping them before the memory goes and registering the new views on wake
        (``unregister_kv_caches`` / ``restore_kv_caches``) is not built."""
        logs.sleep_mode_refused()
        return False

    def unregister_kv_caches(self) -> None:
        raise NotImplementedError(SLEEP_MODE_REASON)

    def restore_kv_caches(self) -> None:
        raise NotImplementedError(SLEEP_MODE_REASON)

    # -- scheduler side ---------------------------------------------------------------------------
    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("called a scheduler-side method on the worker-side connector")
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM's cache manager: a hybrid model's live block ids of every group are read from
        it (then the block pool is bound, as vLLM's base class does)."""
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """vLLM's block pool, bound once its cache manager exists (lazy offload uses it)."""
        self.scheduler_side.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        side = self.scheduler_side
        with side.timer.timed():
            return side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        side = self.scheduler_side
        with side.timer.timed():
            side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self.scheduler_side
        with side.timer.timed():
            meta = side.build_connector_meta(scheduler_output)
        side.timer.end_step()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the worker's saves of this request are done (``get_finished``),
        unless every worker has reported them copied already (``scheduler/frees.py``); a
        ``kv_producer`` announces what it stored in the ``kv_transfer_params``
        (``handover.py``)."""
        side = self.scheduler_side
        with side.timer.timed():
            return side.finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` for every request when vLLM's hybrid memory allocator is on:
        the primary group's blocks stand for the request's (a held request keeps all)."""
        return self.request_finished(request, list(block_ids[self.groups.primary]))

    def reset_cache(self) -> bool | None:
        return self.scheduler_side.reset_cache()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        side = self.scheduler_side
        with side.timer.timed():
            side.update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler_side.has_pending_block_frees()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events for kvtier's host tier (``scheduler/events.py``), published with vLLM's own."""
        return self.scheduler_side.events.take()

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The loaded tokens by tier: host memory, disk, and Redis (vLLM 0.32 has no "remote"
        source: it counts as ``external_unspecified``)."""
        side = self.scheduler_side
        out: dict[CacheHitSource, int] = {}
        for tier, n in side.lookups.sources(request, num_external_tokens, side.block_size).items():
            src = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + n
        return out

    # -- metrics (both sides; see stats.py) -------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            self._worker.timer.end_step()
            return self._worker.get_kv_connector_stats()
        if self._scheduler is not None:
            return self._scheduler.get_kv_connector_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        # A copy: vLLM's log accumulator aggregates into it, the payload also feeds Prometheus.
        return KVTierStats(data=copy.deepcopy(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ------------------------------------------------------------------------------
    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("called a worker-side method on the scheduler-side connector")
        return self._worker

    @property
    def engine(self) -> CacheEngine | None:
        """The worker's ``CacheEngine`` (None before ``register_kv_caches``)."""
        return self.worker_side.engine

    def _meta(self) -> KVTierMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    # Every worker hook runs on vLLM's forward thread, inside the step: its time is counted
    # into ``worker_seconds`` (one observation per step, when vLLM collects the step's stats).
    # The per-layer hooks do work only in layerwise mode, and are timed only then.
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            side = self.worker_side
            with side.timer.timed():
                side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        side = self.worker_side
        with side.timer.timed() if side.config.use_layerwise else contextlib.nullcontext():
            side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        side = self.worker_side
        if not side.config.use_layerwise:
            return
        meta = self._meta()
        if meta is not None:
            with side.timer.timed():
                side.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        side = self.worker_side
        with side.timer.timed():
            side.wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVTierMetadata):
            side = self.worker_side
            with side.timer.timed():
                side.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        side = self.worker_side
        with side.timer.timed():
            return side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``, plus a hybrid model's failed asynchronous loads (also reported
        finished, so vLLM stops waiting for them)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker_side.failed_loads()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        side = self.worker_side
        with side.timer.timed():
            return side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's report to the scheduler: new chunks for its index, probe answers."""
        side = self.worker_side
        with side.timer.timed():
            return side.build_connector_worker_meta()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
