"""The Triton kernel that moves token rows between a paged KV cache and flat row buffers.

Imported only by ``kvtier.cuda.kernels`` when a copy is first launched: importing ``kvtier.cuda``
never imports triton.

A *row* is one ``(k|v, layer)`` slice of one chunk (MLA: one layer): ``n`` tokens of ``HD`` words
each, contiguous in the flat buffer (a staging slot on the device, or the pinned host object
itself). The host describes a launch as *runs* of rows, eight int64s each in ``table``:

====  ==========================================================================================
0     first row index ``r0`` (into ``bases``: the paged base address of each ``(k|v, layer)``)
1     row step (1: a whole chunk's rows in order; ``num_layers``: a layer's K row then V row)
2     rows in the run
3     flat address of the run's first row, in bytes
4     bytes from one row of the run to the next in the flat buffer
5     address of the run's int64 slot list (one slot per token; ``-1`` skips the token)
6     tokens per row ``n``
7     unused (zero)
====  ==========================================================================================

so one run is usually a whole chunk and the host never expands rows. One program copies
``BLOCK_T`` tokens of row ``program_id(1)`` of run ``program_id(0)`` (programs past a run's last
row do nothing). A token of row ``r`` sits ``(slot // block_size) * block_stride +
(slot % block_size) * token_stride`` words from ``bases[r]``. Addresses are raw ``data_ptr()``
values cast to pointers of ``WORD_BYTES``-wide integers, so the kernel moves bytes whatever the
KV dtype (fp8 included) and one compiled kernel serves every layer and chunk of a call.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_runs_kernel(
    table,
    bases,
    total_slots,
    block_size,
    block_stride,
    token_stride,
    HD: tl.constexpr,
    WORD_BYTES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TO_PAGED: tl.constexpr,
):
    run = tl.program_id(0)
    j = tl.program_id(1)
    tok_block = tl.program_id(2)
    entry = table + run * 8
    rows = tl.load(entry + 2)
    if j < rows:
        row = tl.load(entry) + j * tl.load(entry + 1)
        paged_addr = tl.load(bases + row)
        flat_addr = tl.load(entry + 3) + j * tl.load(entry + 4)
        # A literal element type per branch (constexpr dtypes as arguments vary across Triton versions).
        if WORD_BYTES == 8:
            paged = paged_addr.to(tl.pointer_type(tl.int64))
            flat = flat_addr.to(tl.pointer_type(tl.int64))
        elif WORD_BYTES == 4:
            paged = paged_addr.to(tl.pointer_type(tl.int32))
            flat = flat_addr.to(tl.pointer_type(tl.int32))
        elif WORD_BYTES == 2:
            paged = paged_addr.to(tl.pointer_type(tl.int16))
            flat = flat_addr.to(tl.pointer_type(tl.int16))
        else:
            paged = paged_addr.to(tl.pointer_type(tl.int8))
            flat = flat_addr.to(tl.pointer_type(tl.int8))
        slot_list = tl.load(entry + 5).to(tl.pointer_type(tl.int64))
        n = tl.load(entry + 6)

        t = tok_block * BLOCK_T + tl.arange(0, BLOCK_T)
        in_row = t < n
        slots = tl.load(slot_list + t, mask=in_row, other=-1)
        # -1 means "skip this token"; an out-of-range slot is refused on the host, and masked here
        # too so that a bug can never write outside the cache.
        valid = in_row & (slots >= 0) & (slots < total_slots)
        paged_off = (slots // block_size) * block_stride + (slots % block_size) * token_stride
        flat_off = t.to(tl.int64) * HD
        for d0 in tl.static_range(0, HD, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = valid[:, None] & (d < HD)[None, :]
            p_ptr = paged + paged_off[:, None] + d[None, :]
            f_ptr = flat + flat_off[:, None] + d[None, :]
            if TO_PAGED:
                tl.store(p_ptr, tl.load(f_ptr, mask=mask), mask=mask)
            else:
                tl.store(f_ptr, tl.load(p_ptr, mask=mask), mask=mask)


@triton.jit
def copy_words_kernel(src, dst, n, BLOCK: tl.constexpr):
    """``dst[:n] = src[:n]`` (int64): a store lane's table from pinned host memory, read in place,
    to the device. A kernel, not a copy-engine copy: see kvtier.cuda.connector._TableSlot."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(dst + i, tl.load(src + i, mask=mask), mask=mask)
