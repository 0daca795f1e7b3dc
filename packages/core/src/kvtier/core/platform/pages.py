"""Where a page sits in an engine's KV view: derived from the view's strides, never its shape.

vLLM hands a connector per-layer views ``[kernel_blocks, H, N, C]`` whose strides follow the
resolved layout; one scheduler (manager) block may be several kernel blocks
(``kernel_block_sizes``: the view's first dimension then counts kernel blocks). A page is every
byte of one manager block of one layer: ``blocks_per_page`` kernel blocks' ``[H, N, C]``.

``PageRuns`` describes a page as a grid of contiguous byte runs: ``dims`` ((size, byte stride)
pairs, outermost first) of runs of ``run_bytes``. A block-compact layout (``LBHNC``, ``BLNHC``,
...) has one run per page; a head-outer one (``LHBNC``, ``BHLNC``) one run per head slot. The
page's bytes in host memory are its runs in that order, so two caches with the same geometry
(the ``KVLayout`` fingerprint) give the same bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout


@dataclass(frozen=True)
class PageRuns:
    """One layer's pages in a byte view of its storage (see the module docstring)."""

    num_blocks: int  # manager blocks
    block_stride: int  # bytes from one manager block's page to the next
    offset: int  # byte offset of block 0's page in the storage (of the layer it was read from)
    dims: tuple[tuple[int, int], ...]  # (size, byte stride) of the run grid, outermost first
    run_bytes: int

    @property
    def page_bytes(self) -> int:
        n = self.run_bytes
        for size, _ in self.dims:
            n *= size
        return n

    @property
    def runs_per_page(self) -> int:
        return self.page_bytes // self.run_bytes

    def run_offsets(self) -> list[int]:
        """Byte offset of each run from its page's start, in page order."""
        offsets = [0]
        for size, stride in self.dims:
            offsets = [o + i * stride for o in offsets for i in range(size)]
        return offsets


def _merge(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sizes-and-strides sorted outermost first, size-1 dims dropped, adjacent dims merged
    where the outer one steps exactly over the inner one."""
    dims = sorted((d for d in dims if d[0] != 1), key=lambda d: -d[1])
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def page_runs(cache: torch.Tensor, num_blocks: int) -> PageRuns:
    """The pages of one layer's view ``cache`` (``[kernel_blocks, H, N, C]``) for ``num_blocks``
    manager blocks; a ``LayoutError`` naming what is wrong when the view has no such pages."""
    if cache.dim() < 2:
        raise LayoutError(f"a KV view of shape {tuple(cache.shape)} has no [blocks, ...] pages")
    if cache.stride(-1) != 1 and cache.shape[-1] != 1:
        raise LayoutError(
            f"a KV view with strides {cache.stride()} has no contiguous innermost dimension"
        )
    kernel_blocks = int(cache.shape[0])
    if num_blocks <= 0 or kernel_blocks % num_blocks:
        raise LayoutError(
            f"a KV view of {kernel_blocks} kernel blocks cannot be {num_blocks} manager blocks"
        )
    ratio = kernel_blocks // num_blocks
    item = cache.element_size()
    inner = [
        (int(s), int(st) * item)
        for s, st in zip(cache.shape[1:-1], cache.stride()[1:-1], strict=True)
    ]
    inner.append((int(cache.shape[-1]) * item, 1))
    kernel_stride = int(cache.stride(0)) * item
    dims = _merge([(ratio, kernel_stride), *inner])
    if not dims or dims[-1][1] != 1:
        raise LayoutError(f"a KV view with strides {cache.stride()} has no contiguous run")
    run_bytes = dims[-1][0]
    grid = tuple(dims[:-1])
    runs = PageRuns(
        num_blocks=num_blocks,
        block_stride=kernel_stride * ratio,
        offset=int(cache.storage_offset()) * item,
        dims=grid,
        run_bytes=run_bytes,
    )
    offsets = sorted(runs.run_offsets())
    if any(b - a < run_bytes for a, b in itertools.pairwise(offsets)):
        raise LayoutError(f"a KV view with strides {cache.stride()} has overlapping pages")
    return runs


def page_view(cache: torch.Tensor, runs: PageRuns) -> torch.Tensor:
    """The pages of ``cache`` as a uint8 tensor ``[num_blocks, *grid, run_bytes]`` over the same
    storage (a view: writing it writes the cache). ``runs`` may be another layer's with the same
    grid: the offset is ``cache``'s own."""
    raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
        cache.untyped_storage(), 0, (cache.untyped_storage().nbytes(),), (1,)
    )
    sizes = (runs.num_blocks, *(s for s, _ in runs.dims), runs.run_bytes)
    strides = (runs.block_stride, *(st for _, st in runs.dims), 1)
    return raw.as_strided(sizes, strides, int(cache.storage_offset()) * cache.element_size())


def manager_blocks(cache: torch.Tensor, layout: KVLayout) -> int:
    """How many manager blocks a logical ``[kernel_blocks, H, N, C]`` view holds: kernel blocks
    times the kernel block size (``N``), over the layout's block size."""
    if cache.dim() != 4:
        raise LayoutError(
            f"a KV view of shape {tuple(cache.shape)} is not vLLM's logical [B, H, N, C]"
        )
    tokens = int(cache.shape[0]) * int(cache.shape[2])
    if tokens % layout.block_size:
        raise LayoutError(
            f"a KV view of shape {tuple(cache.shape)} does not hold whole blocks of "
            f"{layout.block_size} tokens"
        )
    return tokens // layout.block_size


def check_pages(layout: KVLayout, caches: Sequence[torch.Tensor], num_blocks: int) -> PageRuns:
    """Every layer's view has pages of ``layout``'s size with one run grid; returns layer 0's."""
    if len(caches) != layout.num_layers:
        raise LayoutError(
            f"layout has {layout.num_layers} layers but {len(caches)} KV tensors were given"
        )
    first = page_runs(caches[0], num_blocks)
    for i, cache in enumerate(caches):
        if cache.dtype != caches[0].dtype or cache.device != caches[0].device:
            raise LayoutError(
                f"KV tensor of layer {i} is {cache.dtype} on {cache.device}, layer 0's "
                f"{caches[0].dtype} on {caches[0].device}: one dtype and device for every layer"
            )
        runs = page_runs(cache, num_blocks) if i else first
        if (runs.dims, runs.run_bytes, runs.block_stride) != (
            first.dims,
            first.run_bytes,
            first.block_stride,
        ):
            raise LayoutError(
                f"layer {i}'s pages are laid out otherwise than layer 0's: {runs} vs {first}"
            )
        if runs.page_bytes != layout.page_bytes:
            raise LayoutError(
                f"layer {i}'s KV view {tuple(cache.shape)} (strides {cache.stride()}) has "
                f"{runs.page_bytes}-byte pages; the layout says {layout.describe()}"
            )
    return first


def block_runs(caches: Sequence[torch.Tensor], runs: PageRuns) -> bool:
    """Whether one block's pages of every layer form one contiguous run, in layer order, with
    every page itself one run (a block-outer, block-compact layout such as ``BLHNC``): then a
    chunk's block moves as one copy of ``layers * page`` bytes."""
    if runs.dims:
        return False
    storage = caches[0].untyped_storage().data_ptr()
    item = caches[0].element_size()
    for i, cache in enumerate(caches):
        if cache.untyped_storage().data_ptr() != storage:
            return False
        if int(cache.storage_offset()) * item != runs.offset + i * runs.page_bytes:
            return False
    return runs.block_stride >= len(caches) * runs.page_bytes
