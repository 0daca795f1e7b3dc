"""The ``kvtier.platforms`` entry point for CUDA: cheap, no CUDA context, no triton import."""

from __future__ import annotations

import ctypes
import importlib.util
import os

PLATFORM_PATH = "kvtier.cuda.platform:CUDAPlatform"


def _nvml_device_count() -> int | None:
    """GPUs NVML sees, or None when NVML cannot be loaded (then torch is asked instead)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        return int(count.value)
    finally:
        nvml.nvmlShutdown()


def detect() -> str | None:
    """``"kvtier.cuda.platform:CUDAPlatform"`` when an NVIDIA GPU and triton are usable, else None.

    Asks NVML (no CUDA context is created, so a process that forks later stays fork-safe);
    without NVML it falls back to ``torch.cuda.is_available()``, which initialises the driver
    but still creates no context. ``CUDA_VISIBLE_DEVICES`` set to nothing hides every GPU.
    """
    if importlib.util.find_spec("triton") is None:
        return None
    import torch

    if torch.version.cuda is None:  # a CPU or ROCm build of torch cannot drive CUDA
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    count = _nvml_device_count()
    if count is None:
        return PLATFORM_PATH if torch.cuda.is_available() else None
    return PLATFORM_PATH if count > 0 else None
