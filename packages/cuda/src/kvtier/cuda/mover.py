"""The CUDA page mover: a Triton kernel gathers pages into device staging, the copy engine moves
the staging to pinned host objects (a load: the reverse).

A store takes a call's blocks in *groups*. Each group's pages (all layers of each block, or one
layer) are gathered by one kernel into a staging slot laid out exactly as the host objects
(``[blocks, layers, page]``), then DMA'd to the objects with one copy per run of blocks that sit
back to back in host memory (a whole object, or several objects allocated one after another). A
load DMAs into a slot, then scatters it. Each direction has its own lane (``kvtier.cuda.lane``:
two streams, two staging slots, events), so a group's gather runs while the previous group's DMA
is on the copy engine, and a store and a load run at once (PCIe is full duplex).

Host time is the other budget: a small model's 2 MiB chunk crosses PCIe in under 40 us. A call
is checked and planned (its block ids gathered by one ``torch.cat``, the rest vectorised in numpy)
in one pass before its first group, or, where its first transfers already hold 32 MiB, those
first and the rest while their copies run. Groups start at 2 MiB and grow
fourfold up to a slot (a gather is ~30 times faster than the DMA behind it, so a larger next
group is still gathered before the copy engine is free). A whole call that fits one slot is one
group on the copy stream alone: stream order replaces the events, half the driver calls.

Streams: every call first orders its kernel stream after the calling thread's current stream (a
store reads what the forward pass wrote; a load overwrites blocks only after the engine's earlier
use of them). Whole calls and ``store_layer``/``load_layer`` return after the host has waited for
their copies. ``store_layerwise`` makes the caller's current stream wait (on the device) for each
layer's gather before yielding it, its DMAs running on until the generator is exhausted;
``load_layerwise`` issues every layer at its first step and, before yielding layer ``i``, makes
the caller's current stream wait for that layer's scatter, so attention can be queued at once.

Whole calls from a mover's second call in each direction on are checked, planned and issued by
one C call with the GIL released (``kvtier.cuda.native``: the same slots, streams, events and
kernels, in parts as above); this module's Python path runs the first calls (which compile the
kernels), the layer calls, and everything where the native issuer could not be built.

On a CPU device (tests, under ``TRITON_INTERPRET=1``) the same code runs synchronously.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout
from kvtier.core.platform.mover import PageMover, Transfer
from kvtier.cuda import native
from kvtier.cuda.kernels import COPY_BLOCK, Geometry, Kernels
from kvtier.cuda.lane import Lane, current_raw_stream
from kvtier.cuda.memory import REGISTRATIONS
from kvtier.cuda.native import NativeLane
from kvtier.cuda.plan import Plan, plan_transfers

# A call's first group: small, so its first DMA starts early; later groups grow by GROWTH up to a
# slot (each group costs host time: fewer, larger ones).
FIRST_GROUP_BYTES = 2 << 20
GROWTH = 4
# A call's first plan stops once its transfers hold this many bytes (a 32 MiB copy takes ~0.6 ms,
# longer than planning the rest of any call); a smaller call is planned in one pass.
PLAN_AHEAD_BYTES = 32 << 20


@dataclass(frozen=True)
class MoverOptions:
    """The CUDA mover's options (``CUDAPlatform.create_mover`` checks them by name and type).

    - ``staging_buffer`` (the meaning every platform shares): True keeps the staging slots
      between calls; False gives them back to torch's allocator when each call ends.
    - ``staging_slots`` (>= 2: one filled while another is copied) and ``staging_slot_bytes``
      (> 0) per direction: the slots cost ``2 * staging_slots * staging_slot_bytes`` of device
      memory; a slot grows to hold one block's pages when those are larger.
    """

    staging_buffer: bool = True
    staging_slots: int = 2
    staging_slot_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if self.staging_slots < 2:
            raise ValueError(
                f"cuda mover option staging_slots must be >= 2, got {self.staging_slots}"
            )
        if self.staging_slot_bytes <= 0:
            raise ValueError(
                f"cuda mover option staging_slot_bytes must be > 0, got {self.staging_slot_bytes}"
            )


OPTION_TYPES = {"staging_slots": int, "staging_slot_bytes": int}


class _Call:
    """One call on a lane: its device current, and at the end (errors and closed generators
    too) the host waits for every copy it issued, so its objects may go."""

    __slots__ = ("keep", "lane", "prev")

    def __init__(self, lane: Lane, keep: bool) -> None:
        self.lane, self.keep, self.prev = lane, keep, -1

    def __enter__(self) -> Lane:
        lane = self.lane
        if lane.gpu:
            current = torch.cuda.current_device()
            if current != lane.index:
                torch.cuda.set_device(lane.device)
                self.prev = current
            lane.bind_context()
        lane.begin()
        return lane

    def __exit__(self, *exc: object) -> None:
        try:
            self.lane.synchronize()
            if not self.keep:
                self.lane.release()
        finally:
            if self.prev >= 0:
                torch.cuda.set_device(self.prev)


class CUDAPageMover(PageMover):
    """Moves pages between CUDA KV views and pinned host objects (see the module doc)."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        num_blocks: int | None = None,
        options: MoverOptions | None = None,
    ) -> None:
        super().__init__(kv_caches, layout, num_blocks)
        self.options = opts = options or MoverOptions()
        device = self.device
        if device.type not in ("cuda", "cpu"):
            raise LayoutError(f"the CUDA mover moves KV on cuda (or cpu, in tests), not {device}")
        self.geometry = Geometry.of(self.kv_caches, self.runs)
        self._kernels = Kernels(self.kv_caches, self.geometry)
        self._page = layout.page_bytes
        self._row = layout.num_layers * layout.page_bytes
        self._store = Lane(device, opts.staging_slots, opts.staging_slot_bytes)
        self._load = Lane(device, opts.staging_slots, opts.staging_slot_bytes)
        self._natives: dict[bool, NativeLane] = {}

    # -- whole calls ---------------------------------------------------------------------------
    def store(self, transfers: Sequence[Transfer]) -> None:
        with _Call(self._store, self.options.staging_buffer) as lane:
            if not self._native_call(lane, transfers, store=True):
                self._whole(lane, transfers, store=True)

    def load(self, transfers: Sequence[Transfer]) -> None:
        with _Call(self._load, self.options.staging_buffer) as lane:
            if not self._native_call(lane, transfers, store=False):
                self._whole(lane, transfers, store=False)

    def _native_call(self, lane: Lane, transfers: Sequence[Transfer], *, store: bool) -> bool:
        """A whole call through the native issuer (``kvtier.cuda.native``): False on a CPU
        device, before the direction's kernels are kept (its first call), where the issuer could
        not be built, or where one block's row is larger than a slot."""
        if not lane.gpu:
            return False
        issuer = self._natives.get(store)
        if issuer is None:
            issuer = self._native_lane(lane, store=store)
            if issuer is None:
                return False
        assert lane.index is not None
        return issuer.call(
            transfers, current_raw_stream(lane.index), REGISTRATIONS.cuts, store=store
        )

    def _native_lane(self, lane: Lane, *, store: bool) -> NativeLane | None:
        lib = native.library()
        layers = self.layout.num_layers
        pages = self._kernels.kept_direct("pages", to_cache=not store, layers=layers)
        words = self._kernels.kept_direct("words") if store else None
        if lib is None or pages is None or (store and words is None):
            return None
        g = self.geometry
        issuer = NativeLane(
            lib, lane, words, pages,
            grid_y=g.runs * g.tiles_per_run, layers=layers, words_block=COPY_BLOCK,
            first_rows=max(1, FIRST_GROUP_BYTES // self._row),
            num_blocks=self.num_blocks, layout=self.layout,
        )  # fmt: skip
        self._natives[store] = issuer
        return issuer

    def _whole(self, lane: Lane, transfers: Sequence[Transfer], *, store: bool) -> None:
        """The first transfers, up to ``PLAN_AHEAD_BYTES``, are checked and issued, then the
        rest is checked and planned while their copies run. A call that fits one slot is one
        group on the copy stream alone (``_one_stream``)."""
        k, ahead = 0, max(1, PLAN_AHEAD_BYTES // self._row)
        while k < len(transfers) and ahead > 0:
            ahead -= transfers[k].blocks.shape[0]
            k += 1
        first = self._plan(lane, transfers[:k], 0)
        if k == len(transfers) and first.count * self._row <= lane.slot_bytes:
            self._one_stream(lane, first, store=store)
            return
        lane.order_after_caller(lane.ks)
        self._upload(lane, first, store=store)
        size = self._run(lane, first, None, max(1, FIRST_GROUP_BYTES // self._row), store=store)
        if k < len(transfers):
            rest = self._plan(lane, transfers[k:], first.count + (first.count & 1))
            self._upload(lane, rest, store=store)
            self._run(lane, rest, None, size, store=store)

    # -- one layer -----------------------------------------------------------------------------
    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        with _Call(self._store, self.options.staging_buffer) as lane:
            plan = self._plan_all(lane, transfers, store=True)
            lane.order_after_caller(lane.ks)
            self._run(lane, plan, layer, 0, store=True)

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        with _Call(self._load, self.options.staging_buffer) as lane:
            plan = self._plan_all(lane, transfers, store=False)
            lane.order_after_caller(lane.ks)
            self._run(lane, plan, layer, 0, store=False)

    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        """Each step gathers one layer into staging and makes the caller's current stream wait
        (on the device) for the gather before yielding: the engine may then overwrite the layer.
        Its DMA to the host runs on; exhausting the generator waits for them all."""
        with _Call(self._store, self.options.staging_buffer) as lane:
            plan = self._plan_all(lane, transfers, store=True)
            for layer in range(self.layout.num_layers):
                lane.order_after_caller(lane.ks)
                self._run(lane, plan, layer, 0, store=True)
                if lane.gathered is not None:
                    lane.caller_waits(lane.gathered)
                yield layer

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        """The first step issues every layer; layer ``i`` is yielded once the caller's current
        stream waits for it (attention queued after the yield reads it loaded)."""
        with _Call(self._load, self.options.staging_buffer) as lane:
            plan = self._plan_all(lane, transfers, store=False)
            lane.order_after_caller(lane.ks)
            layers = self.layout.num_layers
            while len(lane.layer_done) < layers:
                lane.layer_done.append(lane.event())
            for layer in range(layers):
                self._run(lane, plan, layer, 0, store=False)
                lane.record(lane.layer_done[layer], lane.ks)
            for layer in range(layers):
                lane.caller_waits(lane.layer_done[layer])
                yield layer

    # -- planning ------------------------------------------------------------------------------
    def _plan_all(self, lane: Lane, transfers: Sequence[Transfer], *, store: bool) -> Plan:
        plan = self._plan(lane, transfers, 0)
        self._upload(lane, plan, store=store)
        return plan

    def _plan(self, lane: Lane, transfers: Sequence[Transfer], at: int) -> Plan:
        return plan_transfers(lane, transfers, at, self.layout, self.num_blocks)

    def _upload(self, lane: Lane, plan: Plan, *, store: bool, stream: Any = None) -> None:
        """``plan``'s block ids to the device, ahead of the kernels that read them (why this
        way: ``kvtier.cuda.lane``); a store's on ``stream`` (default: the kernel stream)."""
        if not lane.gpu or not plan.count:
            return
        if store:
            self._kernels.copy_words(
                lane.ids_host, lane.ids, plan.at, plan.count, stream=stream or lane.kernel_stream
            )
        else:
            lane.to_device(
                lane.ids.data_ptr() + 8 * plan.at,
                lane.ids_host.data_ptr() + 8 * plan.at,
                8 * plan.count,
            )

    # -- issuing -------------------------------------------------------------------------------
    def _one_stream(self, lane: Lane, plan: Plan, *, store: bool) -> None:
        """A whole call that fits one slot, as one group on the copy stream: stream order takes
        the place of the events between a kernel stream and the copy stream, so a store's first
        DMA follows five driver calls (wait for the caller, ids, gather) instead of seven, and a
        call makes about half as many. A load's DMA goes first; only its scatter waits for the
        caller's stream."""
        if not plan.count:
            return
        row, n = self._row, plan.count
        s = lane.take_slot(n * row, lane.cs)  # a call's first use: no wait
        slot = lane.slots[s]
        layers = self.layout.num_layers
        if store:
            lane.order_after_caller(lane.cs)
            self._upload(lane, plan, store=True, stream=lane.copy_stream)
            self._kernels.pages(
                slot, lane.ids, plan.at, n, layers, 0, to_cache=False, stream=lane.copy_stream
            )
            self._copies(lane, plan, 0, n, slot.data_ptr(), row, 0, store=True)
        else:
            self._upload(lane, plan, store=False)
            self._copies(lane, plan, 0, n, slot.data_ptr(), row, 0, store=False)
            lane.order_after_caller(lane.cs)
            self._kernels.pages(
                slot, lane.ids, plan.at, n, layers, 0, to_cache=True, stream=lane.copy_stream
            )
        lane.record(lane.free[s], lane.cs)

    def _run(self, lane: Lane, plan: Plan, layer: int | None, size: int, *, store: bool) -> int:
        """Issue ``plan``'s groups for ``layer`` (None: every layer at once, a block's pages one
        row). Groups start at ``size`` blocks (0: as many as a slot holds) and grow by
        ``GROWTH`` up to a slot; returns the size the next group would have."""
        width = self._row if layer is None else self._page
        cap = max(1, lane.slot_bytes // width)
        a, n = 0, min(size or cap, cap)
        while a < plan.count:
            b = min(plan.count, a + n)
            self._group(lane, plan, a, b, layer, width, store=store)
            a, n = b, min(GROWTH * n, cap)
        return n

    def _group(
        self, lane: Lane, plan: Plan, a: int, b: int, layer: int | None, width: int, *, store: bool
    ) -> None:
        """One group: blocks ``a:b`` of ``plan`` (``layer`` None: every layer), through one slot:
        a store gathers then DMAs, a load DMAs then scatters."""
        s = lane.take_slot((b - a) * width, lane.ks if store else lane.cs)
        slot = lane.slots[s]
        base = slot.data_ptr()
        layers, first = (self.layout.num_layers, 0) if layer is None else (1, layer)
        offset = 0 if layer is None else layer * self._page
        if store:
            self._kernels.pages(
                slot, lane.ids, plan.at + a, b - a, layers, first,
                to_cache=False, stream=lane.kernel_stream,
            )  # fmt: skip
            lane.record(lane.filled[s], lane.ks)
            lane.gathered = lane.filled[s]
            lane.filled[s].wait_on(lane.cs)
        self._copies(lane, plan, a, b, base, width, offset, store=store)
        if store:
            lane.record(lane.free[s], lane.cs)
        else:
            lane.record(lane.filled[s], lane.cs)
            lane.filled[s].wait_on(lane.ks)
            self._kernels.pages(
                slot, lane.ids, plan.at + a, b - a, layers, first,
                to_cache=True, stream=lane.kernel_stream,
            )  # fmt: skip
            lane.record(lane.free[s], lane.ks)

    def _copies(
        self,
        lane: Lane,
        plan: Plan,
        a: int,
        b: int,
        base: int,
        width: int,
        offset: int,
        *,
        store: bool,
    ) -> None:
        """The DMAs between blocks ``a:b`` of ``plan`` (at ``offset`` in each block's row, ``width``
        bytes of it) and the slot at ``base``: one copy per run of blocks back to back in host
        memory."""
        row, cuts = self._row, plan.cuts
        bounds = [a, *cuts[bisect.bisect_right(cuts, a) : bisect.bisect_left(cuts, b)], b]
        for j0, j1 in itertools.pairwise(bounds):
            host = plan.host(j0, row) + offset
            dev = base + (j0 - a) * width
            if width == row:
                if store:
                    lane.to_host(host, dev, (j1 - j0) * row)
                else:
                    lane.to_device(dev, host, (j1 - j0) * row)
            elif store:
                lane.copy_2d(host, row, dev, width, width, j1 - j0, to_host=True)
            else:
                lane.copy_2d(dev, width, host, row, width, j1 - j0, to_host=False)
