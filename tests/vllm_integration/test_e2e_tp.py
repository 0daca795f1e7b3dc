"""Tensor parallelism 2 through real vLLM on CPU (two worker processes, one core each).

Keys use the engine-local rank, each rank stores and loads its own shard, and the scheduler
counts a hit only where both ranks hold it. The references run vLLM without kvtier in the same
TP mode with its own prefix cache on: DOC cold, then DOC again (a hit of the same blocks). A restarted engine hits the disk tier on both ranks; zeroing one rank's chunks
changes the output (both ranks' loaded KV is what attention reads).
"""

from __future__ import annotations

import pytest
from prompts import DOC, FULL_HIT, gen

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def stats(rank: int) -> dict:
    return {"op": "stats", "rank": rank}


@pytest.fixture(scope="module")
def tp2_reference(run_engine) -> tuple[dict, dict]:
    """DOC cold and DOC hit by vLLM's own prefix cache, TP 2, no kvtier."""
    cold, hit = run_engine(
        {"kvtier": None, "tp": 2, "prefix_caching": True, "steps": [gen(DOC), gen(DOC)]}
    )
    return cold, hit


def test_tp2_cold_warm_and_restart_equal_vllm(run_engine, tp2_reference, tmp_path) -> None:
    cold, hit = tp2_reference
    config = {"local_cpu_size_gb": 0.25, "local_disk_path": str(tmp_path / "disk")}
    first = run_engine(
        {
            "kvtier": config,
            "tp": 2,
            "steps": [
                gen(DOC),
                gen(DOC),
                stats(0),
                stats(1),
                {"op": "flush", "rank": 0},
                {"op": "flush", "rank": 1},
            ],
        }
    )
    assert first[:2] == [cold, hit]
    assert [first[2]["loaded_tokens"], first[3]["loaded_tokens"]] == [FULL_HIT, FULL_HIT]
    assert first[4:] == [True, True]
    second = run_engine(
        {
            "kvtier": config,
            "tp": 2,
            "steps": [
                gen(DOC),
                stats(0),
                stats(1),
                {"op": "corrupt_rank", "rank": 1, "prompt": DOC},
                gen(DOC),
                stats(1),
            ],
        }
    )
    assert second[0] == hit  # restart: from disk, on both ranks
    assert [second[1]["loaded_tokens"], second[2]["loaded_tokens"]] == [FULL_HIT, FULL_HIT]
    assert second[3] > 0  # rank 1's chunks zeroed
    assert second[5]["loaded_tokens"] == 2 * FULL_HIT
    assert second[4]["logprobs"] != hit["logprobs"]  # rank 1's KV is what attention read


def test_tp2_hits_answered_by_the_index_load_on_both_ranks(run_engine, tp2_reference) -> None:
    """Under ``kv_load_failure_policy="recompute"`` (``lookup: auto`` -> index) a hit is answered
    from the scheduler's index only where both ranks reported the chunk, and each rank loads its
    own shard without a hold; the outputs equal vLLM's without kvtier in the same TP mode (the hit:
    its prefix cache hitting the same blocks). The host budget is given for the whole engine
    (``local_cpu_size_gb_total``): each rank gets half of it (test_host_budget.py)."""
    cold, hit = tp2_reference
    out = run_engine(
        {
            "kvtier": {"tiers": ["local_cpu"], "local_cpu_size_gb_total": 0.5},
            "tp": 2,
            "load_failure_policy": "recompute",
            "steps": [{"op": "host_tier_gb"}, gen(DOC), gen(DOC), stats(0), stats(1)],
        }
    )
    ranks, *out = out
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["local_cpu_size_gb"] for r in ranks] == [0.25, 0.25]
    assert [r["arena_bytes"] for r in ranks] == [1 << 28, 1 << 28]  # what each rank allocates
    assert out[:2] == [cold, hit]
    for s in out[2:]:
        assert s["loaded_tokens"] == FULL_HIT
        assert s["indexed_loads"] == 1
        assert s["holds"] == s["held_objects"] == 0
