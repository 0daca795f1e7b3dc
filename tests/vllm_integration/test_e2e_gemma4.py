"""Gemma 4's geometry through real vLLM on CPU (issue 56): five sliding-window layers (head 64,
window 64) to one full-attention layer (head 512), which vLLM serves with its hybrid memory
allocator as six KV cache groups of one layer each over one allocation, the window groups with
blocks of 256 tokens and the full-attention group with blocks of 32 (pages of one size).

kvtier's block is then 256 tokens (the groups' least common block size, where vLLM's own hybrid
prefix cache hits too) and each stored block holds a section per group: one window block of
each window group and eight full-attention blocks (``KVLayout.group_block_sizes``). The
reference is vLLM's own prefix cache, no kvtier, in the same mode, on the same prompts; with
``prefix_cache_retention_interval=None`` it hits the same blocks. Tokens and logprobs must be
equal.
"""

from __future__ import annotations

import pytest
from prompts import DOC, FLUSH, OTHER, SHARED, STATS, gen, loaded_after_each

pytestmark = [pytest.mark.vllm]

BLOCK = 256  # kvtier's block for this model: the window groups' block size
FULL_HIT = (len(DOC) - 1) // BLOCK * BLOCK  # 512
PARTIAL_HIT = 256  # SHARED shares DOC's first 400 tokens: one whole block of 256
EXT = DOC + [5, 6, 7, 8] * 20  # DOC continued (a second turn): hits DOC's 512 stored tokens
INFO = {"op": "engine_info"}
GROUPS = ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]
HOST = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}


@pytest.fixture(scope="module")
def gemma4_reference(run_engine, gemma4_model_dir) -> dict[str, dict]:
    """vLLM's own prefix cache on the Gemma 4 model, no kvtier: DOC cold, then DOC, SHARED,
    EXT and OTHER twice, each hitting what a kvtier hit loads."""
    spec = {
        "model": str(gemma4_model_dir),
        "kvtier": None,
        "prefix_caching": True,
        "prefix_cache_retention_interval": None,
        "report_cached_tokens": True,
    }
    steps = [INFO, gen(DOC), gen(DOC), gen(SHARED), gen(EXT), gen(OTHER), gen(OTHER)]
    info, *out = run_engine({**spec, "steps": steps})
    assert info["kv_cache_groups"] == GROUPS  # HMA on: vLLM's six groups
    cached = [r.pop("cached_tokens") for r in out]
    assert cached == [0, FULL_HIT, PARTIAL_HIT, FULL_HIT, 0, (len(OTHER) - 1) // BLOCK * BLOCK]
    return dict(zip(("cold", "doc", "shared", "ext", "other_cold", "other"), out, strict=True))


def test_model_output_follows_its_context(gemma4_reference) -> None:
    """The fixture model is useful for comparing outputs: two prompts, two answers."""
    assert gemma4_reference["cold"]["tokens"] != gemma4_reference["other_cold"]["tokens"]


def test_hits_equal_vllms_prefix_cache(run_engine, gemma4_model_dir, gemma4_reference) -> None:
    """Cold, full, partial (a prompt diverging inside the second block) and multi-turn hits from
    host memory equal vLLM's own prefix cache, tokens and logprobs; KV events name each group's
    own blocks."""
    steps = [INFO, gen(DOC), STATS, gen(DOC), STATS, gen(SHARED), STATS, gen(EXT), STATS]
    info, *out = run_engine(
        {"model": str(gemma4_model_dir), "kvtier": HOST, "steps": steps, "log_stats": True}
    )
    assert info["kv_cache_groups"] == GROUPS and info["connector"] == "KVTierConnector"
    assert loaded_after_each(out) == [0, FULL_HIT, PARTIAL_HIT, FULL_HIT]
    ref = gemma4_reference
    assert out[0::2] == [ref["cold"], ref["doc"], ref["shared"], ref["ext"]]
    stats = out[-1]
    assert stats["load_failed_blocks"] == 0 and stats["save_errors"] == 0


def test_restart_from_disk_and_each_groups_pages_matter(
    run_engine, gemma4_model_dir, gemma4_reference, tmp_path
) -> None:
    """A new engine on the same disk loads DOC's blocks (every group's section) and answers as
    vLLM's prefix cache; zeroing only one window group's section of a stored prompt, or only the
    full-attention group's, changes the answer (each section is loaded into its own group's
    blocks and used)."""
    tiers = {
        "tiers": ["local_cpu", "local_disk"],
        "local_cpu_size_gb": 0.25,
        "local_disk_path": str(tmp_path / "disk"),
    }
    model = str(gemma4_model_dir)
    first = run_engine({"model": model, "kvtier": tiers, "steps": [gen(DOC), FLUSH]})
    assert first[0] == gemma4_reference["cold"]
    steps = [
        gen(DOC),
        STATS,
        {"op": "corrupt", "prompt": DOC, "salt": None, "group": 4},  # the last window group
        gen(DOC),
        gen(OTHER),
        {"op": "corrupt", "prompt": OTHER, "salt": None, "group": 5},  # the full group
        gen(OTHER),
    ]
    again, stats, zeroed_window, window_out, other_cold, zeroed_full, full_out = run_engine(
        {"model": model, "kvtier": tiers, "steps": steps}
    )
    assert again == gemma4_reference["doc"]
    assert stats["loaded_tokens"] == FULL_HIT
    assert zeroed_window == 2 and zeroed_full == 1  # DOC: 2 blocks of 256; OTHER: 1
    assert other_cold == gemma4_reference["other_cold"]
    for wrong, right in ((window_out, "doc"), (full_out, "other")):
        assert wrong != gemma4_reference[right]


def test_verification_compares_every_groups_section(
    run_engine, gemma4_model_dir, gemma4_reference
) -> None:
    """``verify_fraction`` 1.0: a hit is recomputed and every page vLLM still holds is compared
    with the stored block's sections. A right cache raises no alarm; OTHER with only the full
    group's section zeroed is caught."""
    kvtier = {**HOST, "verify_fraction": 1.0}
    steps = [
        gen(DOC),
        gen(DOC),
        FLUSH,
        STATS,
        gen(OTHER),
        {"op": "corrupt", "prompt": OTHER, "salt": None, "group": 5},
        gen(OTHER),
        FLUSH,
        STATS,
    ]
    out = run_engine({"model": str(gemma4_model_dir), "kvtier": kvtier, "steps": steps})
    cold, checked, right, wrong = out[0], out[1], out[3], out[8]
    assert cold == checked == gemma4_reference["cold"]
    assert right["verify_chunks"] >= 2 and right["verify_mismatches"] == 0, right
    assert wrong["verify_mismatches"] >= 1, wrong
