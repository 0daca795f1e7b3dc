"""kvtier through real vLLM on CPU: outputs, logprobs and hits, with the local random model.

Every run is a new engine (``run_engine``); hits are counted by the worker-side
connector's counters (``loaded_tokens``), never inferred from timings. Block size 32, chunk
256: a 700-token prompt stores chunks [0,256) [256,512) and the block-aligned tail [512,672);
a repeat loads 672 tokens (the most that leaves the last token to recompute).

Each comparison changes one factor: the reference runs in the same mode (in process, as every
run here; vLLM's multiprocess mode is test_e2e_tp.py's, whose TP 2 workers run apart from the
scheduler) with only kvtier switched off. A cold request equals vLLM without kvtier; a hit
(full or partial) equals vLLM's own prefix cache hitting the same blocks of the same prompts
(``hit_reference``): it computes the same suffix after the same cached KV, so tokens and
logprobs must be identical. A full recompute is not a hit's reference: on CPUs whose kernels are
not batch-invariant a suffix computed after a hit differs from one long prefill (``prompts.py``).
The negative control (zeroed stored KV) moves the logprobs by far more than
``CORRUPT_GAP``.
"""

from __future__ import annotations

import os

import pytest
from prompts import (
    CORRUPT_GAP,
    DOC,
    FLUSH,
    FULL_HIT,
    OTHER,
    PARTIAL_HIT,
    SHARED,
    STATS,
    gen,
    loaded_after_each,
    logprob_gap,
)

pytestmark = [pytest.mark.vllm]


def kvtier_config(tmp_path, **extra) -> dict:
    return {"local_disk_path": str(tmp_path / "disk"), "local_cpu_size_gb": 0.25, **extra}


# Lazy offload needs vLLM's prefix cache, which would answer every repeat itself: the engine
# gets 80 blocks, and before each request after the first a prompt filling all of them (a new
# one each time) evicts everything else; lazy offload copies the blocks first.
LAZY_BLOCKS = 80
LAZY_ENGINE = {
    "prefix_caching": True,
    "num_gpu_blocks_override": LAZY_BLOCKS,
    "max_model_len": (LAZY_BLOCKS - 1) * 32,
}


def with_fillers(steps: list[dict]) -> tuple[list[dict], set[int]]:
    """``steps`` with a cache-filling request before every generate or corrupt step but the
    first; and the indices of the fillers' results."""
    out: list[dict] = []
    fillers: set[int] = set()
    for step in steps:
        if step["op"] in ("generate", "corrupt") and out:
            k = len(fillers) + 1
            n = (LAZY_BLOCKS - 1) * 32 - 8
            fillers.add(len(out))
            out.append(
                {**gen([3 + (7919 * i + 104729 * k) % 2990 for i in range(n)]), "max_tokens": 1}
            )
        out.append(step)
    return out, fillers


