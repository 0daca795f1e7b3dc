"""A Mamba / linear-attention hybrid through real vLLM on CPU (issue 38): Qwen3-Next, layers
alternating Gated DeltaNet and full attention, which vLLM serves with its hybrid memory
allocator (a Mamba group in "align" mode beside a full-attention group).

vLLM raises the block size so one block holds a layer's state, and kvtier's default chunk
follows it: 544 with the runner's 32 where vLLM keeps the SSM state in fp32 (its accelerated
GDN kernels, AVX-512), 288 where it keeps it in bf16 (AVX2); the tests read it from vLLM.
Chunks hold the attention pages; the states vLLM offers at chunk boundaries are stored as state
entries (``kvtier.core.engine.states``); a hit ends where both exist. The reference is vLLM's own
prefix cache on the same requests in the same run shape: its Mamba prefix cache also needs a
state at the hit's end, and with prefill steps of at most 544 tokens (block-aligned) and
``prefix_cache_retention_interval=None`` it keeps one at every block, so it hits what kvtier
hits. A hit from kvtier is forced by resetting vLLM's prefix cache before each
request. Tokens and logprobs must be equal.
"""

from __future__ import annotations

import random

import pytest
from prompts import FLUSH, STATS, gen, logprob_gap

pytestmark = [pytest.mark.vllm]

RNG = random.Random(4321)
A = [RNG.randrange(3, 3000) for _ in range(1700)]
EXT = A + [RNG.randrange(3, 3000) for _ in range(300)]  # A continued: hits A's states
DIV = A[:850] + [RNG.randrange(3, 3000) for _ in range(850)]  # diverges inside A's 2nd chunk
RESET = {"op": "reset_prefix_cache"}
GROUPS = ["MambaSpec", "FullAttentionSpec"]
MODE = {"prefix_caching": True, "prefix_cache_retention_interval": None,
        "max_num_batched_tokens": 544}  # fmt: skip
HOST = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}


@pytest.fixture(scope="module")
def mamba_reference(run_engine, mamba_model_dir) -> dict:
    """vLLM's own prefix cache, no kvtier: A cold, then A, EXT and DIV hitting A's states; and
    vLLM's block size with the hits it implies (``block``, ``hit``: A's last state before its
    last token, ``div_hit``: the last state DIV shares)."""
    spec = {"model": str(mamba_model_dir), "kvtier": None, "report_cached_tokens": True, **MODE}
    info, *out = run_engine({**spec, "steps": [{"op": "engine_info"}, gen(A), gen(A),
                                               gen(EXT), gen(DIV)]})  # fmt: skip
    assert info["kv_cache_groups"] == GROUPS
    block = info["block_size"]
    hit, div_hit = (len(A) - 1) // block * block, 850 // block * block
    assert [r.pop("cached_tokens") for r in out] == [0, hit, hit, div_hit]
    ref = dict(zip(("cold", "a", "ext", "div"), out, strict=True))
    return {**ref, "block": block, "hit": hit, "div_hit": div_hit}


def test_hits_equal_vllms_prefix_cache(run_engine, mamba_model_dir, mamba_reference) -> None:
    """Full, multi-turn and partial hits from kvtier's host tier, with vLLM's hybrid memory
    allocator on: the attention pages and the state at the hit's end are loaded, and the
    answers equal vLLM's own prefix cache on the same requests."""
    steps = [{"op": "engine_info"}, gen(A), FLUSH, RESET, STATS, gen(A), STATS, RESET,
             gen(EXT), STATS, RESET, gen(DIV), STATS]  # fmt: skip
    spec = {"model": str(mamba_model_dir), "kvtier": HOST, "report_cached_tokens": True, **MODE}
    info, cold, _, _, s0, a, s1, _, ext, s2, _, div, s3 = run_engine({**spec, "steps": steps})
    assert info["kv_cache_groups"] == GROUPS and info["connector"] == "KVTierConnector"
    loaded = [s1["loaded_tokens"] - s0["loaded_tokens"], s2["loaded_tokens"] - s1["loaded_tokens"],
              s3["loaded_tokens"] - s2["loaded_tokens"]]  # fmt: skip
    ref = mamba_reference
    assert loaded == [ref["hit"], ref["hit"], ref["div_hit"]]
    for r in (cold, a, ext, div):
        r.pop("cached_tokens")
    assert [cold, a, ext, div] == [ref["cold"], ref["a"], ref["ext"], ref["div"]]
    assert s3["load_failed_blocks"] == 0 and s3["save_errors"] == 0


def test_a_restarted_engine_hits_from_disk(
    run_engine, mamba_model_dir, mamba_reference, tmp_path
) -> None:
    """States and chunks written to local disk by one engine are loaded by a new one."""
    disk = {"tiers": ["local_cpu", "local_disk"], "local_cpu_size_gb": 0.25,
            "local_disk_path": str(tmp_path / "disk"), "local_disk_size_gb": 1.0}  # fmt: skip
    base = {"model": str(mamba_model_dir), "kvtier": disk, **MODE}
    run_engine({**base, "steps": [gen(A), FLUSH]})
    out = run_engine({**base, "steps": [gen(A), STATS]})
    assert out[0] == mamba_reference["a"]
    assert out[1]["loaded_tokens"] == mamba_reference["hit"]
    assert out[1]["load_failed_blocks"] == 0


