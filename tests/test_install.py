"""What ``pip install kvtier[xpu]`` brings in, and what importing kvtier loads.

The install tests resolve the checkout's packages with ``pip install --dry-run --report`` (pip
builds their metadata; nothing is installed). torch is constrained to the build already in
this environment's find-links (``torch==2.13.0``): it stands for "the torch for your hardware
is installed", since an unconstrained torch resolves to CUDA wheels here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"
PIP_TIMEOUT_S = 240


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def _resolve(tmp_path: Path, *targets: str) -> set[str]:
    """Distribution names pip would install for ``targets`` into an empty environment."""
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    report = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        # The packages' build backend (hatchling) from this environment, not an isolated build
        # environment per package and per resolution (most of these tests' time otherwise).
        "--no-build-isolation",
        "--report",
        str(report),
        "-c",
        str(constraints),
        *targets,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert proc.returncode == 0, f"pip could not resolve {targets}:\n{proc.stderr[-4000:]}"
    return {_name(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]}


def _cuda_or_engine(names: set[str]) -> set[str]:
    return {
        n
        for n in names
        if n in {"triton", "kvtier-cuda", "kvtier-vllm", "redis"}
        or n.startswith(("nvidia-", "vllm", "cuda-"))
    }


@pytest.mark.slow
@pytest.mark.timeout(PIP_TIMEOUT_S + 60)
def test_kvtier_xpu_installs_no_cuda_triton_or_vllm(tmp_path: Path) -> None:
    names = _resolve(
        tmp_path,
        "./packages/core",
        "./packages/storage",
        "./packages/xpu",
        "./packages/kvtier[xpu]",
    )
    assert {"kvtier", "kvtier-core", "kvtier-storage", "kvtier-xpu"} <= names
    assert _cuda_or_engine(names) == set(), sorted(names)


@pytest.mark.slow
@pytest.mark.timeout(PIP_TIMEOUT_S + 60)
def test_kvtier_cuda_does_pull_triton(tmp_path: Path) -> None:
    """The same check sees CUDA's dependencies when they are asked for."""
    names = _resolve(
        tmp_path,
        "./packages/core",
        "./packages/storage",
        "./packages/cuda",
        "./packages/kvtier[cuda]",
    )
    assert {"kvtier-cuda", "triton"} <= _cuda_or_engine(names)
    assert "kvtier-xpu" not in names


@pytest.mark.slow
@pytest.mark.timeout(PIP_TIMEOUT_S + 60)
def test_the_connector_installs_no_benchmark_or_demo_code(tmp_path: Path) -> None:
    """A serving deployment's packages hold only the library: benchmarks, the demo and their
    plotting and progress dependencies are kvtier-bench's."""
    names = _resolve(
        tmp_path, "./packages/core", "./packages/storage", "./packages/vllm-integration"
    )
    assert {"kvtier-core", "kvtier-storage", "kvtier-vllm"} <= names
    assert not names & {"kvtier-bench", "matplotlib", "rich"}, sorted(names)
    library = [
        p for p in (REPO / "packages").glob("*/src/kvtier/**/*.py") if "/bench/" not in str(p)
    ]
    assert library and not [p for p in library if p.stem.startswith(("bench", "demo"))]


_CHILD = """
import json, sys
import torch
import kvtier.core, kvtier.storage, kvtier.xpu
from kvtier.xpu import detect
detect()
print(json.dumps({
    "triton": "triton" in sys.modules,
    "vllm": sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")),
    "cuda_initialized": torch.cuda.is_initialized(),
    "xpu_initialized": torch.xpu.is_initialized(),
}))
"""


@pytest.mark.timeout(120)
def test_importing_kvtier_loads_no_triton_no_vllm_and_no_device() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=100, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "triton": False,
        "vllm": [],
        "cuda_initialized": False,
        "xpu_initialized": False,
    }
