"""``lookup: index``: a hit the scheduler's index knows is answered in the same call, with no
probe and no hold, driven step by step against real worker parts (``sched_harness.py``). What
happens when such a load comes up short inside real vLLM is in ``test_e2e_index_lookup.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from sched_harness import BLOCK, CHUNK, Harness, blocks, request
from vllm.v1.outputs import KVConnectorOutput

from kvtier.core import load_config
from kvtier.core.errors import ConfigError
from kvtier.vllm_integration.messages import KVTierWorkerMeta, RankReport
from kvtier.vllm_integration.scheduler.side import SchedulerSide

DOC = list(range(1000, 1000 + 3 * CHUNK + BLOCK))  # 3 chunks and a tail block
MOST = len(DOC) - BLOCK  # the last block holds the last prompt token: always recomputed


@pytest.fixture
def h():
    harness = Harness.create(save_unfull_chunk=True, lookup="index")
    yield harness
    harness.close()


def test_a_stored_prompt_is_answered_at_once_and_loaded_without_a_hold(h) -> None:
    h.store(request(DOC))
    req = request(DOC)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (MOST, True)
    h.sched.update_state_after_alloc(req, blocks(len(DOC)), MOST)
    meta = h.step()
    assert meta.probes == []
    (load,) = meta.loads
    assert (load.start, load.end, load.hold_id, load.load_async) == (0, MOST, None, True)
    assert h.ranks[0].holds.stats()["holds"] == 0
    stats = h.sched.stats
    assert (stats["indexed_hits"], stats["probes"]) == (1, 0)
    # Finishing releases nothing on the workers: nothing was held.
    h.sched.request_finished(req)
    assert h.step().releases == []


def test_the_tier_of_an_index_answer_is_where_the_index_last_saw_each_chunk(tmp_path) -> None:
    """vLLM's hit-source metrics: host memory until a chunk leaves it, then the disk tier."""
    harness = Harness.create(
        save_unfull_chunk=True,
        lookup="index",
        tiers=["local_cpu", "local_disk"],
        local_disk_path=str(tmp_path / "disk"),
    )
    try:
        harness.store(request(DOC))
        req = request(DOC)
        assert harness.sched.get_num_new_matched_tokens(req, 0) == (MOST, True)
        assert harness.sched.lookups.sources(req, MOST, BLOCK) == {"local_cpu": MOST}
        engine = harness.ranks[0].engine
        assert engine.storage.flush(10.0)
        engine.storage.drop_host()
        harness.report()
        req = request(DOC)
        assert harness.sched.get_num_new_matched_tokens(req, 0) == (MOST, True)
        assert harness.sched.lookups.sources(req, MOST, BLOCK) == {"local_disk": MOST}
    finally:
        harness.close()


def test_a_load_that_came_up_short_makes_the_index_forget_the_rest(h) -> None:
    h.store(request(DOC))
    req = request(DOC)
    assert h.sched.get_num_new_matched_tokens(req, 0)[0] == MOST
    h.sched.update_state_after_alloc(req, blocks(len(DOC)), MOST)
    h.step()
    # The worker found only the first chunk (the others were evicted after the answer).
    h.ranks[0].feed.shortfall(req.request_id, CHUNK)
    h.report()
    assert h.sched.get_num_new_matched_tokens(request(DOC), 0) == (CHUNK, True)


def test_a_prompt_partly_held_by_vllm_loads_only_the_rest(h) -> None:
    h.store(request(DOC))
    req = request(DOC)
    assert h.sched.get_num_new_matched_tokens(req, CHUNK) == (MOST - CHUNK, True)
    assert h.sched.get_num_new_matched_tokens(request(DOC), MOST) == (0, False)


def test_a_tier_the_index_cannot_list_keeps_the_probe(h) -> None:
    """Redis (or any tier that cannot list its chunks) may hold what other engines wrote: only
    a probe can see it, so no answer comes from the index."""
    h.store(request(DOC))
    keys = h.ranks[0].engine.keys
    namespace = (keys.model, keys.layout_fp, keys.world_size, keys.rank)
    unlisted = RankReport(0, namespace, complete=False, capacity=4096)
    h.sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMeta({0: unlisted}))
    )
    assert h.sched.get_num_new_matched_tokens(request(DOC), 0) == (None, False)  # probed
    assert h.hit(request(DOC)) == MOST


@pytest.mark.parametrize(
    ("lookup", "policy", "overrides", "mode"),
    [
        ("auto", "recompute", {}, "index"),
        ("auto", "fail", {}, "probe"),  # a chunk gone by the load would fail the request
        ("auto", "recompute", {"load_async": False}, "probe"),
        ("auto", "recompute", {"use_layerwise": True}, "probe"),
        ("probe", "recompute", {}, "probe"),
        ("index", "recompute", {}, "index"),
    ],
)
def test_auto_answers_from_the_index_only_where_a_short_load_is_recomputed(
    lookup, policy, overrides, mode
) -> None:
    config = load_config(env={}, overrides={"lookup": lookup, **overrides})
    side = SchedulerSide(config, block_size=BLOCK, num_workers=1, load_failure_policy=policy)
    assert side.lookups.mode == mode


def test_index_lookups_without_what_they_need_are_config_errors() -> None:
    config = load_config(env={}, overrides={"lookup": "index"})
    with pytest.raises(ConfigError, match=r"lookup.*kv_load_failure_policy"):
        SchedulerSide(config, block_size=BLOCK, num_workers=1, load_failure_policy="fail")
    for bad in ({"load_async": False}, {"use_layerwise": True}):
        with pytest.raises(ConfigError, match=r"lookup.*asynchronous loads"):
            load_config(env={}, overrides={"lookup": "index", **bad})
    with pytest.raises(ConfigError, match=r"lookup.*one of auto, probe, index"):
        load_config(env={}, overrides={"lookup": "sometimes"})


@pytest.mark.parametrize("how", ["blocks", "request"])
def test_a_request_whose_load_failed_is_not_offered_the_hit_again(h, how) -> None:
    """vLLM reports a failed load (``invalid_block_ids`` or ``failed_recving``) and recomputes
    the request; asked again, kvtier must not offer the same hit (a chunk that cannot be
    loaded would otherwise be retried step after step, forever)."""
    h.store(request(DOC))
    req = request(DOC)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (MOST, True)
    h.sched.update_state_after_alloc(req, blocks(len(DOC)), MOST)
    h.step()
    failed = (
        KVConnectorOutput(invalid_block_ids={1})
        if how == "blocks"
        else KVConnectorOutput(failed_recving={req.request_id})
    )
    h.sched.update_connector_output(failed)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # another request for the same prompt still hits
    assert h.sched.get_num_new_matched_tokens(request(DOC), 0) == (MOST, True)
