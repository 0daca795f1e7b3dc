"""vLLM's ``kv_role`` through real vLLM on CPU: a producer (a prefill instance) saves and never
loads, a consumer (a decode instance) loads what a producer stored and never saves, over a
shared disk tier. Outputs equal vLLM's own prefix cache hitting the same blocks."""

from __future__ import annotations

import pytest
from prompts import DOC, FLUSH, FULL_HIT, OTHER, STATS, gen

pytestmark = [pytest.mark.vllm]


def shared_disk(tmp_path) -> dict:
    return {
        "chunk_size": 256,
        "tiers": ["local_cpu", "local_disk"],
        "local_cpu_size_gb": 0.05,
        "local_disk_path": str(tmp_path / "disk"),
    }


def test_producer_saves_and_consumer_loads(run_engine, hit_reference, tmp_path) -> None:
    config = shared_disk(tmp_path)
    producer = run_engine(
        {
            "kvtier": config,
            "kv_role": "kv_producer",
            "steps": [gen(DOC), gen(DOC), FLUSH, STATS],
        }
    )
    stats = producer[3]
    assert stats["saved_tokens"] > 0, "a producer saves"
    assert stats["loaded_tokens"] == 0 and stats["load_requests"] == 0, "a producer never loads"
    # DOC comes from the producer's chunks; OTHER is new, and a consumer still does not save it
    consumer = run_engine(
        {"kvtier": config, "kv_role": "kv_consumer", "steps": [gen(DOC), gen(OTHER), STATS]}
    )
    assert consumer[0] == hit_reference["doc"]
    assert consumer[2]["loaded_tokens"] == FULL_HIT
    assert consumer[2]["saved_tokens"] == 0 and consumer[2]["save_jobs"] == 0, (
        "a consumer never saves"
    )
