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
    chunk_slots,
    make_arena,
    make_caches,
    make_obj,
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
