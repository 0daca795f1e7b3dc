"""kvtier under vLLM's asynchronous scheduling (its default on GPUs), through real vLLM on CPU.

vLLM CPU turns asynchronous scheduling off (``CpuPlatform.check_and_update_config``: "async
scheduling is not required on CPU"); the engine runner keeps it on (``force_async_scheduling``)
so vLLM's ``AsyncScheduler`` and the model runner's asynchronous path (the ones GPUs run) drive
kvtier. There, a step is scheduled before the previous step's sampled tokens are known (they
are placeholders in the scheduler), so a save of generated tokens may only store what the
scheduler knows. The reference is vLLM's own prefix cache in the same mode, hitting the same
blocks.
"""

from __future__ import annotations

import pytest
from prompts import DOC, FULL_HIT, OTHER, SHARED, STATS, gen

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ASYNC = {"async_scheduling": True, "force_async_scheduling": True}
DECODED = 80  # DOC (700 tokens) + 80 generated fill the chunk [512, 768)
EXTENDED = 768  # DOC + its first 68 generated tokens
EXTENDED_HIT = (EXTENDED - 1) // 32 * 32  # 736: the chunk of generated tokens is loaded too
STEPS = [
    {**gen(DOC), "max_tokens": DECODED},
    {"op": "generate", "prompt": [], "extend_with_previous": EXTENDED - len(DOC)},
    gen(DOC),
]


def test_hits_under_async_scheduling_equal_vllms_prefix_cache(run_engine) -> None:
    info = {"op": "engine_info"}
    reference = run_engine(
        {
            "kvtier": None,
            "prefix_caching": True,
            "report_cached_tokens": True,
            **ASYNC,
            "steps": [*STEPS, info],
        }
    )
    assert reference[3] == {
        "async_scheduling": True,
        "scheduler": "AsyncScheduler",
        "connector": "NoneType",
        "kv_cache_groups": ["FullAttentionSpec"],
        "block_size": 32,
    }
    assert [r.pop("cached_tokens") for r in reference[:3]] == [0, EXTENDED_HIT, FULL_HIT]
    config = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25, "save_decode_cache": True}
    out = run_engine(
        {
            "kvtier": config,
            **ASYNC,
            "steps": [STEPS[0], STATS, STEPS[1], STATS, STEPS[2], STATS, info],
        }
    )
    assert out[6]["scheduler"] == "AsyncScheduler" and out[6]["connector"] == "KVTierConnector"
    assert [out[0], out[2], out[4]] == reference[:3]
    # DOC's prompt, then the chunk its generated tokens filled: saved only once known
    assert out[1]["saved_tokens"] >= EXTENDED and out[1]["save_errors"] == 0
    assert out[3]["loaded_tokens"] == EXTENDED_HIT
    assert out[5]["loaded_tokens"] - out[3]["loaded_tokens"] == FULL_HIT
    assert out[5]["holds"] == out[5]["held_objects"] == 0


def test_preemption_under_async_scheduling_equals_vllm_without_kvtier(run_engine) -> None:
    """Three prompts in one batch over a KV cache that holds them but not their decoding: vLLM
    preempts (frees a running request's blocks and recomputes it later; here kvtier loads part
    of it back) while steps are scheduled ahead of their sampled tokens. kvtier's saves of
    those blocks are finished or abandoned before the blocks are reused
    (``handle_preemptions``), and the outputs equal vLLM's in the same mode without kvtier."""
    # 13 blocks each at admission (39 of 40); each needs 2 more while decoding: preemption
    prompts = [DOC[:400], OTHER[:400], SHARED[400:] + DOC[:200]]
    batch = {"op": "generate_batch", "prompts": prompts, "max_tokens": 64}
    mode = {
        **ASYNC,
        "prefix_caching": True,
        "num_gpu_blocks_override": 40,
        "max_model_len": 1024,
        "log_stats": True,
    }
    reference = run_engine({"kvtier": None, **mode, "steps": [batch]})
    config = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}
    out = run_engine({"kvtier": config, **mode, "steps": [batch, STATS]})
    assert reference[0]["preemptions"] > 0, "the cache must be too small for the batch"
    assert out[0]["preemptions"] > 0
    assert out[0]["tokens"] == reference[0]["tokens"]
    stats = out[1]
    assert stats["save_errors"] == 0 and stats["saved_tokens"] > 0
    assert stats["holds"] == stats["held_objects"] == 0
