"""The CUDA platform: priority 100 (above xpu's 50 and cpu's 0)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import torch

from kvtier.core.layout import KVLayout
from kvtier.core.memory import HostArena
from kvtier.core.platform import Platform
from kvtier.cuda.connector import CUDAPagedConnector

logger = logging.getLogger("kvtier")

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every device and addressable
# by kernels (the connector's zerocopy mode).
_REGISTER_FLAGS = 1 | 2


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


class CUDAPlatform(Platform):
    name = "cuda"
    priority = 100
    device_type = "cuda"

    @property
    def has_pinned_memory(self) -> bool:
        return True

    def create_arena(self, nbytes: int, *, pin_memory: bool = True) -> HostArena:
        """One host allocation of ``nbytes``, page-locked with one registration when asked."""
        if not pin_memory:
            return HostArena.create(nbytes, pin_memory=False)
        torch.cuda.init()
        return RegisteredHostArena(torch.empty(nbytes, dtype=torch.uint8))

    def create_connector(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, **options: object
    ) -> CUDAPagedConnector:
        """A ``CUDAPagedConnector``; options: its keyword arguments (``mode``, ``staging_slots``,
        ``staging_slot_bytes``, ``use_driver_api``, ``first_group_bytes``, ``combine_calls``) and
        the engine's ``staging_buffer`` (config ``device_staging_buffer``): True keeps the
        default ``mode="dma"`` (gather into device staging slots, then the copy engine), False
        asks for ``mode="zerocopy"`` (kernels read and write pinned host memory in place)."""
        known = {
            "mode", "staging_slots", "staging_slot_bytes", "use_driver_api", "first_group_bytes", "combine_calls",
            "staging_buffer",
        }
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown CUDA connector option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        opts = dict(options)
        staging = opts.pop("staging_buffer", True)
        if not isinstance(staging, bool):
            raise TypeError(f"staging_buffer (config device_staging_buffer) must be a bool, got {staging!r}")
        if not staging:
            opts.setdefault("mode", "zerocopy")
        return CUDAPagedConnector(kv_caches, layout, **opts)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
