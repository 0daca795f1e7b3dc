"""The host planner in C (``_hostplan.c``), compiled on first use, as Triton builds its launchers.

Nothing is compiled at install time: the first connector that needs it compiles the C source
with the machine's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) against the running
Python's headers (Triton needs both to launch a kernel, so a machine that runs kvtier-cuda has
them) into ``$KVTIER_CACHE_DIR/native`` (default ``~/.cache/kvtier/native``), named by a hash
of the source, the Python version and the platform; later processes load that file. The module
uses the Python C API only (no torch headers), so it is not tied to a torch version.

Where no compiler or headers are found, or the build fails, ``load()`` logs one warning (once per
process) and returns None: the connector then plans in Python (same pieces and runs, more host
time). The connector option ``native_planner=False`` skips it.
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
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvtier.cuda.geometry import CallShape
from kvtier.cuda.kernels import RUN_WORDS
from kvtier.cuda.memory import StagingRing, TableBuffer
from kvtier.cuda.plan import Copy, Piece

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
    cmd = [
        *cc.split(),
        "-O2",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        f"-I{include}",
        str(_SOURCE),
        "-o",
        tmp,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}"
            )
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
    """The compiled planner, or None (Python planning) when it cannot be built (logged once)."""
    try:
        return _import(build())
    except Exception as e:  # any failure means the Python path, never a failed transfer
        log.warning("kvtier-cuda: planning in Python (slower host path): %s", e)
        return None


def plan_group(
    native: Any,
    shape: CallShape,
    ring: StagingRing,
    transfers: Sequence[Any],
    lo: int,
    hi: int,
    table: TableBuffer,
    *,
    first_piece_bytes: int | None,
    last_piece_bytes: int | None,
) -> tuple[list[Piece], int, int] | None:
    """``plan.prepare`` + ``plan.plan`` of whole-chunk group ``transfers[lo:hi]`` in C: the slots
    and then the run table written into ``table``'s host buffer; returns the pieces, the slot
    count and the table's length in int64s, or None (nothing of the ring changed) for anything
    but the ordinary case, which the Python path then checks and plans."""
    if not ring.slot_ptrs or table.host is None:
        return None
    out = native.plan_group(
        transfers,
        lo,
        hi,
        shape.chunk_shapes,
        shape.layout.torch_dtype,
        torch.int64,
        shape.hd_bytes,
        shape.rows_per_obj,
        shape.total_slots,
        table.host_ptr,
        table.host.numel(),
        ring.slot_bytes,
        ring.slot_ptrs,
        ring.next_slot,
        table.dev_ptr,
        first_piece_bytes or 0,
        last_piece_bytes or 0,
    )
    if out is None:
        return None
    next_slot, tokens, runs, raw = out
    ring.next_slot = next_slot
    pieces = [
        Piece(
            start=start,
            stop=stop,
            max_tokens=max_tokens,
            slot=slot,
            max_rows=max_rows,
            cap=cap,
            nbytes=nbytes,
            copies=[Copy(ptr, 0, offset, n) for ptr, offset, n in copies],
        )
        for slot, start, stop, max_rows, max_tokens, cap, nbytes, copies in raw
    ]
    return pieces, tokens, tokens + RUN_WORDS * runs
