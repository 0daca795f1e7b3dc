"""The CUDA device connector: Triton gathers/scatters on the GPU, copy engines move the bytes.

Why this shape: a kernel that writes straight into pinned host memory ("zero-copy") reached
0.84 of PCIe in one direction on an H200 and gained nothing when stores and loads ran at once,
because zero-copy traffic does not go through the copy engines. So by default (``mode="dma"``)
a store gathers a chunk's scattered paged rows into a ring of device staging slots (two of
32 MiB) and the copy engine DMAs each slot to the pinned host object while the next slot is
gathered; a load runs the same pipeline backwards (DMA into a slot, scatter from it). Stores and
loads each have their own pair of streams and their own ring, so both directions run at once
(PCIe is full duplex). ``mode="zerocopy"`` keeps the one-kernel path for comparison.

Host time is the other budget: a small model's 2 MiB chunk crosses PCIe in under 40 us, about
what one Triton launch plus a few stream operations cost in Python. So pieces are large (one
launch, and one DMA per contiguous host range, per 32 MiB), the kernel reads runs of rows (one
table entry per chunk, never a host-expanded row table), a call is prepared in groups so its
first DMA starts early (a lone load's first DMA even before the call is checked), and
``store_and_load_async`` lets one thread keep both directions busy,
interleaving their steps. A store's table reaches the GPU without queueing behind loads on the
copy engine (see ``_TableSlot``).

Streams and events (CUDA):

- Every call first records an event on the caller's current stream (the engine's compute
  stream) and its own streams wait on it: a store reads the KV the forward pass wrote, a load
  writes blocks only after the engine's earlier use of them.
- The compute stream is never made to wait for PCIe by ``store``. ``store_layerwise`` makes it
  wait (on the device, not the host) only for the on-device gather of each layer, so the engine
  may overwrite that layer as soon as the generator yields; if PCIe falls more than the staging
  ring behind, that gather waits for a free slot rather than losing data.
- ``load`` returns once the KV is in the cache. ``load_layerwise`` enqueues every layer at the
  first ``next()`` and, before yielding layer ``i``, makes the compute stream wait on layer
  ``i``'s event: attention on layer ``i`` runs as soon as that layer has landed, while later layers
  are still in flight.
- Whole-call methods (``store``, ``load``, ``store_layer``, ``load_layer``) return after the host
  has waited for their copies: the host objects may then be read, written to disk or released.
  The generators do the same when exhausted or closed; the ``*_async`` methods return a
  ``PendingTransfer`` whose ``wait()`` does it.

Slots: ``-1`` skips a token in both directions (a store leaves that row of the object as it was,
which in ``dma`` mode costs a host-to-device copy of the chunk into its staging slot first). Slot
tensors may live on the host (no synchronisation) or on the GPU (one blocking read to validate
them, which waits for the work that produced them). A slot past the cache is an error, never a
write outside it.

On a CPU device (tests under ``TRITON_INTERPRET=1``) the same plans run synchronously.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.core.connector import DeviceConnector, Transfer
from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.cuda import _native
from kvtier.cuda._driver import CudaDriver, CUDADriverError, OpBatch, RawEvent, driver
from kvtier.cuda._env import switch
from kvtier.cuda.kernels import (
    LAUNCHES,
    RUN_WORDS,
    WORDS_ALIGN,
    RowGeometry,
    copy_runs,
    word_bytes_for,
)

MODES = ("dma", "zerocopy")
_DEFAULT_SLOTS = 2
_DEFAULT_SLOT_BYTES = 32 << 20
# A whole-call store's first piece: small, so the first DMA starts after a short gather.
_FIRST_PIECE_BYTES = 4 << 20
# A whole-chunk load's last piece: small, so the scatter after the last DMA is short.
_LAST_PIECE_BYTES = 4 << 20
# A whole-chunk call's first group of transfers (see ``_groups``): the host checks and plans
# only this much before the first DMA can start; later groups are prepared while it runs.
_FIRST_GROUP_BYTES = 8 << 20
# Each later group's cap, as a multiple of the previous one's: for stores and for both
# directions of store_and_load_async, and for a lone load (see ``_groups``).
_GROUP_GROWTH = 2
_LOAD_GROUP_GROWTH = 4
# How long a call handed to another thread's issuer may wait before it starts (see _issue).
_HANDOFF_TIMEOUT_S = 120.0
# Table buffers per lane (driver path): batches of runs that may be in flight at once.
_TABLE_RING = 8
# Per thread: the devices whose CUDA context the thread has current (see _Lane.bind_context).
_BOUND = threading.local()
# The slot tensor of a batch planned in C (its slots are in the table buffer already).
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


def _nothing() -> None:
    pass


@dataclass(slots=True)
class _Prepared:
    """One transfer, checked: where its bytes live and where its slots sit on the device."""

    transfer: Transfer
    obj: torch.Tensor  # the memory object's tensor (contiguous, on the host)
    host_ptr: int
    storage: int  # identifies the object's buffer: adjacent objects of one buffer merge into one DMA
    num_tokens: int
    row_bytes: int  # one row: num_tokens * kv_heads * head_size * itemsize
    slot_index: int  # element offset of this transfer's slots in the call's slot tensor
    has_holes: bool
    empty: bool  # every slot is -1: nothing to move


@dataclass(slots=True)
class _Copy:
    """A contiguous host byte range and where it sits in a staging slot.

    The range starts ``obj_offset`` bytes into ``obj`` and may run on into the objects after it
    when they are adjacent in the same storage (one arena), so one DMA moves them all.
    """

    obj: torch.Tensor | None  # None from the C planner (the driver path needs addresses only)
    storage: int  # ``obj``'s buffer (see ``_Prepared.storage``)
    obj_offset: int
    host_ptr: int  # absolute address of the first byte
    slot_offset: int
    nbytes: int

    def host_view(self) -> torch.Tensor:
        assert self.obj is not None
        start = self.obj.storage_offset() * self.obj.element_size() + self.obj_offset
        t = torch.empty(0, dtype=torch.uint8)
        return t.set_(self.obj.untyped_storage(), start, (self.nbytes,), (1,))


@dataclass(slots=True)
class _Piece:
    """Runs ``[start, stop)`` of the call's run table: one kernel launch, one staging slot."""

    start: int
    stop: int
    max_tokens: int
    slot: int
    max_rows: int = 0  # the most rows one of its runs holds (the launch grid's second axis)
    cap: int = 0  # bytes of its slot this piece may fill
    nbytes: int = 0
    prefill: bool = False
    copies: list[_Copy] = field(default_factory=list)
    layers_done: list[int] = field(default_factory=list)


class _Unit:
    """The generators of one call (``_issue``): stepped by whichever thread issues, with their
    results or first error kept for the calling thread."""

    __slots__ = ("done", "error", "gens", "results", "retry")

    def __init__(self, gens: list[Generator[None, None, Any]]) -> None:
        self.gens: list[Generator[None, None, Any] | None] = list(gens)
        self.results: list[Any] = [None] * len(gens)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.retry = False  # handed back unstarted: the calling thread issues it itself

    def fail(self, error: BaseException) -> None:
        """Keep the first error; close (drain) the unit's other calls."""
        self.error = error
        for i, gen in enumerate(self.gens):
            if gen is not None:
                self.gens[i] = None
                with contextlib.suppress(BaseException):  # the first error is the one reported
                    gen.close()

    def finished(self) -> bool:
        return all(gen is None for gen in self.gens)

    def result(self) -> list[Any]:
        if self.error is not None:
            raise self.error
        return self.results


def _same_copies(a: _Piece, b: _Piece) -> bool:
    """Whether two load pieces fill the same staging slot with the same host bytes."""
    return a.slot == b.slot and [(c.host_ptr, c.slot_offset, c.nbytes) for c in a.copies] == [
        (c.host_ptr, c.slot_offset, c.nbytes) for c in b.copies
    ]


@dataclass(slots=True)
class _CallState:
    """Driver-path state shared by the batches of one whole-chunk call (``_call_steps``)."""

    ordered: bool = False  # ks already follows the caller's stream
    # The calling thread's current stream (raw handle), read when the call was made: another
    # thread may issue the call's steps (see CUDAPagedConnector._issue). None: read it then.
    caller_stream: int | None = None
    # A load's first piece, DMA'd before the call was checked or planned (``_eager_piece``):
    # its first batch issues no DMA of its own for a first piece that matches it.
    eager: _Piece | None = None
    # A load batch's last scatter, issued only after the next batch's first DMA: streams may
    # share a hardware queue, and a DMA submitted after a scatter that waits for the previous
    # DMA would wait for that scatter too (~35 us per batch on an H200).
    pending: list[Callable[[Any], None]] = field(default_factory=list)  # called with the step's driver


