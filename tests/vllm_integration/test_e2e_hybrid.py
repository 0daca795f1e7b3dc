"""Hybrid models through real vLLM on CPU, served with vLLM's hybrid memory allocator on because
kvtier supports it (``SupportsHMA``):

- Gemma 3 (issue 38): layers alternating sliding window (64 tokens) and full attention, two KV
  cache groups of one block size (32); kvtier stores every group's pages of each chunk
  (``kvtier.vllm_integration.groups``), so a hit of any whole-block length serves both groups.
- Gemma 4 (issue 56): five sliding-window layers (head 64, window 64) to one full-attention layer
  (head 512), which vLLM serves as six groups of one layer each over one allocation, the window
  groups with blocks of 256 tokens and the full group with blocks of 32 (pages of one size).
  kvtier's block is then 256 tokens (the groups' least common block size, where vLLM's own
  hybrid prefix cache hits too) and each stored block holds a section per group
  (``KVLayout.group_block_sizes``).

The reference is vLLM's own prefix cache, no kvtier, in the same mode, hitting the same blocks of
the same prompts; with ``prefix_cache_retention_interval=None`` vLLM keeps its window blocks at
every block, so it hits SHARED's shared tokens as kvtier does (by default it keeps them only at a
prompt's replay boundary and hits nothing of SHARED). Tokens and logprobs must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prompts import DOC, FLUSH, FULL_HIT, OTHER, SHARED, STATS, gen, loaded_after_each

pytestmark = [pytest.mark.vllm]

EXT = DOC + [5, 6, 7, 8] * 20  # DOC continued (a second turn): hits DOC's stored prefix
INFO = {"op": "engine_info"}
HOST = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}


@dataclass(frozen=True)
class Model:
    """A hybrid test model and what its hits are."""

    name: str
    fixture: str  # the session fixture that builds it
    groups: list[str]  # vLLM's KV cache groups
    block: int  # kvtier's block, the hit granularity (vLLM's own hybrid prefix cache's too)
    window_group: int  # a window group's section, zeroed in a negative control
    full_group: int  # the full-attention group's
    verify_group: int  # the group whose section verification must catch zeroed
    doc_entries: int  # entries DOC is stored as (chunks and tail blocks), at least

    def hit(self, prompt_len: int, shared: int | None = None) -> int:
        """The tokens a repeat of a stored prompt hits (``shared``: of a prompt sharing that
        many tokens with it)."""
        n = prompt_len - 1 if shared is None else shared
        return n // self.block * self.block


GEMMA3 = Model(
    "gemma3", "hybrid_model_dir", ["SlidingWindowSpec", "FullAttentionSpec"], 32, 0, 1, 0, 3
)
GEMMA4 = Model(
    "gemma4", "gemma4_model_dir", ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"], 256, 4, 5, 5, 2
)


@pytest.fixture(scope="module", params=[GEMMA3, GEMMA4], ids=lambda m: m.name)
def hybrid(request, run_engine) -> tuple[Model, str, dict[str, dict]]:
    """A model, its directory, and vLLM's own prefix cache on it, no kvtier: DOC cold, then
    DOC, SHARED, EXT and OTHER twice, each hitting what a kvtier hit loads."""
    m: Model = request.param
    model = str(request.getfixturevalue(m.fixture))
    spec = {
        "model": model,
        "kvtier": None,
        "prefix_caching": True,
        "prefix_cache_retention_interval": None,
        "report_cached_tokens": True,
    }
    steps = [INFO, gen(DOC), gen(DOC), gen(SHARED), gen(EXT), gen(OTHER), gen(OTHER)]
    info, *out = run_engine({**spec, "steps": steps})
    assert info["kv_cache_groups"] == m.groups  # HMA on: vLLM's groups
    cached = [r.pop("cached_tokens") for r in out]
    full = m.hit(len(DOC))
    assert cached == [0, full, m.hit(len(SHARED), 400), full, 0, m.hit(len(OTHER))]
    ref = dict(zip(("cold", "doc", "shared", "ext", "other_cold", "other"), out, strict=True))
    return m, model, ref


def test_the_models_output_follows_its_context(hybrid) -> None:
    """The fixture model is useful for comparing outputs: two prompts, two answers."""
    _, _, ref = hybrid
    assert ref["cold"]["tokens"] != ref["other_cold"]["tokens"]


def test_hits_equal_vllms_prefix_cache_with_hma_on(run_engine, hybrid) -> None:
    """Cold, full, partial (a prompt diverging inside a chunk) and multi-turn hits from host
    memory, with vLLM's hybrid memory allocator on (the same groups as without kvtier)."""
    m, model, ref = hybrid
    steps = [INFO, gen(DOC), STATS, gen(DOC), STATS, gen(SHARED), STATS, gen(EXT), STATS]
    info, *out = run_engine({"model": model, "kvtier": HOST, "steps": steps, "log_stats": True})
    assert info["kv_cache_groups"] == m.groups and info["connector"] == "KVTierConnector"
    full = m.hit(len(DOC))
    assert loaded_after_each(out) == [0, full, m.hit(len(SHARED), 400), full]
    assert out[0::2] == [ref["cold"], ref["doc"], ref["shared"], ref["ext"]]
    stats = out[-1]
    assert stats["load_failed_blocks"] == 0 and stats["save_errors"] == 0


