"""Page movers: copy whole pages between an engine's paged KV cache and host memory objects.

The contract (every platform's mover keeps it; ``tests/conformance/test_page_mover.py`` runs the
same checks against every platform, on views built by vLLM's own allocator):

- A mover is built over the engine's per-layer KV views (``[kernel_blocks, H, N, C]``, strides
  per vLLM's layout; ``kvtier.core.platform.pages``) and a ``KVLayout``. It finds each page (one layer's
  one manager block) from the views' strides and copies pages as opaque bytes: it never reads
  a page's interior.
- A ``Transfer`` pairs a memory object (``[blocks, layers, page_bytes]`` uint8, see
  ``KVLayout.chunk_shape``) with one cache block id per object block (kept as a contiguous
  int64 host tensor: ``Transfer`` converts ids given otherwise). A block id of ``-1``
  means "skip this block": on store its pages in the object are left as they are, on load the
  engine's copy is left as it is (the engine already has it).
- ``store``/``load`` return once the bytes are where they were asked to be: after ``store`` the
  host objects may be read or written to disk; after ``load`` attention may read the cache.
- ``store_layerwise``/``load_layerwise`` are generators that yield each layer index once that
  layer is done (load: the layer may be read by attention; store: the layer has been captured
  and the engine may overwrite it). Exhausting the generator completes the transfer. Closing it
  early waits for the copies it issued (the objects may then be released); layers it has not
  yielded may or may not have moved.
- **Bad input** raises and never writes outside the cache or the call's objects: a block id
  below -1 or past the cache, or a layer outside ``[0, num_layers)``, is an ``IndexError``; an
  object whose shape or dtype is not the layout's chunk a ``LayoutError``; a transfer whose
  block count is not its object's, or whose ids are not integers, a ``ValueError``
  (``Transfer`` itself). Other transfers of the
  failed call may have moved; the mover stays usable. KV views whose pages do not match the
  layout are a ``LayoutError`` when the mover is built.
- **Threads.** One store (``store``, ``store_layer``, or a ``store_layerwise`` generator not yet
  exhausted or closed) and one load (likewise) may be in flight at the same time, called from two
  threads (vLLM saves on its saver thread while the forward thread loads): each moves exactly
  its own bytes, as if it ran alone. Their blocks are disjoint (the engine never loads into
  blocks it is saving). Two stores, or two loads, at once are the caller's to serialise.
- **Streams** (accelerators). A call is ordered after the work the calling thread issued on its
  current stream before the call; work issued by another thread must be ordered by the caller
  (an event recorded where the work is handed over).
- **Synchronous.** Every method has done its copies when it returns (a generator: when it
  yields, for that layer).
- **Options** (``Platform.create_mover(kv_caches, layout, **options)``) mean the same on every
  platform. ``staging_buffer`` (bool, default True; config ``device_staging_buffer``) is
  accepted by every platform: True lets the mover keep device staging memory between calls,
  False keeps none between calls; on the CPU platform the cache is host memory and it changes
  nothing. Other options are the platform's own. An unknown option, or a value of the wrong
  type, is a ``TypeError`` naming it; a value out of range a ``ValueError``. ``check_options``
  does these checks for a platform.

``TorchPageMover`` is the torch-generic reference (``index_select``/``index_copy_`` over page
views); it is the CPU platform's mover and the XPU platform builds on it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout
from kvtier.core.memory import MemoryObj
from kvtier.core.platform.pages import PageRuns, block_runs, check_pages, manager_blocks, page_view

#: Options every platform's ``create_mover`` accepts, with their types (see the module doc).
COMMON_OPTIONS: Mapping[str, type] = {"staging_buffer": bool}


def check_options(
    platform: str, options: Mapping[str, object], own: Mapping[str, type] | None = None
) -> dict[str, object]:
    """``options`` checked against ``COMMON_OPTIONS`` and the platform's ``own`` ones (name ->
    type): an unknown name or a value of the wrong type is a ``TypeError`` naming it (a bool is
    not an int here). Returns them as a new dict, for the platform to read."""
    known = {**COMMON_OPTIONS, **(own or {})}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"unknown {platform} mover option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    for name, value in options.items():
        want = known[name]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise TypeError(
                f"{platform} mover option {name} must be a {want.__name__}, got {value!r}"
            )
    return dict(options)


@dataclass(frozen=True)
class Transfer:
    """One chunk to move: a memory object and the cache block of each of its blocks.

    ``blocks`` is held as a contiguous int64 host tensor, so a mover reads the ids in place: ids
    of another integer dtype, stride or device are converted once, here; ids that already are
    one are viewed, not copied: their values may change until a call takes them, while resizing
    the caller's tensor or pointing it at other storage leaves the transfer's ids as they were
    (a mover reads as many ids as the object has blocks, from the view's data pointer)."""

    obj: MemoryObj
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        blocks, shape = self.blocks, self.obj.meta.shape
        dims = blocks.shape
        if len(dims) != 1 or not shape or dims[0] != shape[0]:
            raise ValueError(
                f"a transfer of an object of {shape[0] if shape else 0} blocks needs as many "
                f"block ids, got shape {tuple(dims)}"
            )
        if blocks.dtype is not torch.int64 or not blocks.is_cpu or not blocks.is_contiguous():
            dtype = blocks.dtype
            if dtype.is_floating_point or dtype.is_complex or dtype is torch.bool:
                raise ValueError(f"a transfer's block ids must be integers, got {dtype}")
            object.__setattr__(self, "blocks", blocks.to("cpu", torch.int64).contiguous())
        else:
            # A view has its own size and storage reference: the caller's resize_ or set_ does
            # not reach it (storage never shrinks), so no mover reads past the ids.
            object.__setattr__(self, "blocks", blocks.view(dims))


class PageMover(ABC):
    """Moves chunks' pages between the paged KV views of one engine and host memory objects.

    Every platform's mover keeps the contract in this module's docstring.
    """

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, num_blocks: int | None = None
    ) -> None:
        self.layout = layout
        self.kv_caches = list(kv_caches)
        if not self.kv_caches:
            raise LayoutError("a page mover needs at least one KV tensor")
        self.num_blocks = (
            manager_blocks(self.kv_caches[0], layout) if num_blocks is None else num_blocks
        )
        self.runs: PageRuns = check_pages(layout, self.kv_caches, self.num_blocks)
        # One block's pages of every layer are one run (block-outer, block-compact layouts).
        self.block_runs = block_runs(self.kv_caches, self.runs)

    @property
    def device(self) -> torch.device:
        return self.kv_caches[0].device

    def check_layer(self, layer: int) -> None:
        """``store_layer``/``load_layer`` take a layer in ``[0, num_layers)``; else ``IndexError``
        (a negative index must not wrap around to the last layer)."""
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.layout.num_layers})")

    def check_transfer(self, transfer: Transfer) -> torch.Tensor:
        """The transfer's block ids (a host int64 tensor), checked against the object's shape
        and the cache (``LayoutError``/``IndexError`` per the contract)."""
        obj, lay = transfer.obj, self.layout
        want = (int(transfer.blocks.numel()), lay.num_layers, lay.page_bytes)
        if tuple(obj.tensor.shape) != want or obj.tensor.dtype != lay.chunk_dtype:
            raise LayoutError(
                f"a memory object {tuple(obj.tensor.shape)} {obj.tensor.dtype} does not match "
                f"the layout's chunk {want} {lay.chunk_dtype} ({lay.describe()})"
            )
        blocks = transfer.blocks
        if blocks.numel():
            lo, hi = (int(v) for v in torch.aminmax(blocks))
            if lo < -1 or hi >= self.num_blocks:
                raise IndexError(
                    f"block ids must be -1 or in [0, {self.num_blocks}), got [{lo}, {hi}]"
                )
        return blocks

    @abstractmethod
    def store(self, transfers: Sequence[Transfer]) -> None:
        """Copy each transfer's pages, all layers, from the paged cache into its object."""

    @abstractmethod
    def load(self, transfers: Sequence[Transfer]) -> None:
        """Copy each transfer's object, all layers, into the paged cache."""

    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        for layer in range(self.layout.num_layers):
            self.store_layer(layer, transfers)
            yield layer

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        for layer in range(self.layout.num_layers):
            self.load_layer(layer, transfers)
            yield layer

    @abstractmethod
    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        """Capture one layer of every transfer (the host copy is complete on return)."""

    @abstractmethod
    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        """Load one layer of every transfer (attention may read it on return)."""


