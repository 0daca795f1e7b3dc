"""CUDAPagedConnector against core's TorchPagedConnector, byte for byte.

Every path (store/load, whole and layer-wise, the C and the Python planner, a kept or released
staging ring, three paged layouts, fp16/bf16/fp8, -1 slots, ring wrap-around, calls split into
groups) is checked on CPU through the Triton interpreter (the same pipeline, run synchronously)
and, with KVTIER_TEST_DEVICE=cuda, on a GPU at an 8B-like size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import (
    OPTION_SETS,
    SHAPE,
    Objects,
    as_bytes,
    assert_same_caches,
    assert_same_objects,
    make_caches,
    make_layout,
    random_slots,
    reference_layout,
)
from kvtier.core.connector import TorchPagedConnector, Transfer
from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.cuda.connector import CUDAPagedConnector

pytestmark = pytest.mark.triton

LAYOUTS = [PagedLayout.FLASH_NHD, PagedLayout.FLASH_BLOCK_FIRST, PagedLayout.MLA]
DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
# Three chunks, the last one short: a ragged batch.
LENGTHS = [SHAPE.chunk, SHAPE.chunk, SHAPE.chunk // 2 + 1]
# One row per staging slot: forces many pieces, ring wrap-around and slot reuse.
SMALL_RING = {"staging_slots": 2, "staging_slot_bytes": 1}


def _reference(layout: KVLayout, caches: list[torch.Tensor]) -> TorchPagedConnector:
    ref = reference_layout(layout)
    return TorchPagedConnector([c.clone().view(ref.torch_dtype) for c in caches], ref)


def _assert_store_matches(conn, ref, arena, lengths, slots, seed):  # type: ignore[no-untyped-def]
    """Storing ``slots`` gives the same object bytes through ``conn`` as through ``ref``."""
    mine, theirs = (
        Objects(arena, conn.layout, lengths, seed),
        Objects(arena, ref.layout, lengths, seed),
    )
    conn.store(mine.transfers(slots))
    ref.store(theirs.transfers(slots))
    assert_same_objects(mine, theirs)


def _assert_load_matches(conn, ref, arena, lengths, slots, seed):  # type: ignore[no-untyped-def]
    """Loading fresh objects into both caches leaves them byte-identical."""
    fresh, fresh_ref = (
        Objects(arena, conn.layout, lengths, seed),
        Objects(arena, ref.layout, lengths, seed),
    )
    conn.load(fresh.transfers(slots))
    ref.load(fresh_ref.transfers(slots))
    assert_same_caches(conn, ref)


@pytest.mark.parametrize("paged", LAYOUTS, ids=lambda p: p.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_store_then_load_matches_reference(device, arena, paged, dtype):
    layout = make_layout(paged, dtype)
    caches = make_caches(layout, device, seed=1)
    ref = _reference(layout, caches)
    conn = CUDAPagedConnector(caches, layout)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS, seed=2, holes="none")
    _assert_store_matches(conn, ref, arena, LENGTHS, slots, 3)
    # Load fresh objects into both caches (the store's objects are now the reference's truth).
    _assert_load_matches(conn, ref, arena, LENGTHS, slots, 4)


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("holes", ["prefix", "scatter"])
@pytest.mark.parametrize("paged", LAYOUTS, ids=lambda p: p.value)
def test_minus_one_slots_are_skipped_both_ways(device, arena, paged, holes, options):
    layout = make_layout(paged, torch.bfloat16)
    caches = make_caches(layout, device, seed=5)
    ref = _reference(layout, caches)
    conn = CUDAPagedConnector(caches, layout, **OPTION_SETS[options], **SMALL_RING)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS, seed=6, holes=holes)

    mine, theirs = Objects(arena, layout, LENGTHS, 7), Objects(arena, layout, LENGTHS, 7)
    before = mine.bytes()
    conn.store(mine.transfers(slots))
    ref.store(theirs.transfers(slots))
    after = mine.bytes()
    assert all(torch.equal(a, b) for a, b in zip(after, theirs.bytes(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))

    cache_before = [as_bytes(c).clone() for c in conn.kv_caches]
    fresh = Objects(arena, layout, LENGTHS, 8)
    conn.load(fresh.transfers(slots))
    ref.load(fresh.transfers(slots))
    changed = False
    for a, b, old in zip(conn.kv_caches, ref.kv_caches, cache_before, strict=True):
        assert torch.equal(as_bytes(a), as_bytes(b))
        changed = changed or not torch.equal(as_bytes(a), old)
    assert changed


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("paged", [PagedLayout.FLASH_NHD, PagedLayout.MLA], ids=lambda p: p.value)
def test_layerwise_generators_and_single_layers_match_reference(device, arena, paged, options):
    layout = make_layout(paged, torch.float16)
    caches = make_caches(layout, device, seed=9)
    ref = _reference(layout, caches)
    conn = CUDAPagedConnector(caches, layout, **OPTION_SETS[options], **SMALL_RING)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS, seed=10, holes="prefix")

    gen_objs, layer_objs, ref_objs = (Objects(arena, layout, LENGTHS, 11) for _ in range(3))
    assert list(conn.store_layerwise(gen_objs.transfers(slots))) == list(range(layout.num_layers))
    for layer in range(layout.num_layers):
        conn.store_layer(layer, layer_objs.transfers(slots))
    ref.store(ref_objs.transfers(slots))
    expected = ref_objs.bytes()
    assert all(torch.equal(a, b) for a, b in zip(gen_objs.bytes(), expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(layer_objs.bytes(), expected, strict=True))

    fresh = Objects(arena, layout, LENGTHS, 12)
    ref.load(fresh.transfers(slots))
    gen_conn = CUDAPagedConnector(
        [c.clone() for c in caches], layout, **OPTION_SETS[options], **SMALL_RING
    )
    seen = []
    for layer in gen_conn.load_layerwise(fresh.transfers(slots)):
        # Attention may read this layer now: it already holds the loaded bytes.
        assert torch.equal(as_bytes(gen_conn.kv_caches[layer]), as_bytes(ref.kv_caches[layer]))
        seen.append(layer)
    assert seen == list(range(layout.num_layers))
    for layer in range(layout.num_layers):
        conn.load_layer(layer, fresh.transfers(slots))
    assert_same_caches(conn, ref)


def test_abandoned_layerwise_generator_finishes_its_copies(device, arena):
    layout = make_layout(PagedLayout.FLASH_BLOCK_FIRST, torch.bfloat16)
    caches = make_caches(layout, device, seed=13)
    conn = CUDAPagedConnector(caches, layout)
    ref = _reference(layout, caches)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS, seed=14, holes="none")
    mine, theirs = Objects(arena, layout, LENGTHS, 15), Objects(arena, layout, LENGTHS, 15)
    gen = conn.store_layerwise(mine.transfers(slots))
    assert next(gen) == 0
    gen.close()
    ref.store_layer(0, theirs.transfers(slots))
    assert_same_objects(mine, theirs)


def test_permuted_view_of_a_block_first_allocation(device, arena):
    """vLLM may hand ``[2, nb, ...]`` as a view of a ``[nb, 2, ...]`` allocation: strides decide."""
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    block_first = make_layout(PagedLayout.FLASH_BLOCK_FIRST, torch.bfloat16)
    views = [c.transpose(0, 1) for c in make_caches(block_first, device, seed=16)]
    assert not views[0].is_contiguous()
    conn = CUDAPagedConnector(views, layout)
    ref = TorchPagedConnector([v.contiguous() for v in views], layout)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS, seed=17, holes="scatter")
    _assert_store_matches(conn, ref, arena, LENGTHS, slots, 18)
    _assert_load_matches(conn, ref, arena, LENGTHS, slots, 19)


def test_adjacent_objects_and_growing_ring(device, arena):
    """Objects back to back in the arena share one DMA; a row larger than a slot grows the ring."""
    layout = make_layout(PagedLayout.FLASH_NHD, torch.float16)
    caches = make_caches(layout, device, seed=20)
    ref = _reference(layout, caches)
    row_bytes = SHAPE.chunk * layout.hidden_size * 2
    conn = CUDAPagedConnector(caches, layout, staging_slots=2, staging_slot_bytes=row_bytes // 2)
    lengths = [SHAPE.chunk] * 2
    slots = random_slots(SHAPE.blocks * SHAPE.block, lengths, seed=21, holes="none")
    mine = Objects(arena, layout, lengths, 22)
    theirs = Objects(arena, layout, lengths, 22)
    conn.store([Transfer(o, s) for o, s in zip(mine.objs, slots, strict=True)])
    ref.store([Transfer(o, s) for o, s in zip(theirs.objs, slots, strict=True)])
    assert_same_objects(mine, theirs)
    _assert_load_matches(conn, ref, arena, lengths, slots, 23)


def test_empty_and_all_skipped_transfers_are_no_ops(device, arena):
    layout = make_layout(PagedLayout.FLASH_NHD, torch.float16)
    caches = make_caches(layout, device, seed=23)
    conn = CUDAPagedConnector(caches, layout)
    conn.store([])
    conn.load([])
    objs = Objects(arena, layout, [4], 24)
    before = objs.bytes()
    cache_before = [as_bytes(c).clone() for c in caches]
    skip = torch.full((4,), -1, dtype=torch.long)
    conn.store(objs.transfers([skip]))
    conn.load(objs.transfers([skip]))
    assert torch.equal(objs.bytes()[0], before[0])
    assert all(torch.equal(as_bytes(c), b) for c, b in zip(caches, cache_before, strict=True))


def test_bad_input_is_refused_with_a_clear_error(device, arena):
    layout = make_layout(PagedLayout.FLASH_NHD, torch.float16)
    caches = make_caches(layout, device, seed=25)
    conn = CUDAPagedConnector(caches, layout)
    objs = Objects(arena, layout, [3], 26)
    total = SHAPE.blocks * SHAPE.block
    with pytest.raises(IndexError, match="slot values"):
        conn.store(objs.transfers([torch.tensor([0, 1, total])]))
    with pytest.raises(IndexError, match="slot values"):
        conn.load(objs.transfers([torch.tensor([0, -2, 1])]))
    with pytest.raises(IndexError, match="layer"):
        conn.store_layer(layout.num_layers, objs.transfers([torch.tensor([0, 1, 2])]))
    other = make_layout(PagedLayout.MLA, torch.float16)
    mla_objs = Objects(arena, other, [3], 27)
    with pytest.raises(LayoutError, match="does not match"):
        conn.store(mla_objs.transfers([torch.tensor([0, 1, 2])]))
    with pytest.raises(TypeError, match=r"unknown CUDA connector option.*mode"):
        CUDAPagedConnector(caches, layout, mode="dma")
    with pytest.raises(TypeError, match="staging_buffer must be a bool"):
        CUDAPagedConnector(caches, layout, staging_buffer="yes")
    with pytest.raises(ValueError, match="staging_slots"):
        CUDAPagedConnector(caches, layout, staging_slots=1)
    cpu_layout = KVLayout(
        SHAPE.layers, SHAPE.heads, SHAPE.head, "float16", SHAPE.block, PagedLayout.VLLM_CPU
    )
    with pytest.raises(LayoutError, match="vllm_cpu"):
        CUDAPagedConnector(make_caches(cpu_layout, device, seed=28), cpu_layout)


def test_a_call_split_into_groups_names_the_bad_transfer_and_leaves_nothing_in_flight(
    device, arena
):
    """One transfer per group (a one-byte staging slot caps every group): the third transfer's
    bad slot is found after the first two groups were issued; the error names it by its index
    in the call."""
    layout = make_layout(PagedLayout.FLASH_NHD, torch.float16)
    caches = make_caches(layout, device, seed=40)
    conn = CUDAPagedConnector(caches, layout, **SMALL_RING)
    lengths = [SHAPE.chunk] * 3
    objs = Objects(arena, layout, lengths, 43)
    slots = random_slots(SHAPE.blocks * SHAPE.block, lengths, seed=44, holes="none")
    slots[2] = slots[2].clone()
    slots[2][1] = SHAPE.blocks * SHAPE.block
    for call in (conn.store, conn.load):
        with pytest.raises(IndexError, match="transfer 2: slot values"):
            call(objs.transfers(slots))
    # The connector is still usable and exact afterwards.
    ref = _reference(layout, caches)
    good = random_slots(SHAPE.blocks * SHAPE.block, lengths, seed=45, holes="none")
    _assert_store_matches(conn, ref, arena, lengths, good, 46)


@pytest.mark.parametrize(
    ("dtype", "head", "word"),
    [
        (torch.float16, 3, 2),
        (torch.float8_e4m3fn, 3, 1),
        (torch.float16, 2, 4),
        (torch.float8_e5m2, 8, 8),
    ],
)
def test_every_word_width(
    device, arena, dtype, head, word
):  # word: the kernel's word width for the row
    """Rows whose byte width is not a multiple of 8 are moved in narrower words, still exactly."""
    shape = dataclasses.replace(SHAPE, heads=1, head=head)
    layout = make_layout(PagedLayout.FLASH_BLOCK_FIRST, dtype, shape)
    caches = make_caches(layout, device, seed=30)
    ref = _reference(layout, caches)
    conn = CUDAPagedConnector(caches, layout)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS, seed=31, holes="scatter")
    _assert_store_matches(conn, ref, arena, LENGTHS, slots, 32)
    _assert_load_matches(conn, ref, arena, LENGTHS, slots, 33)


def test_async_store_and_load_complete_on_wait(device, arena):
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=40)
    ref = _reference(layout, caches)
    conn = CUDAPagedConnector(caches, layout)
    total = SHAPE.blocks * SHAPE.block
    slots = random_slots(total, LENGTHS * 2, seed=41, holes="none")
    store_slots, load_slots = slots[: len(LENGTHS)], slots[len(LENGTHS) :]
    mine, theirs = Objects(arena, layout, LENGTHS, 42), Objects(arena, layout, LENGTHS, 42)
    fresh = Objects(arena, layout, LENGTHS, 43)
    pending_store = conn.store_async(mine.transfers(store_slots))
    pending_load = conn.load_async(fresh.transfers(load_slots))
    pending_store.wait()
    pending_load.wait()
    pending_load.wait()  # idempotent
    assert pending_store.done() and pending_load.done()
    ref.store(theirs.transfers(store_slots))
    ref.load(fresh.transfers(load_slots))
    assert_same_objects(mine, theirs)
    assert_same_caches(conn, ref)


def test_store_and_load_together_from_one_thread(device, arena):
    layout = make_layout(PagedLayout.FLASH_BLOCK_FIRST, torch.float16)
    caches = make_caches(layout, device, seed=44)
    ref = _reference(layout, caches)
    conn = CUDAPagedConnector(caches, layout, **SMALL_RING)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS * 2, seed=45, holes="scatter")
    store_slots, load_slots = slots[: len(LENGTHS)], slots[len(LENGTHS) :]
    mine, theirs = Objects(arena, layout, LENGTHS, 46), Objects(arena, layout, LENGTHS, 46)
    fresh = Objects(arena, layout, LENGTHS, 47)
    pending_store, pending_load = conn.store_and_load_async(
        mine.transfers(store_slots), fresh.transfers(load_slots)
    )
    pending_load.wait()
    pending_store.wait()
    ref.store(theirs.transfers(store_slots))
    ref.load(fresh.transfers(load_slots))
    assert_same_objects(mine, theirs)
    assert_same_caches(conn, ref)


@pytest.mark.parametrize("holes", ["none", "scatter"])
def test_store_and_load_together_back_to_back(device, arena, holes):
    """Two ``store_and_load_async`` calls back to back (the second's store table goes up while
    the first's load DMAs may be in flight), every transfer a group of its own (a one-byte
    staging slot): the same bytes as the reference. With -1 slots the groups take the Python
    planner and the load's early first DMA does not match the plan's first piece."""
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=60)
    ref = _reference(layout, caches)
    conn = CUDAPagedConnector(caches, layout, **SMALL_RING)
    slots = random_slots(SHAPE.blocks * SHAPE.block, LENGTHS * 2, seed=61, holes=holes)
    store_slots, load_slots = slots[: len(LENGTHS)], slots[len(LENGTHS) :]
    stored = [Objects(arena, layout, LENGTHS, 62 + k) for k in range(2)]
    expected = [Objects(arena, layout, LENGTHS, 62 + k) for k in range(2)]
    loaded = [Objects(arena, layout, LENGTHS, 64 + k) for k in range(2)]
    pending = [
        p
        for k in range(2)
        for p in conn.store_and_load_async(
            stored[k].transfers(store_slots), loaded[k].transfers(load_slots)
        )
    ]
    for p in pending:
        p.wait()
    for k in range(2):
        ref.store(expected[k].transfers(store_slots))
        ref.load(loaded[k].transfers(load_slots))
        assert_same_objects(stored[k], expected[k])
    assert_same_caches(conn, ref)


@pytest.mark.parametrize("first_skipped", [False, True], ids=["eager-matches", "eager-overwritten"])
def test_a_loads_first_dma_before_the_call_is_checked_changes_no_byte(device, arena, first_skipped):
    """A whole-chunk load's first DMA is issued before its call is checked or planned. When the
    plan's first piece differs (here the first transfer skips every slot, so the plan leaves it
    out) the batch DMAs its own piece over it; either way the cache ends byte-identical to the
    reference's, alone and in ``store_and_load_async``."""
    layout = make_layout(PagedLayout.FLASH_NHD, torch.bfloat16)
    caches = make_caches(layout, device, seed=50)
    ref = _reference(layout, caches)
    conn = CUDAPagedConnector(caches, layout)
    lengths = [SHAPE.chunk] * 3
    slots = random_slots(SHAPE.blocks * SHAPE.block, lengths * 2, seed=51, holes="none")
    load_slots, store_slots = slots[:3], slots[3:]
    if first_skipped:
        load_slots[0] = torch.full((SHAPE.chunk,), -1, dtype=torch.long)
    fresh, again = Objects(arena, layout, lengths, 52), Objects(arena, layout, lengths, 54)
    conn.load(fresh.transfers(load_slots))
    ref.load(fresh.transfers(load_slots))
    assert_same_caches(conn, ref)
    mine, theirs = Objects(arena, layout, lengths, 53), Objects(arena, layout, lengths, 53)
    for pending in conn.store_and_load_async(
        mine.transfers(store_slots), again.transfers(load_slots)
    ):
        pending.wait()
    ref.store(theirs.transfers(store_slots))
    ref.load(again.transfers(load_slots))
    assert_same_objects(mine, theirs)
    assert_same_caches(conn, ref)
