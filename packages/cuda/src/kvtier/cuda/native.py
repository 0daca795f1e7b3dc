"""The native issuer (``_issue.c``): a whole mover call, checked, planned and issued by one C call
made with the GIL released.

Why: a small model's call is bound by host time. Planning it in Python and issuing its driver
calls from Python cost a large share of its DMA time, and a store and a load called at once from
two threads issued one after the other, the first holding the GIL until its wait (measurements:
docs/cuda-performance.md, "Native issuer"). Python now only reads each transfer's host address,
block count and block ids' address (``CallArrays``); the C call reads the ids in place, checks
them, writes the kept ones to the lane's pinned id buffer, finds the runs of blocks back to back
in host memory, and issues the call in parts on the lane's two streams so that the kernel of
one part overlaps the DMAs of another: a call that fits one slot in two parts through it (the
part whose kernel nothing hides, a store's first gather or a load's last scatter, a sixteenth of
the rows), a larger one in groups through the slots in turn (2 MiB first, then four times
larger up to a slot), every part issued before the host waits once.

The library is compiled at first use with the C compiler Triton uses too (``$CC``, else ``cc``,
``gcc`` or ``clang``), once per source and compiler, into ``~/.cache/kvtier/cuda``
(``$XDG_CACHE_HOME``). Where it cannot be built, a warning says why and calls are issued from
Python. Kernels are the mover's kept Triton kernels (``kvtier.cuda.kernels``), so a mover's first
call in each direction, which compiles them, runs in Python.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from ctypes import POINTER, Structure, c_int, c_int64, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Any

import torch

from kvtier.core.config import default_cache_dir
from kvtier.core.layout import KVLayout
from kvtier.core.platform.mover import Transfer
from kvtier.cuda.plan import object_mismatch

logger = logging.getLogger("kvtier")

_SOURCE = Path(__file__).with_name("_issue.c")
# The driver entry points, in kvt_driver's order.
_ENTRY_POINTS = (
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuLaunchKernel",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuEventSynchronize",
    "cuStreamSynchronize",
)
# kvt_call's *failed: the driver call that failed.
_FAILED = {
    1: "cuEventRecord",
    2: "cuStreamWaitEvent",
    3: "cuLaunchKernel",
    4: "cuLaunchKernel",
    5: "cuMemcpyDtoHAsync",
    6: "cuMemcpyHtoDAsync",
    7: "cuEventSynchronize",
}


class DriverTable(Structure):
    """``kvt_driver``: the driver entry points the C code calls, in ``_ENTRY_POINTS``' order."""

    _fields_ = [
        (name, c_void_p)
        for name in ("record", "wait", "launch", "dtoh", "htod", "sync", "stream_sync")
    ]


class KernelStruct(Structure):
    """``kvt_kernel``: a kept kernel's function, parameter array, block size and shared memory."""

    _fields_ = [
        ("function", c_void_p),
        ("params", c_void_p),
        ("block_x", c_uint32),
        ("shared", c_uint32),
    ]


class LaneStruct(Structure):
    """``kvt_lane``: one mover direction's streams, events, kernels and buffers."""

    _fields_ = [
        ("drv", c_void_p),
        ("stream", c_void_p),
        ("kstream", c_void_p),
        ("after", c_void_p),
        ("ids", KernelStruct),
        ("pages", KernelStruct),
        ("grid_y", c_uint32),
        ("layers", c_uint32),
        ("words_block", c_uint32),
        ("slots", c_void_p),
        ("filled", c_void_p),
        ("free", c_void_p),
        ("nslots", c_int64),
        ("slot_rows", c_int64),
        ("first_rows", c_int64),
        ("ids_host", c_void_p),
        ("ids_dev", c_uint64),
        ("row", c_int64),
        ("num_blocks", c_int64),
        ("cuts", c_void_p),
        ("ncuts", c_int64),
    ]


def _compiler() -> str | None:
    return (
        os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    )


