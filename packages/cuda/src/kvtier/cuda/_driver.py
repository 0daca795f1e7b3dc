"""The few CUDA driver calls a page mover issues per group of pages, through ctypes.

Why: a small model's 2 MiB chunk crosses PCIe in under 40 us, and torch's way of putting a copy
on a side stream costs more than that in host time (``set_stream`` twice, ~10 us each, plus
``Tensor.copy_`` dispatch, ~4 us). ``cuMemcpy*Async`` on an explicit stream handle costs about a
microsecond from Python and needs no stream switch; ``cuEventRecord``/``cuStreamWaitEvent`` the
same. The handles are the ones torch uses (a runtime ``cudaStream_t`` is a driver ``CUstream``),
so these calls order correctly with torch's own work.

The calls that return at once (copies and events queued on a stream) keep the GIL: a store and
a load issued from two threads (vLLM's saver and forward threads) would otherwise hand the GIL
back and forth at every call, each hand-off a thread wake-up. Only ``cuEventSynchronize``, the
host's wait for the device, releases it.

``libcuda.so.1`` comes with the NVIDIA driver, so this adds no dependency and compiles nothing.
Every call's result is checked: a failure raises ``CUDADriverError`` naming the call and the
driver's error name, never a silent skip.
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import c_int, c_size_t, c_uint, c_void_p

_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600
_CU_EVENT_DISABLE_TIMING = 0x2
_CU_MEMORYTYPE_HOST = 1
_CU_MEMORYTYPE_DEVICE = 2


class CUDADriverError(RuntimeError):
    """A CUDA driver call failed."""


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D``: a strided copy (rows of ``WidthInBytes``, each side its own pitch)."""

    _fields_ = [
        ("srcXInBytes", c_size_t),
        ("srcY", c_size_t),
        ("srcMemoryType", c_int),
        ("srcHost", c_void_p),
        ("srcDevice", c_void_p),
        ("srcArray", c_void_p),
        ("srcPitch", c_size_t),
        ("dstXInBytes", c_size_t),
        ("dstY", c_size_t),
        ("dstMemoryType", c_int),
        ("dstHost", c_void_p),
        ("dstDevice", c_void_p),
        ("dstArray", c_void_p),
        ("dstPitch", c_size_t),
        ("WidthInBytes", c_size_t),
        ("Height", c_size_t),
    ]


class CudaDriver:
    """Thin wrappers over ``libcuda`` entry points (arguments are raw handles and addresses)."""

    def __init__(self, lib: ctypes.CDLL, waiting: ctypes.CDLL | None = None) -> None:
        """``lib``: the library loaded to keep the GIL during calls (``ctypes.PyDLL``);
        ``waiting``: loaded to release it (``ctypes.CDLL``), for the one call that waits."""

        def fn(name: str, *argtypes: type, of: ctypes.CDLL = lib) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
            f = getattr(of, name)
            f.argtypes = list(argtypes)
            f.restype = c_int
            return f

        self._dtoh = fn("cuMemcpyDtoHAsync_v2", c_void_p, c_void_p, c_size_t, c_void_p)
        self._htod = fn("cuMemcpyHtoDAsync_v2", c_void_p, c_void_p, c_size_t, c_void_p)
        self._2d = fn("cuMemcpy2DAsync_v2", ctypes.POINTER(_Memcpy2D), c_void_p)
        self._record = fn("cuEventRecord", c_void_p, c_void_p)
        self._wait = fn("cuStreamWaitEvent", c_void_p, c_void_p, c_uint)
        self._create = fn("cuEventCreate", ctypes.POINTER(c_void_p), c_uint)
        self._destroy = fn("cuEventDestroy_v2", c_void_p)
        self._query = fn("cuEventQuery", c_void_p)
        self._sync = fn("cuEventSynchronize", c_void_p, of=waiting or lib)
        self._ctx_get = fn("cuCtxGetCurrent", ctypes.POINTER(c_void_p))
        self._err_name = fn("cuGetErrorName", c_int, ctypes.POINTER(ctypes.c_char_p))
        self._launch = fn("cuLaunchKernel", c_void_p, *([c_uint] * 7), c_void_p, c_void_p, c_void_p)
        try:  # CUDA 12.4+
            self._param_info: ctypes._CFuncPtr | None = fn(  # type: ignore[name-defined]
                "cuFuncGetParamInfo",
                c_void_p,
                c_size_t,
                ctypes.POINTER(c_size_t),
                ctypes.POINTER(c_size_t),
            )
        except AttributeError:
            self._param_info = None

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

    def memcpy_2d(
        self,
        dst: int,
        dst_pitch: int,
        src: int,
        src_pitch: int,
        width: int,
        height: int,
        stream: int,
        *,
        to_host: bool,
    ) -> None:
        """``height`` rows of ``width`` bytes between device and host memory, each side with its
        own pitch (``to_host``: device ``src`` -> host ``dst``; else host ``src`` -> device)."""
        p = _Memcpy2D()
        p.srcMemoryType, p.dstMemoryType = (
            (_CU_MEMORYTYPE_DEVICE, _CU_MEMORYTYPE_HOST)
            if to_host
            else (_CU_MEMORYTYPE_HOST, _CU_MEMORYTYPE_DEVICE)
        )
        p.srcHost = p.srcDevice = src
        p.dstHost = p.dstDevice = dst
        p.srcPitch, p.dstPitch, p.WidthInBytes, p.Height = src_pitch, dst_pitch, width, height
        res = self._2d(ctypes.byref(p), stream)
        if res:
            raise self._fail("cuMemcpy2DAsync", res)

    def record(self, event: int, stream: int) -> None:
        res = self._record(event, stream)
        if res:
            raise self._fail("cuEventRecord", res)

    def wait(self, stream: int, event: int) -> None:
        res = self._wait(stream, event, 0)
        if res:
            raise self._fail("cuStreamWaitEvent", res)

    def launch(
        self,
        function: int,
        grid: tuple[int, int, int],
        block_x: int,
        shared: int,
        stream: int,
        params: int,
    ) -> None:
        """``cuLaunchKernel`` of ``function`` on ``stream``; ``params``: the address of its array
        of pointers to each parameter's value."""
        res = self._launch(function, *grid, block_x, 1, 1, shared, stream, params, None)
        if res:
            raise self._fail("cuLaunchKernel", res)

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

    def has_context(self) -> bool:
        """Whether this thread has a current context (the driver calls above need one)."""
        ctx = c_void_p()
        return self._ctx_get(ctypes.byref(ctx)) == _CUDA_SUCCESS and bool(ctx.value)

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
    """The driver wrapper, or None when ``libcuda.so.1`` cannot be loaded or is too old."""
    try:
        lib, waiting = ctypes.PyDLL("libcuda.so.1"), ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        return CudaDriver(lib, waiting)
    except AttributeError:  # a driver too old for one of the entry points
        return None
