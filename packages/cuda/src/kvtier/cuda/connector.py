"""The CUDA device connector: Triton gathers/scatters on the GPU, copy engines move the bytes.

A store gathers a chunk's scattered paged rows into a ring of device staging slots (two of
32 MiB per direction by default) and the copy engine DMAs each slot to the pinned host object
while the next slot is gathered; a load runs the same pipeline backwards (DMA into a slot,
scatter from it). Stores and loads each have their own pair of streams and their own ring, so
both directions run at once (PCIe is full duplex). Host time is the other budget (a small
model's 2 MiB chunk crosses PCIe in under 40 us): pieces are large, the kernel reads runs of
rows from a table, a call is prepared in groups so its first DMA starts early, and device work
is issued through the CUDA driver on explicit streams.

Where things live: ``plan`` (host planning), ``_native`` (the same planning in C), ``pipeline``
(the store and load pipelines), ``calls`` (a whole-chunk call as groups), ``issuer`` (one
issuing thread), ``lane`` (a direction's streams and executor), ``memory`` (buffers and their
lifetimes), ``kernels`` (launches), ``options`` (``CUDAOptions``).

Streams and events:

- Every call first orders its own streams after the caller's current stream (the engine's
  compute stream): a store reads the KV the forward pass wrote, a load writes blocks only after
  the engine's earlier use of them.
- ``store_layerwise`` makes the compute stream wait (on the device) only for each layer's gather,
  so the engine may overwrite that layer as soon as the generator yields. ``load_layerwise``
  issues every layer at the first ``next()`` and, before yielding layer ``i``, makes the compute
  stream wait on layer ``i``'s event.
- Whole-call methods return after the host has waited for their copies. The ``*_async`` methods
  return a ``PendingTransfer`` whose ``wait()`` does it (an extension: see ``DeviceConnector``).

Slots: ``-1`` skips a token in both directions (a store leaves that row of the object as it was,
which costs a host-to-device copy of the chunk into its staging slot first). Slot tensors may
live on the host or on the GPU (one blocking read to check them). A slot past the cache is an
error, never a write outside it. On a CPU device (tests under ``TRITON_INTERPRET=1``) the same
pipeline runs synchronously.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtier.core.connector import DeviceConnector, Transfer
from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout
from kvtier.cuda import _native
from kvtier.cuda.calls import WholeCalls
from kvtier.cuda.geometry import CallShape, row_bases, row_geometry
from kvtier.cuda.issuer import Issuer
from kvtier.cuda.lane import Lane, raw_current_stream
from kvtier.cuda.options import CUDAOptions
from kvtier.cuda.pipeline import BatchState, Pipeline, run_steps
from kvtier.cuda.plan import Prepared, Segment, layer_rows, prepare


class PendingTransfer:
    """A transfer in flight (``store_async``/``load_async``). ``wait()`` blocks the host until
    the copies are done (the host objects may then be read, written or released) and, for a
    load, also orders the caller's current stream after it; it is idempotent."""

    __slots__ = ("_done", "_load_device")

    def __init__(self, done: Any, load_device: torch.device | None) -> None:
        self._done = done  # an event; None when nothing was issued or all has run
        self._load_device = load_device

    def done(self) -> bool:
        """Whether the copies have finished (never blocks)."""
        return self._done is None or self._done.query()

    def wait(self) -> None:
        if self._done is None:
            return
        if self._load_device is not None and self._load_device.type == "cuda":
            self._done.wait_on(raw_current_stream(self._load_device))
        self._done.synchronize()
        self._done = None


