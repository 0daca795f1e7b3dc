"""A request's life on the scheduler side (``scheduler/request.py``, ``scheduler/request_state.py``):
every change of phase the code lists is one the connector makes, stepped through the harness
with real worker parts; nothing else writes a request's state; docs/architecture.md lists the
same transitions; and a step's block ids are read as vLLM sends them."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sched_harness import BLOCK, CHUNK, Harness, empty_output, request
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.outputs import KVConnectorOutput

from kvtier.vllm_integration.scheduler import request_state as state_module
from kvtier.vllm_integration.scheduler.request_state import TRANSITIONS, Phase, TrackedRequest
from kvtier.vllm_integration.scheduler.steps import BlockUpdate, block_updates

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(100, 100 + 3 * CHUNK + 5))
HIT = 3 * CHUNK
OTHER = list(range(9000, 9000 + 2 * CHUNK + 3))  # never stored


def blocks(n: int = 8) -> Any:
    """vLLM's ``KVCacheBlocks`` as ``update_state_after_alloc`` reads it."""
    return SimpleNamespace(get_block_ids=lambda: (list(range(n)),))


def preempt(h: Harness, *reqs: Any) -> None:
    out = empty_output()
    out.preempted_req_ids = {r.request_id for r in reqs}
    h.deliver(h.sched.build_connector_meta(out))


def run_partly(h: Harness, req: Any, tokens: int) -> None:
    """One step that computes the first ``tokens`` of ``req``'s prompt."""
    h.sched.update_state_after_alloc(req, blocks(), 0)
    out = empty_output()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (list(range(8)),))]
    out.num_scheduled_tokens = {req.request_id: tokens}
    h.deliver(h.sched.build_connector_meta(out))


def ask(h: Harness, req: Any) -> int | None:
    return h.sched.get_num_new_matched_tokens(req, 0)[0]


def finish(h: Harness, req: Any) -> None:
    h.sched.request_finished(req, [])


def probe_mode_paths(h: Harness) -> None:
    stored = request(PROMPT)
    h.store(stored)  # new -> running (allocated, never asked)
    finish(h, stored)  # running -> finished
    r = request(PROMPT)
    assert ask(h, r) is None  # new -> looking up
    h.step()
    assert ask(h, r) == HIT  # looking up -> answered
    h.sched.update_state_after_alloc(r, blocks(), HIT)  # answered -> loading (async)
    h.step()
    h.sched.update_state_after_alloc(r, blocks(), 0)  # loading -> running (after its load)
    preempt(h, r)  # running -> preempted
    assert ask(h, r) is None  # preempted -> looking up
    finish(h, r)  # looking up -> finished

    miss = request(OTHER)
    assert ask(h, miss) == 0  # new -> answered
    later = request(OTHER)
    h.store(later)
    assert ask(h, miss) is None  # answered -> looking up (stored since: probed)
    h.step()
    assert ask(h, miss) == 2 * CHUNK
    h.sched.update_state_after_alloc(miss, blocks(), 0)  # answered -> running
    preempt(h, miss)
    gone = request(list(range(5000, 5000 + 2 * CHUNK)))
    h.store(gone)
    preempt(h, gone)
    finish(h, gone)  # preempted -> finished
    short = request(list(range(7000, 7000 + CHUNK)))
    h.sched.update_state_after_alloc(short, blocks(), 0)  # allocated; never scheduled
    preempt(h, short)
    assert ask(h, short) == 0  # preempted -> answered (a miss)
    finish(h, short)  # answered -> finished
    finish(h, miss)

    failed = request(PROMPT)
    assert ask(h, failed) is None
    h.step()
    assert ask(h, failed) == HIT
    h.sched.update_state_after_alloc(failed, blocks(), HIT)
    h.sched.update_connector_output(KVConnectorOutput(failed_recving={failed.request_id}))
    assert ask(h, failed) == 0  # loading -> answered (its load failed)
    finish(h, failed)
    aborted = request(PROMPT)
    ask(h, aborted)
    h.step()
    ask(h, aborted)
    h.sched.update_state_after_alloc(aborted, blocks(), HIT)
    finish(h, aborted)  # loading -> finished
    idle = request(PROMPT)
    h.sched.requests.track(idle)
    finish(h, idle)  # new -> finished
    unused = request(PROMPT)
    assert ask(h, unused) is None
    h.sched.update_state_after_alloc(unused, blocks(), 0)  # looking up -> running (vLLM read
    finish(h, unused)  # no cache for it: prompt logprobs)

    # A producer (loads off) is never asked: preempted -> running
    h.sched.requests.loads_enabled = False
    producer = request(list(range(3000, 3000 + 2 * CHUNK)))
    h.store(producer)
    preempt(h, producer)
    h.sched.update_state_after_alloc(producer, blocks(), 0)
    finish(h, producer)


