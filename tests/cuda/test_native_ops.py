"""The C op runner (``run_ops`` in ``_hostplan.c``) and the Python side that fills it
(``kvtier.cuda._driver.OpBatch``, ``kvtier.cuda.kernels._Direct``).

On the CPU the driver is a fake: ctypes callbacks standing in for the five libcuda entry points,
each logging its arguments (a launch also reads its parameter values, as the driver would). The
runner must make exactly the calls the batch holds, in order, write each launch's parameter
values just before that launch, stop at the first failing call, and issue nothing for a
malformed batch. On a GPU the connector's transfers must be byte-exact with the runner on and
off, and must have gone through it.
"""

from __future__ import annotations

import ctypes
from ctypes import CFUNCTYPE, POINTER, c_int, c_size_t, c_uint, c_uint64, c_void_p

import pytest
import torch

from conftest import (
    SHAPE,
    Objects,
    assert_same_caches,
    assert_same_objects,
    assert_store_then_load_like,
    make_caches,
    make_layout,
    random_slots,
)
from kvtier.core.connector import TorchPagedConnector
from kvtier.core.layout import PagedLayout
from kvtier.cuda import _native
from kvtier.cuda._driver import CUDADriverError, OpBatch
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.kernels import _Direct

RECORD = CFUNCTYPE(c_int, c_void_p, c_void_p)
WAIT = CFUNCTYPE(c_int, c_void_p, c_void_p, c_uint)
COPY = CFUNCTYPE(c_int, c_uint64, c_uint64, c_size_t, c_void_p)
LAUNCH = CFUNCTYPE(c_int, c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                   POINTER(c_void_p), c_void_p)


class FakeDriver:
    """Five C-callable stand-ins for the libcuda entry points, logging every call. ``fail_at``:
    the call (counted from 0 over all kinds) that returns ``fail_code``."""

    def __init__(self, param_sizes: tuple[int, ...] = ()) -> None:
        self.log: list[tuple] = []
        self.fail_at = -1
        self.fail_code = 700
        self.param_sizes = param_sizes  # what a launch reads from its parameter array

        def result() -> int:
            n = len(self.log) - 1
            return self.fail_code if n == self.fail_at else 0

        def record(event, stream):  # type: ignore[no-untyped-def]
            self.log.append(("record", event or 0, stream or 0))
            return result()

        def wait(stream, event, flags):  # type: ignore[no-untyped-def]
            self.log.append(("wait", stream or 0, event or 0, flags))
            return result()

        def htod(dst, src, nbytes, stream):  # type: ignore[no-untyped-def]
            self.log.append(("htod", dst, src, nbytes, stream or 0))
            return result()

        def dtoh(dst, src, nbytes, stream):  # type: ignore[no-untyped-def]
            self.log.append(("dtoh", dst, src, nbytes, stream or 0))
            return result()

        def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):  # type: ignore[no-untyped-def]
            values = []
            for i, size in enumerate(self.param_sizes):
                addr = params[i]
                ctype = ctypes.c_int32 if size == 4 else ctypes.c_int64
                values.append(ctype.from_address(addr).value)
            self.log.append(("launch", fn or 0, (gx, gy, gz), (bx, by, bz), shared, stream or 0, tuple(values),
                             extra))
            return result()

        self._fns = (RECORD(record), WAIT(wait), COPY(htod), COPY(dtoh), LAUNCH(launch))

    def entry_points(self) -> tuple[int, ...]:
        return tuple(ctypes.cast(f, c_void_p).value for f in self._fns)  # type: ignore[misc]

    @staticmethod
    def _fail(call: str, res: int) -> CUDADriverError:
        return CUDADriverError(f"{call} failed: error {res}")


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The host module built into its own file: its driver entry points are its own, so the fakes
    set here never reach a connector's (which loads the cached build)."""
    try:
        return _native._import(_native.build(tmp_path_factory.mktemp("ops")))
    except RuntimeError as e:
        pytest.skip(f"no C toolchain here: {e}")


