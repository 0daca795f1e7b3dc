"""The read side of ``CacheEngine``: the objects a lookup's hit prefix keeps
(``LoadPlanner.fetch_prefix``, what ``hold`` takes) and the transfers of one ``retrieve``
(``LoadPlanner.plan``): the hit spans the caller wants (fetched now, or taken from a ``Hold``),
each paired with the cache slots its object is written to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.core.engine.slots import span_rows, written
from kvtier.core.engine.states import StateEntries
from kvtier.core.engine.store_writer import release_all
from kvtier.core.errors import KVTierError
from kvtier.core.keys.prompt import PromptHashes
from kvtier.core.keys.spans import SpanPlanner
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObj
from kvtier.core.memory.handles import ChunkSpan, EngineStats, Hold
from kvtier.core.platform.mover import Transfer
from kvtier.core.storage import StorageManager


class LoadPlanner:
    """Fetches hit prefixes and plans the loads of one engine (its storage, spans and layout)."""

    def __init__(
        self,
        storage: StorageManager,
        spans: SpanPlanner,
        layout: KVLayout,
        states: StateEntries | None,
        stats: EngineStats,
    ) -> None:
        self.storage = storage
        self.spans = spans
        self.layout = layout
        self.states = states
        self.stats = stats

    def fetch_prefix(self, spans: Sequence[ChunkSpan]) -> tuple[list[ChunkSpan], list[MemoryObj]]:
        """Get the objects of ``spans``; keep only the contiguous run from the first one.

        Once a chunk is gone (or is not what its span says), later chunks are useless: they are
        released, not returned.
        """
        objs = self.storage.batched_get([s.key for s in spans]) if spans else []
        kept: list[MemoryObj] = []
        for i, (span, obj) in enumerate(zip(spans, objs, strict=True)):
            if obj is None:
                continue
            if len(kept) == i and obj.num_tokens == span.object_tokens:
                kept.append(obj)
            else:
                obj.release()
        if len(kept) < len(spans):
            self.stats.add(retrieve_misses=1)
        return list(spans[: len(kept)]), kept

    def plan(
        self,
        prompt: PromptHashes,
        cpu_slots: torch.Tensor,
        hold: Hold | None,
        state_blocks: Sequence[int] | None = None,
    ) -> tuple[list[Transfer], torch.Tensor]:
        """The transfers of a retrieve of ``prompt`` into ``cpu_slots`` (checked, on the host)
        and the mask of the tokens they write: from ``hold``'s objects, else fetched now. The
        transfers' objects are the caller's to release."""
        # Per token, whether any group has a slot; summed once, so a span's test is a subtraction.
        seen = np.concatenate(([0], np.cumsum(written(cpu_slots).numpy())))

        def wanted(span: ChunkSpan) -> bool:
            return bool(seen[span.end] > seen[span.start])

        if hold is None:
            spans, objs = self.fetch_prefix([s for s in self.spans.hits(prompt) if wanted(s)])
        else:
            spans, objs = held_objects(hold, prompt, wanted)
        try:
            transfers, mask = load_transfers(spans, objs, cpu_slots, self.layout)
        except BaseException:
            release_all(objs)
            raise
        if self.states is None or not transfers:
            return transfers, mask
        return self.states.with_state(
            prompt, cpu_slots, transfers, mask, hold.state if hold else None, state_blocks
        )


def held_objects(
    hold: Hold, prompt: PromptHashes, wanted: Callable[[ChunkSpan], bool]
) -> tuple[list[ChunkSpan], list[MemoryObj]]:
    """The spans of ``hold`` that ``wanted`` keeps, each with a new handle on its object (the
    hold stays its owner's); ``hold`` must be live and taken for the prompt's tokens and
    scope."""
    if hold.released:
        raise KVTierError("retrieve got a hold that was already released")
    n = hold.num_tokens
    if n > len(prompt.arr) or hold.digest != prompt.digest(n):
        raise ValueError("retrieve got a hold taken for other tokens or another scope")
    pairs = [(s, o.share()) for s, o in zip(hold.spans, hold.objs, strict=True) if wanted(s)]
    return [s for s, _ in pairs], [o for _, o in pairs]


def load_transfers(
    spans: Sequence[ChunkSpan],
    objs: Sequence[MemoryObj],
    cpu_slots: torch.Tensor,
    layout: KVLayout,
) -> tuple[list[Transfer], torch.Tensor]:
    """A ``Transfer`` of each object into the cache blocks of its span's slots, and the bool
    mask (one per token) of the tokens those transfers write (the span's slots that are not
    -1; for a hybrid engine's ``[groups, n]`` slots, those of any group). Slots must map whole
    blocks (``span_blocks``) of each group's block size (``layout``). Each run of adjacent
    spans (a hit is one) is read in one pass and cut per span: the work does not grow with its
    chunks."""
    mask = torch.zeros(cpu_slots.shape[-1], dtype=torch.bool)
    unit, per_block = layout.block_tokens, layout.rows_per_block
    cuts: list[torch.Tensor] = []
    for run in _runs(spans):
        start, end = run[0].start, run[-1].end
        rows = span_rows(cpu_slots, start, end, layout.slot_block_sizes)
        mask[start:end] = written(cpu_slots[..., start:end])
        for span in run:
            first = (span.start - start) // unit * per_block
            cuts.append(rows[first : first + span.num_tokens // unit * per_block])
    transfers = []
    for blocks, obj in zip(cuts, objs, strict=True):
        n = obj.tensor.shape[0]
        if n > len(blocks):
            # A prefix of a stored chunk (an alias hit): the rest of its blocks are skipped.
            blocks = torch.cat([blocks, blocks.new_full((n - len(blocks),), -1)])
        transfers.append(Transfer(obj, blocks))
    return transfers, mask


def _runs(spans: Sequence[ChunkSpan]) -> list[list[ChunkSpan]]:
    """``spans`` in runs of adjacent ones (each starting where the one before ends)."""
    runs: list[list[ChunkSpan]] = []
    for span in spans:
        if runs and runs[-1][-1].end == span.start:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs
