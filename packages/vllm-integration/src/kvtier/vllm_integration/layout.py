"""Which paged KV layout vLLM handed over, detected from the tensors and the model's shape.

vLLM's CPU backend gives per-layer ``[num_blocks, kv_heads, block_size, 2 * head_size]`` views
(K transposed inside each block, then V); CUDA flash-attn gives ``[2, num_blocks, block_size,
kv_heads, head_size]`` (newer backends put the 2 after ``num_blocks``); MLA gives ``[num_blocks,
block_size, latent]``. Anything else is refused with a ``LayoutError``: a token-level copy with a
guessed layout would load the wrong bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout, dtype_name

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if not found:
        raise LayoutError(f"cannot find a layer index in KV cache name {name!r}")
    return int(found[-1])


def ordered_caches(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The per-layer tensors in layer order (the dict's order is not guaranteed to be it)."""
    names = sorted(kv_caches, key=layer_index)
    indices = [layer_index(n) for n in names]
    if len(set(indices)) != len(indices):
        raise LayoutError(f"two KV tensors claim the same layer: {names}")
    return [kv_caches[n] for n in names]


def detect_paged_layout(
    shape: tuple[int, ...], *, block_size: int, num_kv_heads: int, head_size: int, use_mla: bool
) -> PagedLayout:
    """The layout whose shape ``shape`` is, for a model with the given attention shape."""
    b, h, d = block_size, num_kv_heads, head_size
    candidates = []
    if use_mla:
        if len(shape) == 3 and shape[1:] == (b, d):
            candidates.append(PagedLayout.MLA)
    elif len(shape) == 4 and shape[1:] == (h, b, 2 * d):
        candidates.append(PagedLayout.VLLM_CPU)
    elif len(shape) == 5:
        if shape[0] == 2 and shape[2:] == (b, h, d):
            candidates.append(PagedLayout.FLASH_NHD)
        if shape[1] == 2 and shape[2:] == (b, h, d):
            candidates.append(PagedLayout.FLASH_BLOCK_FIRST)
    if len(candidates) != 1:
        what = "no known layout" if not candidates else "more than one layout"
        raise LayoutError(
            f"KV cache tensor of shape {tuple(shape)} matches {what} for block_size={b}, "
            f"kv_heads={h}, head_size={d}, mla={use_mla}; kvtier knows vllm_cpu "
            f"[blocks, heads, block, 2*head], flash_nhd [2, blocks, block, heads, head], "
            f"flash_block_first [blocks, 2, block, heads, head] and mla [blocks, block, latent]"
        )
    return candidates[0]


def build_layout(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    use_mla: bool = False,
    cache_dtype: str = "auto",
) -> KVLayout:
    """A ``KVLayout`` for the tensors vLLM passed to ``register_kv_caches``; ``cache_dtype`` is
    vLLM's KV cache dtype string (``auto``, ``fp8_e4m3``, ``fp8_e5m2``, ...)."""
    if not kv_caches:
        raise LayoutError("register_kv_caches got no KV tensors")
    caches = ordered_caches(kv_caches)
    first = caches[0]
    paged = detect_paged_layout(
        tuple(first.shape),
        block_size=block_size,
        num_kv_heads=1 if use_mla else num_kv_heads,
        head_size=head_size,
        use_mla=use_mla,
    )
    for c in caches[1:]:
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise LayoutError(
                f"KV tensors differ between layers ({tuple(first.shape)}/{first.dtype}/{first.device} "
                f"vs {tuple(c.shape)}/{c.dtype}/{c.device}); kvtier needs one shape for every layer"
            )
    return KVLayout(
        num_layers=len(caches),
        num_kv_heads=1 if use_mla else num_kv_heads,
        head_size=head_size,
        dtype=dtype_name(first.dtype),
        block_size=block_size,
        paged_layout=paged,
        use_mla=use_mla,
        cache_dtype=cache_dtype,
    )
