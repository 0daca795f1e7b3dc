"""The CPU platform: the engine's KV cache lives in host memory (vLLM's CPU backend, tests)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.connector import TorchPagedConnector, check_options
from kvtier.core.layout import KVLayout
from kvtier.core.platform import Platform


def probe() -> str | None:
    """Always available."""
    return "kvtier.core.platforms.cpu:CPUPlatform"


class CPUPlatform(Platform):
    name = "cpu"
    priority = 0
    device_type = "cpu"

    def create_connector(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, **options: object
    ) -> TorchPagedConnector:
        """The reference ``TorchPagedConnector``. Options: only the common ones
        (``kvtier.core.connector.COMMON_OPTIONS``); ``staging_buffer`` changes nothing here, the
        cache being host memory. Anything else is a ``TypeError``."""
        check_options(self.name, options)
        return TorchPagedConnector(kv_caches, layout)
