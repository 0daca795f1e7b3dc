"""Asynchronous loads through real vLLM on CPU (``load_async``, the default).

A hit is loaded on the worker's loader thread while vLLM keeps running other requests; the
request waits in WAITING_FOR_REMOTE_KVS until the worker reports the load. Loads are slowed by
a test hook (as a slow tier would be), never timed: the assertions count tokens and blocks.
"""

from __future__ import annotations

import pytest
from prompts import DOC, FLUSH, FULL_HIT, OTHER, STATS, gen

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Every hit on the loader thread (a short hit in host memory would otherwise load before the
# forward pass of its first step: test_e2e_index_lookup.py, test_sync_loads.py).
CONFIG = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25, "sync_load_mb": 0.0}


def test_another_request_keeps_decoding_while_a_hit_loads(run_engine, hit_reference) -> None:
    """DOC is stored; then DOC (a full hit whose load takes 2 s) and OTHER (decoding 24 tokens)
    are added together, once with asynchronous loads and once with synchronous ones. Both times
    OTHER decodes while DOC's lookup is probed (a step or two) and along DOC's 8 tokens;
    asynchronously it also decodes during the 2 s load, synchronously the whole step waits for
    it (a step takes well under 0.5 s here). DOC's tokens equal vLLM's prefix cache hitting the
    same blocks (``hit_reference``); its logprobs are not compared here: it decodes batched with
    OTHER, and CPU kernels are not batch-invariant (a logprob moved by 0.06 in one such run with
    no KV involved). The KV itself is compared exactly by the one-request tests."""
    before = {}
    for load_async in (True, False):
        steps = [
            gen(DOC),
            {
                "op": "load_while_decoding",
                "first": DOC,
                "second": OTHER[:200],
                "delay_s": 2.0,
                "second_max_tokens": 24,
            },
            STATS,
        ]
        out = run_engine({"kvtier": {**CONFIG, "load_async": load_async}, "steps": steps})
        both = out[1]
        assert both["first"]["tokens"] == hit_reference["doc"]["tokens"]
        assert out[2]["loaded_tokens"] == FULL_HIT
        assert out[2]["holds"] == out[2]["held_objects"] == 0
        before[load_async] = both["second_tokens_when_first_finished"]
    assert before[False] >= 8  # OTHER decodes batched with DOC's 8 tokens either way
    assert before[True] >= before[False] + 4  # ... and only asynchronously during the load


def test_an_abort_during_a_load_gives_every_block_back(run_engine, hit_reference) -> None:
    steps = [
        gen(DOC),
        {"op": "abort_during_load", "prompt": DOC, "delay_s": 2.0},
        STATS,
        gen(DOC),
        STATS,
    ]
    out = run_engine({"kvtier": CONFIG, "steps": steps})
    assert out[1] is True  # reset_prefix_cache succeeded: no block was kept
    assert out[2]["holds"] == out[2]["held_objects"] == 0
    assert out[3] == hit_reference["doc"]
    assert out[4]["loaded_tokens"] - out[2]["loaded_tokens"] == FULL_HIT  # served after all


def test_a_disk_only_hit_is_probed_without_stalling_the_scheduler(
    run_engine, hit_reference, tmp_path
) -> None:
    """After a restart DOC is only on disk. Its lookup (a probe on the worker's threads, slowed
    to 4 s by a test hook as a slow disk would be: long enough that OTHER decodes past its
    batched tokens on a slow day too) runs while OTHER decodes: the scheduler
    answers "not yet" instead of waiting, so OTHER keeps decoding and no scheduler step
    takes anywhere near the probe's 4 s (kvtier's share of each step is the
    ``scheduler_seconds`` histogram, read through vLLM's own metrics). DOC is then loaded from
    disk; its tokens equal vLLM's prefix cache hitting the same blocks."""
    config = {
        "tiers": ["local_cpu", "local_disk"],
        "local_cpu_size_gb": 0.25,
        "local_disk_path": str(tmp_path / "disk"),
        "lookup_timeout_s": 20.0,
    }
    run_engine({"kvtier": config, "steps": [gen(DOC), FLUSH]})
    steps = [
        {
            "op": "load_while_decoding",
            "first": DOC,
            "second": OTHER[:200],
            "delay_s": 4.0,
            "delay": "hold",
            "second_max_tokens": 24,
        },
        STATS,
        {"op": "metrics", "prefixes": ["vllm:kvtier_scheduler_seconds"]},
    ]
    out = run_engine({"kvtier": config, "log_stats": True, "steps": steps})
    both = out[0]
    assert both["first"]["tokens"] == hit_reference["doc"]["tokens"]
    # OTHER got tokens beyond the 8 it decodes batched with DOC (how many depends on the
    # machine's step time); that no step waited for the probe is the histogram's to say.
    assert both["second_tokens_when_first_finished"] > 8
    assert out[1]["loaded_tokens"] == FULL_HIT  # from disk, through the probe's hold
    (hist,) = out[2]
    assert hist["count"] > 10
    assert hist["buckets"]["0.5"] == hist["count"]  # no step waited for the 4 s probe