@dataclass(slots=True)
class _TableSlot:
    """One table buffer of a lane's ring (driver path): a call's slots, then its run table.

    Written in pinned host memory, read by the kernels from a device copy ``dev``. A load lane
    makes the copy with a small kernel reading the pinned buffer in place (``copy_words``, ~10 us
    more host time a batch than a copy), and so does a store lane while a load DMA of its
    connector is in flight; otherwise a store's copy goes on the copy engine. A host-to-device
    copy that waits for anything queues behind every host-to-device copy already on the copy
    engine, whatever its stream (measured on an H200: a 64 KiB copy issued just after a 32 MiB
    one ended with it, ~600 us later), so a store's table would wait for the loads in flight,
    and a load's for its own call's DMAs, holding its scatters back (``_driver_steps``).
    (Gathers reading the table in place instead measured slower: each row re-reads its
    chunk's slots across PCIe.)
    """

    done: Any  # RawEvent recorded after the last kernel reading this table
    host: torch.Tensor | None = None  # pinned; keeps host_np's memory alive
    host_np: np.ndarray | None = None
    dev: torch.Tensor | None = None
    host_ptr: int = 0
    host_read_ptr: int = 0  # where a kernel reads ``host`` in place
    dev_ptr: int = 0

    def ensure(self, numel: int, drv: CudaDriver, device: torch.device, keep: int = 0) -> None:
        """At least ``numel`` int64s (rounded up to ``WORDS_ALIGN``) on both sides; the first
        ``keep`` host values survive."""
        if self.host is not None and self.host.numel() >= numel:
            return
        size = -(-max(numel, 1 << 12) // WORDS_ALIGN) * WORDS_ALIGN
        old = self.host_np
        host = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self.host, self.host_np, self.host_ptr = host, host.numpy(), host.data_ptr()
        self.host_read_ptr = drv.host_device_pointer(self.host_ptr)
        self.dev = torch.empty(size, dtype=torch.int64, device=device)
        self.dev_ptr = self.dev.data_ptr()
        if keep and old is not None:
            self.host_np[:keep] = old[:keep]


class _Lane:
    """One direction's streams and staging ring.

    Every slot has two events: ``filled`` (the producer side is done writing it) and ``free``
    (the consumer side is done reading it). Reusing a slot waits on ``free`` on the device, so
    callers interleaving on one lane stay correct; the lock only keeps the ring position and
    the Python-side bookkeeping consistent while a plan is enqueued.
    """

    def __init__(
        self, device: torch.device, num_slots: int, slot_bytes: int, *, use_driver: bool
    ) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.lock = threading.RLock()  # a whole-chunk call holds it across its batches
        self.next_slot = 0
        # This lane's kernels, launched directly with their parameters bound (LAUNCHES.launch).
        self.launch_cache: dict[tuple, Any] = {}
        self.slots: list[torch.Tensor] = []
        self.slot_ptrs: list[int] = []  # the slots' addresses (read once)
        # The driver path (see kvtier.cuda._driver): raw events and stream handles, no stream
        # switches for copies. None: torch events, set_stream and Tensor.copy_.
        self.drv: CudaDriver | None = None
        # The driver path's calls of one step, issued by one C call (kvtier.cuda._driver.OpBatch);
        # None: each through ctypes. Set by the connector when its host module is compiled.
        self.ops: OpBatch | None = None
        if self.is_cuda:
            self.kernel_stream = torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)
            self.drv = driver() if use_driver else None
            self.ks_h = self.kernel_stream.cuda_stream
            self.cs_h = self.copy_stream.cuda_stream
            self.filled: list[Any] = [self._event() for _ in range(num_slots)]
            self.free: list[Any] = [self._event() for _ in range(num_slots)]
            # A pinned buffer reused for each call's table upload (pin_memory() costs
            # ~10 us a call) and the event after the copy that last read it.
            self.upload_host: torch.Tensor | None = None
            self.upload_done: Any = None if self.drv is not None else torch.cuda.Event()
            self.after: Any = self._event()  # ordering after the caller's stream, per call
            # Driver path: a ring of table buffers (device + pinned host), one per batch of
            # rows enqueued; see table_buffers.
            self.tables: list[_TableSlot] = (
                [_TableSlot(RawEvent(self.drv)) for _ in range(_TABLE_RING)] if self.drv is not None else []
            )
            self.next_table = 0

    def _event(self) -> Any:
        """A fresh event of the lane's kind (raw driver event, or torch's)."""
        return RawEvent(self.drv) if self.drv is not None else torch.cuda.Event()

    def pinned_upload(self, parts: tuple[torch.Tensor, ...], numel: int) -> torch.Tensor:
        """``parts`` (host int64) back to back in pinned memory; the caller copies it to the device
        on the current stream and then records ``upload_done`` there.

        The lane's buffer is reused only once the copy that last read it has finished (an event
        query, never a wait); otherwise a fresh one replaces it (the caching host allocator keeps
        the old one until its copy is done)."""
        host = self.upload_host
        if host is None or host.numel() < numel or not self.upload_done.query():
            host = torch.empty(max(numel, 1 << 12), dtype=torch.int64, pin_memory=True)
            self.upload_host = host
        out = host[:numel]
        torch.cat(parts, out=out)
        return out

    def table_buffers(self, numel: int) -> _TableSlot:
        """Driver path: the next table slot of the ring, holding at least ``numel`` int64s of
        pinned host memory.

        The caller records the slot's ``done`` event on ks after the last kernel that reads the
        table. Reusing a slot waits
        for that event on the host: with ``_TABLE_RING`` slots its last user is that many
        batches back, normally long finished; when the host runs further ahead of the GPU
        than that, this wait is the back-pressure. (torch's allocators do not see driver
        copies, so these buffers are owned here and never freed under a live copy.)
        """
        assert self.drv is not None
        self.bind_context()
        slot = self.tables[self.next_table]
        self.next_table = (self.next_table + 1) % len(self.tables)
        slot.done.synchronize()
        slot.ensure(numel, self.drv, self.device)
        return slot

    def dma_in_flight(self) -> bool:
        """Driver path: whether a DMA this lane issued may still be running (event queries)."""
        return not all(e.query() for e in self.filled)

    def busy(self) -> bool:
        """Driver path: whether work this lane enqueued may still be running: a slot still being
        filled or not yet freed (event queries, never a wait)."""
        return self.dma_in_flight() or not all(e.query() for e in self.free)

    def bind_context(self) -> None:
        """Make sure this thread has the device's CUDA context current before driver calls (a
        thread's first CUDA runtime call binds it; remembered per thread and device, so only a
        thread's first call pays for the device switch and the check)."""
        bound = getattr(_BOUND, "devices", None)
        if bound is None:
            bound = _BOUND.devices = set()
        if self.device.index in bound:
            return
        assert self.drv is not None
        with _OnDevice(self.device.index):
            if not self.drv.has_context():
                torch.cuda.current_stream(self.device).query()
                if not self.drv.has_context():
                    raise CUDADriverError(f"no CUDA context is current on this thread for {self.device}")
        bound.add(self.device.index)

    def ensure_slots(self, nbytes: int) -> None:
        """Allocate the ring on first use; grow it (after draining) for a row larger than a slot."""
        if self.slots and nbytes <= self.slot_bytes:
            return
        if self.slots:
            self.synchronize()
        self.slot_bytes = max(self.slot_bytes, nbytes)
        with torch.cuda.stream(self.kernel_stream) if self.is_cuda else contextlib.nullcontext():
            self.slots = [
                torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                for _ in range(self.num_slots)
            ]
        if self.is_cuda:
            for s in self.slots:
                s.record_stream(self.copy_stream)
        self.slot_ptrs = [s.data_ptr() for s in self.slots]

    def synchronize(self) -> None:
        if self.is_cuda:
            self.kernel_stream.synchronize()
            self.copy_stream.synchronize()


class _OnDevice:
    """Makes device ``index`` current for a block and gives the caller its own back afterwards
    (``set_device`` only when they differ, so the common single-GPU case costs ~1 us)."""

    __slots__ = ("index", "prev")

    def __init__(self, index: int) -> None:
        self.index = index
        self.prev = index

    def __enter__(self) -> None:
        self.prev = torch.cuda.current_device()
        if self.prev != self.index:
            torch.cuda.set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.prev != self.index:
            torch.cuda.set_device(self.prev)


def _torch_raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# The caller's current stream as a raw handle: torch's private accessor costs ~0.3 us where
# ``torch.cuda.current_stream()`` builds a Stream object (~3-9 us on a busy host); the public
# call is the fallback where the private one is missing.
_get_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", _torch_raw_stream)


def _raw_current_stream(device: torch.device) -> int:
    """The raw handle of the current stream on ``device`` (a CUDA device with an index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _get_raw_stream(index)


def _current_waits(device: torch.device, event: Any) -> None:
    """The caller's current stream on ``device`` waits (on the device) for ``event``."""
    if isinstance(event, RawEvent):
        event.wait_on(_raw_current_stream(device))
    else:
        torch.cuda.current_stream(device).wait_event(event)


class PendingTransfer:
    """A transfer in flight (``store_async``/``load_async``). Call ``wait()`` exactly when the
    result is needed; it is idempotent.

    ``wait()`` blocks the host until the copies are done (the host objects may then be read,
    written or released) and, for a load, also orders the caller's current stream after it.
    """

    __slots__ = ("_done", "_keep", "_load_device")

    def __init__(self, done: Any, keep: list[torch.Tensor], load_device: torch.device | None) -> None:
        self._done = done  # a torch.cuda.Event or a RawEvent; None when nothing was enqueued
        self._keep = keep  # device tensors the enqueued work reads; freed after the wait
        self._load_device = load_device

    def done(self) -> bool:
        """Whether the copies have finished (never blocks)."""
        return self._done is None or self._done.query()

    def wait(self) -> None:
        if self._done is None:
            return
        if self._load_device is not None:
            _current_waits(self._load_device, self._done)
        self._done.synchronize()
        self._done = None
        self._keep = []


