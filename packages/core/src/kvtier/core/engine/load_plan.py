"""The transfers of one ``CacheEngine.retrieve``: the hit spans the caller wants (fetched now,
or taken from a ``Hold``), each paired with the cache slots its object is written to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.core.engine.slots import span_rows, written
from kvtier.core.errors import KVTierError
from kvtier.core.keys.prompt import PromptHashes
from kvtier.core.memory import MemoryObj
from kvtier.core.memory.handles import ChunkSpan, Hold
from kvtier.core.platform.mover import Transfer


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
    block_sizes: Sequence[int],
) -> tuple[list[Transfer], torch.Tensor]:
    """A ``Transfer`` of each object into the cache blocks of its span's slots, and the bool
    mask (one per token) of the tokens those transfers write (the span's slots that are not
    -1; for a hybrid engine's ``[groups, n]`` slots, those of any group). Slots must map whole
    blocks (``span_blocks``) of each row's ``block_sizes``."""
    mask = torch.zeros(cpu_slots.shape[-1], dtype=torch.bool)
    transfers = []
    for span, obj in zip(spans, objs, strict=True):
        blocks = span_rows(cpu_slots, span.start, span.end, block_sizes)
        rows = obj.tensor.shape[0]
        if rows > len(blocks):
            # A prefix of a stored chunk (an alias hit): the rest of its blocks are skipped.
            blocks = torch.cat([blocks, blocks.new_full((rows - len(blocks),), -1)])
        transfers.append(Transfer(obj, blocks))
        mask[span.start : span.end] = written(cpu_slots[..., span.start : span.end])
    return transfers, mask
