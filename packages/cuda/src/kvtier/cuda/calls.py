"""A whole-chunk call (``store_async``, ``load_async``, ``store_and_load_async``) as steps:
split into groups, each checked, planned and issued in turn.

Groups let a call's first DMA start after the host has prepared a few MiB, not the whole call:
the host prepares the next group while the previous one's bytes cross PCIe. A lone load's first
DMA starts even before its first group is checked (``plan.eager_piece``). While the lane still
has earlier calls in flight, their bytes hide this call's preparation, and every group or piece
boundary costs the copy engine a gap: such a call is one group with no short first or last
piece. The measurements behind these choices are in docs/cuda-performance.md.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from kvtier.core.connector import Transfer
from kvtier.cuda import _native
from kvtier.cuda.kernels import RUN_WORDS
from kvtier.cuda.lane import Lane, OnDevice
from kvtier.cuda.pipeline import BatchState, Pipeline
from kvtier.cuda.plan import (
    FIRST_GROUP_BYTES,
    FIRST_PIECE_BYTES,
    GROUP_GROWTH,
    LAST_PIECE_BYTES,
    LOAD_GROUP_GROWTH,
    Prepared,
    all_rows,
    eager_piece,
    groups,
    prepare,
)

# The slot tensor of a batch planned in C (its slots are in the table buffer already).
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


class WholeCalls:
    """Builds the steps of whole-chunk calls on a ``Pipeline``; ``native``: the compiled
    planner module, or None to plan in Python; ``keep_ring``: False releases a lane's staging
    ring once each call is issued (the ``staging_buffer`` option)."""

    def __init__(self, pipeline: Pipeline, native: Any, *, keep_ring: bool) -> None:
        self.pipeline = pipeline
        self.native = native
        self.keep_ring = keep_ring

    def steps(
        self,
        lane: Lane,
        transfers: Sequence[Transfer],
        *,
        store: bool,
        interleaved: bool = False,
        caller_stream: int | None = None,
    ) -> Generator[None, None, Any]:
        """A whole-chunk call, group by group; ``interleaved``: one direction of
        ``store_and_load_async`` (the other direction's steps run between this one's).

        Checks run group by group: a call that fails on a later group has already run the
        earlier ones (a load has written some of its slots, a store some of its objects).
        Nothing stays in flight after the error, and the caller treats the whole call as
        failed, as for any error."""
        pipe, shape = self.pipeline, self.pipeline.shape
        done = None
        state = BatchState(caller_stream=caller_stream)
        with lane.lock:  # held across batches: a deferred scatter's slot must stay ours
            try:
                eager = not store
                # One group, and no short first or last piece, while earlier calls keep the lane busy.
                busy = lane.busy()
                parts = groups(
                    transfers,
                    shape.token_bytes,
                    first=(1 if store else 2)
                    * FIRST_GROUP_BYTES,  # a load's first DMA starts early: more to hide
                    slot_bytes=lane.ring.slot_bytes,
                    growth=GROUP_GROWTH if store or interleaved else LOAD_GROUP_GROWTH,
                    whole=busy,
                )
                first_load_piece = None
                if eager:
                    lo, hi, _ = parts[0]
                    lane.bind_context()
                    with OnDevice(lane.index):
                        last = LAST_PIECE_BYTES if len(parts) == 1 and not busy else None
                        state.eager = eager_piece(
                            lane.ring, transfers[lo:hi], shape, last_piece_bytes=last
                        )
                        if state.eager is not None:
                            pipe.load_dma(lane, state.eager)
                            first_load_piece = state.eager.nbytes
                    if interleaved and state.eager is not None:
                        yield  # the other direction's first batch next, while this DMA runs
                for g, (lo, hi, tokens) in enumerate(parts):
                    last_group = g + 1 == len(parts)
                    first_piece = None
                    if not state.ordered:
                        first_piece = (
                            (None if busy else FIRST_PIECE_BYTES) if store else first_load_piece
                        )
                    last_piece = LAST_PIECE_BYTES if not store and last_group and not busy else None
                    table = lane.take_table(tokens + RUN_WORDS * (hi - lo + 8))
                    planned = None
                    if self.native is not None:
                        planned = _native.plan_group(
                            self.native,
                            shape,
                            lane.ring,
                            transfers,
                            lo,
                            hi,
                            table,
                            first_piece_bytes=first_piece,
                            last_piece_bytes=last_piece,
                        )
                    prepared: Sequence[Prepared] = ()
                    slots = _NO_SLOTS
                    if planned is None:
                        prepared, slots = prepare(
                            shape, transfers[lo:hi], first_index=lo, out=table.host
                        )
                    done = (
                        yield from pipe.batch(
                            lane,
                            prepared,
                            all_rows(len(prepared), shape),
                            slots,
                            store=store,
                            state=state,
                            table=table,
                            planned=planned,
                            interleaved=interleaved,
                            defer_last=not store and not last_group,
                            first_piece_bytes=first_piece,
                            last_piece_bytes=last_piece,
                        )
                    ) or done
                if state.pending:  # the batches after the deferring one issued nothing
                    done = pipe.flush_pending(lane, state)
            except BaseException:
                state.pending.clear()
                lane.synchronize()
                raise
            finally:
                if not self.keep_ring:
                    lane.ring.release()
        return done
