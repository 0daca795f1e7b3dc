"""Platform discovery through the kvtier.platforms entry-point group."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from kvtier.core import platform as platform_mod
from kvtier.core.errors import PlatformError
from kvtier.core.platform import (
    PLATFORM_GROUP,
    discover_platforms,
    get_platform,
    resolve_platform_class,
)
from kvtier.core.platform.cpu import CPUPlatform


def _with_plugins(monkeypatch: pytest.MonkeyPatch, **probes: str) -> None:
    """The built-in CPU platform and the fake plugins only: a real accelerator plugin available on
    the test machine (CUDA on a GPU box) would otherwise take part in the priority contest."""
    real = [ep for ep in platform_mod.entry_points(group=PLATFORM_GROUP) if ep.name == "cpu"]
    extra = [
        EntryPoint(name, f"fixtures.fake_plugins:{func}", PLATFORM_GROUP)
        for name, func in probes.items()
    ]

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        assert group == PLATFORM_GROUP
        return [*real, *extra]

    monkeypatch.setattr(platform_mod, "entry_points", fake_entry_points)


def test_cpu_is_always_there() -> None:
    assert discover_platforms()["cpu"] == "kvtier.core.platform.cpu:CPUPlatform"
    assert isinstance(get_platform("cpu"), CPUPlatform)


def test_highest_priority_wins_and_name_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_plugins(monkeypatch, acme="probe_acme", gone="probe_absent")
    assert resolve_platform_class().name == "acme"
    assert resolve_platform_class("cpu") is CPUPlatform
    assert resolve_platform_class(allow=["cpu"]) is CPUPlatform


def test_missing_and_unavailable_platforms_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _with_plugins(monkeypatch, gone="probe_absent")
    with pytest.raises(PlatformError, match="not installed"):
        resolve_platform_class("quantum")
    with pytest.raises(PlatformError, match="not available"):
        resolve_platform_class("gone")


def test_tie_at_the_top_asks_for_a_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_plugins(monkeypatch, acme="probe_acme", rival="probe_rival")
    with pytest.raises(PlatformError, match="KVTIER_PLATFORM"):
        resolve_platform_class()
    assert resolve_platform_class("rival").name == "rival"


def test_broken_plugin_is_skipped_not_fatal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _with_plugins(monkeypatch, boom="probe_broken")
    assert resolve_platform_class() is CPUPlatform
    assert "driver exploded" in caplog.text
    _with_plugins(monkeypatch, liar="probe_not_a_platform")
    with pytest.raises(PlatformError, match="not a Platform"):
        resolve_platform_class("liar")


_CHILD = """
import json, sys
import kvtier.core
from kvtier.core import CacheEngine, load_config, get_platform
import torch
print(json.dumps({"triton": "triton" in sys.modules, "vllm": "vllm" in sys.modules,
                  "redis": "redis" in sys.modules,
                  "cuda_initialized": torch.cuda.is_initialized()}))
"""


def test_importing_core_pulls_no_triton_vllm_or_cuda() -> None:
    res = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {
        "triton": False,
        "vllm": False,
        "redis": False,
        "cuda_initialized": False,
    }
