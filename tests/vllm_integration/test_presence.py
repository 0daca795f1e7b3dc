"""The scheduler never waits: its index of stored chunks (``presence.py``) and its probes
(``probes.py``), driven step by step against real worker parts (``sched_harness.py``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from sched_harness import BLOCK, CHUNK, Harness, request

from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, KVLayout, load_config
from kvtier.core.keys import KeyFactory, KeyScope, prefix_hashes
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.vllm_integration.messages import KVTierWorkerMeta, RankReport
from kvtier.vllm_integration.scheduler.index import PresenceIndex
from kvtier.vllm_integration.scheduler.prompts import IndexedPrompt

DOC = list(range(1000, 1000 + 3 * CHUNK + BLOCK))  # 3 chunks and a tail block
LAYOUT = KVLayout(
    num_layers=1,
    num_kv_heads=1,
    head_size=4,
    dtype="float32",
    block_size=BLOCK,
    paged_layout="LBHNC",
)


@pytest.fixture
def h():
    harness = Harness.create(save_unfull_chunk=True)
    yield harness
    harness.close()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 6 * CHUNK), order=st.lists(st.integers(-8, 8), max_size=10))
def test_chunk_hashes_computed_on_demand_are_those_of_the_whole_prompt(n, order) -> None:
    """The scheduler hashes a prompt's chunks only as far as they are asked for, in any order:
    every hash is the one hashing the whole prompt at once gives."""
    tokens = np.arange(5, 5 + n, dtype=np.int64)
    scope = KeyScope("s", None, None)
    want = prefix_hashes(tokens, CHUNK, scope)
    lazy = IndexedPrompt(tokens, scope, CHUNK, BLOCK, tails=False).full
    assert len(lazy) == len(want)
    for i in order:
        if -len(want) <= i < len(want):
            assert lazy[i] == want[i]
        else:
            with pytest.raises(IndexError):
                lazy[i]
    assert lazy[1:3] == want[1:3] and list(lazy) == want


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5 * CHUNK), salt=st.sampled_from([None, "a"]), index=st.integers(0, 5))
def test_prompt_hashes_are_the_engines_keys(n, salt, index) -> None:
    """The scheduler hashes a prompt exactly as the engine keys what it stores: full chunks,
    then the block-sized tail after any full chunk."""
    config = load_config(env={}, overrides={"chunk_size": CHUNK, "save_unfull_chunk": True})
    arena = HostArena.create(1 << 16)
    engine = CacheEngine(
        config, LAYOUT, model="m", platform=CPUPlatform(), storage=HostMemoryStorageManager(arena)
    )
    tokens = list(range(7, 7 + n))
    scope = KeyScope(salt, None, None)
    hashes = IndexedPrompt(torch.tensor(tokens).numpy(), scope, CHUNK, BLOCK, tails=True)
    full = engine.full_spans(tokens, scope)
    assert [bytes.fromhex(s.key.chunk_hash) for s in full] == list(hashes.full)
    index = min(index, len(full))
    tail = engine.tail_spans(tokens, index, scope)
    assert [bytes.fromhex(s.key.chunk_hash) for s in tail] == hashes.tail(index)
    engine.close()


def test_a_prompt_the_index_rules_out_is_answered_at_once(h) -> None:
    """Nothing stored: the answer is 0 in the same call, and no probe goes to the workers."""
    n, load_async = h.sched.get_num_new_matched_tokens(request(DOC), 0)
    assert (n, load_async) == (0, False)
    assert h.step().probes == []


def test_a_stored_prompt_is_probed_then_answered_from_the_hold(h) -> None:
    h.store(request(DOC))
    req = request(DOC)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # not yet
    meta = h.step()
    assert [p.req_id for p in meta.probes] == [req.request_id]
    assert h.ranks[0].holds.stats()["holds"] == 1
    # The chunks are gone from host memory before the load: the probe's hold still has them.
    h.ranks[0].engine.storage.drop_host()
    n, load_async = h.sched.get_num_new_matched_tokens(req, 0)
    assert n == len(DOC) - BLOCK and load_async  # the last block holds the last prompt token
    assert h.sched.get_num_new_matched_tokens(req, BLOCK)[0] == n - BLOCK  # vLLM has a block


def test_a_hit_vllm_already_has_is_not_probed(h) -> None:
    h.store(request(DOC))
    assert h.sched.get_num_new_matched_tokens(request(DOC), len(DOC) - BLOCK) == (0, False)
    assert h.step().probes == []


def test_a_probe_never_answered_is_a_miss_after_lookup_timeout_s() -> None:
    harness = Harness.create(lookup_timeout_s=0.2)
    try:
        harness.store(request(DOC))
        req = request(DOC)
        assert harness.sched.get_num_new_matched_tokens(req, 0)[0] is None
        meta = harness.step(answer=False)  # the workers never answer (a dead or stuck worker)
        assert harness.sched.get_num_new_matched_tokens(req, 0)[0] is None
        time.sleep(0.25)
        assert harness.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert harness.sched.stats["lookup_failures"] == 1
        harness.sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        probe = meta.probes[0]
        assert (req.request_id, probe.hold_id) in harness.step().releases
    finally:
        harness.close()


def test_a_chunk_counts_only_when_every_rank_stores_its_shard() -> None:
    harness = Harness.create(world_size=2)
    try:

        def store_on(rank: int) -> None:  # a save of this prompt that only this rank made
            harness.ranks[rank].engine.store(DOC, torch.arange(len(DOC)))
            harness.report()

        store_on(0)
        assert harness.sched.get_num_new_matched_tokens(request(DOC), 0) == (0, False)
        store_on(1)
        assert harness.hit(request(DOC)) == 3 * CHUNK  # no tail blocks without save_unfull_chunk
    finally:
        harness.close()


def test_the_ranks_hits_are_combined_by_their_minimum() -> None:
    harness = Harness.create(world_size=2)
    try:
        harness.store(request(DOC))
        # Rank 1 loses its chunks after it reported them: the index still says stored.
        harness.ranks[1].engine.storage.drop_host()
        req = request(DOC)
        assert harness.hit(req) == 0
        # The probe told the scheduler: the next prompt is not probed again.
        assert harness.sched.get_num_new_matched_tokens(request(DOC), 0) == (0, False)
    finally:
        harness.close()


def test_a_request_arriving_while_its_prefix_is_being_saved_is_probed(h) -> None:
    """The scheduler counts the chunks it asked to save before the workers report them."""
    first = request(DOC)
    h.prefill(first)  # the save is asked for; the worker has not stored or reported it yet
    assert h.sched.get_num_new_matched_tokens(request(DOC), 0) == (None, False)


def test_a_stale_index_entry_is_forgotten_after_one_probe(h) -> None:
    h.store(request(DOC))
    h.ranks[0].engine.storage.drop_host()
    assert h.hit(request(DOC)) == 0
    assert h.sched.get_num_new_matched_tokens(request(DOC), 0) == (0, False)
    assert h.step().probes == []


def test_scheduler_seconds_are_observed_once_per_step(h) -> None:
    for _ in range(3):
        with h.sched.timer.timed():
            h.sched.get_num_new_matched_tokens(request(DOC), 0)
        h.sched.timer.end_step()
    data = h.sched.get_kv_connector_stats().data["samples"]
    wall, cpu = data["scheduler_seconds"][""], data["scheduler_cpu_seconds"][""]
    assert len(wall) == len(cpu) == 3 and all(0 <= s < 1 for s in wall)
    # CPU time is the thread's own: never more than the wall time (clock granularity aside).
    assert all(0 <= c <= w + 1e-3 for c, w in zip(cpu, wall, strict=True))


def test_scheduler_cpu_seconds_leave_out_time_spent_waiting(h) -> None:
    with h.sched.timer.timed():
        time.sleep(0.05)  # waiting, as for the GIL or a core: wall time, no CPU time
    h.sched.timer.end_step()
    data = h.sched.get_kv_connector_stats().data["samples"]
    (wall,), (cpu,) = data["scheduler_seconds"][""], data["scheduler_cpu_seconds"][""]
    assert wall >= 0.05 and cpu < 0.02


def test_worker_reports_merge_by_rank_and_an_unlistable_tier_makes_the_index_incomplete() -> None:
    ns = ("m", "fp", 2, 0)
    a = KVTierWorkerMeta({0: RankReport(0, ns, True, 10, ["x"])})
    b = KVTierWorkerMeta({1: RankReport(1, ("m", "fp", 2, 1), False, 10, ["y"])})
    merged = a.aggregate(b)
    assert isinstance(merged, KVTierWorkerMeta) and sorted(merged.reports) == [0, 1]
    index = PresenceIndex(2)
    index.apply(merged.reports[0])
    assert not index.ready and not index.complete
    index.apply(merged.reports[1])
    assert index.ready and not index.complete  # rank 1 has a tier it cannot list (Redis)
    assert len(index) == 2


def test_index_keeps_at_most_its_capacity_oldest_out() -> None:
    keys = KeyFactory("m", "fp", 1, 0)
    hashes = [bytes([i]) * 16 for i in range(4)]
    index = PresenceIndex(1)
    index.apply(
        RankReport(0, ("m", "fp", 1, 0), True, 3, [keys.key(x, None).digest() for x in hashes])
    )
    assert len(index) == 3
    assert index.leading(hashes, None) == 0  # the oldest went
    assert index.leading(hashes[1:], None) == 3


def test_kv_events_carry_vllms_block_hashes_for_stored_and_dropped_chunks() -> None:
    """With vLLM's KV events on, every chunk that lands in host memory is a ``BlockStored``
    (medium CPU) whose block hashes are the ones vLLM gives the same blocks, and a chunk the
    host tier drops is a ``BlockRemoved`` with the same hashes."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    # The first request's save is asked for before the worker has ever reported (vLLM's first
    # step): its events still come once the chunks land.
    harness = Harness.create(kv_events=True, report_first=False)
    try:
        req = request(DOC, block_hasher=hasher)
        harness.store(req)
        stored = harness.sched.events.take()
        assert all(isinstance(e, BlockStored) and e.medium == "CPU" for e in stored)
        vllm_hashes = [maybe_convert_block_hash(x) for x in req.block_hashes]
        spans = [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, 3 * CHUNK), (3 * CHUNK, len(DOC))]
        assert [e.block_hashes for e in stored] == [
            vllm_hashes[s // BLOCK : e // BLOCK] for s, e in spans
        ]
        assert [e.parent_block_hash for e in stored] == [None] + [
            vllm_hashes[s // BLOCK - 1] for s, _ in spans[1:]
        ]
        assert [e.token_ids for e in stored] == [DOC[s:e] for s, e in spans]
        harness.ranks[0].engine.storage.drop_host()
        harness.report()
        removed = harness.sched.events.take()
        assert all(isinstance(e, BlockRemoved) for e in removed)
        assert sorted(e.block_hashes for e in removed) == sorted(e.block_hashes for e in stored)
        # Host memory was the only tier: the index forgot them too, no probe for this prompt.
        assert harness.sched.get_num_new_matched_tokens(request(DOC), 0) == (0, False)
    finally:
        harness.close()


def test_kv_events_for_the_disk_tier_follow_its_writes(tmp_path) -> None:
    """A chunk written to the disk tier is announced again with medium DISK (same hashes), once
    the disk tier holds it; a chunk the disk tier drops is a ``BlockRemoved`` there."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    harness = Harness.create(
        kv_events=True,
        tiers=["local_cpu", "local_disk"],
        local_disk_path=str(tmp_path),
        local_cpu_size_gb=0.01,
    )
    try:
        harness.store(request(DOC, block_hasher=get_request_block_hasher(BLOCK, hash_fn)))
        assert harness.ranks[0].engine.storage.flush(10)
        harness.report()
        events = harness.sched.events.take()
        by_medium = {m: [e.block_hashes for e in events if e.medium == m] for m in ("CPU", "DISK")}
        # the disk writer's threads finish chunks in any order: compare the sets
        assert len(by_medium["CPU"]) == 4 and sorted(by_medium["DISK"]) == sorted(by_medium["CPU"])
        keys = [s.key for s in harness.ranks[0].engine.store_spans(DOC)]
        harness.ranks[0].engine.storage.lower[0].remove(keys[:1])
        harness.report()
        (removed,) = harness.sched.events.take()
        assert (removed.medium, removed.block_hashes) == ("DISK", by_medium["CPU"][0])
    finally:
        harness.close()


def test_no_events_unless_vllm_publishes_them(h) -> None:
    h.store(request(DOC))
    assert h.sched.events.take() == []


def test_store_threshold_saves_a_chunk_only_on_its_nth_sighting() -> None:
    """``store_threshold=2``: a one-off prompt is not saved; the second request containing a
    chunk saves it; a prompt sharing only DOC's first chunk saves just that chunk."""
    harness = Harness.create(store_threshold=2)
    try:

        def saved(tokens) -> list[int]:
            req = request(tokens)
            harness.hit(req)  # vLLM asks first: the request is seen
            return [len(s.tokens) - s.skip for s in harness.prefill(req).saves]

        assert saved(DOC) == []
        assert saved(DOC) == [len(DOC)]  # every chunk and the tail block: seen twice now
        shared = DOC[:CHUNK] + list(range(5000, 5000 + CHUNK))
        assert saved(shared) == [CHUNK]  # its first chunk was in both DOCs; the rest is new
        assert saved(list(range(9000, 9000 + 2 * CHUNK))) == []
    finally:
        harness.close()
