"""The XPU page mover: core's torch page copy (``TorchPageMover``) on transfer streams, with
whole chunks staged on the device in the host objects' layout.

What this adds to the reference (whose page views and ``gather``/``scatter`` it reuses):

- **Transfer streams.** Every gather, scatter and copy is issued on a side stream of the cache's
  device, one for stores and one for loads, so copies overlap the engine's compute. A call first
  makes its stream wait for the calling thread's current stream (a layer-wise store waits again
  before each layer: the engine computes the next layer between two steps); a layer-wise load
  step makes the engine's stream wait for an event recorded after that layer's scatter, so
  attention reads the layer once it landed, without blocking the host.
- **Whole chunks staged in the objects' layout** (``store``, ``load``). A host object is
  block-major (``[blocks, layers, page]``): one object is contiguous, one layer of it is not.
  So a whole transfer stages its chunks on the device laid out exactly like their objects,
  back to back, and each object crosses the link in one ``non_blocking`` copy (one per run of
  consecutive blocks where some are -1). Where every layer's pages sit at one stride in one
  storage (vLLM's one buffer per cache group, every layout) the batch's pages of every layer
  are gathered or scattered in one indexing op over a stacked ``[blocks, layers, page]`` view;
  elsewhere one op per layer.
- **Layer by layer.** One layer's pages are strided in the host objects. A layer-wise load
  whose batch fits the bound below stages it like a whole load (one copy per chunk, before
  layer 0), then scatters one layer per step. A layer-wise store step (and ``store_layer``,
  ``load_layer``, and a layer-wise load over the bound) gathers or scatters the layer of every
  chunk in one op and moves it in one synchronous copy through host memory, packed or
  unpacked there: a store step returns with the layer in the objects, as the contract asks.
- **Bounded staging** (``max_staging_bytes``, default 256 MiB). A batch whose chunks need more
  device staging than this moves in groups of chunks that fit (a chunk larger than the bound
  alone): a whole transfer stages one group at a time, a layer step through host memory moves
  one group at a time.
- **Staging memory** (``staging_buffer``, config ``device_staging_buffer``): True keeps each
  direction's whole-chunk buffer between calls, grown on demand (``staging_nbytes``); False
  allocates it per call and drops it on return. The data path is the same.
- **Host waits.** A call returns (a layer-wise generator finishes, or is closed early) only
  after its stream is done: the caller reads the stored objects, or releases the loaded ones,
  next.

Threads (``PageMover``'s contract): one store and one load may be in flight at once, from two
threads. Each direction has its own stream and staging buffer (a ``_Lane``), so neither waits
for the other's copies and no lock is taken; two stores (or two loads) at once are the caller's
to serialise. On CPU tensors the streams are no-ops (``kvtier.xpu.streams``) and the same code
runs, which is how the tests check it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvtier.core.layout import KVLayout
from kvtier.core.platform.mover import Picked, TorchPageMover, Transfer
from kvtier.xpu.streams import Stream, StreamAPI

# Device staging a store or load may use at once; past it a batch moves in groups of chunks.
DEFAULT_MAX_STAGING_BYTES = 256 << 20


@dataclass
class _Lane:
    """One direction's transfer stream and staging buffer (stores and loads each own one)."""

    stream: Stream
    buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


@dataclass(frozen=True)
class _Group:
    """Chunks staged together: ``items[i]``'s moved blocks are staging rows ``starts[i]`` on,
    in object order; ``picked`` holds every one of them, in staging order."""

    items: list[tuple[Transfer, Picked]]
    starts: list[int]
    picked: Picked

    @property
    def num_blocks(self) -> int:
        return int(self.picked.blocks.numel())


def _row_runs(p: Picked) -> list[tuple[int, int, int]]:
    """``(object row, staging row, count)`` of each run of consecutive moved blocks."""
    count = int(p.blocks.numel())
    if p.rows is None:
        return [(0, 0, count)]
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(p.rows.tolist()):
        if runs and runs[-1][0] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, i, 1))
    return runs


