"""Properties of the connector's planner: how a call's rows are packed into staging pieces.

Pure host logic (no kernel runs), so it is checked over many random calls: every row of every
transfer lands exactly once, pieces fit their staging slot, the host ranges the DMAs move are
exactly the rows the kernel reads or writes, and the first/last piece caps hold.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.connector import Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.cuda.geometry import CallShape
from kvtier.cuda.memory import StagingRing
from kvtier.cuda.plan import all_rows, eager_piece, groups, layer_rows, plan, prepare, same_copies

LAYOUT = KVLayout(2, 2, 8, "float16", 4, PagedLayout.FLASH_NHD)  # a row token: 32 bytes
BLOCKS = 64
SHAPE = CallShape.of(LAYOUT, BLOCKS)


def _ring(slot_bytes: int) -> StagingRing:
    return StagingRing(torch.device("cpu"), 3, slot_bytes, None)


@st.composite
def calls(draw):  # type: ignore[no-untyped-def]
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))
    uniform = draw(st.booleans())
    if uniform:
        lengths = [lengths[0]] * len(lengths)
    holes = draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    by_layer = draw(st.booleans())
    row_max = max(lengths) * 32
    slot_bytes = draw(st.integers(row_max, 6 * row_max))
    first = draw(st.sampled_from([None, 1, row_max, 2 * row_max]))
    last = draw(st.sampled_from([None, 1, row_max, 2 * row_max]))
    store = draw(st.booleans())
    return lengths, holes, by_layer, slot_bytes, first, last, store, uniform


@settings(max_examples=150, deadline=None)
@given(calls())
def test_every_row_lands_once_inside_its_piece_and_its_dma(call):  # type: ignore[no-untyped-def]
    lengths, holes, by_layer, slot_bytes, first, last, store, uniform = call
    ring = _ring(slot_bytes)
    arena = HostArena.create(1 << 20)
    perm = torch.randperm(
        BLOCKS * LAYOUT.block_size, generator=torch.Generator().manual_seed(len(lengths))
    )
    transfers, at = [], 0
    for n, hole in zip(lengths, holes, strict=True):
        obj = arena.allocate(MemoryObjMeta(LAYOUT.chunk_shape(n), torch.float16, n))
        assert obj is not None
        slots = perm[at : at + n].clone()
        at += n
        if hole:
            slots[: (n + 1) // 2] = -1
        transfers.append(Transfer(obj, slots))
    prepared, _ = prepare(SHAPE, transfers)
    segments = (
        [
            seg
            for layer in range(LAYOUT.num_layers)
            for seg in layer_rows(len(prepared), layer, SHAPE)
        ]
        if by_layer
        else all_rows(len(prepared), SHAPE)
    )
    slot0 = ring.next_slot
    pieces, runs = plan(
        ring,
        prepared,
        segments,
        store=store,
        slot_base=1 << 40,
        first_piece_bytes=first,
        last_piece_bytes=last,
    )
    rows_per_obj = 2 * LAYOUT.num_layers
    expected = {(i, r) for i, p in enumerate(prepared) if not p.empty for r in range(rows_per_obj)}
    by_slot_index = {p.slot_index: i for i, p in enumerate(prepared)}
    slot_ptrs = [t.data_ptr() for t in ring.slots]
    seen: set[tuple[int, int]] = set()
    total = 0
    for k, piece in enumerate(pieces):
        assert piece.slot == (slot0 + k) % ring.num_slots
        assert 0 < piece.nbytes <= piece.cap <= ring.slot_bytes
        base = slot_ptrs[piece.slot]
        used: list[tuple[int, int]] = []
        for run in runs[piece.start : piece.stop]:
            r0, step, count, flat, stride, slot_list, n, pad = run
            i = by_slot_index[(slot_list - (1 << 40)) // 8]
            p = prepared[i]
            assert pad == 0 and n == p.num_tokens and stride == p.row_bytes
            assert count <= piece.max_rows and n <= piece.max_tokens
            for j in range(count):
                row = r0 + j * step
                assert (i, row) not in seen
                seen.add((i, row))
                off = flat - base + j * stride
                assert off >= 0 and off + stride <= piece.nbytes
                used.append((off, off + stride))
                # The DMA ranges move exactly this row's host bytes to this slot offset.
                addr = p.host_ptr + row * p.row_bytes
                assert any(
                    c.host_ptr <= addr
                    and addr + stride <= c.host_ptr + c.nbytes
                    and c.slot_offset + (addr - c.host_ptr) == off
                    for c in piece.copies
                ), (i, row)
        used.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(used))
        assert sum(b - a for a, b in used) == piece.nbytes == sum(c.nbytes for c in piece.copies)
        assert piece.prefill == (
            store
            and any(
                prepared[by_slot_index[(r[5] - (1 << 40)) // 8]].has_holes
                for r in runs[piece.start : piece.stop]
            )
        )
        total += piece.nbytes
    assert seen == expected
    assert total == sum(p.row_bytes * rows_per_obj for p in prepared if not p.empty)
    row = max((p.row_bytes for p in prepared if not p.empty), default=0)
    if pieces and first:
        assert pieces[0].nbytes <= max(first, row)
    if uniform and last and last >= row and len(pieces) > 1 and total > last:
        assert pieces[-1].nbytes <= last


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=12),
    first_rows=st.integers(0, 8),
    slot_rows=st.integers(1, 40),
    double_first=st.booleans(),
)
def test_groups_cover_the_call_in_order_and_grow_from_the_first_cap(
    lengths, first_rows, slot_rows, double_first
):  # type: ignore[no-untyped-def]
    """``groups``: consecutive ``(lo, hi, tokens)`` covering every transfer once, in order; the
    first group within ``first`` bytes (at most a staging slot) unless one transfer alone is
    larger; later groups within ``growth`` times the previous cap; 0, or ``whole``, makes one
    group."""
    per_token = SHAPE.token_bytes
    first = first_rows * per_token * (2 if double_first else 1)

    def split(whole: bool = False) -> list[tuple[int, int, int]]:
        return groups(
            transfers,
            per_token,
            first=first,
            slot_bytes=slot_rows * per_token,
            growth=2,
            whole=whole,
        )

    arena = HostArena.create(1 << 20)
    transfers = []
    for n in lengths:
        obj = arena.allocate(MemoryObjMeta(LAYOUT.chunk_shape(n), torch.float16, n))
        assert obj is not None
        transfers.append(Transfer(obj, torch.full((n,), -1, dtype=torch.int64)))
    parts = split()
    # A call made while its lane is busy (``whole``) is one group, whatever the first cap.
    assert split(whole=True) == [(0, len(lengths), sum(lengths))]
    assert parts[0][0] == 0 and parts[-1][1] == len(lengths)
    for (_, hi, _), (lo, _, _) in itertools.pairwise(parts):
        assert hi == lo
    for lo, hi, tokens in parts:
        assert lo < hi and tokens == sum(lengths[lo:hi])
    if first_rows == 0:
        assert parts == [(0, len(lengths), sum(lengths))]
        return
    cap = min(first_rows * (2 if double_first else 1), slot_rows)  # in tokens
    for lo, hi, tokens in parts:
        assert (
            tokens <= cap or sum(1 for n in lengths[lo:hi] if n) == 1
        )  # empty transfers ride along
        if hi < len(lengths):  # a group stops only because the next transfer did not fit
            assert tokens + lengths[hi] > cap
        cap *= 2


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    empty=st.lists(st.booleans(), min_size=8, max_size=8),
    gaps=st.lists(st.booleans(), min_size=8, max_size=8),
    slot_rows=st.integers(12, 60),
    last_rows=st.sampled_from([0, 1, 6, 20]),
    last=st.booleans(),
)
def test_an_eager_first_load_piece_is_the_plans_first_piece(
    lengths, empty, gaps, slot_rows, last_rows, last
):  # type: ignore[no-untyped-def]
    """``eager_piece`` (a load's first DMA, issued before the call is checked): whole leading
    objects within a staging slot (leaving the short last piece to the plan when the group is
    the call's last), host ranges exactly their bytes, adjacent ones merged; and when none of
    them is empty (every slot -1), the plan told its size makes the same first piece, so the
    batch skips its own first DMA."""
    per_token = SHAPE.token_bytes
    ring = _ring(slot_rows * per_token)
    arena = HostArena.create(1 << 20)
    perm = torch.randperm(
        BLOCKS * LAYOUT.block_size, generator=torch.Generator().manual_seed(len(lengths))
    )
    transfers, at = [], 0
    for k, n in enumerate(lengths):
        if gaps[k]:  # a spacer: this object is not adjacent to the one before
            assert (
                arena.allocate(MemoryObjMeta(LAYOUT.chunk_shape(1), torch.float16, 1)) is not None
            )
        obj = arena.allocate(MemoryObjMeta(LAYOUT.chunk_shape(n), torch.float16, n))
        assert obj is not None
        slots = torch.full((n,), -1, dtype=torch.int64) if empty[k] else perm[at : at + n].clone()
        at += n
        transfers.append(Transfer(obj, slots))
    last_bytes = last_rows * per_token if last else None
    eager = eager_piece(ring, transfers, SHAPE, last_piece_bytes=last_bytes)
    sizes = [n * per_token for n in lengths]
    lead = sizes[: sizes.index(0)] if 0 in sizes else sizes  # objects before the first empty one
    budget = ring.slot_bytes
    if last_bytes and last_bytes < sum(lead) <= budget + last_bytes:
        budget = sum(lead) - last_bytes
    if eager is None:
        assert not lead or lead[0] > budget
        return
    assert eager.slot == ring.next_slot and 0 < eager.nbytes <= budget
    covered = len(
        list(itertools.takewhile(lambda total: total <= budget, itertools.accumulate(lead)))
    )
    assert sum(sizes[:covered]) == eager.nbytes
    ranges = [
        (t.obj.tensor.data_ptr(), size) for t, size in zip(transfers[:covered], sizes, strict=False)
    ]
    got, offset = [], 0
    for c in eager.copies:
        assert c.slot_offset == offset
        offset += c.nbytes
        got.append((c.host_ptr, c.nbytes))
    merged: list[tuple[int, int]] = []
    for addr, size in ranges:
        if merged and merged[-1][0] + merged[-1][1] == addr:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((addr, size))
    assert got == merged
    prepared, _ = prepare(SHAPE, transfers)
    pieces, _ = plan(
        ring,
        prepared,
        all_rows(len(prepared), SHAPE),
        store=False,
        slot_base=1 << 40,
        first_piece_bytes=eager.nbytes,
        last_piece_bytes=last_bytes,
    )
    if not any(empty[:covered]):
        assert same_copies(eager, pieces[0])
    elif pieces:
        assert not same_copies(eager, pieces[0])