class CUDAPagedConnector(DeviceConnector):
    """Moves chunks between a CUDA paged KV cache and pinned host objects (see module doc).

    Options: ``CUDAOptions`` (``staging_buffer``, ``staging_slots``, ``staging_slot_bytes``,
    ``native_planner``), by keyword."""

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, **options: object
    ) -> None:
        super().__init__(kv_caches, layout)
        self.options = opts = CUDAOptions.from_options(options)
        device = self.device
        for cache in self.kv_caches:
            if cache.device != device:
                raise LayoutError(f"every KV tensor must be on {device}, one is on {cache.device}")
        self._shape = shape = CallShape.of(layout, self.num_blocks)
        bases, strides = row_bases(layout, self.kv_caches)
        # The kernel finds row r's paged base at bases[r] (see kvtier.cuda._triton_kernels).
        self._bases_dev = torch.tensor(bases, dtype=torch.int64, device=device)
        self._store_lane = Lane(device, opts.staging_slots, opts.staging_slot_bytes)
        self._load_lane = Lane(device, opts.staging_slots, opts.staging_slot_bytes)
        self._pipe = Pipeline(
            shape,
            row_geometry(shape, bases, strides),
            self._bases_dev,
            self._store_lane,
            self._load_lane,
        )
        native = _native.load() if opts.native_planner else None
        self._calls = WholeCalls(self._pipe, native, keep_ring=opts.staging_buffer)
        self._issuer = Issuer()

    # -- whole-chunk calls ---------------------------------------------------------------------
    def store(self, transfers: Sequence[Transfer]) -> None:
        self.store_async(transfers).wait()

    def load(self, transfers: Sequence[Transfer]) -> None:
        self.load_async(transfers).wait()

    def _caller_stream(self) -> int | None:
        """The calling thread's current stream, for a call another thread may issue. Also binds
        the device's CUDA context to this thread: ``wait()``'s event wait needs one."""
        if self.device.type != "cuda":
            return None
        self._store_lane.bind_context()
        return raw_current_stream(self.device)

    def store_async(self, transfers: Sequence[Transfer]) -> PendingTransfer:
        """Issue a whole-chunk store after the current stream's work and return at once. The
        objects must stay alive and unread until ``wait()`` returns."""
        (done,) = self._issuer.issue(
            [
                self._calls.steps(
                    self._store_lane, transfers, store=True, caller_stream=self._caller_stream()
                )
            ]
        )
        return PendingTransfer(done, None)

    def load_async(self, transfers: Sequence[Transfer]) -> PendingTransfer:
        """Issue a whole-chunk load and return at once; ``wait()`` before attention reads it."""
        (done,) = self._issuer.issue(
            [
                self._calls.steps(
                    self._load_lane, transfers, store=False, caller_stream=self._caller_stream()
                )
            ]
        )
        return PendingTransfer(done, self.device)

    def store_and_load_async(
        self, stores: Sequence[Transfer], loads: Sequence[Transfer]
    ) -> tuple[PendingTransfer, PendingTransfer]:
        """A store and a load at once from one thread: their steps are issued alternately (a
        store's batch at a time, a load's piece at a time), the store's first batch first (its
        first DMA needs the most host work), then the load's first DMA, so both directions'
        copy engines start at once. Returns ``(store, load)``; ``wait()`` on each."""
        caller = self._caller_stream()
        done_s, done_l = self._issuer.issue(
            [
                self._calls.steps(
                    self._store_lane, stores, store=True, interleaved=True, caller_stream=caller
                ),
                self._calls.steps(
                    self._load_lane, loads, store=False, interleaved=True, caller_stream=caller
                ),
            ]
        )
        return PendingTransfer(done_s, None), PendingTransfer(done_l, self.device)

    # -- layer by layer ------------------------------------------------------------------------
    def _batch(
        self,
        lane: Lane,
        transfers: Sequence[Transfer],
        rows_of: Any,
        *,
        store: bool,
        checked: tuple[list[Prepared], torch.Tensor] | None = None,
        layer_events: dict[int, Any] | None = None,
    ) -> Any:
        """Check ``transfers`` (unless ``checked``), then plan and issue their rows
        ``rows_of(count)`` in one batch; the event after it."""
        prepared, slots = checked if checked is not None else prepare(self._shape, transfers)
        with lane.lock:
            return run_steps(
                self._pipe.batch(
                    lane,
                    prepared,
                    rows_of(len(prepared)),
                    slots,
                    store=store,
                    state=BatchState(),
                    layer_events=layer_events,
                )
            )

    def _call_done(self, lane: Lane) -> None:
        """A layer-by-layer call ended: with ``staging_buffer=False`` its staging ring goes
        (whole-chunk calls release theirs once issued, see ``WholeCalls``)."""
        if not self.options.staging_buffer:
            with lane.lock:
                lane.ring.release()

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.layout.num_layers})")

    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self._check_layer(layer)
        rows = functools.partial(layer_rows, layer=layer, shape=self._shape)
        PendingTransfer(self._batch(self._store_lane, transfers, rows, store=True), None).wait()
        self._call_done(self._store_lane)

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self._check_layer(layer)
        rows = functools.partial(layer_rows, layer=layer, shape=self._shape)
        PendingTransfer(
            self._batch(self._load_lane, transfers, rows, store=False), self.device
        ).wait()
        self._call_done(self._load_lane)

    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        """Yield each layer once its gather is ordered before the engine's next write to it.

        Call ``next()`` after the forward pass has written layer ``i`` (on the current stream):
        the layer is captured after that point, and the current stream waits (on the device)
        for the capture before anything later runs. The host waits for the DMAs at exhaustion.
        """
        lane = self._store_lane
        prepared, slots = prepare(self._shape, transfers)  # checked once, uploaded once
        if lane.is_cuda and slots.numel():
            with torch.cuda.stream(lane.kernel_stream):
                slots = slots.pin_memory().to(self.device, non_blocking=True)
        last: Any = None
        try:
            for layer in range(self.layout.num_layers):
                rows = functools.partial(layer_rows, layer=layer, shape=self._shape)
                last = (
                    self._batch(lane, transfers, rows, store=True, checked=(prepared, slots))
                    or last
                )
                if lane.is_cuda:
                    gathered = lane.new_event()
                    gathered.record(lane.ks_h)
                    gathered.wait_on(raw_current_stream(self.device))
                yield layer
        finally:
            # Also on close()/abandonment: the objects must not be released under a live DMA.
            if last is not None:
                last.synchronize()
            lane.synchronize()
            self._call_done(lane)

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        """Issue every layer at once; yield layer ``i`` once the current stream waits for it."""
        lane = self._load_lane
        layer_events: dict[int, Any] = {}
        shape = self._shape

        def rows(count: int) -> list[Segment]:
            return [
                seg
                for layer in range(shape.layout.num_layers)
                for seg in layer_rows(count, layer, shape)
            ]

        done = None
        try:
            done = self._batch(lane, transfers, rows, store=False, layer_events=layer_events)
            for layer in range(self.layout.num_layers):
                ev = layer_events.get(layer)
                if lane.is_cuda and ev is not None:
                    ev.wait_on(raw_current_stream(self.device))
                yield layer
        finally:
            if done is not None:
                done.synchronize()
            lane.synchronize()
            self._call_done(lane)

    def synchronize(self) -> None:
        """Wait for every copy this connector started, in both directions."""
        self._store_lane.synchronize()
        self._load_lane.synchronize()