class XPUPageMover(TorchPageMover):
    """Page transfers on an XPU (or, for tests, CPU) cache; see the module docstring."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        num_blocks: int | None = None,
        *,
        staging_buffer: bool = True,
        max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
    ) -> None:
        if max_staging_bytes < 0:
            raise ValueError(f"max_staging_bytes must be >= 0, got {max_staging_bytes}")
        super().__init__(kv_caches, layout, num_blocks)
        self.streams = StreamAPI(self.device)
        self.use_staging = staging_buffer
        self.max_staging_bytes = max_staging_bytes
        self._store_lane = _Lane(self.streams.new_stream())
        self._load_lane = _Lane(self.streams.new_stream())

    @property
    def staging_nbytes(self) -> int:
        """Device bytes the staging buffers hold between calls (0 before the first transfer,
        and always 0 with ``staging_buffer=False``)."""
        return self._store_lane.nbytes + self._load_lane.nbytes

    def _group_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.layout.num_layers * self.layout.page_bytes

    def _groups(self, picked: Sequence[tuple[Transfer, Picked]]) -> list[_Group]:
        """The live transfers in staging groups of at most ``max_staging_bytes`` each."""
        groups: list[_Group] = []
        items: list[tuple[Transfer, Picked]] = []
        blocks = 0
        for t, p in picked:
            n = int(p.blocks.numel())
            if not n:
                continue
            if items and self._group_bytes(blocks + n) > self.max_staging_bytes:
                groups.append(self._group(items))
                items, blocks = [], 0
            items.append((t, p))
            blocks += n
        if items:
            groups.append(self._group(items))
        return groups

    @staticmethod
    def _group(items: list[tuple[Transfer, Picked]]) -> _Group:
        starts, at = [], 0
        for _, p in items:
            starts.append(at)
            at += int(p.blocks.numel())
        blocks = torch.cat([p.blocks for _, p in items])
        return _Group(items, starts, Picked(blocks, None))

    # -- staging -------------------------------------------------------------------------------
    def _stage(self, lane: _Lane, num_blocks: int) -> torch.Tensor:
        """``[num_blocks, layers, page]`` of ``lane``'s buffer, grown if needed. Called on the
        lane's stream, so the buffer belongs to it in the caching allocator."""
        numel = self._group_bytes(num_blocks)
        if lane.buffer is None or lane.buffer.numel() < numel:
            lane.buffer = None
            lane.buffer = torch.empty(numel, dtype=torch.uint8, device=self.device)
        return lane.buffer[:numel].view(num_blocks, self.layout.num_layers, -1)

    def _to_host(self, group: _Group, stage: torch.Tensor) -> None:
        for (t, p), start in zip(group.items, group.starts, strict=True):
            for row, at, n in _row_runs(p):
                src = stage[start + at : start + at + n]
                t.obj.tensor[row : row + n].copy_(src, non_blocking=True)

    def _to_device(self, group: _Group, stage: torch.Tensor) -> None:
        for (t, p), start in zip(group.items, group.starts, strict=True):
            for row, at, n in _row_runs(p):
                src = t.obj.tensor[row : row + n]
                stage[start + at : start + at + n].copy_(src, non_blocking=True)

    def _gather_all(self, group: _Group, stage: torch.Tensor) -> None:
        """Every layer of the group's pages into ``stage``."""
        if self.stacked is None:
            for layer in range(self.layout.num_layers):
                stage[:, layer].copy_(self.gather(layer, group.picked))
            return
        out = self.words(stage).view(group.num_blocks, *self.stacked.shape[1:])
        torch.index_select(self.stacked, 0, group.picked.blocks, out=out)

    def _scatter_all(self, group: _Group, stage: torch.Tensor) -> None:
        """Every layer of ``stage`` into the group's pages."""
        if self.stacked is None:
            for layer in range(self.layout.num_layers):
                self.scatter(layer, group.picked, stage[:, layer])
            return
        values = self.words(stage).view(group.num_blocks, *self.stacked.shape[1:])
        self.stacked.index_copy_(0, group.picked.blocks, values)

    @contextlib.contextmanager
    def _lane(self, lane: _Lane) -> Iterator[Stream]:
        """Orders ``lane``'s stream after the calling thread's current stream (yielded); on exit
        waits for the lane's copies and drops a per-call buffer. The lane's stream is *not* made
        current here: a generator must not leave it current across its yields."""
        compute = self.streams.current_stream()
        lane.stream.wait_stream(compute)
        try:
            yield compute
        finally:
            # The caller reads (or, on failure, frees) the host objects next.
            lane.stream.synchronize()
            if not self.use_staging:
                lane.buffer = None

    def _pick_all(self, transfers: Sequence[Transfer]) -> list[tuple[Transfer, Picked]]:
        # Every transfer is checked before anything moves: bad input copies nothing.
        return [(t, self._pick(t)) for t in transfers]

    # -- the moves, on the lanes' streams ------------------------------------------------------
    def store(self, transfers: Sequence[Transfer]) -> None:
        lane = self._store_lane
        with self._lane(lane):
            with self.streams.use(lane.stream):
                groups = self._groups(self._pick_all(transfers))
            for group in groups:
                with self.streams.use(lane.stream):
                    stage = self._stage(lane, group.num_blocks)
                    self._gather_all(group, stage)
                    self._to_host(group, stage)

    def load(self, transfers: Sequence[Transfer]) -> None:
        lane = self._load_lane
        with self._lane(lane):
            with self.streams.use(lane.stream):
                groups = self._groups(self._pick_all(transfers))
            for group in groups:
                with self.streams.use(lane.stream):
                    stage = self._stage(lane, group.num_blocks)
                    self._to_device(group, stage)
                    self._scatter_all(group, stage)

    def _store_layer_of(self, layer: int, groups: Sequence[_Group]) -> None:
        """One layer of every group into the host objects (the host holds it on return)."""
        for group in groups:
            host = self.gather(layer, group.picked).cpu()  # waits for the stream
            for (t, p), start in zip(group.items, group.starts, strict=True):
                for row, at, n in _row_runs(p):
                    t.obj.tensor[row : row + n, layer].copy_(host[start + at : start + at + n])

    def _load_layer_of(self, layer: int, groups: Sequence[_Group]) -> None:
        """One layer of every group from the host objects into the cache."""
        for group in groups:
            host = torch.cat(
                [
                    t.obj.tensor[row : row + n, layer]
                    for t, p in group.items
                    for row, _, n in _row_runs(p)
                ]
            )
            # A synchronous copy: ``host`` is a temporary.
            self.scatter(layer, group.picked, host.to(self.device))

    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        lane = self._store_lane
        with self._lane(lane) as compute:
            with self.streams.use(lane.stream):
                groups = self._groups(self._pick_all(transfers))
            for layer in range(self.layout.num_layers):
                # The engine wrote this layer just before this step.
                lane.stream.wait_stream(compute)
                with self.streams.use(lane.stream):
                    self._store_layer_of(layer, groups)
                yield layer

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        lane = self._load_lane
        with self._lane(lane) as compute:
            with self.streams.use(lane.stream):
                groups = self._groups(self._pick_all(transfers))
            stage = None
            if len(groups) == 1:
                # The batch fits the bound: every object crosses in one copy before layer 0.
                with self.streams.use(lane.stream):
                    stage = self._stage(lane, groups[0].num_blocks)
                    self._to_device(groups[0], stage)
            for layer in range(self.layout.num_layers):
                with self.streams.use(lane.stream):
                    if stage is None:
                        self._load_layer_of(layer, groups)
                    else:
                        self.scatter(layer, groups[0].picked, stage[:, layer])
                # Attention reads the layer only once it has landed.
                compute.wait_event(lane.stream.record_event())
                yield layer

    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        lane = self._store_lane
        with self._lane(lane), self.streams.use(lane.stream):
            self._store_layer_of(layer, self._groups(self._pick_all(transfers)))

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        lane = self._load_lane
        with self._lane(lane), self.streams.use(lane.stream):
            self._load_layer_of(layer, self._groups(self._pick_all(transfers)))
