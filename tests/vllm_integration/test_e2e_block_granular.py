"""Block-granular hits through real vLLM on CPU (issue 20): prompts that share a document with a
stored prompt and diverge inside one of its chunks hit every whole block they share, through
the stored chunk's aliases (``kvtier.core.keys.aliases``), from host memory, from disk after a
restart, and through Redis from another engine. Outputs equal vLLM's own prefix cache (no
kvtier, the same mode) hitting the same blocks of the same prompts, tokens and logprobs exactly
(``prompts.py`` explains why a full recompute is not the reference).

Block 32, chunk 256: DOC (700 tokens) is stored as chunks [0,256) [256,512) and tail blocks
[512,672). Each offset is where a second prompt leaves DOC: one block before and one block
after each chunk boundary, inside a chunk off a block boundary, and inside DOC's tail (its tail
blocks, which hit already without aliases). Offsets run in one engine each, in increasing
order: a prompt's own saves share with the next only what DOC shares with both, so every hit
is the offset cut to whole blocks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prompts import DOC, FLUSH, STATS, gen, loaded_after_each

pytestmark = [pytest.mark.vllm]

OFFSETS = [224, 288, 400, 480, 544]
_RNG = random.Random(2026)
SECOND = {d: DOC[:d] + [_RNG.randrange(3, 3000) for _ in range(120)] for d in OFFSETS}


def shared_blocks(d: int) -> int:
    return d - d % 32


def second_steps() -> list[dict]:
    steps: list[dict] = []
    for d in OFFSETS:
        steps += [gen(SECOND[d]), STATS]
    return steps


@pytest.fixture(scope="module")
def expected(run_engine) -> list[dict]:
    """vLLM's own prefix cache, no kvtier, on DOC then the second prompts: each second prompt
    hits the same whole blocks a kvtier hit loads."""
    spec = {"kvtier": None, "prefix_caching": True, "report_cached_tokens": True}
    cached = run_engine({**spec, "steps": [gen(DOC), *map(gen, SECOND.values())]})[1:]
    assert [r.pop("cached_tokens") for r in cached] == [shared_blocks(d) for d in OFFSETS]
    return cached


def check(results: list, expected: list[dict]) -> None:
    """``results``: generate/stats pairs of the second prompts, in ``OFFSETS`` order."""
    assert loaded_after_each(results) == [shared_blocks(d) for d in OFFSETS]
    assert results[0::2] == expected  # tokens and logprobs, exactly
    stats = results[-1]
    assert stats["load_failed_blocks"] == 0 and stats["save_errors"] == 0
    assert stats["holds"] == stats["held_objects"] == 0


def test_second_prompts_hit_every_shared_block_from_host_memory(run_engine, expected) -> None:
    config = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}
    out = run_engine({"kvtier": config, "steps": [gen(DOC), STATS, *second_steps()]})
    assert out[1]["loaded_tokens"] == 0
    check(out[2:], expected)


@pytest.mark.slow
def test_second_prompts_hit_every_shared_block_from_disk_after_a_restart(
    run_engine, expected, tmp_path
) -> None:
    config = {
        "tiers": ["local_cpu", "local_disk"],
        "local_disk_path": str(tmp_path / "disk"),
        "local_cpu_size_gb": 0.25,
    }
    assert run_engine({"kvtier": config, "steps": [gen(DOC), FLUSH]})[1] is True
    check(run_engine({"kvtier": config, "steps": second_steps()}), expected)


@pytest.mark.slow
@pytest.mark.redis
def test_second_prompts_hit_every_shared_block_through_redis_from_another_engine(
    run_engine, expected, redis_clean
) -> None:
    config = {
        "tiers": ["local_cpu", "redis"],
        "redis_url": redis_clean.url,
        "local_cpu_size_gb": 0.25,
    }
    assert run_engine({"kvtier": config, "steps": [gen(DOC), FLUSH]})[1] is True
    check(run_engine({"kvtier": config, "steps": second_steps()}), expected)


# -- the scheduler's index predicts what the worker holds --------------------------------------
U_BLOCK, U_CHUNK = 16, 64


@settings(max_examples=40, deadline=None)
@given(
    stored_len=st.integers(U_CHUNK, 4 * U_CHUNK),
    diverge=st.integers(0, 4 * U_CHUNK),
    tails=st.booleans(),
    salt=st.sampled_from([None, "a"]),
)
def test_the_index_promises_what_the_engine_finds(stored_len, diverge, tails, salt) -> None:
    """Fed the keys a store commits (chunks, tail blocks, aliases), the scheduler's index says
    a diverging prompt hits exactly what the engine's lookup finds; once a probe finds nothing
    (all gone), ``missing_after`` makes the index stop promising chunks, tails and aliases."""
    from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
    from kvtier.core.keys import KeyScope
    from kvtier.core.platform.cpu import CPUPlatform
    from kvtier.vllm_integration.messages import RankReport
    from kvtier.vllm_integration.scheduler.index import PresenceIndex
    from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt

    layout = KVLayout(1, 1, 4, "float32", U_BLOCK, "LBHNC")
    config = load_config(env={}, overrides={"chunk_size": U_CHUNK, "save_unfull_chunk": tails})
    storage = HostMemoryStorageManager(HostArena.create(4 << 20))
    engine = CacheEngine(config, layout, model="m", platform=CPUPlatform(), storage=storage)
    engine.register_kv_caches([torch.zeros(layout.expected_cache_shape(32))])
    added: list[str] = []
    engine.watch_stores(lambda keys: added.extend(k.digest() for k in keys))
    scope = KeyScope(salt, None, None)
    stored = list(range(100, 100 + stored_len))
    engine.store(stored, torch.arange(stored_len), scope=scope)
    keys = engine.keys
    index = PresenceIndex(1)
    namespace = (keys.model, keys.layout_fp, keys.world_size, keys.rank)
    index.apply(RankReport(0, namespace, True, 1 << 16, added))
    other = stored[:diverge] + [7] * U_CHUNK
    hashes = IndexedPrompt(np.asarray(other), scope, U_CHUNK, U_BLOCK, tails=tails)
    found = engine.lookup(other, scope)
    assert hashes.indexed_hit(index) == found
    # everything is gone: the probe finds nothing, and the index stops promising anything
    engine.storage.drop_host()
    assert engine.lookup(other, scope) == 0
    index.forget(0, hashes.missing_after(0), scope)
    assert hashes.indexed_hit(index) == 0
    engine.close()
