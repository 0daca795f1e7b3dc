"""The scheduler half of the connector driven step by step against real worker parts.

``Harness`` wires a ``SchedulerSide`` to one real ``CacheEngine`` per rank (CPU platform, host
memory), each with the worker's ``HoldTable`` and ``PresenceFeed``: what vLLM's engine loop
does between them (metadata down, worker reports up through ``KVConnectorOutput``) is done
here in-line, so tests can stop between any two steps. Probes run synchronously when a step's
metadata is delivered, unless ``deliver`` is told not to answer them.

With ``pool_blocks`` the scheduler is bound to a real vLLM ``BlockPool`` with prefix caching
(what lazy offload walks and touches); ``run`` and ``finish`` play vLLM's part for a request
(allocate blocks, cache their block hashes, free them in vLLM's order when it finishes), and
the lazy saves of a delivered step are copied from those blocks (unless ``copy`` is False: the
copy is then still running until ``copy_lazy``).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

import torch
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.keys.receipts import has_receipt, write_receipt
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.vllm_integration.messages import (
    KVTierMetadata,
    KVTierWorkerMeta,
    LazyWorkerMeta,
    ProbeAnswer,
    SaveSpec,
    slot_mapping,
)
from kvtier.vllm_integration.scheduler.side import SchedulerSide
from kvtier.vllm_integration.worker.feed import PresenceFeed
from kvtier.vllm_integration.worker.holds import HoldTable

BLOCK, CHUNK = 32, 64
CACHE_BLOCKS = 64  # blocks of the fake paged cache each rank's engine reads


def block_hasher():
    """vLLM's request block hasher (sha256), for requests whose blocks a ``BlockPool`` caches."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def request(tokens, *, salt=None, **kw) -> Request:
    return Request(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=list(tokens) if tokens is not None else None,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        cache_salt=salt,
        **kw,
    )


@dataclass
class Rank:
    engine: CacheEngine
    holds: HoldTable
    feed: PresenceFeed
    caches: list[torch.Tensor] = field(default_factory=list)  # the paged cache it reads