def verify_paths(h: Harness) -> None:
    h.store(request(PROMPT))
    r = request(PROMPT)
    assert ask(h, r) is None
    h.step()
    assert ask(h, r) == 0  # looking up -> sampled
    run_partly(h, r, BLOCK)  # sampled -> running; its check waits for the whole hit
    preempt(h, r)
    assert ask(h, r) == 0  # preempted -> sampled (its check is still due)
    finish(h, r)  # sampled -> finished
    p = request(PROMPT)
    run_partly(h, p, BLOCK)
    preempt(h, p)
    assert ask(h, p) is None
    h.step()
    assert ask(h, p) == 0  # preempted -> sampled (its lookup sampled)


def index_verify_paths(h: Harness) -> None:
    first = request(PROMPT)
    assert ask(h, first) == 0  # new -> answered: nothing stored yet
    h.store(request(PROMPT))
    assert ask(h, first) == 0  # answered -> sampled (the index answers)
    r = request(PROMPT)
    assert ask(h, r) == 0  # new -> sampled at once
    finish(h, r)


SCENARIOS = [
    ({}, probe_mode_paths),
    ({"verify_fraction": 1.0}, verify_paths),
    ({"verify_fraction": 1.0, "lookup": "index"}, index_verify_paths),
]


def test_every_listed_transition_is_made_and_only_state_py_writes_a_request(monkeypatch) -> None:
    writers: Counter[str] = Counter()
    plain = object.__setattr__

    def recording(self: TrackedRequest, name: str, value: Any) -> None:
        writers[sys._getframe(1).f_globals["__name__"]] += 1
        plain(self, name, value)

    monkeypatch.setattr(TrackedRequest, "__setattr__", recording)
    seen: Counter[tuple[Phase, Phase]] = Counter()
    for overrides, scenario in SCENARIOS:
        h = Harness.create(**overrides)
        try:
            scenario(h)
            seen.update(h.sched.requests.transitions)
        finally:
            h.close()
    assert set(writers) == {state_module.__name__}
    missing = sorted(f"{a.value} -> {b.value}" for a, b in set(TRANSITIONS) - set(seen))
    assert not missing, f"listed, never made: {missing}"
    assert set(seen) <= set(TRANSITIONS)


def test_a_change_not_listed_is_refused() -> None:
    from kvtier.vllm_integration.scheduler.request_state import LifecycleError

    h = Harness.create()
    try:
        r = request(PROMPT)
        h.sched.requests.track(r)
        with pytest.raises(LifecycleError, match="from new to preempted"):
            preempt(h, r)
    finally:
        h.close()


def test_the_docs_list_the_transitions_the_code_has() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| ([a-z ,]+) \| ([a-z ]+) \| ([^|]+?) \|$", text, re.M)
    listed: dict[tuple[str, str], str] = {}
    for sources, to, event in rows:
        for source in sources.split(", "):
            listed[(source, to)] = event
    want = {(a.value, b.value): event for (a, b), event in TRANSITIONS.items()}
    assert listed == want


