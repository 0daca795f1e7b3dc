"""What the scheduler side learns from each step's ``KVConnectorOutput``: saves done (vLLM frees
those requests' blocks now), loads that failed (vLLM recomputes them; kvtier stops offering
those requests a hit), and each worker's report (chunks for the index and the KV events, probe
answers, shortfalls of index-answered loads, quarantines, lazy copies done)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.vllm_integration.messages import KVTierWorkerMeta, LazyWorkerMeta, RankReport
from kvtier.vllm_integration.scheduler.events import EventLog
from kvtier.vllm_integration.scheduler.frees import BlockFrees
from kvtier.vllm_integration.scheduler.generation import WeightsGeneration
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.lazy import LazyOffload
from kvtier.vllm_integration.scheduler.request import RequestLifecycle
from kvtier.vllm_integration.scheduler.verify import VerifySampling

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

logger = logging.getLogger("kvtier")


@dataclass
class StepOutputs:
    """Applies a step's output to the scheduler side's parts (see the module docstring)."""

    requests: RequestLifecycle
    index: PresenceIndex
    frees: BlockFrees
    events: EventLog
    verify: VerifySampling
    lazy: LazyOffload | None
    weights: WeightsGeneration

    def apply(self, output: KVConnectorOutput) -> None:
        self.frees.sent(set(output.finished_sending or ()))
        blocks, failed = output.invalid_block_ids, output.failed_recving
        if blocks or failed:
            for rid in self.requests.load_failures(blocks or set(), failed or set()):
                logger.warning(
                    "kvtier: loading request %s failed; it is recomputed and not offered a "
                    "kvtier hit again",
                    rid,
                )
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            for report in meta.reports.values():
                self._report(report)
        if isinstance(meta, LazyWorkerMeta) and self.lazy is not None:
            for rank, lazy_ids in meta.saved.items():
                self.lazy.copied(rank, lazy_ids)

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
            self.requests.answer(report.rank, ans)
        for rid, found in report.short:
            self.requests.short(report.rank, rid, found)