def _batch(isolated, fake: FakeDriver) -> OpBatch:  # type: ignore[no-untyped-def]
    isolated.set_driver(*fake.entry_points())
    return OpBatch(fake, isolated.run_ops)  # type: ignore[arg-type]


def test_the_runner_makes_the_batch_calls_in_order_with_each_launch_seeing_its_own_values(isolated):  # type: ignore[no-untyped-def]
    fake = FakeDriver(param_sizes=(8, 4))
    ops = _batch(isolated, fake)
    values = (c_uint64 * 1)(), (ctypes.c_int32 * 1)()
    params = (c_void_p * 2)(ctypes.addressof(values[0]), ctypes.addressof(values[1]))
    high = (1 << 64) - 4096  # an address above 2**63 passes through unsigned
    ops.record(11, 12)
    ops.wait(13, 14)
    ops.memcpy_htod(high, 0x1000, 4096, 15)
    ops.set_value(ctypes.addressof(values[0]), 8, 1 << 40)
    ops.set_value(ctypes.addressof(values[1]), 4, -5)
    ops.launch(77, (3, 2, 1), 128, 64, 16, ctypes.addressof(params))
    ops.set_value(ctypes.addressof(values[0]), 8, 123)
    ops.launch(77, (1, 1, 1), 128, 0, 17, ctypes.addressof(params))
    ops.memcpy_dtoh(0x2000, high, 1 << 20, 18)
    assert fake.log == []  # nothing before flush
    ops.flush()
    assert fake.log == [
        ("record", 11, 12),
        ("wait", 13, 14, 0),
        ("htod", high, 0x1000, 4096, 15),
        ("launch", 77, (3, 2, 1), (128, 1, 1), 64, 16, (1 << 40, -5), None),
        ("launch", 77, (1, 1, 1), (128, 1, 1), 0, 17, (123, -5), None),
        ("dtoh", 0x2000, high, 1 << 20, 18),
    ]
    assert ops.ops == [] and ops.flushes == 1
    ops.flush()  # empty: no call, no count
    assert len(fake.log) == 6 and ops.flushes == 1


def test_a_long_batch_runs_whole_and_in_order(isolated):  # type: ignore[no-untyped-def]
    fake = FakeDriver()
    ops = _batch(isolated, fake)
    for i in range(300):  # past the runner's on-stack batch
        ops.record(i + 1, 1000 + i)
    ops.flush()
    assert fake.log == [("record", i + 1, 1000 + i) for i in range(300)]


def test_a_failing_call_stops_the_batch_and_raises_naming_it(isolated):  # type: ignore[no-untyped-def]
    fake = FakeDriver()
    ops = _batch(isolated, fake)
    fake.fail_at = 2
    ops.record(1, 2)
    ops.wait(3, 4)
    ops.memcpy_dtoh(5, 6, 7, 8)
    ops.record(9, 10)
    with pytest.raises(CUDADriverError, match="cuMemcpyDtoHAsync failed: error 700"):
        ops.flush()
    assert [c[0] for c in fake.log] == ["record", "wait", "dtoh"]  # nothing after the failure
    assert ops.ops == []
    assert isolated.run_ops([(0, 1, 2), (0, 3, 4)]) is None  # the next batch runs normally
    fake.fail_at = len(fake.log)
    assert isolated.run_ops([(1, 5, 6)]) == (0, 700)


@pytest.mark.parametrize(
    "bad",
    [
        [(0, 1, 2), (0, 1)],  # too short for its kind
        [(0, 1, 2), (9, 1, 2)],  # no such kind
        [(0, 1, 2), [0, 1, 2]],  # not a tuple
        [(0, 1, 2), (5, 1000, 2, 7)],  # a 2-byte value
        [(0, 1, 2), (5, 0, 8, 7)],  # a value written at address 0
        [(0, 1, 2), (0, "x", 2)],  # not an int
        [(0, 1, 2), (0, -(1 << 70), 2)],  # too wide
    ],
)
def test_a_malformed_batch_issues_nothing(isolated, bad):  # type: ignore[no-untyped-def]
    fake = FakeDriver()
    isolated.set_driver(*fake.entry_points())
    with pytest.raises((TypeError, ValueError, OverflowError)):
        isolated.run_ops(bad)
    assert fake.log == []


