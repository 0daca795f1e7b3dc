"""One direction of a page mover (store or load): its two streams, staging slots, events and
block-id buffer, and the device calls its groups issue.

On a GPU every copy, event record and wait goes through the CUDA driver on an explicit stream
(``kvtier.cuda._driver``), so torch's current stream is never switched. On a CPU device (Triton's
interpreter, in tests) the same calls run at once, in order: the mover's code is the same on both.

A call's block ids go to the device before its kernels read them: a load's by DMA on its own copy
stream, ahead of its own DMAs; a store's by a small kernel reading the pinned buffer in place
(``Kernels.copy_words``), because a host-to-device copy queues behind every host-to-device copy
already on the copy engine, whatever its stream (a 64 KiB copy issued after a 32 MiB one ended
~600 us later), so a store's ids copied that way would wait for a concurrent load's DMAs. (The
kernels reading the pinned ids in place were slower: a 16 MiB gather 90 us instead of 28, H100.)

A copy whose host range crosses where one host registration ends and another (or pageable memory)
begins is split there (``kvtier.cuda.memory``: the arena is pinned segment by segment, and the
driver takes no copy that spans two registrations); the check is one bisect of a short tuple.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvtier.cuda._driver import CUDADriverError, RawEvent, driver
from kvtier.cuda.memory import REGISTRATIONS, crosses, pieces, row_pieces

# Per thread: the devices whose CUDA context the thread has current (see Lane.bind_context).
_BOUND = threading.local()


def _torch_raw_stream(index: int) -> int:
    return int(torch.cuda.current_stream(index).cuda_stream)


# The caller's current stream as a raw handle: torch's private accessor costs ~0.3 us where
# ``torch.cuda.current_stream()`` builds a Stream object (~3-9 us on a busy host).
current_raw_stream: Callable[[int], int] = getattr(
    torch._C, "_cuda_getCurrentRawStream", _torch_raw_stream
)


class HostEvent:
    """An event on a CPU device: the work before it has always run."""

    __slots__ = ()

    def record(self, stream: int) -> None:
        pass

    def wait_on(self, stream: int) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Lane:
    """One direction's streams (``kernel_stream`` runs gathers or scatters, ``copy_stream`` the
    DMAs), ``slots`` staging buffers used in turn, and two events per slot: ``filled`` (its
    producer is done writing it) and ``free`` (its consumer is done reading it). A slot is
    reused only after ``free`` on the device; ``last`` is the event behind the lane's latest
    work, which the host waits for to end a call."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int) -> None:
        self.device = device
        self.gpu = device.type == "cuda"
        self.index: int | None = device.index if self.gpu else None
        self.slot_bytes = slot_bytes
        self.slots: list[torch.Tensor] = []
        self.generation = 0  # bumped whenever the slots are allocated or released
        self.next_slot = 0
        if self.gpu:
            drv = driver()
            if drv is None:
                raise CUDADriverError(
                    "kvtier-cuda needs the CUDA driver library (libcuda.so.1), which did not load"
                )
            self.drv = drv
            self.kernel_stream: Any = torch.cuda.Stream(device)
            self.copy_stream: Any = torch.cuda.Stream(device)
            self.ks, self.cs = self.kernel_stream.cuda_stream, self.copy_stream.cuda_stream
        else:
            self.kernel_stream = self.copy_stream = None
            self.ks = self.cs = 0
        self.filled = [self.event() for _ in range(slots)]
        self.free = [self.event() for _ in range(slots)]
        self.taken = [False] * slots  # used in this call: its next use waits for ``free``
        self.after = self.event()  # the caller's stream, at the call
        self.layer_done: list[Any] = []  # a layer-by-layer load's per-layer events
        self.last: Any = None
        self.ids_host = torch.empty(0, dtype=torch.int64)
        self.ids_np = self.ids_host.numpy()
        self.ids = self.ids_host  # on the device (the same tensor on a CPU device)
        self.gathered: Any = None  # a store's event after its latest gather

    def event(self) -> Any:
        return RawEvent(self.drv) if self.gpu else HostEvent()

    # -- buffers -------------------------------------------------------------------------------
    def ensure_ids(self, n: int) -> None:
        """Block-id buffers of ``n`` int64s (host, pinned on a GPU, and device), their contents
        not kept; growing them first waits for the lane's work (the old ones may be in use)."""
        if self.ids_host.numel() >= n:
            return
        self.synchronize()
        size = max(n, 4096)
        self.ids_host = torch.empty(size, dtype=torch.int64, pin_memory=self.gpu)
        self.ids_np = self.ids_host.numpy()
        self.ids = self.device_empty(size, torch.int64) if self.gpu else self.ids_host

    def begin(self) -> None:
        """A call starts: the lane is idle (every call ends with the host waiting for it)."""
        self.gathered = None
        self.taken = [False] * len(self.filled)

    def take_slot(self, nbytes: int, stream: int) -> int:
        """The next slot in turn, holding at least ``nbytes`` (all slots are allocated or grown
        together; a grown ring first waits for the lane's work: the old slots may be in use),
        ``stream`` made to wait until its previous consumer in this call is done with it (a
        driver call saved on a slot's first use in a call)."""
        if not self.slots or nbytes > self.slot_bytes:
            self.synchronize()
            self.slot_bytes = max(self.slot_bytes, nbytes)
            size = -(-self.slot_bytes // 16) * 16  # the kernels view a slot as 8-byte words
            self.slots = [self.device_empty(size, torch.uint8) for _ in self.filled]
            self.generation += 1
            self.taken = [False] * len(self.filled)
        s = self.next_slot
        self.next_slot = (s + 1) % len(self.filled)
        if self.taken[s]:
            self.free[s].wait_on(stream)
        self.taken[s] = True
        return s

    def release(self) -> None:
        """Give the slots back to torch's allocator (only with nothing of this lane in flight)."""
        self.slots = []
        self.generation += 1

    def device_empty(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory of the lane, allocated on its copy stream: torch's caching allocator
        then never hands it a block freed on the caller's stream with work still queued there (a
        load's DMAs into it do not wait for the caller's stream)."""
        with torch.cuda.stream(self.copy_stream):
            return torch.empty(size, dtype=dtype, device=self.device)

    # -- device calls --------------------------------------------------------------------------
    def record(self, event: Any, stream: int) -> None:
        event.record(stream)
        self.last = event

    def to_host(self, dst: int, src: int, nbytes: int) -> None:
        """Device ``src`` -> host ``dst`` on the copy stream."""
        if not self.gpu:
            ctypes.memmove(dst, src, nbytes)
            return
        cuts = REGISTRATIONS.cuts
        if cuts and crosses(cuts, dst, dst + nbytes):
            for off, n in pieces(cuts, dst, dst + nbytes):
                self.drv.memcpy_dtoh(dst + off, src + off, n, self.cs)
        else:
            self.drv.memcpy_dtoh(dst, src, nbytes, self.cs)

    def to_device(self, dst: int, src: int, nbytes: int) -> None:
        """Host ``src`` -> device ``dst`` on the copy stream."""
        if not self.gpu:
            ctypes.memmove(dst, src, nbytes)
            return
        cuts = REGISTRATIONS.cuts
        if cuts and crosses(cuts, src, src + nbytes):
            for off, n in pieces(cuts, src, src + nbytes):
                self.drv.memcpy_htod(dst + off, src + off, n, self.cs)
        else:
            self.drv.memcpy_htod(dst, src, nbytes, self.cs)

    def copy_2d(
        self,
        dst: int,
        dst_pitch: int,
        src: int,
        src_pitch: int,
        width: int,
        rows: int,
        *,
        to_host: bool,
    ) -> None:
        """``rows`` rows of ``width`` bytes, each side with its pitch, on the copy stream."""
        if not self.gpu:
            for r in range(rows):
                ctypes.memmove(dst + r * dst_pitch, src + r * src_pitch, width)
            return
        host, pitch = (dst, dst_pitch) if to_host else (src, src_pitch)
        cuts = REGISTRATIONS.cuts
        if not (cuts and crosses(cuts, host, host + (rows - 1) * pitch + width)):
            self.drv.memcpy_2d(
                dst, dst_pitch, src, src_pitch, width, rows, self.cs, to_host=to_host
            )
            return
        for r, n, off, w in row_pieces(cuts, host, pitch, width, rows):
            self.drv.memcpy_2d(
                dst + r * dst_pitch + off,
                dst_pitch,
                src + r * src_pitch + off,
                src_pitch,
                w,
                n,
                self.cs,
                to_host=to_host,
            )

    def order_after_caller(self, stream: int) -> None:
        """``stream`` (the lane's kernel or copy stream) waits (on the device) for the work the
        calling thread has queued on its current stream so far."""
        if self.gpu:
            assert self.index is not None
            caller = current_raw_stream(self.index)
            self.after.record(caller)
            self.after.wait_on(stream)

    def caller_waits(self, event: Any) -> None:
        """The calling thread's current stream waits (on the device) for ``event``."""
        if self.gpu:
            assert self.index is not None
            event.wait_on(current_raw_stream(self.index))

    def synchronize(self) -> None:
        """The host waits for all work this lane issued."""
        if self.last is not None:
            self.last.synchronize()
            self.last = None

    def bind_context(self) -> None:
        """Make sure this thread has the device's CUDA context current before driver calls (a
        thread's first CUDA runtime call binds it; remembered per thread and device)."""
        if not self.gpu:
            return
        bound = getattr(_BOUND, "devices", None)
        if bound is None:
            bound = _BOUND.devices = set()
        if self.index in bound:
            return
        if not self.drv.has_context():
            torch.cuda.current_stream(self.device).query()  # binds the primary context
            if not self.drv.has_context():
                raise CUDADriverError(
                    f"no CUDA context is current on this thread for {self.device}"
                )
        bound.add(self.index)
