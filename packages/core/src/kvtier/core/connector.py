"""Device connectors: move chunks between an engine's paged KV cache and host memory objects.

The contract (every platform's connector keeps it; ``tests/conformance/test_device_connector.py``
runs the same checks against every platform):

- A ``Transfer`` pairs a memory object (``[2, layers, n, heads*head]``, MLA ``[layers, n, latent]``)
  with ``n`` slot indices into the paged cache (``slot = block_id * block_size + offset``). A slot
  of ``-1`` means "skip this token": on store its row in the object is left as it is, on load the
  engine's copy is left as it is (the engine already has it).
- ``store``/``load`` return once the bytes are where they were asked to be: after ``store`` the
  host objects may be read or written to disk; after ``load`` attention may read the cache.
- ``store_layerwise``/``load_layerwise`` are generators that yield each layer index once that
  layer is done (load: the layer may be read by attention; store: the layer has been captured
  and the engine may overwrite it). Exhausting the generator completes the transfer. Closing it
  early waits for the copies it issued (the objects may then be released); layers it has not
  yielded may or may not have moved.
- **Bad input** raises and never writes outside the cache or the call's objects: a slot below
  -1 or past the cache, or a layer outside ``[0, num_layers)``, is an ``IndexError``; an object
  whose shape or dtype is not the layout's chunk a ``LayoutError``; a transfer whose slot count is not its object's token count a
  ``ValueError`` (``Transfer`` itself). Other transfers of the failed call may have moved (a
  connector may start copying before it has checked the whole call); the connector stays
  usable. A paged layout the connector cannot move, or KV tensors that do not match the
  layout, are a ``LayoutError`` when the connector is built.
- **Threads.** One store (``store``, ``store_layer``, or a ``store_layerwise`` generator not yet
  exhausted or closed) and one load (likewise) may be in flight at the same time, called from two
  threads (vLLM saves on its saver thread while the forward thread loads): each moves exactly
  its own bytes, as if it ran alone. Their slots are disjoint (the engine never loads into
  blocks it is saving). Two stores, or two loads, at once are the caller's to serialise.
- **Streams** (accelerators). A call is ordered after the work the calling thread issued on its
  current stream before the call; work issued by another thread must be ordered by the caller
  (an event recorded where the work is handed over).
- **Synchronous.** Every method of this interface has done its copies when it returns (a
  generator: when it yields, for that layer). There is no asynchronous variant in the contract:
  a platform may offer one as an extension (the CUDA connector's ``store_async``, ``load_async``
  and ``store_and_load_async`` return a handle to ``wait()`` on), but nothing in kvtier calls
  them and other platforms have none, so code written against ``DeviceConnector`` must not.
- **Options** (``Platform.create_connector(kv_caches, layout, **options)``) mean the same on
  every platform. ``staging_buffer`` (bool, default True; config ``device_staging_buffer``) is
  accepted by every platform: True lets the connector keep device staging memory between calls
  (XPU: per-direction staging buffers; CUDA: its per-direction DMA staging rings), False keeps
  none between calls (XPU: each chunk moves through a temporary; CUDA: the ring is released
  after each call); on the CPU platform the cache is host memory and it changes nothing. Other
  options are the platform's own (documented on its ``create_connector``). An unknown option, or
  a value of the wrong type, is a ``TypeError`` naming it; a value out of range a ``ValueError``.
  ``check_options`` does these checks for a platform.

``TorchPagedConnector`` is the torch-generic reference (``index_select``/``index_copy_``); it is
the CPU platform's connector, the XPU platform builds on it, and tests/cuda compares the CUDA
kernels with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import MemoryObj

#: Options every platform's ``create_connector`` accepts, with their types (see the module doc).
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
            f"unknown {platform} connector option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    for name, value in options.items():
        want = known[name]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise TypeError(
                f"{platform} connector option {name} must be a {want.__name__}, got {value!r}"
            )
    return dict(options)


@dataclass(frozen=True)
class Transfer:
    """One chunk to move: a memory object and the paged-cache slot of each of its tokens."""

    obj: MemoryObj
    slots: torch.Tensor

    def __post_init__(self) -> None:
        if self.slots.dim() != 1 or self.slots.numel() != self.obj.num_tokens:
            raise ValueError(
                f"a transfer of {self.obj.num_tokens} tokens needs as many slots, got shape "
                f"{tuple(self.slots.shape)}"
            )


class DeviceConnector(ABC):
    """Moves chunks between the paged KV tensors of one engine and host memory objects.

    Every platform's connector keeps the contract in this module's docstring: what each method
    guarantees on return, ``-1`` slots, bad input, one store and one load from two threads at
    once, stream ordering, options.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout) -> None:
        if len(kv_caches) != layout.num_layers:
            raise LayoutError(
                f"layout has {layout.num_layers} layers but {len(kv_caches)} KV tensors were given"
            )
        self.layout = layout
        self.kv_caches = list(kv_caches)
        self.num_blocks = layout.num_blocks_of(self.kv_caches[0])
        for cache in self.kv_caches[1:]:
            if layout.num_blocks_of(cache) != self.num_blocks:
                raise LayoutError("every layer's KV tensor must have the same number of blocks")

    @property
    def device(self) -> torch.device:
        return self.kv_caches[0].device

    def check_layer(self, layer: int) -> None:
        """``store_layer``/``load_layer`` take a layer in ``[0, num_layers)``; else ``IndexError``
        (a negative index must not wrap around to the last layer)."""
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.layout.num_layers})")

    @abstractmethod
    def store(self, transfers: Sequence[Transfer]) -> None:
        """Copy each transfer's tokens, all layers, from the paged cache into its object."""

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


