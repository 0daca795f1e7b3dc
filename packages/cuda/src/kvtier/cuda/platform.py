"""The CUDA platform: priority 100 (above xpu's 50 and cpu's 0).

Its host arena is one ordinary allocation, page-locked segment by segment on a background thread
(``cudaHostRegister``, ``kvtier.cuda.memory``): usable at once, its capacity growing as segments
are pinned (``kvtier.core.memory.arena_growth``). Not ``torch.empty(pin_memory=True)``: torch's pinned
allocator rounds a request up to a power of two (a 40 GiB arena would pin 64 GiB) and pins it
all before returning.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

import torch

from kvtier.core.layout import KVLayout
from kvtier.core.memory import HostArena
from kvtier.core.platform import Platform
from kvtier.core.platform.mover import check_options
from kvtier.core.platform.pages import manager_blocks
from kvtier.cuda.memory import (
    REGISTRATIONS,
    default_prefault_threads,
    prefault,
    unregister_when_collected,
)
from kvtier.cuda.mover import OPTION_TYPES, CUDAPageMover, MoverOptions


class CUDAPlatform(Platform):
    name = "cuda"
    priority = 100
    device_type = "cuda"

    pins_ranges = True
    #: Threads that fault a segment's pages in before it is registered (0: the registration
    #: does, on the pinning thread).
    prefault_threads: ClassVar[int] = default_prefault_threads()

    def __init__(self, device_index: int | None = None) -> None:
        super().__init__(device_index)
        self._pin_device: int | None = None
        self._bound = threading.local()

    @property
    def has_pinned_memory(self) -> bool:
        return True

    def create_arena(self, nbytes: int, *, pin_memory: bool = True) -> HostArena:
        """One host allocation of ``nbytes``, usable at once; when ``pin_memory``, page-locked
        in the background, segment by segment. CUDA is initialised here, on the calling thread,
        and the pinning thread uses this thread's device (a new thread's is device 0: pinning
        from it would create a context on another rank's GPU)."""
        if pin_memory:
            torch.cuda.init()
            if self.device_index is not None:
                self._pin_device = self.device_index
            else:
                self._pin_device = torch.cuda.current_device()
        arena = super().create_arena(nbytes, pin_memory=pin_memory)
        if pin_memory and arena.target_bytes:
            unregister_when_collected(arena)
        return arena

    def pin_host_range(self, address: int, nbytes: int) -> bool:
        """``cudaHostRegister`` (portable) of the range, rounded out to whole pages a neighbour
        does not hold; False when the driver refuses (e.g. the memlock limit)."""
        if not getattr(self._bound, "device", False):
            device = self._pin_device
            torch.cuda.set_device(torch.cuda.current_device() if device is None else device)
            self._bound.device = True
        prefault(address, nbytes, self.prefault_threads)
        return REGISTRATIONS.register(address, nbytes)

    def unpin_host_range(self, address: int, nbytes: int) -> None:
        REGISTRATIONS.unregister(address)

    def create_mover(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        *,
        num_blocks: int | None = None,
        **options: object,
    ) -> CUDAPageMover:
        """A ``CUDAPageMover``. Options: ``staging_buffer``, ``staging_slots``,
        ``staging_slot_bytes`` (``kvtier.cuda.mover.MoverOptions``); anything else, or a value
        of the wrong type, is a ``TypeError`` naming it, a value out of range a ``ValueError``."""
        opts = MoverOptions(**check_options(self.name, options, OPTION_TYPES))  # type: ignore[arg-type]
        if num_blocks is None and kv_caches:
            num_blocks = manager_blocks(kv_caches[0], layout)
        return CUDAPageMover(kv_caches, layout, num_blocks, opts)

    def synchronize(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
