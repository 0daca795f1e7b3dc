"""Fault-drill findings: each is a named kvtier error or an accurate message, never a raw error
of a layer below (torch's allocator, the socket layer) or a misleading log line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvtier.core import CacheEngine, ClosedError, HostArena, HostMemoryStorageManager, KVLayout
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_size=8, dtype="bfloat16", block_size=32, paged_layout="LBHNC"
)


def config(**overrides):
    return load_config(
        env={},
        overrides={
            "tiers": ["local_cpu"],
            "chunk_size": 64,
            "local_cpu_size_gb": 0.01,
            **overrides,
        },
    )


def caches(blocks: int = 8) -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.expected_cache_shape(blocks)).to(torch.bfloat16) for _ in range(2)]


def test_host_memory_that_cannot_be_allocated_names_the_field() -> None:
    with pytest.raises(ConfigError, match="local_cpu_size_gb"):
        CacheEngine(config(local_cpu_size_gb=1e9), LAYOUT, model="m")


@pytest.mark.parametrize("own_storage", [False, True])
def test_every_call_after_close_is_a_closed_error(own_storage) -> None:
    storage = HostMemoryStorageManager(HostArena.create(1 << 20)) if own_storage else None
    engine = CacheEngine(config(), LAYOUT, model="m", storage=storage)
    engine.register_kv_caches(caches())
    engine.close()
    tokens = np.arange(64)
    for call in (
        lambda: engine.lookup(tokens),
        lambda: engine.store(tokens, torch.arange(64)),
        lambda: engine.retrieve(tokens, torch.arange(64)),
        lambda: engine.hold(tokens),
    ):
        with pytest.raises(ClosedError, match="close"):
            call()


def test_a_store_while_host_memory_is_still_growing_is_not_reported_as_full(caplog) -> None:
    """A host arena pinned in the background is usable segment by segment: stores tried before
    the first segment is ready are skipped quietly (counted), not logged as "full"."""
    arena = HostArena(torch.empty(1 << 20, dtype=torch.uint8), ready_bytes=0)
    engine = CacheEngine(config(), LAYOUT, model="m", storage=HostMemoryStorageManager(arena))
    engine.register_kv_caches(caches())
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        for i in range(5):
            assert engine.store(np.arange(i, i + 64), torch.arange(64)) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert engine.stats.as_dict()["store_skipped_chunks"] == 5
    engine.close()