def test_set_driver_refuses_a_null_entry_point(isolated):  # type: ignore[no-untyped-def]
    fake = FakeDriver()
    with pytest.raises(ValueError, match="non-null"):
        isolated.set_driver(*fake.entry_points()[:4], 0)


def test_a_direct_launcher_appends_its_values_and_launch_to_a_batch(isolated):  # type: ignore[no-untyped-def]
    """``_Direct`` with ``ops``: the same launch it would make through ctypes, through the batch
    (its parameter array is the one the driver reads)."""
    fake = FakeDriver(param_sizes=(8, 8, 4))
    ops = _batch(isolated, fake)
    direct = _Direct(fake, 99, 128, 256, [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32])
    direct((4, 1, 1), 21, (0x7000, 0x8000, 4096), ops)
    bound = direct.bound((0, 0x9000, 17))
    bound.launch_first((2, 3, 4), 22, 0xA000, ops)
    bound.launch_first((5, 6, 7), 23, 0xB000, ops)  # its own value, though the same parameter
    assert direct.values[0].value == 0 and bound.values[0].value == 0  # written when run, not now
    ops.flush()
    assert fake.log == [
        ("launch", 99, (4, 1, 1), (128, 1, 1), 256, 21, (0x7000, 0x8000, 4096), None),
        ("launch", 99, (2, 3, 4), (128, 1, 1), 256, 22, (0xA000, 0x9000, 17), None),
        ("launch", 99, (5, 6, 7), (128, 1, 1), 256, 23, (0xB000, 0x9000, 17), None),
    ]


def test_a_gpu_connector_issues_through_the_runner_byte_for_byte(device, arena):  # type: ignore[no-untyped-def]
    """With the runner on (``KVTIER_CUDA_NATIVE_OPS=1``; it needs the host module) and off,
    stores, loads and both at once move the bytes core's reference connector moves; with it on
    they went through it."""
    if device.type != "cuda":
        pytest.skip("the op runner issues driver calls, which needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=70)
    conn = CUDAPagedConnector(caches, layout)
    if conn._store_lane.ops is None:
        pytest.skip("no C toolchain: the connector issues through ctypes")
    ref = TorchPagedConnector([c.clone() for c in caches], layout)
    total = SHAPE.blocks * SHAPE.block
    lengths = [SHAPE.chunk // 4] * 4
    for native_ops, seed in ((True, 71), (False, 72), (True, 73)):
        conn._native_ops = native_ops
        before = conn._store_lane.ops.flushes + conn._load_lane.ops.flushes  # type: ignore[union-attr]
        # Disjoint: the store of store_and_load_async reads what its load does not write.
        both = random_slots(total, lengths * 2, seed=seed, holes="none")
        slots, load_slots = both[: len(lengths)], both[len(lengths) :]
        made = assert_store_then_load_like(conn, ref, arena, layout, lengths, slots, load_slots, seed)
        out, out_ref = Objects(arena, layout, lengths, seed + 20), Objects(arena, layout, lengths, seed + 20)
        back, back_ref = Objects(arena, layout, lengths, seed + 30), Objects(arena, layout, lengths, seed + 30)
        s, ld = conn.store_and_load_async(out.transfers(slots), back.transfers(load_slots))
        s.wait()
        ld.wait()
        ref.store(out_ref.transfers(slots))
        ref.load(back_ref.transfers(load_slots))
        assert_same_objects(out, out_ref)
        assert_same_caches(conn, ref)
        after = conn._store_lane.ops.flushes + conn._load_lane.ops.flushes  # type: ignore[union-attr]
        assert (after > before) == native_ops
        for objs in (*made, out, out_ref, back, back_ref):
            objs.release()
