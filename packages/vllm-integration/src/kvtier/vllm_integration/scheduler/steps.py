"""What a step's scheduler output says about each request's blocks.

vLLM sends a request's block ids once when it is scheduled first (``scheduled_new_reqs``) and
then only the blocks each step adds (``scheduled_cached_reqs.new_block_ids``), all of them again
when a preempted request resumes. kvtier follows the primary group's list (``groups.py``); a
hybrid model's live ids of every group are read from vLLM's cache manager
(``HybridBlocks.refresh``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


class BlockUpdate(NamedTuple):
    """One scheduled request's blocks in a step."""

    rid: str
    block_ids: list[int]  # all of them (first scheduled, resumed), else the ones added
    first: bool  # scheduled for the first time
    resumed: bool  # scheduled again after a preemption
    computed: int  # tokens computed before the step
    scheduled: int  # tokens the step computes


def block_updates(output: SchedulerOutput, primary: int) -> list[BlockUpdate]:
    """Every request ``output`` schedules, with its primary group's block ids."""
    scheduled = output.num_scheduled_tokens
    out = [
        BlockUpdate(
            new.req_id,
            list(new.block_ids[primary]),
            True,
            False,
            new.num_computed_tokens,
            scheduled.get(new.req_id, 0),
        )
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        blocks = cached.new_block_ids[i]
        ids = list(blocks[primary]) if blocks is not None else []
        resumed = rid in cached.resumed_req_ids
        computed = cached.num_computed_tokens[i]
        out.append(BlockUpdate(rid, ids, False, resumed, computed, scheduled.get(rid, 0)))
    return out
