"""Where a mover's pages sit, in kernel words (``Geometry``), and the launches of its kernels
(``Kernels``). Triton is imported at the first launch, not before.

The kernels (``kvtier.cuda._triton_kernels``) address every page from one anchor pointer: the
lowest-addressed layer's storage. Each layer's block-0 page is a word offset from it (vLLM puts
every layer of a cache group in one buffer; tests may give each layer its own allocation, and
addresses are flat either way).

After a configuration's first launch (``kernel[grid]``, which compiles) its compiled kernel is
kept and launched again on an explicit stream with ``cuLaunchKernel`` through ctypes, its
parameter array built once, where the driver confirms the parameter layout (CUDA 12.4+); else
through Triton's launcher, the way ``JITFunction.run`` does at its end. ``kernel[grid]`` costs
~15-20 us of Python a launch on a GPU host and launches on torch's current stream, which a caller
on a side stream must switch to and back; a small model's 2 MiB chunk crosses PCIe in ~40 us.
Every argument that changes between launches is a pointer to an allocation (16-byte aligned) or
marked ``do_not_specialize``, so one compiled kernel serves them all.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.core.platform.pages import PageRuns, page_runs

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Bytes one program copies: enough loads in flight to keep memory busy, few enough registers.
_TILE_BYTES = 16 * 1024
_NUM_WARPS = 4
# copy_words: int64s one program copies.
COPY_BLOCK = 1024
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
    def dtype(self) -> torch.dtype:
        return _WORD_DTYPES[self.word]

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor], runs: PageRuns) -> Geometry:
        """The geometry of ``caches`` (checked by ``kvtier.core.platform.pages.check_pages``: one run
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


class _Kept:
    """A compiled kernel kept after its first launch, launched on an explicit stream with its
    non-constexpr values (addresses for pointers) followed by its constexprs."""

    __slots__ = ("ck", "consts", "direct", "function", "params", "values")

    def __init__(self, ck: Any, runtime: Sequence[int], pointers: int, consts: tuple) -> None:
        self.ck, self.consts = ck, consts
        self.direct: tuple[Any, int, int] | None = None
        self.values: list[Any] = []
        self.params: tuple[Any, int] = (None, 0)
        self.function = 0
        from kvtier.cuda._driver import driver

        drv = driver()
        md = getattr(ck, "metadata", None)
        function = getattr(ck, "function", None)
        if drv is None or md is None or not isinstance(function, int) or not function:
            return
        if (
            getattr(md, "num_ctas", 1) != 1
            or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False)
            or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0)
        ):
            return
        sizes = drv.param_sizes(function)
        n = len(runtime)
        want = [8] * pointers + [4] * (n - pointers)  # the ints are do_not_specialize i32s
        # Triton appends up to two scratch pointers (null here: the kernels use none).
        if sizes is None or sizes[:n] != want or not set(sizes[n:]) <= {8} or len(sizes) > n + 2:
            return
        types = [ctypes.c_uint64] * pointers + [ctypes.c_int32] * (n - pointers)
        self.values = [t() for t in types] + [ctypes.c_uint64() for _ in sizes[n:]]
        array = (ctypes.c_void_p * len(self.values))(*[ctypes.addressof(v) for v in self.values])
        self.params = (array, ctypes.addressof(array))  # the array stays alive with its address
        self.function = function
        self.direct = (drv, 32 * int(md.num_warps), int(md.shared))

    def __call__(self, grid: tuple[int, int, int], stream: int, runtime: Sequence[int]) -> None:
        if self.direct is not None:
            drv, block_x, shared = self.direct
            values = self.values
            for i, v in enumerate(runtime):
                values[i].value = v
            drv.launch(self.function, grid, block_x, shared, stream, self.params[1])
            return
        ck = self.ck
        args = (*runtime, *self.consts)
        knobs = _knobs()
        ck.run(
            *grid,
            stream,
            ck.function,
            ck.packed_metadata,
            ck.launch_metadata(grid, stream, *args),
            knobs.launch_enter_hook,
            knobs.launch_exit_hook,
            *args,
        )


