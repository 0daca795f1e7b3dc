"""Device connectors: move chunks between an engine's paged KV cache and host memory objects.

The contract (every platform's connector keeps it):

- A ``Transfer`` pairs a memory object (``[2, layers, n, heads*head]``, MLA ``[layers, n, latent]``)
  with ``n`` slot indices into the paged cache (``slot = block_id * block_size + offset``). A slot
  of ``-1`` means "skip this token": on store its row in the object is left as it is, on load the
  engine's copy is left as it is (the engine already has it).
- ``store``/``load`` return once the bytes are where they were asked to be: after ``store`` the
  host objects may be read or written to disk; after ``load`` attention may read the cache.
- ``store_layerwise``/``load_layerwise`` are generators that yield each layer index once that
  layer is done (load: the layer may be read by attention; store: the layer has been captured
  and the engine may overwrite it). Exhausting the generator completes the transfer.

``TorchPagedConnector`` is the torch-generic reference (``index_select``/``index_copy_``); it is
the CPU platform's connector, the XPU platform builds on it, and the CUDA kernels are tested
against it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import MemoryObj


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
    """Moves chunks between the paged KV tensors of one engine and host memory objects."""

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
        self._views = [self._paged_views(c) for c in self.kv_caches]

    # -- paged views -----------------------------------------------------------------------
    def _paged_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lay = self.layout
        b, h, d, n = lay.block_size, lay.num_kv_heads, lay.head_size, self.num_blocks
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
        slots = transfer.slots.to(device=self.device, dtype=torch.long)
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
        return obj.tensor[layer] if self.layout.use_mla else obj.tensor[:, layer]

    def _token_dim(self) -> int:
        return 0 if self.layout.use_mla else 1

    def _copy_to_host(self, dst: torch.Tensor, rows: torch.Tensor | None, src: torch.Tensor) -> None:
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
        self._store_layer(layer, [(t, self._rows(t)) for t in transfers])

    def load_layer(self, layer: int, transfers: Sequence[Transfer]) -> None:
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
