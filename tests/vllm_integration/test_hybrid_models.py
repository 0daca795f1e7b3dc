"""Models kvtier cannot serve yet are a named startup error, never a shape error deep in vLLM:
a model with a recurrent state and no attention (pure Mamba) configured with kvtier stops when
vLLM builds its config, naming the model and why (docs/hybrid.md); an attention + Mamba hybrid
starts (test_e2e_mamba.py) unless vLLM keeps no state it can take a hit into (prefix caching
off). Plain attention models and sliding-window hybrids (served with vLLM's hybrid memory
allocator on, Gemma 4's groups of several block sizes included: test_e2e_hybrid.py) start."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.vllm_integration.plugin import recurrent_state_conflict, register

pytestmark = [pytest.mark.vllm]

ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
KVTIER = {"kv_connector": "KVTierConnector", "kv_role": "kv_both"}
EXAMPLE = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}


def config_dir(tmp_path: Path, tokenizer_from: Path, hf_config) -> Path:
    """A model directory with ``hf_config`` and the test tokenizer (no weights: only the
    config is read)."""
    d = tmp_path / hf_config.model_type
    d.mkdir()
    hf_config.architectures = [ARCHITECTURES[hf_config.model_type]]
    hf_config.to_json_file(str(d / "config.json"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, d / name)
    return d


def qwen3_next():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=3300, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128,
        max_position_embeddings=4096,
    )  # fmt: skip


def gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=3300, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=4096,
    )  # fmt: skip


def build(model_dir: Path, ktc: dict | None):
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    register()
    transfer = KVTransferConfig(**ktc) if ktc is not None else None
    return VllmConfig(model_config=ModelConfig(model=str(model_dir)), kv_transfer_config=transfer)


MULTI = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"connectors": [EXAMPLE, KVTIER]},
}


@pytest.mark.parametrize("ktc", [KVTIER, MULTI], ids=["kvtier", "multiconnector-child"])
def test_a_gated_deltanet_hybrid_with_kvtier_builds(ktc, tmp_path, vllm_model_dir) -> None:
    """An attention + Gated DeltaNet hybrid passes vLLM's config with kvtier (its states are
    stored as state entries: test_e2e_mamba.py), alone or as a MultiConnector child."""
    model = config_dir(tmp_path, vllm_model_dir, qwen3_next())
    assert build(model, ktc).model_config.is_hybrid


def test_without_kvtier_vllm_takes_the_same_model(tmp_path, vllm_model_dir) -> None:
    model = config_dir(tmp_path, vllm_model_dir, qwen3_next())
    assert build(model, EXAMPLE).model_config.is_hybrid


def test_a_mamba_hybrid_without_prefix_caching_is_a_named_startup_error(
    run_engine, mamba_model_dir
) -> None:
    """Without prefix caching vLLM keeps no Mamba state it could take a hit into
    (``mamba_cache_mode`` "none"): the engine stops at start with kvtier's error naming the
    groups, the mode and what to do, never a shape error."""
    kvtier = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}
    with pytest.raises(AssertionError) as exc:
        run_engine({"model": str(mamba_model_dir), "prefix_caching": False, "kvtier": kvtier,
                    "steps": [{"op": "generate", "prompt": list(range(10, 80))}]})  # fmt: skip
    text = str(exc.value)
    assert "LayoutError" in text and "mamba_cache_mode is 'none'" in text
    assert "MambaSpec" in text and "without kvtier" in text


@pytest.mark.parametrize("make", [gemma3, None], ids=["sliding-window hybrid", "llama"])
def test_attention_models_with_kvtier_start(make, tmp_path, vllm_model_dir) -> None:
    model = config_dir(tmp_path, vllm_model_dir, make()) if make else vllm_model_dir
    assert build(model, KVTIER).kv_transfer_config.kv_connector == "KVTierConnector"


def test_the_check_reads_vllms_model_flags() -> None:
    ktc = SimpleNamespace(
        kv_connector="KVTierConnector", kv_connector_module_path=None, kv_connector_extra_config={}
    )
    plain = SimpleNamespace(is_hybrid=False, has_inner_state=False, is_attention_free=False)
    assert recurrent_state_conflict(ktc, plain) is None
    mamba = SimpleNamespace(
        is_hybrid=False, has_inner_state=True, is_attention_free=True, model="m",
        architectures=["MambaForCausalLM"],
    )  # fmt: skip
    text = recurrent_state_conflict(ktc, mamba)
    assert "has_inner_state, is_attention_free" in text and "without kvtier" in text
    hybrid = SimpleNamespace(**{**vars(mamba), "is_hybrid": True, "is_attention_free": False})
    assert recurrent_state_conflict(ktc, hybrid) is None  # attention + Mamba: stored
    other = SimpleNamespace(**{**vars(ktc), "kv_connector": "ExampleConnector"})
    assert recurrent_state_conflict(other, mamba) is None
