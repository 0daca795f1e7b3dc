"""The native issuer's driver calls (``kvtier/cuda/_issue.c``) on any machine with a C compiler,
through a driver table of Python callbacks that act at once on host memory standing in for the
device: the order of a call's parts on the two streams, the waits between them and between a
slot's parts, the copies split where host registrations begin or end, staging offsets and ids,
and failures. On a GPU the mover's own tests and the conformance suite run it against the real
driver."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from ctypes import CFUNCTYPE, c_int, c_size_t, c_uint, c_uint64, c_void_p

import pytest
import torch

from conftest import BLOCKS, chunk_objects, make_layout
from kvtier.core.memory import HostArena
from kvtier.core.platform.mover import Transfer
from kvtier.cuda import native

LAYOUT = make_layout()
ROW = LAYOUT.num_layers * LAYOUT.page_bytes


# -- issuing, through a driver table of callbacks ------------------------------------------------
_RECORD = CFUNCTYPE(c_int, c_void_p, c_void_p)
_WAIT = CFUNCTYPE(c_int, c_void_p, c_void_p, c_uint)
_LAUNCH = CFUNCTYPE(c_int, c_void_p, *([c_uint] * 7), c_void_p, c_void_p, c_void_p)
_DTOH = CFUNCTYPE(c_int, c_void_p, c_uint64, c_size_t, c_void_p)
_HTOD = CFUNCTYPE(c_int, c_uint64, c_void_p, c_size_t, c_void_p)
_SYNC = CFUNCTYPE(c_int, c_void_p)

STREAM, KSTREAM, CALLER, AFTER, IDS_FN, PAGES_FN = 0x51, 0x53, 0x52, 0xE1, 0xF1, 0xF2
FILLED, FREE = (0xA0, 0xA1, 0xA2), (0xB0, 0xB1, 0xB2)  # per slot
L = LAYOUT.num_layers


class FakeDriver:
    """Callbacks that log each call and act at once, in issue order, on host memory standing in
    for the device: copies copy, the ids kernel copies the ids, a gather fills each staged row
    with its block id's low byte, a scatter records each staged row under its block id
    (``cache``). ``fail_at``: the index of the copy that fails (CUDA_ERROR_INVALID_VALUE)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.log: list[tuple] = []
        self.copies = 0
        self.fail_at = fail_at
        self.store = True
        self.cache: dict[int, bytes] = {}

        def copy(kind: str, dst: int, src: int, n: int, stream: int) -> int:
            self.log.append((kind, stream, n))
            self.copies += 1
            if self.fail_at is not None and self.copies - 1 == self.fail_at:
                return 1
            ctypes.memmove(dst, src, n)
            return 0

        def value(p, i, t):  # type: ignore[no-untyped-def]
            return ctypes.cast(p[i], ctypes.POINTER(t))[0]

        def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):  # type: ignore[no-untyped-def]
            p = ctypes.cast(params, ctypes.POINTER(c_void_p))
            if fn == IDS_FN:
                n = value(p, 3, ctypes.c_int32)
                ctypes.memmove(value(p, 1, c_uint64), value(p, 0, c_uint64), 8 * n)
                self.log.append(("launch ids", stream, gx, n))
                return 0
            staging, ids = value(p, 1, c_uint64), value(p, 2, c_uint64)
            first, count = value(p, 5, ctypes.c_int32), gx // L
            self.log.append(("launch pages", stream, count, staging, first))
            blocks = (ctypes.c_int64 * (first + count)).from_address(ids)
            for j in range(count):
                b, row = blocks[first + j], staging + j * ROW
                if self.store:
                    ctypes.memset(row, b & 0xFF, ROW)
                else:
                    self.cache[b] = ctypes.string_at(row, ROW)
            return 0

        self.callbacks = [
            _RECORD(lambda e, s: self.log.append(("record", e, s)) or 0),
            _WAIT(lambda s, e, f: self.log.append(("wait", s, e)) or 0),
            _LAUNCH(launch),
            _DTOH(lambda d, s, n, st: copy("dtoh", d, s, n, st)),
            _HTOD(lambda d, s, n, st: copy("htod", d, s, n, st)),
            _SYNC(lambda e: self.log.append(("sync", e)) or 0),
            _SYNC(lambda s: self.log.append(("stream sync", s)) or 0),
        ]
        self.table = native.DriverTable(*[ctypes.cast(c, c_void_p).value for c in self.callbacks])


