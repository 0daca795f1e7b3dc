"""The worker half of ``KVTierConnector`` (each worker process, next to the KV tensors).

``register_kv_caches`` detects the paged layout (``layout.py``), builds the ``CacheEngine`` on
the configured tiers, keyed by the engine's identity and engine-local rank (``identity.py``),
and starts reporting to the scheduler's index of stored chunks (``scheduler/index.py``): what the
local tiers hold, then every chunk a save commits, sent with each step's output
(``build_connector_worker_meta``).

Probes (``scheduler/prompts.py``) arrive in the step's metadata and run on the probe threads: each
looks a prompt up in every tier and keeps what it finds as a *hold* (``worker/holds.py``), reading
lower-tier hits into host memory now; the answer goes back with a later step's output. The load that
follows reads exactly the held chunks, so a chunk evicted between probe and load is still loaded;
the hold is released right after. The one way a load can still come up short is a hold that expired
before its load (``messages.hold_ttl_s``); such a load reads the tiers again and may miss chunks
evicted meanwhile. A short load is reported through ``get_block_ids_with_load_errors``: with
``kv_load_failure_policy="recompute"`` vLLM recomputes those blocks, with "fail" the request fails.
Synchronous loads run in ``start_load_kv`` before the forward pass, or layer by layer in
``wait_for_layer_load`` with ``use_layerwise``, or (CPU platform, a worker bound to some of its
CPUs) layer by layer on the layer pipe while the forward pass runs, each layer waited for in
``wait_for_layer_load``; loads marked ``load_async`` go to the loader thread
and are reported through ``get_finished`` (their failed blocks through
``get_block_ids_with_load_errors`` in the same step's output). The loads themselves:
``worker/loads.py``.

Saves, lazy saves and the sampled checks of verification run on the saver thread
(``worker/saves.py``); the scheduler keeps a request's blocks until they are done.

A step whose metadata carries a new weights generation (``reset_cache`` on the scheduler)
first drops the host-memory tier: its chunks were computed with the old weights
(``worker/generation.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.core.affinity import set_background_cpus, unbound_cpus
from kvtier.core.config import KVTierConfig
from kvtier.core.engine import CacheEngine
from kvtier.core.engine.thread_cpu import PROCESS_THREADS
from kvtier.core.errors import LayoutError
from kvtier.core.keys import KeyScope
from kvtier.core.keys.receipts import has_receipt
from kvtier.core.metrics import engine_values
from kvtier.core.platform import get_platform
from kvtier.vllm_integration.channel import ControlServer, socket_path
from kvtier.vllm_integration.handover import producer_config
from kvtier.vllm_integration.identity import engine_rank, engine_weights, model_identity
from kvtier.vllm_integration.layout import read_registration
from kvtier.vllm_integration.messages import (
    KVTierMetadata,
    KVTierWorkerMeta,
    LazyWorkerMeta,
    LoadSpec,
    ProbeSpec,
    hold_ttl_s,
)
from kvtier.vllm_integration.stats import Counters, KVTierStats, StatsTracker, StepTimer
from kvtier.vllm_integration.weights import served_weights
from kvtier.vllm_integration.worker.feed import PresenceFeed
from kvtier.vllm_integration.worker.generation import WorkerWeights
from kvtier.vllm_integration.worker.holds import HoldTable
from kvtier.vllm_integration.worker.loads import WorkerLoads
from kvtier.vllm_integration.worker.prober import Found, Prober
from kvtier.vllm_integration.worker.saves import SAVE_DRAIN_TIMEOUT_S, WorkerSaves
from kvtier.vllm_integration.worker.verify import WorkerVerify

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvtier")

# How long get_finished waits for this step's asynchronous loads (``worker/load_thread.py``): a
# host-memory load is done within it and its request is scheduled a step sooner.
LOAD_REPORT_WAIT_S = 0.005
# How long a step in which vLLM scheduled nothing waits for kvtier's saves and loads in flight
# (``WorkerSide._yield_idle``): the most a request arriving meanwhile waits for its first step.
IDLE_WAIT_S = 0.01
WORKER_COUNTERS = (
    "load_requests",
    "load_tokens_requested",
    "loaded_tokens",
    "load_failed_blocks",
    "loads_without_hold",
    "indexed_loads",
    "layer_pipe_loads",  # synchronous loads copied on the layer pipe (worker/layer_pipe.py)
    "save_jobs",
    "saved_tokens",
    "save_errors",
    "saves_abandoned",
    "saves_dropped",  # a save in the step of a load that fell short: made after the recompute
    "generation_resets",
    "receipts_written",  # a producer's hand-over receipts (kvtier.core.keys.receipts)
    "receipts_unwritten",  # no host memory even for the receipt: its consumer waits it out
)
# The counters that are also metrics (``kvtier.core.metrics.METRICS``).
WORKER_METRICS = ("load_failed_blocks", "loads_without_hold", "save_errors", "saves_abandoned")


@dataclass(frozen=True)
class Runtime:
    """What a worker runs once vLLM has registered its KV tensors (``register_kv_caches``)."""

    engine: CacheEngine
    rank: int  # this worker's engine-local rank
    layer_of: dict[str, int]  # vLLM's layer name -> layer index
    holds: HoldTable
    saves: WorkerSaves
    loads: WorkerLoads
    feed: PresenceFeed
    prober: Prober
    server: ControlServer


class WorkerSide:
    """Loads and saves on one worker (see the module docstring). Before ``register_kv_caches``
    there is no runtime and every hook is a no-op."""

    def __init__(
        self,
        config: KVTierConfig,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        block_size: int,
        engine_id: str,
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        if transfer is not None and transfer.kv_role == "kv_producer":
            config = producer_config(config)  # its chunks are another instance's input
        self.config = config
        self._kv_cache_config = kv_cache_config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self._vllm_config = vllm_config
        self._engine_id = engine_id
        self._rt: Runtime | None = None  # built by register_kv_caches
        self.counters = Counters(WORKER_COUNTERS)
        self._count = self.counters.add
        self.weights = WorkerWeights(self._count)  # resets (worker/generation.py)
        self.metrics = StatsTracker()
        self.timer = StepTimer(self.metrics, "worker")  # kvtier's time in each step (connector.py)

    @property
    def engine(self) -> CacheEngine | None:
        return self._rt.engine if self._rt is not None else None

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """What changed since the last call (``stats.py``); vLLM calls it after every step."""
        rt = self._rt
        if rt is None:
            return None
        values = engine_values(rt.engine)
        values.update(self.counters.values(WORKER_METRICS))
        values["hold_expiries"] = {"": rt.holds.stats()["hold_expiries"]}
        values["background_cpu_seconds"] = {"": PROCESS_THREADS.seconds()}
        values.update(rt.saves.verify.verifier.values())
        return self.metrics.delta(values)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        vc = self._vllm_config
        reg = read_registration(vc, self._kv_cache_config, kv_caches)
        layout, caches = reg.layout, reg.caches
        if layout.block_size != self.block_size:
            raise LayoutError(
                f"vLLM's cache spec has blocks of {layout.block_size} tokens, its cache config "
                f"{self.block_size}: kvtier needs one block size"
            )
        # The control socket is per worker; the key's rank collapses MLA's identical TP shards.
        _, worker = engine_rank(vc, use_mla=False)
        key_world, key_rank = engine_rank(vc, layout.use_mla)
        model, weights, live = served_weights(vc)
        self.weights.started(model, live)
        weights = engine_weights(vc, weights)
        # vLLM's CPU backend bound this process to its forward pass's cores: the lower tiers'
        # writers (started from here on) take the CPUs the process was started with.
        set_background_cpus(unbound_cpus())
        platform = get_platform(
            self.config.platform or caches[0].device.type,
            self.config.plugins,
            device_index=caches[0].device.index,
        )
        # local_cpu_size_gb_total is the engine's: each of its TP x PP workers gets its share.
        engine = CacheEngine(
            self.config.per_worker(int(vc.parallel_config.world_size)),
            layout,
            model=model_identity(vc, weights),
            world_size=key_world,
            rank=key_rank,
            platform=platform,
        )
        engine.register_kv_caches(caches, reg.num_blocks)
        kv_events = vc.kv_events_config
        self.start(
            engine,
            reg.layer_of,
            rank=worker,
            tier_events=bool(kv_events and kv_events.enable_kv_cache_events),
        )
        logger.info(
            "kvtier: %s (fingerprint %s), tiers %s, control channel %s",
            layout.describe(),
            layout.fingerprint(),
            self.config.tiers,
            self._runtime().server.path,
        )

    def start(
        self, engine: CacheEngine, layer_of: dict[str, int], *, rank: int, tier_events: bool
    ) -> None:
        """Build the runtime over ``engine`` (its KV views registered), worker ``rank``'s, with
        vLLM's layer names (``register_kv_caches``, once the views and the weights are read)."""
        holds = HoldTable(engine, hold_ttl_s(self.config))
        feed = PresenceFeed(rank, engine, tier_events=tier_events)
        self._rt = Runtime(
            engine=engine,
            rank=rank,
            layer_of=layer_of,
            holds=holds,
            saves=WorkerSaves(
                self.config,
                engine,
                WorkerVerify(engine, holds, quarantined=feed.quarantined),
                layer_of=layer_of,
                count=self._count,
                metrics=self.metrics,
            ),
            loads=WorkerLoads(
                self.config,
                engine,
                holds,
                block_size=self.block_size,
                layer_of=layer_of,
                metrics=self.metrics,
                reports=self,
            ),
            feed=feed,
            prober=Prober(self._probe, feed.answer),
            server=ControlServer(socket_path(self._engine_id, rank), self._serve),
        )

    def _runtime(self) -> Runtime:
        """The runtime, for the callbacks it calls (they only run once it exists)."""
        assert self._rt is not None, "kvtier worker used before register_kv_caches"
        return self._rt

    def _serve(self, request: dict[str, Any]) -> dict[str, Any]:
        """A control channel request (``channel``): ``stats`` or ``flush``."""
        rt = self._runtime()
        op = request.get("op")
        if op == "stats":
            stats: dict[str, int] = self.counters.snapshot()
            stats.update(rt.holds.stats())
            stats.update({f"engine_{k}": v for k, v in rt.engine.stats.as_dict().items()})
            stats.update(rt.saves.verify.stats())
            return {"stats": stats}
        if op == "flush":
            # Saves queued so far, then lower-tier writes: what a planned restart waits for.
            timeout = float(request.get("timeout_s", SAVE_DRAIN_TIMEOUT_S))
            ok = rt.saves.saver.drain(timeout) and rt.engine.storage.flush(timeout)
            return {"flushed": ok}
        raise ValueError(f"unknown control channel request {op!r}")

    def _probe(self, spec: ProbeSpec) -> Found:
        """One probe on a probe thread: hold what the tiers have of the prompt. A consumer's
        receipt is asked for first: found, every chunk its producer wrote is there already."""
        rt = self._runtime()
        self._await_related_saves(spec.tokens, spec.scope)
        t0 = time.perf_counter()
        settled = spec.receipt is not None and has_receipt(
            rt.engine.storage, rt.engine.keys, spec.receipt, spec.scope
        )
        hit = rt.holds.lookup(spec.req_id, spec.hold_id, spec.tokens, spec.scope)
        self.metrics.observe("lookup_seconds", time.perf_counter() - t0)
        return hit, rt.holds.sources(spec.req_id), settled

    def _await_related_saves(self, tokens: np.ndarray, scope: KeyScope) -> None:
        """Before a probe's lookup or an index-answered load: a save of the same prefix still
        copying would be missed, give it a moment (at most half of ``lookup_timeout_s``)."""
        if not self._runtime().saves.saver.wait_related(
            tokens, scope, self.chunk_size, self.config.lookup_timeout_s / 2
        ):
            logger.warning("kvtier: lookup answered before a save of the same prefix finished")

    # What the loads report (``worker/loads.py``'s ``LoadReports``).

    def count(self, **counters: int) -> None:
        self.counters.add(**counters)

    def before_indexed_load(self, spec: LoadSpec) -> None:
        """A load answered by the scheduler's index, on the loader thread."""
        self._await_related_saves(spec.tokens, spec.scope)

    def load_short(self, req_id: str, found: int) -> None:
        self._runtime().feed.shortfall(req_id, found)

    @property
    def loads_in_flight(self) -> int:
        """Asynchronous loads submitted to the loader thread and not finished yet."""
        return self._rt.loads.in_flight if self._rt is not None else 0

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        """This step's report; with lazy offload always a ``LazyWorkerMeta`` (so every rank's
        object aggregates the lazy saves copied), naming those whose copies are done."""
        rt = self._rt
        if rt is None:
            return None
        rt.feed.saves_copied(rt.saves.saver.copied_through)
        report = rt.feed.take()
        if self.config.offload != "lazy":
            return report
        done = rt.saves.lazy_copied()
        reports = report.reports if report is not None else {}
        return LazyWorkerMeta(reports, {rt.rank: sorted(done)} if done else {})

    # -- loads (worker/loads.py) --------------------------------------------------------------
    def start_load_kv(self, meta: KVTierMetadata) -> None:
        rt = self._rt
        if rt is None:
            return
        self.weights.digest(rt.feed, meta)
        self.weights.follow(rt.engine, rt.holds, meta)
        for rid, hold_id in meta.releases:
            rt.holds.release(rid, hold_id)
        rt.holds.expire()
        for probe in meta.probes:
            rt.prober.submit(probe)
        rt.loads.run(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._rt is not None:
            self._rt.loads.wait_for_layer(layer_name)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._rt.loads.take_failed() if self._rt is not None else set()

    # -- saves (worker/saves.py) ---------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, meta: KVTierMetadata) -> None:
        if self.config.use_layerwise and self._rt is not None and meta.saves:
            self._rt.saves.save_layer(layer_name, meta)

    def wait_for_save(self, meta: KVTierMetadata | None) -> None:
        rt = self._rt
        if rt is None:
            return
        rt.loads.finish()
        unfilled = rt.loads.take_unfilled()
        if meta is not None:
            rt.saves.submit(meta, unfilled)
            if meta.idle:
                self._yield_idle(rt)

    def _yield_idle(self, rt: Runtime) -> None:
        """A step with nothing scheduled: while its requests wait (some on kvtier's saves or
        loads), vLLM's engine loop would spin through empty steps holding the interpreter, and
        kvtier's saver and loader threads would get it only between them (once per switch
        interval). Block here for a moment instead, until they are done or ``IDLE_WAIT_S``."""
        deadline = time.monotonic() + IDLE_WAIT_S
        rt.saves.saver.wait_idle(IDLE_WAIT_S)  # returns at once with no save queued
        if rt.loads.in_flight:
            rt.loads.wait_idle(max(0.0, deadline - time.monotonic()))

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """Before the step writes anything: blocks a save may still read are reused (a
        preempted request's, or a hybrid model's freed window blocks)."""
        if (meta.preempted or meta.drain_saves) and self._rt is not None:
            self._rt.saves.before_reuse()

    def failed_loads(self) -> set[str]:
        """A hybrid model's requests whose asynchronous loads failed (``failed_recving``)."""
        return self._rt.loads.take_failed_requests() if self._rt is not None else set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(saves done, async loads done)``; the failed blocks of the loads reported here go
        out through ``get_block_ids_with_load_errors``, which vLLM calls right after."""
        rt = self._rt
        if rt is None:
            return None, None
        if finished_req_ids:
            rt.holds.release_requests(finished_req_ids)
        recving = rt.loads.take_finished(LOAD_REPORT_WAIT_S)
        done = rt.saves.finished(finished_req_ids)
        return (done or None), (recving or None)

    def shutdown(self) -> None:
        rt, self._rt = self._rt, None
        if rt is None:
            return
        rt.prober.close()
        rt.loads.close(SAVE_DRAIN_TIMEOUT_S)
        rt.saves.close()
        rt.server.close()
        rt.holds.close()
        rt.engine.storage.flush(timeout=SAVE_DRAIN_TIMEOUT_S)
        rt.engine.close()
