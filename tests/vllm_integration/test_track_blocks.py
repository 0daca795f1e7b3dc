"""A step's block-id bookkeeping (``scheduler/steps.py``): vLLM sends a request's block ids
whole when it is first scheduled and when it resumes after a preemption, and only the added
ones in between; a preempted request's saved progress is forgotten; a request sampled for
verification starts checking after what vLLM's prefix cache gave it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.vllm_integration.groups import CacheGroups
from kvtier.vllm_integration.scheduler.hybrid import HybridBlocks
from kvtier.vllm_integration.scheduler.steps import track_blocks

pytestmark = [pytest.mark.vllm]


def state(**kw: Any) -> Any:
    base = {"block_ids": [], "prompt_saved": False, "saved_upto": 0, "verify": None}
    return SimpleNamespace(**{**base, **kw})


def output(
    *, new=(), cached=(), resumed=(), preempted=(), scheduled: dict[str, int] | None = None
) -> Any:
    """``new``: (id, block ids, computed); ``cached``: (id, added block ids or None, computed)."""
    return SimpleNamespace(
        preempted_req_ids=set(preempted),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c) for r, ids, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[None if ids is None else (ids,) for _, ids, _ in cached],
            resumed_req_ids=set(resumed),
            num_computed_tokens=[c for _, _, c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
    )


def test_new_added_resumed_and_preempted_requests() -> None:
    hybrid = HybridBlocks(CacheGroups(), 16)
    reqs = {"a": state(), "b": state(block_ids=[4, 5]), "c": state(block_ids=[9])}
    out = track_blocks(
        output(new=[("a", [1, 2], 32)], cached=[("b", [6], 48), ("c", None, 16)],
               scheduled={"a": 8, "b": 1}),
        reqs, 0, hybrid,
    )  # fmt: skip
    assert out == [("a", 32, 8), ("b", 48, 1), ("c", 16, 0)]
    assert (reqs["a"].block_ids, reqs["b"].block_ids, reqs["c"].block_ids) == (
        [1, 2],
        [4, 5, 6],
        [9],
    )

    reqs["b"].prompt_saved, reqs["b"].saved_upto = True, 32
    track_blocks(output(preempted=["b"]), reqs, 0, hybrid)
    assert (reqs["b"].block_ids, reqs["b"].prompt_saved, reqs["b"].saved_upto) == ([], False, 0)

    # Resumed: its block ids come whole again (not appended to what it had).
    reqs["c"].block_ids = [9, 10]
    track_blocks(output(cached=[("b", [7, 8], 0), ("c", [11], 32)], resumed=["b", "c"]),
                 reqs, 0, hybrid)  # fmt: skip
    assert (reqs["b"].block_ids, reqs["c"].block_ids) == ([7, 8], [11])


def test_unknown_requests_are_left_out_and_a_check_starts_after_vllms_hit() -> None:
    hybrid = HybridBlocks(CacheGroups(), 16)
    check = SimpleNamespace(start=16)
    reqs = {"v": state(verify=check)}
    out = track_blocks(
        output(new=[("v", [1, 2, 3], 48), ("x", [4], 0)], cached=[("y", [5], 16)]), reqs, 0, hybrid
    )
    assert out == [("v", 48, 0)] and check.start == 48
