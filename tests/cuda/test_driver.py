"""The CUDA driver wrapper (kvtier.cuda._driver): selection, error reporting, strided copies, and
on a GPU that its events order streams."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import ON_GPU
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
    bad_2d = CudaDriver(_FakeLib({"cuMemcpy2DAsync_v2": 700}))  # type: ignore[arg-type]
    with pytest.raises(CUDADriverError, match="cuMemcpy2DAsync failed"):
        bad_2d.memcpy_2d(1, 64, 2, 32, 32, 4, 5, to_host=True)


def test_event_query_tells_ready_from_pending_and_raises_on_errors():
    assert CudaDriver(_FakeLib({})).event_query(1) is True  # type: ignore[arg-type]
    assert CudaDriver(_FakeLib({"cuEventQuery": 600})).event_query(1) is False  # type: ignore[arg-type]
    with pytest.raises(CUDADriverError, match="cuEventQuery"):
        CudaDriver(_FakeLib({"cuEventQuery": 700})).event_query(1)  # type: ignore[arg-type]


def test_no_driver_library_means_no_driver_path(monkeypatch):
    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(_driver.ctypes, "CDLL", missing)
    monkeypatch.setattr(_driver.ctypes, "PyDLL", missing)
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


def test_a_lane_on_a_cpu_device_copies_strided_rows_at_once():
    from kvtier.cuda.lane import Lane

    lane = Lane(torch.device("cpu"), 2, 64)
    src = torch.arange(4 * 32, dtype=torch.uint8)  # 4 rows of 32 bytes, packed
    dst = torch.zeros(4 * 48, dtype=torch.uint8)  # rows 48 bytes apart
    lane.copy_2d(dst.data_ptr(), 48, src.data_ptr(), 32, 32, 4, to_host=True)
    assert torch.equal(dst.view(4, 48)[:, :32], src.view(4, 32))
    assert not dst.view(4, 48)[:, 32:].any()


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
def test_strided_copies_between_device_and_pinned_host(device):
    drv = _driver.driver()
    assert drv is not None
    stream = torch.cuda.Stream()
    rows, width, host_pitch = 16, 4096, 3 * 4096
    dev = torch.randint(0, 256, (rows * width,), dtype=torch.uint8, device=device)
    host = torch.zeros(rows * host_pitch, dtype=torch.uint8, pin_memory=True)
    drv.memcpy_2d(
        host.data_ptr(),
        host_pitch,
        dev.data_ptr(),
        width,
        width,
        rows,
        stream.cuda_stream,
        to_host=True,
    )
    stream.synchronize()
    assert torch.equal(host.view(rows, host_pitch)[:, :width], dev.view(rows, width).cpu())
    back = torch.zeros_like(dev)
    drv.memcpy_2d(
        back.data_ptr(),
        width,
        host.data_ptr(),
        host_pitch,
        width,
        rows,
        stream.cuda_stream,
        to_host=False,
    )
    stream.synchronize()
    assert torch.equal(back, dev)