class Kernels:
    """One mover's kernel launches: ``pages`` (a gather or a scatter) and ``copy_words``.

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
        self._fixed = (
            self._cache.data_ptr(),
            self._layer_offsets.data_ptr(),
            self._run_offsets.data_ptr(),
        )
        self._kept: dict[tuple, _Kept] = {}

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
        grid = (entries * layers, g.runs * g.tiles_per_run, 1)
        consts = (layers, g.block_stride, g.run, g.runs, g.tile, g.tiles_per_run, g.align, to_cache)
        args = (
            self._cache,
            staging.view(g.dtype),
            ids,
            self._layer_offsets,
            self._run_offsets,
            first_entry,
            first_layer,
        )
        if stream is None:
            self._first(_jit()[0], grid, (*args, *consts), stream)
            return
        s, i = staging.data_ptr(), ids.data_ptr()
        key = ("pages", to_cache, layers, s % 16 == 0, i % 16 == 0)
        c, lo, ro = self._fixed
        runtime = (c, s, i, lo, ro, first_entry, first_layer)
        self._run(key, _jit()[0], grid, args, runtime, 5, consts, stream)

    def copy_words(
        self, src: torch.Tensor, dst: torch.Tensor, start: int, n: int, *, stream: Any
    ) -> None:
        """``dst[start:start + n] = src[start:start + n]`` (int64) on ``stream``; ``src`` may be
        pinned host memory, read in place."""
        if n <= 0:
            return
        grid = (-(-n // COPY_BLOCK), 1, 1)
        consts = (COPY_BLOCK,)
        if stream is None:
            self._first(_jit()[1], grid, (src, dst, start, n, *consts), stream)
            return
        s, d = src.data_ptr(), dst.data_ptr()
        key = ("words", s % 16 == 0, d % 16 == 0)
        self._run(key, _jit()[1], grid, (src, dst, start, n), (s, d, start, n), 2, consts, stream)

    def kept_direct(self, kind: str, *, to_cache: bool = False, layers: int = 0) -> _Kept | None:
        """The kept ``pages`` (``to_cache``, ``layers``) or ``words`` kernel for 16-byte aligned
        buffers, where it is launched with ``cuLaunchKernel``, its parameters that no call
        changes set (the others are written by ``kvtier.cuda.native`` at each call); None before
        its first launch or where it is not launched that way."""
        key = ("pages", to_cache, layers, True, True) if kind == "pages" else ("words", True, True)
        kept = self._kept.get(key)
        if kept is None or kept.direct is None:
            return None
        if kind == "pages":  # the parameters no call changes: cache, layer and run offsets
            c, lo, ro = self._fixed
            for i, v in ((0, c), (3, lo), (4, ro)):
                kept.values[i].value = v
        return kept

    def _run(
        self,
        key: tuple,
        kernel: Any,
        grid: tuple[int, int, int],
        args: tuple,
        runtime: tuple[int, ...],
        pointers: int,
        consts: tuple,
        stream: Any,
    ) -> None:
        """Launch on a GPU ``stream``: the kept kernel for ``key`` with ``runtime`` (``args``'
        values, addresses for tensors), else a first launch whose kernel is kept."""
        kept = self._kept.get(key)
        if kept is not None:
            kept(grid, stream.cuda_stream, runtime)
            return
        ck = self._first(kernel, grid, (*args, *consts), stream)
        if ck is not None:
            self._kept[key] = _Kept(ck, runtime, pointers, consts)

    @staticmethod
    def _first(kernel: Any, grid: tuple[int, int, int], args: tuple, stream: Any) -> Any:
        """Launch through ``kernel[grid]`` (the interpreter on a CPU device, ``stream`` None);
        on a GPU return the compiled kernel to keep, where this Triton lets it be launched
        again (else None: every launch comes here)."""
        if stream is None:
            with _INTERPRETER:
                kernel[grid](*args, num_warps=_NUM_WARPS)
            return None
        with torch.cuda.stream(stream):
            ck = kernel[grid](*args, num_warps=_NUM_WARPS)
        usable = _knobs() is not None and all(
            hasattr(ck, a) for a in ("run", "function", "packed_metadata", "launch_metadata")
        )
        return ck if usable else None


@functools.cache
def _knobs() -> Any:
    """Triton's runtime knobs (launch hooks), where this Triton has them (>= 3.3)."""
    try:
        import triton

        knobs = triton.knobs.runtime
    except (ImportError, AttributeError):
        return None
    ok = hasattr(knobs, "launch_enter_hook") and hasattr(knobs, "launch_exit_hook")
    return knobs if ok else None
