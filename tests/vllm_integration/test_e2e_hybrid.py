"""A hybrid model through real vLLM on CPU (issue 38): Gemma 3, layers alternating sliding
window (64 tokens) and full attention, which vLLM serves with its hybrid memory allocator on
(two KV cache groups) because kvtier supports it (``SupportsHMA``).

kvtier stores every group's pages of each chunk (``kvtier.vllm_integration.groups``), so a hit
of any whole-block length gives both groups what vLLM's hybrid rule asks for. The reference is
vLLM's own prefix cache, no kvtier, in the same mode, hitting the same blocks of the same
prompts; with ``prefix_cache_retention_interval=None`` vLLM keeps its window blocks at every
block, so it hits SHARED's 384 shared tokens as kvtier does (by default it keeps them only at a
prompt's replay boundary and hits nothing of SHARED). Tokens and logprobs must be equal.
"""

from __future__ import annotations

import pytest
from prompts import (
    DOC,
    FLUSH,
    FULL_HIT,
    OTHER,
    PARTIAL_HIT,
    SHARED,
    STATS,
    gen,
    loaded_after_each,
)

pytestmark = [pytest.mark.vllm]

EXT = DOC + [5, 6, 7, 8] * 20  # DOC continued (a second turn): hits DOC's stored prefix
INFO = {"op": "engine_info"}
GROUPS = ["SlidingWindowSpec", "FullAttentionSpec"]
HOST = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}


