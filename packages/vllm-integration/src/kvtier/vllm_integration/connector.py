"""``KVTierConnector``: kvtier as a vLLM KV connector (KV-connector API v1).

vLLM builds two instances: a *scheduler-side* one (in the EngineCore process, next to the
scheduler) and a *worker-side* one (in each worker, next to the KV tensors). They share only the
per-step metadata the scheduler side builds and what both can reach (the lookup channel, disk,
Redis).

Scheduler side
  ``get_num_new_matched_tokens`` asks the worker(s) over the lookup channel (``channel.py``) how
  long a prefix of the prompt kvtier holds in any tier, including the worker's host memory;
  the hit is cut to whole blocks and at most ``n - 1`` tokens (the last prompt token is always
  recomputed, to produce the first logits). A channel failure or timeout is a miss. The worker
  answers with a *hold* (``holds.py``): the hit chunks stay in its host memory until the load,
  so what the scheduler was told is what gets loaded. The lookup names the request and a
  ``hold_id`` the scheduler picks; every later decision about that hold (load it, or drop it
  because vLLM will not load: no external tokens allocated, request finished or aborted) reaches
  the worker in the next step's metadata. ``build_connector_meta`` turns the step's schedule
  into loads (tokens vLLM must not compute), hold releases and saves (chunks completed by this
  step's forward pass).

Worker side
  ``register_kv_caches`` detects the paged layout (``layout.py``), builds the ``CacheEngine``
  on the configured tiers and starts the lookup server. Loads are synchronous: all at once in
  ``start_load_kv`` before the forward pass, or layer by layer in ``wait_for_layer_load`` with
  ``use_layerwise``, from the request's hold, which is released right after. The hold is what
  makes the default ``kv_load_failure_policy="fail"`` safe: a chunk evicted from the host tier
  between lookup and load is still loaded. The one way a load can still come up short is a
  hold that expired before its load: holds unused for ``hold_ttl_s(config)`` (10x
  ``lookup_timeout_s``, at least 30 s) are released so a lost one cannot pin memory; a load
  after that reads the tiers again and may miss chunks evicted meanwhile. Such a short load is
  reported through ``get_block_ids_with_load_errors``: with ``kv_load_failure_policy=
  "recompute"`` vLLM recomputes those blocks, with "fail" the request fails.

  Saves are asynchronous: ``wait_for_save`` hands the step's saves to one saver thread, which
  copies the chunks from the paged cache into host memory and puts them in the tiers (lower
  tiers are written in the background by the storage manager). The scheduler side keeps the
  blocks of every request that had a save (``request_finished`` returns True) until the worker
  reports, through ``get_finished``, that the request's saves are done. Before vLLM reuses the
  blocks of a preempted request (``handle_preemptions``) the saver is drained. With
  ``use_layerwise`` each layer is captured in ``save_kv_layer`` right after attention wrote it,
  so the saves are complete when the step ends.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.core.config import KVTierConfig, load_config
from kvtier.core.engine import CacheEngine, RetrieveJob
from kvtier.core.errors import ConfigError
from kvtier.core.platform import get_platform
from kvtier.vllm_integration.channel import ChannelError, LookupClient, LookupServer, socket_path
from kvtier.vllm_integration.holds import HoldTable
from kvtier.vllm_integration.layout import build_layout, layer_index, ordered_caches

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier")

SAVE_DRAIN_TIMEOUT_S = 60.0
HOLD_TTL_MIN_S = 30.0


def hold_ttl_s(config: KVTierConfig) -> float:
    """How long the worker keeps a lookup's hold with no lookup or load: 10x
    ``lookup_timeout_s``, at least 30 s. A load normally follows its lookup within a step, and a
    waiting request's repeated lookups refresh its hold, so only a lost hold (a decision the
    worker never heard of) lives this long."""
    return max(HOLD_TTL_MIN_S, 10.0 * config.lookup_timeout_s)


# -- per-step metadata (pickled from the scheduler to the workers) ------------------------------
@dataclass
class LoadSpec:
    """Load tokens ``[start, end)`` of ``tokens`` (the whole prompt) into ``block_ids``."""

    req_id: str
    tokens: np.ndarray
    block_ids: list[int]
    start: int
    end: int
    salt: str | None
    hold_id: int | None = None  # the worker's hold from this request's lookup


@dataclass
class SaveSpec:
    """Save the chunks of ``tokens`` that start at or after ``skip`` (they live in ``block_ids``)."""

    req_id: str
    tokens: np.ndarray
    block_ids: list[int]
    skip: int
    salt: str | None


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    releases: list[tuple[str, int]] = field(default_factory=list)  # holds not to be loaded


def slot_mapping(block_ids: list[int], block_size: int, length: int, start: int, end: int) -> np.ndarray:
    """Slots of tokens ``[start, end)`` (from the request's block table), ``-1`` elsewhere."""
    slots = np.full(length, -1, dtype=np.int64)
    if end > start:
        pos = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(block_ids, dtype=np.int64)
        if len(blocks) * block_size < end:
            raise ValueError(
                f"{len(blocks)} blocks of {block_size} cannot hold tokens up to {end}"
            )
        slots[start:end] = blocks[pos // block_size] * block_size + pos % block_size
    return slots


@dataclass
class _Request:
    """What the scheduler side tracks for one live request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    external: int = 0  # tokens to load in the request's next scheduled step
    hold_id: int | None = None  # the worker's hold those tokens are loaded from
    saved_upto: int = 0  # tokens handed to the worker for saving
    prompt_saved: bool = False
    had_save: bool = False


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's vLLM connector; see the module docstring for what each side does."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config: KVTierConfig = load_config(overrides=extra)
        logging.getLogger("kvtier").setLevel(self.config.log_level.upper())
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.config.chunk_size % self.block_size:
            raise ConfigError(
                "chunk_size", self.config.chunk_size,
                f"must be a multiple of vLLM's block size {self.block_size}",
            )
        self.chunk_size = self.config.chunk_size
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.world_size = int(vllm_config.parallel_config.world_size)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ===========================================================================================
    # Scheduler side
    # ===========================================================================================
    def _init_scheduler(self) -> None:
        self._reqs: dict[str, _Request] = {}
        self._clients = [
            LookupClient(socket_path(self.engine_id, r), self.config.lookup_timeout_s)
            for r in range(self.world_size)
        ]
        # Holds by request id that no load or release has consumed yet (see holds.py).
        self._hold_ids: dict[str, int] = {}
        self._next_hold_id = 0
        self._releases: list[tuple[str, int]] = []
        # Scheduler-process counters (the worker's are served over the lookup channel).
        self.scheduler_stats = {"lookups": 0, "lookup_failures": 0, "hit_tokens": 0}
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "kvtier: kv_load_failure_policy=%r: a load whose lookup hold expired (no load "
                "within %.0f s of the lookup) and whose chunks were evicted meanwhile fails the "
                "request; set kv_load_failure_policy='recompute' to recompute it instead",
                self._kv_transfer_config.kv_load_failure_policy, hold_ttl_s(self.config),
            )

    def _lookup(self, tokens: np.ndarray, salt: str | None, req_id: str, hold_id: int) -> int:
        """Tokens of ``tokens`` every rank holds (the minimum over ranks); 0 if any cannot say.

        Each rank keeps what it found as hold ``hold_id`` of ``req_id``; each holds at least the
        minimum, so the load of the reported hit reads only held chunks."""
        hit = len(tokens)
        header = {"op": "lookup", "salt": salt, "req_id": req_id, "hold_id": hold_id}
        for client in self._clients:
            try:
                reply = client.call(header, tokens)
            except ChannelError as e:
                self.scheduler_stats["lookup_failures"] += 1
                logger.warning("kvtier lookup failed, treating it as a miss: %s", e)
                return 0
            hit = min(hit, int(reply["hit"]))
        return hit

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        n = len(prompt)
        bs = self.block_size
        most = (n - 1) // bs * bs  # the last prompt token is always recomputed
        if most <= num_computed_tokens:
            return 0, False
        self.scheduler_stats["lookups"] += 1
        rid = request.request_id
        hold_id = self._hold_ids.get(rid)
        if hold_id is None:
            hold_id = self._hold_ids[rid] = self._next_hold_id
            self._next_hold_id += 1
        hit = self._lookup(np.asarray(prompt, dtype=np.int64), request.cache_salt, rid, hold_id)
        hit = min(hit, most)
        hit -= hit % bs
        new = max(0, hit - num_computed_tokens)
        self.scheduler_stats["hit_tokens"] += new
        return new, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _Request(request)
        state.external = num_external_tokens
        hold_id = self._hold_ids.pop(request.request_id, None)
        if num_external_tokens:
            state.hold_id = hold_id
        elif hold_id is not None:
            self._releases.append((request.request_id, hold_id))

    def _save_spec(self, rid: str, state: _Request, end: int) -> SaveSpec | None:
        """The save this step's forward pass makes possible (tokens ``[0, end)`` have KV)."""
        req = state.request
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
        # What the engine will actually store: whole chunks, plus a block-aligned tail when
        # save_unfull_chunk is set. Nothing storable means no save, so no blocks are held.
        step = self.block_size if self.config.save_unfull_chunk else c
        if save_end - save_end % step <= state.saved_upto:
            return None
        skip = state.saved_upto // c * c
        state.saved_upto = save_end
        state.had_save = True
        n_blocks = -(-save_end // self.block_size)
        tokens = np.asarray(req.all_token_ids[:save_end], dtype=np.int64)
        return SaveSpec(rid, tokens, list(state.block_ids[:n_blocks]), skip, req.cache_salt)

    def _schedule(
        self, meta: KVTierMetadata, rid: str, computed: int, scheduled: int
    ) -> None:
        state = self._reqs.get(rid)
        if state is None:
            return
        if state.external:
            end = computed
            start = end - state.external
            prompt = np.asarray(state.request.prompt_token_ids, dtype=np.int64)
            meta.loads.append(LoadSpec(rid, prompt, list(state.block_ids), start, end,
                                       state.request.cache_salt, state.hold_id))
            state.hold_id = None
            # Everything before the loaded chunk's start is stored already.
            state.saved_upto = max(state.saved_upto, end // self.chunk_size * self.chunk_size)
            state.external = 0
        spec = self._save_spec(rid, state, computed + scheduled)
        if spec is not None:
            meta.saves.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVTierMetadata(preempted=set(scheduler_output.preempted_req_ids or ()),
                              releases=self._releases)
        self._releases = []
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
            self._schedule(meta, new.req_id, new.num_computed_tokens,
                           scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
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
            self._schedule(meta, rid, cached.num_computed_tokens[i],
                           scheduler_output.num_scheduled_tokens.get(rid, 0))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the worker's saves of this request are done (``get_finished``).

        A hold still pending for the request is released through the next step's metadata."""
        rid = request.request_id
        state = self._reqs.pop(rid, None)
        hold_id = self._hold_ids.pop(rid, None)
        if hold_id is None and state is not None:
            hold_id = state.hold_id
        if hold_id is not None:
            self._releases.append((rid, hold_id))
        return (state is not None and state.had_save), None

    # ===========================================================================================
    # Worker side
    # ===========================================================================================
    def _init_worker(self) -> None:
        self.engine: CacheEngine | None = None
        self._server: LookupServer | None = None
        self._layer_of: dict[str, int] = {}
        self._load_jobs: list[RetrieveJob] = []
        self._store_gens: list[Iterator[int]] = []
        self._failed_blocks: set[int] = set()
        self._holds: HoldTable | None = None
        # The saver thread takes SaveSpecs from the queue; None stops it.
        self._save_queue: queue.Queue[SaveSpec | None] = queue.Queue()
        self._pending: dict[str, int] = {}  # req_id -> saves queued or running
        self._inflight: dict[int, SaveSpec] = {}  # id(spec) -> spec, queued or running
        self._pending_cv = threading.Condition()
        self._saving_reqs: set[str] = set()  # requests that had a save (their blocks are held)
        self._finishing: set[str] = set()
        self._saver: threading.Thread | None = None
        self._stats_lock = threading.Lock()
        self.worker_stats = {
            "load_requests": 0, "load_tokens_requested": 0, "loaded_tokens": 0,
            "load_failed_blocks": 0, "loads_without_hold": 0, "save_jobs": 0, "saved_tokens": 0,
            "save_errors": 0,
        }

    def _count(self, **kw: int) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                self.worker_stats[k] += v

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        vc = self._vllm_config
        mc = vc.model_config
        use_mla = bool(getattr(mc, "use_mla", False))
        layout = build_layout(
            kv_caches, block_size=self.block_size,
            num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
            head_size=mc.get_head_size(), use_mla=use_mla,
        )
        caches = ordered_caches(kv_caches)
        self._layer_of = {name: layer_index(name) for name in kv_caches}
        first = sorted(self._layer_of.values())
        self._layer_of = {n: first.index(i) for n, i in self._layer_of.items()}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        platform = get_platform(self.config.platform or caches[0].device.type, self.config.plugins,
                                device_index=caches[0].device.index)
        self.engine = CacheEngine(
            self.config, layout, model=str(mc.model), world_size=self.world_size, rank=rank,
            platform=platform,
        )
        self.engine.register_kv_caches(caches)
        self._holds = HoldTable(self.engine, hold_ttl_s(self.config))
        self._server = LookupServer(socket_path(self.engine_id, rank), self._serve)
        self._saver = threading.Thread(target=self._save_loop, name="kvtier-saver", daemon=True)
        self._saver.start()
        logger.info("kvtier: %s layout %s, tiers %s, lookup channel %s", layout.paged_layout.value,
                    layout.fingerprint(), self.config.tiers, self._server.path)

    def _serve(self, header: dict[str, Any], tokens: np.ndarray | None) -> dict[str, Any]:
        assert self.engine is not None and self._holds is not None
        op = header.get("op")
        if op == "lookup" and tokens is not None:
            salt = header.get("salt") or None
            self._wait_for_related_saves(tokens, salt, self.config.lookup_timeout_s / 2)
            hit = self._holds.lookup(str(header["req_id"]), int(header["hold_id"]), tokens, salt)
            return {"hit": hit}
        if op == "stats":
            with self._stats_lock:
                stats = dict(self.worker_stats)
            stats.update(self._holds.stats())
            stats.update({f"engine_{k}": v for k, v in self.engine.stats.as_dict().items()})
            return {"stats": stats}
        if op == "flush":
            # Saves queued so far, then lower-tier writes: what a planned restart waits for.
            timeout = float(header.get("timeout_s", SAVE_DRAIN_TIMEOUT_S))
            ok = self._drain_saves(timeout) and self.engine.storage.flush(timeout)
            return {"flushed": ok}
        raise ValueError(f"unknown lookup channel request {op!r}")

    def _meta(self) -> KVTierMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    # -- loads ---------------------------------------------------------------------------------
    def _load_slots(self, spec: LoadSpec) -> np.ndarray:
        return slot_mapping(spec.block_ids, self.block_size, len(spec.tokens), spec.start, spec.end)

    def _check_loaded(self, spec: LoadSpec, mask: torch.Tensor) -> None:
        want = mask[spec.start : spec.end]
        loaded = int(want.sum())
        self._count(load_requests=1, load_tokens_requested=spec.end - spec.start,
                    loaded_tokens=loaded)
        if loaded == spec.end - spec.start:
            return
        missing = (~want).nonzero().squeeze(1) + spec.start
        blocks = {spec.block_ids[int(i) // self.block_size] for i in missing}
        logger.warning("kvtier: request %s: %d of %d tokens could not be loaded; %d block(s) "
                       "reported failed to vLLM (its kv_load_failure_policy recomputes them or "
                       "fails the request)", spec.req_id, spec.end - spec.start - loaded,
                       spec.end - spec.start, len(blocks))
        self._count(load_failed_blocks=len(blocks))
        self._failed_blocks |= blocks

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or self.engine is None or self._holds is None:
            return
        for rid, hold_id in meta.releases:
            self._holds.release(rid, hold_id)
        self._holds.expire()
        for spec in meta.loads:
            slots = torch.from_numpy(self._load_slots(spec))
            hold = self._holds.take(spec.req_id, spec.hold_id)
            if hold is None:
                # Expired before its load: read the tiers (may come up short, see above).
                self._count(loads_without_hold=1)
            try:
                # The retrieval takes its own references to the held objects: the hold can go
                # as soon as it is planned, also for a layer-wise load still to run.
                if self.config.use_layerwise:
                    job = self.engine.retrieve_layerwise(spec.tokens, slots, salt=spec.salt,
                                                         hold=hold)
                    self._check_loaded(spec, job.mask)
                    self._load_jobs.append(job)
                else:
                    mask = self.engine.retrieve(spec.tokens, slots, salt=spec.salt, hold=hold)
                    self._check_loaded(spec, mask)
            finally:
                if hold is not None:
                    hold.release()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._load_jobs:
            return
        for job in self._load_jobs:
            next(job.layers, None)
        if self._layer_of.get(layer_name) == len(self._layer_of) - 1:
            self._finish_loads()

    def _finish_loads(self) -> None:
        jobs, self._load_jobs = self._load_jobs, []
        for job in jobs:
            for _ in job.layers:
                pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves ---------------------------------------------------------------------------------
    def _save_slots(self, spec: SaveSpec) -> torch.Tensor:
        n = len(spec.tokens)
        return torch.from_numpy(slot_mapping(spec.block_ids, self.block_size, n, spec.skip, n))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if not self.config.use_layerwise or self.engine is None:
            return
        meta = self._meta()
        if meta is None or not meta.saves:
            return
        if self._layer_of.get(layer_name) == 0:
            self._store_gens = [
                self.engine.store_layerwise(s.tokens, self._save_slots(s), salt=s.salt)
                for s in meta.saves
            ]
            self._count(save_jobs=len(meta.saves))
        for gen in self._store_gens:
            next(gen, None)

    def wait_for_save(self) -> None:
        self._finish_loads()
        meta = self._meta()
        if meta is None or self.engine is None:
            return
        # The scheduler holds the blocks of every request with a save until get_finished says so.
        self._saving_reqs.update(spec.req_id for spec in meta.saves)
        if self.config.use_layerwise:
            gens, self._store_gens = self._store_gens, []
            before = self.engine.stats.stored_tokens
            for gen in gens:
                for _ in gen:
                    pass
            self._count(saved_tokens=self.engine.stats.stored_tokens - before)
            return
        for spec in meta.saves:
            with self._pending_cv:
                self._pending[spec.req_id] = self._pending.get(spec.req_id, 0) + 1
                self._inflight[id(spec)] = spec
            self._save_queue.put(spec)

    def _save_loop(self) -> None:
        while True:
            spec = self._save_queue.get()
            if spec is None:
                return
            try:
                assert self.engine is not None
                n = self.engine.store(spec.tokens, self._save_slots(spec), salt=spec.salt)
                self._count(save_jobs=1, saved_tokens=n)
            except Exception:  # a failed save is a future miss, never a crashed engine
                logger.exception("kvtier: saving request %s failed", spec.req_id)
                self._count(save_errors=1)
            finally:
                with self._pending_cv:
                    del self._inflight[id(spec)]
                    left = self._pending[spec.req_id] - 1
                    if left:
                        self._pending[spec.req_id] = left
                    else:
                        del self._pending[spec.req_id]
                    self._pending_cv.notify_all()

    def _wait_for_related_saves(self, tokens: np.ndarray, salt: str | None, timeout_s: float) -> None:
        """Let in-flight saves of the same prefix land before answering a lookup.

        Saves run after the step that computed them, so a request repeated as soon as the
        previous one returned would otherwise miss the chunks being saved. Only saves whose
        first chunk is this prompt's first chunk are waited for, and never longer than
        ``timeout_s`` (then the lookup answers with what is stored).
        """
        k = min(len(tokens), self.chunk_size)

        def related() -> bool:
            return any(
                s.salt == salt and len(s.tokens) >= k and np.array_equal(s.tokens[:k], tokens[:k])
                for s in self._inflight.values()
            )

        with self._pending_cv:
            if k and not self._pending_cv.wait_for(lambda: not related(), timeout=timeout_s):
                logger.warning("kvtier: lookup answered before a save of the same prefix finished")

    def _drain_saves(self, timeout_s: float = SAVE_DRAIN_TIMEOUT_S) -> bool:
        with self._pending_cv:
            return self._pending_cv.wait_for(lambda: not self._pending, timeout=timeout_s)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """A preempted request's blocks are reused by this step: finish reading them first."""
        meta = kv_connector_metadata
        if isinstance(meta, KVTierMetadata) and meta.preempted and not self._drain_saves():
            logger.error("kvtier: saves did not finish in %.0f s before blocks were reused",
                             SAVE_DRAIN_TIMEOUT_S)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._holds is not None and finished_req_ids:
            self._holds.release_requests(finished_req_ids)
        self._finishing |= finished_req_ids & self._saving_reqs
        if not self._finishing:
            return None, None
        with self._pending_cv:
            done = {r for r in self._finishing if r not in self._pending}
        self._finishing -= done
        self._saving_reqs -= done
        return (done or None), None

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            for client in self._clients:
                client.close()
            return
        if self._saver is not None:
            self._save_queue.put(None)
            self._saver.join(timeout=SAVE_DRAIN_TIMEOUT_S)
            self._saver = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._holds is not None:
            self._holds.close()
            self._holds = None
        if self.engine is not None:
            self.engine.storage.flush(timeout=SAVE_DRAIN_TIMEOUT_S)
            self.engine.close()
            self.engine = None