@dataclass
class Harness:
    sched: SchedulerSide
    ranks: list[Rank]
    held: list[KVTierMetadata] = field(default_factory=list)  # metadata not delivered yet
    pool: BlockPool | None = None
    in_copy: list[SaveSpec] = field(default_factory=list)  # lazy saves delivered, not copied
    copied: dict[int, list[str]] = field(default_factory=dict)  # for the next report
    # Each rank's live weights (their digest) at start, and now: a worker reports the latter,
    # and whether it differs, after every reset; a test changes them as a weight update would.
    start_live: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)
    weights_epoch: int = 0

    @classmethod
    def create(
        cls,
        world_size: int = 1,
        kv_events: bool = False,
        report_first: bool = True,
        pool_blocks: int | None = None,
        max_num_batched_tokens: int = 2048,
        arena_chunks: int = 32,
        cache_blocks: int = CACHE_BLOCKS,
        token_bytes: int = 0,
        **overrides,
    ) -> Harness:
        """``report_first``: the workers' first report (after vLLM's first step) has reached
        the scheduler already. ``pool_blocks``: bind a vLLM block pool of that many blocks.
        ``arena_chunks``: each rank's host memory, in chunks of the configured size;
        ``cache_blocks``: blocks of each rank's fake paged cache. ``token_bytes``: what the
        scheduler is told one token's KV takes (0: unknown, so no hit loads synchronously)."""
        layout = KVLayout(
            num_layers=2,
            num_kv_heads=2,
            head_size=8,
            dtype="bfloat16",
            block_size=BLOCK,
            paged_layout="LBHNC",
        )
        config = load_config(
            env={},
            overrides={
                "chunk_size": CHUNK,
                "tiers": ["local_cpu"],
                "lookup": "probe",
                "verify_fraction": 0.0,
                **overrides,
            },
        )
        ranks = []
        for r in range(world_size):
            # Host memory only unless the config names more tiers (then kvtier-storage's).
            storage = None
            if config.tiers == ["local_cpu"]:
                chunk = config.chunk_size
                arena = HostArena.create(arena_chunks * math.prod(layout.chunk_shape(chunk)) * 2)
                storage = HostMemoryStorageManager(arena)
            engine = CacheEngine(
                config,
                layout,
                model="m",
                world_size=world_size,
                rank=r,
                platform=CPUPlatform(),
                storage=storage,
            )
            caches = [
                torch.randn(layout.expected_cache_shape(cache_blocks)).to(torch.bfloat16)
                for _ in range(2)
            ]
            engine.register_kv_caches(caches)
            ranks.append(
                Rank(
                    engine,
                    HoldTable(engine, 30.0),
                    PresenceFeed(r, engine, tier_events=kv_events),
                    caches,
                )
            )
        sched = SchedulerSide(
            config,
            block_size=BLOCK,
            num_workers=world_size,
            load_failure_policy="recompute",
            kv_events=kv_events,
            max_num_batched_tokens=max_num_batched_tokens,
            token_bytes=token_bytes,
        )
        start = ["weights-0"] * world_size
        harness = cls(sched, ranks, start_live=start, live=list(start))
        if pool_blocks is not None:
            assert pool_blocks <= cache_blocks
            harness.pool = BlockPool(pool_blocks, enable_caching=True, hash_block_size=BLOCK)
            sched.bind_gpu_block_pool(harness.pool)
        if report_first:
            harness.report()
        return harness

    def report(self) -> None:
        """Send every rank's report of this step to the scheduler."""
        meta: KVTierWorkerMeta | None = None
        for rank in self.ranks:
            mine = rank.feed.take()
            if mine is None:
                continue
            meta = mine if meta is None else meta.aggregate(mine)  # type: ignore[assignment]
        if self.copied:
            lazy = LazyWorkerMeta(meta.reports if meta is not None else {}, self.copied)
            meta, self.copied = lazy, {}
        self.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))

    def deliver(self, meta: KVTierMetadata, answer: bool = True, copy: bool = True) -> None:
        """What the workers do with a step's metadata: releases, then probes (answered now
        unless ``answer`` is False: the answer then never comes), then lazy saves (copied now
        unless ``copy`` is False)."""
        if meta.weights_epoch != self.weights_epoch:
            self.weights_epoch = meta.weights_epoch
            for rank, live, start in zip(self.ranks, self.live, self.start_live, strict=True):
                rank.feed.weights(meta.weights_epoch, live, live != start)
        self.in_copy.extend(meta.lazy_saves)
        if copy:
            self.copy_lazy()
        for rank in self.ranks:
            for rid, hold_id in meta.releases:
                rank.holds.release(rid, hold_id)
            if not answer:
                continue
            for p in meta.probes:
                storage, keys = rank.engine.storage, rank.engine.keys
                # As a worker's probe: the consumer's receipt first, then the chunks.
                settled = p.receipt is not None and has_receipt(storage, keys, p.receipt, p.scope)
                n = rank.holds.lookup(p.req_id, p.hold_id, p.tokens, p.scope)
                sources = rank.holds.sources(p.req_id)
                rank.feed.answer(ProbeAnswer(p.req_id, p.hold_id, n, sources, settled))

    def copy_lazy(self) -> None:
        """Every rank copies the lazy saves delivered so far from their blocks (reported with
        the next report)."""
        specs, self.in_copy = self.in_copy, []
        for i, rank in enumerate(self.ranks):
            for spec in specs:
                n = len(spec.tokens)
                slots = slot_mapping(spec.block_ids, BLOCK, n, spec.skip, n)
                rank.engine.store(spec.tokens, torch.from_numpy(slots), scope=spec.scope)
                self.copied.setdefault(i, []).append(spec.req_id)

    def step(self, answer: bool = True, copy: bool = True) -> KVTierMetadata:
        """An empty scheduler step: its metadata reaches the workers, their reports come back."""
        meta = self.sched.build_connector_meta(empty_output())
        self.deliver(meta, answer, copy)
        self.report()
        return meta

    def run(self, req: Request, copy: bool = True) -> list[KVCacheBlock]:
        """vLLM runs ``req`` with its prefix cache: new blocks from the pool (the head of its
        free queue is evicted), the full ones cached under the request's block hashes, the
        prompt computed in one step (whose metadata the workers get). Returns the blocks."""
        assert self.pool is not None
        n = len(req.prompt_token_ids or ())
        blocks = self.pool.get_new_blocks(-(-n // BLOCK))
        self.pool.cache_full_blocks(req, blocks, 0, n // BLOCK, BLOCK, 0)
        self.deliver(self.prefill(req, [b.block_id for b in blocks]), copy=copy)
        self.report()
        return blocks

    def finish(self, req: Request, blocks: list[KVCacheBlock]) -> None:
        """``req`` finishes: the connector is told, vLLM frees its blocks (tail first)."""
        assert self.pool is not None
        req.num_computed_tokens = len(req.prompt_token_ids or ())
        assert not self.sched.request_finished(req, [b.block_id for b in blocks])
        self.pool.free_blocks(reversed(blocks))

    def hit(self, req: Request, computed: int = 0) -> int:
        """vLLM's view: ask, and while the answer is "not yet", run a step and ask again."""
        for _ in range(3):
            n, _ = self.sched.get_num_new_matched_tokens(req, computed)
            if n is not None:
                return n
            self.step()
        raise AssertionError("the lookup was never answered")

    def prefill(
        self,
        req: Request,
        blocks: list[int] | None = None,
        computed: int = 0,
        allocated: bool = False,
    ) -> KVTierMetadata:
        """One scheduler step that computes the whole prompt into ``blocks`` (default 0, 1,
        ...), after the first ``computed`` tokens vLLM's prefix cache had (no load), or that
        ``update_state_after_alloc`` was told of already (``allocated``: a synchronous load of
        the hit goes with the step); its metadata."""
        n = len(req.prompt_token_ids or ())
        blocks = blocks if blocks is not None else list(range(-(-n // BLOCK)))
        if not allocated:
            self.sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        req.num_computed_tokens = computed
        out = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(req, (blocks,))],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={req.request_id: n - computed},
            total_num_scheduled_tokens=n - computed,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0],
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        return self.sched.build_connector_meta(out)

    def store(
        self, req: Request, ranks: list[int] | None = None, saved: bool = True
    ) -> KVTierMetadata:
        """Prefill ``req`` and store what the step's metadata says to save, on every rank (or
        only ``ranks``), as the workers would (blocks 0.. hold the prompt; with ``saved`` False
        every store is skipped, as when host memory is full), then write its receipts (a
        producer's); then report. Returns the step's metadata."""
        meta = self.prefill(req)
        self.deliver(meta)
        for i, rank in enumerate(self.ranks):
            if ranks is not None and i not in ranks:
                continue
            for spec in meta.saves if saved else ():
                n = len(spec.tokens)
                rank.engine.store(spec.tokens, torch.arange(n), scope=spec.scope)
            for r in meta.receipts:
                assert write_receipt(rank.engine.storage, rank.engine.keys, r.receipt, r.scope)
            rank.feed.saves_copied(meta.step)  # as the worker's saver reports it
        self.report()
        return meta

    def close(self) -> None:
        self.sched.shutdown()
        for rank in self.ranks:
            rank.holds.close()
            rank.engine.close()


def blocks(n_tokens: int) -> KVCacheBlocks:
    """Blocks 0, 1, ... for ``n_tokens`` tokens, as vLLM's cache manager hands them to
    ``update_state_after_alloc``."""
    return KVCacheBlocks(([KVCacheBlock(i) for i in range(-(-n_tokens // BLOCK))],))


def empty_output() -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
