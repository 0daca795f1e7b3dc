"""The XPU device connector: core's torch paged copy, run on transfer streams.

What this adds to ``TorchPagedConnector`` (whose ``index_select``/``index_copy_`` paged indexing it
reuses unchanged):

- **Transfer streams.** Every gather, scatter and host copy is issued on a side stream of the
  cache's device (one for stores, one for loads), so copies overlap the engine's compute. Ordering with the engine's current
  stream is explicit: a store waits for the engine's work before reading a layer (per layer for
  the layer-wise store, whose next layer is computed between calls); a layer-wise load makes the
  engine's stream wait for that layer's event, so attention on layer ``l`` starts as soon as
  layer ``l`` landed, without blocking the host.
- **Asynchronous host copies.** Device-to-host and host-to-device copies are
  ``non_blocking`` and contiguous (K and V halves are copied separately, so each is one DMA from
  or to the pinned host arena). The host waits for the transfer stream before anything reads a
  host buffer written by a store, and before a load returns the objects it read to their owner
  (who may free and reuse them): that is at the end of ``store``/``load`` and when a layer-wise
  generator is exhausted *or closed early*.
- **Device staging buffers** (``staging_buffer=True``, config ``device_staging_buffer``). Store
  (whole and layer-wise): per layer, the tokens of *all* chunks are gathered in one indexing op
  into a preallocated device buffer (one layer of the batch), then each chunk's K and V go to
  host in one copy each. Layer-wise load is the reverse: copy each chunk's layer into the buffer,
  scatter all of them in one op. Whole load copies each object to the device in one copy (into a
  buffer laid out like the objects, up to ``max_staging_bytes``; larger batches go layer by
  layer), then gathers and scatters each layer of all chunks in one op each. Without staging,
  each chunk is gathered/scattered on its own through a temporary. Buffers grow on demand and
  are kept for the next transfer (``staging_nbytes``).

Threads (``DeviceConnector``'s contract): one store and one load may be in flight at once, from
two threads. Each direction has its own transfer stream and its own staging buffers (a
``_Lane``), so a load never writes into a buffer a store has gathered into but not yet copied
to host, and neither waits for the other's copies; no lock is taken. Two stores (or two loads)
at once share a lane: the caller serialises those.
On CPU tensors the streams are no-ops (``kvtier.xpu.streams``) and the same code runs, which is
how the tests check it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.core.connector import Rows, TorchPagedConnector, Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.xpu.streams import Stream, StreamAPI


@dataclass
class _Lane:
    """One direction's transfer stream and staging buffers (stores and loads each own one)."""

    stream: Stream
    staging: torch.Tensor | None = None  # one layer of a batch
    whole: torch.Tensor | None = None  # whole objects of a batch (loads only)

    @property
    def nbytes(self) -> int:
        return sum(
            b.numel() * b.element_size() for b in (self.staging, self.whole) if b is not None
        )


@dataclass
class _Plan:
    """A batch of transfers, prepared once (slots moved to the device, merged) for all layers.

    ``spans[i]`` is where ``prepared[i]``'s tokens sit in the one-layer staging buffer: its
    valid tokens when storing, all its tokens when loading (``all_tokens``). ``positions`` (load
    only) picks the valid tokens out of that buffer when some slots are -1. ``merged`` is None
    without staging; ``whole`` is set for a whole load that fits ``max_staging_bytes``.
    """

    prepared: list[tuple[Transfer, Rows]]
    merged: Rows | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    positions: torch.Tensor | None = None
    num_tokens: int = 0
    whole: _WholeStaging | None = None


@dataclass
class _WholeStaging:
    """Staging laid out exactly like the memory objects, back to back, so each chunk crosses
    the link in one copy. Row ``base[j] + layer * step[j]`` (rows of ``width`` elements) holds
    row ``j`` of ``layer`` as ``scatter`` takes it (K of every valid token, then V; MLA: the
    latent)."""

    base: torch.Tensor
    step: torch.Tensor
    regions: list[tuple[int, int]]  # (first row, rows) of each prepared transfer's object
    rows: int
    width: int


# Whole-object staging (whole loads) holds a whole batch on the device; past this size the batch
# is moved layer by layer through the one-layer staging buffer instead. Measured on an H200
# (benchmarks/results/xpu-cuda.json): whole-object staging speeds up loads, but slows stores
# (their copies to host could then start only after every layer is gathered), so stores always
# go layer by layer.
DEFAULT_MAX_STAGING_BYTES = 256 << 20


