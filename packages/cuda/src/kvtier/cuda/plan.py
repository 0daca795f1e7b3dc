"""Planning a CUDA mover call: its transfers checked against the layout, their block ids
written to the lane's host id buffer, and where each block's row lies in host memory."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObjMeta
from kvtier.core.platform.mover import Transfer
from kvtier.cuda.lane import Lane


@dataclass
class Plan:
    """Some transfers' blocks to move, skipped blocks left out: ``count`` block ids at ``at`` in
    the lane's id buffers; ``cuts``, the indices where a block's row does not follow the
    previous one's in host memory (a copy ends there); and where each block's row is: the
    transfers' first indices and row-0 addresses (``starts``, ``ptrs``), or with skipped blocks
    every row's address (``addrs``)."""

    at: int
    count: int
    cuts: list[int]
    starts: list[int]
    ptrs: list[int]
    addrs: np.ndarray | None = None

    def host(self, i: int, row: int) -> int:
        """The host address of block ``i``'s row."""
        if self.addrs is not None:
            return int(self.addrs[i])
        t = bisect.bisect_right(self.starts, i) - 1
        return self.ptrs[t] + (i - self.starts[t]) * row


def object_mismatch(meta: MemoryObjMeta, n: int, layout: KVLayout) -> LayoutError:
    """The error for a memory object whose shape or dtype is not ``n`` blocks of the layout's
    chunk."""
    chunk = (n, layout.num_layers, layout.page_bytes)
    return LayoutError(
        f"a memory object {meta.shape} {meta.dtype} does not match the layout's "
        f"chunk {chunk} {layout.chunk_dtype} ({layout.describe()})"
    )


def plan_transfers(
    lane: Lane,
    transfers: Sequence[Transfer],
    at: int,
    layout: KVLayout,
    num_blocks: int,
) -> Plan:
    """Check ``transfers`` (the contract's errors) and write their kept block ids at ``at``
    of the lane's host id buffer. Tiny torch and numpy calls cost microseconds each (several
    on a busy GPU host): this runs before a call's first DMA, so it makes few."""
    row = layout.num_layers * layout.page_bytes
    chunk = (layout.num_layers, layout.page_bytes)
    starts, ptrs, ids, cuts = [], [], [], []
    end, total = -1, 0
    for t in transfers:
        obj, blocks = t.obj, t.blocks
        n = blocks.shape[0]
        meta = obj.meta  # the object's tensor is this shape and dtype
        if meta.shape != (n, *chunk) or meta.dtype != torch.uint8:
            raise object_mismatch(meta, n, layout)
        ptr = obj.address
        if ptr != end and total:
            cuts.append(total)
        starts.append(total)
        ptrs.append(ptr)
        end, total = ptr + n * row, total + n
        ids.append(blocks)
    if not total:
        return Plan(at, 0, [], starts, ptrs)
    # The transfers' ids (each a contiguous int64 host tensor: ``Transfer``) joined by one
    # torch.cat and read as one array: cheaper on the host than a numpy() per transfer.
    block_ids = (ids[0] if len(ids) == 1 else torch.cat(ids)).numpy()
    if total <= 64:  # Python's min and max beat numpy's below this
        listed = block_ids.tolist()
        lo, hi = min(listed), max(listed)
    else:
        lo, hi = int(block_ids.min()), int(block_ids.max())
    if lo < -1 or hi >= num_blocks:
        raise IndexError(f"block ids must be -1 or in [0, {num_blocks}), got [{lo}, {hi}]")
    lane.ensure_ids(at + total)
    if lo >= 0:
        lane.ids_np[at : at + total] = block_ids
        return Plan(at, total, cuts, starts, ptrs)
    sizes = np.diff(np.asarray([*starts, total], dtype=np.int64))
    addrs = np.repeat(np.asarray(ptrs, dtype=np.int64) - np.asarray(starts) * row, sizes)
    addrs += np.arange(total, dtype=np.int64) * row
    keep = block_ids >= 0
    block_ids, addrs = block_ids[keep], addrs[keep]
    k = int(block_ids.size)
    lane.ids_np[at : at + k] = block_ids
    gaps = (np.flatnonzero(np.diff(addrs) != row) + 1).tolist()
    return Plan(at, k, gaps, starts, ptrs, addrs)