def test_verification_compares_every_groups_pages(run_engine, hybrid) -> None:
    """``verify_fraction`` 1.0: a hit is recomputed instead of loaded and every page vLLM still
    holds (every group's pages of the blocks it computed) is compared with the stored chunk. A
    right cache raises no alarm (the answer is the cold one); OTHER with only one group's
    pages zeroed is caught."""
    m, model, ref = hybrid
    kvtier = {**HOST, "verify_fraction": 1.0}
    steps = [
        gen(DOC),
        gen(DOC),
        FLUSH,
        STATS,
        gen(OTHER),
        {"op": "corrupt", "prompt": OTHER, "salt": None, "group": m.verify_group},
        gen(OTHER),
        FLUSH,
        STATS,
    ]
    out = run_engine({"model": model, "kvtier": kvtier, "steps": steps})
    cold, checked, right, wrong = out[0], out[1], out[3], out[8]
    assert cold == checked == ref["cold"]
    assert right["verify_chunks"] >= m.doc_entries and right["verify_mismatches"] == 0, right
    assert wrong["verify_mismatches"] >= 1, wrong


def test_restart_from_disk_and_each_groups_pages_matter(run_engine, hybrid, tmp_path) -> None:
    """A new engine on the same disk loads DOC's chunks (every group's pages) and answers as
    vLLM's prefix cache; zeroing only a sliding-window group's pages of a stored prompt, or
    only the full-attention group's, changes the answer (the negative controls: each group's
    pages are loaded into its own blocks and used)."""
    m, model, ref = hybrid
    tiers = {
        "tiers": ["local_cpu", "local_disk"],
        "local_cpu_size_gb": 0.25,
        "local_disk_path": str(tmp_path / "disk"),
    }
    first = run_engine({"model": model, "kvtier": tiers, "steps": [gen(DOC), FLUSH]})
    assert first[0] == ref["cold"]
    steps = [
        gen(DOC),
        STATS,
        {"op": "corrupt", "prompt": DOC, "salt": None, "group": m.window_group},
        gen(DOC),
        gen(OTHER),
        {"op": "corrupt", "prompt": OTHER, "salt": None, "group": m.full_group},
        gen(OTHER),
    ]
    again, stats, zeroed_window, window_out, other_cold, zeroed_full, full_out = run_engine(
        {"model": model, "kvtier": tiers, "steps": steps}
    )
    assert again == ref["doc"]
    assert stats["loaded_tokens"] == m.hit(len(DOC))
    assert zeroed_window >= m.doc_entries and zeroed_full >= 1
    assert other_cold == ref["other_cold"]
    for wrong, right in ((window_out, "doc"), (full_out, "other")):
        assert wrong != ref[right]


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
