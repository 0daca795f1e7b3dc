"""Whether the KV views vLLM registers for a hybrid model's groups are views of the same pages.

vLLM places group ``g``'s ``i``-th layer in the same bytes as every other group's ``i``-th layer
(``groups.py``), so kvtier's mover reads every group's pages through the primary group's views.
That holds only where the views agree on where each block's page lies: the same view (one
geometry), a view of another shape whose every block is the same one run of bytes (groups
vLLM evened out with different block sizes: Gemma 4), or a Mamba view whose state sits in the
first bytes of each block's page. Anything else is a ``LayoutError`` naming the two layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.core.errors import LayoutError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _run_bytes(block: torch.Tensor) -> int | None:
    """The bytes of ``block`` (one block of a view) when its elements fill one run of memory
    from its first byte, in any order of its dimensions (vLLM's NHD and HND pages both do);
    None when they do not (a head-outer layout's page is one run per head)."""
    expected = 1
    dims = zip(block.stride(), block.shape, strict=True)
    for stride, size in sorted((st, sz) for st, sz in dims if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return expected * block.element_size()


def _holds_state(state: torch.Tensor, page: torch.Tensor, *, whole: bool = False) -> bool:
    """Whether the Mamba view ``state`` keeps each block's state in the first bytes of the
    same block's page of the attention view ``page``: one address, one block stride, pages
    that are one run of bytes at least as long as a state (``whole``: as long as the page,
    for two attention views of different shapes over the same pages)."""
    size = state.element_size()
    state_bytes, page_bytes = _run_bytes(state[0]), _run_bytes(page[0])
    return (
        state_bytes is not None
        and page_bytes is not None
        and state.data_ptr() == page.data_ptr()
        and state.shape[0] == page.shape[0]
        and state.stride(0) * size == page.stride(0) * page.element_size()
        and (state_bytes == page_bytes if whole else state_bytes <= page_bytes)
    )


def shared_views(
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
    primary: int,
    mambas: Sequence[int] = (),
    *,
    evened: bool = False,
) -> tuple[list[str], dict[str, int]]:
    """The primary group's layer names in vLLM's order (one view per shared tensor) and, for
    every layer of every group, the position of the tensor it lives in. Group ``g``'s ``i``-th
    layer must be a view of the same bytes as the primary group's ``i``-th (same address,
    shape, strides, element type; a Mamba group's, listed in ``mambas``, must keep each
    block's state in the first bytes of that block's page: ``_holds_state``; with ``evened``,
    groups of different page shapes, each block's page must be the same run of bytes in
    both); else a ``LayoutError`` naming the two layers."""
    groups = kv_cache_config.kv_cache_groups
    reps = list(groups[primary].layer_names)
    position: dict[str, int] = {}
    for g, group in enumerate(groups):
        for i, name in enumerate(group.layer_names):
            rep = reps[i]
            a, b = kv_caches.get(name), kv_caches.get(rep)
            if a is None or b is None:
                missing = name if a is None else rep
                raise LayoutError(f"register_kv_caches got no KV tensor for layer {missing!r}")
            same = (
                _holds_state(a, b)
                if g in mambas
                else _holds_state(a, b, whole=True)
                if evened and g != primary
                else (
                    a.data_ptr() == b.data_ptr()
                    and a.shape == b.shape
                    and a.stride() == b.stride()
                    and a.dtype == b.dtype
                )
            )
            if not same:
                raise LayoutError(
                    f"layers {name!r} and {rep!r} of two KV cache groups do not share their "
                    "pages (kvtier stores hybrid models whose groups overlay one allocation "
                    "with pages of one size, each block's page one run of bytes)"
                )
            position[name] = i
    return reps, position
