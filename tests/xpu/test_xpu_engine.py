"""The XPU platform end to end through CacheEngine: store, wipe, retrieve into other blocks."""

from __future__ import annotations

import pytest
import torch
from xpu_helpers import BLOCK, NUM_BLOCKS, Geometry, all_pages, make_caches, storage_bytes

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, load_config
from kvtier.xpu import XPUPageMover, XPUPlatform

CHUNK = 16
N_BLOCKS = 10  # two full chunks of 4 blocks and a partial one of 2
N_TOKENS = N_BLOCKS * BLOCK


def _engine(
    geometry: Geometry, device: torch.device, staging: bool
) -> tuple[CacheEngine, HostArena]:
    cfg = load_config(
        env={},
        overrides={
            "chunk_size": CHUNK,
            "tiers": ["local_cpu"],
            "device_staging_buffer": staging,
        },
    )
    platform = XPUPlatform(device.index) if device.type == "xpu" else XPUPlatform()
    arena = platform.create_arena(1 << 20, pin_memory=True)
    engine = CacheEngine(
        cfg, geometry.layout, model="m", platform=platform, storage=HostMemoryStorageManager(arena)
    )
    return engine, arena


def _blocks(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS, generator=g)[:N_BLOCKS].tolist()


def _slots(blocks: list[int]) -> torch.Tensor:
    """Token slots of whole blocks, in order (as vLLM's block table maps them)."""
    return (torch.tensor(blocks).unsqueeze(1) * BLOCK + torch.arange(BLOCK)).reshape(-1)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("staging", [True, False], ids=["staging", "no_staging"])
def test_engine_round_trip(
    geometry: Geometry, device: torch.device, staging: bool, layerwise: bool
) -> None:
    lay = geometry.layout
    engine, arena = _engine(geometry, device, staging)
    caches = make_caches(geometry, device, seed=1)
    originals = all_pages(caches, geometry)
    engine.register_kv_caches(caches)
    assert isinstance(engine.mover, XPUPageMover)
    tokens = list(range(1000, 1000 + N_TOKENS))
    src, dst = _blocks(1), _blocks(2)

    if layerwise:
        layers = list(engine.store_layerwise(tokens, _slots(src).to(device)))
        assert layers == list(range(lay.num_layers))
    else:
        assert engine.store(tokens, _slots(src).to(device)) == N_TOKENS
    assert engine.lookup(tokens) == N_TOKENS

    storage_bytes(caches[0]).zero_()
    zero = all_pages(caches, geometry)
    # The engine already holds the first block: its slots are -1 and it must stay untouched.
    dst_mapping = _slots(dst)
    dst_mapping[:BLOCK] = -1
    if layerwise:
        job = engine.retrieve_layerwise(tokens, dst_mapping.to(device))
        mask = job.mask
        assert list(job.layers) == list(range(lay.num_layers))
    else:
        mask = engine.retrieve(tokens, dst_mapping.to(device))
    assert mask.tolist() == [False] * BLOCK + [True] * (N_TOKENS - BLOCK)

    pages = all_pages(caches, geometry)
    for layer in range(lay.num_layers):
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            want = originals[layer][s] if i else zero[layer][d]
            assert torch.equal(pages[layer][d], want), (layer, i)
    assert engine.stats.retrieved_tokens == N_TOKENS - BLOCK
    engine.close()
    assert arena.used_bytes == 0
