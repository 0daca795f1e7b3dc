"""Checking a slot mapping handed to ``CacheEngine``, and reading a span's cache blocks from it.

A one-group engine's slot mapping is one slot per token (``[n]``); a hybrid engine's
(``KVLayout.groups``) is one row per KV cache group (``[groups, n]``), since each group has its
own block table. A slot of ``-1`` means "no slot" (vLLM's null block of a window group, a token
the engine did not compute)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def checked_slots(
    slot_mapping: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
    n_tokens: int,
    num_slots: int | Sequence[int] | None,
    groups: int = 1,
) -> torch.Tensor:
    """``slot_mapping`` as a long tensor, checked: integers, one per token (``groups`` rows of
    them for a hybrid engine), each -1 or a slot below ``num_slots`` (when known; one per row
    where the groups' blocks differ in size) (``ValueError`` naming the bad entry otherwise)."""
    if isinstance(slot_mapping, torch.Tensor):  # on any device: kept there
        bad_dtype = (
            slot_mapping.is_floating_point()
            or slot_mapping.is_complex()
            or slot_mapping.dtype == torch.bool
        )
        dtype_name = str(slot_mapping.dtype)
        given: torch.Tensor | np.ndarray = slot_mapping
    else:  # a list, a numpy array, or rows of either: one array
        given = np.asarray(slot_mapping)
        bad_dtype = given.size > 0 and given.dtype.kind not in "iu"
        dtype_name = str(given.dtype)
    if bad_dtype:
        raise ValueError(f"slot_mapping must hold integers, got {dtype_name}")
    slots = torch.as_tensor(given, dtype=torch.long)
    want = (n_tokens,) if groups == 1 else (groups, n_tokens)
    if tuple(slots.shape) != want:
        per = "one entry per token" if groups == 1 else f"one row per KV cache group ({groups})"
        raise ValueError(
            f"slot_mapping must have {per} of one entry per token ({n_tokens}): shape {want}, "
            f"got shape {tuple(slots.shape)}"
        )
    if not slots.numel():
        return slots
    limits = [num_slots] if num_slots is None or isinstance(num_slots, int) else list(num_slots)
    rows = [slots] if len(limits) == 1 else list(slots)
    for row, limit in zip(rows, limits, strict=True):
        lo, hi = (int(v) for v in torch.aminmax(row))
        if lo < -1:
            raise ValueError(f"slot_mapping entry {lo} is invalid: a slot is -1 (none) or >= 0")
        if limit is not None and hi >= limit:
            raise ValueError(
                f"slot_mapping entry {hi} is out of range: the registered KV cache "
                f"has {limit} slots"
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


def span_rows(
    slots: torch.Tensor, start: int, end: int, block_sizes: int | Sequence[int]
) -> torch.Tensor:
    """The cache block of each row of the chunk object of tokens ``[start, end)``
    (``span_blocks``). ``block_sizes``: each slot row's block size (one int for a one-group
    engine's ``[n]`` slots). For a hybrid engine's ``[groups, n]`` slots, each kvtier block
    (the groups' least common block size) holds every group's blocks in turn: with one block
    size, row ``i * groups + g`` is group ``g``'s ``i``-th block (``KVLayout.chunk_shape``)."""
    sizes = [block_sizes] if isinstance(block_sizes, int) else list(block_sizes)
    if slots.dim() == 1:
        return span_blocks(slots[start:end], sizes[0])
    if len(sizes) != slots.shape[0]:
        raise ValueError(f"{slots.shape[0]} slot rows need one block size each, got {sizes}")
    unit = math.lcm(*sizes)
    if (end - start) % unit:
        raise ValueError(f"a span of {end - start} tokens is not whole blocks of {unit}")
    units = (end - start) // unit
    per_group = [
        span_blocks(row[start:end], bs).view(units, unit // bs)
        for row, bs in zip(slots, sizes, strict=True)
    ]
    return torch.cat(per_group, dim=1).reshape(-1)


def written(slots: torch.Tensor) -> torch.Tensor:
    """Per token, whether any group has a slot for it (bool, ``[n]``)."""
    valid = slots >= 0
    return valid if valid.dim() == 1 else valid.any(dim=0)


def complete(slots: torch.Tensor) -> torch.Tensor:
    """Per token, whether every group has a slot for it (bool, ``[n]``)."""
    valid = slots >= 0
    return valid if valid.dim() == 1 else valid.all(dim=0)
