"""KV page geometry: what an engine's paged KV cache is, as far as kvtier needs to know it.

kvtier moves *pages*: one layer's one block, copied as opaque bytes. It never reads a page's
interior, so any attention backend's packing (vLLM CPU's ISA-specific K layout, fp8 with its
scales, MLA latents) round-trips exactly. What it must know is which pages are interchangeable:
the ``KVLayout`` names everything that decides a page's bytes, and its ``fingerprint`` is part of
every chunk key and stored header, so a page written under another geometry or another interior
writer is a miss, never a load.

The engine's per-layer KV tensors are vLLM's logical views ``[num_blocks, H, N, C]`` (RFC #42082:
blocks, head slots, tokens of a block, content per head and token), laid out in memory by one of
vLLM's ``KVCacheLayout`` stride orders (``PagedLayout`` here). ``kvtier.core.platform.pages`` derives how a
page sits in such a view from the view's strides, never from its shape.

A chunk of ``n`` tokens lives in host memory as ``[n // block_size, num_layers, page_bytes]``
bytes: block-major, so the first ``k`` blocks of a chunk are a contiguous prefix and a
block-outer cache moves one block's every layer as one run.

A hybrid model's cache (vLLM's hybrid memory allocator: several KV cache groups, e.g. sliding
window and full attention layers) has ``G`` groups over the same ``num_layers`` tensors: each
tensor holds one layer of every group, and a block id belongs to one group at a time. A chunk
then holds every group's pages: ``[n // block_size * G, num_layers, page_bytes]``, row
``i * G + g`` being group ``g``'s ``i``-th block (still block-major: a prefix of ``k`` blocks is
the first ``k * G`` rows).

Groups whose layers differ in head size (Gemma 4: full-attention heads of 512, window heads of
64) get different block sizes from vLLM, which evens out their pages' bytes
(``group_block_sizes``). kvtier's block is then their least common multiple
(``block_tokens``, the hit granularity), and each block holds a *section* per group: group
``g``'s ``block_tokens / group_block_sizes[g]`` blocks in turn (``group_rows``), so a chunk is
``[n // block_tokens * rows_per_block, num_layers, page_bytes]`` and stays block-major.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from enum import Enum

import torch

from kvtier.core.errors import LayoutError


class PagedLayout(str, Enum):
    """vLLM's KV cache layouts (``vllm.v1.kv_cache_layout.KVCacheLayout``), by name.

    The logical shape is ``[L, B, H, N, C]``; the name is the physical order, outermost first.
    Layer-outer layouts give each layer its own region; block-outer ones (``B..``) put one
    block's pages of every layer together; head-outer ones (``LHBNC``, ``BHLNC``) split a page
    into one run per head slot.
    """

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"

    @property
    def stride_order(self) -> tuple[int, ...]:
        """The physical order of the logical axes ``L=0, B=1, H=2, N=3, C=4``."""
        return tuple("LBHNC".index(axis) for axis in self.value)

    @property
    def block_outer(self) -> bool:
        return self.value[0] == "B"


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
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


#: The dtype of every chunk held in host memory: pages are bytes.
CHUNK_DTYPE = torch.uint8


@dataclass(frozen=True)
class KVLayout:
    """The page geometry of one engine's KV cache and the writer of its pages' interior.

    - ``num_kv_heads``: head slots per page (``H``; vLLM's ``num_heads`` of the cache spec, 1 for
      MLA); ``head_size``: per head and token, K's size (MLA: the latent's).
    - ``content_bytes``: bytes per head slot and token (``C`` in bytes). ``0`` means dense K and
      V (``2 * head_size`` elements; MLA one latent); a quantized cache that packs scales next
      to its values says its own (vLLM's ``state_content_size_bytes``).
    - ``paged_layout``: vLLM's resolved ``KVCacheLayout``; ``cache_dtype``: vLLM's cache dtype
      string (fp8 variants share a torch dtype, only this tells their bytes apart).
    - ``interior``: who wrote the pages' interior: the attention backend and, where it packs
      differently per ISA, the ISA (vLLM CPU: ``CPU_ATTN/amx`` packs K otherwise than
      ``CPU_ATTN/vec``). Pages of two interiors are never interchangeable.
    - ``groups``: for a hybrid model, each KV cache group's kind in vLLM's group order (e.g.
      ``("SlidingWindowSpec/128", "FullAttentionSpec")``); empty for one group. The groups
      share the geometry above, and a chunk holds every group's pages (module docstring).
    - ``states``: for a hybrid model with Mamba / linear-attention groups, each such group's
      kind (its state's shapes and dtypes). Their blocks hold one recurrent state each, in the
      same tensors; a chunk holds none of them, a state entry (``kvtier.core.engine.states``) holds
      one block of each: ``state_shape``.
    - ``group_block_sizes``: each group's block size in tokens, when they differ (empty: every
      group's is ``block_size``). The pages of every group are ``page_bytes`` long (vLLM evens
      them out); ``block_size`` and the geometry above are those of the pages the mover reads
      them through, and each group's own geometry is part of its name in ``groups``.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    paged_layout: PagedLayout = PagedLayout.LBHNC
    use_mla: bool = False
    cache_dtype: str = "auto"
    interior: str = ""
    content_bytes: int = 0
    groups: tuple[str, ...] = ()
    states: tuple[str, ...] = ()
    group_block_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"KVLayout.{field} must be a positive int, got {value!r}")
        dtype_from_name(self.dtype)
        if not isinstance(self.cache_dtype, str) or not self.cache_dtype:
            raise LayoutError(
                f"KVLayout.cache_dtype must be a non-empty str, got {self.cache_dtype!r}"
            )
        if not isinstance(self.interior, str):
            raise LayoutError(f"KVLayout.interior must be a str, got {self.interior!r}")
        if not isinstance(self.content_bytes, int) or self.content_bytes < 0:
            raise LayoutError(
                f"KVLayout.content_bytes must be an int >= 0, got {self.content_bytes!r}"
            )
        try:
            object.__setattr__(self, "paged_layout", PagedLayout(self.paged_layout))
        except ValueError:
            raise LayoutError(
                f"KVLayout.paged_layout {self.paged_layout!r} is not a vLLM KV cache layout; "
                f"kvtier moves {', '.join(p.value for p in PagedLayout)}"
            ) from None
        groups = self.groups
        if not isinstance(groups, tuple) or len(groups) == 1:
            raise LayoutError(
                f"KVLayout.groups must be a tuple of two or more group kinds, or empty; "
                f"got {groups!r}"
            )
        if any(not isinstance(g, str) or not g for g in groups):
            raise LayoutError(f"KVLayout.groups must hold non-empty strs, got {groups!r}")
        if not isinstance(self.states, tuple) or any(
            not isinstance(g, str) or not g for g in self.states
        ):
            raise LayoutError(
                f"KVLayout.states must be a tuple of non-empty strs, got {self.states!r}"
            )
        sizes = self.group_block_sizes
        if sizes and (
            not isinstance(sizes, tuple)
            or len(sizes) != len(groups)
            or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in sizes)
        ):
            raise LayoutError(
                f"KVLayout.group_block_sizes must be empty or one positive int per group "
                f"({len(groups)}), got {sizes!r}"
            )
        if self.use_mla and self.num_kv_heads != 1:
            raise LayoutError(
                f"an MLA layout has one latent 'head', got num_kv_heads={self.num_kv_heads}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the engine's KV tensors."""
        return dtype_from_name(self.dtype)

    @property
    def cell_bytes(self) -> int:
        """Bytes per head slot and token (``C``)."""
        if self.content_bytes:
            return self.content_bytes
        per_head = self.head_size * (1 if self.use_mla else 2)
        return per_head * self.torch_dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's one block: ``H * block_size * C``."""
        return self.num_kv_heads * self.block_size * self.cell_bytes

    @property
    def num_groups(self) -> int:
        """KV cache groups: row sections of a chunk's block."""
        return max(1, len(self.groups))

    @property
    def slot_block_sizes(self) -> tuple[int, ...]:
        """Each group's block size in tokens (one per row of a hybrid slot mapping)."""
        return self.group_block_sizes or (self.block_size,) * self.num_groups

    @property
    def block_tokens(self) -> int:
        """Tokens of one kvtier block, the hit granularity: the block size, or the least
        common multiple of the groups' block sizes."""
        return math.lcm(*self.slot_block_sizes)

    @property
    def group_rows(self) -> tuple[int, ...]:
        """Rows of each group in one kvtier block (its blocks of ``block_tokens``)."""
        b = self.block_tokens
        return tuple(b // s for s in self.slot_block_sizes)

    @property
    def rows_per_block(self) -> int:
        return sum(self.group_rows)

    @property
    def chunk_dtype(self) -> torch.dtype:
        return CHUNK_DTYPE

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int]:
        """A chunk of ``num_tokens`` (whole kvtier blocks) in host memory: ``[blocks *
        rows_per_block, layers, page]``."""
        bt = self.block_tokens
        if num_tokens % bt:
            raise LayoutError(f"a chunk of {num_tokens} tokens is not whole blocks of {bt}")
        rows = num_tokens // bt * self.rows_per_block
        return (rows, self.num_layers, self.page_bytes)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """A state entry in host memory: one block of each state group, ``[groups, layers,
        page]``."""
        if not self.states:
            raise LayoutError("this layout has no state groups")
        return (len(self.states), self.num_layers, self.page_bytes)

    def bytes_per_token(self) -> int:
        return self.rows_per_block * self.num_layers * self.page_bytes // self.block_tokens

    def chunk_nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token() * num_tokens

    def max_entry_nbytes(self, chunk_size: int) -> int:
        """The largest stored entry's bytes: a full chunk, or a state entry when larger."""
        n = self.chunk_nbytes(chunk_size)
        if self.states:
            rows, layers, page = self.state_shape
            n = max(n, rows * layers * page)
        return n

    def expected_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """The per-layer logical view vLLM hands over, in elements: ``[B, H, N, C]``."""
        c = self.cell_bytes
        itemsize = self.torch_dtype.itemsize
        if c % itemsize:
            raise LayoutError(f"{c} content bytes are not whole {self.dtype} elements")
        return (num_blocks, self.num_kv_heads, self.block_size, c // itemsize)

    def fingerprint(self) -> str:
        """A short stable digest of every field; part of every chunk key."""
        fields = asdict(self)
        fields["paged_layout"] = self.paged_layout.value
        if not self.groups:
            del fields["groups"]  # a one-group engine keeps the fingerprint it always had
        if not self.states:
            del fields["states"]
        if not self.group_block_sizes:
            del fields["group_block_sizes"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    def describe(self) -> str:
        """One line for logs and errors."""
        mla = " mla" if self.use_mla else ""
        groups = f", groups {' + '.join(self.groups)}" if self.groups else ""
        if self.group_block_sizes:
            groups += f" (blocks {'/'.join(map(str, self.group_block_sizes))})"
        if self.states:
            groups += f", states {' + '.join(self.states)}"
        return (
            f"{self.paged_layout.value} {self.num_layers} layers x {self.page_bytes}-byte pages "
            f"(heads {self.num_kv_heads}, block {self.block_size}, {self.dtype}/"
            f"{self.cache_dtype}{mla}, interior {self.interior or 'unnamed'}{groups})"
        )
