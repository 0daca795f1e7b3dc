"""The scheduler side's view of a hybrid model's KV cache groups (``groups.py``).

A hybrid model's requests have one block table per KV cache group, and vLLM frees a window
group's blocks that fall out of the window while the request runs (its null block takes their
place). So, for a hybrid model:

- each step, the live block ids of every group are read from vLLM's cache manager
  (``refresh``) and sent with each load, save and check (``attach``); a save starts at the first
  chunk whose window blocks are all live (``TrackedRequest.live_from``);
- a window block a save or check may still be reading on a worker can be freed and handed to
  another request; when a step reuses one (newly allocated, or filled by an asynchronous load)
  before every worker has reported that save copied (``RankReport.saves_copied``), the step's
  metadata asks the workers to finish their saves before anything writes
  (``KVTierMetadata.drain_saves``).

A model whose every layer is sliding window (one group) gets the same; a model without window
layers does none of this.

A Mamba hybrid (``groups.py``; ``mamba_cache_mode="align"``) keeps one recurrent state per
request in one block of each Mamba group, and vLLM says which block holds the state at which
boundary only in the step whose forward pass writes it (``boundary_state_offloads``; it
relocates state blocks later). So its states are saved from those offers (``take_offers``,
``states``: a save spec carries them, the worker stores them as state entries,
``kvtier.core.engine.states``), and fenced as window blocks are: a step that hands an offered block
to another request, or writes a request's running state in a block still being read, drains
the saves first. A load names the block of each Mamba group vLLM gave for the state at its end
(``LoadSpec.states``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from kvtier.vllm_integration.groups import NULL_BLOCK, CacheGroups
from kvtier.vllm_integration.messages import KVTierMetadata, LoadSpec, SaveSpec, VerifySpec
from kvtier.vllm_integration.scheduler.request_state import TrackedRequest

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
        rows = groups.rows
        self._window_rows = [rows.index(g) for g in groups.windows]  # in a spec's groups
        self._offers: dict[str, list[tuple[int, list[int]]]] = {}  # this step's, by request
        self._running: set[int] = set()  # Mamba blocks scheduled requests write in place

    def bind(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def refresh(self, rid: str) -> tuple[list[list[int]], int]:
        """The request's live block ids of every group (read before its specs are made), and
        the first token from which every window group still has its blocks."""
        if self._manager is None:
            raise RuntimeError(
                "a model with sliding-window layers needs vLLM's cache manager "
                "(bind_kv_cache_manager)"
            )
        ids = [list(g) for g in self._manager.get_block_ids(rid)]
        for g in self.groups.mambas:  # its running state: the last block of the group
            live = [b for b in ids[g] if b != NULL_BLOCK]
            if live:
                self._running.add(live[-1])
        return ids, self.groups.live_from(ids, self.block_size)

    def take_offers(self, output: SchedulerOutput) -> None:
        """The step's boundary-state offers: for each request, ``(boundary, block of each
        Mamba group)`` where every Mamba group offered one."""
        self._offers = {}
        self._running = set()
        block_state = getattr(output, "kv_connector_block_state", None)
        if not self.groups.mambas or block_state is None:
            return
        for rid, items in (block_state.boundary_state_offloads or {}).items():
            by: dict[int, dict[int, int]] = {}
            for group, block, boundary in items:
                by.setdefault(int(boundary), {})[int(group)] = int(block)
            self._offers[rid] = [
                (b, [blocks[g] for g in self.groups.mambas])
                for b, blocks in sorted(by.items())
                if all(g in blocks for g in self.groups.mambas)
            ]

    def states(self, rid: str, chunk_size: int, limit: int) -> list[tuple[int, list[int]]]:
        """The request's offered states a save stores: at full-chunk boundaries within its
        first ``limit`` tokens (its prompt: only prompt tokens are keyed)."""
        return [
            (b, blocks)
            for b, blocks in self._offers.get(rid, ())
            if 0 < b <= limit and b % chunk_size == 0
        ]

    def with_states(
        self, rid: str, req: TrackedRequest, spec: SaveSpec | None, chunk: int
    ) -> tuple[SaveSpec | None, bool]:
        """``spec`` (the request's save this step, or None) carrying the states vLLM offered
        for it this step (``states``), within what the save stores; a save of the states
        alone when its chunks are stored already (then True)."""
        limit = min(len(spec.tokens) if spec is not None else len(req.prompt), len(req.prompt))
        states = self.states(rid, chunk, limit)
        if not states or not req.cacheable:
            return spec, False
        alone = spec is None
        if spec is None:
            end = states[-1][0]
            spec = SaveSpec(rid, req.prompt[:end], [], end, req.scope)
        spec.states = states
        return spec, alone

    def attach(
        self, spec: LoadSpec | SaveSpec | VerifySpec, groups: Sequence[Sequence[int]] | None
    ) -> None:
        """Give ``spec`` every group's block ids for its tokens (the groups' blocks may differ
        in size: each group's own); where they differ, its primary ones too."""
        if self.groups.tracked and groups is not None:
            g0 = self.groups
            if not g0.block_sizes:
                n = len(spec.block_ids)
                spec.groups = [list(groups[g][:n]) for g in g0.rows]
            else:
                end = spec.end if isinstance(spec, LoadSpec) else len(spec.tokens)
                cut = [list(ids[: -(-end // g0.block_sizes[g])]) for g, ids in enumerate(groups)]
                spec.groups = [cut[g] for g in g0.rows]
                spec.block_ids = cut[g0.primary]
            if isinstance(spec, LoadSpec) and self.groups.mambas:
                spec.states = self._state_blocks(groups, spec.end)

    def _state_blocks(self, groups: Sequence[Sequence[int]], end: int) -> list[int] | None:
        """The block of each Mamba group vLLM gave for the state after ``end`` tokens (an
        external hit gets one at index ``end / block_size - 1``); None where it gave none
        (the load then loads nothing and is reported failed)."""
        i = end // self.block_size - 1
        out = [groups[g][i] if 0 <= i < len(groups[g]) else NULL_BLOCK for g in self.groups.mambas]
        return None if NULL_BLOCK in out else out

    def fence(self, meta: KVTierMetadata, output: SchedulerOutput, copied_through: int) -> None:
        """Ask for a drain when this step reuses a window block still being read; then
        remember the window blocks this step's saves and checks read."""
        if not self.groups.tracked:
            return
        self._reading = {b: s for b, s in self._reading.items() if s > copied_through}
        size_of = partial(self.groups.block_size_of, block_size=self.block_size)
        written = [*_written(meta, output, size_of), *self._running]
        if self._reading and any(b in self._reading for b in written):
            meta.drain_saves = True
            self.drains += 1
        specs: list[SaveSpec | VerifySpec] = [*meta.saves, *meta.verifies]
        for spec in specs:
            if spec.groups is None:
                continue
            for g in self._window_rows:
                for b in spec.groups[g]:
                    if b != NULL_BLOCK:
                        self._reading[b] = meta.step
        for save in meta.saves:
            for _, blocks in save.states:
                for b in blocks:
                    self._reading[b] = meta.step


def _written(
    meta: KVTierMetadata, output: SchedulerOutput, size_of: Callable[[int], int]
) -> Iterable[int]:
    """Every block this step may write (``size_of``: a group's block size): newly scheduled
    requests' blocks past what they had computed (before it: vLLM's prefix-cache hits, read
    only; kvtier's loads are listed with the loads), new blocks of every group, the blocks of
    the loads it carries (their state blocks too) and the targets of vLLM's block copies."""
    for new in output.scheduled_new_reqs:
        for g, ids in enumerate(new.block_ids):
            yield from ids[new.num_computed_tokens // size_of(g) :]
    for blocks in output.scheduled_cached_reqs.new_block_ids:
        for ids in blocks or ():
            yield from ids
    for load in meta.loads:
        for ids in load.groups or ():
            yield from ids
        yield from load.states or ()  # a Mamba hybrid's state blocks the load writes
    # Blocks vLLM fills by copying this step (a Mamba group's copy-on-write of a state).
    for copy in getattr(output, "kv_cache_block_copies", None) or ():
        yield copy.dst_block_id
