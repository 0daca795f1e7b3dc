"""What the scheduler side learns from each step's ``KVConnectorOutput``: saves done (vLLM frees
those requests' blocks now), loads that failed (vLLM recomputes them; kvtier stops offering
those requests a hit), and each worker's report (chunks for the index and the KV events, probe
answers, shortfalls of index-answered loads, quarantines, lazy copies done)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.vllm_integration.messages import KVTierWorkerMeta, LazyWorkerMeta, RankReport
from kvtier.vllm_integration.scheduler.events import EventLog
from kvtier.vllm_integration.scheduler.frees import BlockFrees
from kvtier.vllm_integration.scheduler.generation import WeightsGeneration
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.lazy import LazyOffload
from kvtier.vllm_integration.scheduler.lookups import Lookups, RequestState
from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt
from kvtier.vllm_integration.scheduler.verify import VerifySampling

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

logger = logging.getLogger("kvtier")


@dataclass
class StepOutputs:
    """Applies a step's output to the scheduler side's parts (see the module docstring)."""

    requests: dict[str, RequestState]
    index: PresenceIndex
    lookups: Lookups
    frees: BlockFrees
    events: EventLog
    verify: VerifySampling
    lazy: LazyOffload | None
    hashes: Callable[[RequestState], IndexedPrompt]
    chunk_size: int
    weights: WeightsGeneration

    def apply(self, output: KVConnectorOutput) -> None:
        self.frees.sent(set(output.finished_sending or ()))
        self._load_failures(output.invalid_block_ids, output.failed_recving)
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            for report in meta.reports.values():
                self._report(report)
        if isinstance(meta, LazyWorkerMeta) and self.lazy is not None:
            for rank, lazy_ids in meta.saved.items():
                self.lazy.copied(rank, lazy_ids)

    def _load_failures(self, blocks: set[int], requests: set[str]) -> None:
        """Requests whose load failed (a block in ``blocks``, or named in ``requests``): vLLM
        recomputes them; kvtier stops offering them a hit."""
        if not blocks and not requests:
            return
        for rid, state in self.requests.items():
            if state.load_failed:
                continue
            if rid in requests or not blocks.isdisjoint(state.block_ids):
                state.load_failed = True
                self.lookups.release(state)
                logger.warning(
                    "kvtier: loading request %s failed; it is recomputed and not offered a "
                    "kvtier hit again",
                    rid,
                )

    def _report(self, report: RankReport) -> None:
        self.index.apply(report)
        if report.weights is not None:
            self.weights.report(report.rank, *report.weights)
        for _, seconds in report.quarantined:
            self.verify.quarantined(seconds)
        self.frees.copied(report.rank, report.saves_copied)
        if report.rank == 0:
            self.events.stored("local_cpu", report.added)
            self.events.removed("local_cpu", report.evicted)
            for tier, stored, dropped in report.tier_events:
                self.events.stored(tier, stored)
                self.events.removed(tier, dropped)
        for ans in report.answers:
            state = self.requests.get(ans.req_id)
            hashes = self.hashes(state) if state is not None else None
            self.lookups.answer(state, hashes, report.rank, ans)
        for rid, found in report.short:
            state = self.requests.get(rid)
            self.lookups.shortfall(self.hashes(state) if state else None, report.rank, found)
            if state is not None:
                # vLLM recomputes what the load missed: save those chunks again
                state.saved_upto = min(state.saved_upto, found // self.chunk_size * self.chunk_size)
