"""The XPU platform end to end through CacheEngine: store, wipe, retrieve into other slots."""

from __future__ import annotations

import pytest
import torch
from xpu_helpers import BLOCK, NUM_BLOCKS, bits, make_caches, token_value

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.xpu import XPUPagedConnector, XPUPlatform

CHUNK = 16
N_TOKENS = 40  # two full chunks and a partial (block-aligned) one


def _engine(layout: KVLayout, device: torch.device, staging: bool) -> tuple[CacheEngine, HostArena]:
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
        cfg, layout, model="m", platform=platform, storage=HostMemoryStorageManager(arena)
    )
    return engine, arena


def _slots(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:N_TOKENS]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("staging", [True, False], ids=["staging", "no_staging"])
def test_engine_round_trip(
    layout: KVLayout, device: torch.device, staging: bool, layerwise: bool
) -> None:
    engine, arena = _engine(layout, device, staging)
    caches = make_caches(layout, device, seed=1)
    originals = [c.cpu().clone() for c in caches]
    engine.register_kv_caches(caches)
    assert isinstance(engine.connector, XPUPagedConnector)
    tokens = list(range(1000, 1000 + N_TOKENS))
    src, dst = _slots(1), _slots(2)

    if layerwise:
        layers = list(engine.store_layerwise(tokens, src.to(device)))
        assert layers == list(range(layout.num_layers))
    else:
        assert engine.store(tokens, src.to(device)) == N_TOKENS
    assert engine.lookup(tokens) == N_TOKENS

    for c in caches:
        c.zero_()
    # The engine already holds the first block: those slots are -1 and must stay untouched.
    dst_mapping = dst.clone()
    dst_mapping[:BLOCK] = -1
    if layerwise:
        job = engine.retrieve_layerwise(tokens, dst_mapping.to(device))
        mask = job.mask
        assert list(job.layers) == list(range(layout.num_layers))
    else:
        mask = engine.retrieve(tokens, dst_mapping.to(device))
    assert mask.tolist() == [False] * BLOCK + [True] * (N_TOKENS - BLOCK)

    for layer in range(layout.num_layers):
        for i in range(N_TOKENS):
            got = token_value(caches[layer], layout, int(dst[i]))
            want = (
                token_value(originals[layer], layout, int(src[i]))
                if i >= BLOCK
                else torch.zeros_like(got)
            )
            assert torch.equal(bits(got), bits(want)), (layer, i)
    assert engine.stats.retrieved_tokens == N_TOKENS - BLOCK
    engine.close()
    assert arena.used_bytes == 0
