"""Prefill/decode handover through the shared tiers, on the scheduler half with real worker
parts: a producer announces what it stored in the request's ``kv_transfer_params``; a consumer
whose request carries an announcement waits (answering "not yet", never blocking) until the
announced chunks are readable, or every rank found the producer's receipt (written after its
last save: what is there is all that is coming), then loads them; the wait is bounded."""

from __future__ import annotations

import pytest
import torch
from sched_harness import BLOCK, CHUNK, Harness, empty_output, request

from kvtier.core.errors import ConfigError
from kvtier.vllm_integration.handover import (
    ConsumerWait,
    Receipts,
    announced,
    announced_receipt,
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


def act_as(
    h: Harness,
    *,
    loads: bool,
    saves: bool,
    waits: ConsumerWait | None = None,
    receipts: Receipts | None = None,
) -> None:
    """Give the harness's scheduler half another role over the same tiers."""
    life = h.sched.requests
    life.loads_enabled, life.saves_enabled = loads, saves
    life.p.waits = h.sched.waits = waits
    life.p.receipts = h.sched.receipts = receipts


def consumer(**overrides) -> tuple[Harness, Clock]:
    h = Harness.create(**overrides)
    clock = Clock()
    act_as(h, loads=True, saves=False, waits=ConsumerWait(h.sched.config, clock))
    return h, clock


def test_a_producer_announces_what_it_stored() -> None:
    h = Harness.create()
    try:
        act_as(h, loads=False, saves=True)  # a producer
        req = request(PROMPT)
        h.store(req)
        _, params = h.sched.finished(req, [])
        assert announced(params) == len(PROMPT) - len(PROMPT) % BLOCK
        both = request(PROMPT)
        act_as(h, loads=True, saves=True)  # kv_both announces nothing
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
        act_as(h, loads=False, saves=True)  # a producer
        prompt = list(range(100, 100 + 3 * CHUNK + BLOCK + 5))  # a whole block past 3 chunks
        req = request(prompt)
        h.store(req)
        _, params = h.sched.finished(req, [])
        assert announced(params) == 3 * CHUNK
        clock = Clock()
        act_as(h, loads=True, saves=False, waits=ConsumerWait(h.sched.config, clock))
        follow = request(prompt)
        follow.kv_transfer_params = params
        assert h.hit(follow) == 3 * CHUNK
        assert h.sched.waits.timeouts == 0
    finally:
        h.close()


def producer(**overrides) -> Harness:
    h = Harness.create(**overrides)
    act_as(h, loads=False, saves=True, receipts=Receipts("prefill-engine"))
    return h


def as_consumer(h: Harness) -> Clock:
    """The same tiers, now read by a consumer's scheduler half (the default 10 s wait)."""
    clock = Clock()
    act_as(h, loads=True, saves=False, waits=ConsumerWait(h.sched.config, clock))
    return clock


@pytest.mark.parametrize("stored_chunks", [0, 1, 3])
def test_a_consumer_stops_waiting_at_the_receipt_of_a_producer_that_stored_less(
    stored_chunks,
) -> None:
    """The producer announces the prompt when the request finishes, and its stores are then
    skipped (host memory full of chunks still being written): before receipts, the consumer
    waited ``consumer_wait_s`` for tokens that were never coming. The receipt, written after
    the request's last save, ends the wait at the next probe; what was stored is loaded."""
    h = producer()
    try:
        req = request(PROMPT)
        meta = h.store(req, saved=False)
        (receipt,) = meta.receipts
        assert receipt.req_id == req.request_id
        _, params = h.sched.finished(req, [])
        assert announced(params) == len(PROMPT) - len(PROMPT) % BLOCK
        assert announced_receipt(params) == receipt.receipt
        n = stored_chunks * CHUNK
        if n:
            h.ranks[0].engine.store(PROMPT[:n], torch.arange(n))
        clock = as_consumer(h)
        follow = request(PROMPT)
        follow.kv_transfer_params = params
        assert h.hit(follow) == min(n, HIT)
        assert h.sched.waits.timeouts == 0
        assert h.sched.waits.settled_short == (1 if n < HIT else 0)
        assert clock.now == 1000.0, "no wait beyond the probes"
    finally:
        h.close()


def test_a_receipt_on_one_rank_of_two_is_not_the_end() -> None:
    """Each rank writes its own receipt: until every rank's is found, the consumer waits."""
    h = producer(world_size=2)
    try:
        req = request(PROMPT)
        h.store(req, ranks=[0], saved=False)  # rank 1's saver has not got there yet
        _, params = h.sched.finished(req, [])
        as_consumer(h)
        follow = request(PROMPT)
        follow.kv_transfer_params = params
        for _ in range(4):
            assert h.sched.get_num_new_matched_tokens(follow, 0)[0] is None
            h.step()
            h.sched.waits._clock.now += 0.06  # type: ignore[attr-defined]
        assert h.sched.waits.settled_short == 0
    finally:
        h.close()


def test_a_producer_sends_a_new_receipt_after_a_preemption() -> None:
    """A preempted request's KV is saved again on resume: its receipt goes after those saves."""
    h = producer()
    try:
        req = request(PROMPT)
        first = h.store(req)
        assert len(first.receipts) == 1
        assert h.step().receipts == []  # once per prompt
        preempt = empty_output()
        preempt.preempted_req_ids = {req.request_id}
        h.deliver(h.sched.build_connector_meta(preempt))
        again = h.store(req)
        assert again.saves, "saved again on resume"
        assert [r.receipt for r in again.receipts] == [r.receipt for r in first.receipts]
    finally:
        h.close()


@pytest.mark.parametrize(
    "params",
    [
        None,
        {"kvtier": {"stored_tokens": 5}},
        {"kvtier": {"stored_tokens": 5, "receipt": 7}},
        {"kvtier": {"stored_tokens": 5, "receipt": "zz" * 16}},
        {"kvtier": {"stored_tokens": 5, "receipt": "ab"}},
    ],
)
def test_what_is_not_a_receipt(params) -> None:
    assert announced_receipt(params) is None


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
