"""The CUDA page mover: a Triton kernel gathers pages into device staging, the copy engine moves
the staging to pinned host objects (a load: the reverse).

A store takes a call's blocks in *groups*. Each group's pages (all layers of each block, or one
layer) are gathered by one kernel into a staging slot laid out exactly as the host objects
(``[blocks, layers, page]``), then DMA'd to the objects with one copy per run of blocks that sit
back to back in host memory (a whole object, or several objects allocated one after another). A
load DMAs into a slot, then scatters it. Each direction has its own lane (``kvtier.cuda.lane``:
two streams, two staging slots, events), so a group's gather runs while the previous group's DMA
is on the copy engine, and a store and a load run at once (PCIe is full duplex).

Host time is the other budget: a small model's 2 MiB chunk crosses PCIe in under 40 us. The
first group is the call's first transfer, checked and issued before the rest of the call is
checked and planned (vectorised, in numpy); groups then double in size up to a slot.

Streams: every call first orders its kernel stream after the calling thread's current stream (a
store reads what the forward pass wrote; a load overwrites blocks only after the engine's earlier
use of them). Whole calls, ``store_layer``/``load_layer`` and each layer a ``store_layerwise``
yields return after the host has waited for their copies. ``load_layerwise`` issues every layer
at its first step and, before yielding layer ``i``, makes the caller's current stream wait (on the
device) for that layer's scatter, so attention can be queued at once.

On a CPU device (tests, under ``TRITON_INTERPRET=1``) the same code runs synchronously.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout
from kvtier.core.mover import PageMover, Transfer
from kvtier.cuda.kernels import Geometry, Kernels
from kvtier.cuda.lane import Lane

# A call's first group: small, so its first DMA starts early; later groups double up to a slot.
FIRST_GROUP_BYTES = 2 << 20


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
    staging_slot_bytes: int = 16 << 20

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


@dataclass
class Plan:
    """Some transfers' blocks to move: block ids at ``at`` in the lane's id buffers (``ids``
    holds them) and each block's row address in host memory (``addrs``); skipped blocks left
    out."""

    at: int
    ids: np.ndarray
    addrs: np.ndarray

    @property
    def count(self) -> int:
        return int(self.ids.shape[0])


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
        self._row = layout.num_layers * layout.page_bytes
        self._store = Lane(device, opts.staging_slots, opts.staging_slot_bytes)
        self._load = Lane(device, opts.staging_slots, opts.staging_slot_bytes)

    # -- whole calls ---------------------------------------------------------------------------
    def store(self, transfers: Sequence[Transfer]) -> None:
        lane = self._store
        with self._call(lane):
            lane.order_after_caller()
            size = self._first_size(self._row)
            for plan in self._phases(lane, transfers):
                self._upload(lane, plan, store=True)
                size = self._run(lane, plan, [None], size, store=True)

    def load(self, transfers: Sequence[Transfer]) -> None:
        lane = self._load
        with self._call(lane):
            lane.order_after_caller()
            size = self._first_size(self._row)
            for plan in self._phases(lane, transfers):
                self._upload(lane, plan, store=False)
                size = self._run(lane, plan, [None], size, store=False)

    # -- one layer -----------------------------------------------------------------------------
    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        lane = self._store
        with self._call(lane):
            plan = self._plan_all(lane, transfers)
            self._upload(lane, plan, store=True)
            lane.order_after_caller()
            self._run(lane, plan, [layer], 0, store=True)

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        lane = self._load
        with self._call(lane):
            plan = self._plan_all(lane, transfers)
            self._upload(lane, plan, store=False)
            lane.order_after_caller()
            self._run(lane, plan, [layer], 0, store=False)

    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        """Each step captures one layer into the host objects (done when it yields)."""
        lane = self._store
        with self._call(lane):
            plan = self._plan_all(lane, transfers)
            self._upload(lane, plan, store=True)
            for layer in range(self.layout.num_layers):
                lane.order_after_caller()
                self._run(lane, plan, [layer], 0, store=True)
                lane.synchronize()
                yield layer

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        """The first step issues every layer; layer ``i`` is yielded once the caller's current
        stream waits for it (attention queued after the yield reads it loaded)."""
        lane = self._load
        with self._call(lane):
            plan = self._plan_all(lane, transfers)
            self._upload(lane, plan, store=False)
            lane.order_after_caller()
            layers = self.layout.num_layers
            while len(lane.layer_done) < layers:
                lane.layer_done.append(lane.event())
            for layer in range(layers):
                self._run(lane, plan, [layer], 0, store=False)
                lane.record(lane.layer_done[layer], lane.ks)
            for layer in range(layers):
                lane.caller_waits(lane.layer_done[layer])
                yield layer

    # -- planning ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _call(self, lane: Lane) -> Iterator[None]:
        """One call on ``lane``: its device current, and at the end (errors and closed
        generators too) the host waits for every copy it issued, so its objects may go."""
        switch = lane.gpu and lane.index is not None and torch.cuda.current_device() != lane.index
        with torch.cuda.device(lane.index) if switch else contextlib.nullcontext():
            lane.bind_context()
            try:
                yield
            finally:
                lane.synchronize()
                if not self.options.staging_buffer:
                    lane.release()

    def _phases(self, lane: Lane, transfers: Sequence[Transfer]) -> Iterator[Plan]:
        """The first transfer's plan, then the rest's: the rest is checked while the first
        one's copies run."""
        if not transfers:
            return
        lane.ensure_ids(sum(int(t.blocks.numel()) for t in transfers) + 2)
        first = self._plan(lane, transfers[:1], 0)
        yield first
        if len(transfers) > 1:
            yield self._plan(lane, transfers[1:], first.count + (first.count & 1))

    def _plan_all(self, lane: Lane, transfers: Sequence[Transfer]) -> Plan:
        lane.ensure_ids(sum(int(t.blocks.numel()) for t in transfers) + 2)
        return self._plan(lane, transfers, 0)

    def _plan(self, lane: Lane, transfers: Sequence[Transfer], at: int) -> Plan:
        """Check ``transfers`` (contract errors) and write their kept block ids at ``at``."""
        if not transfers:
            return Plan(at, np.empty(0, np.int64), np.empty(0, np.int64))
        lay, row = self.layout, self._row
        counts, ptrs, ids = [], [], []
        for t in transfers:
            obj = t.obj.tensor
            n = int(t.blocks.numel())
            if obj.shape != (n, lay.num_layers, lay.page_bytes) or obj.dtype != lay.chunk_dtype:
                raise LayoutError(
                    f"a memory object {tuple(obj.shape)} {obj.dtype} does not match the "
                    f"layout's chunk {(n, lay.num_layers, lay.page_bytes)} {lay.chunk_dtype} "
                    f"({lay.describe()})"
                )
            counts.append(n)
            ptrs.append(obj.data_ptr())
            blocks = t.blocks if t.blocks.device.type == "cpu" else t.blocks.cpu()
            ids.append(blocks.numpy())
        block_ids = np.concatenate(ids).astype(np.int64, copy=False)
        if block_ids.size:
            lo, hi = int(block_ids.min()), int(block_ids.max())
            if lo < -1 or hi >= self.num_blocks:
                raise IndexError(
                    f"block ids must be -1 or in [0, {self.num_blocks}), got [{lo}, {hi}]"
                )
        sizes = np.asarray(counts, dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        addrs = np.repeat(np.asarray(ptrs, dtype=np.int64) - starts * row, sizes)
        addrs += np.arange(block_ids.size, dtype=np.int64) * row
        keep = block_ids >= 0
        if not keep.all():
            block_ids, addrs = block_ids[keep], addrs[keep]
        k = block_ids.size
        lane.ids_host.numpy()[at : at + k] = block_ids
        return Plan(at, block_ids, addrs)

    def _first_size(self, width: int) -> int:
        return max(1, FIRST_GROUP_BYTES // width)

    def _upload(self, lane: Lane, plan: Plan, *, store: bool) -> None:
        """``plan``'s block ids to the device, ahead of the kernels that read them."""
        if not lane.gpu or not plan.count:
            return
        if store:
            self._kernels.copy_words(
                lane.ids_host, lane.ids_dev, plan.at, plan.count, stream=lane.kernel_stream
            )
        else:
            lane.to_device(
                lane.ids_dev.data_ptr() + 8 * plan.at,
                lane.ids_host.data_ptr() + 8 * plan.at,
                8 * plan.count,
            )

    # -- issuing -------------------------------------------------------------------------------
    def _run(
        self,
        lane: Lane,
        plan: Plan,
        layers: Sequence[int | None],
        size: int,
        *,
        store: bool,
    ) -> int:
        """Issue ``plan``'s groups for each of ``layers`` (None: every layer at once, a block's
        pages one row). Groups start at ``size`` blocks (0: as many as a slot holds) and double
        up to a slot; returns the size the next group would have."""
        for layer in layers:
            width = self._row if layer is None else self.layout.page_bytes
            cap = max(1, lane.slot_bytes // width)
            a, n = 0, min(size or cap, cap)
            while a < plan.count:
                b = min(plan.count, a + n)
                self._group(lane, plan, a, b, layer, width, store=store)
                a, n = b, min(2 * n, cap)
            size = n
        return size

    def _group(
        self, lane: Lane, plan: Plan, a: int, b: int, layer: int | None, width: int, *, store: bool
    ) -> None:
        """One group: blocks ``a:b`` of ``plan`` (``layer`` None: every layer), through one slot."""
        s = lane.take_slot((b - a) * width)
        slot = lane.slots[s]
        base = slot.data_ptr()
        row = self._row
        count = b - a
        layers, first = (self.layout.num_layers, 0) if layer is None else (1, layer)
        offset = 0 if layer is None else layer * self.layout.page_bytes
        addrs = plan.addrs[a:b]
        # runs of blocks back to back in host memory: one copy each
        cuts = np.flatnonzero(np.diff(addrs) != row) + 1
        bounds = [0, *cuts.tolist(), count]
        if store:
            lane.free[s].wait_on(lane.ks)
            self._kernels.pages(
                slot,
                lane.ids_dev,
                plan.at + a,
                count,
                layers,
                first,
                to_cache=False,
                stream=lane.kernel_stream,
            )
            lane.record(lane.filled[s], lane.ks)
            lane.filled[s].wait_on(lane.cs)
        else:
            lane.free[s].wait_on(lane.cs)
        for j0, j1 in itertools.pairwise(bounds):
            host = int(addrs[j0]) + offset
            dev = base + j0 * width
            if width == row:
                nbytes = (j1 - j0) * row
                if store:
                    lane.to_host(host, dev, nbytes)
                else:
                    lane.to_device(dev, host, nbytes)
            elif store:
                lane.copy_2d(host, row, dev, width, width, j1 - j0, to_host=True)
            else:
                lane.copy_2d(dev, width, host, row, width, j1 - j0, to_host=False)
        if store:
            lane.record(lane.free[s], lane.cs)
        else:
            lane.record(lane.filled[s], lane.cs)
            lane.filled[s].wait_on(lane.ks)
            self._kernels.pages(
                slot,
                lane.ids_dev,
                plan.at + a,
                count,
                layers,
                first,
                to_cache=True,
                stream=lane.kernel_stream,
            )
            lane.record(lane.free[s], lane.ks)
