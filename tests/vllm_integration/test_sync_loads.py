"""A hit already in host memory loads in the step that schedules its request
(``scheduler/sync_loads.py``), driven step by step against real worker parts
(``sched_harness.py``). What vLLM does with such a load, including one that comes up short, is in
``test_e2e_index_lookup.py``."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from sched_harness import BLOCK, CHUNK, Harness, blocks, request

from kvtier.core.keys import KeyFactory
from kvtier.vllm_integration.messages import RankReport
from kvtier.vllm_integration.scheduler.index import HOST, OTHER, SAVING, PresenceIndex

DOC = list(range(1000, 1000 + 3 * CHUNK + BLOCK))  # 3 chunks and a tail block
OTHER_DOC = list(range(5000, 5000 + 3 * CHUNK + BLOCK))
MOST = len(DOC) - BLOCK  # the last block holds the last prompt token: always recomputed
TOKEN_BYTES = 16 << 10  # a hit of MOST tokens is 3 MiB
ONE_HIT_MB = 4.0  # room for one such hit per step, not two


def harness(**overrides) -> Harness:
    settings = {"save_unfull_chunk": True, "lookup": "index", "sync_load_mb": ONE_HIT_MB}
    return Harness.create(token_bytes=TOKEN_BYTES, **(settings | overrides))


@pytest.fixture
def h():
    harness_ = harness()
    yield harness_
    harness_.close()


def test_a_hit_in_host_memory_loads_with_the_step_that_schedules_it(h) -> None:
    h.store(request(DOC))
    req = request(DOC)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (MOST, False)  # synchronous
    h.sched.update_state_after_alloc(req, blocks(len(DOC)), MOST)
    # Scheduled at once: its load goes with this step's metadata, before the forward pass.
    meta = h.prefill(req, computed=MOST, allocated=True)
    (load,) = meta.loads
    assert (load.start, load.end, load.hold_id, load.load_async) == (0, MOST, None, False)
    assert h.sched.stats["sync_loads"] == 1


def test_the_steps_synchronous_loads_stay_within_sync_load_mb(h) -> None:
    h.store(request(DOC))
    h.store(request(OTHER_DOC))
    first, second = request(DOC), request(OTHER_DOC)
    assert h.sched.get_num_new_matched_tokens(first, 0) == (MOST, False)
    # 3 MiB more would pass 4 MiB in this step: the loader thread takes it.
    assert h.sched.get_num_new_matched_tokens(second, 0) == (MOST, True)
    h.step()
    # The next step has the whole budget again.
    assert h.sched.get_num_new_matched_tokens(request(OTHER_DOC), 0) == (MOST, False)


def test_a_hit_whose_save_is_still_copying_waits_for_it_then_loads_synchronously(h) -> None:
    meta = h.prefill(request(DOC))
    h.deliver(meta)
    rank = h.ranks[0]
    for spec in meta.saves:  # committed to host memory, the saver not done with the step
        rank.engine.store(spec.tokens, list(range(len(spec.tokens))), scope=spec.scope)
    h.report()
    req = request(DOC)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # nothing reported yet
    rank.feed.saves_copied(meta.step)
    h.report()
    assert h.sched.get_num_new_matched_tokens(req, 0) == (MOST, False)
    assert h.sched.stats["sync_loads_deferred"] == 2


def test_waiting_for_a_save_is_bounded_by_lookup_timeout_s() -> None:
    h = harness(lookup_timeout_s=0.05)
    try:
        meta = h.prefill(request(DOC))
        h.deliver(meta)
        h.report()  # the save never reports copied
        req = request(DOC)
        assert h.sched.get_num_new_matched_tokens(req, 0) == (None, False)
        time.sleep(0.06)
        # The loader thread takes it, and waits for the save there.
        assert h.sched.get_num_new_matched_tokens(req, 0) == (MOST, True)
    finally:
        h.close()


def test_a_hit_in_a_lower_tier_loads_on_the_loader_thread(tmp_path) -> None:
    h = harness(tiers=["local_cpu", "local_disk"], local_disk_path=str(tmp_path / "disk"))
    try:
        h.store(request(DOC))
        engine = h.ranks[0].engine
        assert engine.storage.flush(10.0)
        engine.storage.drop_host()
        h.report()
        assert h.sched.get_num_new_matched_tokens(request(DOC), 0) == (MOST, True)
    finally:
        h.close()


def test_a_probed_hit_is_held_in_host_memory_and_loads_synchronously() -> None:
    """A probe's hold has read every hit into host memory (lower tiers too)."""
    h = harness(lookup="probe")
    try:
        h.store(request(DOC))
        req = request(DOC)
        assert h.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # probed
        h.step()
        assert h.sched.get_num_new_matched_tokens(req, 0) == (MOST, False)
        h.sched.update_state_after_alloc(req, blocks(len(DOC)), MOST)
        (load,) = h.prefill(req, computed=MOST, allocated=True).loads
        assert load.hold_id is not None and not load.load_async
    finally:
        h.close()


@pytest.mark.parametrize(
    ("overrides", "token_bytes"),
    [({"sync_load_mb": 0.0}, TOKEN_BYTES), ({}, 0), ({"load_async": False}, TOKEN_BYTES)],
    ids=["sync_load_mb-0", "token-bytes-unknown", "load_async-false"],
)
def test_without_a_budget_hits_load_as_load_async_says(overrides, token_bytes) -> None:
    settings = {"save_unfull_chunk": True, "sync_load_mb": ONE_HIT_MB, "lookup": "probe"}
    h = Harness.create(token_bytes=token_bytes, **(settings | overrides))
    try:
        h.store(request(DOC))
        req = request(DOC)
        assert h.hit(req) == MOST
        assert h.sched.get_num_new_matched_tokens(req, 0)[1] is (overrides != {"load_async": False})
        assert h.sched.stats["sync_loads"] == 0
    finally:
        h.close()


# What the index says of a chunk as saves are asked for and reported (``PresenceIndex.where``).
NAMESPACE = ("m", "layout", 1, 0)


def _report(added: list[str], copied: int) -> RankReport:
    return RankReport(0, NAMESPACE, True, 4096, added=added, saves_copied=copied)


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["expect", "commit", "copied"]), st.integers(0, 2)),
        max_size=12,
    )
)
def test_a_chunk_is_in_host_memory_only_once_its_save_is_reported_copied(events) -> None:
    """A chunk a save was asked for in step ``s`` is never ``HOST`` before the rank reports
    step ``s`` copied; committed and copied, it is."""
    keys = KeyFactory(*NAMESPACE)
    index = PresenceIndex(1)
    index.apply(_report([], -1))
    chunks = [bytes([i]) * 16 for i in range(3)]
    step, copied = 0, -1
    asked: dict[int, int] = {}  # chunk -> step of its last save asked, not yet copied
    committed: set[int] = set()
    for op, i in events:
        h = chunks[i]
        if op == "expect":
            step += 1
            asked[i] = step
            index.expect([h], None, step)
        elif op == "commit":
            committed.add(i)
            index.apply(_report([keys.digest(h, None)], copied))
        else:
            copied = step
            index.apply(_report([], copied))
            asked = {c: s for c, s in asked.items() if s > copied}
        where = index.where([h], None)
        if i in asked:
            assert where == SAVING
        elif i in committed:
            assert where == HOST
        else:
            assert where in (HOST, OTHER)


def test_a_step_with_nothing_scheduled_is_marked_idle(h) -> None:
    """The workers wait for kvtier's threads in such a step (``WorkerSide._yield_idle``)."""
    assert h.step().idle
    assert not h.prefill(request(DOC)).idle
