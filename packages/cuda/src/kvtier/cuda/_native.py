"""The host planner in C (``_hostplan.c``), compiled on first use, as Triton builds its launchers.

Nothing is compiled at install time: the first connector that needs it compiles the C source
with the machine's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) against the running
Python's headers (Triton needs both to launch a kernel, so a machine that runs kvtier-cuda has
them) into ``$KVTIER_CACHE_DIR/native`` (default ``~/.cache/kvtier/native``), named by a hash
of the source, the Python version and the platform; later processes load that file. The module
uses the Python C API only (no torch headers), so it is not tied to a torch version.

Where no compiler or headers are found, or ``KVTIER_CUDA_NATIVE=0``, ``load()`` returns None and
the connector plans in Python (same pieces and runs, more host time), with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from kvtier.cuda._env import switch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_hostplan.c")
_NAME = "_kvtier_hostplan"
_COMPILE_TIMEOUT_S = 120


def cache_dir() -> Path:
    root = os.environ.get("KVTIER_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "kvtier") / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return cc
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def build(out_dir: Path | None = None) -> Path:
    """Compile the planner (or find it already compiled); the path of the extension module.
    Raises RuntimeError saying why it cannot."""
    source = _SOURCE.read_bytes()
    include = sysconfig.get_paths()["include"]
    key = hashlib.sha256(
        source + sys.version.encode() + sysconfig.get_platform().encode() + include.encode()
    ).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{_NAME}-{key}{_suffix()}"
    if target.exists():
        return target
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
    if not (Path(include) / "Python.h").exists():
        raise RuntimeError(f"the Python headers are not installed ({include}/Python.h is missing)")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile next to the target, then rename: a concurrent process sees the whole file or none.
    fd, tmp = tempfile.mkstemp(prefix=f".{_NAME}-", suffix=_suffix(), dir=out_dir)
    os.close(fd)
    cmd = [*cc.split(), "-O2", "-shared", "-fPIC", "-fvisibility=hidden", f"-I{include}", str(_SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"compiling the host planner took over {_COMPILE_TIMEOUT_S} s") from e
    except OSError as e:
        raise RuntimeError(f"cannot compile the host planner: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load() -> ModuleType | None:
    """The compiled planner, or None (Python planning) when disabled or it cannot be built."""
    if not switch("KVTIER_CUDA_NATIVE", default=True):
        return None
    try:
        return _import(build())
    except Exception as e:  # any failure means the Python path, never a failed transfer
        log.warning("kvtier-cuda: planning in Python (slower host path): %s", e)
        return None
