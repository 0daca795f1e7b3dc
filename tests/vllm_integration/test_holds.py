"""The worker's lookup holds (``holds.HoldTable``) over a real CacheEngine on the CPU platform:
a held prefix is loaded byte for byte after its chunks were evicted, holds are reused, replaced,
released and expired as the scheduler's decisions say, and nothing stays pinned afterwards."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from kvtier.core import (
    CacheEngine,
    HostArena,
    HostMemoryStorageManager,
    KVLayout,
    PagedLayout,
    load_config,
)
from kvtier.core.memory import MemoryObjMeta
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.vllm_integration.worker.holds import HoldTable

BLOCK, CHUNK, NUM_BLOCKS = 16, 64, 16
TTL = 10.0
PROMPT = np.arange(100, 228, dtype=np.int64)  # 128 tokens: two full chunks
OTHER = np.arange(500, 628, dtype=np.int64)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup():
    layout = KVLayout(
        num_layers=2,
        num_kv_heads=2,
        head_size=8,
        dtype="bfloat16",
        block_size=BLOCK,
        paged_layout=PagedLayout.LBHNC,
    )
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"]})
    chunk_bytes = math.prod(layout.chunk_shape(CHUNK)) * 2
    arena = HostArena.create(6 * chunk_bytes)
    engine = CacheEngine(
        config, layout, model="m", platform=CPUPlatform(), storage=HostMemoryStorageManager(arena)
    )
    g = torch.Generator().manual_seed(0)
    shape = layout.expected_cache_shape(NUM_BLOCKS)
    caches = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2)]
    engine.register_kv_caches(caches)
    slots = torch.arange(len(PROMPT))  # blocks 0-7
    engine.store(PROMPT, slots)
    engine.store(OTHER, slots + len(PROMPT))  # blocks 8-15
    clock = Clock()
    table = HoldTable(engine, TTL, clock=clock)
    yield engine, table, clock, caches, arena
    table.close()
    engine.close()
    assert arena.used_bytes == 0  # every hold and stored chunk was released


def fill_tier(engine: CacheEngine, count: int = 20) -> None:
    """Put ``count`` other chunks (as other requests' saves do): far more than host memory holds."""
    meta = MemoryObjMeta(engine.layout.chunk_shape(CHUNK), engine.layout.chunk_dtype, CHUNK)
    for _ in range(count):
        obj = engine.storage.allocate(meta)
        assert obj is not None
        with obj:
            engine.storage.put(engine.keys.key(os.urandom(16)), obj)


def test_a_held_prefix_survives_eviction_and_loads_after_leaving_the_tier(setup) -> None:
    """Eviction skips held chunks (dropping them would free no bytes), so other requests' saves
    leave a held prefix found; and when a tier loses it anyway (here: removed from the host
    index directly, as a lower tier's own eviction or a restart can), the hold still loads it
    byte for byte."""
    engine, table, _, caches, _ = setup
    assert table.lookup("r1", 0, PROMPT, None) == len(PROMPT)
    assert table.stats()["held_objects"] == 2
    fill_tier(engine)
    assert engine.lookup(PROMPT) == len(PROMPT)
    assert engine.lookup(OTHER) == 0  # not held: evicted by the saves
    engine.storage._index.remove([s.key for s in engine.store_spans(PROMPT)])  # type: ignore[attr-defined]
    assert engine.lookup(PROMPT) == 0
    ref = [c[:8].clone() for c in caches]
    for c in caches:
        c.zero_()
    hold = table.take("r1", 0)
    assert hold is not None and table.take("r1", 0) is None
    try:
        mask = engine.retrieve(PROMPT, torch.arange(len(PROMPT)), hold=hold)
    finally:
        hold.release()
    assert bool(mask.all())
    for c, r in zip(caches, ref, strict=True):
        assert torch.equal(c[:8], r)
    assert table.stats()["holds"] == table.stats()["held_objects"] == 0


def test_reuse_replace_and_release_follow_the_scheduler(setup) -> None:
    _, table, _, _, _ = setup
    assert table.lookup("r1", 0, PROMPT, None) == 128
    assert table.lookup("r1", 0, PROMPT, None) == 128  # vLLM asked again: same hold
    assert table.stats() == {
        "holds": 1,
        "held_objects": 2,
        "held_tokens": 128,
        "hold_expiries": 0,
        "hold_reuses": 1,
    }
    # Other tokens, salt or hold id under the same request: the old hold goes.
    assert table.lookup("r1", 0, OTHER[:64], None) == 64
    assert table.stats()["held_objects"] == 1
    assert table.lookup("r1", 0, OTHER[:64], "tenant") == 0
    assert table.lookup("r1", 1, PROMPT, None) == 128
    assert table.stats()["held_objects"] == 2
    table.release("r1", 0)  # a stale decision about an older hold leaves the new one
    assert table.stats()["holds"] == 1
    table.release("r1", 1)
    assert table.stats()["holds"] == 0
    table.lookup("r2", 2, PROMPT, None)
    table.lookup("r3", 3, OTHER, None)
    table.release_requests({"r2", "r3", "never-looked-up"})
    assert table.stats()["holds"] == table.stats()["held_objects"] == 0


def test_holds_expire_after_the_ttl_unless_looked_up_again(setup) -> None:
    _, table, clock, _, _ = setup
    table.lookup("r1", 0, PROMPT, None)
    table.lookup("r2", 1, OTHER, None)
    clock.now = TTL * 0.75
    table.lookup("r1", 0, PROMPT, None)  # still waiting: refreshed
    clock.now = TTL * 1.5
    assert table.expire() == 1
    assert table.take("r2", 1) is None
    stats = table.stats()
    assert (stats["holds"], stats["held_objects"], stats["hold_expiries"]) == (1, 2, 1)
    clock.now = TTL * 2
    assert table.expire() == 1
    assert table.stats()["holds"] == 0 and table.stats()["hold_expiries"] == 2


def test_ttl_must_be_positive(setup) -> None:
    engine = setup[0]
    with pytest.raises(ValueError, match="ttl_s"):
        HoldTable(engine, 0)
