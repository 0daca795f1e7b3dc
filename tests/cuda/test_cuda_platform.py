"""The CUDA platform: cheap import and probe, discovery, arena, connector options."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ON_GPU, SHAPE, as_bytes, make_caches, make_layout
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


def test_cuda_outranks_the_cpu_and_xpu_platforms_and_names_its_device():
    from kvtier.core.platforms.cpu import CPUPlatform
    from kvtier.cuda.platform import CUDAPlatform

    assert CUDAPlatform.priority > CPUPlatform.priority
    xpu = pytest.importorskip("kvtier.xpu.platform", reason="kvtier-xpu is not installed")
    assert CUDAPlatform.priority > xpu.XPUPlatform.priority
    assert CUDAPlatform().has_pinned_memory
    assert CUDAPlatform(1).device == torch.device("cuda", 1)


def test_create_connector_checks_its_options(device):
    from kvtier.cuda.connector import CUDAPagedConnector
    from kvtier.cuda.options import CUDAOptions
    from kvtier.cuda.platform import CUDAPlatform

    layout = make_layout(PagedLayout.FLASH_NHD, torch.float16)
    caches = make_caches(layout, device, seed=1)
    conn = CUDAPlatform().create_connector(caches, layout, staging_slots=3, native_planner=False)
    assert isinstance(conn, CUDAPagedConnector)
    assert conn.options == CUDAOptions(staging_slots=3, native_planner=False)
    # Misspelt, removed or foreign options are errors naming them, as are wrong types.
    for bad in (
        {"use_gpu": True},
        {"mode": "zerocopy"},
        {"staging_slot": 4},
        {"max_staging_bytes": 1},
    ):
        with pytest.raises(TypeError, match=f"unknown CUDA connector option.*{next(iter(bad))}"):
            CUDAPlatform().create_connector(caches, layout, **bad)
    with pytest.raises(TypeError, match="staging_buffer"):
        CUDAPlatform().create_connector(caches, layout, staging_buffer="yes")
    with pytest.raises(TypeError, match="staging_slot_bytes"):
        CUDAPlatform().create_connector(caches, layout, staging_slot_bytes=True)
    with pytest.raises(ValueError, match="staging_slot_bytes"):
        CUDAPlatform().create_connector(caches, layout, staging_slot_bytes=0)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("staging", [True, False])
def test_the_cache_engine_runs_on_the_cuda_platform(device, staging, layerwise):
    """CacheEngine registers the caches with the CUDA platform (passing its generic options)
    and a stored prefix comes back byte-identical into fresh slots, whole or layer by layer."""
    from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, load_config
    from kvtier.cuda.platform import CUDAPlatform

    layout = make_layout(PagedLayout.FLASH_NHD, torch.float16)
    caches = make_caches(layout, device, seed=3)
    platform = CUDAPlatform()
    # two 8B-shaped chunks fill 64 MiB; 1 MiB more holds their alias entries (kvtier.core.aliases)
    size = (64 << 20) + (1 << 20)
    arena = platform.create_arena(size) if device.type == "cuda" else HostArena.create(size)
    config = load_config(
        env={},
        overrides={
            "chunk_size": SHAPE.chunk,
            "tiers": ["local_cpu"],
            "device_staging_buffer": staging,
        },
    )
    engine = CacheEngine(
        config,
        layout,
        model="test/model",
        platform=platform,
        storage=HostMemoryStorageManager(arena),
    )
    engine.register_kv_caches(caches)
    assert engine.connector is not None
    n = 2 * SHAPE.chunk
    total = SHAPE.blocks * SHAPE.block
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(4))
    src, dst = perm[:n], perm[n : 2 * n]
    tokens = list(range(1000, 1000 + n))
    if layerwise:
        assert list(engine.store_layerwise(tokens, src)) == list(range(layout.num_layers))
        assert engine.stats.stored_tokens == n
    else:
        assert engine.store(tokens, src) == n
    before = [as_bytes(c).clone() for c in caches]
    if layerwise:
        job = engine.retrieve_layerwise(tokens, dst)
        assert list(job.layers) == list(range(layout.num_layers))
        mask = job.mask
    else:
        mask = engine.retrieve(tokens, dst)
    assert bool(mask.all())
    for layer, cache in enumerate(caches):
        flat = cache.view(torch.int16).permute(1, 2, 0, 3, 4).reshape(total, -1)
        old = (
            before[layer]
            .view(torch.int16)
            .view(cache.shape)
            .permute(1, 2, 0, 3, 4)
            .reshape(total, -1)
        )
        assert torch.equal(flat[dst.to(flat.device)], old[src.to(flat.device)])


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
