"""The C host planner (``kvtier.cuda._native``, ``_hostplan.c``) against the Python one.

Host logic only (no kernel runs, no GPU): for random whole-chunk groups, ``_native_plan`` must
write the same slots and run table into the table buffer and return the same pieces as
``_prepare`` + ``_plan``, and leave everything to the Python path (returning None, the lane
untouched) for every input that is not the ordinary case.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import (
    SHAPE,
    Objects,
    assert_store_then_load_like,
    make_caches,
    make_layout,
    random_slots,
)
from kvtier.core.connector import TorchPagedConnector, Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.cuda import _native
from kvtier.cuda.connector import CUDAPagedConnector, _TableSlot
from kvtier.cuda.kernels import RUN_WORDS

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


def _ring(words: int) -> _TableSlot:
    host = torch.full((words,), -7, dtype=torch.int64)
    return _TableSlot(done=None, host=host, host_np=host.numpy(), host_ptr=host.data_ptr(), dev_ptr=DEV_PTR)


def _connector(native, slot_bytes: int) -> CUDAPagedConnector:  # type: ignore[no-untyped-def]
    caches = [torch.zeros(LAYOUT.expected_cache_shape(BLOCKS), dtype=torch.float16) for _ in range(2)]
    conn = CUDAPagedConnector(caches, LAYOUT, staging_slots=3, staging_slot_bytes=slot_bytes)
    conn._native = native
    for lane in (conn._store_lane, conn._load_lane):
        lane.ensure_slots(slot_bytes)
    return conn


def _transfers(lengths: list[int], arenas: list[int], gaps: list[bool], seed: int) -> list[Transfer]:
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


def _python_plan(conn, lane, transfers, lo, hi, ring, first, last):  # type: ignore[no-untyped-def]
    prepared, _ = conn._prepare(transfers[lo:hi], first_index=lo, slot_out=ring)
    with lane.lock:
        pieces, runs = conn._plan(
            lane, prepared, conn._all_rows(len(prepared)), store=True, slot_base=ring.dev_ptr,
            first_piece_bytes=first, last_piece_bytes=last,
        )
    tokens = sum(p.num_tokens for p in prepared)
    return pieces, tokens, [x for run in runs for x in run]


def _key(piece):  # type: ignore[no-untyped-def]
    return (piece.slot, piece.start, piece.stop, piece.max_rows, piece.max_tokens, piece.cap, piece.nbytes,
            piece.prefill, [(c.host_ptr, c.slot_offset, c.nbytes) for c in piece.copies])


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
    conn = _connector(native, slot_rows * max(lengths) * 32)
    conn._prepare(transfers)  # the Python path learns each length's shape (the C path reads them)
    lane = conn._store_lane
    words = 4096
    lane.next_slot = next_slot
    py_ring = _ring(words)
    py_pieces, tokens, py_runs = _python_plan(conn, lane, transfers, lo, len(transfers), py_ring, first, last)
    py_next = lane.next_slot
    lane.next_slot = next_slot
    c_ring = _ring(words)
    with lane.lock:
        out = conn._native_plan(lane, transfers, lo, len(transfers), c_ring, first_piece_bytes=first,
                                last_piece_bytes=last)
    assert out is not None
    pieces, n_slots, numel = out
    assert n_slots == tokens and numel == tokens + len(py_runs)
    assert lane.next_slot == py_next
    assert [_key(p) for p in pieces] == [_key(p) for p in py_pieces]
    assert torch.equal(c_ring.host[:tokens], py_ring.host[:tokens])
    assert c_ring.host[tokens:numel].tolist() == py_runs
    assert (c_ring.host[numel:] == -7).all()  # nothing written past the table
    assert all(len(py_runs) % RUN_WORDS == 0 for _ in [0])


def _ordinary(native):  # type: ignore[no-untyped-def]
    transfers = _transfers([4, 4, 4], [0, 0, 0], [False, False, False], seed=1)
    conn = _connector(native, 4 * 4 * 32)
    conn._prepare(transfers)
    return conn, transfers


def _plan_or_none(conn, transfers, ring=None):  # type: ignore[no-untyped-def]
    lane = conn._store_lane
    lane.next_slot = 1
    with lane.lock:
        out = conn._native_plan(lane, transfers, 0, len(transfers), ring or _ring(4096),
                                first_piece_bytes=None, last_piece_bytes=None)
    if out is None:
        assert lane.next_slot == 1  # the lane is left as it was
    return out


def test_the_ordinary_case_is_planned_in_c(native):  # type: ignore[no-untyped-def]
    conn, transfers = _ordinary(native)
    assert _plan_or_none(conn, transfers) is not None


def test_objects_of_two_arenas_never_share_a_dma_even_when_adjacent_in_memory(native):  # type: ignore[no-untyped-def]
    """As in the Python planner, host ranges merge only within one arena's buffer."""
    meta = MemoryObjMeta(LAYOUT.chunk_shape(4), torch.float16, 4)
    buf = torch.empty(2 * meta.nbytes, dtype=torch.uint8)
    first, second = HostArena(buf[: meta.nbytes]), HostArena(buf[meta.nbytes :])
    objs = [first.allocate(meta), second.allocate(meta)]
    assert objs[0] is not None and objs[1] is not None
    assert objs[0].tensor.data_ptr() + meta.nbytes == objs[1].tensor.data_ptr()
    transfers = [Transfer(o, torch.arange(4 * k, 4 * k + 4)) for k, o in enumerate(objs)]  # type: ignore[arg-type]
    conn = _connector(native, 8 * meta.nbytes)
    conn._prepare(transfers)
    out = _plan_or_none(conn, transfers)
    assert out is not None
    (piece,) = out[0]
    assert [(c.host_ptr, c.nbytes) for c in piece.copies] == [
        (o.tensor.data_ptr(), meta.nbytes) for o in objs  # type: ignore[union-attr]
    ]


