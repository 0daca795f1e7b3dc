"""Fixtures of the XPU tests: the device under test and the KV geometries.

``KVTIER_TEST_DEVICE`` picks the device (cpu in tests-cpu, xpu in tests-xpu); the data-path tests
run unchanged on both.
"""

from __future__ import annotations

import pytest
import torch
from xpu_helpers import GEOMETRIES, Geometry, xpu_available


@pytest.fixture(scope="session")
def device(test_device: torch.device) -> torch.device:
    """The cache device; a test run asked to use an absent accelerator skips, never passes empty."""
    if test_device.type == "xpu" and not xpu_available():
        pytest.skip("KVTIER_TEST_DEVICE=xpu but torch.xpu.is_available() is False")
    if test_device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("KVTIER_TEST_DEVICE=cuda but torch.cuda.is_available() is False")
    return test_device


@pytest.fixture(params=list(GEOMETRIES))
def geometry(request: pytest.FixtureRequest) -> Geometry:
    return GEOMETRIES[request.param]
