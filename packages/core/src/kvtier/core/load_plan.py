"""The transfers of one ``CacheEngine.retrieve``: the hit spans the caller wants (fetched now,
or taken from a ``Hold``), each paired with the cache slots its object is written to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.core.connector import Transfer
from kvtier.core.errors import KVTierError
from kvtier.core.handles import ChunkSpan, Hold, prefix_digest
from kvtier.core.keys import Scope
from kvtier.core.memory import MemoryObj


def held_objects(
    hold: Hold, arr: np.ndarray, salt: Scope, wanted: Callable[[ChunkSpan], bool]
) -> tuple[list[ChunkSpan], list[MemoryObj]]:
    """The spans of ``hold`` that ``wanted`` keeps, each with a new handle on its object (the
    hold stays its owner's); ``hold`` must be live and taken for ``arr``'s tokens and ``salt``."""
    if hold.released:
        raise KVTierError("retrieve got a hold that was already released")
    if hold.num_tokens > len(arr) or hold.digest != prefix_digest(arr[: hold.num_tokens], salt):
        raise ValueError("retrieve got a hold taken for other tokens or another salt")
    pairs = [(s, o.share()) for s, o in zip(hold.spans, hold.objs, strict=True) if wanted(s)]
    return [s for s, _ in pairs], [o for _, o in pairs]


def load_transfers(
    spans: Sequence[ChunkSpan],
    objs: Sequence[MemoryObj],
    slots: torch.Tensor,
    cpu_slots: torch.Tensor,
) -> tuple[list[Transfer], torch.Tensor]:
    """A ``Transfer`` of each object into its span's ``slots``, and the bool mask (one per
    token) of the tokens those transfers write (the span's slots that are not -1)."""
    mask = torch.zeros(len(cpu_slots), dtype=torch.bool)
    transfers = []
    for span, obj in zip(spans, objs, strict=True):
        span_slots = slots[span.start : span.end]
        if span.object_tokens > span.num_tokens:
            # A prefix of a stored chunk (an alias hit): the rest of its tokens are skipped.
            skip = span_slots.new_full((span.object_tokens - span.num_tokens,), -1)
            span_slots = torch.cat([span_slots, skip])
        transfers.append(Transfer(obj, span_slots))
        mask[span.start : span.end] = cpu_slots[span.start : span.end] >= 0
    return transfers, mask
