"""The CPU platform: the engine's KV cache lives in host memory (vLLM's CPU backend, tests)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.layout import KVLayout
from kvtier.core.platform import Platform
from kvtier.core.platform.mover import TorchPageMover, check_options


def detect() -> str | None:
    """Always available."""
    return "kvtier.core.platform.cpu:CPUPlatform"


class CPUPlatform(Platform):
    name = "cpu"
    priority = 0
    device_type = "cpu"

    def create_mover(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        *,
        num_blocks: int | None = None,
        **options: object,
    ) -> TorchPageMover:
        """The reference ``TorchPageMover``. Options: only the common ones
        (``kvtier.core.platform.mover.COMMON_OPTIONS``); ``staging_buffer`` changes nothing here, the
        cache being host memory. Anything else is a ``TypeError``."""
        check_options(self.name, options)
        return TorchPageMover(kv_caches, layout, num_blocks)
