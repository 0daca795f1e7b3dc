"""The Intel XPU platform: the engine's KV cache lives on an Intel GPU, driven through torch.xpu.

Chosen automatically over the CPU platform when ``torch.xpu.is_available()`` (priority 50; CUDA
is 100, CPU 0), or explicitly with ``platform: xpu`` / ``KVTIER_PLATFORM=xpu``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.layout import KVLayout
from kvtier.core.platform import Platform
from kvtier.core.platform.mover import check_options
from kvtier.xpu.mover import DEFAULT_MAX_STAGING_BYTES, XPUPageMover


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

    def create_mover(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        *,
        num_blocks: int | None = None,
        **options: object,
    ) -> XPUPageMover:
        """An ``XPUPageMover`` (``kvtier.xpu.mover``). Options: the common ``staging_buffer``
        (bool, default True: keep each direction's device staging buffer between calls; False:
        allocate it per call) and ``max_staging_bytes`` (int >= 0, default 256 MiB: a whole
        store or load stages at most this much at once, moving a larger batch in groups of
        chunks). Anything else is a ``TypeError``, as on every platform
        (``kvtier.core.platform.mover.check_options``)."""
        opts = check_options(self.name, options, {"max_staging_bytes": int})
        staging = opts.get("staging_buffer", True)
        cap = opts.get("max_staging_bytes", DEFAULT_MAX_STAGING_BYTES)
        assert isinstance(staging, bool) and isinstance(cap, int)
        return XPUPageMover(
            kv_caches, layout, num_blocks, staging_buffer=staging, max_staging_bytes=cap
        )

    def synchronize(self) -> None:
        """Wait for every copy issued on this platform's device (every stream)."""
        if _xpu_available():
            torch.xpu.synchronize(self.device)
