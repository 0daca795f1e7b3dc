"""The memory a CUDA connector owns, and the one place its lifetimes are decided.

- ``RegisteredHostArena``: the pinned host arena (one ``cudaHostRegister`` for the whole arena),
  unregistered when the arena is collected.
- ``StagingRing``: one direction's device staging slots. Allocated on first use on the lane's
  kernel stream and marked used by its copy stream, so freeing it (``release``) is safe with
  work in flight: torch's allocator reuses the bytes only after both streams' work so far.
- ``TableRing``: buffers that carry a batch's slot list and run table from the host to the
  device. The device reads them from work issued through the driver, which torch's allocator
  does not see, so a buffer is reused only after the event recorded behind its last reader.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np
import torch

from kvtier.core.memory import HostArena
from kvtier.cuda.kernels import WORDS_ALIGN

logger = logging.getLogger("kvtier")

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every device, and addressable
# by kernels (a table buffer is read in place by ``copy_words``).
_REGISTER_FLAGS = 1 | 2
# Table buffers per lane: batches whose tables may be in flight at once.
TABLE_RING = 8


class RegisteredHostArena(HostArena):
    """A host arena page-locked with one ``cudaHostRegister`` call.

    Why not ``torch.empty(pin_memory=True)``: torch's pinned allocator rounds every request up
    to a power of two (a 40 GiB arena would pin 64 GiB) and caches it for the process's life.
    Here the bytes are an ordinary allocation, registered once and unregistered when the arena
    is collected (which cannot happen while a memory object of it is alive: each holds its
    arena). If the registration is refused (e.g. ``ulimit -l``), the arena stays pageable with a
    warning: copies stay correct, only slower.
    """

    def __init__(self, buffer: torch.Tensor, *, alignment: int = 256) -> None:
        super().__init__(buffer, alignment=alignment)
        self.registered = False
        if buffer.numel() == 0:
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), _REGISTER_FLAGS)
        if err != cudart.cudaError.success:
            logger.warning(
                "kvtier: cudaHostRegister of the %d-byte host arena failed (%s); it stays pageable "
                "and transfers will be slower (check the memlock limit, ulimit -l)",
                buffer.numel(),
                err,
            )
            return
        self.registered = True
        # The finalizer holds the buffer, so the bytes are unregistered before they are freed.
        weakref.finalize(self, _unregister, buffer)


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class StagingRing:
    """``num_slots`` device buffers of ``slot_bytes`` each, claimed in turn (``claim``).

    ``streams``: (kernel stream, copy stream) on a GPU, None on a CPU device (tests)."""

    def __init__(
        self, device: torch.device, num_slots: int, slot_bytes: int, streams: tuple[Any, Any] | None
    ) -> None:
        self.device = device
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.next_slot = 0
        self.slots: list[torch.Tensor] = []
        self.slot_ptrs: list[int] = []
        self._streams = streams

    def claim(self) -> int:
        """The next slot's index (the ring moves on)."""
        s = self.next_slot
        self.next_slot = (s + 1) % self.num_slots
        return s

    def ensure(self, nbytes: int) -> None:
        """Allocate the slots if released or never allocated; grow them to hold ``nbytes``."""
        if self.slots and nbytes <= self.slot_bytes:
            return
        if self.slots and self._streams is not None:
            for stream in self._streams:  # a grown ring must not free slots under live copies
                stream.synchronize()
        self.slot_bytes = max(self.slot_bytes, nbytes)
        if self._streams is None:
            self.slots = [
                torch.empty(self.slot_bytes, dtype=torch.uint8) for _ in range(self.num_slots)
            ]
        else:
            ks, cs = self._streams
            with torch.cuda.stream(ks):
                self.slots = [
                    torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                    for _ in range(self.num_slots)
                ]
            for s in self.slots:
                s.record_stream(cs)
        self.slot_ptrs = [s.data_ptr() for s in self.slots]

    def release(self) -> None:
        """Give the slots back to torch's allocator (safe with copies in flight, see module doc)."""
        self.slots, self.slot_ptrs = [], []


class TableBuffer:
    """One buffer of a ``TableRing``: a batch's slot list, then its run table (int64s).

    Written on the host in ``host`` (pinned on a GPU) and read by kernels from ``dev``; on a CPU
    device both are the same tensor. ``done``: an event recorded behind the last reader."""

    __slots__ = ("dev", "dev_ptr", "done", "host", "host_np", "host_ptr", "host_read_ptr")

    def __init__(self, done: Any) -> None:
        self.done = done
        self.host: torch.Tensor | None = None
        self.host_np: np.ndarray | None = None
        self.dev: torch.Tensor | None = None
        self.host_ptr = self.host_read_ptr = self.dev_ptr = 0

    def ensure(
        self, numel: int, device: torch.device, host_device_pointer: Any = None, keep: int = 0
    ) -> None:
        """At least ``numel`` int64s (rounded up to ``WORDS_ALIGN``) on both sides; the first
        ``keep`` host values survive. ``host_device_pointer``: maps a pinned host address to the
        address a kernel reads it at (GPU only)."""
        if self.host is not None and self.host.numel() >= numel:
            return
        size = -(-max(numel, 1 << 12) // WORDS_ALIGN) * WORDS_ALIGN
        old = self.host_np
        on_gpu = device.type == "cuda"
        host = torch.empty(size, dtype=torch.int64, pin_memory=on_gpu)
        self.host, self.host_np, self.host_ptr = host, host.numpy(), host.data_ptr()
        self.dev = torch.empty(size, dtype=torch.int64, device=device) if on_gpu else host
        self.dev_ptr = self.dev.data_ptr()
        self.host_read_ptr = host_device_pointer(self.host_ptr) if on_gpu else self.host_ptr
        if keep and old is not None:
            self.host_np[:keep] = old[:keep]


class TableRing:
    """``TABLE_RING`` table buffers used in turn. Taking one waits (host) for its ``done``
    event: its last reader is that many batches back, normally long finished; when the host
    runs further ahead of the GPU than that, this wait is the back-pressure."""

    def __init__(
        self, device: torch.device, make_event: Any, host_device_pointer: Any = None
    ) -> None:
        self.device = device
        self.buffers = [TableBuffer(make_event()) for _ in range(TABLE_RING)]
        self.next = 0
        self._host_device_pointer = host_device_pointer

    def take(self, numel: int) -> TableBuffer:
        buf = self.buffers[self.next]
        self.next = (self.next + 1) % len(self.buffers)
        buf.done.synchronize()
        buf.ensure(numel, self.device, self._host_device_pointer)
        return buf

    def grow(self, buf: TableBuffer, numel: int, keep: int) -> None:
        buf.ensure(numel, self.device, self._host_device_pointer, keep=keep)