class Setup:
    """A lane struct over host memory standing in for the device: ``slots`` staging slots of
    ``slot_rows`` rows, id buffers, kernels whose parameter arrays are host values."""

    def __init__(
        self,
        drv: FakeDriver,
        cuts: tuple[int, ...] = (),
        *,
        slot_rows: int = 9,
        slots: int = 2,
        first_rows: int = 1,
    ) -> None:
        self.drv = drv
        self.slots = [torch.zeros(slot_rows * ROW, dtype=torch.uint8) for _ in range(slots)]
        self.slot_array = (c_uint64 * slots)(*[t.data_ptr() for t in self.slots])
        self.events = ((c_void_p * slots)(*FILLED[:slots]), (c_void_p * slots)(*FREE[:slots]))
        self.ids_host = torch.zeros(64, dtype=torch.int64)
        self.ids_dev = torch.zeros(64, dtype=torch.int64)
        self.values = [c_uint64() for _ in range(5)] + [ctypes.c_int32(), ctypes.c_int32()]
        self.params = (c_void_p * 7)(*[ctypes.addressof(v) for v in self.values])
        self.words = [c_uint64(), c_uint64(), ctypes.c_int32(), ctypes.c_int32()]
        self.wparams = (c_void_p * 4)(*[ctypes.addressof(v) for v in self.words])
        self.cuts = (c_uint64 * max(1, len(cuts)))(*cuts)
        s = self.struct = native.LaneStruct()
        s.drv, s.stream, s.kstream = ctypes.addressof(drv.table), STREAM, KSTREAM
        s.after = AFTER
        s.ids = native.KernelStruct(IDS_FN, ctypes.addressof(self.wparams), 128, 0)
        s.pages = native.KernelStruct(PAGES_FN, ctypes.addressof(self.params), 128, 0)
        s.grid_y, s.layers, s.words_block = 3, L, 1024
        s.slots = ctypes.addressof(self.slot_array)
        s.filled, s.free = (ctypes.addressof(e) for e in self.events)
        s.nslots, s.slot_rows, s.first_rows = slots, slot_rows, first_rows
        s.ids_host, s.ids_dev = self.ids_host.data_ptr(), self.ids_dev.data_ptr()
        s.row, s.num_blocks = ROW, BLOCKS
        s.cuts, s.ncuts = ctypes.addressof(self.cuts), len(cuts)

    def slot(self, i: int = 0) -> int:
        return self.slots[i].data_ptr()

    def call(self, lib: ctypes.CDLL, transfers: list[Transfer], *, store: bool) -> tuple[int, int]:
        self.drv.store = store
        arrays, failed = native.CallArrays(LAYOUT), c_int(0)
        arrays.read(transfers)
        res = lib.kvt_call(
            ctypes.addressof(self.struct), CALLER, store, arrays.addrs.address,
            arrays.counts.address, len(transfers), arrays.ids.address, arrays.runs.address,
            arrays.lohi.address, 1, ctypes.byref(failed),
        )  # fmt: skip
        return int(res), failed.value


@pytest.fixture
def objects() -> Iterator[list]:  # type: ignore[type-arg]
    arena = HostArena.create(32 * ROW)
    objs = chunk_objects(arena, LAYOUT, [3, 2, 4])
    for o in objs:
        o.tensor.copy_(torch.randint(0, 256, o.tensor.shape, dtype=torch.uint8))
    yield objs
    for o in objs:
        o.release()


def _transfers(objs: list, blocks: list[list[int]]) -> list[Transfer]:  # type: ignore[type-arg]
    return [Transfer(o, torch.tensor(b)) for o, b in zip(objs, blocks, strict=True)]


def _stored_right(objs: list, blocks: list[list[int]], before: list[torch.Tensor]) -> bool:  # type: ignore[type-arg]
    """Every kept block's host row holds the bytes its gather wrote; skipped rows are as before."""
    for o, bs, old in zip(objs, blocks, before, strict=True):
        for j, b in enumerate(bs):
            want = old[j] if b < 0 else torch.full_like(old[j], b & 0xFF)
            if not torch.equal(o.tensor[j], want):
                return False
    return True


