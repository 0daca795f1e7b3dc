"""Page-locking host memory for CUDA copies, range by range (``cudaHostRegister``).

The CUDA platform pins its host arena in the background, one segment after another
(``kvtier.core.memory.arena_growth``), so the arena is many registrations, not one. Two rules of the
driver shape this module:

- A page belongs to one registration: registering a range whose first or last page is already
  registered fails (``cudaErrorHostMemoryAlreadyRegistered``). The arena's buffer is not
  page-aligned, so two neighbouring segments share a page; ``HostRegistrations`` rounds each
  range out to whole pages and leaves out a page a neighbour already holds.
- One copy must not span two registrations, nor registered and pageable bytes (the driver
  answers ``CUDA_ERROR_INVALID_VALUE``; ``cudaMemcpyBatchAsync`` does for two registrations).
  ``HostRegistrations.cuts`` lists where registrations begin and end, and the lane splits a
  copy there (``kvtier.cuda.lane``): a piece then lies in one registration or in none.

Registration failures happen on the pinning thread, so the CUDA runtime's last error (kept per
thread) never surfaces in the serving threads' calls.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch

from kvtier.core.memory import HostArena

logger = logging.getLogger("kvtier")

PAGE = mmap.PAGESIZE
# cudaHostRegisterPortable: pinned for every device's copies.
_REGISTER_FLAGS = 1


def _page_down(address: int) -> int:
    return address // PAGE * PAGE


def _page_up(address: int) -> int:
    return -(-address // PAGE) * PAGE


class HostRegistrations:
    """The host ranges this process page-locked through kvtier, each rounded out to whole pages
    it does not share with another: ``register(address, nbytes) -> bool`` (False: refused, the
    range stays pageable), ``unregister(address)``. ``cuts`` is every registered range's first
    and end address, sorted (a tuple replaced whole, so readers need no lock)."""

    def __init__(
        self, register: Callable[[int, int], bool], unregister: Callable[[int], None]
    ) -> None:
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._ranges: dict[int, tuple[int, int]] = {}  # address asked -> pages registered
        self.cuts: tuple[int, ...] = ()

    def _held(self, page: int) -> bool:
        return any(lo <= page < hi for lo, hi in self._ranges.values())

    def register(self, address: int, nbytes: int) -> bool:
        if nbytes <= 0:
            raise ValueError(f"nothing to register: {nbytes} bytes")
        with self._lock:
            if address in self._ranges:
                raise ValueError(f"host range at {address:#x} is already registered")
            end = address + nbytes
            lo, hi = _page_down(address), _page_up(end)
            if lo < address and self._held(lo):
                lo += PAGE
            if hi > end and hi - PAGE >= lo and self._held(hi - PAGE):
                hi -= PAGE
            if lo < hi and not self._register(lo, hi - lo):
                return False
            self._ranges[address] = (lo, max(lo, hi))  # empty: its pages were held already
            self._set_cuts()
            return True

    def unregister(self, address: int) -> None:
        with self._lock:
            lo, hi = self._ranges.pop(address)
            self._set_cuts()
            if lo < hi:
                self._unregister(lo)

    def unregister_within(self, start: int, end: int) -> None:
        """Unregister every range asked for at an address in ``[start, end)``."""
        with self._lock:
            mine = [a for a in self._ranges if start <= a < end]
        for address in mine:
            self.unregister(address)

    def registered(self, start: int, end: int) -> list[tuple[int, int]]:
        """The registered page ranges that meet ``[start, end)``, sorted."""
        with self._lock:
            return sorted(
                (lo, hi) for lo, hi in self._ranges.values() if lo < hi and lo < end and hi > start
            )

    def _set_cuts(self) -> None:
        self.cuts = tuple(
            sorted({x for lo, hi in self._ranges.values() if lo < hi for x in (lo, hi)})
        )


def crosses(cuts: tuple[int, ...], start: int, end: int) -> bool:
    """Whether a cut lies strictly inside ``[start, end)``."""
    return bisect.bisect_right(cuts, start) != bisect.bisect_left(cuts, end)


def pieces(cuts: tuple[int, ...], start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` split at the cuts inside it: ``(offset from start, nbytes)`` pairs."""
    inner = cuts[bisect.bisect_right(cuts, start) : bisect.bisect_left(cuts, end)]
    bounds = [start, *inner, end]
    return [(a - start, b - a) for a, b in itertools.pairwise(bounds)]