@dataclass(frozen=True)
class Rows:
    """A transfer's slots split into the valid ones and where they sit in the object."""

    slots: torch.Tensor  # valid slots only, on the cache device
    rows: torch.Tensor | None  # positions of the valid slots in the object; None = all rows
    blocks: torch.Tensor
    offsets: torch.Tensor


class TorchPagedConnector(DeviceConnector):
    """Reference connector: per-layer ``index_select``/``index_copy_`` (and advanced indexing).

    Subclasses change *where* the bytes go between device and host by overriding
    ``_copy_to_host``/``_copy_to_device`` (streams, staging buffers), not the paged indexing.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout) -> None:
        super().__init__(kv_caches, layout)
        # The dtype bytes are indexed as: fp8 formats as uint8 (torch's CPU indexing has no fp8
        # kernels, and a copy moves the same bytes either way).
        self.copy_dtype = torch.uint8 if layout.torch_dtype.itemsize == 1 else layout.torch_dtype
        self._views = [self._paged_views(c) for c in self.kv_caches]

    # -- paged views -----------------------------------------------------------------------
    def _paged_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lay = self.layout
        b, h, d, n = lay.block_size, lay.num_kv_heads, lay.head_size, self.num_blocks
        cache = cache.view(self.copy_dtype)
        try:
            if lay.paged_layout is PagedLayout.FLASH_NHD:
                return (cache.view(2, n * b, h * d),)
            if lay.paged_layout is PagedLayout.FLASH_BLOCK_FIRST:
                return (cache.view(n, 2, b, h * d),)
            if lay.paged_layout is PagedLayout.VLLM_CPU:
                halves = cache.view(n, h, 2, d * b)
                k_t = halves[:, :, 0].unflatten(-1, (d, b))  # [n, h, d, b]: K transposed
                v = halves[:, :, 1].unflatten(-1, (b, d))  # [n, h, b, d]
                return (k_t, v)
            if lay.paged_layout is PagedLayout.MLA:
                return (cache.view(n * b, d),)
        except RuntimeError as e:
            raise LayoutError(
                f"KV tensor with shape {tuple(cache.shape)} and strides {cache.stride()} cannot be "
                f"viewed as {lay.paged_layout.value}: {e}"
            ) from None
        raise LayoutError(f"no torch paged copy for layout {lay.paged_layout!r}")

    def _rows(self, transfer: Transfer) -> Rows:
        obj, lay = transfer.obj, self.layout
        if tuple(obj.tensor.shape) != tuple(lay.chunk_shape(obj.num_tokens)) or (
            obj.tensor.dtype != lay.torch_dtype
        ):
            raise LayoutError(
                f"a memory object {tuple(obj.tensor.shape)} {obj.tensor.dtype} does not match the "
                f"layout's chunk {tuple(lay.chunk_shape(obj.num_tokens))} {lay.torch_dtype}"
            )
        slots = transfer.slots.to(device=self.device, dtype=torch.long)
        total = self.num_blocks * self.layout.block_size
        if slots.numel():
            lo, hi = (int(v) for v in torch.aminmax(slots))
            if lo < -1 or hi >= total:
                raise IndexError(f"slot values must be -1 or in [0, {total}), got [{lo}, {hi}]")
        valid = slots >= 0
        rows: torch.Tensor | None = None
        if not bool(valid.all()):
            rows = valid.nonzero().squeeze(1)
            slots = slots[rows]
        bs = self.layout.block_size
        return Rows(slots, rows, torch.div(slots, bs, rounding_mode="floor"), slots % bs)

    def gather(self, layer: int, r: Rows) -> torch.Tensor:
        """One layer of the given tokens, on the device: ``[2, t, h*d]`` (MLA ``[t, latent]``)."""
        views = self._views[layer]
        lay = self.layout
        if lay.paged_layout is PagedLayout.FLASH_NHD:
            return views[0].index_select(1, r.slots)
        if lay.paged_layout is PagedLayout.FLASH_BLOCK_FIRST:
            return views[0][r.blocks, :, r.offsets].transpose(0, 1)
        if lay.paged_layout is PagedLayout.VLLM_CPU:
            k_t, v = views
            k = k_t[r.blocks, :, :, r.offsets]  # [t, h, d]
            vv = v[r.blocks, :, r.offsets, :]  # [t, h, d]
            return torch.stack((k.flatten(1), vv.flatten(1)))
        return views[0].index_select(0, r.slots)

    def scatter(self, layer: int, r: Rows, values: torch.Tensor) -> None:
        """Write one layer of the given tokens (``values`` shaped as ``gather`` returns)."""
        views = self._views[layer]
        lay = self.layout
        if lay.paged_layout is PagedLayout.FLASH_NHD:
            views[0].index_copy_(1, r.slots, values)
        elif lay.paged_layout is PagedLayout.FLASH_BLOCK_FIRST:
            views[0][r.blocks, :, r.offsets] = values.transpose(0, 1)
        elif lay.paged_layout is PagedLayout.VLLM_CPU:
            k_t, v = views
            h, d = lay.num_kv_heads, lay.head_size
            k_t[r.blocks, :, :, r.offsets] = values[0].unflatten(1, (h, d))
            v[r.blocks, :, r.offsets, :] = values[1].unflatten(1, (h, d))
        else:
            views[0].index_copy_(0, r.slots, values)

    # -- host side ---------------------------------------------------------------------------
    def host_layer(self, obj: MemoryObj, layer: int) -> torch.Tensor:
        """The object's slice for one layer: ``[2, n, h*d]`` (MLA ``[n, latent]``)."""
        t = obj.tensor.view(self.copy_dtype)
        return t[layer] if self.layout.use_mla else t[:, layer]

    def _token_dim(self) -> int:
        return 0 if self.layout.use_mla else 1

    def _copy_to_host(
        self, dst: torch.Tensor, rows: torch.Tensor | None, src: torch.Tensor
    ) -> None:
        """Write device values ``src`` into host ``dst`` (at ``rows`` of the token dim, or all)."""
        if rows is None:
            dst.copy_(src)
        else:
            dst.index_copy_(self._token_dim(), rows.to(dst.device), src.to(dst.device))

    def _copy_to_device(self, src: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Host values (all rows or the selected ones) as a tensor on the cache device."""
        if rows is not None:
            src = src.index_select(self._token_dim(), rows.to(src.device))
        return src.to(self.device)

    # -- the four moves --------------------------------------------------------------------------
    def store_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        self._store_layer(layer, [(t, self._rows(t)) for t in transfers])

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
        self.check_layer(layer)
        self._load_layer(layer, [(t, self._rows(t)) for t in transfers])

    def _store_layer(self, layer: int, prepared: Sequence[tuple[Transfer, Rows]]) -> None:
        for t, r in prepared:
            if r.slots.numel():
                self._copy_to_host(self.host_layer(t.obj, layer), r.rows, self.gather(layer, r))

    def _load_layer(self, layer: int, prepared: Sequence[tuple[Transfer, Rows]]) -> None:
        for t, r in prepared:
            if r.slots.numel():
                self.scatter(layer, r, self._copy_to_device(self.host_layer(t.obj, layer), r.rows))

    def store(self, transfers: Sequence[Transfer]) -> None:
        prepared = [(t, self._rows(t)) for t in transfers]
        for layer in range(self.layout.num_layers):
            self._store_layer(layer, prepared)

    def load(self, transfers: Sequence[Transfer]) -> None:
        prepared = [(t, self._rows(t)) for t in transfers]
        for layer in range(self.layout.num_layers):
            self._load_layer(layer, prepared)

    def store_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        prepared = [(t, self._rows(t)) for t in transfers]
        for layer in range(self.layout.num_layers):
            self._store_layer(layer, prepared)
            yield layer

    def load_layerwise(self, transfers: Sequence[Transfer]) -> Iterator[int]:
        prepared = [(t, self._rows(t)) for t in transfers]
        for layer in range(self.layout.num_layers):
            self._load_layer(layer, prepared)
            yield layer
