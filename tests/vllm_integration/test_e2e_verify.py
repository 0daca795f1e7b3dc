"""Verification by recompute through real vLLM on CPU: another prompt's KV planted under a
prompt's key (a valid payload) is caught by the first sampled hit, removed and its tier
quarantined, and what is stored afterwards is right; a correct cache under
``verify_fraction=1.0`` raises no alarm across a workload; the metrics reach vLLM's."""

from __future__ import annotations

import pytest
from prompts import DOC, FLUSH, FULL_HIT, OTHER, SHARED, STATS, gen

pytestmark = [pytest.mark.vllm]


def tiers(tmp_path, **kw) -> dict:
    return {
        "chunk_size": 256,
        "tiers": ["local_cpu", "local_disk"],
        "local_cpu_size_gb": 0.05,
        "local_disk_path": str(tmp_path / "disk"),
        **kw,
    }


def metric(rows: list[dict], name: str, **labels: str) -> float:
    return sum(
        r["value"]
        for r in rows
        if r["name"] == f"vllm:kvtier_{name}" and labels.items() <= r["labels"].items()
    )


def test_a_planted_chunk_is_caught_removed_and_stored_again_right(
    run_engine, hit_reference, tmp_path
) -> None:
    quarantine_s = 8
    config = tiers(tmp_path, verify_fraction=1.0, verify_quarantine_s=quarantine_s)
    metrics = {"op": "metrics"}
    out = run_engine(
        {
            "kvtier": config,
            "log_stats": True,
            "steps": [
                gen(OTHER),
                gen(DOC),
                {"op": "plant", "prompt": DOC, "source": OTHER},
                gen(DOC),  # sampled: computed, compared, the planted chunk caught
                FLUSH,
                STATS,
                metrics,
                gen(DOC),  # host memory quarantined: found on disk
                metrics,
                {"op": "sleep", "seconds": quarantine_s},
                gen(DOC),  # the quarantine is over: found in host memory again
                STATS,
                metrics,
            ],
        }
    )
    cold, verified, stats, rows = out[1], out[3], out[5], out[6]
    assert verified == cold, "a verified request is computed, as a cold one"
    assert stats["verify_mismatches"] == 1, "exactly the planted chunk"
    assert stats["verify_chunks"] >= 1, "DOC's other chunk and tail blocks are right"
    assert metric(rows, "verify_mismatches", tier="local_cpu") == 1
    assert metric(rows, "verify_requests") == 1
    assert metric(rows, "verify_tokens") == FULL_HIT

    def hits(rows: list[dict], tier: str) -> float:
        return metric(rows, "lookup_hit_tokens", tier=tier)

    during, after = out[8], out[12]
    assert hits(during, "local_disk") - hits(rows, "local_disk") == FULL_HIT
    assert hits(during, "local_cpu") == hits(rows, "local_cpu"), "quarantined: no host hit"
    assert hits(after, "local_cpu") - hits(during, "local_cpu") == FULL_HIT, "it expired"
    assert out[11]["verify_mismatches"] == 1, "what was stored again is right"
    # Another engine on the same disk, without verification, loads DOC and answers as vLLM's
    # prefix cache does.
    again = run_engine({"kvtier": tiers(tmp_path), "steps": [gen(DOC), STATS]})
    assert again[1]["loaded_tokens"] == FULL_HIT
    assert again[0] == hit_reference["doc"]


def test_a_right_cache_raises_no_alarm_under_full_verification(run_engine, tmp_path) -> None:
    """In vLLM's multiprocess mode (the checks cross from the scheduler's process)."""
    config = tiers(tmp_path, verify_fraction=1.0)
    steps = [gen(DOC), gen(DOC), gen(SHARED), gen(SHARED), gen(OTHER), gen(DOC), FLUSH, STATS]
    out = run_engine({"kvtier": config, "multiprocess": True, "steps": steps})
    stats = out[-1]
    assert stats["verify_mismatches"] == 0
    assert stats["verify_chunks"] >= 3
    assert stats["loaded_tokens"] == 0, "every hit was verified, none loaded"
    print(f"worst error of a right chunk: {stats['verify_worst_ok_ppm'] / 1e6:.2e}")
