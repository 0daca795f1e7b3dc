"""Checking a slot mapping handed to ``CacheEngine``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def checked_slots(
    slot_mapping: torch.Tensor | Sequence[int], n_tokens: int, num_slots: int | None
) -> torch.Tensor:
    """``slot_mapping`` as a long tensor, checked: integers, one per token, each -1 or a slot
    below ``num_slots`` (when known) (``ValueError`` naming the bad entry otherwise)."""
    if isinstance(slot_mapping, torch.Tensor):
        bad_dtype = (
            slot_mapping.is_floating_point()
            or slot_mapping.is_complex()
            or slot_mapping.dtype == torch.bool
        )
        dtype_name = str(slot_mapping.dtype)
    else:
        kind = np.asarray(slot_mapping).dtype
        bad_dtype, dtype_name = len(slot_mapping) > 0 and kind.kind not in "iu", str(kind)
    if bad_dtype:
        raise ValueError(f"slot_mapping must hold integers, got {dtype_name}")
    slots = torch.as_tensor(slot_mapping, dtype=torch.long)
    if slots.dim() != 1 or slots.numel() != n_tokens:
        raise ValueError(
            f"slot_mapping must have one entry per token ({n_tokens}), got shape {tuple(slots.shape)}"
        )
    if slots.numel():
        lo, hi = (int(v) for v in torch.aminmax(slots))
        if lo < -1:
            raise ValueError(f"slot_mapping entry {lo} is invalid: a slot is -1 (none) or >= 0")
        if num_slots is not None and hi >= num_slots:
            raise ValueError(
                f"slot_mapping entry {hi} is out of range: the registered KV cache "
                f"has {num_slots} slots"
            )
    return slots


def span_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache block of each whole block of a span's ``slots`` (a multiple of ``block_size``
    long), ``-1`` for a block whose slots are all -1. kvtier moves whole pages, so each block's
    slots must be all -1 or ``b * block_size + [0, block_size)`` for one cache block ``b``; a
    ``ValueError`` naming the first token that is not."""
    n = int(slots.numel())
    if n % block_size:
        raise ValueError(f"a span of {n} slots is not whole blocks of {block_size}")
    s = slots.to(device="cpu", dtype=torch.long).view(-1, block_size)
    first = s[:, 0]
    expected = torch.where(
        (first >= 0).unsqueeze(1),
        first.unsqueeze(1) + torch.arange(block_size),
        torch.full_like(s, -1),
    )
    bad = (s != expected) | ((first >= 0) & (first % block_size != 0)).unsqueeze(1)
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        token = row * block_size + col
        raise ValueError(
            f"slot_mapping does not map whole blocks at token {token} of the span (slot "
            f"{int(s[row, col])}): kvtier moves whole pages, so each block's {block_size} tokens "
            f"must all be -1 or fill one cache block in order"
        )
    return torch.where(first >= 0, torch.div(first, block_size, rounding_mode="floor"), first)
