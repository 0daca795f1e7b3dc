"""The XPU connector's data path, against core's reference connector and the raw paged tensors.

Runs on ``KVTIER_TEST_DEVICE`` (cpu here: streams are no-ops; xpu on an Intel GPU: the same
tests drive real streams, events, pinned memory and non-blocking copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from xpu_helpers import (
    BLOCK,
    NUM_BLOCKS,
    SIZES_3,
    bits,
    chunk_slots,
    make_arena,
    make_caches,
    make_obj,
    obj_token,
    token_value,
    transfers_for,
)

from kvtier.core import KVLayout, PagedLayout, PlatformError, TorchPagedConnector, Transfer
from kvtier.xpu import StreamAPI, XPUPagedConnector

SIZES = SIZES_3
MODES = ("whole", "layerwise", "per_layer")


# whole: objects staged whole on the device (one copy per chunk); layer: one layer at a time
# (the path of batches over max_staging_bytes); off: no staging buffer.
STAGINGS = {"whole": (True, 256 << 20), "layer": (True, 0), "off": (False, 0)}
STAGING = pytest.mark.parametrize("staging", sorted(STAGINGS))


def make_conn(caches: list[torch.Tensor], layout: KVLayout, staging: str) -> XPUPagedConnector:
    on, cap = STAGINGS[staging]
    return XPUPagedConnector(caches, layout, staging_buffer=on, max_staging_bytes=cap)


def sizes_of(slots: Sequence[Sequence[int]]) -> list[int]:
    return [len(s) for s in slots]


def run_store(conn: TorchPagedConnector, transfers: list[Transfer], mode: str) -> None:
    layers = conn.layout.num_layers
    if mode == "whole":
        conn.store(transfers)
    elif mode == "layerwise":
        assert list(conn.store_layerwise(transfers)) == list(range(layers))
    else:
        for layer in range(layers):
            conn.store_layer(layer, transfers)


def run_load(conn: TorchPagedConnector, transfers: list[Transfer], mode: str) -> None:
    layers = conn.layout.num_layers
    if mode == "whole":
        conn.load(transfers)
    elif mode == "layerwise":
        assert list(conn.load_layerwise(transfers)) == list(range(layers))
    else:
        for layer in range(layers):
            conn.load_layer(layer, transfers)


@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
@pytest.mark.parametrize("mode", MODES)
@STAGING
def test_store_is_bit_identical_to_reference(
    layout: KVLayout, device: torch.device, staging: str, mode: str, holes: bool
) -> None:
    slots = chunk_slots(SIZES, seed=1, holes=holes)
    caches = make_caches(layout, device)
    arena, ref_arena = make_arena(device), make_arena(torch.device("cpu"))
    objs = [make_obj(arena, layout, n, seed=10 + i) for i, n in enumerate(sizes_of(slots))]
    ref_objs = [make_obj(ref_arena, layout, n, seed=10 + i) for i, n in enumerate(sizes_of(slots))]
    before = [o.tensor.clone() for o in objs]

    conn = make_conn(caches, layout, staging)
    run_store(conn, transfers_for(objs, slots, device), mode)
    ref = TorchPagedConnector([c.cpu() for c in caches], layout)
    ref.store(transfers_for(ref_objs, slots, torch.device("cpu")))

    for obj, ref_obj, old, s in zip(objs, ref_objs, before, slots, strict=True):
        assert torch.equal(bits(obj.tensor), bits(ref_obj.tensor))
        for layer in range(layout.num_layers):
            for i, slot in enumerate(s):
                want = old if slot < 0 else None
                got = obj_token(obj, layout, layer, i)
                if want is not None:  # a -1 row is left as it was
                    assert torch.equal(bits(got), bits(obj_token_of(old, layout, layer, i)))
                else:
                    assert torch.equal(bits(got), bits(token_value(caches[layer], layout, slot)))
    for o in objs + ref_objs:
        o.release()
    assert arena.used_bytes == 0


def obj_token_of(t: torch.Tensor, layout: KVLayout, layer: int, i: int) -> torch.Tensor:
    return t[layer, i] if layout.use_mla else t[:, layer, i]


@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
@pytest.mark.parametrize("mode", MODES)
@STAGING
def test_load_is_bit_identical_to_reference(
    layout: KVLayout, device: torch.device, staging: str, mode: str, holes: bool
) -> None:
    slots = chunk_slots(SIZES, seed=2, holes=holes)
    caches = make_caches(layout, device, seed=3)
    originals = [c.cpu().clone() for c in caches]
    arena = make_arena(device)
    objs = [make_obj(arena, layout, n, seed=20 + i) for i, n in enumerate(sizes_of(slots))]

    conn = make_conn(caches, layout, staging)
    run_load(conn, transfers_for(objs, slots, device), mode)
    ref_caches = [c.clone() for c in originals]
    ref = TorchPagedConnector(ref_caches, layout)
    ref.load(transfers_for(objs, slots, torch.device("cpu")))

    written = {slot for s in slots for slot in s if slot >= 0}
    for layer in range(layout.num_layers):
        assert torch.equal(bits(caches[layer]), bits(ref_caches[layer]))
        for obj, s in zip(objs, slots, strict=True):
            for i, slot in enumerate(s):
                if slot >= 0:
                    want = obj_token(obj, layout, layer, i)
                    assert torch.equal(bits(token_value(caches[layer], layout, slot)), bits(want))
        for slot in set(range(NUM_BLOCKS * BLOCK)) - written:  # nothing else is touched
            assert torch.equal(
                bits(token_value(caches[layer], layout, slot)),
                bits(token_value(originals[layer], layout, slot)),
            )
    for o in objs:
        o.release()
    assert arena.used_bytes == 0


@pytest.mark.parametrize("mode", MODES)
@STAGING
def test_round_trip_into_other_slots(
    layout: KVLayout, device: torch.device, staging: str, mode: str
) -> None:
    """Store from one set of slots, wipe the cache, load into another: the KV bytes follow."""
    src = chunk_slots(SIZES, seed=4, holes=False)
    dst = chunk_slots(SIZES, seed=5, holes=False)
    caches = make_caches(layout, device, seed=6)
    originals = [c.cpu().clone() for c in caches]
    arena = make_arena(device)
    objs = [make_obj(arena, layout, n, seed=0) for n in SIZES]
    conn = make_conn(caches, layout, staging)
    run_store(conn, transfers_for(objs, src, device), mode)
    for c in caches:
        c.zero_()
    run_load(conn, transfers_for(objs, dst, device), mode)
    for layer in range(layout.num_layers):
        for s_chunk, d_chunk in zip(src, dst, strict=True):
            for s, d in zip(s_chunk, d_chunk, strict=True):
                assert torch.equal(
                    bits(token_value(caches[layer], layout, d)),
                    bits(token_value(originals[layer], layout, s)),
                )
    for o in objs:
        o.release()
    assert arena.used_bytes == 0


@pytest.mark.parametrize("op", ["store", "store_layerwise", "load", "load_layerwise"])
def test_staging_moves_all_chunks_in_one_op_per_layer(
    layout: KVLayout, device: torch.device, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With staging, one gather (store) or one scatter (load) per layer covers every chunk,
    through a buffer of the documented size; without it, one per chunk per layer, no buffer."""
    slots = chunk_slots(SIZES, seed=7, holes=True)
    live = [s for s in slots if any(x >= 0 for x in s)]
    valid_tokens = sum(1 for s in slots for x in s if x >= 0)
    all_tokens = sum(len(s) for s in live)
    layer_bytes = layout.chunk_nbytes(1) // layout.num_layers
    expect_bytes = {  # (staging) -> staging_nbytes after the op
        "whole": layout.chunk_nbytes(all_tokens) if op == "load"
        else layer_bytes * (valid_tokens if op.startswith("store") else all_tokens),
        "layer": layer_bytes * (valid_tokens if op.startswith("store") else all_tokens),
        "off": 0,
    }
    for staging in STAGINGS:
        caches = make_caches(layout, device)
        arena = make_arena(device)
        objs = [make_obj(arena, layout, n, seed=i) for i, n in enumerate(sizes_of(slots))]
        conn = make_conn(caches, layout, staging)
        count = {"gather": 0, "_gather_into": 0, "scatter": 0}
        for name in count:
            real = getattr(conn, name)

            def spy(*a: object, _real=real, _name=name, _count=count) -> object:
                _count[_name] += 1
                return _real(*a)

            monkeypatch.setattr(conn, name, spy)
        transfers = transfers_for(objs, slots, device)
        result = getattr(conn, op)(transfers)
        if op.endswith("layerwise"):
            assert list(result) == list(range(layout.num_layers))
        per_layer = 1 if staging != "off" else len(live)
        # (_gather_into may itself go through gather: count the outer call)
        moves = count["scatter"] if op.startswith("load") else count["_gather_into"] or count["gather"]
        assert moves == layout.num_layers * per_layer, (staging, count)
        assert conn.staging_nbytes == expect_bytes[staging], staging
        for o in objs:
            o.release()
        assert arena.used_bytes == 0


