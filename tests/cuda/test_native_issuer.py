"""The native issuer's build and planning (``kvtier/cuda/_issue.c``) on any machine with a C
compiler: the library is built once per source, a failed build is a warning and the Python path,
and its planning equals the Python planner's on random calls. On a GPU, a mover's calls after its
first go through it with exact bytes and the contract's errors. Its driver calls:
test_native_driver_calls.py."""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import (
    BLOCKS,
    LAYERS,
    Objects,
    chunk_objects,
    make_layout,
    make_views,
    random_blocks,
    same_cache,
    twin,
)
from kvtier.core.errors import LayoutError
from kvtier.core.layout import PagedLayout
from kvtier.core.memory import HostArena
from kvtier.core.platform.mover import Transfer
from kvtier.cuda import native
from kvtier.cuda.lane import Lane
from kvtier.cuda.plan import plan_transfers
from kvtier.cuda.platform import CUDAPlatform

LAYOUT = make_layout()
ROW = LAYOUT.num_layers * LAYOUT.page_bytes


def test_a_second_build_reuses_the_library(lib: ctypes.CDLL, tmp_path: Path) -> None:
    first = native.build(out_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native.build(out_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime


def test_a_source_that_does_not_compile_is_an_oserror_naming_the_compiler(
    lib: ctypes.CDLL, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("int f( {\n")
    with pytest.raises(OSError, match="failed"):
        native.build(source=bad, out_dir=tmp_path / "out")


def test_without_a_compiler_calls_run_in_python_after_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kvtier"):
            assert native.library() is None
        assert "the native issuer could not be built" in caplog.text
        assert "no-such-cc" in caplog.text
    finally:
        native.library.cache_clear()


def _c_plan(lib: ctypes.CDLL, transfers: list[Transfer], num_blocks: int):  # type: ignore[no-untyped-def]
    arrays = native.CallArrays(LAYOUT)
    total = arrays.read(transfers)
    out, nruns = native.Int64s(total), ctypes.c_int64()
    kept = lib.kvt_plan(
        arrays.addrs.address, arrays.counts.address, len(transfers), arrays.ids.address, ROW,
        num_blocks, out.address, arrays.runs.address, ctypes.byref(nruns), arrays.lohi.address,
    )  # fmt: skip
    if kept < 0:
        return None, (arrays.lohi.array[0], arrays.lohi.array[1])
    triples = [tuple(arrays.runs.array[3 * r : 3 * r + 3]) for r in range(nruns.value)]
    return list(out.array[:kept]), triples


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    order=st.randoms(use_true_random=False),
    skips=st.lists(st.booleans(), min_size=24, max_size=24),
    bad=st.sampled_from([None, -2, BLOCKS]),
    form=st.sampled_from(["int64", "int32", "strided"]),
)
def test_planning_equals_the_python_planner(lib, lengths, order, skips, bad, form) -> None:  # type: ignore[no-untyped-def]
    """Kept ids in order, runs of rows back to back in host memory (objects allocated one after
    another and then shuffled), skipped blocks (-1) left out, and the same bad-id error; ids of
    any integer dtype and stride (the C code reads contiguous int64s: others are converted)."""
    arena = HostArena.create(32 * ROW)
    objs = chunk_objects(arena, LAYOUT, lengths)
    order.shuffle(objs)
    perm = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(len(lengths)))
    at, transfers = 0, []
    for o in objs:
        n = o.tensor.shape[0]
        ids = perm[at : at + n].clone()
        for j in range(n):
            if skips[(at + j) % len(skips)]:
                ids[j] = -1
        at += n
        if bad is not None and len(transfers) == len(objs) - 1:
            ids[-1] = bad
        if form == "int32":
            ids = ids.to(torch.int32)
        elif form == "strided":
            ids = torch.stack([ids, torch.zeros_like(ids)], 1)[:, 0]
            assert n == 1 or not ids.is_contiguous()
        transfers.append(Transfer(o, ids))
    lane = Lane(torch.device("cpu"), 2, 1 << 16)
    got_ids, got = _c_plan(lib, transfers, BLOCKS)
    if bad is not None:
        with pytest.raises(IndexError):
            plan_transfers(lane, transfers, 0, LAYOUT, BLOCKS)
        assert got_ids is None and (got[0] == bad or got[1] == bad)
    else:
        plan = plan_transfers(lane, transfers, 0, LAYOUT, BLOCKS)
        assert got_ids == lane.ids_np[: plan.count].tolist()
        bounds = [0, *plan.cuts, plan.count]
        want = [(plan.host(a, ROW), a, b - a) for a, b in itertools.pairwise(bounds) if b > a]
        assert got == want
    for o in objs:
        o.release()


# -- on a GPU: the mover's calls after its first -------------------------------------------------
@pytest.mark.parametrize("paged", [PagedLayout.LBHNC, PagedLayout.BLNHC, PagedLayout.BHLNC])
def test_a_movers_later_calls_go_native_with_exact_bytes(device, arena, paged) -> None:  # type: ignore[no-untyped-def]
    """Rounds of a store and a load, skipped blocks among them, equal the torch reference; from
    the second round on both directions run through the native issuer."""
    if device.type != "cuda":
        pytest.skip("the native issuer runs on a GPU (on a CPU device calls run in Python)")
    if native.library() is None:
        pytest.fail("the native issuer was not built on this GPU machine")
    layout = make_layout(paged)
    mover = CUDAPlatform().create_mover(make_views(layout, device, 3), layout, num_blocks=BLOCKS)
    ref = twin(mover.kv_caches, layout)
    lengths = [3, 1, 4, 2]
    for r in range(3):
        blocks = random_blocks(lengths, seed=10 + r)
        blocks[r % len(lengths)][0] = -1
        mine, theirs = Objects(arena, layout, lengths, r), Objects(arena, layout, lengths, r)
        mover.store(mine.transfers(blocks))
        ref.store(theirs.transfers(blocks))
        assert all(
            torch.equal(a, b) for a, b in zip(mine.snapshot(), theirs.snapshot(), strict=True)
        )
        into = random_blocks(lengths, seed=20 + r)
        into[-1][-1] = -1
        objs = Objects(arena, layout, lengths, 30 + r)
        mover.load(objs.transfers(into))
        ref.load(objs.transfers(into))
        torch.cuda.synchronize()
        assert same_cache(mover, ref)
        assert (set(mover._natives) == {True, False}) == (r > 0)
    # bad input through the native issuer: the contract's errors, nothing moved
    objs = Objects(arena, layout, [2], 40)
    before = objs.snapshot()
    with pytest.raises(IndexError, match=r"block ids must be -1 or in \[0, "):
        mover.store(objs.transfers([torch.tensor([1, BLOCKS])]))
    assert torch.equal(objs.snapshot()[0], before[0])
    wrong = Objects(arena, make_layout(paged, num_layers=LAYERS // 2), [2], 41)
    with pytest.raises(LayoutError, match="does not match the layout's chunk"):
        mover.load(wrong.transfers([torch.tensor([1, 2])]))