def _loaded_right(drv: FakeDriver, objs: list, blocks: list[list[int]]) -> bool:  # type: ignore[type-arg]
    """Every kept block was scattered once, from its object's row; no other block was."""
    want = {
        b: bytes(o.tensor[j].numpy())
        for o, bs in zip(objs, blocks, strict=True)
        for j, b in enumerate(bs)
        if b >= 0
    }
    return drv.cache == want


def _cut_inside(objs: list) -> int:  # type: ignore[type-arg]
    """An address inside the second object's second row: a registration boundary there."""
    return objs[1].tensor.data_ptr() + ROW + ROW // 2


def test_a_store_gathers_a_small_first_part_then_the_rest_while_the_first_is_copied(
    lib, objects
) -> None:  # type: ignore[no-untyped-def]
    """The kernel stream waits for the caller's stream and copies the ids; the first sixteenth of
    the rows is gathered, then the rest, each copied out by the copy stream once gathered (one
    copy per run of rows back to back in host memory, split at the registration cut); the host
    waits for the last part."""
    drv = FakeDriver()
    setup = Setup(drv, (_cut_inside(objects),))
    blocks = [[5, 6, 7], [-1, 9], [1, 2, 3, 4]]
    before = [o.tensor.clone() for o in objects]
    assert setup.call(lib, _transfers(objects, blocks), store=True)[0] == 0
    slot = setup.slot()
    assert setup.ids_dev[:8].tolist() == [5, 6, 7, 9, 1, 2, 3, 4]
    # rows: object 1's three, then object 2's second and object 3's four (back to back)
    assert drv.log == [
        ("record", AFTER, CALLER), ("wait", KSTREAM, AFTER), ("launch ids", KSTREAM, 1, 8),
        ("launch pages", KSTREAM, 1, slot, 0), ("record", FILLED[0], KSTREAM),
        ("wait", STREAM, FILLED[0]), ("dtoh", STREAM, ROW), ("record", FREE[0], STREAM),
        ("launch pages", KSTREAM, 7, slot + ROW, 1), ("record", FILLED[0], KSTREAM),
        ("wait", STREAM, FILLED[0]), ("dtoh", STREAM, 2 * ROW),
        ("dtoh", STREAM, ROW // 2), ("dtoh", STREAM, ROW // 2 + 4 * ROW),
        ("record", FREE[0], STREAM), ("sync", FREE[0]),
    ]  # fmt: skip
    assert _stored_right(objects, blocks, before)


def test_a_load_copies_a_part_in_and_scatters_it_while_the_next_is_copied(lib, objects) -> None:  # type: ignore[no-untyped-def]
    """The ids go in first; the first fifteen sixteenths of the rows, then the rest, each
    scattered by the kernel stream (after the caller's stream) once it is in."""
    drv = FakeDriver()
    setup = Setup(drv)
    blocks = [[5, 6, -1], [8, 9], [1, 2, 3, 4]]
    assert setup.call(lib, _transfers(objects, blocks), store=False)[0] == 0
    slot = setup.slot()
    assert drv.log == [
        ("record", AFTER, CALLER), ("wait", KSTREAM, AFTER), ("htod", STREAM, 8 * 8),
        ("htod", STREAM, 2 * ROW), ("htod", STREAM, 5 * ROW), ("record", FILLED[0], STREAM),
        ("wait", KSTREAM, FILLED[0]), ("launch pages", KSTREAM, 7, slot, 0),
        ("record", FREE[0], KSTREAM),
        ("htod", STREAM, ROW), ("record", FILLED[0], STREAM),
        ("wait", KSTREAM, FILLED[0]), ("launch pages", KSTREAM, 1, slot + 7 * ROW, 7),
        ("record", FREE[0], KSTREAM), ("sync", FREE[0]),
    ]  # fmt: skip
    assert _loaded_right(drv, objects, blocks)


def _group_log(setup: Setup, parts: list, nslots: int, *, store: bool) -> list[tuple]:  # type: ignore[type-arg]
    """The driver calls of a call in ``parts`` (slot, first row, rows, copy sizes), in issue
    order: each part's kernel and copies with the waits between the streams, a slot's next part
    waiting for its previous one, the host's wait for the last part's slot."""
    log: list[tuple] = [("record", AFTER, CALLER), ("wait", KSTREAM, AFTER)]
    log.append(("launch ids", KSTREAM, 1, 8) if store else ("htod", STREAM, 8 * 8))
    for j, (slot, first, rows, sizes) in enumerate(parts):
        kernel = [("launch pages", KSTREAM, rows, setup.slot(slot), first)]
        if store:
            log += [("wait", KSTREAM, FREE[slot])] if j >= nslots else []
            log += [*kernel, ("record", FILLED[slot], KSTREAM), ("wait", STREAM, FILLED[slot])]
            log += [("dtoh", STREAM, n) for n in sizes] + [("record", FREE[slot], STREAM)]
        else:
            log += [("wait", STREAM, FREE[slot])] if j >= nslots else []
            log += [("htod", STREAM, n) for n in sizes]
            log += [("record", FILLED[slot], STREAM), ("wait", KSTREAM, FILLED[slot]), *kernel]
            log += [("record", FREE[slot], KSTREAM)]
    return [*log, ("sync", FREE[parts[-1][0]])]


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_a_call_larger_than_a_slot_goes_in_growing_groups_through_the_slots_in_turn(
    lib, objects, store
) -> None:  # type: ignore[no-untyped-def]
    """Groups of 1, then 4 rows (capped at a slot: 3), through slots 0, 1, 2, 0; copies split at
    the registration cut (inside row 3)."""
    drv = FakeDriver()
    setup = Setup(drv, (_cut_inside(objects),), slot_rows=3, slots=3, first_rows=1)
    blocks = [[5, 6, 7], [-1, 9], [1, 2, 3, 4]]
    before = [o.tensor.clone() for o in objects]
    assert setup.call(lib, _transfers(objects, blocks), store=store)[0] == 0
    parts = [
        (0, 0, 1, [ROW]), (1, 1, 3, [2 * ROW, ROW // 2, ROW // 2]), (2, 4, 3, [3 * ROW]),
        (0, 7, 1, [ROW]),
    ]  # fmt: skip
    assert drv.log == _group_log(setup, parts, 3, store=store)
    if store:
        assert _stored_right(objects, blocks, before)
    else:
        assert _loaded_right(drv, objects, blocks)


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_two_slots_of_one_row_take_turns_and_the_host_waits_for_the_last(
    lib, objects, store
) -> None:  # type: ignore[no-untyped-def]
    """Eight one-row groups through two slots: every group after the second waits for the one
    before it in its slot; the last is in slot 1."""
    drv = FakeDriver()
    setup = Setup(drv, slot_rows=1, slots=2, first_rows=4)
    blocks = [[5, 6, 7], [8, 9], [1, 2, 3]]
    before = [o.tensor.clone() for o in objects]
    assert (
        setup.call(lib, _transfers(objects, [*blocks[:2], [*blocks[2], -1]]), store=store)[0] == 0
    )
    parts = [(j % 2, j, 1, [ROW]) for j in range(8)]
    assert drv.log == _group_log(setup, parts, 2, store=store)
    if store:
        assert _stored_right(objects, [*blocks[:2], [*blocks[2], -1]], before)
    else:
        assert _loaded_right(drv, objects, [*blocks[:2], [*blocks[2], -1]])


def test_one_row_is_one_part(lib, objects) -> None:  # type: ignore[no-untyped-def]
    drv = FakeDriver()
    setup = Setup(drv)
    assert setup.call(lib, _transfers(objects[1:2], [[-1, 4]]), store=True)[0] == 0
    assert [e[0] for e in drv.log].count("launch pages") == 1


def test_a_failed_copy_waits_for_what_was_queued_and_names_the_call(lib, objects) -> None:  # type: ignore[no-untyped-def]
    drv = FakeDriver(fail_at=0)
    setup = Setup(drv, (_cut_inside(objects),))
    res, failed = setup.call(
        lib, _transfers(objects, [[5, 6, 7], [8, 9], [1, 2, 3, 4]]), store=True
    )
    assert (res, native._FAILED[failed]) == (1, "cuMemcpyDtoHAsync")
    assert drv.log[-2:] == [("stream sync", STREAM), ("stream sync", KSTREAM)]
    assert not any(e[0] == "sync" for e in drv.log)


def test_a_bad_id_issues_nothing(lib, objects) -> None:  # type: ignore[no-untyped-def]
    drv = FakeDriver()
    setup = Setup(drv)
    res, _ = setup.call(
        lib, _transfers(objects, [[5, 6, 7], [8, BLOCKS], [1, 2, 3, -3]]), store=True
    )
    assert res == -1 and drv.log == []
