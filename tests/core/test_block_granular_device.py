# ruff: noqa: F811  (the conformance fixtures are imported by name and taken as parameters)
"""An alias hit loads the first blocks of a stored chunk: a ``Transfer`` of the whole chunk
object whose slots are -1 past the shared blocks. Every platform's device connector (the CPU
reference, XPU on CPU tensors, CUDA through the Triton interpreter) must write exactly the
shared blocks and leave every other slot untouched (the conformance suite's subjects and
oracle)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "conformance"))

from device_cases import SHAPE, Objects, cache_rows, expected_cache_rows, random_slots, same_bytes
from test_device_connector import (  # noqa: F401 (fixtures)
    LAYOUTS,
    MODES,
    arena,
    connect,
    device,
    platform,
    run_load,
    subject,
    supported,
)


@pytest.mark.parametrize("shared_blocks", [1, 2])
@MODES
@LAYOUTS
def test_a_chunk_prefix_load_writes_only_the_shared_blocks(
    subject,
    platform,
    device,
    arena,
    paged,
    mode,
    shared_blocks,
):
    layout = supported(subject, paged)
    conn = connect(platform, subject, layout, device, seed=21)
    slots = random_slots(SHAPE.lengths, seed=22, holes=False, device=device)
    shared = shared_blocks * SHAPE.block
    for s in slots:
        s[shared:] = -1  # the rest of each stored chunk is not the prompt's
    objs = Objects(arena, layout, [int(s.numel()) for s in slots], seed=23)
    before, caches_before = objs.snapshot(), [c.cpu().clone() for c in conn.kv_caches]
    run_load(conn, objs.transfers(slots), mode)
    # the shared slots hold the object's rows; every other slot is untouched
    assert same_bytes(cache_rows(conn), expected_cache_rows(layout, caches_before, before, slots))
    assert same_bytes(objs.snapshot(), before)
