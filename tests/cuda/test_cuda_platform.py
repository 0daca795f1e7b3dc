"""The CUDA platform: cheap import and probe, discovery, arena, connector options."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ON_GPU, SHAPE, make_caches, make_layout
from kvtier.core.errors import PlatformError
from kvtier.core.layout import PagedLayout
from kvtier.core.platform import discover_platforms, resolve_platform_class
from kvtier.cuda.probe import PLATFORM_PATH, probe


def test_importing_the_package_and_its_platform_is_cheap():
    code = (
        "import sys, kvtier.cuda, kvtier.cuda.probe, kvtier.cuda.platform, kvtier.cuda.connector\n"
        "import torch\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "kvtier.cuda.probe.probe()\n"
        "assert 'triton' not in sys.modules, 'the probe imported triton'\n"
        "assert not torch.cuda.is_initialized(), 'the probe initialised CUDA'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_probe_answers_for_this_machine():
    if ON_GPU:
        assert probe() == PLATFORM_PATH
        assert discover_platforms()["cuda"] == PLATFORM_PATH
    elif torch.version.cuda is None:
        assert probe() is None
        with pytest.raises(PlatformError, match="not available"):
            resolve_platform_class("cuda")


def test_probe_respects_an_empty_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe() is None


def test_platform_class_attributes():
    from kvtier.cuda.platform import CUDAPlatform

    assert (CUDAPlatform.name, CUDAPlatform.device_type, CUDAPlatform.priority) == ("cuda", "cuda", 100)
    assert CUDAPlatform().has_pinned_memory
    assert CUDAPlatform(1).device == torch.device("cuda", 1)


def test_create_connector_checks_its_options(device):
    from kvtier.cuda.connector import CUDAPagedConnector
    from kvtier.cuda.platform import CUDAPlatform

    layout = make_layout(PagedLayout.FLASH_NHD, torch.float16)
    caches = make_caches(layout, device, seed=1)
    conn = CUDAPlatform().create_connector(caches, layout, mode="zerocopy", staging_slots=3)
    assert isinstance(conn, CUDAPagedConnector) and conn.mode == "zerocopy"
    with pytest.raises(TypeError, match="unknown CUDA connector option"):
        CUDAPlatform().create_connector(caches, layout, use_gpu=True)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
def test_gpu_discovery_and_registered_arena():
    from kvtier.cuda.platform import CUDAPlatform, RegisteredHostArena

    assert resolve_platform_class() is CUDAPlatform
    arena = CUDAPlatform().create_arena(3 * (1 << 30) + 12345)
    assert isinstance(arena, RegisteredHostArena) and arena.registered
    assert arena.is_pinned
    # One registration of exactly the size asked for (torch's pinned allocator would round up).
    assert arena.buffer.numel() == 3 * (1 << 30) + 12345
    host = arena.buffer[: 1 << 20]
    dev = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, dev.cpu())
    assert SHAPE.layers > 2  # real sizes in the GPU run
