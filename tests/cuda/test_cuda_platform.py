"""The CUDA platform: cheap import and detection, discovery, the registered arena, mover options,
and the CacheEngine over it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BLOCKS, ON_GPU, make_layout, make_views
from kvtier.core.errors import PlatformError
from kvtier.core.layout import PagedLayout
from kvtier.core.pages import page_view
from kvtier.core.platform import discover_platforms, resolve_platform_class
from kvtier.cuda.detect import PLATFORM_PATH, detect


def test_importing_the_package_its_platform_and_mover_is_cheap():
    code = (
        "import sys, kvtier.cuda, kvtier.cuda.detect, kvtier.cuda.platform, kvtier.cuda.mover\n"
        "import torch\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "kvtier.cuda.detect.detect()\n"
        "assert 'triton' not in sys.modules, 'detect imported triton'\n"
        "assert not torch.cuda.is_initialized(), 'detect initialised CUDA'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_entry_point_names_detect():
    pyproject = Path(__file__).parents[2] / "packages" / "cuda" / "pyproject.toml"
    text = pyproject.read_text()
    group = text.split('[project.entry-points."kvtier.platforms"]')[1].split("[")[0]
    assert group.strip() == 'cuda = "kvtier.cuda.detect:detect"'


def test_detect_answers_for_this_machine():
    if ON_GPU:
        assert detect() == PLATFORM_PATH
        assert discover_platforms()["cuda"] == PLATFORM_PATH
    elif torch.version.cuda is None:
        assert detect() is None
        with pytest.raises(PlatformError, match="not available"):
            resolve_platform_class("cuda")


def test_detect_respects_an_empty_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect() is None


def test_cuda_outranks_the_cpu_and_xpu_platforms_and_names_its_device():
    from kvtier.core.platforms.cpu import CPUPlatform
    from kvtier.cuda.platform import CUDAPlatform

    assert CUDAPlatform.priority > CPUPlatform.priority
    xpu = pytest.importorskip("kvtier.xpu.platform", reason="kvtier-xpu is not installed")
    assert CUDAPlatform.priority > xpu.XPUPlatform.priority
    assert CUDAPlatform().has_pinned_memory
    assert CUDAPlatform(1).device == torch.device("cuda", 1)


def test_create_mover_checks_its_own_options(device):
    from kvtier.cuda.mover import CUDAPageMover, MoverOptions
    from kvtier.cuda.platform import CUDAPlatform

    layout = make_layout()
    views = make_views(layout, device, seed=1)
    mover = CUDAPlatform().create_mover(views, layout, staging_slots=3, staging_slot_bytes=4096)
    assert isinstance(mover, CUDAPageMover) and mover.num_blocks == BLOCKS
    assert mover.options == MoverOptions(staging_slots=3, staging_slot_bytes=4096)
    for removed in ("native_planner", "max_staging_bytes"):
        with pytest.raises(TypeError, match=f"unknown cuda mover option.*{removed}"):
            CUDAPlatform().create_mover(views, layout, **{removed: 1})
    with pytest.raises(TypeError, match="staging_slot_bytes"):
        CUDAPlatform().create_mover(views, layout, staging_slot_bytes=True)
    with pytest.raises(ValueError, match="staging_slots"):
        CUDAPlatform().create_mover(views, layout, staging_slots=1)
    with pytest.raises(ValueError, match="staging_slot_bytes"):
        CUDAPlatform().create_mover(views, layout, staging_slot_bytes=0)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("staging", [True, False])
def test_the_cache_engine_runs_on_the_cuda_platform(device, staging, layerwise):
    """CacheEngine registers vLLM-placed views with the CUDA platform (passing its generic
    options) and a stored prefix comes back page for page into other blocks."""
    from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, load_config
    from kvtier.cuda.platform import CUDAPlatform

    layout = make_layout(PagedLayout.BLNHC)
    views = make_views(layout, device, seed=3)
    platform = CUDAPlatform()
    chunk = 4 * layout.block_size
    size = 4 * layout.chunk_nbytes(chunk) + (1 << 20)  # and room for alias entries
    arena = platform.create_arena(size) if device.type == "cuda" else HostArena.create(size)
    config = load_config(
        env={},
        overrides={"chunk_size": chunk, "tiers": ["local_cpu"], "device_staging_buffer": staging},
    )
    engine = CacheEngine(
        config,
        layout,
        model="test/model",
        platform=platform,
        storage=HostMemoryStorageManager(arena),
    )
    engine.register_kv_caches(views)
    assert engine.mover is not None and engine.mover.options.staging_buffer is staging  # type: ignore[attr-defined]
    n = 2 * chunk
    perm = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(4))
    src, dst = (
        perm[: n // layout.block_size],
        perm[n // layout.block_size : 2 * n // layout.block_size],
    )

    def slots(blocks: torch.Tensor) -> torch.Tensor:
        return (blocks[:, None] * layout.block_size + torch.arange(layout.block_size)).reshape(-1)

    tokens = list(range(1000, 1000 + n))
    if layerwise:
        assert list(engine.store_layerwise(tokens, slots(src))) == list(range(layout.num_layers))
    else:
        assert engine.store(tokens, slots(src)) == n
    runs = engine.mover.runs
    stored = [page_view(v, runs)[src.to(device)] for v in views]
    if layerwise:
        job = engine.retrieve_layerwise(tokens, slots(dst))
        assert list(job.layers) == list(range(layout.num_layers))
        mask = job.mask
    else:
        mask = engine.retrieve(tokens, slots(dst))
    assert bool(mask.all())
    for view, pages in zip(views, stored, strict=True):
        assert torch.equal(page_view(view, runs)[dst.to(device)], pages)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
def test_gpu_discovery_and_registered_arena():
    from kvtier.cuda.memory import RegisteredHostArena
    from kvtier.cuda.platform import CUDAPlatform

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
