"""What is the XPU connector's own: one gather/scatter per layer through its staging buffers, and
its stream API. The byte-exact data path (every layout, mode, -1 slots, two threads) is checked
for every platform by tests/conformance/test_device_connector.py.

Runs on ``KVTIER_TEST_DEVICE`` (cpu here: streams are no-ops; xpu on an Intel GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from xpu_helpers import (
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

from kvtier.core import KVLayout, PlatformError
from kvtier.xpu import StreamAPI, XPUPagedConnector

SIZES = SIZES_3


# whole: objects staged whole on the device (one copy per chunk); layer: one layer at a time
# (the path of batches over max_staging_bytes); off: no staging buffer.
STAGINGS = {"whole": (True, 256 << 20), "layer": (True, 0), "off": (False, 0)}


def make_conn(caches: list[torch.Tensor], layout: KVLayout, staging: str) -> XPUPagedConnector:
    on, cap = STAGINGS[staging]
    return XPUPagedConnector(caches, layout, staging_buffer=on, max_staging_bytes=cap)


def sizes_of(slots: Sequence[Sequence[int]]) -> list[int]:
    return [len(s) for s in slots]


@pytest.mark.parametrize("op", ["store", "store_layerwise", "load", "load_layerwise"])
@pytest.mark.parametrize("staging", sorted(STAGINGS))
def test_each_staging_mode_moves_the_batch_and_keeps_the_documented_buffer(
    layout: KVLayout, device: torch.device, op: str, staging: str
) -> None:
    """Every staging mode moves a ragged batch with -1 holes (an all -1 chunk included) byte for
    byte, a layer-wise op yields every layer in order, and afterwards ``staging_nbytes`` is the
    size the module docstring gives: whole loads stage every live chunk's object; stores and
    layer-wise loads one layer of the batch's tokens (stores only the valid ones); off, none.
    How many device ops a layer costs is a speed question: ``kvtier bench xpu`` measures it."""
    slots = chunk_slots(SIZES, seed=7, holes=True)
    live = [s for s in slots if any(x >= 0 for x in s)]
    valid_tokens = sum(1 for s in slots for x in s if x >= 0)
    all_tokens = sum(len(s) for s in live)
    layer_bytes = layout.chunk_nbytes(1) // layout.num_layers
    storing = op.startswith("store")
    expect_bytes = {
        "whole": layout.chunk_nbytes(all_tokens)
        if op == "load"
        else layer_bytes * (valid_tokens if storing else all_tokens),
        "layer": layer_bytes * (valid_tokens if storing else all_tokens),
        "off": 0,
    }[staging]
    caches = make_caches(layout, device)
    arena = make_arena(device)
    objs = [make_obj(arena, layout, n, seed=i) for i, n in enumerate(sizes_of(slots))]
    conn = make_conn(caches, layout, staging)
    assert conn.staging_nbytes == 0

    result = getattr(conn, op)(transfers_for(objs, slots, device))
    if op.endswith("layerwise"):
        assert list(result) == list(range(layout.num_layers))

    for obj, chunk in zip(objs, slots, strict=True):
        for i, slot in enumerate(chunk):
            if slot < 0:
                continue
            for layer in range(layout.num_layers):
                assert torch.equal(
                    bits(obj_token(obj, layout, layer, i)),
                    bits(token_value(caches[layer], layout, slot)),
                ), (slot, layer)
    assert conn.staging_nbytes == expect_bytes
    for o in objs:
        o.release()
    assert arena.used_bytes == 0


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
