"""Request identity through real vLLM on CPU: LoRA adapters and weight updates.

Each reference runs the same requests in the same mode (in-process, LoRA enabled where the
kvtier run has it) with kvtier switched off and vLLM's own prefix cache on, so a full hit is
compared with vLLM's prefix cache hitting the same blocks and a cold request with a cold one.
Outputs are compared token for token and logprob for logprob.
"""

from __future__ import annotations

import pytest
from prompts import DOC, FLUSH, FULL_HIT, STATS, gen, loaded_after_each

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def with_lora(step: dict, adapters: dict, name: str) -> dict:
    return {
        **step,
        "lora": {"name": name, "id": {"a": 1, "b": 2}[name], "path": str(adapters[name])},
    }


def test_lora_adapters_and_base_never_share_kv(run_engine, lora_adapters, tmp_path) -> None:
    """Base, then adapter A, then adapter B on one prompt, then A again: each of the first
    three is cold (an adapter on k/v projections changes the KV), the last a full hit."""
    steps = [
        gen(DOC),
        with_lora(gen(DOC), lora_adapters, "a"),
        with_lora(gen(DOC), lora_adapters, "b"),
    ]
    steps.append(steps[1])
    ref = run_engine({"kvtier": None, "prefix_caching": True, "enable_lora": True, "steps": steps})
    assert ref[0] != ref[1] != ref[2]  # the adapters do change the output
    kv_steps = [s for step in steps for s in (step, STATS)]
    out = run_engine(
        {
            "kvtier": {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25},
            "enable_lora": True,
            "steps": kv_steps,
        }
    )
    assert out[0::2] == ref
    assert loaded_after_each(out) == [0, 0, 0, FULL_HIT]


def test_weight_update_then_reset_serves_the_new_weights(run_engine, tmp_path) -> None:
    """A prompt is stored, the weights its KV comes from change (as an RL weight update would),
    the cache is reset: the next request recomputes with the new weights (equal to vLLM without
    kvtier after the same update), and its own chunks are then served (equal to vLLM's prefix
    cache hitting them after the same update)."""
    perturb = {"op": "perturb_kv", "seed": 7}
    reset = {"op": "reset_prefix_cache"}
    steps = [gen(DOC), perturb, reset, gen(DOC), gen(DOC)]
    ref = run_engine({"kvtier": None, "prefix_caching": True, "steps": steps})
    assert ref[1] > 0 and ref[2] is True
    del ref[1:3]
    assert ref[0] != ref[1]  # the update changes the output
    config = {"local_cpu_size_gb": 0.25, "local_disk_path": str(tmp_path / "disk")}
    out = run_engine(
        {
            "kvtier": config,
            "steps": [
                gen(DOC),
                STATS,
                perturb,
                {"op": "reset_connector"},
                gen(DOC),
                STATS,
                gen(DOC),
                STATS,
            ],
        }
    )
    assert out[2] > 0  # layers perturbed
    assert out[3] is True
    del out[2:4]
    assert out[0::2] == ref
    assert loaded_after_each(out) == [0, 0, FULL_HIT]
    assert out[-1]["generation_resets"] == 1


def copy_model(src, dst):
    """The model's files at another path (another mount, another host's layout)."""
    import shutil

    shutil.copytree(src, dst)
    return dst


def perturb_checkpoint(model_dir) -> None:
    """New weights of the same shapes written over the old file at the same path (a new
    checkpoint deployed into the same directory)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(11)
    changed = {
        name: (t.float() + torch.randn(t.shape, generator=gen) * 0.2).to(t.dtype)
        for name, t in tensors.items()
    }
    save_file(changed, str(path), metadata={"format": "pt"})


def test_keys_follow_the_weights_not_their_path(
    run_engine, vllm_model_dir, hit_reference, tmp_path
) -> None:
    """The same weights at another path hit (equal to vLLM's prefix cache hitting the same
    blocks); new weights written over the old file at the same path never load the old KV
    (equal to the new model with no cache)."""
    here = copy_model(vllm_model_dir, tmp_path / "here")
    there = copy_model(vllm_model_dir, tmp_path / "mnt" / "there")
    config = {"local_cpu_size_gb": 0.25, "local_disk_path": str(tmp_path / "disk")}
    first = run_engine({"model": str(here), "kvtier": config, "steps": [gen(DOC), FLUSH, STATS]})
    assert first[2]["loaded_tokens"] == 0
    moved = run_engine({"model": str(there), "kvtier": config, "steps": [gen(DOC), STATS]})
    assert moved[1]["loaded_tokens"] == FULL_HIT
    assert moved[0] == hit_reference["doc"]
    perturb_checkpoint(here)
    ref = run_engine({"model": str(here), "kvtier": None, "steps": [gen(DOC)]})
    assert ref[0]["tokens"] != first[0]["tokens"]  # the new weights do answer differently
    swapped = run_engine({"model": str(here), "kvtier": config, "steps": [gen(DOC), STATS]})
    assert swapped[1]["loaded_tokens"] == 0
    assert swapped[0] == ref[0]


def test_engines_that_made_the_same_weight_update_share_after_their_resets(
    run_engine, tmp_path
) -> None:
    """Two engines update their weights in place the same way and reset (as RL trainers'
    inference fleets do): the second loads what the first stored after its update; an engine
    that made another update does not."""
    config = {"local_cpu_size_gb": 0.25, "local_disk_path": str(tmp_path / "disk")}

    def updated(seed: int, steps: list) -> list:
        out = run_engine(
            {
                "kvtier": config,
                "steps": [{"op": "perturb_kv", "seed": seed}, {"op": "reset_connector"}, *steps],
            }
        )
        assert out[0] > 0 and out[1] is True
        return out[2:]

    first = updated(7, [gen(DOC), gen(DOC), FLUSH, STATS])
    assert first[3]["loaded_tokens"] == FULL_HIT  # its own chunks after the reset
    second = updated(7, [gen(DOC), STATS])
    assert second[1]["loaded_tokens"] == FULL_HIT
    assert second[0] == first[1]  # the first engine's hit on the same weights
    other = updated(8, [gen(DOC), STATS])
    assert other[1]["loaded_tokens"] == 0
