"""The CUDA driver wrapper (kvtier.cuda._driver): selection, error reporting, and on a GPU that
the connector's repeated launches go through the kept kernel."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import ON_GPU, make_caches, make_layout
from kvtier.core.layout import PagedLayout
from kvtier.cuda import _driver
from kvtier.cuda._driver import CudaDriver, CUDADriverError


class _FakeCall:
    """Stands in for one ctypes function of a library without libcuda: returns a fixed code."""

    def __init__(self, name: str, codes: dict[str, int]) -> None:
        self.name, self.codes = name, codes

    def __call__(self, *args):
        if self.name == "cuGetErrorName":
            code, out = args
            text = {700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}.get(code)
            if text is None:
                return 1
            ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = text
            return 0
        return self.codes.get(self.name, 0)


class _FakeLib:
    def __init__(self, codes: dict[str, int]) -> None:
        self.codes = codes

    def __getattr__(self, name: str) -> _FakeCall:
        call = _FakeCall(name, self.codes)
        setattr(self, name, call)
        return call


def test_failed_driver_calls_raise_naming_the_call_and_the_error():
    drv = CudaDriver(_FakeLib({"cuMemcpyDtoHAsync_v2": 700, "cuStreamWaitEvent": 999}))  # type: ignore[arg-type]
    with pytest.raises(
        CUDADriverError, match="cuMemcpyDtoHAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS"
    ):
        drv.memcpy_dtoh(1, 2, 3, 4)
    with pytest.raises(CUDADriverError, match="cuStreamWaitEvent failed: error 999"):
        drv.wait(1, 2)
    drv.memcpy_htod(1, 2, 3, 4)  # success returns quietly


def test_event_query_tells_ready_from_pending_and_raises_on_errors():
    assert CudaDriver(_FakeLib({})).event_query(1) is True  # type: ignore[arg-type]
    assert CudaDriver(_FakeLib({"cuEventQuery": 600})).event_query(1) is False  # type: ignore[arg-type]
    with pytest.raises(CUDADriverError, match="cuEventQuery"):
        CudaDriver(_FakeLib({"cuEventQuery": 700})).event_query(1)  # type: ignore[arg-type]


def test_no_driver_library_means_no_driver_path(monkeypatch):
    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(_driver.ctypes, "CDLL", missing)
    _driver.driver.cache_clear()
    try:
        assert _driver.driver() is None
    finally:
        _driver.driver.cache_clear()


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
def test_raw_events_order_streams_and_report_completion(device):
    drv = _driver.driver()
    assert drv is not None
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device=device)
    ev = _driver.RawEvent(drv)
    with torch.cuda.stream(a):
        torch.cuda._sleep(50_000_000)
        x.fill_(1.0)
    ev.record(a.cuda_stream)
    assert ev.query() is False  # the sleep is still running
    ev.wait_on(b.cuda_stream)
    with torch.cuda.stream(b):
        y = x * 2  # must see the fill
    ev.synchronize()
    assert ev.query() is True
    b.synchronize()
    assert torch.all(y == 2.0)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
def test_repeated_dma_calls_launch_through_the_kept_compiled_kernel(device, arena):
    from conftest import SHAPE, Objects, as_bytes, random_slots
    from kvtier.core.connector import TorchPagedConnector
    from kvtier.cuda.connector import CUDAPagedConnector
    from kvtier.cuda.kernels import LAUNCHES

    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=3)
    conn = CUDAPagedConnector(caches, layout)
    ref = TorchPagedConnector([c.clone() for c in caches], layout)
    lengths = [SHAPE.chunk]
    slots = random_slots(SHAPE.blocks * SHAPE.block, lengths, seed=4, holes="none")
    for round_ in range(3):  # the first call compiles and keeps; the later ones reuse it
        mine, theirs = (
            Objects(arena, layout, lengths, 5 + round_),
            Objects(arena, layout, lengths, 5 + round_),
        )
        conn.store(mine.transfers(slots))
        ref.store(theirs.transfers(slots))
        assert all(torch.equal(a, b) for a, b in zip(mine.bytes(), theirs.bytes(), strict=True))
        fresh = Objects(arena, layout, lengths, 9 + round_)
        conn.load(fresh.transfers(slots))
        ref.load(fresh.transfers(slots))
        torch.cuda.synchronize()
        assert all(
            torch.equal(as_bytes(a), as_bytes(b))
            for a, b in zip(conn.kv_caches, ref.kv_caches, strict=True)
        )
    # ... and from then on with cuLaunchKernel (the driver reports each parameter's size).
    assert LAUNCHES.usable is True and LAUNCHES.direct


@pytest.mark.parametrize(
    ("sizes", "runtime", "expected"),
    [
        (
            [8, 8, 4, 4, 4, 4],
            (1 << 40, 1 << 41, 4096, 16, 2048, 128),
            ["u64", "u64", "i32", "i32", "i32", "i32"],
        ),
        (
            [8, 8, 4, 8, 8],
            (1 << 40, 1 << 41, 64, 1 << 33),
            ["u64", "u64", "i32", "i64", "u64"],
        ),  # + a scratch pointer
        ([8, 8, 4, 8, 8], (1, 2, 3), ["u64", "u64", "i32", "u64", "u64"]),  # + two scratch pointers
        (
            [8, 8, 4, 4, 4],
            (1 << 40, 1 << 41, 4096, 1, 2048, 128),
            None,
        ),  # a 1 may be passed as a constant
        (
            [8, 8, 4, 4, 4, 4],
            (1 << 40, 1 << 41, 4096, 1, 2048, 128),
            None,
        ),  # ... even when the count fits
        ([8, 8, 4, 4, 8, 8, 8], (1, 2, 3, 4), None),  # three extra parameters: an unknown layout
        ([8, 4, 4], (1 << 40, 1 << 41, 64), None),  # a pointer that is not 8 bytes
        ([8, 8, 4], (1 << 40, 1 << 41, 1 << 33), None),  # a value too wide for its parameter
        ([8, 8, 4, 4], (1 << 40, 1 << 41, 64), None),  # a 4-byte extra is no scratch pointer
        (None, (1 << 40, 1 << 41, 64), None),  # the driver cannot tell (before CUDA 12.4)
    ],
)
def test_a_kernel_is_launched_directly_only_where_its_parameter_layout_is_certain(
    sizes, runtime, expected
):
    from kvtier.cuda.kernels import param_types

    names = {ctypes.c_uint64: "u64", ctypes.c_int32: "i32", ctypes.c_int64: "i64"}
    got = param_types(sizes, runtime, pointers=2)
    assert (None if got is None else [names[t] for t in got]) == expected
