"""Discovery and choice of the XPU platform, with ``torch.xpu.is_available`` simulated on CPU
machines; the ``xpu``-marked tests need a real Intel GPU and skip without one."""

from __future__ import annotations

import pytest
import torch
from xpu_helpers import GEOMETRIES, NUM_BLOCKS, make_caches, xpu_available

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, PlatformError, load_config
from kvtier.core.platform import discover_platforms, get_platform, resolve_platform_class
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.xpu import XPUPageMover, XPUPlatform, detect

needs_xpu = pytest.mark.skipif(not xpu_available(), reason="needs an Intel XPU (torch.xpu)")


@pytest.fixture
def fake_xpu(isolated_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """torch reports an Intel GPU; nothing else about torch changes."""
    isolated_env.setattr(torch.xpu, "is_available", lambda: True)
    return isolated_env


@pytest.fixture
def no_xpu(isolated_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    isolated_env.setattr(torch.xpu, "is_available", lambda: False)
    return isolated_env


def _platform_from_env(env: dict[str, str]) -> object:
    cfg = load_config(env=env)
    return get_platform(cfg.platform, cfg.plugins)


def test_detect_follows_torch_xpu(no_xpu: pytest.MonkeyPatch) -> None:
    assert detect() is None
    assert discover_platforms()["xpu"] is None
    no_xpu.setattr(torch.xpu, "is_available", lambda: True)
    assert detect() == "kvtier.xpu.platform:XPUPlatform"
    assert discover_platforms()["xpu"] == "kvtier.xpu.platform:XPUPlatform"


def test_xpu_beats_cpu_when_available(fake_xpu: pytest.MonkeyPatch) -> None:
    assert XPUPlatform.priority > CPUPlatform.priority
    cls = resolve_platform_class()
    assert cls is XPUPlatform
    platform = _platform_from_env({})
    assert isinstance(platform, XPUPlatform)
    assert platform.device == torch.device("xpu")


def test_without_xpu_cpu_is_chosen(no_xpu: pytest.MonkeyPatch) -> None:
    assert resolve_platform_class() is CPUPlatform


def test_explicit_cpu_wins_over_an_available_xpu(fake_xpu: pytest.MonkeyPatch) -> None:
    assert isinstance(_platform_from_env({"KVTIER_PLATFORM": "cpu"}), CPUPlatform)


def test_plugin_allow_list_narrows_the_choice(fake_xpu: pytest.MonkeyPatch) -> None:
    assert isinstance(_platform_from_env({"KVTIER_PLUGINS": "cpu"}), CPUPlatform)
    assert isinstance(_platform_from_env({"KVTIER_PLUGINS": "cpu,xpu"}), XPUPlatform)
    with pytest.raises(PlatformError, match="'xpu' is not installed"):
        _platform_from_env({"KVTIER_PLUGINS": "cpu", "KVTIER_PLATFORM": "xpu"})


def test_asking_for_xpu_without_one_is_a_clear_error(no_xpu: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlatformError, match=r"'xpu' was asked for .* not available"):
        _platform_from_env({"KVTIER_PLATFORM": "xpu"})


def test_cache_engine_picks_xpu_and_builds_its_mover(fake_xpu: pytest.MonkeyPatch) -> None:
    geometry = GEOMETRIES["LBHNC"]
    cfg = load_config(env={"KVTIER_DEVICE_STAGING_BUFFER": "false"}, overrides={"chunk_size": 16})
    # No pinned arena without a real device runtime: hand the engine its storage.
    storage = HostMemoryStorageManager(HostArena.create(1 << 16))
    engine = CacheEngine(cfg, geometry.layout, model="m", storage=storage)
    assert isinstance(engine.platform, XPUPlatform)
    engine.register_kv_caches(make_caches(geometry, torch.device("cpu")))
    assert isinstance(engine.mover, XPUPageMover)
    assert engine.mover.num_blocks == NUM_BLOCKS
    assert engine.mover.use_staging is False
    engine.close()


def test_no_pinned_memory_without_a_device(no_xpu: pytest.MonkeyPatch) -> None:
    platform = XPUPlatform()
    assert not platform.has_pinned_memory
    assert not platform.create_arena(4096).is_pinned
    platform.synchronize()  # nothing to wait for, and no error


@pytest.mark.xpu
@needs_xpu
def test_real_xpu_is_discovered_with_pinned_arena_and_streams() -> None:
    assert detect() == "kvtier.xpu.platform:XPUPlatform"
    platform = get_platform("xpu")
    assert isinstance(platform, XPUPlatform)
    assert platform.create_arena(1 << 20).is_pinned
    geometry = GEOMETRIES["LBHNC"]
    mover = platform.create_mover(make_caches(geometry, torch.device("xpu")), geometry.layout)
    assert mover.streams.is_async
    platform.synchronize()
