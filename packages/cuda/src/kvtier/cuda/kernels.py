"""Launching the paged-row copy kernel (triton is imported on the first launch, not before).

Every address a launch touches sits in a run table built by the connector (eight int64s a run
of rows, see ``kvtier.cuda._triton_kernels``) or in the connector's ``bases`` (the paged base
address of each row index), so the launch itself takes only those two and the geometry. All
sizes here are in *words*: the widest integer (8, 4, 2 or 1 bytes) that divides every row, block
and address of the call, so the kernel copies bytes and never interprets the KV dtype.

``LAUNCHES`` keeps each configuration's compiled kernel after its first launch and launches it
again directly (``kvtier.cuda.direct_launch``: ``cuLaunchKernel`` through ctypes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.cuda.direct_launch import DirectLaunch, direct_launch_for, param_types

__all__ = [
    "LAUNCHES",
    "RUN_WORDS",
    "WORDS_ALIGN",
    "RowGeometry",
    "copy_runs",
    "copy_words",
    "param_types",
    "word_bytes_for",
]

# Bytes one program moves: large enough to keep the memory system busy, small enough to stay in
# registers (an 8B-shaped row of 2 KiB gives 8 tokens a program).
_TILE_BYTES = 16 * 1024
_MAX_BLOCK_D = 256
# int64s per run in the table (see kvtier.cuda._triton_kernels).
RUN_WORDS = 8
# copy_words: int64s one program copies; counts are rounded up to WORDS_ALIGN so Triton's
# specialisation of the count (divisible by 16 or not) never changes between launches.
_COPY_BLOCK = 1024
WORDS_ALIGN = 16


@dataclass(frozen=True)
class RowGeometry:
    """How a row maps onto the paged cache, in words of ``word_bytes``."""

    word_bytes: int
    hd_words: int  # one token of one row (kv_heads * head_size elements)
    block_size: int  # tokens per paged block
    block_stride_words: int  # distance between consecutive blocks of one row's base
    token_stride_words: int  # distance between consecutive tokens of one block
    total_slots: int  # num_blocks * block_size: slots at or past this are refused


def word_bytes_for(*values: int) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every byte count and address given."""
    for w in (8, 4, 2, 1):
        if all(v % w == 0 for v in values):
            return w
    return 1


@functools.cache
def _triton():
    import triton

    from kvtier.cuda._triton_kernels import copy_words_kernel, paged_runs_kernel

    return triton, paged_runs_kernel, copy_words_kernel


