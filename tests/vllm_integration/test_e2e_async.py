"""Asynchronous loads through real vLLM on CPU (``load_async``, the default).

A hit is loaded on the worker's loader thread while vLLM keeps running other requests; the
request waits in WAITING_FOR_REMOTE_KVS until the worker reports the load. Loads are slowed by
a test hook (as a slow tier would be), never timed: the assertions count tokens and blocks.
"""

from __future__ import annotations

import pytest
from prompts import DOC, FULL_HIT, OTHER, STATS, gen

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONFIG = {"tiers": ["local_cpu"], "local_cpu_size_gb": 0.25}


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_another_request_keeps_decoding_while_a_hit_loads(run_engine, reference,
                                                          load_async) -> None:
    """DOC is stored; then DOC (a full hit whose load takes 2 s) and OTHER (decoding 24 tokens)
    are added together. Asynchronously, OTHER's tokens keep coming while DOC loads; with
    synchronous loads the whole step waits for the load (a step takes well under 0.5 s here). DOC's tokens equal vLLM without kvtier;
    its logprobs are not compared here: it decodes batched with OTHER, and CPU kernels are not
    batch-invariant (a logprob moved by 0.06 in one such run with no KV involved). The KV itself
    is compared exactly by the one-request tests."""
    steps = [gen(DOC), {"op": "load_while_decoding", "first": DOC, "second": OTHER[:200],
                        "delay_s": 2.0, "second_max_tokens": 24}, STATS]
    out = run_engine({"kvtier": {**CONFIG, "load_async": load_async}, "steps": steps})
    both = out[1]
    assert both["first"]["tokens"] == reference["doc"]["tokens"]
    # DOC decodes 8 tokens after its load, batched with OTHER: with a synchronous load OTHER
    # has at most those 8 when DOC finishes; asynchronously OTHER also decoded during the load.
    before = both["second_tokens_when_first_finished"]
    if load_async:
        assert before >= 8 + 4
    else:
        assert before <= 8
    assert out[2]["loaded_tokens"] == FULL_HIT
    assert out[2]["holds"] == out[2]["held_objects"] == 0


def test_an_abort_during_a_load_gives_every_block_back(run_engine, reference) -> None:
    steps = [gen(DOC), {"op": "abort_during_load", "prompt": DOC, "delay_s": 2.0}, STATS,
             gen(DOC), STATS]
    out = run_engine({"kvtier": CONFIG, "steps": steps})
    assert out[1] is True  # reset_prefix_cache succeeded: no block was kept
    assert out[2]["holds"] == out[2]["held_objects"] == 0
    assert out[3] == reference["doc"]
    assert out[4]["loaded_tokens"] - out[2]["loaded_tokens"] == FULL_HIT  # served after all
