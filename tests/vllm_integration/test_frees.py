"""When a finished request's blocks go back to vLLM (``frees.py``; the saver's side of it,
``Saver.copied_through``, is tested in ``test_save_thread.py``).

The hazard: vLLM hands a freed block to another request at once. If kvtier's copy of the old
request's KV is still reading that block, the chunk is stored with the new request's KV under
the old prompt's keys (wrong KV served later). So a request gives its blocks back when it
finishes only if every rank has reported every save of it copied; otherwise the blocks wait for
the workers' ``finished_sending``. The cost guarded against the other way: a request whose
saves were copied long before it finished held its blocks a step longer, and under memory
pressure the next request waited for them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from sched_harness import CHUNK, Harness, empty_output, request
from vllm.v1.outputs import KVConnectorOutput

from kvtier.vllm_integration.scheduler.frees import BlockFrees

TEXT = list(range(500, 500 + 3 * CHUNK))


@pytest.fixture
def two_ranks():
    harness = Harness.create(world_size=2)
    yield harness
    harness.close()


def test_a_request_every_rank_has_copied_gives_its_blocks_back_at_once(two_ranks) -> None:
    h = two_ranks
    req = request(TEXT)
    h.store(req)  # prefilled, saved and reported copied by both ranks
    assert h.sched.request_finished(req) is False
    assert not h.sched.has_pending_block_frees()
    # The workers are told, so they never report it in finished_sending (vLLM asserts on a
    # request it has freed already).
    assert h.sched.build_connector_meta(empty_output()).unheld == [req.request_id]
    assert h.sched.build_connector_meta(empty_output()).unheld == []
    assert h.sched.stats["finished_freed_at_once"] == 1


def test_a_rank_still_copying_keeps_the_blocks_until_it_reports(two_ranks) -> None:
    h = two_ranks
    req = request(TEXT)
    h.store(req, ranks=[0])  # rank 1 has not copied its shard yet
    assert h.sched.request_finished(req) is True
    assert h.sched.has_pending_block_frees()
    assert h.sched.build_connector_meta(empty_output()).unheld == []
    h.sched.update_connector_output(KVConnectorOutput(finished_sending={req.request_id}))
    assert not h.sched.has_pending_block_frees()


def test_a_save_after_the_last_copied_step_keeps_the_blocks(two_ranks) -> None:
    """Copied through an earlier step is not enough: the request's last save counts."""
    h = two_ranks
    h.store(request(list(range(9000, 9000 + CHUNK))))  # both ranks report copied through step 1
    req = request(TEXT)
    meta = h.prefill(req)  # step 2 saves it; no worker has copied that yet
    assert meta.saves and meta.step == 2
    assert h.sched.request_finished(req) is True
    assert h.sched.stats["finished_held"] == 1


def test_a_request_without_saves_never_holds_its_blocks(two_ranks) -> None:
    h = two_ranks
    req = request(TEXT[:10])  # shorter than a block: nothing to save
    assert h.prefill(req).saves == []
    assert h.sched.request_finished(req) is False
    assert h.sched.build_connector_meta(empty_output()).unheld == []


@settings(max_examples=200, deadline=None)
@given(
    ranks=st.integers(1, 4),
    events=st.lists(
        st.one_of(
            st.tuples(st.just("copied"), st.integers(0, 3), st.integers(-1, 20)),
            st.tuples(st.just("finished"), st.integers(0, 10**6), st.integers(-1, 20)),
        ),
        max_size=40,
    ),
)
def test_blocks_are_given_back_only_when_every_rank_copied_the_last_save(ranks, events) -> None:
    frees = BlockFrees(ranks)
    copied = [-1] * ranks
    freed: list[str] = []
    held: set[str] = set()
    for kind, a, step in events:
        if kind == "copied":
            if a < ranks:
                copied[a] = max(copied[a], step)
            frees.copied(a, step)  # a rank this engine does not have is ignored
            continue
        rid = f"r{a}-{len(freed) + len(held)}"
        keep = frees.finished(rid, step)
        assert keep == (step >= 0 and step > min(copied))
        if keep:
            held.add(rid)
        elif step >= 0:  # had saves, all copied: freed at once, and the workers are told
            freed.append(rid)
    assert frees.take_unheld() == freed and frees.take_unheld() == []
    assert frees.pending == bool(held)
    frees.sent(held)
    assert not frees.pending
