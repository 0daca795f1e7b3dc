"""FastKernel: launching a kept Triton kernel through ``cuLaunchKernel`` (ctypes).

On CPU a fake compiled kernel and a fake driver check what ``build`` accepts and what a launch
hands the driver: the parameter pointers must point at exactly the non-constexpr arguments, in
order, at the sizes the driver reports. On a GPU the real kernels launch through it (every
``dma`` test, against the torch reference) and one test here checks it is actually used.
"""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

import pytest
import torch

from kvtier.cuda.kernels import LAUNCHES, FastKernel

SIG = {"table": "*i64", "bases": "*i64", "total": "i32", "bs": "i32", "stride": "i64", "HD": "constexpr"}


class FakeDriver:
    def __init__(self, sizes: list[int] | None) -> None:
        self.sizes = sizes
        self.launches: list[tuple] = []

    def param_sizes(self, function: int) -> list[int] | None:
        return self.sizes

    def launch_kernel(self, function, grid, block_x, shared, stream, params) -> None:
        n = len(self.sizes or [])
        ptrs = (ctypes.c_void_p * n).from_address(params)
        values = [ctypes.string_at(ptrs[i], size) for i, size in enumerate(self.sizes or [])]
        self.launches.append((function, grid, block_x, shared, stream, values))


def fake_ck(signature=SIG, **metadata) -> SimpleNamespace:
    md = {"num_warps": 4, "shared": 1024, "num_ctas": 1, "global_scratch_size": 0, "profile_scratch_size": 0,
          "launch_cooperative_grid": False, "launch_pdl": False, "cluster_dims": (1, 1, 1)}
    md.update(metadata)
    return SimpleNamespace(metadata=SimpleNamespace(**md), src=SimpleNamespace(signature=signature),
                           function=0xF00D)


OWN = [8, 8, 4, 4, 8]
NO_HOOKS = (None, None)


@pytest.mark.parametrize("scratch", [0, 1, 2])
def test_launch_packs_the_non_constexpr_arguments_in_order(scratch):
    drv = FakeDriver(OWN + [8] * scratch)
    fk = FastKernel.build(fake_ck(), drv, NO_HOOKS)
    assert fk is not None
    table, bases = 0x7F00_0000_1230, 0x7F00_0000_4560
    fk((3, 5, 7), 0xABC, (table, bases, 4096, 16, 1 << 33, 64))
    (function, grid, block_x, shared, stream, values), = drv.launches
    assert (function, grid, block_x, shared, stream) == (0xF00D, (3, 5, 7), 128, 1024, 0xABC)
    assert values[:5] == [
        struct.pack("<Q", table), struct.pack("<Q", bases), struct.pack("<i", 4096), struct.pack("<i", 16),
        struct.pack("<q", 1 << 33),
    ]
    assert values[5:] == [bytes(8)] * scratch  # scratch pointers are null


def test_buffer_is_reused_and_rewritten_per_launch():
    drv = FakeDriver(OWN)
    fk = FastKernel.build(fake_ck(), drv, NO_HOOKS)
    assert fk is not None
    fk((1, 1, 1), 1, (0x10, 0x20, 1, 2, 3, 0))
    fk((1, 1, 1), 1, (0x30, 0x20, -5, 2, 3, 0))
    assert drv.launches[0][5][0] == struct.pack("<Q", 0x10)
    assert drv.launches[1][5][0] == struct.pack("<Q", 0x30)
    assert drv.launches[1][5][2] == struct.pack("<i", -5)


def test_an_i32_argument_out_of_range_raises_rather_than_truncates():
    fk = FastKernel.build(fake_ck(), FakeDriver(OWN), NO_HOOKS)
    assert fk is not None
    with pytest.raises(struct.error):
        fk((1, 1, 1), 1, (0x10, 0x20, 1 << 31, 2, 3, 0))


@pytest.mark.parametrize(
    ("ck", "sizes", "hooks"),
    [
        pytest.param(fake_ck(), None, NO_HOOKS, id="driver-cannot-tell-the-layout"),
        pytest.param(fake_ck(), [8, 8, 4, 4], NO_HOOKS, id="fewer-params-than-arguments"),
        pytest.param(fake_ck(), [*OWN, 8, 8, 8], NO_HOOKS, id="three-trailing-params"),
        pytest.param(fake_ck(), [8, 8, 8, 4, 8], NO_HOOKS, id="size-mismatch"),
        pytest.param(fake_ck(), [*OWN, 4], NO_HOOKS, id="trailing-param-not-a-pointer"),
        pytest.param(fake_ck(), OWN, (print, None), id="launch-hook-installed"),
        pytest.param(fake_ck(global_scratch_size=64), OWN, NO_HOOKS, id="needs-scratch"),
        pytest.param(fake_ck(profile_scratch_size=64), OWN, NO_HOOKS, id="needs-profile-scratch"),
        pytest.param(fake_ck(num_ctas=2), OWN, NO_HOOKS, id="clusters"),
        pytest.param(fake_ck(launch_pdl=True), OWN, NO_HOOKS, id="pdl"),
        pytest.param(fake_ck(launch_cooperative_grid=True), OWN, NO_HOOKS, id="cooperative"),
        pytest.param(fake_ck(cluster_dims=(2, 1, 1)), OWN, NO_HOOKS, id="cluster-dims"),
        pytest.param(fake_ck({**SIG, "x": "fp32"}), [*OWN, 4], NO_HOOKS, id="float-argument"),
        pytest.param(fake_ck({**SIG, "t": ("i32", "i32")}), OWN, NO_HOOKS, id="tuple-argument"),
        pytest.param(SimpleNamespace(metadata=None, src=None, function=0), OWN, NO_HOOKS, id="not-a-kernel"),
    ],
)
def test_anything_not_checked_keeps_tritons_launcher(ck, sizes, hooks):
    assert FastKernel.build(ck, FakeDriver(sizes), hooks) is None


def test_no_driver_or_switched_off_keeps_tritons_launcher(monkeypatch):
    assert FastKernel.build(fake_ck(), None, NO_HOOKS) is None
    monkeypatch.setenv("KVTIER_CUDA_FAST_LAUNCH", "0")
    assert FastKernel.build(fake_ck(), FakeDriver(OWN), NO_HOOKS) is None


def test_fast_launch_is_used_and_copies_exactly_on_gpu(device):
    """On a GPU the kept copy_words kernel gets a FastKernel, and launching through it copies
    exactly (the dma-mode connector tests run the paged kernels through it too, against the
    torch reference)."""
    if device.type != "cuda":
        pytest.skip("cuLaunchKernel needs a CUDA device")
    from kvtier.cuda._driver import driver

    drv = driver()
    if drv is None or drv.param_sizes(0) is None:
        pytest.skip("this driver cannot report kernel parameter layouts (cuFuncGetParamInfo, CUDA 12.4+)")
    n = 4096
    src = (torch.arange(n, dtype=torch.int64) * 3 + 1).pin_memory()
    stream = torch.cuda.Stream(device)
    dst = torch.zeros(n, dtype=torch.int64, device=device)
    for _ in range(2):  # the first launch compiles and keeps the kernel; the second goes fast
        LAUNCHES.copy_words(src, drv.host_device_pointer(src.data_ptr()), dst, n, stream=stream)
    stream.synchronize()
    keys = [k for k in LAUNCHES.fast if k and k[0] == "copy_words"]
    assert keys, "the kept copy_words kernel did not get a FastKernel on this GPU"
    assert torch.equal(dst.cpu(), src)