def build(source: Path = _SOURCE, out_dir: Path | None = None) -> Path:
    """The shared library of ``source``, compiled once per source and compiler into ``out_dir``
    (default ``<cache>/cuda``); raises ``OSError`` naming what failed."""
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found (set CC, or install cc, gcc or clang)")
    text = source.read_bytes()
    key = hashlib.sha256(text + cc.encode()).hexdigest()[:16]
    out = out_dir or Path(default_cache_dir()) / "cuda"
    lib = out / f"issue-{key}.so"
    if lib.exists():
        return lib
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        src, built = Path(tmp) / "issue.c", Path(tmp) / "issue.so"
        src.write_bytes(text)
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(src)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError as e:
            first = (e.stderr or b"").decode(errors="replace").strip().splitlines()[:3]
            raise OSError(f"{cc} failed: {' / '.join(first)}") from e
        except subprocess.TimeoutExpired as e:
            raise OSError(f"{cc} did not finish within 120 s") from e
        os.replace(built, lib)  # atomic: another process may be building the same
    return lib


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its functions' argument types declared (``CDLL``: every
    call releases the GIL)."""
    lib = ctypes.CDLL(str(path))
    p64 = POINTER(c_int64)
    lib.kvt_plan.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_int64]
    lib.kvt_plan.argtypes += [c_void_p, c_void_p, p64, c_void_p]
    lib.kvt_plan.restype = c_int64
    lib.kvt_call.argtypes = [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int64, c_void_p]
    lib.kvt_call.argtypes += [c_void_p, c_void_p, c_int, POINTER(c_int)]
    lib.kvt_call.restype = c_int64
    lib.kvt_lane_layout.argtypes = [c_void_p]
    lib.kvt_lane_layout.restype = None
    names = [field[0] for field in LaneStruct._fields_]
    got = Int64s(1 + len(names))
    lib.kvt_lane_layout(got.address)
    want = [ctypes.sizeof(LaneStruct), *(getattr(LaneStruct, f).offset for f in names)]
    if list(got.array[: len(want)]) != want:
        raise OSError(f"{path.name}: kvt_lane is laid out as {list(got.array)}, not {want}")
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The native issuer, built and loaded once per process; None (with a warning) where it
    cannot be built."""
    try:
        return load(build())
    except OSError as e:
        logger.warning(
            "kvtier-cuda: the native issuer could not be built (%s); calls that fit one staging "
            "slot are issued from Python, with more host time per call",
            e,
        )
        return None


@functools.cache
def _driver_table() -> DriverTable:
    """``kvt_driver`` filled from ``libcuda.so.1`` (already loaded by torch)."""
    cu = ctypes.CDLL("libcuda.so.1")
    return DriverTable(*[ctypes.cast(getattr(cu, n), c_void_p).value for n in _ENTRY_POINTS])


class Int64s:
    """A growable C array of int64 (its address stays valid until it grows)."""

    __slots__ = ("address", "array", "size")
    array: Any  # a ctypes c_int64 array (slice assignment takes a list of ints)

    def __init__(self, size: int) -> None:
        self.size = 0
        self.ensure(size)

    def ensure(self, size: int) -> None:
        if size > self.size:
            self.size = max(size, 2 * self.size, 16)
            self.array = (c_int64 * self.size)()
            self.address = ctypes.addressof(self.array)


class CallArrays:
    """The arrays one call hands the C code: per transfer its host object's address
    (``addrs``), block count (``counts``) and block ids' address (``ids``), and room for the
    plan's runs and an id range (``runs``, ``lohi``)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout, self.chunk = layout, (layout.num_layers, layout.page_bytes)
        self.addrs, self.counts, self.ids = Int64s(16), Int64s(16), Int64s(16)
        self.runs, self.lohi = Int64s(48), Int64s(2)
        self.meta: Any = None  # the latest object meta found to be the layout's chunk

    def read(self, transfers: Sequence[Transfer]) -> int:
        """Fill the per-transfer arrays from ``transfers`` and return their block count; a
        ``LayoutError`` for an object that is not the layout's chunk. Reads attributes and one
        torch call per transfer (the ids' address: ``Transfer`` holds them as contiguous int64
        on the host), as host time counts: a ``torch.cat`` of a call's ids cost 7-30 us."""
        count = len(transfers)
        for a in (self.addrs, self.counts, self.ids):
            a.ensure(count)
        objs = [t.obj for t in transfers]
        metas = [o.meta for o in objs]
        known = self.meta
        for meta in metas:
            if meta is not known:  # metas are frozen: one checked is good for every object
                shape = meta.shape
                if tuple(shape[1:]) != self.chunk or meta.dtype is not torch.uint8:
                    raise object_mismatch(meta, shape[0] if shape else 0, self.layout)
                known = meta
        self.meta = known
        counts = [m.shape[0] for m in metas]
        self.addrs.array[:count] = [o.address for o in objs]
        self.counts.array[:count] = counts
        self.ids.array[:count] = [t.blocks.data_ptr() for t in transfers]
        total = sum(counts)
        self.runs.ensure(3 * total)
        return total


