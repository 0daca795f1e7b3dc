"""The scheduler half of the connector driven step by step against real worker parts.

``Harness`` wires a ``SchedulerSide`` to one real ``CacheEngine`` per rank (CPU platform, host
memory), each with the worker's ``HoldTable`` and ``PresenceFeed``: what vLLM's engine loop
does between them (metadata down, worker reports up through ``KVConnectorOutput``) is done
here in-line, so tests can stop between any two steps. Probes run synchronously when a step's
metadata is delivered, unless ``deliver`` is told not to answer them.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.platforms.cpu import CPUPlatform
from kvtier.vllm_integration.holds import HoldTable
from kvtier.vllm_integration.metadata import KVTierMetadata
from kvtier.vllm_integration.presence import KVTierWorkerMeta, PresenceFeed, ProbeAnswer
from kvtier.vllm_integration.scheduler import SchedulerSide

BLOCK, CHUNK = 32, 64


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


@dataclass
class Harness:
    sched: SchedulerSide
    ranks: list[Rank]
    held: list[KVTierMetadata] = field(default_factory=list)  # metadata not delivered yet

    @classmethod
    def create(
        cls, world_size: int = 1, kv_events: bool = False, report_first: bool = True, **overrides
    ) -> Harness:
        """``report_first``: the workers' first report (after vLLM's first step) has reached
        the scheduler already."""
        layout = KVLayout(
            num_layers=2,
            num_kv_heads=2,
            head_size=8,
            dtype="bfloat16",
            block_size=BLOCK,
            paged_layout="vllm_cpu",
        )
        config = load_config(
            env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"], **overrides}
        )
        ranks = []
        for r in range(world_size):
            # Host memory only unless the config names more tiers (then kvtier-storage's).
            storage = None
            if config.tiers == ["local_cpu"]:
                arena = HostArena.create(32 * math.prod(layout.chunk_shape(CHUNK)) * 2)
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
                torch.randn(layout.expected_cache_shape(64)).to(torch.bfloat16) for _ in range(2)
            ]
            engine.register_kv_caches(caches)
            ranks.append(
                Rank(
                    engine, HoldTable(engine, 30.0), PresenceFeed(r, engine, tier_events=kv_events)
                )
            )
        sched = SchedulerSide(
            config,
            block_size=BLOCK,
            engine_id=f"h-{uuid.uuid4().hex[:6]}",
            num_workers=world_size,
            load_failure_policy="recompute",
            kv_events=kv_events,
        )
        harness = cls(sched, ranks)
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
        self.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))

    def deliver(self, meta: KVTierMetadata, answer: bool = True) -> None:
        """What the workers do with a step's metadata: releases, then probes (answered now
        unless ``answer`` is False: the answer then never comes)."""
        for rank in self.ranks:
            for rid, hold_id in meta.releases:
                rank.holds.release(rid, hold_id)
            if not answer:
                continue
            for p in meta.probes:
                n = rank.holds.lookup(p.req_id, p.hold_id, p.tokens, p.scope)
                rank.feed.answer(ProbeAnswer(p.req_id, p.hold_id, n, rank.holds.sources(p.req_id)))

    def step(self, answer: bool = True) -> KVTierMetadata:
        """An empty scheduler step: its metadata reaches the workers, their reports come back."""
        meta = self.sched.build_connector_meta(empty_output())
        self.deliver(meta, answer)
        self.report()
        return meta

    def hit(self, req: Request, computed: int = 0) -> int:
        """vLLM's view: ask, and while the answer is "not yet", run a step and ask again."""
        for _ in range(3):
            n, _ = self.sched.get_num_new_matched_tokens(req, computed)
            if n is not None:
                return n
            self.step()
        raise AssertionError("the lookup was never answered")

    def prefill(self, req: Request) -> KVTierMetadata:
        """One scheduler step that computes the whole prompt (no load); its metadata."""
        n = len(req.prompt_token_ids or ())
        blocks = list(range(-(-n // BLOCK)))
        self.sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        out = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(req, (blocks,))],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={req.request_id: n},
            total_num_scheduled_tokens=n,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0],
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        return self.sched.build_connector_meta(out)

    def store(self, req: Request, ranks: list[int] | None = None) -> None:
        """Prefill ``req`` and store what the step's metadata says to save, on every rank (or
        only ``ranks``), as the workers would (blocks 0.. hold the prompt); then report."""
        meta = self.prefill(req)
        self.deliver(meta)
        for i, rank in enumerate(self.ranks):
            if ranks is not None and i not in ranks:
                continue
            for spec in meta.saves:
                n = len(spec.tokens)
                rank.engine.store(spec.tokens, torch.arange(n), salt=spec.scope)
        self.report()

    def close(self) -> None:
        self.sched.shutdown()
        for rank in self.ranks:
            rank.holds.close()
            rank.engine.close()


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