@pytest.mark.parametrize(
    ("layerwise", "load_async", "offload", "pipe"),
    [
        (False, True, "eager", False),
        (False, False, "eager", False),
        (True, False, "eager", False),
        (False, True, "lazy", False),
        (False, True, "eager", True),
    ],
    ids=["whole-async", "whole-sync", "layerwise", "lazy", "layer-pipe"],
)
def test_outputs_match_and_hits_are_used(
    run_engine, reference, hit_reference, layerwise, load_async, offload, pipe
) -> None:
    """vLLM's default kv_load_failure_policy ("fail"), a small host tier only. Between the full
    hit's lookup and its load, other chunks are put until the tier is full (as other requests'
    saves would): without the lookup's hold they evict every chunk of the prompt and the load
    fails the request; the hold keeps them, so it neither fails nor recomputes. ``lazy``: the
    same with lazy offload (see ``LAZY_ENGINE``). ``layer-pipe``: synchronous loads copied on
    another thread while the forward pass runs (``worker/layer_pipe.py``), as in an engine that
    vLLM CPU bound to its cores."""
    steps = [
        gen(DOC),
        STATS,  # cold
        {**gen(DOC), "evict_after_lookup": True},
        STATS,  # full hit, under eviction pressure
        gen(SHARED),
        STATS,  # partial-prefix hit
        gen(DOC, "tenant-a"),
        STATS,  # another salt: stored apart, no hit
        gen(DOC, "tenant-a"),
        STATS,  # its own salt hits
        gen(DOC, "tenant-b"),
        STATS,  # a third salt does not see tenant-a's chunks
        gen(OTHER),
        STATS,
        {"op": "corrupt", "prompt": OTHER},
        gen(OTHER),
        STATS,  # negative control
        {"op": "sched_stats"},
    ]
    config = {
        "tiers": ["local_cpu"],
        "local_cpu_size_gb": 0.1,
        "use_layerwise": layerwise,
        "load_async": load_async,
        "offload": offload,
    }
    if offload == "lazy":
        steps, fillers = with_fillers(steps)
        out = run_engine({"kvtier": config, **LAZY_ENGINE, "steps": steps})
        out = [r for i, r in enumerate(out) if i not in fillers]
    else:
        extra = {"background_cpus": sorted(os.sched_getaffinity(0))} if pipe else {}
        out = run_engine({"kvtier": config, "steps": steps, **extra})
    sched = out.pop()
    evict = out[2].pop("evict")
    # Chunks [0,256) [256,512) and tail blocks [512,672) were stored; filling the tier evicted
    # other chunks, never held ones.
    assert (evict["stored"], evict["evicted"], evict["tier_full"]) == (7, 0, True)
    corrupted = out.pop(-2)
    assert out.pop(-2) > 0  # chunks overwritten
    out.insert(-1, corrupted)
    results = out[0::2]
    # Tokens and logprobs, exactly: cold requests as vLLM without kvtier, hits as vLLM's prefix
    # cache hitting the same blocks.
    cold_doc, full_hit, partial_hit, salt_a, salt_a_hit, salt_b, other = results[:7]
    assert cold_doc == salt_a == salt_b == reference["doc"]
    assert full_hit == salt_a_hit == hit_reference["doc"]
    assert partial_hit == hit_reference["shared"]
    assert other == reference["other"]
    assert loaded_after_each(out) == [
        0,
        FULL_HIT,
        PARTIAL_HIT,
        0,
        FULL_HIT,
        0,
        0,
        (len(OTHER) - 1) // 32 * 32,
    ]
    # The loaded KV is what the model attended to: zeros in the cache change the answer.
    assert logprob_gap(corrupted, reference["other"]) > CORRUPT_GAP
    stats = out[-1]
    assert stats["load_failed_blocks"] == 0 and stats["save_errors"] == 0
    assert stats["loads_without_hold"] == 0
    assert (stats["layer_pipe_loads"] > 0) == pipe
    assert stats["holds"] == stats["held_objects"] == 0  # every lookup's hold was let go
    # A request whose saves every worker reported copied before it finished gives its blocks
    # back at once (lazy offload saves only after the request finished).
    if offload == "eager":
        assert sched["finished_freed_at_once"] >= 5, sched
    else:
        assert sched["finished_freed_at_once"] == sched["finished_held"] == 0, sched


@pytest.mark.slow
def test_restart_hits_the_disk_tier(run_engine, reference, hit_reference, tmp_path) -> None:
    """A restarted engine loads the prompt from disk, with asynchronous loads (the default)
    and with synchronous ones."""
    config = kvtier_config(tmp_path)
    first = run_engine({"kvtier": config, "steps": [gen(DOC), FLUSH]})
    assert first == [reference["doc"], True]
    for load_async in (True, False):
        again = {**config, "load_async": load_async}
        second = run_engine({"kvtier": again, "steps": [gen(DOC), STATS]})
        assert second[0] == hit_reference["doc"], load_async
        assert second[1]["loaded_tokens"] == FULL_HIT, load_async


@pytest.mark.slow
@pytest.mark.redis
def test_two_engines_share_through_redis(run_engine, reference, hit_reference, redis_clean) -> None:
    config = {
        "tiers": ["local_cpu", "redis"],
        "redis_url": redis_clean.url,
        "local_cpu_size_gb": 0.25,
    }
    first = run_engine({"kvtier": config, "steps": [gen(DOC), FLUSH, STATS]})
    assert first[:2] == [reference["doc"], True]
    assert first[2]["loaded_tokens"] == 0
    for load_async in (True, False):  # asynchronous loads (the default) and synchronous ones
        again = {**config, "load_async": load_async}
        second = run_engine({"kvtier": again, "steps": [gen(DOC), STATS]})
        assert second[0] == hit_reference["doc"], load_async
        assert second[1]["loaded_tokens"] == FULL_HIT, load_async


@pytest.mark.parametrize("decode", [False, True], ids=["prompt-only", "save-decode"])
def test_generated_tokens_are_saved_only_with_save_decode_cache(
    run_engine, tmp_path, decode
) -> None:
    """Prompt of 100 tokens, 60 generated, chunk 64. A follow-up prompt made of the first
    prompt and 40 generated tokens (140 tokens) can reuse [0, 128) only if the chunk filled by
    generated tokens was saved; otherwise the prompt's chunk and block-aligned tail, [0, 96)."""
    steps = [
        {**gen(OTHER[:100]), "max_tokens": 60},
        STATS,
        {**gen([]), "extend_with_previous": 40},
        STATS,
    ]
    config = kvtier_config(tmp_path, chunk_size=64, save_decode_cache=decode)
    out = run_engine({"kvtier": config, "steps": steps})
    assert len(out[0]["tokens"]) == 60
    assert loaded_after_each(out) == [0, 128 if decode else 96]


def test_bad_extra_config_fails_fast_naming_the_key(run_engine, tmp_path) -> None:
    with pytest.raises(AssertionError, match="chunk_sise"):
        run_engine({"kvtier": {"chunk_sise": 128}, "steps": []})
