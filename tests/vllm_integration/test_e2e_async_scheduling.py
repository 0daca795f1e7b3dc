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
from prompts import DOC, FULL_HIT, STATS, gen

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