@STAGING
def test_layerwise_load_lands_layer_by_layer(
    layout: KVLayout, device: torch.device, staging: str
) -> None:
    slots = chunk_slots(SIZES, seed=8, holes=False)
    caches = make_caches(layout, device)
    originals = [c.cpu().clone() for c in caches]
    arena = make_arena(device)
    objs = [make_obj(arena, layout, n, seed=30 + i) for i, n in enumerate(SIZES)]
    conn = make_conn(caches, layout, staging)
    slot0 = slots[0][0]
    for layer in conn.load_layerwise(transfers_for(objs, slots, device)):
        # Read on the engine's (current) stream: it waits for this layer's event.
        for seen in range(layout.num_layers):
            got = bits(token_value(caches[seen], layout, slot0))
            if seen <= layer:
                assert torch.equal(got, bits(obj_token(objs[0], layout, seen, 0)))
            else:
                assert torch.equal(got, bits(token_value(originals[seen], layout, slot0)))
    for o in objs:
        o.release()


@STAGING
def test_layerwise_store_captures_each_layer_before_the_engine_overwrites_it(
    layout: KVLayout, device: torch.device, staging: str
) -> None:
    slots = chunk_slots(SIZES, seed=9, holes=False)
    caches = make_caches(layout, device, seed=11)
    originals = [c.cpu().clone() for c in caches]
    arena = make_arena(device)
    objs = [make_obj(arena, layout, n, seed=0) for n in SIZES]
    conn = make_conn(caches, layout, staging)
    for layer in conn.store_layerwise(transfers_for(objs, slots, device)):
        caches[layer].fill_(7.0)  # the engine reuses the layer's blocks right away
    for layer in range(layout.num_layers):
        for obj, s in zip(objs, slots, strict=True):
            for i, slot in enumerate(s):
                assert torch.equal(
                    bits(obj_token(obj, layout, layer, i)),
                    bits(token_value(originals[layer], layout, slot)),
                )
    for o in objs:
        o.release()