class NativeLane:
    """One mover direction's state for the C issuer: the ``kvt_lane`` struct (streams, events,
    kept kernels, id buffers, registration cuts) and the arrays a call passes."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        lane: Any,
        ids_kernel: Any,
        pages_kernel: Any,
        *,
        grid_y: int,
        layers: int,
        words_block: int,
        first_rows: int,
        num_blocks: int,
        layout: KVLayout,
    ) -> None:
        self.lib, self.lane, self.layout = lib, lane, layout
        self.row = row = layout.num_layers * layout.page_bytes
        self.num_blocks = num_blocks
        self.driver = _driver_table()
        s = self.struct = LaneStruct()
        s.drv = ctypes.addressof(self.driver)
        s.stream, s.kstream, s.after = lane.cs, lane.ks, lane.after.handle
        k = len(lane.free)
        self.events = (
            (c_void_p * k)(*[e.handle for e in lane.filled]),
            (c_void_p * k)(*[e.handle for e in lane.free]),
        )
        s.filled, s.free = (ctypes.addressof(a) for a in self.events)
        s.nslots, s.first_rows = k, first_rows
        self.generation = -1
        self.slot_array: Any = None
        for field, kept in (("ids", ids_kernel), ("pages", pages_kernel)):
            if kept is not None:
                _, block_x, shared = kept.direct
                setattr(s, field, KernelStruct(kept.function, kept.params[1], block_x, shared))
        s.grid_y, s.layers, s.words_block = grid_y, layers, words_block
        s.row, s.num_blocks = row, num_blocks
        self.address = ctypes.addressof(s)
        self.arrays = CallArrays(layout)
        self.failed = c_int(0)
        self.ids_host: Any = None
        self.cuts: Any = None
        self.cuts_array: Any = None

    def call(
        self, transfers: Sequence[Transfer], caller: int, cuts: tuple[int, ...], *, store: bool
    ) -> bool:
        """Check, plan and issue ``transfers`` through the slots and wait for them; False
        (nothing done) where one block's row does not fit a slot (the Python path grows it)."""
        lane, row, arrays = self.lane, self.row, self.arrays
        if row > lane.slot_bytes:
            return False
        total = arrays.read(transfers)
        if not total:
            return True
        lane.ensure_ids(total)
        s = self.struct
        if lane.ids_host is not self.ids_host:
            self.ids_host = lane.ids_host
            s.ids_host, s.ids_dev = lane.ids_host.data_ptr(), lane.ids.data_ptr()
        if cuts is not self.cuts:
            self.cuts = cuts
            self.cuts_array = (c_uint64 * max(1, len(cuts)))(*cuts)
            s.cuts, s.ncuts = ctypes.addressof(self.cuts_array), len(cuts)
        if not lane.slots:
            lane.take_slot(row, lane.cs)  # allocates the slots
        if lane.generation != self.generation:  # holds no slot: a released one is freed
            self.generation = lane.generation
            self.slot_array = (c_uint64 * len(lane.slots))(*[t.data_ptr() for t in lane.slots])
            s.slots, s.slot_rows = ctypes.addressof(self.slot_array), lane.slot_bytes // row
        res = self.lib.kvt_call(
            self.address, caller, store, arrays.addrs.address, arrays.counts.address,
            len(transfers), arrays.ids.address, arrays.runs.address, arrays.lohi.address, 1,
            ctypes.byref(self.failed),
        )  # fmt: skip
        if res == -1:
            lo, hi = arrays.lohi.array[0], arrays.lohi.array[1]
            raise IndexError(f"block ids must be -1 or in [0, {self.num_blocks}), got [{lo}, {hi}]")
        if res:
            raise lane.drv._fail(_FAILED.get(self.failed.value, "a driver call"), int(res))
        return True