def test_zeroed_states_change_the_answer(run_engine, mamba_model_dir, mamba_reference) -> None:
    """Negative control: with A's state entries zeroed (the attention chunks intact), the hit
    loads a wrong state and the answer moves away from vLLM's prefix cache, which the exact
    comparison above catches. (This model's attention layers carry most of the context: a
    zeroed Gated DeltaNet state moves the logprobs by ~0.015, less than zeroed attention KV.)"""
    steps = [gen(A), FLUSH, {"op": "corrupt", "prompt": A, "states": True}, RESET, gen(A), STATS]
    out = run_engine({"model": str(mamba_model_dir), "kvtier": HOST, "steps": steps, **MODE})
    ref = mamba_reference
    assert out[2] == ref["hit"] // ref["block"]  # a state at every block up to the hit
    assert out[5]["loaded_tokens"] == ref["hit"]
    assert logprob_gap(out[4], mamba_reference["a"]) > 0


def test_a_hit_equals_vllms_prefix_cache_across_processes(
    run_engine, mamba_model_dir, mamba_reference
) -> None:
    """Across processes: tensor parallelism 2 runs each rank's worker in a process of its own,
    apart from the scheduler (the case vLLM CPU's multiprocess mode also makes, with one worker
    process; test_e2e.py runs that mode), each rank storing its own shard of the attention pages
    and of the Gated DeltaNet state: A's hit equals vLLM's prefix cache in the same mode."""
    base = {"model": str(mamba_model_dir), **MODE, "tp": 2}
    ref = run_engine({**base, "kvtier": None, "steps": [gen(A), gen(A)]})
    steps = [gen(A), FLUSH, RESET, gen(A), STATS]
    out = run_engine({**base, "kvtier": HOST, "steps": steps})
    assert [out[0], out[3]] == ref
    assert out[4]["loaded_tokens"] == mamba_reference["hit"]
    assert out[4]["load_failed_blocks"] == 0


def test_a_prompt_without_a_state_at_its_prefix_does_not_hide_stored_chunks(
    run_engine, mamba_model_dir, mamba_reference
) -> None:
    """At vLLM's default batch A is prefilled in one step up to its last block boundary (1632
    with blocks of 544): the only state is there. B shares A's first 1200 tokens but ends
    before it, so no state ends a prefix of it: a miss
    (as for vLLM's own prefix cache: no state there either). A again still hits all of its
    chunks (the probe's short answer for B does not hide them: test_hybrid_groups.py)."""
    b = A[:1200] + [RNG.randrange(3, 3000) for _ in range(400)]
    mode = {"prefix_caching": True, "prefix_cache_retention_interval": None}
    steps = [gen(A), FLUSH, RESET, STATS, gen(b), STATS, RESET, gen(A), STATS]
    out = run_engine({"model": str(mamba_model_dir), "kvtier": HOST, "steps": steps, **mode})
    s0, s1, s2 = out[3], out[5], out[8]
    assert s1["loaded_tokens"] - s0["loaded_tokens"] == 0
    assert s2["loaded_tokens"] - s1["loaded_tokens"] == mamba_reference["hit"]


def test_verification_compares_the_attention_pages_and_the_state(
    run_engine, mamba_model_dir, mamba_reference
) -> None:
    """``verify_fraction`` 1.0: A's hit is recomputed instead of loaded; the attention pages
    vLLM computed are compared with the stored chunks, and the Gated DeltaNet state vLLM offered
    at the hit's end (a step of 544 tokens ends there) with the stored state entry. A right
    cache raises no alarm and the answer is the cold one; A's state entries zeroed (its chunks
    right) are caught as one wrong state; then A's chunks zeroed are caught. (No quarantine,
    so each phase is a hit again.)"""
    kvtier = {**HOST, "verify_fraction": 1.0, "verify_quarantine_s": 0}
    again = [RESET, gen(A), FLUSH, STATS]
    steps = [gen(A), FLUSH, *again, {"op": "corrupt", "prompt": A, "states": True}, *again,
             {"op": "corrupt", "prompt": A}, *again]  # fmt: skip
    out = run_engine({"model": str(mamba_model_dir), "kvtier": kvtier, "steps": steps, **MODE})
    cold, right, state_wrong, chunks_wrong = out[0], out[5], out[10], out[15]
    assert cold == out[3] == out[8] == out[13] == mamba_reference["cold"]
    assert right["verify_chunks"] >= 3 and right["verify_states"] == 1, right
    assert right["verify_mismatches"] == 0, right
    assert out[6] >= 1  # state entries zeroed
    assert state_wrong["verify_mismatches"] == 1, "the state at the hit's end, nothing else"
    assert state_wrong["verify_chunks"] >= 2 * right["verify_chunks"]
    assert chunks_wrong["verify_mismatches"] >= 2, chunks_wrong
