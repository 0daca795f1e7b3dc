"""kvtier's metrics through real vLLM on CPU (in-process engines, ``log_stats`` on).

``llm.get_metrics()`` carries ``vllm:kvtier_*`` series fed by the connector's stats hooks, and
vLLM's own ``vllm:prompt_tokens_cached_by_source`` splits kvtier's hits by tier through
``get_external_cache_hit_sources``: a repeat in the same engine hits host memory; a new engine
on the same disk directory hits the disk. Every number is checked against what the test made
happen (one full hit of DOC: ``FULL_HIT`` tokens), never against a timing.
"""

from __future__ import annotations

import random

import pytest
from prompts import FLUSH

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Block size 32, chunk 256: a 700-token prompt is stored as chunks [0,256) [256,512) and its
# block-aligned tail [512,672); a repeat loads 672 tokens (the last one is always recomputed).
DOC = [random.Random(4321).randrange(3, 3000) for _ in range(700)]
FULL_HIT = (len(DOC) - 1) // 32 * 32

# DOC's hit is stored as two full chunks and its tail block by block (save_unfull_chunk).
HIT_CHUNKS = 2 + (FULL_HIT - 2 * 256) // 32
METRICS = {"op": "metrics", "prefixes": ["vllm:kvtier_", "vllm:prompt_tokens_cached_by_source"]}


def value(rows: list[dict], name: str, **labels: str) -> float:
    """The sum of ``name``'s rows whose labels include ``labels`` (0 if there is none)."""
    return sum(
        r.get("value", 0)
        for r in rows
        if r["name"] == name and all(r["labels"].get(k) == v for k, v in labels.items())
    )


def gen(prompt: list[int]) -> dict:
    return {"op": "generate", "prompt": prompt}


def test_metrics_and_hit_sources_host_then_disk(run_engine, tmp_path) -> None:
    config = {
        "tiers": ["local_cpu", "local_disk"],
        "local_disk_path": str(tmp_path / "disk"),
        "local_cpu_size_gb": 0.25,
    }
    warm = run_engine(
        {
            "kvtier": config,
            "log_stats": True,
            "steps": [gen(DOC), gen(DOC), FLUSH, METRICS],
        }
    )
    assert warm[2] is True
    assert warm[1]["tokens"] == warm[0]["tokens"]  # the hit gives what the cold run computed
    m = warm[3]
    assert {r["labels"].get("tier") for r in m if r["name"] == "vllm:kvtier_lookup_hit_tokens"} == {
        "local_cpu"
    }
    assert value(m, "vllm:kvtier_lookup_hit_tokens", tier="local_cpu") == FULL_HIT
    assert value(m, "vllm:kvtier_loaded_tokens") == FULL_HIT
    assert value(m, "vllm:kvtier_saved_tokens") >= FULL_HIT
    assert value(m, "vllm:kvtier_saved_bytes") > 0
    assert value(m, "vllm:kvtier_hit_chunks", tier="local_cpu") == HIT_CHUNKS
    assert value(m, "vllm:kvtier_host_arena_used_bytes") > 0
    assert value(m, "vllm:kvtier_load_failed_blocks") == 0
    loads = [r for r in m if r["name"] == "vllm:kvtier_load_seconds"]
    assert sum(r["count"] for r in loads) == 1
    assert value(m, "vllm:prompt_tokens_cached_by_source", source="host") == FULL_HIT
    assert value(m, "vllm:prompt_tokens_cached_by_source", source="disk") == 0
    # Labels are bounded: vLLM's model name and engine index, and the tier. No salt, no request.
    assert {k for r in m if r["name"].startswith("vllm:kvtier_") for k in r["labels"]} <= {
        "model_name",
        "engine",
        "tier",
    }

    restarted = run_engine({"kvtier": config, "log_stats": True, "steps": [gen(DOC), METRICS]})
    assert restarted[0]["tokens"] == warm[0]["tokens"]
    m = restarted[1]
    assert value(m, "vllm:kvtier_lookup_hit_tokens", tier="local_disk") == FULL_HIT
    assert value(m, "vllm:kvtier_lookup_hit_tokens", tier="local_cpu") == 0
    assert value(m, "vllm:kvtier_hit_chunks", tier="local_disk") == HIT_CHUNKS
    assert value(m, "vllm:kvtier_loaded_tokens") == FULL_HIT
    assert value(m, "vllm:prompt_tokens_cached_by_source", source="disk") == FULL_HIT
    assert value(m, "vllm:prompt_tokens_cached_by_source", source="host") == 0