@STAGING
def test_closing_a_layerwise_load_early_stops_cleanly(
    layout: KVLayout, device: torch.device, staging: str
) -> None:
    slots = chunk_slots(SIZES, seed=12, holes=False)
    caches = make_caches(layout, device)
    originals = [c.cpu().clone() for c in caches]
    arena = make_arena(device)
    objs = [make_obj(arena, layout, n, seed=40 + i) for i, n in enumerate(SIZES)]
    conn = make_conn(caches, layout, staging)
    gen = conn.load_layerwise(transfers_for(objs, slots, device))
    assert next(gen) == 0
    gen.close()  # the copies it issued are complete: the objects may go now
    for o in objs:
        o.release()
    assert arena.used_bytes == 0
    for layer in range(1, layout.num_layers):
        assert torch.equal(bits(caches[layer]), bits(originals[layer]))


def test_all_minus_one_transfers_move_nothing(layout: KVLayout, device: torch.device) -> None:
    caches = make_caches(layout, device)
    originals = [c.cpu().clone() for c in caches]
    arena = make_arena(device)
    obj = make_obj(arena, layout, 8, seed=1)
    before = obj.tensor.clone()
    conn = XPUPagedConnector(caches, layout)
    t = transfers_for([obj], [[-1] * 8], device)
    conn.store(t)
    conn.load(t)
    assert list(conn.load_layerwise(t)) == list(range(layout.num_layers))
    assert torch.equal(bits(obj.tensor), bits(before))
    for c, o in zip(caches, originals, strict=True):
        assert torch.equal(bits(c), bits(o))
    assert conn.staging_nbytes == 0
    obj.release()


def test_stream_api_on_cpu_is_synchronous_and_unknown_devices_are_refused() -> None:
    api = StreamAPI(torch.device("cpu"))
    assert not api.is_async
    s = api.new_stream()
    with api.use(s):
        s.wait_stream(api.current_stream())
        api.current_stream().wait_event(s.record_event())
        s.synchronize()
    with pytest.raises(PlatformError, match="no stream API"):
        StreamAPI(torch.device("meta"))


def test_connector_refuses_a_cache_that_does_not_match_the_layout(device: torch.device) -> None:
    layout = KVLayout(2, 2, 8, "bfloat16", BLOCK, PagedLayout.FLASH_NHD)
    wrong = torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="does not match"):
        XPUPagedConnector([wrong, wrong], layout)
