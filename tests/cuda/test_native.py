"""The C host planner (``kvtier.cuda._native``, ``_hostplan.c``) against the Python one.

Host logic only (no kernel runs, no GPU): for random whole-chunk groups, ``_native.plan_group``
must write the same slots and run table into the table buffer and return the same pieces as
``plan.prepare`` + ``plan.plan``, and leave everything to the Python path (returning None, the
ring untouched) for every input that is not the ordinary case. A missing compiler means Python
planning, logged once.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SHAPE as TEST_SHAPE
from conftest import assert_store_then_load_like, make_caches, make_layout, random_slots
from kvtier.core.connector import TorchPagedConnector, Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.cuda import _native
from kvtier.cuda.connector import CUDAPagedConnector
from kvtier.cuda.geometry import CallShape
from kvtier.cuda.kernels import RUN_WORDS
from kvtier.cuda.memory import StagingRing, TableBuffer
from kvtier.cuda.plan import all_rows, plan, prepare

LAYOUT = KVLayout(2, 2, 8, "float16", 4, PagedLayout.FLASH_NHD)  # a row token: 32 bytes
BLOCKS = 64
TOTAL = BLOCKS * LAYOUT.block_size
DEV_PTR = 1 << 40  # where the table would sit on the device


@pytest.fixture(scope="module")
def native():  # type: ignore[no-untyped-def]
    try:
        return _native._import(_native.build())
    except RuntimeError as e:
        pytest.skip(f"no C toolchain here: {e}")


def _table(words: int) -> TableBuffer:
    table = TableBuffer(done=None)
    table.host = torch.full((words,), -7, dtype=torch.int64)
    table.host_np, table.host_ptr, table.dev_ptr = (
        table.host.numpy(),
        table.host.data_ptr(),
        DEV_PTR,
    )
    return table


def _setup(slot_bytes: int) -> tuple[CallShape, StagingRing]:
    ring = StagingRing(torch.device("cpu"), 3, slot_bytes, None)
    ring.ensure(slot_bytes)
    return CallShape.of(LAYOUT, BLOCKS), ring


def _transfers(
    lengths: list[int], arenas: list[int], gaps: list[bool], seed: int
) -> list[Transfer]:
    pools = [HostArena.create(1 << 18) for _ in range(max(arenas) + 1)]
    perm = torch.randperm(TOTAL, generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for n, a, gap in zip(lengths, arenas, gaps, strict=True):
        if gap:  # a hole in the arena between this object and the one before it
            assert pools[a].allocate(MemoryObjMeta((64,), torch.uint8, 1)) is not None
        obj = pools[a].allocate(MemoryObjMeta(LAYOUT.chunk_shape(n), torch.float16, n))
        assert obj is not None
        out.append(Transfer(obj, perm[at : at + n].clone()))
        at += n
    return out


def _python_plan(shape, ring, transfers, lo, table, first, last):  # type: ignore[no-untyped-def]
    prepared, _ = prepare(shape, transfers[lo:], first_index=lo, out=table.host)
    pieces, runs = plan(
        ring,
        prepared,
        all_rows(len(prepared), shape),
        store=True,
        slot_base=table.dev_ptr,
        first_piece_bytes=first,
        last_piece_bytes=last,
    )
    tokens = sum(p.num_tokens for p in prepared)
    return pieces, tokens, [x for run in runs for x in run]


def _key(piece):  # type: ignore[no-untyped-def]
    return (
        piece.slot,
        piece.start,
        piece.stop,
        piece.max_rows,
        piece.max_tokens,
        piece.cap,
        piece.nbytes,
        piece.prefill,
        [(c.host_ptr, c.slot_offset, c.nbytes) for c in piece.copies],
    )


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    arenas=st.lists(st.integers(0, 1), min_size=8, max_size=8),
    gaps=st.lists(st.booleans(), min_size=8, max_size=8),
    slot_rows=st.integers(1, 6),
    first=st.sampled_from([None, 1, 100, 400, 1000]),
    last=st.sampled_from([None, 1, 100, 400, 1000]),
    next_slot=st.integers(0, 2),
    lo=st.integers(0, 3),
)
def test_the_c_planner_writes_and_returns_what_the_python_planner_does(  # type: ignore[no-untyped-def]
    native, lengths, arenas, gaps, slot_rows, first, last, next_slot, lo
):
    lo = min(lo, len(lengths) - 1)
    transfers = _transfers(lengths, arenas[: len(lengths)], gaps[: len(lengths)], seed=len(lengths))
    shape, ring = _setup(slot_rows * max(lengths) * 32)
    prepare(shape, transfers)  # the Python path learns each length's shape (the C path reads them)
    ring.next_slot = next_slot
    py_table = _table(4096)
    py_pieces, tokens, py_runs = _python_plan(shape, ring, transfers, lo, py_table, first, last)
    py_next = ring.next_slot
    ring.next_slot = next_slot
    c_table = _table(4096)
    out = _native.plan_group(
        native,
        shape,
        ring,
        transfers,
        lo,
        len(transfers),
        c_table,
        first_piece_bytes=first,
        last_piece_bytes=last,
    )
    assert out is not None
    pieces, n_slots, numel = out
    assert n_slots == tokens and numel == tokens + len(py_runs)
    assert ring.next_slot == py_next
    assert [_key(p) for p in pieces] == [_key(p) for p in py_pieces]
    assert c_table.host is not None and py_table.host is not None
    assert torch.equal(c_table.host[:tokens], py_table.host[:tokens])
    assert c_table.host[tokens:numel].tolist() == py_runs
    assert (c_table.host[numel:] == -7).all()  # nothing written past the table


def _ordinary(native):  # type: ignore[no-untyped-def]
    transfers = _transfers([4, 4, 4], [0, 0, 0], [False, False, False], seed=1)
    shape, ring = _setup(4 * 4 * 32)
    prepare(shape, transfers)
    return shape, ring, transfers


def _plan_or_none(native, shape, ring, transfers, table=None):  # type: ignore[no-untyped-def]
    ring.next_slot = 1
    out = _native.plan_group(
        native,
        shape,
        ring,
        transfers,
        0,
        len(transfers),
        table or _table(4096),
        first_piece_bytes=None,
        last_piece_bytes=None,
    )
    if out is None:
        assert ring.next_slot == 1  # the ring is left as it was
    return out


def test_the_ordinary_case_is_planned_in_c(native):  # type: ignore[no-untyped-def]
    assert _plan_or_none(native, *_ordinary(native)) is not None


def test_objects_of_two_arenas_never_share_a_dma_even_when_adjacent_in_memory(native):  # type: ignore[no-untyped-def]
    """As in the Python planner, host ranges merge only within one arena's buffer."""
    meta = MemoryObjMeta(LAYOUT.chunk_shape(4), torch.float16, 4)
    buf = torch.empty(2 * meta.nbytes, dtype=torch.uint8)
    first, second = HostArena(buf[: meta.nbytes]), HostArena(buf[meta.nbytes :])
    objs = [first.allocate(meta), second.allocate(meta)]
    assert objs[0] is not None and objs[1] is not None
    assert objs[0].tensor.data_ptr() + meta.nbytes == objs[1].tensor.data_ptr()
    transfers = [Transfer(o, torch.arange(4 * k, 4 * k + 4)) for k, o in enumerate(objs)]  # type: ignore[arg-type]
    shape, ring = _setup(8 * meta.nbytes)
    prepare(shape, transfers)
    out = _plan_or_none(native, shape, ring, transfers)
    assert out is not None
    (piece,) = out[0]
    assert [(c.host_ptr, c.nbytes) for c in piece.copies] == [
        (o.tensor.data_ptr(), meta.nbytes)
        for o in objs  # type: ignore[union-attr]
    ]


