"""The few CUDA driver calls the transfer pipeline issues per piece, through ctypes.

Why: a small model's 2 MiB chunk crosses PCIe in under 40 us, and torch's way of putting a copy
on a side stream costs more than that in host time (``set_stream`` twice, ~10 us each, plus
``Tensor.copy_`` dispatch, ~4 us). ``cuMemcpy*Async`` on an explicit stream handle costs about a
microsecond from Python and needs no stream switch; ``cuEventRecord``/``cuStreamWaitEvent`` the
same. The handles are the ones torch uses (a runtime ``cudaStream_t`` is a driver ``CUstream``),
so these calls order correctly with torch's own work.

``libcuda.so.1`` comes with the NVIDIA driver, so this adds no dependency and compiles nothing.
Set ``KVTIER_CUDA_DRIVER_API=0`` to use torch's stream switches and copies instead (slower,
same results); the connector also falls back to them when the library cannot be loaded.

Every call's result is checked: a failure raises ``CUDADriverError`` naming the call and the
driver's error name, never a silent skip.
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import c_int, c_size_t, c_uint, c_void_p
from typing import Any

from kvtier.cuda._env import switch

_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600
_CU_EVENT_DISABLE_TIMING = 0x2


class CUDADriverError(RuntimeError):
    """A CUDA driver call failed."""


class CudaDriver:
    """Thin wrappers over ``libcuda`` entry points (arguments are raw handles and addresses)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

        def fn(name: str, *argtypes: type) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
            f = getattr(lib, name)
            f.argtypes = list(argtypes)
            f.restype = c_int
            return f

        self._dtoh = fn("cuMemcpyDtoHAsync_v2", c_void_p, c_void_p, c_size_t, c_void_p)
        self._htod = fn("cuMemcpyHtoDAsync_v2", c_void_p, c_void_p, c_size_t, c_void_p)
        self._record = fn("cuEventRecord", c_void_p, c_void_p)
        self._wait = fn("cuStreamWaitEvent", c_void_p, c_void_p, c_uint)
        self._create = fn("cuEventCreate", ctypes.POINTER(c_void_p), c_uint)
        self._destroy = fn("cuEventDestroy_v2", c_void_p)
        self._query = fn("cuEventQuery", c_void_p)
        self._host_dev_ptr = fn("cuMemHostGetDevicePointer_v2", ctypes.POINTER(c_void_p), c_void_p, c_uint)
        self._sync = fn("cuEventSynchronize", c_void_p)
        self._ctx_get = fn("cuCtxGetCurrent", ctypes.POINTER(c_void_p))
        self._err_name = fn("cuGetErrorName", c_int, ctypes.POINTER(ctypes.c_char_p))
        self._launch = fn(
            "cuLaunchKernel", c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p,
            c_void_p,
        )
        try:  # CUDA 12.4+
            self._param_info: ctypes._CFuncPtr | None = fn(  # type: ignore[name-defined]
                "cuFuncGetParamInfo", c_void_p, c_size_t, ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t)
            )
        except AttributeError:
            self._param_info = None

    def entry_points(self) -> tuple[int, int, int, int, int]:
        """The addresses of cuEventRecord, cuStreamWaitEvent, cuMemcpyHtoDAsync_v2,
        cuMemcpyDtoHAsync_v2 and cuLaunchKernel, as this wrapper calls them (for the C op runner,
        see ``OpBatch``)."""
        fns = (self._record, self._wait, self._htod, self._dtoh, self._launch)
        addrs = tuple(ctypes.cast(f, c_void_p).value or 0 for f in fns)
        return addrs  # type: ignore[return-value]

    def _fail(self, call: str, res: int) -> CUDADriverError:
        name = ctypes.c_char_p()
        if self._err_name(res, ctypes.byref(name)) == _CUDA_SUCCESS and name.value:
            text = name.value.decode()
        else:
            text = f"error {res}"
        return CUDADriverError(f"{call} failed: {text}")

    def memcpy_dtoh(self, dst_host: int, src_device: int, nbytes: int, stream: int) -> None:
        res = self._dtoh(dst_host, src_device, nbytes, stream)
        if res:
            raise self._fail("cuMemcpyDtoHAsync", res)

    def memcpy_htod(self, dst_device: int, src_host: int, nbytes: int, stream: int) -> None:
        res = self._htod(dst_device, src_host, nbytes, stream)
        if res:
            raise self._fail("cuMemcpyHtoDAsync", res)

    def record(self, event: int, stream: int) -> None:
        res = self._record(event, stream)
        if res:
            raise self._fail("cuEventRecord", res)

    def wait(self, stream: int, event: int) -> None:
        res = self._wait(stream, event, 0)
        if res:
            raise self._fail("cuStreamWaitEvent", res)

    def host_device_pointer(self, host: int) -> int:
        """The address a kernel reads page-locked host memory ``host`` at (zero-copy)."""
        ptr = c_void_p()
        res = self._host_dev_ptr(ctypes.byref(ptr), host, 0)
        if res:
            raise self._fail("cuMemHostGetDevicePointer", res)
        assert ptr.value is not None
        return ptr.value

    def has_context(self) -> bool:
        """Whether this thread has a current context (the driver calls above need one)."""
        ctx = c_void_p()
        return self._ctx_get(ctypes.byref(ctx)) == _CUDA_SUCCESS and bool(ctx.value)

    def param_sizes(self, function: int, limit: int = 64) -> list[int] | None:
        """The byte size of each parameter of kernel ``function`` (a ``CUfunction``), in order;
        None where the driver cannot tell (before CUDA 12.4)."""
        if self._param_info is None:
            return None
        offset, size = c_size_t(), c_size_t()
        sizes: list[int] = []
        for i in range(limit):
            if self._param_info(function, i, ctypes.byref(offset), ctypes.byref(size)):
                break  # past the last parameter
            sizes.append(size.value)
        return sizes

    def launch(self, function: int, grid: tuple[int, int, int], block_x: int, shared: int, stream: int,
               params: int) -> None:
        """``cuLaunchKernel`` of ``function`` on ``stream``; ``params``: the address of its array
        of pointers to each parameter's value."""
        res = self._launch(function, grid[0], grid[1], grid[2], block_x, 1, 1, shared, stream, params, None)
        if res:
            raise self._fail("cuLaunchKernel", res)

    def event_create(self) -> int:
        handle = c_void_p()
        res = self._create(ctypes.byref(handle), _CU_EVENT_DISABLE_TIMING)
        if res:
            raise self._fail("cuEventCreate", res)
        assert handle.value is not None
        return handle.value

    def event_destroy(self, event: int) -> None:
        self._destroy(event)  # at teardown a failure has no one to report to

    def event_query(self, event: int) -> bool:
        res = self._query(event)
        if res == _CUDA_SUCCESS:
            return True
        if res == _CUDA_ERROR_NOT_READY:
            return False
        raise self._fail("cuEventQuery", res)

    def event_synchronize(self, event: int) -> None:
        res = self._sync(event)
        if res:
            raise self._fail("cuEventSynchronize", res)


