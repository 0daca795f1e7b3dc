"""vLLM's connector contract around kvtier, through real vLLM on CPU: kvtier as a child of
vLLM's ``MultiConnector`` next to vLLM's ``ExampleConnector`` (which stores whole prompts as
files), and ``--kv-offloading-size`` next to kvtier refused at startup. The scheduler-half
contract (a sibling's hit and kvtier's lookups) is in ``test_connector_contract.py``."""

from __future__ import annotations

import pytest
from prompts import DOC, FULL_HIT, STATS, gen

pytestmark = [pytest.mark.vllm]

CONFIG = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}


def example(tmp_path) -> dict:
    path = tmp_path / "example"
    path.mkdir(exist_ok=True)
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def test_kvtier_inside_multiconnector_stores_loads_and_the_sibling_works(
    run_engine, hit_reference, tmp_path
) -> None:
    """kvtier first, ExampleConnector second: both store DOC; DOC again is kvtier's hit (the
    first child with one), loaded in full and equal to vLLM's prefix cache. A new engine whose
    kvtier has nothing: DOC is the sibling's hit, loaded by it (vLLM counts it cached)."""
    sibling = example(tmp_path)
    first = run_engine(
        {
            "kvtier": CONFIG,
            "siblings_after": [sibling],
            "report_cached_tokens": True,
            "steps": [gen(DOC), gen(DOC), STATS, {"op": "engine_info"}],
        }
    )
    assert first[3]["connector"] == "MultiConnector"
    assert first[0]["cached_tokens"] == 0 and first[1]["cached_tokens"] == FULL_HIT
    assert [{k: r[k] for k in ("tokens", "logprobs")} for r in first[:2]] == [
        hit_reference["cold"],
        hit_reference["doc"],
    ]
    assert first[2]["loaded_tokens"] == FULL_HIT and first[2]["saved_tokens"] > 0
    assert any((tmp_path / "example").iterdir()), "the sibling stored DOC too"

    second = run_engine(
        {
            "kvtier": CONFIG,
            "siblings_after": [sibling],
            "report_cached_tokens": True,
            "steps": [gen(DOC), STATS],
        }
    )
    assert second[0].pop("cached_tokens") == FULL_HIT  # the sibling's load
    assert second[0] == hit_reference["doc"]
    assert second[1]["loaded_tokens"] == 0 and second[1]["load_requests"] == 0


def test_kv_offloading_size_next_to_kvtier_fails_at_startup(run_engine) -> None:
    """vLLM would silently swap kvtier for its OffloadingConnector; the plugin refuses it while
    ``LLM(...)`` builds its config, naming both settings."""
    with pytest.raises(AssertionError) as exc:
        run_engine({"kvtier": CONFIG, "kv_offloading_size": 1.0, "steps": []})
    text = str(exc.value)
    assert "--kv-offloading-size" in text and "kv_offloading_size=1.0" in text
    assert "--kv-transfer-config kv_connector='KVTierConnector'" in text