@functools.cache
def _blocks(hd_words: int, word_bytes: int) -> tuple[int, int]:
    block_d = min(_MAX_BLOCK_D, 1 << max(0, (hd_words - 1).bit_length()))
    block_t = max(1, min(64, _TILE_BYTES // (block_d * word_bytes)))
    block_t = 1 << (block_t.bit_length() - 1)
    return block_t, block_d


class _Launches:
    """Launching a configuration again without ``JITFunction.run``.

    ``kernel[grid](...)`` costs ~15 us of Python per launch (binding and specialising every
    argument, a cache lookup, a pointer query per tensor) and launches on torch's current stream,
    which a side-stream caller must switch to and back (~10 us each). A connector launches one
    configuration over and over with only the table address and grid changing, so after the first,
    compiling launch of a configuration its compiled kernel is kept and later launches call its
    launcher directly, the way ``JITFunction.run`` does at its end, on an explicit stream.

    The key holds everything Triton specialises on here: the geometry and constexprs (fixed per
    connector) and whether the table and bases addresses are 16-byte aligned; the device, for
    its module.
    Used only where the installed Triton exposes that launcher (``triton.knobs``, Triton >= 3.3);
    otherwise, and under the interpreter, every launch goes through ``kernel[grid]``.
    """

    def __init__(self) -> None:
        self.compiled: dict[tuple, Any] = {}
        # Kept kernels launched with cuLaunchKernel (see DirectLaunch); others through Triton's
        # launcher.
        self.direct: dict[tuple, DirectLaunch] = {}
        self.knobs: Any = None
        self.usable: bool | None = None  # decided at the first launch on a GPU

    def _check(self) -> bool:
        try:
            import triton

            self.knobs = triton.knobs.runtime
            return hasattr(self.knobs, "launch_enter_hook") and hasattr(
                self.knobs, "launch_exit_hook"
            )
        except (ImportError, AttributeError):
            return False

    def launch(
        self,
        table: torch.Tensor,
        table_addr: int,
        offset: int,
        start: int,
        stop: int,
        max_rows: int,
        max_tokens: int,
        geo: RowGeometry,
        bases: torch.Tensor,
        *,
        to_paged: bool,
        stream: torch.cuda.Stream,
        cache: dict[tuple, tuple[RowGeometry, torch.Tensor, DirectLaunch, int]] | None = None,
    ) -> None:
        """Runs ``[start, stop)`` of the run table that starts ``offset`` int64s into the int64
        device buffer ``table`` (whose address is ``table_addr``: read once by the caller); at
        most ``max_rows`` rows and ``max_tokens`` tokens a run; on ``stream`` (need not be
        current).

        ``cache``: a dict the caller owns (a connector, whose ``geo`` and ``bases`` never
        change), holding a directly launched kernel per direction and table alignment with every
        parameter but the table's address already set: a launch is then one lookup, one value
        and one driver call (9.2 us of host time instead of 11.6 on one H200 host: the gain is the
        key building and lookups skipped, see ``DirectLaunch``)."""
        runs = stop - start
        if runs <= 0 or max_tokens == 0 or max_rows == 0:
            return
        ptr = table_addr + 8 * (offset + start * RUN_WORDS)
        if cache is not None:
            fast_key = (to_paged, ptr & 15 == 0, id(geo), id(bases))
            hit = cache.get(fast_key)
            if hit is not None and hit[0] is geo and hit[1] is bases:
                hit[2].launch_first(
                    (runs, max_rows, -(-max_tokens // hit[3])), stream.cuda_stream, ptr
                )
                return
        block_t, block_d = _blocks(geo.hd_words, geo.word_bytes)
        bases_ptr = bases.data_ptr()
        key = (
            bases.device.index,
            geo,
            to_paged,
            block_t,
            block_d,
            ptr % 16 == 0,
            bases_ptr % 16 == 0,
        )
        args = (
            ptr,
            bases_ptr,
            geo.total_slots,
            geo.block_size,
            geo.block_stride_words,
            geo.token_stride_words,
            geo.hd_words,
            geo.word_bytes,
            block_t,
            block_d,
            to_paged,
        )

        def first() -> Any:
            view = table[offset + start * RUN_WORDS : offset + stop * RUN_WORDS].view(-1, RUN_WORDS)
            return _launch(
                view, max_rows, max_tokens, geo, bases, to_paged=to_paged, blocks=(block_t, block_d)
            )

        self._dispatch(
            key, (runs, max_rows, -(-max_tokens // block_t)), args, 6, stream, bases.device, first
        )
        if cache is not None:
            direct = self.direct.get(key)
            if direct is not None:
                cache[(to_paged, ptr & 15 == 0, id(geo), id(bases))] = (
                    geo,
                    bases,
                    direct.bound(args[:6]),
                    block_t,
                )

    def copy_words(
        self,
        src: torch.Tensor,
        src_addr: int,
        dst: torch.Tensor,
        numel: int,
        *,
        stream: torch.cuda.Stream,
    ) -> None:
        """``dst[:numel] = src[:numel]`` (int64) by a kernel on ``stream``; ``src`` is pinned host
        memory the kernel reads in place at ``src_addr``. Both hold at least ``numel`` rounded up
        to ``WORDS_ALIGN``."""
        n = -(-numel // WORDS_ALIGN) * WORDS_ALIGN
        if n == 0:
            return
        dst_ptr = dst.data_ptr()
        key = ("copy_words", dst.device.index, src_addr % 16 == 0, dst_ptr % 16 == 0)
        grid = (-(-n // _COPY_BLOCK), 1, 1)
        args = (src_addr, dst_ptr, n, _COPY_BLOCK)
        self._dispatch(key, grid, args, 3, stream, dst.device, lambda: copy_words(src, dst, numel))

    def _dispatch(
        self,
        key: tuple,
        grid: tuple[int, int, int],
        args: tuple,
        runtime: int,
        stream: torch.cuda.Stream,
        device: torch.device,
        first: Callable[[], Any],
    ) -> None:
        """Launch the kept kernel for ``key`` on ``stream`` with ``args`` (every argument, the
        constexprs included, as ``JITFunction.run`` passes them; the first ``runtime`` are the
        non-constexpr ones, two addresses first); without one, ``first()`` launches through
        ``kernel[grid]`` with ``stream`` made current, and its compiled kernel is kept (and,
        where its parameter layout is certain, launched directly from then on: ``DirectLaunch``)."""
        direct = self.direct.get(key)
        if direct is not None:
            direct(grid, stream.cuda_stream, args[:runtime])
            return
        ck = self.compiled.get(key)
        if ck is not None:
            knobs = self.knobs
            handle = stream.cuda_stream
            ck.run(
                *grid,
                handle,
                ck.function,
                ck.packed_metadata,
                ck.launch_metadata(grid, handle, *args),
                knobs.launch_enter_hook,
                knobs.launch_exit_hook,
                *args,
            )
            return
        prev = torch.cuda.current_stream(device)
        torch.cuda.set_stream(stream)
        try:
            ck = first()
        finally:
            torch.cuda.set_stream(prev)
        if self.usable is None:
            self.usable = self._check()
        if (
            self.usable
            and ck is not None
            and all(
                hasattr(ck, a) for a in ("run", "function", "packed_metadata", "launch_metadata")
            )
        ):
            self.compiled[key] = ck
            direct = direct_launch_for(ck, args[:runtime], pointers=2)
            if direct is not None:
                self.direct[key] = direct


LAUNCHES = _Launches()


def _launch(
    table: torch.Tensor,
    max_rows: int,
    max_tokens: int,
    geo: RowGeometry,
    bases: torch.Tensor,
    *,
    to_paged: bool,
    blocks: tuple[int, int],
) -> Any:
    triton, kernel, _ = _triton()
    block_t, block_d = blocks
    grid = (table.shape[0], max_rows, triton.cdiv(max_tokens, block_t))
    return kernel[grid](
        table,
        bases,
        geo.total_slots,
        geo.block_size,
        geo.block_stride_words,
        geo.token_stride_words,
        HD=geo.hd_words,
        WORD_BYTES=geo.word_bytes,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        TO_PAGED=to_paged,
        num_warps=4,
    )


def copy_runs(
    table: torch.Tensor,
    max_rows: int,
    max_tokens: int,
    geo: RowGeometry,
    bases: torch.Tensor,
    *,
    to_paged: bool,
) -> None:
    """Copy every run of ``table`` (``[runs, RUN_WORDS]`` int64 on the cache's device; at most
    ``max_rows`` rows and ``max_tokens`` tokens a run) in one launch; ``bases``: int64 on the
    device, the paged base address of each row index.

    ``to_paged=False`` gathers paged -> flat (store), ``True`` scatters flat -> paged (load).
    Asynchronous on CUDA (runs on the current stream); synchronous under ``TRITON_INTERPRET=1``.
    """
    if table.shape[0] == 0 or max_tokens == 0 or max_rows == 0:
        return
    _launch(
        table,
        max_rows,
        max_tokens,
        geo,
        bases,
        to_paged=to_paged,
        blocks=_blocks(geo.hd_words, geo.word_bytes),
    )


def copy_words(src: torch.Tensor, dst: torch.Tensor, numel: int) -> Any:
    """``dst[:numel] = src[:numel]`` (int64) in one launch on the current stream (``src`` may be
    pinned host memory: the kernel reads it in place). Counts round up to ``WORDS_ALIGN``, so
    both must hold that many."""
    n = -(-numel // WORDS_ALIGN) * WORDS_ALIGN
    if n == 0:
        return None
    triton, _, kernel = _triton()
    return kernel[(triton.cdiv(n, _COPY_BLOCK),)](src, dst, n, BLOCK=_COPY_BLOCK, num_warps=4)
