"""Prefill/decode handover through the shared tiers, on the scheduler half with real worker
parts: a producer announces what it stored in the request's ``kv_transfer_params``; a consumer
whose request carries an announcement waits (answering "not yet", never blocking) until the
announced chunks are readable, then loads them; the wait is bounded."""

from __future__ import annotations

import pytest
import torch
from sched_harness import BLOCK, CHUNK, Harness, request

from kvtier.core.errors import ConfigError
from kvtier.vllm_integration.handover import (
    ConsumerWait,
    announced,
    announcement,
    producer_config,
)
from kvtier.vllm_integration.scheduler.side import SchedulerSide

PROMPT = list(range(100, 100 + 3 * CHUNK + 5))
HIT = 3 * CHUNK


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def consumer(**overrides) -> tuple[Harness, Clock]:
    h = Harness.create(**overrides)
    h.sched.loads_enabled, h.sched.saves_enabled = True, False
    clock = Clock()
    h.sched.waits = ConsumerWait(h.sched.config, clock)
    return h, clock


def test_a_producer_announces_what_it_stored() -> None:
    h = Harness.create()
    try:
        h.sched.loads_enabled = False  # a producer
        req = request(PROMPT)
        h.store(req)
        _, params = h.sched.finished(req, [])
        assert announced(params) == len(PROMPT) - len(PROMPT) % BLOCK
        both = request(PROMPT)
        h.sched.loads_enabled = True  # kv_both announces nothing
        h.store(both)
        assert h.sched.finished(both, [])[1] is None
    finally:
        h.close()


def test_a_producer_without_unfull_chunks_announces_only_whole_chunks() -> None:
    """With ``save_unfull_chunk: false`` the engine stores whole chunks: announcing the
    block-aligned tail too made every consumer wait ``consumer_wait_s`` for blocks never
    stored. The consumer then loads exactly what was announced, without waiting."""
    h = Harness.create(save_unfull_chunk=False)
    try:
        h.sched.loads_enabled = False  # a producer
        prompt = list(range(100, 100 + 3 * CHUNK + BLOCK + 5))  # a whole block past 3 chunks
        req = request(prompt)
        h.store(req)
        _, params = h.sched.finished(req, [])
        assert announced(params) == 3 * CHUNK
        h.sched.loads_enabled, h.sched.saves_enabled = True, False  # now its consumer
        clock = Clock()
        h.sched.waits = ConsumerWait(h.sched.config, clock)
        follow = request(prompt)
        follow.kv_transfer_params = params
        assert h.hit(follow) == 3 * CHUNK
        assert h.sched.waits.timeouts == 0
    finally:
        h.close()


def test_a_consumer_waits_for_announced_chunks_then_loads_them() -> None:
    h, clock = consumer()
    try:
        req = request(PROMPT)
        req.kv_transfer_params = announcement(len(PROMPT))
        # Nothing readable yet: "not yet", whatever the probes find, until the chunks land.
        for _ in range(3):
            assert h.sched.get_num_new_matched_tokens(req, 0)[0] is None
            h.step()
            clock.now += 0.06  # paced: a probe at most every 50 ms
        h.ranks[0].engine.store(PROMPT, torch.arange(len(PROMPT)))
        h.report()
        answers = []
        for _ in range(4):
            n, _ = h.sched.get_num_new_matched_tokens(req, 0)
            answers.append(n)
            if n is not None:
                break
            h.step()
            clock.now += 0.06
        assert answers[-1] == HIT, answers
        assert h.sched.waits.timeouts == 0
    finally:
        h.close()


def test_the_wait_is_bounded() -> None:
    h, clock = consumer(consumer_wait_s=2.0)
    try:
        req = request(PROMPT)
        req.kv_transfer_params = announcement(len(PROMPT))
        h.ranks[0].engine.store(PROMPT[:CHUNK], torch.arange(CHUNK))
        h.report()
        n = None
        for _ in range(100):
            n, _ = h.sched.get_num_new_matched_tokens(req, 0)
            if n is not None:
                break
            h.step()
            clock.now += 0.25
        assert n == CHUNK, "served with what was there"
        assert h.sched.waits.timeouts == 1
        assert clock.now - 1000.0 >= 2.0
    finally:
        h.close()


def test_a_request_without_an_announcement_does_not_wait() -> None:
    h, _ = consumer()
    try:
        req = request(PROMPT)
        assert h.hit(req) == 0
        other = request(PROMPT)
        other.kv_transfer_params = {"do_remote_decode": True}  # another connector's
        assert h.hit(other) == 0
    finally:
        h.close()


@pytest.mark.parametrize("params", [None, {}, {"kvtier": 3}, {"kvtier": {"stored_tokens": "x"}}])
def test_what_is_not_an_announcement(params) -> None:
    assert announced(params) == 0


def test_a_producer_waits_for_room_in_the_write_queue_and_is_never_lazy() -> None:
    from kvtier.core.config import load_config

    cfg = load_config(env={}, overrides={})
    assert producer_config(cfg).write_queue_wait_s == 10.0
    assert producer_config(cfg.replace(write_queue_wait_s=30.0)).write_queue_wait_s == 30.0
    lazy = load_config(env={}, overrides={"offload": "lazy"})
    with pytest.raises(ConfigError, match=r"offload.*kv_producer"):
        SchedulerSide(
            lazy,
            block_size=BLOCK,
            num_workers=1,
            load_failure_policy="recompute",
            role="kv_producer",
        )