@pytest.fixture(scope="module")
def hybrid_reference(run_engine, hybrid_model_dir) -> dict[str, dict]:
    """vLLM's own prefix cache on the hybrid model, no kvtier: DOC cold, then DOC, SHARED,
    EXT and OTHER twice, each hitting what a kvtier hit loads."""
    spec = {
        "model": str(hybrid_model_dir),
        "kvtier": None,
        "prefix_caching": True,
        "prefix_cache_retention_interval": None,
        "report_cached_tokens": True,
    }
    steps = [INFO, gen(DOC), gen(DOC), gen(SHARED), gen(EXT), gen(OTHER), gen(OTHER)]
    info, *out = run_engine({**spec, "steps": steps})
    assert info["kv_cache_groups"] == GROUPS  # HMA on: vLLM's two groups
    cached = [r.pop("cached_tokens") for r in out]
    assert cached == [0, FULL_HIT, PARTIAL_HIT, FULL_HIT, 0, (len(OTHER) - 1) // 32 * 32]
    return dict(zip(("cold", "doc", "shared", "ext", "other_cold", "other"), out, strict=True))


def test_hits_equal_vllms_prefix_cache_with_hma_on(
    run_engine, hybrid_model_dir, hybrid_reference
) -> None:
    """Cold, full, partial (a prompt diverging inside a chunk) and multi-turn hits from host
    memory, with vLLM's hybrid memory allocator on (two groups, as without kvtier)."""
    steps = [INFO, gen(DOC), STATS, gen(DOC), STATS, gen(SHARED), STATS, gen(EXT), STATS]
    info, *out = run_engine(
        {"model": str(hybrid_model_dir), "kvtier": HOST, "steps": steps, "log_stats": True}
    )
    assert info["kv_cache_groups"] == GROUPS and info["connector"] == "KVTierConnector"
    assert loaded_after_each(out) == [0, FULL_HIT, PARTIAL_HIT, FULL_HIT]
    ref = hybrid_reference
    assert out[0::2] == [ref["cold"], ref["doc"], ref["shared"], ref["ext"]]
    stats = out[-1]
    assert stats["load_failed_blocks"] == 0 and stats["save_errors"] == 0


def test_verification_compares_every_groups_pages(
    run_engine, hybrid_model_dir, hybrid_reference
) -> None:
    """``verify_fraction`` 1.0: a hit is recomputed instead of loaded and every page vLLM still
    holds (both groups' pages of the blocks it computed) is compared with the stored chunk. A
    right cache raises no alarm (the answer is the cold one); OTHER with only its
    sliding-window pages zeroed is caught."""
    kvtier = {**HOST, "verify_fraction": 1.0}
    steps = [
        gen(DOC),
        gen(DOC),
        FLUSH,
        STATS,
        gen(OTHER),
        {"op": "corrupt", "prompt": OTHER, "salt": None, "group": 0},
        gen(OTHER),
        FLUSH,
        STATS,
    ]
    out = run_engine({"model": str(hybrid_model_dir), "kvtier": kvtier, "steps": steps})
    cold, checked, right, wrong = out[0], out[1], out[3], out[8]
    assert cold == checked == hybrid_reference["cold"]
    assert right["verify_chunks"] >= 3 and right["verify_mismatches"] == 0, right
    assert wrong["verify_mismatches"] >= 1, wrong


def test_restart_from_disk_and_one_groups_pages_matter(
    run_engine, hybrid_model_dir, hybrid_reference, tmp_path
) -> None:
    """A new engine on the same disk loads DOC's chunks (both groups' pages) and answers as
    vLLM's prefix cache; zeroing only the sliding-window group's pages of a stored prompt, or
    only the full-attention group's, changes the answer (the negative controls: each group's
    pages are loaded and used)."""
    tiers = {
        "tiers": ["local_cpu", "local_disk"],
        "local_cpu_size_gb": 0.25,
        "local_disk_path": str(tmp_path / "disk"),
    }
    model = str(hybrid_model_dir)
    first = run_engine({"model": model, "kvtier": tiers, "steps": [gen(DOC), FLUSH]})
    assert first[0] == hybrid_reference["cold"]
    steps = [
        gen(DOC),
        STATS,
        {"op": "corrupt", "prompt": DOC, "salt": None, "group": 0},  # the sliding group's pages
        gen(DOC),
        gen(OTHER),
        {"op": "corrupt", "prompt": OTHER, "salt": None, "group": 1},  # the full group's
        gen(OTHER),
    ]
    again, stats, zeroed_window, window_out, other_cold, zeroed_full, full_out = run_engine(
        {"model": model, "kvtier": tiers, "steps": steps}
    )
    assert again == hybrid_reference["doc"]
    assert stats["loaded_tokens"] == FULL_HIT
    assert zeroed_window >= 3 and zeroed_full >= 1  # DOC: 2 chunks and tail blocks
    assert other_cold == hybrid_reference["other_cold"]
    for wrong, right in ((window_out, "doc"), (full_out, "other")):
        assert wrong != hybrid_reference[right]


def test_freed_window_blocks_are_not_read_after_reuse(run_engine, hybrid_model_dir) -> None:
    """vLLM frees a sliding-window group's blocks while a request runs and hands them out
    again. DOC is prefilled 64 tokens a step and stored in chunks of 64, each saved right after
    the step that computed it; with only 30 blocks of 32 tokens, the window blocks freed behind
    the prefill are the next ones vLLM hands out, and a slow saver (each save waits 0.3 s
    before it copies) would read them after the next steps overwrote them. The workers drain
    their saves first (``window_drains``): every stored chunk is byte for byte the one the
    same engine stores with blocks to spare and a saver that does not wait."""
    base = {
        "model": str(hybrid_model_dir),
        "kvtier": {**HOST, "chunk_size": 64},
        "max_num_batched_tokens": 64,
        "max_model_len": 768,
    }
    digests = {"op": "chunk_digests", "prompt": DOC, "salt": None}
    steps = [gen(DOC), digests, {"op": "sched_stats"}]
    roomy, roomy_digests, _ = run_engine({**base, "steps": steps})
    tight, tight_digests, sched = run_engine(
        {**base, "num_gpu_blocks_override": 30, "slow_saves_s": 0.3, "steps": steps}
    )
    assert None not in roomy_digests and len(roomy_digests) == FULL_HIT // 32 - 10
    assert sched["window_drains"] > 0
    assert tight_digests == roomy_digests
    assert tight == roomy


@pytest.mark.slow
def test_tp2_hybrid_hits_equal_vllms_prefix_cache(run_engine, hybrid_model_dir) -> None:
    """Tensor parallelism 2 (two worker processes apart from the scheduler, one KV head per
    rank: the cross-process case that vLLM CPU's multiprocess mode also makes, with one worker
    process; test_e2e.py runs that mode): each rank stores and loads every group's pages of its
    shard; DOC's hit equals vLLM's own prefix cache in the
    same TP mode, and zeroing rank 1's sliding-window pages changes the answer."""
    model = str(hybrid_model_dir)
    cold, hit = run_engine(
        {"model": model, "kvtier": None, "tp": 2, "prefix_caching": True,
         "steps": [gen(DOC), gen(DOC)]}
    )  # fmt: skip
    steps = [
        gen(DOC),
        gen(DOC),
        {"op": "stats", "rank": 0},
        {"op": "stats", "rank": 1},
        {"op": "corrupt_rank", "rank": 1, "prompt": DOC, "group": 0},
        gen(DOC),
    ]
    out = run_engine({"model": model, "kvtier": HOST, "tp": 2, "steps": steps})
    assert out[:2] == [cold, hit]
    assert [out[2]["loaded_tokens"], out[3]["loaded_tokens"]] == [FULL_HIT, FULL_HIT]
    assert out[4] > 0
    assert out[5] != hit
