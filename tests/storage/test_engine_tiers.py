"""CacheEngine over the tiered manager (found through the entry point, as in production): KV
stored by one engine comes back bit-identical into a fresh engine from disk or Redis."""

from __future__ import annotations

import pytest
import torch

from kvtier.core import CacheEngine, KVLayout, load_config
from kvtier.core.platforms.cpu import CPUPlatform
from kvtier.storage.manager import TieredStorageManager

BLOCK, CHUNK, NUM_BLOCKS = 16, 64, 24
LAYOUT = KVLayout(
    num_layers=2,
    num_kv_heads=2,
    head_size=8,
    dtype="bfloat16",
    block_size=BLOCK,
    paged_layout="flash_nhd",
)


def engine(tmp_path, **cfg) -> CacheEngine:
    config = load_config(
        env={},
        overrides={
            "chunk_size": CHUNK,
            "local_cpu_size_gb": 0.01,
            "local_disk_path": str(tmp_path / "disk"),
            "redis_timeout_s": 1.0,
            **cfg,
        },
    )
    e = CacheEngine(config, LAYOUT, model="test/model", platform=CPUPlatform())
    assert isinstance(e.storage, TieredStorageManager)
    return e


def caches(seed: int | None) -> list[torch.Tensor]:
    shape = LAYOUT.expected_cache_shape(NUM_BLOCKS)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]


def round_trip(tmp_path, **cfg) -> None:
    tokens = list(range(1000, 1000 + 3 * CHUNK + 20))
    slots = torch.arange(len(tokens))
    src = caches(0)
    a = engine(tmp_path, **cfg)
    try:
        a.register_kv_caches(src)
        assert a.store(tokens, slots) > 0
        assert a.storage.flush(30)
    finally:
        a.close()
    b = engine(tmp_path, **cfg)
    try:
        dst = caches(None)
        b.register_kv_caches(dst)
        n = b.lookup(tokens)
        assert n >= 3 * CHUNK
        mask = b.retrieve(tokens, slots)
        assert int(mask.sum()) == n
        for s, d in zip(src, dst, strict=True):
            got = d.permute(1, 2, 0, 3, 4).reshape(NUM_BLOCKS * BLOCK, -1)[:n]
            want = s.permute(1, 2, 0, 3, 4).reshape(NUM_BLOCKS * BLOCK, -1)[:n]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert b.storage.stats.get("writeback.chunks") >= 3
    finally:
        b.close()


def test_engine_round_trip_through_disk(tmp_path):
    round_trip(tmp_path, tiers=["local_cpu", "local_disk"])


@pytest.mark.redis
def test_engine_round_trip_through_redis(tmp_path, redis_clean):
    pytest.importorskip("redis", reason="redis-py (kvtier[redis]) is not installed")
    round_trip(tmp_path, tiers=["local_cpu", "redis"], redis_url=redis_clean.url)
