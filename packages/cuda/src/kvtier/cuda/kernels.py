"""Where a mover's pages sit, in kernel words (``Geometry``), and the launches of its kernels
(``Kernels``). Triton is imported at the first launch, not before.

The kernels (``kvtier.cuda._triton_kernels``) address every page from one anchor pointer: the
lowest-addressed layer's storage. Each layer's block-0 page is a word offset from it (vLLM puts
every layer of a cache group in one buffer; tests may give each layer its own allocation, and
addresses are flat either way).

After a configuration's first launch its compiled kernel is kept and launched again through its
launcher on an explicit stream, the way ``JITFunction.run`` does at its end: ``kernel[grid]``
costs ~15 us of Python per launch and launches on torch's current stream, which a caller on a
side stream must switch to and back (~10 us each). Every argument that changes between launches
is a pointer to an allocation (16-byte aligned) or marked ``do_not_specialize``, so one compiled
kernel serves them all.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.core.pages import PageRuns, page_runs

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Bytes one program copies: enough loads in flight to keep memory busy, few enough registers.
_TILE_BYTES = 16 * 1024
_NUM_WARPS = 4
# copy_words: int64s one program copies.
_COPY_BLOCK = 1024
# Triton's interpreter patches triton.language while a launch runs: one launch at a time.
_INTERPRETER = threading.Lock()


def _pow2_dividing(values: Sequence[int], cap: int) -> int:
    """The largest power of two, at most ``cap``, that divides every value."""
    a = cap
    while a > 1 and any(v % a for v in values):
        a //= 2
    return a


@dataclass(frozen=True)
class Geometry:
    """A mover's pages in words of ``word`` bytes (see the module doc)."""

    word: int
    align: int  # words every tile start is a multiple of (ALIGN)
    block_stride: int
    run: int  # words per run
    runs: int  # runs per page
    tile: int  # words per program
    tiles_per_run: int
    anchor_layer: int  # the layer whose storage start is the anchor
    layer_offsets: tuple[int, ...]  # words from the anchor to each layer's block-0 page
    run_offsets: tuple[int, ...]  # words from a page's start to each run

    @property
    def page_words(self) -> int:
        return self.run * self.runs

    @property
    def dtype(self) -> torch.dtype:
        return _WORD_DTYPES[self.word]

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor], runs: PageRuns) -> Geometry:
        """The geometry of ``caches`` (checked by ``kvtier.core.pages.check_pages``: one run
        grid for every layer; ``runs`` is layer 0's)."""
        starts = [c.untyped_storage().data_ptr() for c in caches]
        pages = [
            s + page_runs(c, runs.num_blocks).offset for s, c in zip(starts, caches, strict=True)
        ]
        anchor_layer = min(range(len(caches)), key=lambda i: starts[i])
        anchor = starts[anchor_layer]
        run_offsets = runs.run_offsets()
        # 16 bytes at most: Triton's widest access.
        align = _pow2_dividing(
            [runs.run_bytes, runs.block_stride, anchor, *pages, *run_offsets], 16
        )
        word = min(align, 8)
        run = runs.run_bytes // word
        tile = min(1 << (run - 1).bit_length(), _TILE_BYTES // word)
        return cls(
            word=word,
            align=align // word,
            block_stride=runs.block_stride // word,
            run=run,
            runs=runs.runs_per_page,
            tile=tile,
            tiles_per_run=-(-run // tile),
            anchor_layer=anchor_layer,
            layer_offsets=tuple((p - anchor) // word for p in pages),
            run_offsets=tuple(o // word for o in run_offsets),
        )


@functools.cache
def _jit() -> tuple[Any, Any]:
    from kvtier.cuda._triton_kernels import copy_words_kernel, page_copy_kernel

    return page_copy_kernel, copy_words_kernel


class Kernels:
    """One mover's kernel launches: ``pages`` (gather or scatter) and ``copy_words``.

    ``stream``: a ``torch.cuda.Stream`` on a GPU; None on a CPU device, where Triton's
    interpreter runs each launch at once."""

    def __init__(self, caches: Sequence[torch.Tensor], geo: Geometry) -> None:
        self.geo = geo
        device = caches[0].device
        storage = caches[geo.anchor_layer].untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(
            storage, 0, (storage.nbytes(),), (1,)
        )
        usable = storage.nbytes() // geo.word * geo.word
        self._cache = raw[:usable].view(geo.dtype)
        self._layer_offsets = torch.tensor(geo.layer_offsets, dtype=torch.int64, device=device)
        self._run_offsets = torch.tensor(geo.run_offsets, dtype=torch.int64, device=device)
        self._kept: dict[tuple, Any] = {}

    def pages(
        self,
        staging: torch.Tensor,
        ids: torch.Tensor,
        first_entry: int,
        entries: int,
        layers: int,
        first_layer: int,
        *,
        to_cache: bool,
        stream: Any,
    ) -> None:
        """Gather (``to_cache=False``) or scatter ``entries`` staged blocks' pages: block
        ``ids[first_entry + j]``'s layers ``first_layer ..`` (``layers`` of them, all or one)
        from or into ``staging`` (``[entries, layers, page]`` bytes)."""
        if entries <= 0:
            return
        g = self.geo
        kernel, _ = _jit()
        grid = (entries * layers, g.runs * g.tiles_per_run, 1)
        args = (
            self._cache,
            staging.view(g.dtype),
            ids,
            self._layer_offsets,
            self._run_offsets,
            first_entry,
            first_layer,
            layers,
            g.block_stride,
            g.run,
            g.runs,
            g.tile,
            g.tiles_per_run,
            g.align,
            to_cache,
        )
        self._launch(kernel, ("pages", to_cache, layers), grid, args, (1, 2), stream)

    def copy_words(
        self, src: torch.Tensor, dst: torch.Tensor, start: int, n: int, *, stream: Any
    ) -> None:
        """``dst[start:start + n] = src[start:start + n]`` (int64) on ``stream``; ``src`` may be
        pinned host memory, read in place."""
        if n <= 0:
            return
        _, kernel = _jit()
        grid = (-(-n // _COPY_BLOCK), 1, 1)
        self._launch(kernel, ("words",), grid, (src, dst, start, n, _COPY_BLOCK), (0, 1), stream)

    def _launch(
        self,
        kernel: Any,
        key: tuple,
        grid: tuple[int, int, int],
        args: tuple,
        changing: tuple[int, ...],
        stream: Any,
    ) -> None:
        """Launch ``kernel`` with ``args`` (constexprs included, in signature order) on
        ``stream``; ``changing``: the positions of tensor arguments that may differ between
        launches (passed to a kept kernel as addresses)."""
        if stream is None:  # the interpreter, on a CPU device
            with _INTERPRETER:
                kernel[grid](*args, num_warps=_NUM_WARPS)
            return
        ptrs = [args[i].data_ptr() for i in changing]
        full = (*key, *(p % 16 == 0 for p in ptrs))
        ck = self._kept.get(full)
        if ck is not None:
            values = list(args)
            for i, p in zip(changing, ptrs, strict=True):
                values[i] = p
            handle = stream.cuda_stream
            knobs = _knobs()
            ck.run(
                *grid,
                handle,
                ck.function,
                ck.packed_metadata,
                ck.launch_metadata(grid, handle, *values),
                knobs.launch_enter_hook,
                knobs.launch_exit_hook,
                *values,
            )
            return
        with torch.cuda.stream(stream):
            ck = kernel[grid](*args, num_warps=_NUM_WARPS)
        if _knobs() is not None and all(
            hasattr(ck, a) for a in ("run", "function", "packed_metadata", "launch_metadata")
        ):
            self._kept[full] = ck


@functools.cache
def _knobs() -> Any:
    """Triton's runtime knobs (launch hooks), where this Triton has them (>= 3.3); without
    them every launch goes through ``kernel[grid]``."""
    try:
        import triton

        knobs = triton.knobs.runtime
    except (ImportError, AttributeError):
        return None
    ok = hasattr(knobs, "launch_enter_hook") and hasattr(knobs, "launch_exit_hook")
    return knobs if ok else None
