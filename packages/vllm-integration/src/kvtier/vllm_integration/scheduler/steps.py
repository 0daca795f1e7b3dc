"""A step's scheduled requests, their block ids brought up to date from the scheduler output.

vLLM sends a request's block ids once when it is scheduled first (``scheduled_new_reqs``) and
then only the blocks each step adds (``scheduled_cached_reqs.new_block_ids``), all of them again
when a preempted request resumes. ``RequestState.block_ids`` follows the primary group's list
(``groups.py``); a hybrid model's live ids of every group are read from vLLM's cache manager
(``HybridBlocks.refresh``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.vllm_integration.scheduler.hybrid import HybridBlocks
from kvtier.vllm_integration.scheduler.lookups import RequestState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


def track_blocks(
    output: SchedulerOutput,
    reqs: dict[str, RequestState],
    primary: int,
    hybrid: HybridBlocks,
) -> list[tuple[str, int, int]]:
    """Update the block ids of every request ``output`` touches; return the scheduled ones
    kvtier tracks as ``(request id, tokens computed before the step, tokens scheduled)``."""
    for rid in output.preempted_req_ids or ():
        state = reqs.get(rid)
        if state is not None:
            # Its KV is gone; what was saved stays saved, the rest is saved again on resume.
            state.block_ids = []
            state.prompt_saved = False
            state.saved_upto = 0
    scheduled = output.num_scheduled_tokens
    out: list[tuple[str, int, int]] = []
    for new in output.scheduled_new_reqs:
        state = reqs.get(new.req_id)
        if state is None:
            continue
        state.block_ids = list(new.block_ids[primary])
        hybrid.refresh(new.req_id, state)
        if state.verify is not None:  # what vLLM's prefix cache gave it is not recomputed
            state.verify.start = max(state.verify.start, new.num_computed_tokens)
        out.append((new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0)))
    cached = output.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        state = reqs.get(rid)
        if state is None:
            continue
        new_blocks = cached.new_block_ids[i]
        if rid in cached.resumed_req_ids:
            state.block_ids = list(new_blocks[primary]) if new_blocks is not None else []
        elif new_blocks is not None:
            state.block_ids.extend(new_blocks[primary])
        hybrid.refresh(rid, state)
        out.append((rid, cached.num_computed_tokens[i], scheduled.get(rid, 0)))
    return out
