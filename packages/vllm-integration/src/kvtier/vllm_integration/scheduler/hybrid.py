"""The scheduler side's view of a hybrid model's KV cache groups (``groups.py``).

A hybrid model's requests have one block table per KV cache group, and vLLM frees a window
group's blocks that fall out of the window while the request runs (its null block takes their
place). So, for a hybrid model:

- each step, the live block ids of every group are read from vLLM's cache manager
  (``refresh``) and sent with each load, save and check (``attach``); a save starts at the first
  chunk whose window blocks are all live (``RequestState.live_from``);
- a window block a save or check may still be reading on a worker can be freed and handed to
  another request; when a step reuses one (newly allocated, or filled by an asynchronous load)
  before every worker has reported that save copied (``RankReport.saves_copied``), the step's
  metadata asks the workers to finish their saves before anything writes
  (``KVTierMetadata.drain_saves``).

A model whose every layer is sliding window (one group) gets the same; a model without window
layers does none of this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvtier.vllm_integration.groups import NULL_BLOCK, CacheGroups
from kvtier.vllm_integration.messages import KVTierMetadata, LoadSpec, SaveSpec, VerifySpec
from kvtier.vllm_integration.scheduler.lookups import RequestState

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput


class HybridBlocks:
    """Per-group block ids and the fence for freed window blocks (module docstring)."""

    def __init__(self, groups: CacheGroups, block_size: int) -> None:
        self.groups = groups
        self.block_size = block_size
        self._manager: KVCacheManager | None = None
        self._reading: dict[int, int] = {}  # window block -> last step a save/check read it
        self.drains = 0  # steps whose metadata asked the workers to drain their saves

    def bind(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def refresh(self, rid: str, state: RequestState) -> None:
        """Read the request's live block ids of every group (before its specs are made)."""
        if not self.groups.tracked:
            return
        if self._manager is None:
            raise RuntimeError(
                "a model with sliding-window layers needs vLLM's cache manager "
                "(bind_kv_cache_manager)"
            )
        ids = [list(g) for g in self._manager.get_block_ids(rid)]
        state.groups = ids
        state.live_from = self.groups.live_from(ids) * self.block_size

    def attach(
        self, spec: LoadSpec | SaveSpec | VerifySpec, groups: Sequence[Sequence[int]] | None
    ) -> None:
        """Give ``spec`` every group's block ids, as many as its primary ones."""
        if self.groups.tracked and groups is not None:
            n = len(spec.block_ids)
            spec.groups = [list(g[:n]) for g in groups]

    def fence(self, meta: KVTierMetadata, output: SchedulerOutput, copied_through: int) -> None:
        """Ask for a drain when this step reuses a window block still being read; then
        remember the window blocks this step's saves and checks read."""
        if not self.groups.tracked:
            return
        self._reading = {b: s for b, s in self._reading.items() if s > copied_through}
        written = _written(meta, output, self.block_size)
        if self._reading and any(b in self._reading for b in written):
            meta.drain_saves = True
            self.drains += 1
        specs: list[SaveSpec | VerifySpec] = [*meta.saves, *meta.verifies]
        for spec in specs:
            if spec.groups is None:
                continue
            for g in self.groups.windows:
                for b in spec.groups[g]:
                    if b != NULL_BLOCK:
                        self._reading[b] = meta.step


def _written(meta: KVTierMetadata, output: SchedulerOutput, block_size: int) -> Iterable[int]:
    """Every block this step may write: newly scheduled requests' blocks past what they had
    computed (before it: vLLM's prefix-cache hits, read only; kvtier's loads are listed with
    the loads), new blocks of every group, and the blocks of the loads it carries."""
    for new in output.scheduled_new_reqs:
        first = new.num_computed_tokens // block_size
        for ids in new.block_ids:
            yield from ids[first:]
    for blocks in output.scheduled_cached_reqs.new_block_ids:
        for ids in blocks or ():
            yield from ids
    for load in meta.loads:
        for ids in load.groups or ():
            yield from ids
