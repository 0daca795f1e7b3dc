"""Tensor parallelism 2 through real vLLM on CPU (two worker processes, one core each).

Keys use the engine-local rank, each rank stores and loads its own shard, and the scheduler
counts a hit only where both ranks hold it. The references run vLLM without kvtier in the same
TP mode with its own prefix cache on: DOC cold, DOC again (a hit of the same blocks), SHARED (a
partial hit). A restarted engine hits the disk tier on both ranks; zeroing one rank's chunks
changes the output (both ranks' loaded KV is what attention reads).

TP 2 is also this suite's case of vLLM's multiprocess mode: the scheduler runs in the EngineCore
process, the workers apart from it, so what the scheduler knows of the workers' host memory
comes in their per-step reports and its probe reaches them through vLLM.
"""

from __future__ import annotations

import pytest
from prompts import DOC, FULL_HIT, PARTIAL_HIT, SHARED, gen, loaded_after_each, prefix_cache_hits

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def stats(rank: int) -> dict:
    return {"op": "stats", "rank": rank}


@pytest.fixture(scope="module")
def tp2_reference(run_engine) -> dict[str, dict]:
    """vLLM's own prefix cache, TP 2, no kvtier: DOC cold (``cold``), DOC's full hit (``doc``),
    SHARED's partial hit (``shared``)."""
    return prefix_cache_hits(run_engine, tp=2)


def one_token(r: dict) -> dict:
    return {k: v[:1] for k, v in r.items()}


def test_tp2_cold_warm_and_restart_equal_vllm(run_engine, tp2_reference, tmp_path) -> None:
    """vLLM's default ``kv_load_failure_policy`` ("fail": lookups probe the workers). The first
    repeat comes as soon as a one-token request returned: its save runs after the step, and
    the workers' probe waits for an in-flight save of the same prefix."""
    ref = tp2_reference
    config = {"local_cpu_size_gb": 0.25, "local_disk_path": str(tmp_path / "disk")}
    first_token = {**gen(DOC), "max_tokens": 1}
    first = run_engine(
        {
            "kvtier": config,
            "tp": 2,
            "steps": [
                first_token,
                stats(0),
                first_token,
                stats(0),
                gen(DOC),
                stats(0),
                gen(SHARED),
                stats(0),
                stats(1),
                {"op": "flush", "rank": 0},
                {"op": "flush", "rank": 1},
                {"op": "thread_cpus"},
            ],
        }
    )
    *first, threads = first
    # vLLM binds each rank's worker to its cores; the disk tier's writers and the layer pipe
    # there run on the engine process's other CPUs (core/affinity.py), the saver and the loader
    # where the worker runs.
    for r in threads:
        assert set(r["worker"]) < set(r["parent"]), r  # bound: the case this checks
        others = sorted(set(r["parent"]) - set(r["worker"]))
        cpus = r["kvtier"]
        assert any(n.startswith("kvtier-writer") for n in cpus), r
        assert "kvtier-layers" in cpus, r
        for name, on in cpus.items():
            away = name.startswith(("kvtier-writer", "kvtier-crc", "kvtier-layers"))
            want = others if away else r["worker"]
            assert on == want, (name, r)
    assert first[0:8:2] == [
        one_token(ref["cold"]),
        one_token(ref["doc"]),
        ref["doc"],
        ref["shared"],
    ]
    assert loaded_after_each(first[:8]) == [0, FULL_HIT, FULL_HIT, PARTIAL_HIT]
    assert first[8]["loaded_tokens"] == first[7]["loaded_tokens"]  # rank 1 loaded its shards
    # Each rank is bound to its core: its hits from host memory were copied on the layer pipe.
    assert [s["layer_pipe_loads"] for s in first[7:9]] == [s["load_requests"] for s in first[7:9]]
    assert first[7]["holds"] == first[7]["held_objects"] == 0
    assert first[9:] == [True, True]
    hit = ref["doc"]
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
    cold, hit = tp2_reference["cold"], tp2_reference["doc"]
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
