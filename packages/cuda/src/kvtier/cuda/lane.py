"""One direction of a connector (store or load): its streams, events, staging ring and tables,
and the executor its pipeline issues device work through.

On a GPU the executor is the CUDA driver (``kvtier.cuda._driver``): every copy, event record,
event wait and kernel launch names its stream, so torch's current stream is never switched
(a switch costs more host time than a small chunk's DMA). On a CPU device (the Triton
interpreter, in tests) ``HostExecutor`` runs the same calls in order, synchronously: the same
pipeline code runs on both.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvtier.cuda._driver import CudaDriver, CUDADriverError, RawEvent, driver
from kvtier.cuda.kernels import LAUNCHES, RUN_WORDS, RowGeometry, copy_runs
from kvtier.cuda.memory import StagingRing, TableBuffer, TableRing
from kvtier.cuda.plan import Piece

# Per thread: the devices whose CUDA context the thread has current (see Lane.bind_context).
_BOUND = threading.local()


def _torch_raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# The caller's current stream as a raw handle: torch's private accessor costs ~0.3 us where
# ``torch.cuda.current_stream()`` builds a Stream object (~3-9 us on a busy host); the public
# call is the fallback where the private one is missing.
_get_raw_stream: Callable[[int], int] = getattr(
    torch._C, "_cuda_getCurrentRawStream", _torch_raw_stream
)


def raw_current_stream(device: torch.device) -> int:
    """The raw handle of the current stream on ``device`` (a CUDA device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _get_raw_stream(index)


class OnDevice:
    """Makes device ``index`` current for a block and gives the caller its own back afterwards
    (``set_device`` only when they differ; a no-op on a CPU device, ``index`` None)."""

    __slots__ = ("index", "prev")

    def __init__(self, index: int | None) -> None:
        self.index = index
        self.prev = index

    def __enter__(self) -> None:
        if self.index is not None:
            self.prev = torch.cuda.current_device()
            if self.prev != self.index:
                torch.cuda.set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.prev != self.index:
            torch.cuda.set_device(self.prev)


class HostEvent:
    """An event on a CPU device: work has always run when it is recorded."""

    __slots__ = ()
    handle = 0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait_on(self, stream: int) -> None:
        pass


class DriverExecutor:
    """Device work through the CUDA driver, each call on an explicit stream."""

    def __init__(self, drv: CudaDriver) -> None:
        self.drv = drv
        self.record, self.wait = drv.record, drv.wait
        self.htod, self.dtoh = drv.memcpy_htod, drv.memcpy_dtoh

    def run_pieces(
        self,
        lane: Lane,
        table: TableBuffer,
        offset: int,
        piece: Piece,
        geo: RowGeometry,
        bases: torch.Tensor,
        *,
        to_paged: bool,
    ) -> None:
        """One kernel launch over ``piece``'s runs of the table (which starts ``offset`` int64s in)."""
        LAUNCHES.launch(
            table.dev,  # type: ignore[arg-type]
            table.dev_ptr,
            offset,
            piece.start,
            piece.stop,
            piece.max_rows,
            piece.max_tokens,
            geo,
            bases,
            to_paged=to_paged,
            stream=lane.kernel_stream,
            cache=lane.launch_cache,
        )

    def table_up(self, lane: Lane, table: TableBuffer, numel: int, *, by_kernel: bool) -> None:
        """The table's first ``numel`` int64s to the device, on the kernel stream: by a kernel
        reading the pinned buffer in place, or on the copy engine (see ``Pipeline``)."""
        if by_kernel:
            LAUNCHES.copy_words(
                table.host,  # type: ignore[arg-type]
                table.host_read_ptr,
                table.dev,  # type: ignore[arg-type]
                numel,
                stream=lane.kernel_stream,
            )
        else:
            self.drv.memcpy_htod(table.dev_ptr, table.host_ptr, 8 * numel, lane.ks_h)


class HostExecutor:
    """The same calls on a CPU device, run at once and in order (streams and events are moot)."""

    def record(self, event: int, stream: int) -> None:
        pass

    def wait(self, stream: int, event: int) -> None:
        pass

    def htod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    dtoh = htod

    def run_pieces(
        self,
        lane: Lane,
        table: TableBuffer,
        offset: int,
        piece: Piece,
        geo: RowGeometry,
        bases: torch.Tensor,
        *,
        to_paged: bool,
    ) -> None:
        assert table.dev is not None
        runs = table.dev[offset + piece.start * RUN_WORDS : offset + piece.stop * RUN_WORDS].view(
            -1, RUN_WORDS
        )
        copy_runs(runs, piece.max_rows, piece.max_tokens, geo, bases, to_paged=to_paged)

    def table_up(self, lane: Lane, table: TableBuffer, numel: int, *, by_kernel: bool) -> None:
        pass  # on a CPU device the kernels read the host buffer itself


class Lane:
    """One direction's streams, staging ring, table ring and slot events.

    Every slot has two events: ``filled`` (the producer side is done writing it) and ``free``
    (the consumer side is done reading it). Reusing a slot waits on ``free`` on the device, so
    calls interleaving on one lane stay correct; ``lock`` keeps the ring positions consistent
    while a call is planned and issued (a whole-chunk call holds it across its batches).
    """

    def __init__(self, device: torch.device, num_slots: int, slot_bytes: int) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.index: int | None = device.index if self.is_cuda else None
        self.lock = threading.RLock()
        # This lane's kernels, launched directly with their parameters bound (LAUNCHES.launch).
        self.launch_cache: dict[tuple, Any] = {}
        self.exe: DriverExecutor | HostExecutor
        if self.is_cuda:
            drv = driver()
            if drv is None:
                raise CUDADriverError(
                    "kvtier-cuda needs the CUDA driver library (libcuda.so.1), which did not load"
                )
            self.drv: CudaDriver | None = drv
            self.kernel_stream = torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)
            self.ks_h, self.cs_h = self.kernel_stream.cuda_stream, self.copy_stream.cuda_stream
            self.exe = DriverExecutor(drv)
            self.ring = StagingRing(
                device, num_slots, slot_bytes, (self.kernel_stream, self.copy_stream)
            )
            self.tables = TableRing(device, self.new_event, drv.host_device_pointer)
        else:
            self.drv = None
            self.ks_h = self.cs_h = 0
            self.exe = HostExecutor()
            self.ring = StagingRing(device, num_slots, slot_bytes, None)
            self.tables = TableRing(device, self.new_event)
        self.filled = [self.new_event() for _ in range(num_slots)]
        self.free = [self.new_event() for _ in range(num_slots)]
        self.after = self.new_event()  # ordering after the caller's stream, per call

    def new_event(self) -> Any:
        """A fresh event (a driver event on a GPU)."""
        return RawEvent(self.drv) if self.drv is not None else HostEvent()

    def take_table(self, numel: int) -> TableBuffer:
        """The next table buffer, holding at least ``numel`` int64s (see ``TableRing``)."""
        self.bind_context()
        with OnDevice(self.index):
            return self.tables.take(numel)

    def dma_in_flight(self) -> bool:
        """Whether a DMA this lane issued may still be running (event queries, never a wait)."""
        return not all(e.query() for e in self.filled)

    def busy(self) -> bool:
        """Whether work this lane issued may still be running (event queries, never a wait)."""
        return self.dma_in_flight() or not all(e.query() for e in self.free)

    def bind_context(self) -> None:
        """Make sure this thread has the device's CUDA context current before driver calls (a
        thread's first CUDA runtime call binds it; remembered per thread and device, so only a
        thread's first call pays for the device switch and the check)."""
        if self.drv is None:
            return
        bound = getattr(_BOUND, "devices", None)
        if bound is None:
            bound = _BOUND.devices = set()
        if self.device.index in bound:
            return
        with OnDevice(self.index):
            if not self.drv.has_context():
                torch.cuda.current_stream(self.device).query()
                if not self.drv.has_context():
                    raise CUDADriverError(
                        f"no CUDA context is current on this thread for {self.device}"
                    )
        bound.add(self.device.index)

    def synchronize(self) -> None:
        if self.is_cuda:
            self.kernel_stream.synchronize()
            self.copy_stream.synchronize()
