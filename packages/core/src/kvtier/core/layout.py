"""KV layout metadata: what an engine's paged KV cache looks like and what a chunk of it is.

Every chunk key carries the layout's fingerprint, so KV saved under one layout (model shape,
dtype, block size, engine memory layout) is never loaded into another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum

import torch

from kvtier.core.errors import LayoutError


class PagedLayout(str, Enum):
    """The engine's per-layer paged KV tensor layouts kvtier knows.

    - ``FLASH_NHD``: ``[2, num_blocks, block_size, kv_heads, head_size]`` (vLLM flash-attn, CUDA).
    - ``FLASH_BLOCK_FIRST``: ``[num_blocks, 2, block_size, kv_heads, head_size]`` (newer CUDA backends).
    - ``VLLM_CPU``: ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (vLLM CPU backend); inside
      one ``(block, head)`` the first ``head_size * block_size`` elements are K stored transposed
      (``[head_size, block_size]``) and the next are V (``[block_size, head_size]``).
    - ``MLA``: ``[num_blocks, block_size, latent_size]`` (multi-head latent attention, one latent
      vector per token; ``head_size`` is the latent size and ``num_kv_heads`` is 1).
    """

    FLASH_NHD = "flash_nhd"
    FLASH_BLOCK_FIRST = "flash_block_first"
    VLLM_CPU = "vllm_cpu"
    MLA = "mla"


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise LayoutError(f"unsupported KV dtype {dtype}; supported: {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise LayoutError(f"unsupported KV dtype {name!r}; supported: {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape of one engine's KV cache, as kvtier needs it to move and key chunks.

    A chunk of ``n`` tokens lives in host memory as ``[2, num_layers, n, kv_heads * head_size]``
    (MLA: ``[num_layers, n, head_size]``), whatever the engine's paged layout.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    paged_layout: PagedLayout
    use_mla: bool = False
    # The engine's name for the KV format (vLLM: "auto", "fp8_e4m3", "fp8_e5m2", ...): fp8
    # variants share one torch dtype (uint8), so only this tells their bytes apart.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise LayoutError(f"KVLayout.{field} must be a positive int, got {value!r}")
        dtype_from_name(self.dtype)
        if not isinstance(self.cache_dtype, str) or not self.cache_dtype:
            raise LayoutError(
                f"KVLayout.cache_dtype must be a non-empty str, got {self.cache_dtype!r}"
            )
        object.__setattr__(self, "paged_layout", PagedLayout(self.paged_layout))
        if self.use_mla != (self.paged_layout is PagedLayout.MLA):
            raise LayoutError(
                f"KVLayout.use_mla={self.use_mla} does not match paged_layout={self.paged_layout.value}"
            )
        if self.use_mla and self.num_kv_heads != 1:
            raise LayoutError(
                f"an MLA layout has one latent 'head', got num_kv_heads={self.num_kv_heads}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def hidden_size(self) -> int:
        """Elements per token per layer for K (or V), i.e. ``kv_heads * head_size``."""
        return self.num_kv_heads * self.head_size

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        if self.use_mla:
            return (self.num_layers, num_tokens, self.head_size)
        return (2, self.num_layers, num_tokens, self.hidden_size)

    def bytes_per_token(self) -> int:
        kv = 1 if self.use_mla else 2
        return kv * self.num_layers * self.hidden_size * self.torch_dtype.itemsize

    def chunk_nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token() * num_tokens

    def fingerprint(self) -> str:
        """A short stable digest of every field; part of every chunk key."""
        fields = asdict(self)
        fields["paged_layout"] = self.paged_layout.value
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    def expected_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The per-layer paged tensor shape the engine should hand over for ``num_blocks`` blocks."""
        b, h, d, n = self.block_size, self.num_kv_heads, self.head_size, num_blocks
        return {
            PagedLayout.FLASH_NHD: (2, n, b, h, d),
            PagedLayout.FLASH_BLOCK_FIRST: (n, 2, b, h, d),
            PagedLayout.VLLM_CPU: (n, h, b, 2 * d),
            PagedLayout.MLA: (n, b, d),
        }[self.paged_layout]

    def num_blocks_of(self, cache: torch.Tensor) -> int:
        """Check one layer's paged tensor against this layout; return its number of blocks."""
        if cache.dtype != self.torch_dtype:
            raise LayoutError(
                f"KV cache dtype {cache.dtype} does not match layout dtype {self.dtype}"
            )
        dim = 1 if self.paged_layout is PagedLayout.FLASH_NHD else 0
        if cache.dim() <= dim:
            raise LayoutError(
                f"KV cache of shape {tuple(cache.shape)} is not {self.paged_layout.value}"
            )
        num_blocks = int(cache.shape[dim])
        expected = self.expected_cache_shape(num_blocks)
        if tuple(cache.shape) != expected:
            raise LayoutError(
                f"KV cache of shape {tuple(cache.shape)} does not match the {self.paged_layout.value} "
                f"layout {expected} (layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size}, block_size={self.block_size})"
            )
        return num_blocks