#: A load into host memory copies block by block (one plain copy per block, rather than
#: ``index_copy_``'s element loop) where one block's pages of every layer are at least this many
#: bytes; below it the per-call overhead weighs as much as the loop (docs/serving.md).
BLOCK_COPY_BYTES = 256 << 10


def _widest_word(byte_counts: Sequence[int]) -> torch.dtype:
    """The widest integer dtype whose size divides every one of ``byte_counts``."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if all(n % dtype.itemsize == 0 for n in byte_counts):
            return dtype
    return torch.uint8


@dataclass(frozen=True)
class Picked:
    """A transfer's blocks split into the ones to move and where they sit in the object."""

    blocks: torch.Tensor  # cache block ids to move, on the cache device
    rows: torch.Tensor | None  # their positions in the object; None = every block, in order


class TorchPageMover(PageMover):
    """Reference mover: ``index_select``/``index_copy_`` over per-layer page views (a whole call
    over one view of every layer, ``stacked``, where the layers share a storage and a stride).
    With the cache in host memory (the CPU platform) a store gathers straight into the object
    and a load of large blocks copies them one by one (``BLOCK_COPY_BYTES``).

    Subclasses change *where* the bytes go between device and host by overriding
    ``_copy_to_host``/``_copy_to_device`` (streams, staging buffers), not the page indexing.
    """

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, num_blocks: int | None = None
    ) -> None:
        super().__init__(kv_caches, layout, num_blocks)
        page, n = layout.page_bytes, self.num_blocks
        # Pages are copied in the widest word every run, stride and offset divides: indexing
        # ops cost per element, and a uint8 element is an eighth of an int64 one.
        offsets = [int(c.storage_offset()) * c.element_size() for c in self.kv_caches]
        self.word = _widest_word(
            [
                self.runs.run_bytes,
                self.runs.block_stride,
                *(st for _, st in self.runs.dims),
                *offsets,
            ]
        )
        pages = [page_view(c, self.runs) for c in self.kv_caches]
        if not self.runs.dims:
            pages = [p.reshape(n, page) for p in pages]
        self._pages = [p.view(self.word) for p in pages]
        self.stacked = self._stacked_pages()
        # Loads copy block by block where a block (every layer's pages) is at least this large.
        self._copy_by_block = page * layout.num_layers >= BLOCK_COPY_BYTES

    def _stacked_pages(self) -> torch.Tensor | None:
        """Every layer's pages as one view ``[blocks, layers, *grid, run]`` (in ``word``s) when
        the layers' pages sit at one positive stride in one storage (how vLLM allocates, on every
        layout); else None. A whole call then gathers or scatters all layers in one op."""
        first = self._pages[0]
        if len(self._pages) == 1:
            return first.unsqueeze(1)
        storage = self.kv_caches[0].untyped_storage().data_ptr()
        step = self._pages[1].storage_offset() - first.storage_offset()
        if step <= 0:
            return None
        for i, (cache, pages) in enumerate(zip(self.kv_caches, self._pages, strict=True)):
            if cache.untyped_storage().data_ptr() != storage:
                return None
            if pages.storage_offset() != first.storage_offset() + i * step:
                return None
        sizes = (first.shape[0], len(self._pages), *first.shape[1:])
        strides = (first.stride(0), step, *first.stride()[1:])
        return first.as_strided(sizes, strides, first.storage_offset())

    def words(self, t: torch.Tensor) -> torch.Tensor:
        """A uint8 tensor of whole pages (innermost dimension contiguous) as ``word`` elements."""
        return t.view(self.word)

    def _same_memory(self, host: torch.Tensor) -> bool:
        """Whether ``host`` (an object's tensor) can be read and written by the cache's own ops:
        the cache is in host memory (the CPU platform) and the object is contiguous."""
        return host.device == self.device and host.is_contiguous()

    def _as_stacked(self, t: Transfer) -> torch.Tensor:
        """A transfer's object as ``stacked``'s rows: ``[blocks, layers, *grid, run]`` words."""
        assert self.stacked is not None
        return self.words(t.obj.tensor).view(-1, *self.stacked.shape[1:])

    # -- picking -------------------------------------------------------------------------------
    def _pick(self, transfer: Transfer) -> Picked:
        blocks = self.check_transfer(transfer)
        valid = blocks >= 0
        rows: torch.Tensor | None = None
        if not bool(valid.all()):
            rows = valid.nonzero().squeeze(1)
            blocks = blocks[rows]
        return Picked(blocks.to(self.device), rows)

    # -- device side ---------------------------------------------------------------------------
    def gather(self, layer: int, p: Picked) -> torch.Tensor:
        """One layer's pages of the picked blocks, on the device: ``[k, page_bytes]`` uint8."""
        pages = self._pages[layer].index_select(0, p.blocks)
        return pages.view(torch.uint8).reshape(-1, self.layout.page_bytes)

    def scatter(self, layer: int, p: Picked, values: torch.Tensor) -> None:
        """Write one layer's pages of the picked blocks (``values`` as ``gather`` returns)."""
        pages = self._pages[layer]
        pages.index_copy_(0, p.blocks, self.words(values).reshape(-1, *pages.shape[1:]))

    # -- host side -----------------------------------------------------------------------------
    def _copy_to_host(
        self, dst: torch.Tensor, rows: torch.Tensor | None, src: torch.Tensor
    ) -> None:
        """Write device pages ``src`` into host ``dst`` (at ``rows`` of dim 0, or all)."""
        if rows is None:
            dst.copy_(src)
        else:
            self.words(dst).index_copy_(0, rows.to(dst.device), self.words(src.to(dst.device)))

    def _copy_to_device(self, src: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Host pages (all rows or the selected ones) as a tensor on the cache device."""
        if rows is not None:
            src = src.index_select(0, rows.to(src.device))
        return src.to(self.device)

    # -- the moves ---------------------------------------------------------------------------------
    def _store_layer(self, layer: int, picked: Sequence[tuple[Transfer, Picked]]) -> None:
        for t, p in picked:
            if p.blocks.numel():
                self._copy_to_host(t.obj.tensor[:, layer], p.rows, self.gather(layer, p))

    def _load_layer(self, layer: int, picked: Sequence[tuple[Transfer, Picked]]) -> None:
        for t, p in picked:
            if p.blocks.numel():
                self.scatter(layer, p, self._copy_to_device(t.obj.tensor[:, layer], p.rows))

    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        self._store_layer(layer, [(t, self._pick(t)) for t in transfers])

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        self._load_layer(layer, [(t, self._pick(t)) for t in transfers])

    def store(self, transfers: Sequence[Transfer]) -> None:
        picked = [(t, self._pick(t)) for t in transfers]
        if self.stacked is not None:
            for t, p in picked:
                if not p.blocks.numel():
                    continue
                if p.rows is None and self._same_memory(t.obj.tensor):
                    # Gathered straight into the object: no temporary the size of the chunk to
                    # allocate, fault in and copy again.
                    torch.index_select(self.stacked, 0, p.blocks, out=self._as_stacked(t))
                    continue
                flat = t.obj.tensor.view(t.obj.tensor.shape[0], -1)
                gathered = self.stacked.index_select(0, p.blocks).view(torch.uint8)
                self._copy_to_host(flat, p.rows, gathered.reshape(-1, flat.shape[1]))
            return
        for layer in range(self.layout.num_layers):
            self._store_layer(layer, picked)

    def load(self, transfers: Sequence[Transfer]) -> None:
        picked = [(t, self._pick(t)) for t in transfers]
        if self.stacked is not None:
            shape = self.stacked.shape[1:]
            for t, p in picked:
                if not p.blocks.numel():
                    continue
                if p.rows is None and self._same_memory(t.obj.tensor) and self._copy_by_block:
                    # One plain copy per block (a run of every layer's pages each): faster than
                    # index_copy_'s element loop once a block is this large.
                    values = self._as_stacked(t)
                    for i, block in enumerate(p.blocks.tolist()):
                        self.stacked[block].copy_(values[i])
                    continue
                flat = t.obj.tensor.view(t.obj.tensor.shape[0], -1)
                values = self.words(self._copy_to_device(flat, p.rows)).view(-1, *shape)
                self.stacked.index_copy_(0, p.blocks, values)
            return
        for layer in range(self.layout.num_layers):
            self._load_layer(layer, picked)

    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        picked = [(t, self._pick(t)) for t in transfers]
        for layer in range(self.layout.num_layers):
            self._store_layer(layer, picked)
            yield layer

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        picked = [(t, self._pick(t)) for t in transfers]
        for layer in range(self.layout.num_layers):
            self._load_layer(layer, picked)
            yield layer
