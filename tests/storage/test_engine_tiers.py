"""CacheEngine over the tiered manager (found through the entry point, as in production): KV
stored by one engine comes back bit-identical into a fresh engine from disk or Redis."""

from __future__ import annotations

import pytest
import torch

from fixtures.tiered_engine import CHUNK, caches, per_slot, tiered_engine

NUM_BLOCKS = 24


def round_trip(tmp_path, **cfg) -> None:
    tokens = list(range(1000, 1000 + 3 * CHUNK + 20))
    slots = torch.arange(len(tokens))
    src = caches(0, NUM_BLOCKS)
    a = tiered_engine(tmp_path, **cfg)
    try:
        a.register_kv_caches(src)
        assert a.store(tokens, slots) > 0
        assert a.storage.flush(30)
    finally:
        a.close()
    b = tiered_engine(tmp_path, **cfg)
    try:
        dst = caches(None, NUM_BLOCKS)
        b.register_kv_caches(dst)
        n = b.lookup(tokens)
        assert n >= 3 * CHUNK
        mask = b.retrieve(tokens, slots)
        assert int(mask.sum()) == n
        for s, d in zip(src, dst, strict=True):
            got, want = per_slot(d)[:n], per_slot(s)[:n]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert b.storage.stats.get("writeback.chunks") >= 3
    finally:
        b.close()


def test_engine_round_trip_through_disk(tmp_path):
    round_trip(tmp_path, tiers=["local_cpu", "local_disk"])


@pytest.mark.redis
def test_engine_round_trip_through_redis(tmp_path, redis_clean):
    round_trip(tmp_path, tiers=["local_cpu", "redis"], redis_url=redis_clean.url)
