"""A model whose every attention layer is sliding window: vLLM runs it with one
``SlidingWindowSpec`` group (with or without its hybrid memory allocator, ``kv_cache_utils``
promotes specs only when kinds are mixed), so ``groups.cache_groups`` takes it as a plain
one-group model. vLLM still frees that group's blocks outside the window and puts its null
block (id 0) in their place, also in a new request's table where its own prefix cache hit
(``SlidingWindowManager.find_longest_cache_hit``). So such a model takes the window path of a
hybrid model (``CacheGroups.windows``): live block ids read from vLLM's cache manager each step,
no slot for the null block, the fence for freed blocks. Without it a save mapped those tokens
to block 0 and the engine stored its bytes as the chunk (found in the review of e8c6fde)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prompts import DOC, FULL_HIT, PARTIAL_HIT, SHARED, STATS, gen, loaded_after_each
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


def test_a_window_only_model_never_saves_the_null_block() -> None:
    groups = cache_groups(_window_only_config())
    assert not groups.hybrid and groups.tracked  # one group, but its blocks are freed
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
    live = SimpleNamespace(get_block_ids=lambda rid: (list(block_ids),))
    side.bind_kv_cache_manager(live)  # type: ignore[arg-type]
    output = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,), num_computed_tokens=128)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={req.request_id: 33},
        total_num_scheduled_tokens=33,
    )
    meta = side.build_connector_meta(output)  # type: ignore[arg-type]
    (save,) = meta.saves
    n = len(save.tokens)
    slots = spec_slots(save.block_ids, save.groups, [BLOCK], n, save.skip, n)
    stored = slots[slots >= 0]
    assert not (stored // BLOCK == NULL_BLOCK).any(), "tokens mapped into vLLM's null block"
    assert save.skip == CHUNK  # chunk [0, 64) lost its window blocks: not asked for


def test_a_window_only_model_hits_as_vllms_prefix_cache(run_engine, window_model_dir) -> None:
    """Through real vLLM: a Gemma 3 whose every layer has a 64-token window (one
    ``SlidingWindowSpec`` group). A full (672) and a partial (384) hit load only the window
    blocks vLLM gives the request (two blocks before the hit's end), and answer as vLLM's own
    prefix cache hitting the same blocks (``prefix_cache_retention_interval=None``)."""
    model = str(window_model_dir)
    info = {"op": "engine_info"}
    ref_spec = {"model": model, "kvtier": None, "prefix_caching": True,
                "prefix_cache_retention_interval": None, "report_cached_tokens": True}  # fmt: skip
    ref_info, *ref = run_engine({**ref_spec, "steps": [info, gen(DOC), gen(DOC), gen(SHARED)]})
    assert ref_info["kv_cache_groups"] == ["SlidingWindowSpec"]
    assert [r.pop("cached_tokens") for r in ref] == [0, FULL_HIT, PARTIAL_HIT]
    kvtier = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}
    steps = [gen(DOC), STATS, gen(DOC), STATS, gen(SHARED), STATS]
    out = run_engine({"model": model, "kvtier": kvtier, "steps": steps})
    assert out[0::2] == ref
    assert loaded_after_each(out) == [0, 2 * BLOCK, 2 * BLOCK]  # the window's blocks only
    assert out[-1]["load_failed_blocks"] == 0 and out[-1]["save_errors"] == 0
