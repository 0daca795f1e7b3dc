"""The Intel XPU platform: the engine's KV cache lives on an Intel GPU, driven through torch.xpu.

Chosen automatically over the CPU platform when ``torch.xpu.is_available()`` (priority 50; CUDA
is 100, CPU 0), or explicitly with ``platform: xpu`` / ``KVTIER_PLATFORM=xpu``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.connector import check_options
from kvtier.core.layout import KVLayout
from kvtier.core.platform import Platform
from kvtier.xpu.connector import DEFAULT_MAX_STAGING_BYTES, XPUPagedConnector


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


class XPUPlatform(Platform):
    name = "xpu"
    priority = 50
    device_type = "xpu"

    @property
    def has_pinned_memory(self) -> bool:
        # Pinned host memory needs a device runtime to register it with; without one, torch
        # refuses to pin (and the platform is not usable anyway, save for tests on CPU tensors).
        return _xpu_available()

    def create_connector(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, **options: object
    ) -> XPUPagedConnector:
        """An ``XPUPagedConnector``. Options: the common ``staging_buffer`` (bool, default True:
        per-direction device staging buffers, see ``kvtier.xpu.connector``; False: each chunk
        moves through a temporary) and ``max_staging_bytes`` (int >= 0, default 256 MiB: the
        largest whole load staged in one piece; larger ones go layer by layer). Anything else is
        a ``TypeError``, as on every platform (``kvtier.core.connector.check_options``)."""
        opts = check_options(self.name, options, {"max_staging_bytes": int})
        staging = opts.get("staging_buffer", True)
        cap = opts.get("max_staging_bytes", DEFAULT_MAX_STAGING_BYTES)
        assert isinstance(staging, bool) and isinstance(cap, int)
        return XPUPagedConnector(kv_caches, layout, staging_buffer=staging, max_staging_bytes=cap)

    def synchronize(self) -> None:
        """Wait for every copy issued on this platform's device (every stream)."""
        if _xpu_available():
            torch.xpu.synchronize(self.device)