@pytest.mark.parametrize(
    "spoil",
    [
        "minus_one",
        "out_of_range",
        "negative",
        "released",
        "wrong_dtype_slots",
        "strided_slots",
        "unknown_length",
        "wrong_object_dtype",
        "small_table",
        "row_over_slot",
        "no_slots_yet",
    ],
)
def test_anything_but_the_ordinary_case_is_left_to_the_python_path(native, spoil):  # type: ignore[no-untyped-def]
    shape, ring, transfers = _ordinary(native)
    table = None
    t = transfers[1]
    if spoil == "minus_one":
        t.slots[2] = -1
    elif spoil == "out_of_range":
        t.slots[0] = TOTAL
    elif spoil == "negative":
        t.slots[3] = -5
    elif spoil == "released":
        t.obj.release()
    elif spoil == "wrong_dtype_slots":
        transfers[1] = Transfer(t.obj, t.slots.to(torch.int32))
    elif spoil == "strided_slots":
        transfers[1] = Transfer(t.obj, torch.arange(8, dtype=torch.int64)[::2])
    elif spoil == "unknown_length":
        shape.chunk_shapes.clear()
    elif spoil == "wrong_object_dtype":
        arena = HostArena.create(1 << 16)
        obj = arena.allocate(MemoryObjMeta(LAYOUT.chunk_shape(4), torch.bfloat16, 4))
        assert obj is not None
        transfers[1] = Transfer(obj, t.slots)
    elif spoil == "small_table":
        table = _table(12 + RUN_WORDS)  # the slots fit, the runs do not
    elif spoil == "row_over_slot":
        ring.slot_bytes = 64
    elif spoil == "no_slots_yet":
        ring.release()
    assert _plan_or_none(native, shape, ring, transfers, table) is None


def test_no_compiler_means_python_planning_logged_once(monkeypatch, tmp_path, caplog):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    _native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.cuda._native"):
            assert _native.load() is None
            assert _native.load() is None
        warnings = [r for r in caplog.records if "planning in Python" in r.getMessage()]
        assert len(warnings) == 1 and "failed" in warnings[0].getMessage()
        assert not list((tmp_path / "native").glob("*"))  # no half-written module left behind
    finally:
        _native.load.cache_clear()


def test_a_build_is_reused_by_the_next_process(tmp_path, native):  # type: ignore[no-untyped-def]
    path = _native.build(tmp_path)
    mtime = path.stat().st_mtime_ns
    code = "import sys; from pathlib import Path; from kvtier.cuda import _native; print(_native.build(Path(sys.argv[1])))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert out == str(path) and path.stat().st_mtime_ns == mtime
    assert _native._import(path).plan_group is not None


def test_a_connector_whose_planner_cannot_be_built_plans_in_python_byte_for_byte(
    monkeypatch, tmp_path, device, arena
):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    _native.load.cache_clear()
    try:
        layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
        caches = make_caches(layout, device, seed=70)
        conn = CUDAPagedConnector(caches, layout)  # native_planner=True, but no build
        ref = TorchPagedConnector([c.clone() for c in caches], layout)
        lengths = [TEST_SHAPE.chunk] * 3
        slots = random_slots(TEST_SHAPE.blocks * TEST_SHAPE.block, lengths, seed=71, holes="none")
        assert_store_then_load_like(conn, ref, arena, layout, lengths, slots, slots, 72)
    finally:
        _native.load.cache_clear()