def test_block_updates_read_new_added_and_resumed_requests() -> None:
    out = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="a", block_ids=([1, 2],), num_computed_tokens=32)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["b", "c", "d"],
            new_block_ids=[([6],), None, ([7, 8],)],
            resumed_req_ids={"d"},
            num_computed_tokens=[48, 16, 0],
        ),
        num_scheduled_tokens={"a": 8, "b": 1},
    )
    assert block_updates(out, 0) == [  # type: ignore[arg-type]
        BlockUpdate("a", [1, 2], True, False, 32, 8),
        BlockUpdate("b", [6], False, False, 48, 1),
        BlockUpdate("c", [], False, False, 16, 0),
        BlockUpdate("d", [7, 8], False, True, 0, 0),
    ]


def test_a_preempted_request_saves_again_and_a_check_starts_after_vllms_hit() -> None:
    h = Harness.create(verify_fraction=1.0)
    try:
        h.store(request(PROMPT))
        r = request(PROMPT)
        ask(h, r)
        h.step()
        assert ask(h, r) == 0  # sampled
        h.sched.update_state_after_alloc(r, blocks(), 0)
        out = empty_output()
        r.num_computed_tokens = CHUNK  # vLLM's prefix cache had one chunk
        out.scheduled_new_reqs = [NewRequestData.from_request(r, (list(range(8)),))]
        out.num_scheduled_tokens = {r.request_id: len(PROMPT) - CHUNK}
        meta = h.sched.build_connector_meta(out)
        (check,) = meta.verifies
        assert check.start == CHUNK, "what vLLM's prefix cache gave is not recomputed"
        assert [len(s.tokens) for s in meta.saves] == [len(PROMPT)]
        tracked = h.sched.requests.get(r.request_id)
        assert tracked is not None and tracked.saved_upto == len(PROMPT)
        preempt(h, r)
        assert (tracked.block_ids, tracked.saved_upto, tracked.prompt_saved) == ([], 0, False)
        # Resumed: its block ids come whole again; its prompt is saved again
        h.sched.update_state_after_alloc(r, blocks(), 0)
        out = empty_output()
        out.scheduled_cached_reqs.req_ids = [r.request_id]
        out.scheduled_cached_reqs.resumed_req_ids = {r.request_id}
        out.scheduled_cached_reqs.new_block_ids = [([11, 12, 13, 14],)]
        out.scheduled_cached_reqs.num_computed_tokens = [0]
        out.num_scheduled_tokens = {r.request_id: len(PROMPT)}
        meta = h.sched.build_connector_meta(out)
        assert tracked.block_ids == [11, 12, 13, 14]
        assert [len(s.tokens) for s in meta.saves] == [len(PROMPT)]
    finally:
        h.close()


def test_a_request_preempted_outside_schedule_and_admitted_again_is_looked_up_again() -> None:
    """vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts running requests
    outside ``schedule()``; the next ``schedule()`` admits them again (lookup, allocation) before
    its output reports the preemption. The lookup finds a running request: its KV is gone."""
    h = Harness.create()
    try:
        h.store(request(PROMPT))
        r = request(PROMPT)
        h.prefill(r)  # running, its prompt handed to a save
        tracked = h.sched.requests.get(r.request_id)
        assert tracked is not None and tracked.phase is Phase.RUNNING and tracked.prompt_saved
        assert ask(h, r) is None  # looked up again: a probe, no LifecycleError
        assert tracked.phase is Phase.LOOKING_UP and not tracked.prompt_saved
        h.step()
        assert ask(h, r) == HIT
        h.sched.update_state_after_alloc(r, blocks(), HIT)
        preempt(h, r)  # the step that reports the preemption: already handled
        assert tracked.phase is Phase.LOADING
        finish(h, r)
    finally:
        h.close()


def test_a_request_that_reads_no_cache_is_never_probed() -> None:
    from vllm import SamplingParams

    h = Harness.create()
    try:
        h.store(request(PROMPT))
        r = request(PROMPT)
        r.sampling_params = SamplingParams(max_tokens=4, prompt_logprobs=1)
        r.skip_reading_prefix_cache = True  # vLLM sets it from prompt_logprobs
        assert ask(h, r) == 0
        assert h.sched.lookups.sent == 0
    finally:
        h.close()
