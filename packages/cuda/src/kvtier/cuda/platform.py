"""The CUDA platform: priority 100 (above xpu's 50 and cpu's 0)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.layout import KVLayout
from kvtier.core.memory import HostArena
from kvtier.core.platform import Platform
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.memory import RegisteredHostArena


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
        """A ``CUDAPagedConnector``; options: ``kvtier.cuda.options.CUDAOptions`` by name (an
        unknown or misspelt one is a ``TypeError``)."""
        return CUDAPagedConnector(kv_caches, layout, **options)

    def synchronize(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
