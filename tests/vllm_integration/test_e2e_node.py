"""The node tier through real vLLM: an engine started after another one exited (another instance,
or the same one restarted) loads the first one's prompt from the node tier's shared memory, with
tokens and logprobs equal to vLLM's own prefix cache hitting the same blocks, and reports the hit
as host memory (vLLM's ``prompt_tokens_cached_by_source``) and as the node tier (kvtier's own)."""

from __future__ import annotations

import pytest
from prompts import DOC, FLUSH, FULL_HIT, STATS, gen
from test_metrics import METRICS, value

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_new_engine_hits_the_node_tier(run_engine, reference, hit_reference, node_dir) -> None:
    config = {"tiers": ["local_cpu", "node"], "node_path": str(node_dir), "local_cpu_size_gb": 0.25}
    first = run_engine({"kvtier": config, "steps": [gen(DOC), FLUSH, STATS]})
    assert first[:2] == [reference["doc"], True]
    assert first[2]["loaded_tokens"] == 0
    assert sorted(node_dir.rglob("*.kvc")), "the first engine's chunks are in the node tier"
    second = run_engine({"kvtier": config, "log_stats": True, "steps": [gen(DOC), STATS, METRICS]})
    assert second[0] == hit_reference["doc"]
    assert second[1]["loaded_tokens"] == FULL_HIT
    m = second[2]
    assert value(m, "vllm:kvtier_lookup_hit_tokens", tier="node") == FULL_HIT
    assert value(m, "vllm:prompt_tokens_cached_by_source", source="host") == FULL_HIT
    assert value(m, "vllm:kvtier_node_used_bytes") > 0
