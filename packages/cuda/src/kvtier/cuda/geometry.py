"""Where a chunk's rows sit in the paged cache, and the sizes the planner works in.

A *row* is one ``(k|v, layer)`` slice of one chunk (MLA: one layer); a memory object holds
``rows_per_obj`` rows back to back, each ``num_tokens * hidden_size`` elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.cuda.kernels import RowGeometry, word_bytes_for

# (block, token, kv) dimension of each paged layout's KV tensor (None: no K/V dimension).
_DIMS = {
    PagedLayout.FLASH_NHD: (1, 2, 0),
    PagedLayout.FLASH_BLOCK_FIRST: (0, 2, 1),
    PagedLayout.MLA: (0, 1, None),
}


@dataclass(frozen=True)
class CallShape:
    """The layout's sizes the host planner needs (no tensors, no device)."""

    layout: KVLayout
    hd_bytes: int  # one token of one row
    rows_per_obj: int
    total_slots: int  # num_blocks * block_size
    chunk_shapes: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, layout: KVLayout, num_blocks: int) -> CallShape:
        return cls(
            layout=layout,
            hd_bytes=layout.hidden_size * layout.torch_dtype.itemsize,
            rows_per_obj=layout.num_layers * (1 if layout.use_mla else 2),
            total_slots=num_blocks * layout.block_size,
        )

    @property
    def token_bytes(self) -> int:
        """Bytes one token of a chunk's object holds."""
        return self.hd_bytes * self.rows_per_obj

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        shape = self.chunk_shapes.get(num_tokens)
        if shape is None:
            shape = self.chunk_shapes[num_tokens] = self.layout.chunk_shape(num_tokens)
        return shape


def row_bases(
    layout: KVLayout, kv_caches: Sequence[torch.Tensor]
) -> tuple[list[int], tuple[int, int, int]]:
    """Paged base address of each object row, and (block, token, kv) strides in bytes.

    Strides come from the tensors, so a permuted view (e.g. ``[2, nb, ...]`` over a block-first
    allocation) works as long as one token's ``heads * head_size`` is contiguous.
    """
    if layout.paged_layout not in _DIMS:
        raise LayoutError(
            f"the CUDA connector does not handle the {layout.paged_layout.value} paged layout"
        )
    es = layout.torch_dtype.itemsize
    block_dim, token_dim, kv_dim = _DIMS[layout.paged_layout]
    strides: tuple[int, int, int] | None = None
    k_bases: list[int] = []
    v_bases: list[int] = []
    for layer, cache in enumerate(kv_caches):
        expect, contiguous = 1, True
        for size, stride in zip(
            reversed(cache.shape[token_dim + 1 :]),
            reversed(cache.stride()[token_dim + 1 :]),
            strict=True,
        ):
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
    return (k_bases if layout.use_mla else k_bases + v_bases), strides


def row_geometry(
    shape: CallShape, bases: Sequence[int], strides: tuple[int, int, int]
) -> RowGeometry:
    """The kernel's view of the cache: sizes in the widest word dividing every row and address."""
    block_b, token_b, _ = strides
    w = word_bytes_for(shape.hd_bytes, block_b, token_b, *bases)
    return RowGeometry(
        word_bytes=w,
        hd_words=shape.hd_bytes // w,
        block_size=shape.layout.block_size,
        block_stride_words=block_b // w,
        token_stride_words=token_b // w,
        total_slots=shape.total_slots,
    )
