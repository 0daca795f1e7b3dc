"""The pinned host arena of the CUDA platform: one ``cudaHostRegister`` for the whole arena."""

from __future__ import annotations

import logging
import weakref

import torch

from kvtier.core.memory import HostArena

logger = logging.getLogger("kvtier")

# cudaHostRegisterPortable: pinned for every device's copies.
_REGISTER_FLAGS = 1


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