class OpBatch:
    """The driver calls of one step of a transfer, collected and then issued by one C call.

    It has ``CudaDriver``'s enqueueing methods (``record``, ``wait``, ``memcpy_htod``,
    ``memcpy_dtoh``, ``launch``) plus ``set_value`` (a kernel parameter's value, written just
    before the launch after it); each appends a tuple of integers, and ``flush()`` hands the
    list to ``run_ops`` of the compiled host module (``kvtier/cuda/_hostplan.c``), which calls
    the same libcuda entry points in order (``CudaDriver.entry_points``). Nothing reaches the
    device before ``flush()``: the connector flushes before every point where another step, the
    host or another direction may look at what was enqueued (each yield and return of a step,
    and before any launch that goes through Triton).

    Why: from Python each driver call costs a ctypes call. On one H200 host (16-core Xeon) a
    record, a wait, a 4 KiB copy and a launch took 1.16, 1.44, 4.4 and 9.3 us through ctypes and
    0.28, 0.22, 2.1 and 4.4 us from C (``benchmarks/transfer_host_timeline.py`` shows the
    steps); a small model's store piece is about eight of them. Measured end to end
    (``benchmarks/transfer_ops_ab.py``) it saves 2-12% of a call's host time but no transfer
    time, so the connector uses it only with ``KVTIER_CUDA_NATIVE_OPS=1`` (see there).

    A failed call raises ``CUDADriverError`` naming it at ``flush()``; the calls after it in the
    batch are not issued (the caller then drains its lane, as for any error).
    """

    RECORD, WAIT, HTOD, DTOH, LAUNCH, SET = range(6)
    _NAMES = ("cuEventRecord", "cuStreamWaitEvent", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuLaunchKernel",
              "a launch parameter")

    __slots__ = ("_drv", "_run", "flushes", "ops")

    def __init__(self, drv: CudaDriver, run_ops: Any) -> None:
        self._drv = drv
        self._run = run_ops
        self.ops: list[tuple[int, ...]] = []
        self.flushes = 0  # batches issued (tests check the C path ran)

    def record(self, event: int, stream: int) -> None:
        self.ops.append((0, event, stream))

    def wait(self, stream: int, event: int) -> None:
        self.ops.append((1, stream, event))

    def memcpy_htod(self, dst_device: int, src_host: int, nbytes: int, stream: int) -> None:
        self.ops.append((2, dst_device, src_host, nbytes, stream))

    def memcpy_dtoh(self, dst_host: int, src_device: int, nbytes: int, stream: int) -> None:
        self.ops.append((3, dst_host, src_device, nbytes, stream))

    def launch(self, function: int, grid: tuple[int, int, int], block_x: int, shared: int, stream: int,
               params: int) -> None:
        self.ops.append((4, function, params, grid[0], grid[1], grid[2], block_x, shared, stream))

    def set_value(self, address: int, size: int, value: int) -> None:
        """Write ``value`` (``size`` 4 or 8 bytes) at ``address`` when the batch runs, in order."""
        self.ops.append((5, address, size, value))

    def flush(self) -> None:
        """Issue the collected calls in order (one C call); raises CUDADriverError on a failure."""
        ops = self.ops
        if not ops:
            return
        self.ops = []
        self.flushes += 1
        failed = self._run(ops)
        if failed is not None:
            index, res = failed
            raise self._drv._fail(self._NAMES[ops[index][0]], res)

    def discard(self) -> None:
        """Drop calls not issued yet (after an error: the caller drains what was issued)."""
        self.ops = []


class RawEvent:
    """A driver event (timing disabled) owned by Python: destroyed when collected.

    Destroying an event whose recorded work is still pending is allowed; the driver frees it
    once that work completes.
    """

    __slots__ = ("_drv", "handle")

    def __init__(self, drv: CudaDriver) -> None:
        self._drv = drv
        self.handle = drv.event_create()

    def record(self, stream: int) -> None:
        self._drv.record(self.handle, stream)

    def query(self) -> bool:
        return self._drv.event_query(self.handle)

    def synchronize(self) -> None:
        self._drv.event_synchronize(self.handle)

    def wait_on(self, stream: int) -> None:
        """Make ``stream`` (a raw handle) wait on the device for this event's recorded work."""
        self._drv.wait(stream, self.handle)

    def __del__(self) -> None:
        try:
            self._drv.event_destroy(self.handle)
        except Exception:  # interpreter teardown: the library may already be gone
            pass


@functools.cache
def driver() -> CudaDriver | None:
    """The driver wrapper, or None when disabled (``KVTIER_CUDA_DRIVER_API=0``) or unavailable."""
    if not switch("KVTIER_CUDA_DRIVER_API", default=True):
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        return CudaDriver(lib)
    except AttributeError:  # a driver too old for one of the entry points
        return None