class CUDAPagedConnector(DeviceConnector):
    """Moves chunks between a CUDA paged KV cache and pinned host objects (see module doc).

    Options: ``mode`` (``"dma"``, default, or ``"zerocopy"``), ``staging_slots`` (ring length,
    default 2) and ``staging_slot_bytes`` (default 32 MiB; grown to fit one row if needed). The
    ring costs ``2 * staging_slots * staging_slot_bytes`` of device memory (store + load).
    ``use_driver_api=False`` issues the ``dma`` mode's copies and events through torch (stream
    switches) instead of the CUDA driver (``kvtier.cuda._driver``): same bytes, more host time.
    ``combine_calls`` (default True): whole-chunk calls made at once from several threads are
    issued by one of them (``_issue``). ``first_group_bytes`` (default 8 MiB; twice that for a
    lone load and for each direction of ``store_and_load_async``) is how much of a whole-chunk
    call is checked and planned before its first DMA (see ``_groups``); 0 prepares the whole
    call first.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        *,
        mode: str = "dma",
        staging_slots: int = _DEFAULT_SLOTS,
        staging_slot_bytes: int = _DEFAULT_SLOT_BYTES,
        use_driver_api: bool = True,
        first_group_bytes: int = _FIRST_GROUP_BYTES,
        combine_calls: bool = True,
    ) -> None:
        super().__init__(kv_caches, layout)
        if mode not in MODES:
            raise ValueError(f"CUDAPagedConnector mode must be one of {MODES}, got {mode!r}")
        if not isinstance(staging_slots, int) or staging_slots < 2:
            raise ValueError(f"staging_slots must be an int >= 2 (double buffering), got {staging_slots!r}")
        if not isinstance(staging_slot_bytes, int) or staging_slot_bytes <= 0:
            raise ValueError(f"staging_slot_bytes must be a positive int, got {staging_slot_bytes!r}")
        if not isinstance(first_group_bytes, int) or first_group_bytes < 0:
            raise ValueError(f"first_group_bytes must be an int >= 0, got {first_group_bytes!r}")
        self._first_group_bytes = first_group_bytes
        # A whole-chunk load's first DMA starts before the call is checked (_eager_piece).
        self._eager_load = True
        # store_and_load_async (see there): which direction's steps go first ("load" or "store"),
        # whether the load's first DMA starts before its first group is planned, and the store's
        # first group (0: twice first_group_bytes, as the load's; the default: first_group_bytes).
        # Measured with benchmarks/transfer_both_ab.py.
        self._both_lead = "store"
        self._both_eager = True
        self._both_store_first_bytes = first_group_bytes
        # A whole-chunk call made while its lane still has work in flight is prepared as one
        # group (see _call_steps).
        self._whole_when_busy = True
        # A load's table goes up by a kernel, not on the copy engine (see _driver_steps).
        self._load_table_by_kernel = True
        # A call on a busy lane skips the short first and last pieces (see _call_steps).
        self._busy_whole_pieces = True
        if layout.paged_layout is PagedLayout.VLLM_CPU:
            raise LayoutError("the CUDA connector does not handle the vllm_cpu paged layout")
        self.mode = mode
        device = self.device
        for cache in self.kv_caches:
            if cache.device != device:
                raise LayoutError(f"every KV tensor must be on {device}, one is on {cache.device}")
        self._itemsize = layout.torch_dtype.itemsize
        self._rows_per_obj = layout.num_layers * (1 if layout.use_mla else 2)
        self._bases, self._geo_bytes = self._row_bases()
        # The kernel finds row r's paged base at bases[r] (see kvtier.cuda._triton_kernels).
        self._bases_dev = torch.tensor(self._bases, dtype=torch.int64, device=device)
        self._hd_bytes = layout.hidden_size * self._itemsize
        self._token_bytes = self._hd_bytes * self._rows_per_obj  # one token of a chunk's object
        self._chunk_shapes: dict[int, tuple[int, ...]] = {}
        self._dma_geometry = self._geometry(())
        use_driver = use_driver_api and mode == "dma"
        self._store_lane = _Lane(device, staging_slots, staging_slot_bytes, use_driver=use_driver)
        self._load_lane = _Lane(device, staging_slots, staging_slot_bytes, use_driver=use_driver)
        # The driver path checks and plans ordinary whole-chunk groups in C (_native_plan).
        self._native = _native.load() if self._store_lane.drv is not None else None
        # It can also issue each step's driver calls in one C call (OpBatch) instead of one ctypes
        # call each: same calls, same order. Off unless KVTIER_CUDA_NATIVE_OPS=1: on H200 hosts
        # it cut a call's host time by 2-12% (small model, both at once, 16 chunks: 308 -> 283 us)
        # but no transfer got faster: in four A/B runs (benchmarks/transfer_ops_ab.py) a lone
        # store per call measured 0.00-0.08 of the one-way limit slower (a load 0.00-0.02; why
        # is not understood yet), both at once and streams the same.
        self._native_ops = False
        if self._native is not None and hasattr(self._native, "run_ops"):
            drv = self._store_lane.drv
            assert drv is not None
            self._native.set_driver(*drv.entry_points())
            for lane in (self._store_lane, self._load_lane):
                lane.ops = OpBatch(drv, self._native.run_ops)
            self._native_ops = switch("KVTIER_CUDA_NATIVE_OPS", default=False)
        if not isinstance(combine_calls, bool):
            raise ValueError(f"combine_calls must be a bool, got {combine_calls!r}")
        # One thread issues the whole-chunk calls made at once from several threads (_issue): on
        # the driver path and on CPU; the torch stream path orders a call after the issuing
        # thread's stream, so there each thread issues its own.
        self._combine = combine_calls and (device.type != "cuda" or self._store_lane.drv is not None)
        self._issue_lock = threading.Lock()
        self._issuing = False
        self._mailbox: list[_Unit] = []

    # -- geometry ---------------------------------------------------------------------------
    def _row_bases(self) -> tuple[list[int], tuple[int, int, int]]:
        """Paged base address of each object row, and (block, token, kv) strides in bytes.

        Strides come from the tensors, so a permuted view (e.g. ``[2, nb, ...]`` over a
        block-first allocation) works as long as one token's ``heads * head_size`` is contiguous.
        """
        lay = self.layout
        es = self._itemsize
        dims = {
            PagedLayout.FLASH_NHD: (1, 2, 0),
            PagedLayout.FLASH_BLOCK_FIRST: (0, 2, 1),
            PagedLayout.MLA: (0, 1, None),
        }[lay.paged_layout]
        block_dim, token_dim, kv_dim = dims
        strides: tuple[int, int, int] | None = None
        k_bases: list[int] = []
        v_bases: list[int] = []
        for layer, cache in enumerate(self.kv_caches):
            inner = cache.stride()[token_dim + 1 :]
            sizes = cache.shape[token_dim + 1 :]
            expect, contiguous = 1, True
            for size, stride in zip(reversed(sizes), reversed(inner), strict=True):
                if size > 1 and stride != expect:
                    contiguous = False
                expect *= size
            if not contiguous:
                raise LayoutError(
                    f"layer {layer}: KV tensor strides {cache.stride()} do not keep one token's "
                    f"heads * head_size contiguous; the CUDA connector cannot copy it"
                )
            st = (
                cache.stride(block_dim) * es,
                cache.stride(token_dim) * es,
                cache.stride(kv_dim) * es if kv_dim is not None else 0,
            )
            if strides is None:
                strides = st
            elif st != strides:
                raise LayoutError(
                    f"layer {layer}: KV tensor strides {cache.stride()} differ from layer 0's; "
                    "every layer must share one geometry"
                )
            k_bases.append(cache.data_ptr())
            v_bases.append(cache.data_ptr() + st[2])
        assert strides is not None
        bases = k_bases if lay.use_mla else k_bases + v_bases
        return bases, strides

    def _geometry(self, extra_addresses: Iterable[int]) -> RowGeometry:
        lay = self.layout
        block_b, token_b, _ = self._geo_bytes
        hd_bytes = lay.hidden_size * self._itemsize
        w = word_bytes_for(hd_bytes, block_b, token_b, *self._bases, *extra_addresses)
        return RowGeometry(
            word_bytes=w,
            hd_words=hd_bytes // w,
            block_size=lay.block_size,
            block_stride_words=block_b // w,
            token_stride_words=token_b // w,
            total_slots=self.num_blocks * lay.block_size,
        )

    # -- preparing a call ---------------------------------------------------------------------
    def _prepare(
        self, transfers: Sequence[Transfer], first_index: int = 0, slot_out: _TableSlot | None = None
    ) -> tuple[list[_Prepared], torch.Tensor]:
        """Validate every transfer; return them with one int64 slot tensor for the whole call.

        The slot tensor stays on the host (``slot_out``, when given, receives it at the start of
        its pinned buffer: the driver path's table buffer, so the slots need no further host
        copy before the upload); it travels to the device with the run table. Checks run once over the
        concatenated slots (a call may hold hundreds of chunks).

        Per-transfer work here is host time on every call's critical path (a small model moves a
        2 MiB chunk in ~40 us): a memory object's shape and dtype are read from its meta (its
        tensor is a contiguous view of a host arena by construction, see kvtier.core.memory).
        """
        lay = self.layout
        dtype = lay.torch_dtype
        shapes = self._chunk_shapes
        hd_bytes = self._hd_bytes
        check_pinned = self.mode == "zerocopy" and self.device.type == "cuda"
        int64 = torch.int64
        host_slots: list[torch.Tensor] = []
        prepared: list[_Prepared] = []
        start = 0
        for i, t in enumerate(transfers):
            mobj = t.obj
            meta = mobj.meta
            n = meta.num_tokens
            shape = shapes.get(n)
            if shape is None:
                shape = shapes[n] = lay.chunk_shape(n)
            if meta.shape != shape or meta.dtype != dtype:
                raise LayoutError(
                    f"transfer {i + first_index}: memory object {meta.shape} {meta.dtype} does not match the "
                    f"layout's chunk {shape} {dtype}"
                )
            obj = mobj.tensor  # raises if the handle was released
            sl = t.slots
            if sl.dtype != int64 or not sl.is_cpu:
                sl = sl.to(device="cpu", dtype=int64)
            host_slots.append(sl)
            prepared.append(
                _Prepared(t, obj, obj.data_ptr(), id(mobj.arena), n, n * hd_bytes, start, False, n == 0)
            )
            start += n
        if slot_out is not None:
            assert slot_out.host is not None and slot_out.host_np is not None
            slot_tensor = slot_out.host[:start]
            if host_slots:
                torch.cat(host_slots, out=slot_tensor)
            values = slot_out.host_np[:start]
        else:
            slot_tensor = torch.cat(host_slots) if host_slots else torch.empty(0, dtype=int64)
            values = slot_tensor.numpy()
        total = self.num_blocks * lay.block_size
        # One reduction: as unsigned, -1 and every negative value are larger than any slot.
        if not (start and int(values.view(np.uint64).max()) < total):
            # Not the common case (no -1, nothing out of range, checked in two reductions).
            empties, holes = self._slot_ranges(values, [p.num_tokens for p in prepared], total, first_index)
            for p, empty, has_holes in zip(prepared, empties, holes, strict=True):
                p.empty = empty
                p.has_holes = has_holes
        if check_pinned:
            for i, p in enumerate(prepared):
                if not p.empty and not p.obj.is_pinned():
                    raise ValueError(
                        f"transfer {i + first_index}: mode='zerocopy' needs memory objects in pinned host memory"
                    )
        return prepared, slot_tensor

    @staticmethod
    def _slot_ranges(
        values: np.ndarray, lengths: list[int], total: int, first_index: int = 0
    ) -> tuple[list[bool], list[bool]]:
        """Per transfer: whether it has no slot at all (every one -1) and whether it has a -1.
        Raises IndexError naming the first transfer with a slot outside ``[-1, total)``."""
        starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
        counts = np.asarray(lengths, dtype=np.int64)
        lows = np.full(len(lengths), -1, dtype=np.int64)
        highs = np.full(len(lengths), -1, dtype=np.int64)
        if values.size:
            nonempty = counts > 0
            lows[nonempty] = np.minimum.reduceat(values, starts[nonempty])
            highs[nonempty] = np.maximum.reduceat(values, starts[nonempty])
            bad = np.flatnonzero((lows < -1) | (highs >= total))
            if bad.size:
                i = int(bad[0])
                raise IndexError(
                    f"transfer {i + first_index}: slot values must be -1 or in [0, {total}), got "
                    f"[{lows[i]}, {highs[i]}]"
                )
        return (highs < 0).tolist(), (lows < 0).tolist()

    def _native_plan(
        self, lane: _Lane, transfers: Sequence[Transfer], lo: int, hi: int, ring: _TableSlot, *,
        first_piece_bytes: int | None, last_piece_bytes: int | None,
    ) -> tuple[list[_Piece], int, int] | None:
        """``_prepare`` + ``_plan`` of whole-chunk group ``transfers[lo:hi]`` in C (see
        ``kvtier.cuda._native``): the slots and then the run table written into ``ring``'s host
        buffer; returns the pieces, the slot count and the table's length in int64s, or None
        (nothing of the lane changed) for anything but the ordinary case, which the Python path
        then checks and plans (a -1 or out-of-range slot, a released or empty object, a
        mismatched shape or dtype, slots that are not contiguous int64 on the host, ...).

        On an H200 host the Python path costs ~40 us a group of 8 small chunks; this, a few."""
        native = self._native
        if native is None or not lane.slot_ptrs or ring.host is None:
            return None
        out = native.plan_group(
            transfers, lo, hi, self._chunk_shapes, self.layout.torch_dtype, torch.int64, self._hd_bytes,
            self._rows_per_obj, self.num_blocks * self.layout.block_size, ring.host_ptr, ring.host.numel(),
            lane.slot_bytes, lane.slot_ptrs, lane.next_slot, ring.dev_ptr, first_piece_bytes or 0,
            last_piece_bytes or 0,
        )
        if out is None:
            return None
        next_slot, tokens, runs, raw = out
        lane.next_slot = next_slot
        pieces = [
            _Piece(start=start, stop=stop, max_tokens=max_tokens, slot=slot, max_rows=max_rows, cap=cap,
                   nbytes=nbytes, copies=[_Copy(None, 0, 0, ptr, offset, n) for ptr, offset, n in copies])
            for slot, start, stop, max_rows, max_tokens, cap, nbytes, copies in raw
        ]
        return pieces, tokens, tokens + RUN_WORDS * runs

    # -- planning ---------------------------------------------------------------------------
    def _plan(
        self,
        lane: _Lane,
        prepared: Sequence[_Prepared],
        segments: Iterable[tuple[int, int, int, int, int]],
        *,
        store: bool,
        slot_base: int = 0,
        first_piece_bytes: int | None = None,
        last_piece_bytes: int | None = None,
    ) -> tuple[list[_Piece], list[tuple[int, ...]]]:
        """Pack row segments into pieces; return them and the run table (``RUN_WORDS`` ints a
        run, see kvtier.cuda._triton_kernels). ``slot_base``: the address the call's slot tensor
        will have on the device (0 when not known yet: the caller adds it to column 5).

        A segment ``(transfer, start, stop, step, layer)`` is the object rows
        ``range(start, stop, step)`` of one transfer; ``layer`` (or -1) tags the segments of one
        layer so the piece that finishes it can be marked. A segment becomes one run unless a
        piece boundary splits it. ``first_piece_bytes`` caps the first piece (a store's first
        gather is then short, so its first DMA starts early); ``last_piece_bytes`` makes the
        last piece about that small (a load's last scatter, which nothing overlaps, is then
        short). Called with ``lane.lock`` held: it claims ring slots in order. In ``zerocopy``
        mode rows point straight at their host object and one piece holds the whole call.
        """
        zero_copy = self.mode == "zerocopy"
        segs = [sg for sg in segments if not prepared[sg[0]].empty]
        if not segs:
            return [], []
        runs: list[tuple[int, ...]] = []
        pieces: list[_Piece] = []
        last_piece_of_layer: dict[int, _Piece] = {}
        piece: _Piece | None = None
        if zero_copy:
            whole = piece = _Piece(start=0, stop=0, max_tokens=0, slot=-1)
            pieces.append(whole)
            for i, start, stop, step, layer in segs:
                p = prepared[i]
                rb = p.row_bytes
                k = len(range(start, stop, step))
                runs.append((start, step, k, p.host_ptr + start * rb, step * rb,
                             slot_base + 8 * p.slot_index, p.num_tokens, 0))
                whole.max_rows = max(whole.max_rows, k)
                whole.max_tokens = max(whole.max_tokens, p.num_tokens)
                if layer >= 0:
                    last_piece_of_layer[layer] = whole
        else:
            lane.ensure_slots(max(prepared[sg[0]].row_bytes for sg in segs))
            slot_bytes = lane.slot_bytes
            left_bytes = (
                sum(prepared[sg[0]].row_bytes * len(range(sg[1], sg[2], sg[3])) for sg in segs)
                if last_piece_bytes else 0
            )
            slot_ptrs = lane.slot_ptrs
            # The current piece's state lives in locals (this loop runs once per chunk per call):
            # bytes used, capacity, its slot's address, its last host range.
            used = cap = base = 0
            last: _Copy | None = None
            for i, start, stop, step, layer in segs:
                p = prepared[i]
                rb, n = p.row_bytes, p.num_tokens
                slot_list = slot_base + 8 * p.slot_index
                host_ptr, storage = p.host_ptr, p.storage
                r = start
                left = (stop - start + step - 1) // step
                while left:
                    fit = (cap - used) // rb
                    if fit == 0:
                        cap = slot_bytes
                        if not pieces and first_piece_bytes:
                            cap = min(cap, max(first_piece_bytes, rb))
                        elif last_piece_bytes and last_piece_bytes < left_bytes <= cap + last_piece_bytes:
                            # What is left fits this piece and a short last one.
                            cap = max(left_bytes - last_piece_bytes, rb)
                        if piece is not None:
                            piece.stop = len(runs)
                            piece.nbytes = used
                        piece = _Piece(start=len(runs), stop=len(runs), max_tokens=0, slot=lane.next_slot, cap=cap)
                        lane.next_slot = (lane.next_slot + 1) % lane.num_slots
                        pieces.append(piece)
                        used, base, last = 0, slot_ptrs[piece.slot], None
                        fit = cap // rb
                    assert piece is not None
                    k = fit if fit < left else left
                    runs.append((r, step, k, base + used, rb, slot_list, n, 0))
                    # The rows' host ranges, merged with the previous one when adjacent in one
                    # buffer (objects carved back to back from one arena move in one DMA).
                    for j in range(1 if step == 1 else k):
                        nbytes = k * rb if step == 1 else rb
                        offset = (r + j * step) * rb
                        addr = host_ptr + offset
                        if last is not None and last.host_ptr + last.nbytes == addr and last.storage == storage:
                            last.nbytes += nbytes
                        else:
                            last = _Copy(p.obj, storage, offset, addr, used, nbytes)
                            piece.copies.append(last)
                        used += nbytes
                    if store and p.has_holes:
                        piece.prefill = True
                    if k > piece.max_rows:
                        piece.max_rows = k
                    if n > piece.max_tokens:
                        piece.max_tokens = n
                    left_bytes -= k * rb
                    r += k * step
                    left -= k
                if layer >= 0 and piece is not None:
                    last_piece_of_layer[layer] = piece
            if piece is not None:
                piece.nbytes = used
        assert piece is not None
        piece.stop = len(runs)
        for layer, pc in last_piece_of_layer.items():
            pc.layers_done.append(layer)
        return pieces, runs

    def _table(self, runs: list[tuple[int, ...]], slot_base: int) -> torch.Tensor:
        """The run table as a host tensor (torch and CPU paths), slot lists at ``slot_base``."""
        table = torch.tensor(runs, dtype=torch.int64).view(-1, RUN_WORDS)
        table[:, 5] += slot_base
        return table

    # -- enqueueing ---------------------------------------------------------------------------
    def _enqueue(
        self,
        lane: _Lane,
        prepared: Sequence[_Prepared],
        rows: Iterable[tuple[int, int, int, int, int]],
        slots: torch.Tensor,
        keep: list[torch.Tensor],
        *,
        store: bool,
        layer_events: dict[int, Any] | None = None,
        first_piece_bytes: int | None = None,
    ) -> Any:
        """Plan and enqueue one batch of rows (all of ``_enqueue_steps`` at once)."""
        return self._run_steps(self._enqueue_steps(
            lane, prepared, rows, slots, keep, store=store, layer_events=layer_events,
            first_piece_bytes=first_piece_bytes,
        ))

    def _enqueue_steps(
        self,
        lane: _Lane,
        prepared: Sequence[_Prepared],
        rows: Iterable[tuple[int, int, int, int, int]],
        slots: torch.Tensor,
        keep: list[torch.Tensor],
        *,
        store: bool,
        layer_events: dict[int, Any] | None = None,
        interleaved: bool = False,
        first_piece_bytes: int | None = None,
        state: _CallState | None = None,
        defer_last: bool = False,
        last_piece_bytes: int | None = None,
        ring: _TableSlot | None = None,
        planned: tuple[list[_Piece], int, int] | None = None,
    ) -> Generator[None, None, Any]:
        """Plan and enqueue one batch of rows after the caller's current stream, one piece per
        step (so a store and a load can be interleaved from one thread). ``planned``: the
        driver path's batch already planned into ``ring`` (``_native_plan``).

        Driver path only: ``state`` is shared by the batches of one call (only its first batch
        orders ks after the caller's stream), and ``defer_last`` leaves a load batch's last
        scatter in ``state.pending`` for the next batch to issue after its first DMA (the
        batch then returns None).

        ``slots`` is the call's slot tensor: on the host (uploaded here together with the run
        table, one copy; driver path: ``ring``, when given, is the lane's table buffer that
        ``slots`` already sits at the start of) or already on the device. Returns an event recorded after the batch's
        last device write (store: the last DMA to the host; load: the last scatter into the
        cache), or None on CPU where everything has run on return. Device tensors the batch
        uses are appended to ``keep`` and must outlive it.

        Host cost matters as much as device cost here (a small model's 2 MiB chunk crosses PCIe
        in under 40 us), so streams are switched with ``set_stream`` rather than context
        managers and each piece costs one launch, its DMAs and four event operations.
        Between steps the lane's lock is held and the caller's stream may be anything; the
        caller's stream is current again once the generator has finished or been closed.
        """
        segments = list(rows)
        with lane.lock:
            if lane.is_cuda and lane.drv is not None and self.mode == "dma":
                return (
                    yield from self._driver_steps(
                        lane, prepared, segments, slots, ring,
                        store=store, layer_events=layer_events, interleaved=interleaved,
                        state=state if state is not None else _CallState(), defer_last=defer_last,
                        first_piece_bytes=first_piece_bytes, last_piece_bytes=last_piece_bytes,
                        planned=planned,
                    )
                )
            pieces, runs = self._plan(
                lane, prepared, segments, store=store, first_piece_bytes=first_piece_bytes,
                last_piece_bytes=last_piece_bytes,
            )
            if not pieces:
                return None
            geo = (
                self._dma_geometry
                if self.mode == "dma"
                else self._geometry([p.host_ptr for p in prepared if not p.empty])
            )
            if not lane.is_cuda:
                self._run_sync(lane, pieces, self._table(runs, slots.data_ptr()), geo, store=store)
                return None
            table = self._table(runs, 0)
            ks, cs = lane.kernel_stream, lane.copy_stream
            caller = torch.cuda.current_stream(self.device)
            lane.after.record(caller)
            ks.wait_event(lane.after)
            with _OnDevice(self.device.index):
                torch.cuda.set_stream(ks)
                try:
                    table_dev = self._upload_table(lane, table, slots, keep)
                    if self.mode == "zerocopy":
                        copy_runs(table_dev, pieces[0].max_rows, pieces[0].max_tokens, geo, self._bases_dev,
                                  to_paged=not store)
                        done = torch.cuda.Event()
                        done.record(ks)
                        if layer_events is not None:
                            for layer in pieces[0].layers_done:
                                layer_events[layer] = done
                        return done
                    for piece in pieces:
                        if interleaved:
                            # Otherwise ks is still current: each piece ends with it (~5 us a switch).
                            torch.cuda.set_stream(ks)
                        if store:
                            self._enqueue_store_piece(lane, piece, table_dev, geo)
                        else:
                            self._enqueue_load_piece(lane, piece, table_dev, geo)
                            if layer_events is not None and piece.layers_done:
                                ev = torch.cuda.Event()
                                ev.record(ks)
                                for layer in piece.layers_done:
                                    layer_events[layer] = ev
                        if interleaved:
                            # The other direction's steps run next and read the caller's stream.
                            torch.cuda.set_stream(caller)
                        yield
                    done = torch.cuda.Event()
                    done.record(cs if store else ks)
                    return done
                except BaseException:
                    # Nothing half-enqueued may outlive the call: the objects may be released next.
                    lane.synchronize()
                    raise
                finally:
                    torch.cuda.set_stream(caller)

    def _driver_steps(
        self,
        lane: _Lane,
        prepared: Sequence[_Prepared],
        segments: list[tuple[int, int, int, int, int]],
        slots: torch.Tensor,
        ring: _TableSlot | None,
        *,
        store: bool,
        layer_events: dict[int, Any] | None,
        interleaved: bool,
        state: _CallState,
        defer_last: bool,
        first_piece_bytes: int | None,
        last_piece_bytes: int | None,
        planned: tuple[list[_Piece], int, int] | None = None,
    ) -> Generator[None, None, Any]:
        """``_enqueue_steps`` for ``dma`` mode through the driver (see kvtier.cuda._driver).
        ``planned``: the batch already checked and planned into ``ring`` by ``_native_plan``.

        Every copy, record, wait and (after a configuration's first launch, see
        ``kernels.LAUNCHES``) kernel launch names its stream: torch's current stream is never
        switched, which is most of the host time the torch path spends per piece. The slots and
        the run table go up in one copy from a pinned buffer of the lane's table ring.

        Order of issue: a store sends its table up, then per piece gathers (ks) and DMAs (cs). A
        load issues its first DMA before anything else (it needs neither the table nor the
        caller's stream; a lone load's first batch finds it already issued, see
        ``_eager_piece``), then the table, then per piece the next piece's DMA before this
        piece's scatter, so the copy engine always has the next copy queued.
        """
        drv = lane.drv
        assert drv is not None
        if planned is not None:
            assert ring is not None
            pieces, n_slots, numel = planned
        else:
            on_device = slots.device.type == "cuda"
            n_slots = 0 if on_device else slots.numel()
            if ring is None:
                with _OnDevice(self.device.index):
                    ring = lane.table_buffers(n_slots + RUN_WORDS * (len(segments) + 8))
                if n_slots:
                    ring.host_np[:n_slots] = slots.numpy()  # type: ignore[index]
            assert ring.host is not None
            slot_base = slots.data_ptr() if on_device else ring.dev_ptr
            pieces, runs = self._plan(
                lane, prepared, segments, store=store, slot_base=slot_base,
                first_piece_bytes=first_piece_bytes, last_piece_bytes=last_piece_bytes,
            )
            if not pieces:
                return None
            numel = n_slots + RUN_WORDS * len(runs)
            if ring.host.numel() < numel:  # more runs than the estimate: grow, slots kept
                assert lane.drv is not None
                with _OnDevice(self.device.index):
                    ring.ensure(numel, lane.drv, self.device, keep=n_slots)
                if not on_device:
                    shift = ring.dev_ptr - slot_base
                    runs = [(*r[:5], r[5] + shift, *r[6:]) for r in runs]
            host = ring.host_np
            assert host is not None
            host[n_slots:numel] = [x for run in runs for x in run]
        # Kernels read the table by its raw address: a tensor view per batch costs host time.
        assert ring.dev is not None
        table_dev = (ring.dev, ring.dev_ptr, n_slots)
        ks_h, cs_h = lane.ks_h, lane.cs_h
        geo = self._dma_geometry
        bases = self._bases_dev
        # ``d`` takes this step's driver calls (``_issuer``), flushed before every yield and return.
        d, flush, ops = self._issuer(lane)
        with _OnDevice(self.device.index):
            try:
                if not state.ordered:
                    lane.bind_context()
                    # ks runs after the caller's work so far: a gather reads what the forward pass
                    # wrote, a scatter writes blocks only after the engine's earlier reads of them.
                    # One lane event serves every call: a wait takes its state when enqueued.
                    caller = state.caller_stream
                    d.record(lane.after.handle, caller if caller is not None else _raw_current_stream(self.device))
                    d.wait(ks_h, lane.after.handle)
                    state.ordered = True
                if store:
                    self._drv_table_up(lane, d, ring, numel, by_kernel=self._load_lane.dma_in_flight())
                    flush()  # the table copy starts while the first piece is prepared
                    # A store issues its whole batch in one step: each gather waits on the device
                    # for its slot, so nothing here blocks the host, and a piece left for a later
                    # step would wait for the load's next preparation (H200, small model, both at
                    # once: 3% faster at 16 chunks a call; no change for 8B).
                    for piece in pieces:
                        self._drv_store_piece(lane, d, piece, table_dev, geo, bases)
                        # Issued piece by piece: held to the end of the batch, the first DMA
                        # started later (H200, small model, 16 chunks: a store 0.894-0.900 of
                        # the one-way limit against 0.912-0.917 through ctypes).
                        flush()
                    yield
                    done = RawEvent(drv)
                    d.record(ring.done.handle, ks_h)
                    d.record(done.handle, cs_h)
                    flush()
                    return done
                eager, state.eager = state.eager, None
                if eager is None or not _same_copies(eager, pieces[0]):
                    # (A mismatching eager DMA only wrote a staging slot, which this DMA, later
                    # on the same stream, overwrites: the cost is bandwidth, never bytes.)
                    self._drv_load_dma(lane, d, pieces[0])
                    flush()  # the copy engine starts now, not at the step's end
                for scatter in state.pending:  # the previous batch's last scatter, after our DMA
                    scatter(d)
                state.pending.clear()
                # The table goes up by a kernel reading it in place, not on the copy engine: a
                # copy there that waits for anything (a pending scatter, the caller's stream)
                # runs only after every copy queued by then, so the batch's scatters (and the
                # next call's first DMA, which waits for a scatter to free its slot) waited for
                # all of the call's DMAs (device trace, H200, streamed small loads: 23-42 us idle
                # copy engine a call; benchmarks/transfer_trace.py --stream).
                self._drv_table_up(lane, d, ring, numel, by_kernel=self._load_table_by_kernel)
                for k, piece in enumerate(pieces):
                    last = k + 1 == len(pieces)
                    if not last:
                        self._drv_load_dma(lane, d, pieces[k + 1])
                    scatter = functools.partial(
                        self._drv_scatter, lane, piece=piece, table_dev=table_dev, geo=geo, bases=bases,
                        layer_events=layer_events, table=ring if last else None,
                    )
                    if interleaved:
                        # The other direction's next piece is submitted before this scatter, which
                        # waits for this piece's DMA: on a shared hardware queue it would hold that
                        # piece up until the DMA lands.
                        flush()
                        yield
                    if last and defer_last:
                        state.pending.append(scatter)
                    else:
                        scatter(d)
                    if not interleaved:
                        flush()
                        yield
                if defer_last:
                    flush()
                    return None
                done = RawEvent(drv)
                d.record(done.handle, ks_h)
                flush()
                return done
            except BaseException:
                # Nothing half-enqueued may outlive the call: the objects may be released next.
                if ops is not None:
                    ops.discard()
                lane.synchronize()
                raise

    def _issuer(self, lane: _Lane) -> tuple[Any, Callable[[], None], OpBatch | None]:
        """Where a driver-path step's calls go: ``(d, flush, ops)``. With the op runner on
        (``_native_ops``) ``d`` is the lane's OpBatch and ``flush`` issues what it collected (one C
        call); otherwise ``d`` is the driver (one ctypes call each) and ``flush`` does nothing."""
        ops = lane.ops if self._native_ops else None
        if ops is not None:
            return ops, ops.flush, ops
        assert lane.drv is not None
        return lane.drv, _nothing, None

    @staticmethod
    def _drv_table_up(lane: _Lane, drv: Any, ring: _TableSlot, numel: int, *, by_kernel: bool) -> None:
        """The table's first ``numel`` words to the device, on ks (see _TableSlot); ``drv``: the
        driver or an OpBatch."""
        assert ring.host is not None and ring.dev is not None
        if by_kernel:
            LAUNCHES.copy_words(ring.host, ring.host_read_ptr, ring.dev, numel, stream=lane.kernel_stream,
                                ops=drv if isinstance(drv, OpBatch) else None)
        else:
            drv.memcpy_htod(ring.dev_ptr, ring.host_ptr, 8 * numel, lane.ks_h)

    @staticmethod
    def _drv_store_piece(
        lane: _Lane, drv: Any, piece: _Piece, table_dev: tuple[torch.Tensor, int, int], geo: RowGeometry,
        bases: torch.Tensor,
    ) -> None:
        """Gather into the piece's slot on ks, then DMA it out on cs (``drv``: the driver or an
        OpBatch)."""
        ks_h, cs_h = lane.ks_h, lane.cs_h
        s = piece.slot
        base = lane.slot_ptrs[s]
        filled, free = lane.filled[s].handle, lane.free[s].handle
        # The slot's previous DMA ran on cs; gathering into it must wait for that.
        drv.wait(ks_h, free)
        if piece.prefill:
            # Rows with -1 slots keep the object's bytes: bring them into the slot first so the
            # DMA back writes them unchanged. cs already follows the slot's previous DMA.
            for c in piece.copies:
                drv.memcpy_htod(base + c.slot_offset, c.host_ptr, c.nbytes, cs_h)
            drv.record(filled, cs_h)
            drv.wait(ks_h, filled)
        LAUNCHES.launch(
            *table_dev, piece.start, piece.stop, piece.max_rows, piece.max_tokens, geo, bases,
            to_paged=False, stream=lane.kernel_stream, cache=lane.launch_cache,
            ops=drv if isinstance(drv, OpBatch) else None,
        )
        drv.record(filled, ks_h)
        drv.wait(cs_h, filled)
        for c in piece.copies:
            drv.memcpy_dtoh(c.host_ptr, base + c.slot_offset, c.nbytes, cs_h)
        drv.record(free, cs_h)

    @staticmethod
    def _drv_scatter(
        lane: _Lane, drv: Any, *, piece: _Piece, table_dev: tuple[torch.Tensor, int, int], geo: RowGeometry,
        bases: torch.Tensor, layer_events: dict[int, Any] | None, table: _TableSlot | None,
    ) -> None:
        """Scatter a load piece from its slot once its DMA has landed (ks); ``table``: the
        batch's last piece, after which its table slot may be reused. ``drv``: the driver or an
        OpBatch (given when called: a deferred scatter runs in a later step)."""
        ks_h = lane.ks_h
        s = piece.slot
        drv.wait(ks_h, lane.filled[s].handle)
        LAUNCHES.launch(
            *table_dev, piece.start, piece.stop, piece.max_rows, piece.max_tokens, geo, bases,
            to_paged=True, stream=lane.kernel_stream, cache=lane.launch_cache,
            ops=drv if isinstance(drv, OpBatch) else None,
        )
        drv.record(lane.free[s].handle, ks_h)
        if layer_events is not None and piece.layers_done:
            assert lane.drv is not None
            ev = RawEvent(lane.drv)
            drv.record(ev.handle, ks_h)
            for layer in piece.layers_done:
                layer_events[layer] = ev
        if table is not None:
            drv.record(table.done.handle, ks_h)

    def _flush_pending(self, lane: _Lane, state: _CallState) -> Any:
        """Issue a call's deferred scatter when no later batch did; the event after it."""
        drv = lane.drv
        assert drv is not None
        d, flush, ops = self._issuer(lane)
        with _OnDevice(self.device.index):
            try:
                for scatter in state.pending:
                    scatter(d)
                state.pending.clear()
                done = RawEvent(drv)
                d.record(done.handle, lane.ks_h)
                flush()
            except BaseException:
                if ops is not None:
                    ops.discard()
                raise
            return done

    @staticmethod
    def _drv_load_dma(lane: _Lane, drv: Any, piece: _Piece) -> None:
        """DMA a load piece's host rows into its slot on cs, once the slot's last scatter is done
        (``drv``: the driver or an OpBatch)."""
        cs_h = lane.cs_h
        s = piece.slot
        base = lane.slot_ptrs[s]
        drv.wait(cs_h, lane.free[s].handle)
        for c in piece.copies:
            drv.memcpy_htod(base + c.slot_offset, c.host_ptr, c.nbytes, cs_h)
        drv.record(lane.filled[s].handle, cs_h)

    def _upload_table(
        self, lane: _Lane, table: torch.Tensor, slots: torch.Tensor, keep: list[torch.Tensor]
    ) -> torch.Tensor:
        """The run table on the device (current stream), with slot-list addresses filled in.

        Host slots travel in the same copy as the table: ``[slots..., table...]``.
        """
        if slots.device.type == "cuda":
            table[:, 5] += slots.data_ptr()
            buf = torch.empty(table.numel(), dtype=torch.int64, device=self.device)
            parts: tuple[torch.Tensor, ...] = (table.view(-1),)
            table_at = 0
        else:
            buf = torch.empty(slots.numel() + table.numel(), dtype=torch.int64, device=self.device)
            table[:, 5] += buf.data_ptr()
            parts = (slots, table.view(-1))
            table_at = slots.numel()
        buf.copy_(lane.pinned_upload(parts, buf.numel()), non_blocking=True)
        lane.upload_done.record()
        keep.append(buf)
        return buf[table_at:].view(-1, RUN_WORDS)

    def _enqueue_store_piece(
        self, lane: _Lane, piece: _Piece, table_dev: torch.Tensor, geo: RowGeometry
    ) -> None:
        """Gather into the piece's slot on ks, then DMA it to the host on cs (current: ks)."""
        ks, cs = lane.kernel_stream, lane.copy_stream
        s = piece.slot
        slot = lane.slots[s]
        # The slot's previous DMA ran on cs; gathering into it must wait for that.
        ks.wait_event(lane.free[s])
        if piece.prefill:
            # Rows with -1 slots keep the object's bytes: bring them into the slot first so the
            # DMA back writes them unchanged. cs already follows the slot's previous DMA.
            torch.cuda.set_stream(cs)
            for c in piece.copies:
                slot[c.slot_offset : c.slot_offset + c.nbytes].copy_(c.host_view(), non_blocking=True)
            lane.filled[s].record(cs)
            torch.cuda.set_stream(ks)
            ks.wait_event(lane.filled[s])
        copy_runs(table_dev[piece.start : piece.stop], piece.max_rows, piece.max_tokens, geo, self._bases_dev,
                  to_paged=False)
        lane.filled[s].record(ks)
        cs.wait_event(lane.filled[s])
        torch.cuda.set_stream(cs)
        for c in piece.copies:
            c.host_view().copy_(slot[c.slot_offset : c.slot_offset + c.nbytes], non_blocking=True)
        lane.free[s].record(cs)
        torch.cuda.set_stream(ks)

    def _enqueue_load_piece(
        self, lane: _Lane, piece: _Piece, table_dev: torch.Tensor, geo: RowGeometry
    ) -> None:
        """DMA the host rows into the piece's slot on cs, then scatter on ks (current: ks)."""
        ks, cs = lane.kernel_stream, lane.copy_stream
        s = piece.slot
        slot = lane.slots[s]
        # The slot's previous scatter ran on ks; overwriting it must wait for that.
        cs.wait_event(lane.free[s])
        torch.cuda.set_stream(cs)
        for c in piece.copies:
            slot[c.slot_offset : c.slot_offset + c.nbytes].copy_(c.host_view(), non_blocking=True)
        lane.filled[s].record(cs)
        torch.cuda.set_stream(ks)
        ks.wait_event(lane.filled[s])
        copy_runs(table_dev[piece.start : piece.stop], piece.max_rows, piece.max_tokens, geo, self._bases_dev,
                  to_paged=True)
        lane.free[s].record(ks)

    def _run_sync(
        self, lane: _Lane, pieces: list[_Piece], table: torch.Tensor, geo: RowGeometry, *, store: bool
    ) -> None:
        """The same plan, run in order on a CPU device (the Triton interpreter)."""
        for piece in pieces:
            runs = table[piece.start : piece.stop]
            args = (piece.max_rows, piece.max_tokens, geo, self._bases_dev)
            if self.mode == "zerocopy":
                copy_runs(runs, *args, to_paged=not store)
                continue
            slot = lane.slots[piece.slot]
            if store:
                if piece.prefill:
                    for c in piece.copies:
                        slot[c.slot_offset : c.slot_offset + c.nbytes].copy_(c.host_view())
                copy_runs(runs, *args, to_paged=False)
                for c in piece.copies:
                    c.host_view().copy_(slot[c.slot_offset : c.slot_offset + c.nbytes])
            else:
                for c in piece.copies:
                    slot[c.slot_offset : c.slot_offset + c.nbytes].copy_(c.host_view())
                copy_runs(runs, *args, to_paged=True)

    # -- row orders --------------------------------------------------------------------------
    def _all_rows(self, count: int) -> list[tuple[int, int, int, int, int]]:
        """Object order: each transfer's rows in a row, so its DMA is one contiguous copy."""
        return [(i, 0, self._rows_per_obj, 1, -1) for i in range(count)]

    def _layer_rows(self, count: int, layer: int) -> list[tuple[int, int, int, int, int]]:
        """One layer of every transfer: its K row and its V row (MLA: its one row)."""
        return [(i, layer, self._rows_per_obj, self.layout.num_layers, layer) for i in range(count)]

    def _slots_on_device(self, lane: _Lane, slots: torch.Tensor) -> torch.Tensor:
        """For calls enqueued in several batches: the slot tensor on the device, once."""
        if not lane.is_cuda or slots.numel() == 0:
            return slots
        with torch.cuda.stream(lane.kernel_stream):
            return slots.pin_memory().to(self.device, non_blocking=True)

    @staticmethod
    def _wait(done: Any) -> None:
        if done is not None:
            done.synchronize()

    # -- the DeviceConnector contract --------------------------------------------------------
    def store(self, transfers: Sequence[Transfer]) -> None:
        self.store_async(transfers).wait()

    def load(self, transfers: Sequence[Transfer]) -> None:
        self.load_async(transfers).wait()

    def _eager_piece(self, lane: _Lane, transfers: Sequence[Transfer], *, last: bool) -> _Piece | None:
        """A whole-chunk load's first piece, found before anything is checked or planned, for
        the caller to DMA at once; None when there is nothing to start this way.

        Moving bytes into a staging slot needs no slot, no table and no ordering after the
        engine's stream (only the scatter writes the cache), so the copy engine can start while
        the host checks and plans the call: the first DMA of a 32 MiB load starts ~25 us into
        the call instead of ~58 us (H200 host, small model). A cache hit's load is on the
        engine's critical path, so this is time to first token.

        The piece is whole objects of the call's first group (``transfers``), adjacent ones
        merged, as the planner packs them when told that first piece's size; the group's first
        batch then skips its own first DMA if its plan's first piece is the same
        (``_same_copies``), else it issues it (an empty or malformed object, say) and the eager
        bytes are simply overwritten: the cost of a mismatch is bandwidth, never bytes.
        ``last``: the group is the call's last, so the piece leaves the load's short last piece
        (``_LAST_PIECE_BYTES``) to the plan.
        """
        per_token = self._token_bytes
        sizes: list[int] = []
        for t in transfers:
            meta = t.obj.meta
            nbytes = meta.num_tokens * per_token
            if nbytes == 0 or meta.nbytes != nbytes:
                break
            sizes.append(nbytes)
        total = sum(sizes)
        budget = lane.slot_bytes
        if last and _LAST_PIECE_BYTES < total <= budget + _LAST_PIECE_BYTES:
            budget = total - _LAST_PIECE_BYTES
        lane.ensure_slots(max(sizes, default=0) // self._rows_per_obj)
        piece = _Piece(start=0, stop=0, max_tokens=0, slot=lane.next_slot)
        last_copy: _Copy | None = None
        used = 0
        for t, nbytes in zip(transfers, sizes, strict=False):
            if used + nbytes > budget:
                break
            mobj = t.obj
            obj = mobj.tensor
            addr, storage = obj.data_ptr(), id(mobj.arena)
            if last_copy is not None and last_copy.host_ptr + last_copy.nbytes == addr and last_copy.storage == storage:
                last_copy.nbytes += nbytes
            else:
                last_copy = _Copy(obj, storage, 0, addr, used, nbytes)
                piece.copies.append(last_copy)
            used += nbytes
        if not used:
            return None
        piece.nbytes = used
        return piece

    def _groups(
        self, transfers: Sequence[Transfer], lane: _Lane, *, double_first: bool = False, growth: int | None = None,
        first_bytes: int = 0, whole: bool = False,
    ) -> list[tuple[int, int, int]]:
        """Split a whole-chunk call into runs of transfers ``(lo, hi, tokens)``:
        ``first_group_bytes`` (at most a staging slot) first, then ``growth`` times the previous
        cap each (a transfer larger than the cap is a group of its own). Preparing a group costs
        the host a fraction of its bytes' PCIe time, so a larger group is still ready before the
        previous group's DMAs end, and a call of N bytes costs only log(N) batch overheads.

        How much larger (``_call_steps`` picks; None: ``_GROUP_GROWTH``): a lone load 4x (``_LOAD_GROUP_GROWTH``), a store
        and both directions of ``store_and_load_async`` 2x (``_GROUP_GROWTH``). A group is checked
        and planned in one step, during which the copy engines have only what is already queued
        (in ``store_and_load_async``, the other direction's too), so a larger group can leave
        them idle before it is issued. Measured on an H200 with ``benchmarks/transfer_groups_ab.py``
        (one connector switching settings call by call), 4x -> 2x: small model both at once
        1.538x -> 1.662x the one-way limit at 64 chunks a call (at 16, 16 MiB + 16 MiB either way), 8B
        1.746x -> 1.762x; a small store 0.886 -> 0.901 (16 chunks) and 0.924 -> 0.946 (64); a
        lone load 0.950 -> 0.947 (64 chunks) and 0.977 -> 0.974 (8B), so loads keep 4x.

        ``double_first``: the first group is twice as large, where its preparation does not
        hold the first DMA up alone:

        - ``store_and_load_async``'s load: one thread prepares both directions, so each
          direction's first DMAs must also cover the other direction's preparation; with the
          single-direction size the copy engines sat idle between the first and second groups
          (H200, small model, one connector switching sizes call by call: both at once 1.20x ->
          1.39x the one-way limit at 16 chunks a call, 1.51x -> 1.62x at 64, 8B unchanged).
          Its store, which now goes first, takes ``first_bytes`` (``_both_store_first_bytes``,
          by default ``first_group_bytes``: see ``store_and_load_async``).
        - a lone load with its early first DMA (``_eager_piece``): that DMA starts before the
          group is prepared, and the longer it runs the more of the next group is ready when it
          ends (small model, 16 chunks a call: 0.91-0.93 of the one-way limit with 16 MiB,
          0.84-0.91 with 8 MiB, on two H200s).

        A lone store did not gain from a larger first group. Measured with
        ``benchmarks/transfer_groups_ab.py``.

        ``whole``: one group, the whole call (as ``first_group_bytes=0``)."""
        per_token = self._token_bytes
        if growth is None:
            growth = _GROUP_GROWTH
        groups: list[tuple[int, int, int]] = []
        whole = whole or self._first_group_bytes == 0
        first = first_bytes or self._first_group_bytes * (2 if double_first else 1)
        start, acc, tokens, cap = 0, 0, 0, min(first, lane.slot_bytes)
        for i, t in enumerate(transfers):
            n = t.obj.meta.num_tokens
            nbytes = n * per_token
            if acc and acc + nbytes > cap and not whole:
                groups.append((start, i, tokens))
                start, acc, tokens, cap = i, 0, 0, growth * cap
            acc += nbytes
            tokens += n
        groups.append((start, len(transfers), tokens))
        return groups

    def _call_steps(
        self, lane: _Lane, transfers: Sequence[Transfer], keep: list[torch.Tensor], *, store: bool,
        interleaved: bool = False, caller_stream: int | None = None,
    ) -> Generator[None, None, Any]:
        """A whole-chunk call, group by group (``_groups``): each group is checked, planned and
        enqueued in turn, so the host prepares the next group while the previous one's bytes
        cross PCIe and the first DMA starts after preparing a few MiB, not the whole call.

        Checks therefore run group by group: a call that fails on a later group has already
        run the earlier ones (a load has written some of its slots, a store some of its
        objects). Nothing stays in flight after the error, and the caller treats the whole
        call as failed, as for any error.
        """
        done = None
        state = _CallState(caller_stream=caller_stream)
        with lane.lock:  # held across batches: a deferred scatter's slot must stay ours
            try:
                driver = lane.drv is not None and self.mode == "dma"
                # A load's first DMA starts before anything is checked (_eager_piece); in
                # store_and_load_async (``_both_eager``) it goes right after the store's first batch.
                eager = driver and not store and self._eager_load and (not interleaved or self._both_eager)
                # Groups let a call's first DMA start before the whole call is prepared, which
                # matters when the copy engine is idle. While the lane's earlier calls still keep
                # it busy, preparing this call hides behind their bytes anyway, and each group
                # boundary costs the copy engine a gap: one group then (H200, small model, 8 calls
                # back to back, 2 outstanding, A/B on one connector: loads 0.916 -> 0.936 of the
                # streamed one-way copy at 16 chunks a call and 0.952 -> 0.974 at 64; both at
                # once 1.719 -> 1.764x at 64, unchanged at 16).
                whole = driver and self._whole_when_busy and lane.busy()
                # A short first store piece (its DMA starts early) and a short last load piece
                # (its scatter ends the call soon after the last DMA) pay off on an idle copy
                # engine; on a busy lane the earlier calls' bytes cover both, and each piece
                # boundary costs the engine a gap (7.4 us between a store's DMAs while loads run:
                # transfer_trace.py --stream). A/B on an H200 (transfer_ops_ab.py --knob
                # _busy_whole_pieces, one run): streamed small both at once 1.758x -> 1.768x at 16
                # chunks a call, 1.787x -> 1.789x at 64, 8B unchanged; calls on an idle lane are
                # unaffected.
                caps_off = whole and self._busy_whole_pieces
                groups = self._groups(
                    transfers, lane, double_first=interleaved or eager,
                    growth=_GROUP_GROWTH if store or interleaved else _LOAD_GROUP_GROWTH,
                    first_bytes=self._both_store_first_bytes if store and interleaved else 0, whole=whole,
                )
                first_load_piece = None
                if eager:
                    lo, hi, _ = groups[0]
                    with _OnDevice(self.device.index):
                        lane.bind_context()
                        state.eager = self._eager_piece(lane, transfers[lo:hi], last=len(groups) == 1 and not caps_off)
                        if state.eager is not None:
                            d, flush, _ = self._issuer(lane)
                            self._drv_load_dma(lane, d, state.eager)
                            flush()
                            first_load_piece = state.eager.nbytes
                    if interleaved and state.eager is not None:
                        yield  # the other direction's first batch next, while this DMA runs
                for g, (lo, hi, tokens) in enumerate(groups):
                    ring = planned = None
                    last_group = g + 1 == len(groups)
                    first_piece = (
                        (None if caps_off else _FIRST_PIECE_BYTES) if store else first_load_piece
                    ) if not state.ordered else None
                    last_piece = _LAST_PIECE_BYTES if not store and last_group and not caps_off else None
                    prepared: Sequence[_Prepared] = ()
                    slots = _NO_SLOTS
                    if driver:
                        # The slots land straight in the pinned buffer they are uploaded from.
                        with _OnDevice(self.device.index):
                            ring = lane.table_buffers(tokens + RUN_WORDS * (hi - lo + 8))
                        planned = self._native_plan(
                            lane, transfers, lo, hi, ring, first_piece_bytes=first_piece, last_piece_bytes=last_piece
                        )
                        if planned is None:
                            prepared, slots = self._prepare(transfers[lo:hi], first_index=lo, slot_out=ring)
                    else:
                        prepared, slots = self._prepare(transfers[lo:hi], first_index=lo)
                    rows = self._all_rows(len(prepared))
                    done = (
                        yield from self._enqueue_steps(
                            lane, prepared, rows, slots, keep, store=store, interleaved=interleaved,
                            first_piece_bytes=first_piece, last_piece_bytes=last_piece,
                            state=state, defer_last=not store and not last_group, ring=ring, planned=planned,
                        )
                    ) or done
                if state.pending:  # the batches after the deferring one enqueued nothing
                    done = self._flush_pending(lane, state)
            except BaseException:
                state.pending.clear()
                if lane.is_cuda:
                    lane.synchronize()
                raise
        return done

    @staticmethod
    def _run_steps(steps: Generator[None, None, Any]) -> Any:
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value

    def _caller_stream(self) -> int | None:
        """The calling thread's current stream, for a call another thread may issue (driver path).

        Also binds the device's CUDA context to this thread: a call issued by another thread
        leaves this one with no driver call of its own before ``wait()``, whose event wait
        needs a context (measured: CUDA_ERROR_INVALID_CONTEXT in a fresh thread)."""
        if not (self._combine and self.device.type == "cuda"):
            return None
        self._store_lane.bind_context()
        return _raw_current_stream(self.device)

    def store_async(self, transfers: Sequence[Transfer]) -> PendingTransfer:
        """Enqueue a whole-chunk store after the current stream's work and return at once.

        The objects must stay alive and unread until ``wait()`` returns. One thread can keep a
        store and a load in flight together this way (no second thread, no GIL contention).
        """
        keep: list[torch.Tensor] = []
        (done,) = self._issue([
            self._call_steps(self._store_lane, transfers, keep, store=True, caller_stream=self._caller_stream())
        ])
        return PendingTransfer(done, keep, None)

    def store_and_load_async(
        self, stores: Sequence[Transfer], loads: Sequence[Transfer]
    ) -> tuple[PendingTransfer, PendingTransfer]:
        """A store and a load at once from one thread: their steps are enqueued alternately (a
        store's batch at a time, a load's piece at a time), so both directions' copy engines
        start at once instead of the load waiting for the store's whole enqueue. Returns
        ``(store, load)``; ``wait()`` on each as for the ``*_async`` methods.

        Start-up order (``_both_lead``, ``_both_store_first_bytes``): the store's first batch
        (``first_group_bytes``, 8 MiB by default: planned, gathered, its DMAs queued), then the
        load's first DMA (before its group is checked, ``_eager_piece``), then the store's next
        group, the load's first group planned and scattered, and so on. The store goes first
        because its first DMA needs the most host work (a plan, a table and a gather before
        it); led by the load, the store's first DMA started ~110 us after the load's (device
        trace, ``benchmarks/transfer_trace.py --only both``), and that lag was most of what a
        call lost against two plain copies. The load's copies then end ~25 us later within the
        call, the pair 40-90 us sooner.

        A/B on one connector, every order in every round with the order rotating
        (``benchmarks/transfer_both_ab.py``, H200, three runs, ratios to the one-way limit), load
        leading -> store leading with an 8 MiB first group: small model, one 16-chunk call
        1.536-1.551x -> 1.606-1.615x in two runs (a 4 MiB first group: 1.622-1.629x) and
        1.445x -> 1.445x in the third, 64 chunks 1.684-1.706x -> 1.715-1.750x, 8B 1.778x ->
        1.796x in a run whose plain copy both ways reached 1.82x (1.715x -> 1.702x in one where
        it reached only 1.71x); streams of calls -0.016 to +0.014. (An earlier A/B, before the
        order rotated and on a machine whose plain copy both ways reached only 1.78x, found the
        orders equal: 1.45-1.46x each.) Planning the load's first group before its first DMA was
        slower (1.50-1.53x against 1.58-1.64x with the early DMA), and so was pausing the store
        after its table (1.46-1.60x)."""
        keep_s: list[torch.Tensor] = []
        keep_l: list[torch.Tensor] = []
        caller = self._caller_stream()
        store_steps = self._call_steps(self._store_lane, stores, keep_s, store=True, interleaved=True, caller_stream=caller)
        load_steps = self._call_steps(self._load_lane, loads, keep_l, store=False, interleaved=True, caller_stream=caller)
        if self._both_lead == "store":
            done_s, done_l = self._issue([store_steps, load_steps])
        else:
            done_l, done_s = self._issue([load_steps, store_steps])
        return PendingTransfer(done_s, keep_s, None), PendingTransfer(done_l, keep_l, self.device)

    def load_async(self, transfers: Sequence[Transfer]) -> PendingTransfer:
        """Enqueue a whole-chunk load and return at once; ``wait()`` before attention reads it."""
        keep: list[torch.Tensor] = []
        (done,) = self._issue([
            self._call_steps(self._load_lane, transfers, keep, store=False, caller_stream=self._caller_stream())
        ])
        return PendingTransfer(done, keep, self.device)

    # -- one issuing thread at a time ----------------------------------------------------------
    def _issue(self, gens: list[Generator[None, None, Any]]) -> list[Any]:
        """Run whole-chunk calls' steps (``_call_steps``) to the end; their results in order.

        Calls from several threads at once (vLLM saves from a saver thread while the forward
        thread loads) are issued by one of them: the first becomes the issuer, and a call made
        while it issues is handed to it and stepped in turn with its own (``_Unit``), as
        ``store_and_load_async`` does from one thread. Two threads issuing at once trade the GIL
        at every driver call, so each issues at about half speed (H200, small model, 16 chunks:
        a store and a load from two threads 0.85-0.88x the one-way limit, against 1.40-1.45x
        from one thread). The handing-over thread waits on an event (no GIL) until its call is
        issued, then waits for its copies itself. Each call keeps its own caller's stream order
        (read when the call is made). The issuer returns once every call it took is issued, so
        a call can return a few batches' host time later than it would alone.

        ``combine_calls=False``, and the torch stream path (it orders a call after the stream of
        the thread that issues it), issue every call in its own thread.
        """
        unit = _Unit(gens)
        if not self._combine:
            self._step_units([unit])
            return unit.result()
        with self._issue_lock:
            handed = self._issuing
            if handed:
                self._mailbox.append(unit)
            self._issuing = True
        if handed:
            return self._await_issue(unit, gens)
        units = [unit]
        try:
            while True:
                self._step_units(units)
                with self._issue_lock:
                    if not self._mailbox:
                        self._issuing = False
                        break
                    units = self._mailbox
                    self._mailbox = []
        except BaseException as e:
            # Only an interruption of the loop itself gets here (a call's own error is kept in
            # its unit): calls started here are drained and fail with it, calls not started
            # yet go back to their threads, which issue them.
            for started in units:
                if not started.done.is_set():
                    started.fail(e)
                    started.done.set()
            with self._issue_lock:
                waiting, self._mailbox, self._issuing = self._mailbox, [], False
            for other in waiting:
                other.retry = True
                other.done.set()
            raise
        return unit.result()

    def _await_issue(self, unit: _Unit, gens: list[Generator[None, None, Any]]) -> list[Any]:
        """Wait (bounded) for the issuer to run a handed-over call; issue it here if handed back."""
        deadline = time.monotonic() + _HANDOFF_TIMEOUT_S
        while not unit.done.wait(timeout=1.0):
            if time.monotonic() > deadline:
                with self._issue_lock:
                    if unit in self._mailbox:  # not started: safe to withdraw
                        self._mailbox.remove(unit)
                        for gen in gens:
                            gen.close()
                        raise TimeoutError(
                            f"a transfer call waited {_HANDOFF_TIMEOUT_S:.0f} s for the thread issuing "
                            "another call on this connector; nothing of it was enqueued"
                        )
                # Started: its steps are being issued and end with the call; keep waiting.
        if unit.retry:
            return self._issue(gens)
        return unit.result()

    def _step_units(self, units: list[_Unit]) -> None:
        """Step every call of ``units`` in turn until all are issued, taking calls handed over
        meanwhile (between rounds). A call that raises is closed with the rest of its unit (closing
        drains what they enqueued) and its error kept for its thread."""
        while units:
            for unit in list(units):
                for i, gen in enumerate(unit.gens):
                    if gen is None:
                        continue
                    try:
                        next(gen)
                    except StopIteration as end:
                        unit.results[i] = end.value
                        unit.gens[i] = None
                    except BaseException as e:  # kept for the call's own thread
                        unit.fail(e)
                        break
                if unit.finished():
                    unit.done.set()
                    units.remove(unit)
            if self._mailbox:  # a hint; taken under the lock
                with self._issue_lock:
                    units.extend(self._mailbox)
                    self._mailbox = []

    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self._check_layer(layer)
        prepared, slots = self._prepare(transfers)
        keep: list[torch.Tensor] = []
        rows = self._layer_rows(len(prepared), layer)
        self._wait(self._enqueue(self._store_lane, prepared, rows, slots, keep, store=True))

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self._check_layer(layer)
        prepared, slots = self._prepare(transfers)
        keep: list[torch.Tensor] = []
        rows = self._layer_rows(len(prepared), layer)
        done = self._enqueue(self._load_lane, prepared, rows, slots, keep, store=False)
        PendingTransfer(done, keep, self.device).wait()


    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        """Yield each layer once its gather is ordered before the engine's next write to it.

        Call ``next()`` after the forward pass has written layer ``i`` (on the current stream):
        the layer is captured after that point, and the current stream waits (on the device)
        for the capture before anything later runs. The host waits for the DMAs at exhaustion.
        """
        prepared, slots = self._prepare(transfers)
        lane = self._store_lane
        # Uploaded once for every layer's batch.
        keep = [self._slots_on_device(lane, slots)]
        last: Any = None
        try:
            for layer in range(self.layout.num_layers):
                rows = self._layer_rows(len(prepared), layer)
                last = self._enqueue(lane, prepared, rows, keep[0], keep, store=True) or last
                if lane.is_cuda:
                    gathered = lane._event()
                    if isinstance(gathered, RawEvent):
                        gathered.record(lane.ks_h)
                    else:
                        gathered.record(lane.kernel_stream)
                    _current_waits(self.device, gathered)
                yield layer
        finally:
            # Also on close()/abandonment: the objects must not be released under a live DMA.
            self._wait(last)
            lane.synchronize()

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        """Enqueue every layer at once; yield layer ``i`` once the current stream waits for it."""
        prepared, slots = self._prepare(transfers)
        lane = self._load_lane
        keep: list[torch.Tensor] = []
        layer_events: dict[int, Any] = {}
        rows = [
            seg for layer in range(self.layout.num_layers) for seg in self._layer_rows(len(prepared), layer)
        ]
        done = None
        try:
            done = self._enqueue(
                lane, prepared, rows, slots, keep, store=False, layer_events=layer_events
            )
            current = torch.cuda.current_stream(self.device) if lane.is_cuda else None
            for layer in range(self.layout.num_layers):
                ev = layer_events.get(layer)
                if current is not None and ev is not None:
                    _current_waits(self.device, ev)
                yield layer
        finally:
            self._wait(done)
            lane.synchronize()

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.layout.num_layers})")

    def synchronize(self) -> None:
        """Wait for every copy this connector started, in both directions."""
        self._store_lane.synchronize()
        self._load_lane.synchronize()