@pytest.mark.parametrize(
    "spoil",
    [
        "minus_one", "out_of_range", "negative", "released", "wrong_dtype_slots", "strided_slots",
        "unknown_length", "wrong_object_dtype", "small_table", "row_over_slot", "no_slots_yet",
    ],
)
def test_anything_but_the_ordinary_case_is_left_to_the_python_path(native, spoil):  # type: ignore[no-untyped-def]
    conn, transfers = _ordinary(native)
    ring = None
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
        conn._chunk_shapes.clear()
    elif spoil == "wrong_object_dtype":
        arena = HostArena.create(1 << 16)
        obj = arena.allocate(MemoryObjMeta(LAYOUT.chunk_shape(4), torch.bfloat16, 4))
        assert obj is not None
        transfers[1] = Transfer(obj, t.slots)
    elif spoil == "small_table":
        ring = _ring(12 + RUN_WORDS)  # the slots fit, the runs do not
    elif spoil == "row_over_slot":
        conn._store_lane.slot_bytes = 64
    elif spoil == "no_slots_yet":
        conn._store_lane.slot_ptrs = []
    assert _plan_or_none(conn, transfers, ring) is None


class _Counting:
    """A stand-in for the compiled module that counts what it planned and what it left."""

    def __init__(self, module) -> None:  # type: ignore[no-untyped-def]
        self.module, self.planned, self.left = module, 0, 0

    def plan_group(self, *args):  # type: ignore[no-untyped-def]
        out = self.module.plan_group(*args)
        if out is None:
            self.left += 1
        else:
            self.planned += 1
        return out


def test_a_gpu_connector_plans_in_c_byte_for_byte_and_falls_back_per_group(device, arena, native):  # type: ignore[no-untyped-def]
    """On the driver path ordinary groups are planned in C (the bytes match core's reference);
    a group with -1 slots goes to the Python path and still moves the right bytes; a bad slot
    is refused with the Python path's message."""
    if device.type != "cuda":
        pytest.skip("the C planner serves the driver path, which needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=60)
    conn = CUDAPagedConnector(caches, layout)
    assert conn._native is not None
    counting = conn._native = _Counting(conn._native)
    ref = TorchPagedConnector([c.clone() for c in caches], layout)
    total = SHAPE.blocks * SHAPE.block
    lengths = [SHAPE.chunk // 4] * 4  # 8 MiB chunks at the GPU shape: several groups a call
    for holes, seed in (("none", 61), ("scatter", 62)):
        slots = random_slots(total, lengths, seed=seed, holes=holes)
        assert_store_then_load_like(conn, ref, arena, layout, lengths, slots, slots, seed)
        if holes == "none":
            assert counting.planned >= 2 and counting.left == 0
    assert counting.left >= 2  # the -1 slots' groups
    bad = random_slots(total, lengths, seed=63, holes="none")
    bad[2] = bad[2].clone()
    bad[2][0] = total
    with pytest.raises(IndexError, match="transfer 2: slot values"):
        conn.store(Objects(arena, layout, lengths, 64).transfers(bad))


def test_disabled_or_unbuildable_means_python_planning(monkeypatch, tmp_path, caplog):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVTIER_CUDA_NATIVE", "0")
    _native.load.cache_clear()
    try:
        assert _native.load() is None
        monkeypatch.setenv("KVTIER_CUDA_NATIVE", "1")
        monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        _native.load.cache_clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.cuda._native"):
            assert _native.load() is None
        assert "planning in Python" in caplog.text and "failed" in caplog.text
        assert not list((tmp_path / "native").glob("*"))  # no half-written module left behind
    finally:
        _native.load.cache_clear()


def test_a_build_is_reused_by_the_next_process(tmp_path, native):  # type: ignore[no-untyped-def]
    path = _native.build(tmp_path)
    mtime = path.stat().st_mtime_ns
    code = "import sys; from pathlib import Path; from kvtier.cuda import _native; print(_native.build(Path(sys.argv[1])))"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=True).stdout.strip()
    assert out == str(path) and path.stat().st_mtime_ns == mtime
    assert _native._import(path).plan_group is not None
