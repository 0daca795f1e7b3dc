"""The store and load pipelines: one batch of planned pieces issued as device work.

A store piece gathers paged rows into a staging slot (kernel stream ``ks``), then the copy
engine DMAs the slot to the host objects (copy stream ``cs``); a load piece runs backwards (DMA
into a slot, then a scatter). Two events per slot keep the ring safe: ``filled`` (the producer
is done writing it) and ``free`` (the consumer is done reading it).

Steps are generator steps, so ``store_and_load_async`` (one thread) and the connector's call
combiner (several threads) can interleave both directions; the steps are written once and run
through the lane's executor (the CUDA driver, or at once on a CPU device).

Order of issue: a store sends its table up, then per piece gathers (ks) and DMAs (cs). A load
issues its first DMA before anything else (it needs neither the table nor the caller's stream),
then the table, then per piece the next piece's DMA before this piece's scatter, so the copy
engine always has the next copy queued. A load batch's last scatter may be deferred
(``BatchState.pending``) until the next batch's first DMA: streams may share a hardware queue,
and a DMA submitted after a scatter that waits for the previous DMA would wait for that scatter.

Tables: a store's table goes up on the copy engine unless a load of this connector is in flight;
a load's always by a kernel reading the pinned table in place (``copy_words``). A host-to-device
copy that waits for anything queues behind every host-to-device copy already on the copy engine,
whatever its stream, so a table copied there would wait for the loads' DMAs in flight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.cuda.geometry import CallShape
from kvtier.cuda.kernels import RUN_WORDS, RowGeometry
from kvtier.cuda.lane import Lane, OnDevice, raw_current_stream
from kvtier.cuda.memory import TableBuffer
from kvtier.cuda.plan import Piece, Prepared, Segment, plan, same_copies


@dataclass(slots=True)
class BatchState:
    """State shared by the batches of one call."""

    ordered: bool = False  # ks already follows the caller's stream
    # The calling thread's current stream (raw handle), read when the call was made: another
    # thread may issue the call's steps. None: read it when the first batch is issued.
    caller_stream: int | None = None
    # A load's first piece, DMA'd before the call was checked (``plan.eager_piece``): the first
    # batch issues no DMA of its own for a first piece that matches it.
    eager: Piece | None = None
    # A load batch's deferred last scatter, for the next batch to issue after its first DMA.
    pending: list[Callable[[], None]] = field(default_factory=list)


class Pipeline:
    """Issues planned batches on a connector's two lanes (``store_lane``, ``load_lane``)."""

    def __init__(
        self,
        shape: CallShape,
        geo: RowGeometry,
        bases: torch.Tensor,
        store_lane: Lane,
        load_lane: Lane,
    ) -> None:
        self.shape, self.geo, self.bases = shape, geo, bases
        self.store_lane, self.load_lane = store_lane, load_lane

    def batch(
        self,
        lane: Lane,
        prepared: Sequence[Prepared],
        segments: list[Segment],
        slots: torch.Tensor,
        *,
        store: bool,
        state: BatchState,
        table: TableBuffer | None = None,
        planned: tuple[list[Piece], int, int] | None = None,
        layer_events: dict[int, Any] | None = None,
        interleaved: bool = False,
        defer_last: bool = False,
        first_piece_bytes: int | None = None,
        last_piece_bytes: int | None = None,
    ) -> Generator[None, None, Any]:
        """Plan (unless ``planned`` into ``table`` already) and issue one batch of rows, one piece a
        step when ``interleaved``. ``slots``: the call's slot list, on the host (copied to the
        start of the table buffer) or on the device. Returns an event recorded after the batch's
        last device write, or None (a deferred last scatter, or nothing to do). Called with the
        lane's lock held."""
        if planned is None:
            on_device = slots.device.type == "cuda"
            n_slots = 0 if on_device else slots.numel()
            if table is None:
                table = lane.take_table(n_slots + RUN_WORDS * (len(segments) + 8))
                assert table.host is not None
                if n_slots:
                    table.host[:n_slots] = slots
            slot_base = slots.data_ptr() if on_device else table.dev_ptr
            pieces, runs = plan(
                lane.ring,
                prepared,
                segments,
                store=store,
                slot_base=slot_base,
                first_piece_bytes=first_piece_bytes,
                last_piece_bytes=last_piece_bytes,
            )
            if not pieces:
                return None
            numel = n_slots + RUN_WORDS * len(runs)
            assert table.host is not None
            if table.host.numel() < numel:  # more runs than the estimate: grow, slots kept
                with OnDevice(lane.index):
                    lane.tables.grow(table, numel, keep=n_slots)
                if not on_device:
                    shift = table.dev_ptr - slot_base
                    runs = [(*r[:5], r[5] + shift, *r[6:]) for r in runs]
            assert table.host_np is not None
            table.host_np[n_slots:numel] = [x for run in runs for x in run]
        else:
            assert table is not None
            pieces, n_slots, numel = planned
        with OnDevice(lane.index):
            try:
                self._order_after_caller(lane, state)
                if store:
                    return (yield from self._store(lane, table, n_slots, numel, pieces))
                return (
                    yield from self._load(
                        lane,
                        table,
                        n_slots,
                        numel,
                        pieces,
                        state,
                        layer_events,
                        interleaved,
                        defer_last,
                    )
                )
            except BaseException:
                # Nothing half-issued may outlive the call: the objects may be released next.
                lane.synchronize()
                raise

    @staticmethod
    def _order_after_caller(lane: Lane, state: BatchState) -> None:
        """ks runs after the caller's work so far (a gather reads what the forward pass wrote, a
        scatter writes blocks only after the engine's earlier reads of them); once a call."""
        if state.ordered:
            return
        state.ordered = True
        if not lane.is_cuda:
            return
        lane.bind_context()
        caller = (
            state.caller_stream
            if state.caller_stream is not None
            else raw_current_stream(lane.device)
        )
        lane.exe.record(lane.after.handle, caller)
        lane.exe.wait(lane.ks_h, lane.after.handle)

    def _store(
        self, lane: Lane, table: TableBuffer, n_slots: int, numel: int, pieces: list[Piece]
    ) -> Generator[None, None, Any]:
        """A store batch in one step: each gather waits on the device for its slot, so nothing
        here blocks the host, and a piece left for a later step would wait for the other
        direction's next preparation."""
        exe = lane.exe
        exe.table_up(lane, table, numel, by_kernel=self.load_lane.dma_in_flight())
        for piece in pieces:
            self._store_piece(lane, table, n_slots, piece)
        yield
        done = lane.new_event()
        exe.record(table.done.handle, lane.ks_h)
        exe.record(done.handle, lane.cs_h)
        return done

    def _store_piece(self, lane: Lane, table: TableBuffer, n_slots: int, piece: Piece) -> None:
        """Gather into the piece's slot on ks, then DMA it out on cs."""
        exe, ks_h, cs_h = lane.exe, lane.ks_h, lane.cs_h
        s = piece.slot
        base = lane.ring.slot_ptrs[s]
        filled, free = lane.filled[s].handle, lane.free[s].handle
        exe.wait(ks_h, free)  # the slot's previous DMA ran on cs
        if piece.prefill:
            # Rows with -1 slots keep the object's bytes: bring them into the slot first so the
            # DMA back writes them unchanged. cs already follows the slot's previous DMA.
            for c in piece.copies:
                exe.htod(base + c.slot_offset, c.host_ptr, c.nbytes, cs_h)
            exe.record(filled, cs_h)
            exe.wait(ks_h, filled)
        exe.run_pieces(lane, table, n_slots, piece, self.geo, self.bases, to_paged=False)
        exe.record(filled, ks_h)
        exe.wait(cs_h, filled)
        for c in piece.copies:
            exe.dtoh(c.host_ptr, base + c.slot_offset, c.nbytes, cs_h)
        exe.record(free, cs_h)

    def _load(
        self,
        lane: Lane,
        table: TableBuffer,
        n_slots: int,
        numel: int,
        pieces: list[Piece],
        state: BatchState,
        layer_events: dict[int, Any] | None,
        interleaved: bool,
        defer_last: bool,
    ) -> Generator[None, None, Any]:
        eager, state.eager = state.eager, None
        if eager is None or not same_copies(eager, pieces[0]):
            # (A mismatching eager DMA only wrote a staging slot, which this DMA, later on the
            # same stream, overwrites: the cost is bandwidth, never bytes.)
            self.load_dma(lane, pieces[0])
        for scatter in state.pending:  # the previous batch's last scatter, after our DMA
            scatter()
        state.pending.clear()
        lane.exe.table_up(lane, table, numel, by_kernel=True)
        for k, piece in enumerate(pieces):
            last = k + 1 == len(pieces)
            if not last:
                self.load_dma(lane, pieces[k + 1])
            scatter = functools.partial(
                self._scatter, lane, table, n_slots, piece, layer_events, table if last else None
            )
            if interleaved:
                # The other direction's next piece is submitted before this scatter, which waits
                # for this piece's DMA: on a shared hardware queue it would hold that piece up.
                yield
            if last and defer_last:
                state.pending.append(scatter)
            else:
                scatter()
            if not interleaved:
                yield
        if defer_last:
            return None
        done = lane.new_event()
        lane.exe.record(done.handle, lane.ks_h)
        return done

    @staticmethod
    def load_dma(lane: Lane, piece: Piece) -> None:
        """DMA a load piece's host rows into its slot on cs, once the slot's last scatter is done."""
        exe, cs_h = lane.exe, lane.cs_h
        s = piece.slot
        base = lane.ring.slot_ptrs[s]
        exe.wait(cs_h, lane.free[s].handle)
        for c in piece.copies:
            exe.htod(base + c.slot_offset, c.host_ptr, c.nbytes, cs_h)
        exe.record(lane.filled[s].handle, cs_h)

    def _scatter(
        self,
        lane: Lane,
        table: TableBuffer,
        n_slots: int,
        piece: Piece,
        layer_events: dict[int, Any] | None,
        last_of: TableBuffer | None,
    ) -> None:
        """Scatter a load piece from its slot once its DMA has landed (ks); ``last_of``: the
        batch's table, free for reuse after this, its last reader."""
        exe, ks_h = lane.exe, lane.ks_h
        s = piece.slot
        exe.wait(ks_h, lane.filled[s].handle)
        exe.run_pieces(lane, table, n_slots, piece, self.geo, self.bases, to_paged=True)
        exe.record(lane.free[s].handle, ks_h)
        if layer_events is not None and piece.layers_done:
            ev = lane.new_event()
            exe.record(ev.handle, ks_h)
            for layer in piece.layers_done:
                layer_events[layer] = ev
        if last_of is not None:
            exe.record(last_of.done.handle, ks_h)

    @staticmethod
    def flush_pending(lane: Lane, state: BatchState) -> Any:
        """Issue a call's deferred scatter when no later batch did; the event after it."""
        with OnDevice(lane.index):
            for scatter in state.pending:
                scatter()
            state.pending.clear()
            done = lane.new_event()
            lane.exe.record(done.handle, lane.ks_h)
            return done


def run_steps(steps: Generator[None, None, Any]) -> Any:
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value