def row_pieces(
    cuts: tuple[int, ...], start: int, pitch: int, width: int, rows: int
) -> list[tuple[int, int, int, int]]:
    """The rows of a strided copy (``rows`` rows of ``width`` bytes, ``pitch`` apart, from host
    ``start``) regrouped so that no piece crosses a cut: ``(first row, rows, byte offset in the
    row, width)``; a row that crosses a cut comes back in pieces of one row each."""
    out: list[tuple[int, int, int, int]] = []
    group, region = -1, -1
    for r in range(rows):
        a = start + r * pitch
        first, last = bisect.bisect_right(cuts, a), bisect.bisect_right(cuts, a + width - 1)
        if first != last:  # this row crosses a cut: one piece per side
            if group >= 0:
                out.append((group, r - group, 0, width))
                group = -1
            out += [(r, 1, off, n) for off, n in pieces(cuts, a, a + width)]
        elif group >= 0 and first == region:
            continue
        else:
            if group >= 0:
                out.append((group, r - group, 0, width))
            group, region = r, first
    if group >= 0:
        out.append((group, rows - group, 0, width))
    return out


def prefault(address: int, nbytes: int, threads: int) -> None:
    """Write zeros over ``nbytes`` at ``address`` from ``threads`` threads, so that the pages are
    there before they are registered (the driver would fault them in one by one, on one thread:
    most of what a registration costs). ``threads`` < 2: nothing (the registration faults)."""
    if threads < 2 or nbytes < threads * PAGE:
        return
    step = _page_up(-(-nbytes // threads))
    workers = [
        threading.Thread(
            target=ctypes.memset,  # a ctypes call: the GIL is released while it runs
            args=(address + at, 0, min(step, nbytes - at)),
            name="kvtier-arena-prefault",
            daemon=True,
        )
        for at in range(0, nbytes, step)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _cuda_register(address: int, nbytes: int) -> bool:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, nbytes, _REGISTER_FLAGS)
    if err != cudart.cudaError.success:
        logger.debug("kvtier: cudaHostRegister(%#x, %d) failed: %s", address, nbytes, err)
        return False
    return True


def _cuda_unregister(address: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostUnregister(address)
    if err != cudart.cudaError.success:
        logger.debug("kvtier: cudaHostUnregister(%#x) failed: %s", address, err)


#: The process's registrations (every CUDA platform and arena shares them: the driver does).
REGISTRATIONS = HostRegistrations(_cuda_register, _cuda_unregister)


def unregister_when_collected(arena: HostArena) -> None:
    """Unregister what is left of ``arena``'s buffer when the arena is collected without
    ``close()``, before its bytes are freed (freed bytes still registered would refuse the
    next registration there)."""
    buffer = arena.buffer
    start = buffer.data_ptr()
    fin = weakref.finalize(arena, _unregister_buffer, start, start + buffer.numel(), buffer)
    fin.atexit = False  # the process's memory goes with it


def _unregister_buffer(start: int, end: int, buffer: torch.Tensor) -> None:
    """(``buffer`` is passed only to outlive the registrations.)"""
    REGISTRATIONS.unregister_within(start, end)


def wait_grown(arena: HostArena, timeout: float) -> bool:
    """Wait until ``arena`` is usable to its full size (its background pinning is done); False
    if that did not happen within ``timeout`` seconds. For tests and benchmarks: serving never
    waits."""
    deadline = time.monotonic() + timeout
    while arena.capacity < arena.target_bytes:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def default_prefault_threads() -> int:
    """Half the CPUs this process may run on, at most 8 (start-up has other work too)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return min(8, cpus // 2)
