"""Run torch and vLLM CPU as on an AVX2-only x86 host (no AVX-512, no AVX-512 bf16, no AMX).

Not a test module: ``nox -s tests-avx2`` puts this directory on ``PYTHONPATH``, so every Python
process of the run (pytest, the engine runner's processes, vLLM's EngineCore and workers,
spawned or forked) imports it at start. It

- limits oneDNN and ATen's CPU dispatch to AVX2 code (``ONEDNN_MAX_CPU_ISA``,
  ``ATEN_CPU_CAPABILITY``);
- makes ``torch.cpu._is_avx512_supported`` and its AVX-512 bf16, VNNI and AMX siblings answer
  False, patched right after ``torch.cpu`` is imported: vLLM CPU then loads its ``_C_AVX2``
  kernels (``CpuPlatform.import_kernels``), picks the ``vec``/``vec16`` attention ISA and skips
  its AVX-512-only paths, as on an AVX2 host;
- gives the run its own torch.compile cache: code compiled in an unrestricted process and reused
  by an emulated one broke vLLM's compiled embedding mask under tensor parallelism; an AVX2 host
  never sees AVX-512 code.

What it cannot emulate is speed: an AVX2 host is 15-20x slower at prefill than this emulation
on an AVX-512 CPU (``docs/testing.md``).
"""

import importlib.abc
import importlib.machinery
import os
import sys
import tempfile

# Set outright: an outer value (a CI's shared compile cache, a wider ISA) would undo the emulation.
os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
os.environ["DNNL_MAX_CPU_ISA"] = "AVX2"
os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
    tempfile.gettempdir(), "torchinductor-avx2-emulation"
)

# Every one must exist: a torch that renamed one would quietly run part of the suite unemulated.
_ABSENT = (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_vnni_supported",  # AVX-512 VNNI
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _no(*_args: object) -> bool:
    return False


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[no-untyped-def]
        self._inner.exec_module(module)
        missing = [name for name in (*_ABSENT, "_init_amx") if not hasattr(module, name)]
        if missing:
            raise ImportError(f"AVX2 emulation: torch.cpu has no {missing}; update the list")
        for name in (*_ABSENT, "_init_amx"):
            setattr(module, name, _no)
        module.avx2_emulated = True


class _TorchCpuFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


sys.meta_path.insert(0, _TorchCpuFinder())
