"""The CUDA platform: priority 100 (above xpu's 50 and cpu's 0)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.layout import KVLayout
from kvtier.core.memory import HostArena
from kvtier.core.mover import check_options
from kvtier.core.pages import manager_blocks
from kvtier.core.platform import Platform
from kvtier.cuda.memory import RegisteredHostArena
from kvtier.cuda.mover import OPTION_TYPES, CUDAPageMover, MoverOptions


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
