"""What is the XPU mover's own: whole chunks staged in the objects' layout (at once, or in groups
bounded by ``max_staging_bytes``), layer steps packed through host memory, one stacked op over
every layer where the layers share a buffer and one op per layer where they do not, the staging
memory it keeps, and its stream API. The contract's checks (every layout and option, bad input,
layer-wise timing, two threads) run for every platform in tests/conformance/test_page_mover.py.

Runs on ``KVTIER_TEST_DEVICE`` (cpu here: streams are no-ops; xpu on an Intel GPU).
"""

from __future__ import annotations

import pytest
import torch
from xpu_helpers import (
    GEOMETRIES,
    NUM_BLOCKS,
    SIZES_3,
    Geometry,
    all_pages,
    chunk_blocks,
    make_arena,
    make_caches,
    make_obj,
    transfers_for,
)

from kvtier.core import PlatformError
from kvtier.xpu import StreamAPI, XPUPageMover, XPUPlatform

# whole: the batch staged at once; grouped: a bound of 0, so each chunk is a group of its own;
# off: no buffer kept between calls.
STAGINGS = {"whole": (True, 256 << 20), "grouped": (True, 0), "off": (False, 256 << 20)}
OPS = ["store", "store_layerwise", "load", "load_layerwise"]
LBHNC = GEOMETRIES["LBHNC"]


def make_mover(caches: list[torch.Tensor], geometry: Geometry, staging: str) -> XPUPageMover:
    on, cap = STAGINGS[staging]
    return XPUPlatform().create_mover(
        caches,
        geometry.layout,
        num_blocks=NUM_BLOCKS,
        staging_buffer=on,
        max_staging_bytes=cap,
    )


def kept_bytes(geometry: Geometry, staging: str, op: str, blocks: list[list[int]]) -> int:
    """``staging_nbytes`` after one ``op`` over ``blocks``, per the module docstring: a whole
    op, and a layer-wise load that fits the bound, keep their staging (the batch's moved blocks,
    or the largest chunk's when each chunk is a group); a layer-wise store, and a layer-wise
    load over the bound, stage nothing on the device; none is kept without ``staging_buffer``."""
    lay = geometry.layout
    moved = [sum(b >= 0 for b in chunk) for chunk in blocks]
    per_block = lay.num_layers * lay.page_bytes
    if staging == "off" or op == "store_layerwise":
        return 0
    if staging == "whole":
        return sum(moved) * per_block
    return 0 if op == "load_layerwise" else max(moved) * per_block


@pytest.mark.parametrize("separate", [False, True], ids=["one_buffer", "per_layer_tensors"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("staging", list(STAGINGS))
def test_each_staging_mode_moves_exactly_the_batchs_pages(
    geometry: Geometry, device: torch.device, op: str, staging: str, separate: bool
) -> None:
    """A ragged batch with -1 holes (an all -1 chunk included) moves page for page: a store
    fills exactly the objects' rows of valid blocks, a load writes exactly the valid blocks'
    pages and no other byte of the cache; a layer-wise op yields every layer in order."""
    lay = geometry.layout
    blocks = chunk_blocks(SIZES_3, seed=7, holes=True)
    caches = make_caches(geometry, device, seed=1, separate=separate)
    before = all_pages(caches, geometry)
    arena = make_arena(device)
    objs = [make_obj(arena, lay, len(b), seed=10 + i) for i, b in enumerate(blocks)]
    held = [o.tensor.clone() for o in objs]
    mover = make_mover(caches, geometry, staging)
    assert mover.staging_nbytes == 0

    result = getattr(mover, op)(transfers_for(objs, blocks, device))
    if op.endswith("layerwise"):
        assert list(result) == list(range(lay.num_layers))

    after = all_pages(caches, geometry)
    want_cache = [list(layer) for layer in before]
    for obj, was, chunk in zip(objs, held, blocks, strict=True):
        for i, block in enumerate(chunk):
            for layer in range(lay.num_layers):
                if op.startswith("store"):
                    want = before[layer][block] if block >= 0 else was[i, layer]
                    assert torch.equal(obj.tensor[i, layer], want), (i, layer)
                elif block >= 0:
                    want_cache[layer][block] = was[i, layer]
        if op.startswith("load"):
            assert torch.equal(obj.tensor, was)
    for layer in range(lay.num_layers):
        for block in range(NUM_BLOCKS):
            assert torch.equal(after[layer][block], want_cache[layer][block]), (layer, block)
    assert mover.staging_nbytes == kept_bytes(geometry, staging, op, blocks)
    for o in objs:
        o.release()
    assert arena.used_bytes == 0


@pytest.mark.parametrize("staging", list(STAGINGS))
def test_a_batch_with_nothing_to_move_yields_every_layer_and_stages_nothing(
    geometry: Geometry, device: torch.device, staging: str
) -> None:
    lay = geometry.layout
    caches = make_caches(geometry, device, seed=2)
    before = all_pages(caches, geometry)
    arena = make_arena(device)
    obj = make_obj(arena, lay, 2, seed=3)
    was = obj.tensor.clone()
    mover = make_mover(caches, geometry, staging)
    transfers = transfers_for([obj], [[-1, -1]], device)
    assert list(mover.store_layerwise(transfers)) == list(range(lay.num_layers))
    assert list(mover.load_layerwise(transfers)) == list(range(lay.num_layers))
    mover.store(transfers)
    mover.load(transfers)
    assert torch.equal(obj.tensor, was)
    after = all_pages(caches, geometry)
    assert all(
        torch.equal(a, b)
        for x, y in zip(after, before, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert mover.staging_nbytes == 0
    obj.release()


def test_closing_a_layerwise_store_early_leaves_the_mover_usable(device: torch.device) -> None:
    """A generator closed after its first layer waits for its copies; the next store moves
    the whole batch."""
    geometry = LBHNC
    lay = geometry.layout
    caches = make_caches(geometry, device, seed=4)
    before = all_pages(caches, geometry)
    arena = make_arena(device)
    blocks = chunk_blocks(SIZES_3, seed=5, holes=False)
    objs = [make_obj(arena, lay, len(b), seed=i) for i, b in enumerate(blocks)]
    mover = make_mover(caches, geometry, "whole")
    transfers = transfers_for(objs, blocks, device)
    steps = mover.store_layerwise(transfers)
    assert next(steps) == 0
    steps.close()
    mover.store(transfers)
    for obj, chunk in zip(objs, blocks, strict=True):
        for i, block in enumerate(chunk):
            for layer in range(lay.num_layers):
                assert torch.equal(obj.tensor[i, layer], before[layer][block])


def test_max_staging_bytes_is_checked(device: torch.device) -> None:
    caches = make_caches(LBHNC, device)
    with pytest.raises(ValueError, match="max_staging_bytes"):
        XPUPlatform().create_mover(caches, LBHNC.layout, max_staging_bytes=-1)
    with pytest.raises(TypeError, match="max_staging_bytes"):
        XPUPlatform().create_mover(caches, LBHNC.layout, max_staging_bytes=1.5)


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
