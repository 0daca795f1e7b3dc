"""Verification by recompute on the scheduler side, stepped through the harness with real
worker parts: a sampled request is told "no hit", keeps its hold, and its check goes out with
the step that computes its hit; the workers' check passes on the same KV and catches changed
KV (removed, tier quarantined, the scheduler's index no longer trusted); roles and budgets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sched_harness import BLOCK, CHUNK, Harness, request

from kvtier.vllm_integration.scheduler.verify import VerifySampling
from kvtier.vllm_integration.worker.verify import WorkerVerify

PROMPT = list(range(100, 100 + 3 * CHUNK + 5))
HIT = 3 * CHUNK  # whole chunks, the last prompt token recomputed


def verifier(h: Harness, rank: int = 0) -> WorkerVerify:
    r = h.ranks[rank]
    return WorkerVerify(r.engine, r.holds, quarantined=r.feed.quarantined)


@pytest.fixture
def h():
    harness = Harness.create(verify_fraction=1.0)
    yield harness
    harness.close()


def test_a_sampled_request_is_told_no_hit_and_checked_once_computed(h) -> None:
    h.store(request(PROMPT))
    req = request(PROMPT)
    assert h.hit(req) == 0, "sampled: vLLM computes the prefix itself"
    assert h.sched.verify.requests == 1 and h.sched.verify.tokens == HIT
    assert h.hit(req) == 0, "asked again while waiting: still no hit, no new probe"
    assert h.ranks[0].holds.stats()["holds"] == 1, "the lookup's hold is kept for the check"
    meta = h.prefill(req)
    assert not meta.releases and not meta.loads
    (check,) = meta.verifies
    assert check.req_id == req.request_id and check.start == 0
    assert np.array_equal(check.tokens, np.array(PROMPT[:HIT]))
    assert check.block_ids == list(range(HIT // BLOCK)) and check.hold_id is not None
    # The worker's check (the prefill wrote the same KV into the same blocks as the store)
    v = verifier(h)
    v.run(check, None)
    assert v.verifier.values() == {"verify_chunks": {"": 3}, "verify_mismatches": {}}
    assert h.ranks[0].holds.stats()["holds"] == 0, "the hold went with the check"
    assert h.sched.get_kv_connector_stats().data["counters"]["verify_requests"] == {"": 1}
    # Once checked, the request is never sampled again and a new request may be
    assert h.sched.verify.sample(h.sched.requests.track(req), 0, HIT, None) is None


def test_changed_kv_is_caught_and_the_index_is_not_trusted_meanwhile(h) -> None:
    h.store(request(PROMPT))
    req = request(PROMPT)
    h.hit(req)
    (check,) = h.prefill(req).verifies
    rank = h.ranks[0]
    for c in rank.caches:  # what vLLM "recomputed" is not what was stored
        c.copy_(torch.randn(c.shape).to(c.dtype))
    v = verifier(h)
    v.run(check, None)
    assert v.verifier.values()["verify_mismatches"] == {"local_cpu": 3}
    assert rank.engine.lookup(PROMPT) == 0
    assert h.sched.verify.index_trusted
    h.report()
    assert not h.sched.verify.index_trusted, "the quarantine reached the scheduler"


@pytest.mark.parametrize("at", ["lookup", "schedule"])
def test_a_prefix_from_vllms_own_cache_is_not_compared(h, at) -> None:
    """What vLLM's prefix cache had, when asked or when it scheduled the request, is not
    recomputed by the request: the check starts after it."""
    h.store(request(PROMPT))
    req = request(PROMPT)
    assert h.hit(req, computed=CHUNK if at == "lookup" else 0) == 0
    (check,) = h.prefill(req, computed=CHUNK if at == "schedule" else 0).verifies
    assert check.start == CHUNK
    v = verifier(h)
    v.run(check, None)
    assert v.verifier.values()["verify_chunks"] == {"": 2}, "the first chunk is not compared"


def test_a_request_that_ends_before_its_check_releases_the_hold(h) -> None:
    h.store(request(PROMPT))
    req = request(PROMPT)
    h.hit(req)
    assert not h.sched.request_finished(req, [])
    meta = h.step()
    assert any(rid == req.request_id for rid, _ in meta.releases)
    assert h.ranks[0].holds.stats()["holds"] == 0


@pytest.mark.parametrize(
    "overrides",
    [{"verify_fraction": 0.0}, {"verify_fraction": 1.0, "verify_max_tokens": HIT - 1}],
    ids=["off", "over-budget"],
)
def test_who_is_never_sampled(overrides) -> None:
    h = Harness.create(**overrides)
    try:
        h.store(request(PROMPT))
        assert h.hit(request(PROMPT)) == HIT
        assert h.sched.verify.requests == 0
    finally:
        h.close()


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_producers_and_consumers_never_sample(h, role) -> None:
    sampling = VerifySampling(h.sched.config, role, BLOCK)
    assert sampling.sample(h.sched.requests.track(request(PROMPT)), 0, HIT, None) is None


def test_a_fraction_samples_about_that_share() -> None:
    h = Harness.create(verify_fraction=0.25)
    try:
        h.store(request(PROMPT))
        hits = [h.hit(request(PROMPT)) for _ in range(200)]
        sampled = hits.count(0)
        assert sampled == h.sched.verify.requests
        assert 25 <= sampled <= 80, sampled  # binomial(200, 0.25): mean 50, sd 6
    finally:
        h.close()


def test_a_request_looked_up_again_and_again_is_drawn_once() -> None:
    """vLLM asks for a waiting request's hit every step until it has blocks for it (under
    memory pressure, many steps): the share sampled stays ``verify_fraction`` of requests, and
    a request answered a hit is answered the same hit again, never sampled later."""
    h = Harness.create(verify_fraction=0.25)
    try:
        h.store(request(PROMPT))
        answers = []
        for _ in range(200):
            req = request(PROMPT)
            answers.append({h.hit(req) for _ in range(6)})
        assert all(len(a) == 1 for a in answers), "one request, one answer"
        sampled = sum(a == {0} for a in answers)
        assert sampled == h.sched.verify.requests
        # binomial(200, 0.25): mean 50, sd 6; six draws a request would sample about 165
        assert 25 <= sampled <= 80, sampled
    finally:
        h.close()


def test_caches_whose_pages_are_not_numbers_are_never_sampled() -> None:
    """Read from vLLM's own cache spec on the scheduler: a dense bf16 cache can be verified; a
    cache that packs scales next to its values (``state_content_bytes``) cannot, and sampling
    it would compute requests for nothing."""
    import dataclasses

    from fixtures.kv_views import vllm_kv_cache_config
    from kvtier.core import KVLayout, load_config
    from kvtier.vllm_integration.layout import pages_verifiable

    layout = KVLayout(2, 2, 64, "bfloat16", BLOCK)
    dense = vllm_kv_cache_config(layout, 8)
    assert pages_verifiable("auto", dense)
    group = dense.kv_cache_groups[0]
    packed_spec = dataclasses.replace(group.kv_cache_spec, state_content_bytes=2 * 64 * 2 + 8)
    packed = dataclasses.replace(
        dense, kv_cache_groups=[dataclasses.replace(group, kv_cache_spec=packed_spec)]
    )
    assert not pages_verifiable("auto", packed)
    assert pages_verifiable("auto", None), "nothing to read: the workers decide"
    config = load_config(env={}, overrides={"verify_fraction": 1.0})
    assert VerifySampling(config, "kv_both", BLOCK, verifiable=False).fraction == 0.0
    assert VerifySampling(config, "kv_both", BLOCK).fraction == 1.0
