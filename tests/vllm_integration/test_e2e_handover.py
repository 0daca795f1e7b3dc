"""Prefill/decode handover through a real Redis: a prefill instance (``kv_producer``) computes a
prompt and announces what it stored in the response's ``kv_transfer_params``; a decode instance
(``kv_consumer``) given them loads every announced token and computes none of them, and answers
as one instance with vLLM's own prefix cache does. A producer whose stores are skipped after it
announced ends its consumer's wait with the receipt it writes after its last save."""

from __future__ import annotations

import pytest
from prompts import DOC, FLUSH, FULL_HIT, STATS, gen

pytestmark = [pytest.mark.vllm, pytest.mark.redis]


def test_decode_loads_what_prefill_announced_through_redis(
    run_engine, hit_reference, redis_clean
) -> None:
    shared = {"chunk_size": 256, "tiers": ["local_cpu", "redis"], "redis_url": redis_clean.url}
    prefill = run_engine(
        {
            "kvtier": {**shared, "local_cpu_size_gb": 0.05},
            "kv_role": "kv_producer",
            "steps": [{**gen(DOC), "max_tokens": 1}, FLUSH, STATS],
        }
    )
    params = prefill[0].get("kv_transfer_params")
    assert params["kvtier"]["stored_tokens"] == len(DOC) - len(DOC) % 32, params
    assert prefill[2]["receipts_written"] == 1, "after the request's last save"
    decode = run_engine(
        {
            "kvtier": {**shared, "local_cpu_size_gb": 0.05},
            "kv_role": "kv_consumer",
            "steps": [{**gen(DOC), "kv_transfer_params": params}, STATS],
        }
    )
    assert decode[1]["loaded_tokens"] == FULL_HIT, "every announced token (n - 1, whole blocks)"
    assert decode[1]["saved_tokens"] == 0
    assert decode[0]["tokens"] == hit_reference["doc"]["tokens"]
    assert decode[0]["logprobs"] == hit_reference["doc"]["logprobs"]
    assert "kv_transfer_params" not in decode[0], "a consumer announces nothing"


def test_a_producer_that_died_before_its_writes_leaves_a_bounded_wait_and_a_miss(
    run_engine, reference, redis_clean
) -> None:
    """The announcement arrives, the chunks never do (the producer was killed before writing,
    or its writes were lost): the decode instance waits consumer_wait_s, then computes the
    prompt itself, and answers as a cold request does."""
    shared = {"chunk_size": 256, "tiers": ["local_cpu", "redis"], "redis_url": redis_clean.url}
    params = {"kvtier": {"stored_tokens": len(DOC) - len(DOC) % 32}}
    decode = run_engine(
        {
            "kvtier": {**shared, "local_cpu_size_gb": 0.05, "consumer_wait_s": 2.0},
            "kv_role": "kv_consumer",
            "steps": [{**gen(DOC), "kv_transfer_params": params}, STATS],
        }
    )
    assert decode[1]["loaded_tokens"] == 0
    assert decode[0]["tokens"] == reference["doc"]["tokens"]
    assert decode[0]["logprobs"] == reference["doc"]["logprobs"]


def test_a_producer_that_stored_nothing_ends_the_wait_with_its_receipt(
    run_engine, reference, redis_clean
) -> None:
    """The producer's host memory (200 kB) holds no chunk of 512 KiB: every store is skipped
    after the request announced its prompt, as when host memory is full of chunks still being
    written. Its receipt still reaches Redis after those saves, so the consumer (whose wait for
    the announced tokens would last 60 s) stops at its first probe that finds the receipt,
    computes the prompt, and answers as a cold request does."""
    shared = {"chunk_size": 256, "tiers": ["local_cpu", "redis"], "redis_url": redis_clean.url}
    prefill = run_engine(
        {
            "kvtier": {**shared, "local_cpu_size_gb": 0.0002},
            "kv_role": "kv_producer",
            "steps": [{**gen(DOC), "max_tokens": 1}, FLUSH, STATS],
        }
    )
    params = prefill[0].get("kv_transfer_params")
    assert params["kvtier"]["stored_tokens"] == len(DOC) - len(DOC) % 32, params
    assert len(params["kvtier"]["receipt"]) == 32, params
    assert prefill[2]["saved_tokens"] == 0, "nothing fit in host memory"
    assert prefill[2]["receipts_written"] == 1
    decode = run_engine(
        {
            "kvtier": {**shared, "local_cpu_size_gb": 0.05, "consumer_wait_s": 60.0},
            "kv_role": "kv_consumer",
            "steps": [
                {**gen(DOC), "kv_transfer_params": params},
                STATS,
                {"op": "sched_stats"},
            ],
        }
    )
    assert decode[1]["loaded_tokens"] == 0
    assert decode[2]["consumer_wait_timeouts"] == 0, "the receipt ended the wait"
    assert decode[2]["consumer_waits_settled_short"] == 1
    assert decode[0]["tokens"] == reference["doc"]["tokens"]
    assert decode[0]["logprobs"] == reference["doc"]["logprobs"]
