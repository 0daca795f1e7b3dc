"""The Triton kernels of the page mover. Imported only by ``kvtier.cuda.kernels`` at the first
launch: importing ``kvtier.cuda`` never imports triton.

``page_copy_kernel`` moves whole pages between the paged cache and a staging buffer laid out as
the host objects (``[entries, LAYERS, page]``: ``entries`` staged blocks, ``LAYERS`` pages each,
all of a block's layers or one). A page is ``RUNS`` runs of ``RUN`` words (``kvtier.core.platform.pages``);
program ``(p, t)`` copies tile ``t`` of staged page ``p``. Page ``(entry, layer)`` of block
``ids[first_entry + entry]`` starts ``layer_offsets[layer] + block * BLOCK_STRIDE`` words from ``cache`` (a
layer's offset may point into another allocation: addresses are flat), and its run ``r`` is
``run_offsets[r]`` words further. Sizes are in *words*: the widest integer that divides every
size, stride and address (``kvtier.cuda.kernels.Geometry``), so the kernel copies bytes and never
reads the KV dtype; ``ALIGN`` words of alignment let Triton use 16-byte accesses.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["first_entry", "first_layer"])
def page_copy_kernel(
    cache,
    staging,
    ids,
    layer_offsets,
    run_offsets,
    first_entry,
    first_layer,
    LAYERS: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
    RUN: tl.constexpr,
    RUNS: tl.constexpr,
    TILE: tl.constexpr,
    TILES_PER_RUN: tl.constexpr,
    ALIGN: tl.constexpr,
    TO_CACHE: tl.constexpr,
):
    p = tl.program_id(0)
    t = tl.program_id(1)
    entry = p // LAYERS
    layer = first_layer + p % LAYERS
    block = tl.load(ids + first_entry + entry)
    run = t // TILES_PER_RUN
    within = (t % TILES_PER_RUN) * TILE
    if RUNS == 1:
        run_off = 0
    else:
        run_off = tl.load(run_offsets + run)
    src = tl.load(layer_offsets + layer) + block * BLOCK_STRIDE + run_off + within
    dst = p.to(tl.int64) * (RUN * RUNS) + run * RUN + within
    offs = tl.arange(0, TILE)
    c = cache + tl.multiple_of(src + offs, ALIGN)
    s = staging + tl.multiple_of(dst + offs, ALIGN)
    if RUN % TILE == 0:  # whole tiles: no mask, so nothing stops 16-byte accesses
        if TO_CACHE:
            tl.store(c, tl.load(s))
        else:
            tl.store(s, tl.load(c))
    else:
        mask = within + offs < RUN
        if TO_CACHE:
            tl.store(c, tl.load(s, mask=mask), mask=mask)
        else:
            tl.store(s, tl.load(c, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["start", "n"])
def copy_words_kernel(src, dst, start, n, BLOCK: tl.constexpr):
    """``dst[start:start + n] = src[start:start + n]`` (int64): a store's block ids from pinned
    host memory, read in place, to the device (``kvtier.cuda.lane`` says why not by DMA)."""
    i = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < start + n
    tl.store(dst + i, tl.load(src + i, mask=mask), mask=mask)
