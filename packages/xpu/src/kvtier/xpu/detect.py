"""The ``kvtier.platforms`` entry point for Intel XPUs: cheap, imports nothing beyond torch."""

from __future__ import annotations

PLATFORM_PATH = "kvtier.xpu.platform:XPUPlatform"


def detect() -> str | None:
    """The XPU platform's class path when torch sees an Intel GPU, else None.

    ``torch.xpu.is_available()`` asks the driver for a device count without creating a context.
    """
    import torch

    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return None
    return PLATFORM_PATH
