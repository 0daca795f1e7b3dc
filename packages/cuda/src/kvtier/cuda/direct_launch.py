"""Launching a kept compiled Triton kernel with ``cuLaunchKernel`` through ctypes.

Used by ``kvtier.cuda.kernels``' launch cache once a configuration has compiled: where the
driver confirms the kernel's parameter layout, a launch sets the changing values in a parameter
array built once and makes one driver call, skipping Triton's Python launcher.
"""

from __future__ import annotations

import ctypes
from typing import Any


def param_types(
    sizes: list[int] | None, runtime: tuple[int, ...], pointers: int
) -> list[type] | None:
    """The ctypes type of each parameter of a compiled Triton kernel, for ``cuLaunchKernel``.

    ``sizes``: the parameters' byte sizes as the driver reports them; ``runtime``: the values of
    the kernel's non-constexpr arguments in order, the first ``pointers`` of them addresses.
    Triton passes those, then (by version) up to two scratch pointers. None where the sizes do
    not fit that layout, and wherever an integer argument is 1 (Triton may pass a 1 as a
    constant, dropping the parameter): the caller then launches through Triton.
    """
    if sizes is None:
        return None
    n = len(runtime)
    extra = len(sizes) - n
    if not 0 <= extra <= 2 or any(size != 8 for size in sizes[n:]):
        return None
    types: list[type] = []
    for i, (value, size) in enumerate(zip(runtime, sizes, strict=False)):
        if i < pointers:
            if size != 8:
                return None
            types.append(ctypes.c_uint64)
        elif value == 1:
            return None
        elif size == 4 and -(1 << 31) <= value < (1 << 31):
            types.append(ctypes.c_int32)
        elif size == 8:
            types.append(ctypes.c_int64)
        else:
            return None
    return types + [ctypes.c_uint64] * extra  # scratch pointers: null (the kernels use none)


class DirectLaunch:
    """A kept compiled kernel launched with ``cuLaunchKernel`` through ctypes: its parameter
    array is built once, and a launch sets the changing values and makes one driver call,
    skipping Triton's Python ``__call__``, argument parsing and launch metadata."""

    __slots__ = ("block_x", "drv", "function", "params", "shared", "values")

    def __init__(
        self, drv: Any, function: int, block_x: int, shared: int, types: list[type]
    ) -> None:
        self.drv, self.function, self.block_x, self.shared = drv, function, block_x, shared
        self.values = [t() for t in types]
        array = (ctypes.c_void_p * len(types))(*[ctypes.addressof(v) for v in self.values])
        self.params = (array, ctypes.addressof(array))  # the array stays alive with its address

    def __call__(self, grid: tuple[int, int, int], stream: int, runtime: tuple[int, ...]) -> None:
        values = self.values
        for i, value in enumerate(runtime):
            values[i].value = value
        self.drv.launch(self.function, grid, self.block_x, self.shared, stream, self.params[1])

    def bound(self, runtime: tuple[int, ...]) -> DirectLaunch:
        """A copy with its own parameter values set to ``runtime``, for ``launch_first`` (a
        connector's own launches, where only the first value changes)."""
        copy = DirectLaunch(
            self.drv, self.function, self.block_x, self.shared, [type(v) for v in self.values]
        )
        for i, value in enumerate(runtime):
            copy.values[i].value = value
        return copy

    def launch_first(self, grid: tuple[int, int, int], stream: int, first: int) -> None:
        """Launch with the first parameter set to ``first`` and the others as they are."""
        self.values[0].value = first
        self.drv.launch(self.function, grid, self.block_x, self.shared, stream, self.params[1])


def direct_launch_for(ck: Any, runtime: tuple[int, ...], pointers: int) -> DirectLaunch | None:
    """A ``DirectLaunch`` for compiled kernel ``ck``, or None (launch through Triton) where it cannot
    be sure of the parameter layout or the launch needs more than a plain ``cuLaunchKernel``."""
    from kvtier.cuda._driver import driver

    drv = driver()
    md = getattr(ck, "metadata", None)
    function = getattr(ck, "function", None)
    if drv is None or md is None or not isinstance(function, int) or not function:
        return None
    if (
        getattr(md, "num_ctas", 1) != 1
        or getattr(md, "launch_cooperative_grid", False)
        or getattr(md, "launch_pdl", False)
        or getattr(md, "global_scratch_size", 0)
        or getattr(md, "profile_scratch_size", 0)
    ):
        return None
    types = param_types(drv.param_sizes(function), runtime, pointers)
    if types is None:
        return None
    return DirectLaunch(drv, function, 32 * int(md.num_warps), int(md.shared), types)