class XPUPagedConnector(TorchPagedConnector):
    """Paged KV transfers on an XPU (or, for tests, CPU) cache; see the module docstring."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        *,
        staging_buffer: bool = True,
        max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
    ) -> None:
        super().__init__(kv_caches, layout)
        if max_staging_bytes < 0:
            raise ValueError(f"max_staging_bytes must be >= 0, got {max_staging_bytes}")
        self.streams = StreamAPI(self.device)
        self.use_staging = staging_buffer
        self.max_staging_bytes = max_staging_bytes
        self._store_lane = _Lane(self.streams.new_stream())
        self._load_lane = _Lane(self.streams.new_stream())

    @property
    def staging_nbytes(self) -> int:
        """Device bytes held by the staging buffers (0 until a staged transfer ran, or without)."""
        return self._store_lane.nbytes + self._load_lane.nbytes

    # -- planning ------------------------------------------------------------------------------
    def _plan(self, transfers: Sequence[Transfer], *, all_tokens: bool) -> _Plan:
        prepared = [(t, r) for t in transfers if (r := self._rows(t)).slots.numel()]
        if not self.use_staging or not prepared:
            return _Plan(prepared)
        spans: list[tuple[int, int]] = []
        positions: list[torch.Tensor] = []
        lo = 0
        for t, r in prepared:
            n = t.obj.num_tokens if all_tokens else r.slots.numel()
            spans.append((lo, lo + n))
            if all_tokens:
                rows = r.rows if r.rows is not None else torch.arange(n, device=self.device)
                positions.append(rows + lo)
            lo += n
        merged = Rows(
            torch.cat([r.slots for _, r in prepared]),
            None,
            torch.cat([r.blocks for _, r in prepared]),
            torch.cat([r.offsets for _, r in prepared]),
        )
        partial = all_tokens and any(r.rows is not None for _, r in prepared)
        return _Plan(prepared, merged, spans, torch.cat(positions) if partial else None, lo)

    def _plan_whole(self, plan: _Plan) -> None:
        """Attach whole-object staging to ``plan`` when the batch fits ``max_staging_bytes``."""
        lay = self.layout
        if plan.merged is None:
            return
        width = lay.head_size if lay.use_mla else lay.hidden_size
        halves = 1 if lay.use_mla else 2
        rows_of = [halves * lay.num_layers * t.obj.num_tokens for t, _ in plan.prepared]
        if sum(rows_of) * width * lay.torch_dtype.itemsize > self.max_staging_bytes:
            return
        bases: list[list[torch.Tensor]] = [[] for _ in range(halves)]
        steps, regions, first = [], [], 0
        for (t, r), rows in zip(plan.prepared, rows_of, strict=True):
            n = t.obj.num_tokens
            valid = r.rows if r.rows is not None else torch.arange(n, device=self.device)
            for kv in range(halves):
                bases[kv].append(first + kv * lay.num_layers * n + valid)
            steps.append(torch.full_like(valid, n))
            regions.append((first, rows))
            first += rows
        plan.whole = _WholeStaging(
            torch.cat([b for kv in bases for b in kv]),
            torch.cat(steps).repeat(halves),
            regions,
            first,
            width,
        )

    def _whole_view(self, w: _WholeStaging) -> torch.Tensor:
        """``[rows, width]`` of the whole-object staging buffer (allocated on the load stream)."""
        numel = w.rows * w.width
        lane = self._load_lane
        buf = lane.whole
        if buf is None or buf.numel() < numel:
            buf = lane.whole = torch.empty(numel, dtype=self.copy_dtype, device=self.device)
        return buf[:numel].view(w.rows, w.width)

    def _object_rows(self, transfer: Transfer, w: _WholeStaging) -> torch.Tensor:
        return transfer.obj.tensor.view(self.copy_dtype).view(-1, w.width)

    def _staging_view(self, lane: _Lane, num_tokens: int) -> torch.Tensor:
        """``[2, num_tokens, h*d]`` (MLA ``[num_tokens, latent]``) of ``lane``'s staging buffer.

        Called on the lane's stream, so the buffer belongs to it in the caching allocator.
        """
        lay = self.layout
        shape = (num_tokens, lay.head_size) if lay.use_mla else (2, num_tokens, lay.hidden_size)
        numel = math.prod(shape)
        buf = lane.staging
        if buf is None or buf.numel() < numel:
            buf = lane.staging = torch.empty(numel, dtype=self.copy_dtype, device=self.device)
        return buf[:numel].view(shape)

    # -- copies between host and device -------------------------------------------------------
    def _halves(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts of a layer slice that are contiguous in a memory object (K and V for MHA)."""
        return (t,) if self.layout.use_mla else (t[0], t[1])

    def _copy_to_host(
        self, dst: torch.Tensor, rows: torch.Tensor | None, src: torch.Tensor
    ) -> None:
        if rows is not None:
            # Scattering into some rows of a host tensor is a host op: core's path brings the
            # values over with a copy synchronous with the (transfer) stream first.
            super()._copy_to_host(dst, rows, src)
            return
        for d, s in zip(self._halves(dst), self._halves(src), strict=True):
            d.copy_(s, non_blocking=True)

    def _copy_into_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for d, s in zip(self._halves(dst), self._halves(src), strict=True):
            d.copy_(s, non_blocking=True)

    def _copy_to_device(self, src: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        self._copy_into_device(out, src)
        if rows is not None:
            out = out.index_select(self._token_dim(), rows)
        return out

    def _gather_into(self, layer: int, r: Rows, out: torch.Tensor) -> None:
        lay = self.layout
        if lay.paged_layout in (PagedLayout.FLASH_NHD, PagedLayout.MLA):
            # Core's gather for these layouts is one index_select over the paged view: run it
            # straight into the staging buffer.
            torch.index_select(self._views[layer][0], self._token_dim(), r.slots, out=out)
        else:
            # Advanced indexing (block-first, CPU layouts) allocates its result; one on-device
            # copy into the buffer is cheap next to the host copies.
            out.copy_(self.gather(layer, r))

    # -- per layer -----------------------------------------------------------------------------
    def _store_planned(self, layer: int, plan: _Plan) -> None:
        if plan.merged is None:
            self._store_layer(layer, plan.prepared)
            return
        buf = self._staging_view(self._store_lane, plan.num_tokens)
        self._gather_into(layer, plan.merged, buf)
        dim = self._token_dim()
        for (t, r), (lo, hi) in zip(plan.prepared, plan.spans, strict=True):
            self._copy_to_host(self.host_layer(t.obj, layer), r.rows, buf.narrow(dim, lo, hi - lo))

    def _load_planned(self, layer: int, plan: _Plan) -> None:
        if plan.merged is None:
            self._load_layer(layer, plan.prepared)
            return
        buf = self._staging_view(self._load_lane, plan.num_tokens)
        dim = self._token_dim()
        for (t, _), (lo, hi) in zip(plan.prepared, plan.spans, strict=True):
            self._copy_into_device(buf.narrow(dim, lo, hi - lo), self.host_layer(t.obj, layer))
        values = buf if plan.positions is None else buf.index_select(dim, plan.positions)
        self.scatter(layer, plan.merged, values)

    def _whole_load(self, plan: _Plan, layers: Sequence[int]) -> None:
        assert plan.whole is not None and plan.merged is not None
        w = plan.whole
        buf = self._whole_view(w)
        for (t, _), (first, rows) in zip(plan.prepared, w.regions, strict=True):
            buf[first : first + rows].copy_(self._object_rows(t, w), non_blocking=True)
        shape = (-1, w.width) if self.layout.use_mla else (2, -1, w.width)
        for layer in layers:
            values = buf.index_select(0, w.base + layer * w.step).view(shape)
            self.scatter(layer, plan.merged, values)

    # -- the moves, on the lanes' streams ------------------------------------------------------
    def _run_store(
        self, transfers: Sequence[Transfer], layers: Sequence[int], layerwise: bool
    ) -> Iterator[int]:
        compute = self.streams.current_stream()
        stream = self._store_lane.stream
        try:
            with self.streams.use(stream):
                plan = self._plan(transfers, all_tokens=False)
            for layer in layers:
                # The engine wrote this layer before asking (layer-wise: just before this step).
                stream.wait_stream(compute)
                with self.streams.use(stream):
                    self._store_planned(layer, plan)
                    captured = stream.record_event()
                if layerwise:
                    # The engine may overwrite the layer once the gather has read it.
                    compute.wait_event(captured)
                    yield layer
        finally:
            # The caller reads (or, on failure, frees) the host objects next.
            stream.synchronize()

    def _run_load(
        self, transfers: Sequence[Transfer], layers: Sequence[int], layerwise: bool
    ) -> Iterator[int]:
        compute = self.streams.current_stream()
        stream = self._load_lane.stream
        try:
            # The engine's earlier work on the destination blocks comes first.
            stream.wait_stream(compute)
            with self.streams.use(stream):
                plan = self._plan(transfers, all_tokens=True)
                if not layerwise:
                    # Nothing waits on single layers: one copy per chunk, then every layer.
                    self._plan_whole(plan)
                if plan.whole is not None:
                    self._whole_load(plan, layers)
            for layer in layers if plan.whole is None else ():
                with self.streams.use(stream):
                    self._load_planned(layer, plan)
                    landed = stream.record_event()
                if layerwise:
                    compute.wait_event(landed)
                    yield layer
        finally:
            # The caller releases the host objects next; pending copies still read them. (This
            # also orders whatever the engine issues after a whole load returns.)
            stream.synchronize()

    def store(self, transfers: Sequence[Transfer]) -> None:
        for _ in self._run_store(transfers, range(self.layout.num_layers), layerwise=False):
            pass

    def load(self, transfers: Sequence[Transfer]) -> None:
        for _ in self._run_load(transfers, range(self.layout.num_layers), layerwise=False):
            pass

    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        return self._run_store(transfers, range(self.layout.num_layers), layerwise=True)

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        return self._run_load(transfers, range(self.layout.num_layers), layerwise=True)

    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        for _ in self._run_store(transfers, (layer,), layerwise=False):
            pass

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        for _ in self._run_load(transfers, (layer,), layerwise=False):
            pass
