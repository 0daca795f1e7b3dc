"""A model whose every attention layer is sliding window: vLLM runs it with one
``SlidingWindowSpec`` group (with or without its hybrid memory allocator, ``kv_cache_utils``
promotes specs only when kinds are mixed), so ``groups.cache_groups`` takes it as a plain
one-group model. vLLM still frees that group's blocks outside the window and puts its null
block (id 0) in their place, also in a new request's table where its own prefix cache hit
(``SlidingWindowManager.find_longest_cache_hit``), but the one-group path never reads the live
block ids: a save maps those tokens to block 0 and the engine stores its bytes as the chunk.

Known and not fixed yet (the review of e8c6fde): strict xfail, so the fix flips it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sched_harness import request

from kvtier.core.config import load_config
from kvtier.vllm_integration.groups import NULL_BLOCK, cache_groups
from kvtier.vllm_integration.messages import spec_slots
from kvtier.vllm_integration.scheduler.side import SchedulerSide

pytestmark = [pytest.mark.vllm]

BLOCK, CHUNK, WINDOW = 32, 64, 64


def _window_only_config():
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    spec = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=WINDOW
    )
    group = KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(2)], spec)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[group])


@pytest.mark.xfail(
    strict=True,
    reason="one SlidingWindowSpec group goes the one-group path: vLLM's null block is saved",
)
def test_a_window_only_model_never_saves_the_null_block() -> None:
    groups = cache_groups(_window_only_config())
    assert not groups.hybrid  # what routes it past the hybrid path's live ids and fence
    config = load_config(
        env={}, overrides={"chunk_size": CHUNK, "tiers": ["local_cpu"], "verify_fraction": 0.0}
    )
    side = SchedulerSide(
        config, block_size=BLOCK, num_workers=1, load_failure_policy="recompute", groups=groups
    )
    req = request(range(161))
    side.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    # vLLM's prefix cache hit the first 128 tokens: a window group gets its null block for
    # the blocks before the window (find_longest_cache_hit), real blocks for the rest.
    block_ids = [NULL_BLOCK, NULL_BLOCK, 7, 8, 9, 10]
    output = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,), num_computed_tokens=128)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={req.request_id: 33},
    )
    meta = side.build_connector_meta(output)  # type: ignore[arg-type]
    (save,) = meta.saves
    n = len(save.tokens)
    slots = spec_slots(save.block_ids, save.groups, BLOCK, n, save.skip, n)
    stored = slots[slots >= 0]
    assert not (stored // BLOCK == NULL_BLOCK).any(), "tokens mapped into vLLM's null block"
