"""What is the CUDA mover's own (the contract is tests/conformance's): kernel words and tiles for
each geometry, a call that fits one slot on one stream, larger ones in groups through the two
staging slots, one copy per run of objects back to back in host memory, slot growth and release,
and errors found after a call's first copies."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    BLOCKS,
    Objects,
    make_layout,
    make_views,
    random_blocks,
    same_cache,
    twin,
)
from fixtures.kv_views import replica_views
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.platform.mover import TorchPageMover
from kvtier.cuda import mover as mover_module
from kvtier.cuda.mover import CUDAPageMover
from kvtier.cuda.platform import CUDAPlatform

ALL = pytest.mark.parametrize("paged", list(PagedLayout), ids=lambda p: p.value)


def build(
    device, paged=PagedLayout.LBHNC, seed=1, **options
) -> tuple[CUDAPageMover, TorchPageMover]:  # type: ignore[no-untyped-def]
    layout = make_layout(paged)
    views = make_views(layout, device, seed)
    mover = CUDAPlatform().create_mover(views, layout, num_blocks=BLOCKS, **options)
    return mover, twin(views, layout)


def store_both(mover, ref, arena, lengths, blocks, seed):  # type: ignore[no-untyped-def]
    mine = Objects(arena, mover.layout, lengths, seed)
    theirs = Objects(arena, mover.layout, lengths, seed)
    mover.store(mine.transfers(blocks))
    ref.store(theirs.transfers(blocks))
    assert all(torch.equal(a, b) for a, b in zip(mine.snapshot(), theirs.snapshot(), strict=True))


# -- geometry -----------------------------------------------------------------------------------
@ALL
def test_an_8b_page_moves_in_16_byte_words_of_16_kib_tiles(paged):
    layout = KVLayout(32, 8, 128, "bfloat16", 16, paged)
    views = replica_views(layout, 4, "cpu")
    geo = CUDAPlatform().create_mover(views, layout).geometry
    head_outer = paged in (PagedLayout.LHBNC, PagedLayout.BHLNC)
    page = layout.page_bytes  # 64 KiB
    assert (geo.word, geo.align) == (8, 2)
    assert geo.runs == (8 if head_outer else 1)
    assert geo.run * 8 == page // geo.runs
    assert geo.tile * 8 == (8 << 10 if head_outer else 16 << 10)
    assert geo.tiles_per_run * geo.tile == geo.run
    # a layer's pages are one region (layer-outer) or interleaved with the other layers'
    if paged.block_outer:
        assert geo.layer_offsets[1] * 8 == (page if not head_outer else page // 8)
    else:
        assert geo.layer_offsets[1] * 8 == 4 * page


def test_odd_page_sizes_move_in_narrower_words_with_a_masked_tile(device, arena):
    """18-byte pages (uint8 cache, 6 content bytes, blocks of 3): 2-byte words, runs of 9 words
    in a 16-word tile."""
    layout = KVLayout(2, 1, 1, "uint8", 3, content_bytes=6)
    views = replica_views(layout, 10, device)
    storage = views[0].untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8).to(device))
    mover = CUDAPlatform().create_mover(views, layout, num_blocks=10)
    geo = mover.geometry
    assert (geo.word, geo.run, geo.tile, geo.tiles_per_run) == (2, 9, 16, 1)
    ref = twin(views, layout)
    blocks = [torch.tensor([7, 2]), torch.tensor([9])]
    store_both(mover, ref, arena, [2, 1], blocks, seed=3)
    fresh = Objects(arena, layout, [2, 1], seed=4)
    mover.load(fresh.transfers([torch.tensor([0, 5]), torch.tensor([1])]))
    ref.load(fresh.transfers([torch.tensor([0, 5]), torch.tensor([1])]))
    assert same_cache(mover, ref)


def test_layers_in_separate_allocations_move_from_the_lowest_one(device, arena):
    """Tests and other engines may give each layer its own tensor: every layer's pages are
    addressed from the lowest allocation."""
    layout = make_layout()
    shape = (BLOCKS, layout.num_kv_heads, layout.block_size, 4 * layout.head_size)  # int8
    caches = [
        torch.randint(-128, 128, shape, dtype=torch.int8, device=device).view(layout.torch_dtype)
        for _ in range(layout.num_layers)
    ]
    mover = CUDAPlatform().create_mover(caches, layout)
    geo = mover.geometry
    assert min(geo.layer_offsets) >= 0
    assert geo.layer_offsets[geo.anchor_layer] == 0
    ref = TorchPageMover([c.clone() for c in caches], layout)
    lengths = [2, 3]
    mine, theirs = Objects(arena, layout, lengths, 5), Objects(arena, layout, lengths, 5)
    blocks = random_blocks(lengths, seed=6)
    mover.store(mine.transfers(blocks))
    ref.store(theirs.transfers(blocks))
    assert all(torch.equal(a, b) for a, b in zip(mine.snapshot(), theirs.snapshot(), strict=True))
    into = random_blocks(lengths, seed=7)
    mover.load(mine.transfers(into))
    ref.load(mine.transfers(into))
    for a, b in zip(mover.kv_caches, ref.kv_caches, strict=True):
        assert torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


# -- groups and staging -------------------------------------------------------------------------
@ALL
def test_a_call_runs_in_growing_groups_through_two_reused_slots(device, arena, paged, monkeypatch):
    """First group one block, then four times larger, capped at the slot (8 blocks), across
    transfers (one plan a call); every group through one of two slots, each reused, bytes
    exact."""
    mover, ref = build(device, paged, staging_slot_bytes=1)
    row = mover.layout.num_layers * mover.layout.page_bytes
    mover._store.slot_bytes = mover._load.slot_bytes = 8 * row
    monkeypatch.setattr(mover_module, "FIRST_GROUP_BYTES", row)
    sizes: list[int] = []
    group = mover._group

    def counted(lane, plan, a, b, *rest, **kw):  # type: ignore[no-untyped-def]
        sizes.append(b - a)
        group(lane, plan, a, b, *rest, **kw)

    monkeypatch.setattr(mover, "_group", counted)
    lengths = [3, 8, 2, 9]
    blocks = random_blocks(lengths, seed=11)
    store_both(mover, ref, arena, lengths, blocks, seed=12)
    assert sizes == [1, 4, 8, 8, 1]
    assert len(mover._store.slots) == 2 and mover._store.slot_bytes == 8 * row
    sizes.clear()
    into = random_blocks(lengths, seed=13)
    objs = Objects(arena, mover.layout, lengths, 14)
    mover.load(objs.transfers(into))
    ref.load(objs.transfers(into))
    assert sizes == [1, 4, 8, 8, 1]
    assert same_cache(mover, ref)
    sizes.clear()
    assert list(mover.load_layerwise(objs.transfers(blocks))) == list(
        range(mover.layout.num_layers)
    )
    ref.load(objs.transfers(blocks))
    # one layer's pages at a time, as many as a slot holds (8 rows: 8 * num_layers pages)
    per_slot = 8 * mover.layout.num_layers
    one_layer = [min(per_slot, 22 - a) for a in range(0, 22, per_slot)]
    assert sizes == one_layer * mover.layout.num_layers
    assert same_cache(mover, ref)


@pytest.mark.parametrize("call", ["store", "load"])
def test_a_call_that_fits_one_slot_is_one_group_on_the_copy_stream(
    device, arena, call, monkeypatch
):
    """No group through the two streams: one gather or scatter and the copies, staged whole in
    one slot; bytes exact, skipped blocks left as they were."""
    mover, ref = build(device)
    groups: list[int] = []
    group = mover._group

    def counted(lane, plan, a, b, *rest, **kw):  # type: ignore[no-untyped-def]
        groups.append(b - a)
        group(lane, plan, a, b, *rest, **kw)

    monkeypatch.setattr(mover, "_group", counted)
    lengths = [3, 2, 4]
    blocks = random_blocks(lengths, seed=81)
    blocks[1][0] = -1
    if call == "store":
        store_both(mover, ref, arena, lengths, blocks, seed=82)
    else:
        objs = Objects(arena, mover.layout, lengths, 83)
        mover.load(objs.transfers(blocks))
        ref.load(objs.transfers(blocks))
        assert same_cache(mover, ref)
    assert groups == []
    lane = mover._store if call == "store" else mover._load
    assert lane.last is None and lane.next_slot == 1


def test_a_large_call_plans_its_first_transfers_ahead_of_the_rest(device, arena, monkeypatch):
    """Transfers past ``PLAN_AHEAD_BYTES`` are checked and planned once the first ones are
    issued, their ids after the first plan's (padded to an even count); bytes exact both ways,
    a bad id in the rest still an error."""
    mover, ref = build(device)
    row = mover.layout.num_layers * mover.layout.page_bytes
    monkeypatch.setattr(mover_module, "PLAN_AHEAD_BYTES", 4 * row)
    plans: list[tuple[int, int]] = []
    plan = mover._plan

    def counted(lane, transfers, at):  # type: ignore[no-untyped-def]
        plans.append((len(transfers), at))
        return plan(lane, transfers, at)

    monkeypatch.setattr(mover, "_plan", counted)
    lengths = [2, 3, 2, 1]
    blocks = random_blocks(lengths, seed=71)
    store_both(mover, ref, arena, lengths, blocks, seed=72)
    assert plans == [(2, 0), (2, 6)]
    objs = Objects(arena, mover.layout, lengths, 73)
    into = random_blocks(lengths, seed=74)
    mover.load(objs.transfers(into))
    ref.load(objs.transfers(into))
    assert same_cache(mover, ref)
    with pytest.raises(IndexError):
        mover.store(objs.transfers([*blocks[:3], torch.tensor([BLOCKS])]))
    assert mover._store.last is None


def test_objects_back_to_back_in_host_memory_move_in_one_copy(device, arena, monkeypatch):
    mover, _ = build(device)
    lengths = [2, 2, 2]
    objs = Objects(arena, mover.layout, lengths, 21)
    rows = [o.tensor.data_ptr() for o in objs.objs]
    row = mover.layout.num_layers * mover.layout.page_bytes
    monkeypatch.setattr(mover_module, "FIRST_GROUP_BYTES", 6 * row)  # the call is one group
    assert rows[1] == rows[0] + 2 * row and rows[2] == rows[1] + 2 * row  # allocated in turn
    copies: list[tuple[int, int]] = []
    to_host = mover._store.to_host

    def counted(dst, src, nbytes):  # type: ignore[no-untyped-def]
        copies.append((dst, nbytes))
        to_host(dst, src, nbytes)

    monkeypatch.setattr(mover._store, "to_host", counted)
    # the Python path's copies (the native issuer's runs: test_native_issuer.py)
    monkeypatch.setattr(mover, "_native_call", lambda *a, **k: False)
    blocks = random_blocks(lengths, seed=22)
    mover.store(objs.transfers(blocks))
    # one copy for the three objects
    assert copies == [(rows[0], 6 * row)]
    copies.clear()
    blocks[1][1] = -1  # a skipped block splits the run and is left as it was
    before = objs.snapshot()[1][1].clone()
    mover.store(objs.transfers(blocks))
    assert copies == [(rows[0], 3 * row), (rows[2], 2 * row)]
    assert torch.equal(objs.objs[1].tensor[1], before)


@pytest.mark.parametrize("call", ["store", "load", "store_layer", "load_layerwise"])
def test_a_slot_grows_to_hold_one_block(device, arena, call):
    mover, _ = build(device, staging_slot_bytes=1)
    objs = Objects(arena, mover.layout, [2], 31)
    transfers = objs.transfers(random_blocks([2], seed=32))
    lane = mover._store if call.startswith("store") else mover._load
    if call == "store_layer":
        mover.store_layer(0, transfers)
    elif call == "load_layerwise":
        list(mover.load_layerwise(transfers))
    else:
        getattr(mover, call)(transfers)
    page = mover.layout.page_bytes
    assert lane.slot_bytes == (
        page * mover.layout.num_layers if call in ("store", "load") else page
    )


@pytest.mark.parametrize("keep", [True, False])
def test_staging_buffer_false_keeps_no_slots_between_calls(device, arena, keep):
    mover, _ = build(device, staging_buffer=keep)
    objs = Objects(arena, mover.layout, [2, 1], 41)
    transfers = objs.transfers(random_blocks([2, 1], seed=42))
    calls = [
        lambda: mover.store(transfers),
        lambda: mover.load(transfers),
        lambda: mover.store_layer(1, transfers),
        lambda: list(mover.store_layerwise(transfers)),
        lambda: next(iter(mover.load_layerwise(transfers))),  # a generator closed early
    ]
    for call in calls:
        call()
        held = len(mover._store.slots) + len(mover._load.slots)
        assert (held > 0) if keep else (held == 0)


def test_a_bad_later_transfer_is_an_error_before_anything_moves(device, arena):
    """A call is checked whole before its first group: a bad later transfer leaves every
    object as it was, nothing is in flight, and the mover goes on working."""
    mover, ref = build(device)
    objs = Objects(arena, mover.layout, [2, 2], 51)
    good = random_blocks([2], seed=52)[0]
    before = objs.snapshot()
    with pytest.raises(IndexError):
        mover.store(objs.transfers([good, torch.tensor([1, BLOCKS])]))
    assert mover._store.last is None  # nothing of it in flight
    assert all(torch.equal(o.tensor, b) for o, b in zip(objs.objs, before, strict=True))
    store_both(mover, ref, arena, [2], [good], seed=53)


def test_block_ids_of_any_int_dtype_on_the_device_or_host(device, arena):
    mover, ref = build(device)
    blocks = random_blocks([3], seed=61)
    for ids in (blocks[0].int(), blocks[0].to(device), blocks[0].to(device).int()):
        store_both(mover, ref, arena, [3], [ids], seed=62)
