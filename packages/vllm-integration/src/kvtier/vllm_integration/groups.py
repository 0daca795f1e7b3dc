"""A hybrid model's KV cache groups, as kvtier stores them (vLLM's hybrid memory allocator).

vLLM serves a model that mixes sliding-window and full attention layers with several KV cache
groups: each group has its own spec and block table, and the groups overlay one backing
allocation, group ``g``'s ``i``-th layer at the same bytes as every other group's ``i``-th
layer (``vllm/v1/core/kv_cache_utils.py``, "Groups alias from byte 0"); a block id belongs to
one group at a time. kvtier moves the pages of those shared tensors: a chunk holds, for each of
its blocks, every group's pages (``KVLayout.groups``), so a hit of any length gives every group
what vLLM's hybrid prefix-cache rule asks for. Window groups' pages are stored in full, as a
full-attention layer's are (what a hit can use of them is a later refinement: issue 38).

What kvtier moves this way: attention groups (full attention, sliding window) with the same
number of layers, at least one of them full attention, whose pages are the same bytes: one page
geometry, or (Gemma 4: full-attention heads of 512, window heads of 64) geometries vLLM evened
out to one page size by giving the groups different block sizes. kvtier's block is then the
groups' least common block size (``CacheGroups.hit_block``: hits and chunks are whole blocks of
it) and a chunk holds a section of each group's blocks (``KVLayout.group_block_sizes``). A
Mamba / linear-attention hybrid (Qwen3-Next's Gated DeltaNet) served with vLLM's ``mamba_cache_mode="align"`` (prefix caching on) has Mamba groups beside
one full-attention group: chunks hold the attention group's pages, the Mamba groups' states
are state entries (``kvtier.core.engine.states``, ``scheduler/hybrid.py``). Anything else is a
``LayoutError`` naming the groups.

vLLM frees a window group's blocks that fall out of the window while the request runs, and
puts its null block (id 0) in their place; ``null_to_slot`` makes those "no slot".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError, LayoutError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvtier")

#: vLLM's null block: what a window group's block table holds where a block was freed.
NULL_BLOCK = 0


@dataclass(frozen=True)
class CacheGroups:
    """The KV cache groups of an engine: ``kinds`` in vLLM's group order (empty for one
    group), ``primary`` the first full-attention group (its block ids stand for the
    request's blocks wherever one list is needed), ``windows`` the groups vLLM frees blocks
    of while a request runs (also for a one-group model whose layers are all sliding window:
    ``kinds`` empty, ``windows`` ``(0,)``), ``mambas`` the Mamba groups whose states are
    stored as state entries (``rows``: the others, whose pages a chunk holds)."""

    kinds: tuple[str, ...] = ()
    primary: int = 0
    windows: tuple[int, ...] = ()
    # Per group, what vLLM's KV events say of its spec: (``KVCacheSpecKind`` value, window).
    event_specs: tuple[tuple[str, int | None], ...] = ()
    window_sizes: tuple[int, ...] = ()  # the window groups' windows, in tokens
    # Mamba groups ("align" mode): one recurrent state per request, stored as state entries.
    mambas: tuple[int, ...] = ()
    # Each group's block size in tokens, where they differ (empty: every group's is the
    # engine's block size).
    block_sizes: tuple[int, ...] = ()

    def block_size_of(self, group: int, block_size: int) -> int:
        """Group ``group``'s block size (``block_size``: the engine's, where they are one)."""
        return self.block_sizes[group] if self.block_sizes else block_size

    def hit_block(self, block_size: int) -> int:
        """kvtier's block: the least common multiple of the chunk groups' block sizes (the
        engine's block size where they are one). Hits, chunks and saves are whole blocks of
        it, as vLLM's own hybrid prefix cache hits at multiples of it."""
        return math.lcm(*(self.block_size_of(g, block_size) for g in self.rows))

    @property
    def hybrid(self) -> bool:
        return bool(self.kinds)

    @property
    def tracked(self) -> bool:
        """Whether the scheduler must read live block ids and fence blocks being read: some
        group frees blocks while its requests run, or holds states read by block id."""
        return bool(self.windows or self.mambas)

    @property
    def rows(self) -> tuple[int, ...]:
        """The groups whose pages a chunk holds (every group but the Mamba ones)."""
        return tuple(i for i in range(len(self.kinds) or 1) if i not in self.mambas)

    def live_from(self, block_ids: Sequence[Sequence[int]], block_size: int) -> int:
        """The first token from which every window group still has its blocks (vLLM freed
        the ones before it); ``block_size``: the engine's (``block_size_of``)."""
        first = 0
        for g in self.windows:
            ids = np.asarray(block_ids[g], dtype=np.int64)
            nulls = np.flatnonzero(ids == NULL_BLOCK)
            if nulls.size:
                first = max(first, (int(nulls[-1]) + 1) * self.block_size_of(g, block_size))
        return first


def _kind(spec: Any) -> str:
    """A group's spec as ``KVLayout.groups`` names it (a window's size is part of it)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = sorted({_kind(s) for s in spec.kv_cache_specs.values()})
        return kinds[0] if len(kinds) == 1 else "mixed:" + "+".join(kinds)
    name = type(spec).__name__
    if name == "SlidingWindowSpec":
        return f"{name}/{int(spec.sliding_window)}"
    if name == "MambaSpec":
        # What makes two states interchangeable: the kind of layer and each tensor's shape
        # and element type (the key's layout fingerprint covers it through KVLayout.states).
        mamba = str(getattr(spec.mamba_type, "name", spec.mamba_type)).lower()
        parts = ",".join(
            f"{'x'.join(str(d) for d in shape)}:{str(dt).removeprefix('torch.')}"
            for shape, dt in zip(spec.shapes, spec.dtypes, strict=True)
        )
        return f"{name}/{mamba}/{parts}"
    return name


def _mamba_refusal(spec: Any) -> str | None:
    """Why kvtier cannot store a Mamba group with ``spec``; None when it can."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (
            f"its mamba_cache_mode is {mode!r}: vLLM takes an external hit of a Mamba model only "
            "in 'align' mode (prefix caching on, a model vLLM aligns: Qwen3-Next)"
        )
    if getattr(spec, "num_speculative_blocks", 0):
        return "speculative decoding keeps extra Mamba blocks kvtier does not store"
    return None


def _smallest_window(spec: Any) -> int:
    """The smallest sliding window of a group's spec (of its layers' specs, for a group that
    wraps several)."""
    inner = getattr(spec, "kv_cache_specs", None)
    specs = list(inner.values()) if inner else [spec]
    return min(int(s.sliding_window) for s in specs if type(s).__name__ == "SlidingWindowSpec")


def token_bytes(kv_cache_config: KVCacheConfig | None) -> int:
    """The KV bytes of one token on one rank, every layer of every group (0: unknown), from
    vLLM's KV cache specs (a page is one layer's block on this rank)."""
    total = 0.0
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        page, block = getattr(spec, "page_size_bytes", 0), getattr(spec, "block_size", 0)
        if not page or not block:
            return 0
        total += page * len(group.layer_names) / block
    return int(total)


def cache_groups(kv_cache_config: KVCacheConfig | None) -> CacheGroups:
    """The groups of ``kv_cache_config`` (one group: ``CacheGroups()``); a ``LayoutError``
    naming them when kvtier cannot store them (module docstring)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) == 1 and "SlidingWindowSpec/" in _kind(groups[0].kv_cache_spec):
        # A model whose every layer is sliding window (one group, HMA or not): vLLM frees its
        # blocks behind the window as for a hybrid model's window group.
        return CacheGroups(windows=(0,), window_sizes=(_smallest_window(groups[0].kv_cache_spec),))
    if len(groups) <= 1:
        return CacheGroups()
    kinds = tuple(_kind(g.kv_cache_spec) for g in groups)
    mambas = tuple(i for i, k in enumerate(kinds) if k.startswith("MambaSpec/"))
    supported = all(
        k in ("FullAttentionSpec", "MLAAttentionSpec")
        or k.startswith("SlidingWindowSpec/")
        or k.startswith("MambaSpec/")
        for k in kinds
    )
    full = [i for i, k in enumerate(kinds) if k in ("FullAttentionSpec", "MLAAttentionSpec")]
    counts = {len(g.layer_names) for g in groups}
    if not supported or not full or len(counts) != 1:
        raise LayoutError(
            f"vLLM runs this model with {len(groups)} KV cache groups ({', '.join(kinds)}; "
            f"layers per group {sorted(len(g.layer_names) for g in groups)}); kvtier stores "
            "hybrid models whose groups are full-attention, sliding-window attention or Mamba "
            "('align' mode) with the same number of layers, at least one of them full attention"
        )
    if mambas:
        why = next(
            (w for w in (_mamba_refusal(groups[i].kv_cache_spec) for i in mambas) if w), None
        )
        if why is None and len(kinds) - len(mambas) != 1:
            why = (
                "kvtier stores a Mamba hybrid's attention layers as one full-attention group "
                "(sliding-window layers or several attention groups beside Mamba ones are not "
                "supported yet)"
            )
        if why is not None:
            raise LayoutError(
                f"vLLM runs this model with KV cache groups {', '.join(kinds)}; kvtier cannot "
                f"store its Mamba groups: {why}. Serve this model without kvtier"
            )
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    windows = tuple(i for i, k in enumerate(kinds) if k.startswith("SlidingWindowSpec/"))
    events = tuple(
        (get_kv_cache_spec_kind(g.kv_cache_spec).value,
         get_kv_cache_spec_sliding_window(g.kv_cache_spec))
        for g in groups
    )  # fmt: skip
    sizes = tuple(w for _, w in events if w)
    blocks = tuple(int(g.kv_cache_spec.block_size) for g in groups)
    if len({b for i, b in enumerate(blocks) if i not in mambas}) == 1:
        blocks = ()  # one block size: a chunk's blocks are every group's alike
    return CacheGroups(kinds, full[0], windows, events, sizes, mambas, blocks)


def hash_block_size(vllm_config: Any, kv_cache_config: Any, default: int) -> int:
    """The tokens of one of a request's block hashes (``Request.block_hashes``), as vLLM
    resolves it for these groups (the groups' greatest common block size unless
    ``prefix_match_unit`` says otherwise); ``default`` where this vLLM does not say."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    except ImportError:
        return default
    try:
        return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
    except (AttributeError, TypeError, ValueError):
        return default


def null_to_slot(slots: np.ndarray, block_ids: Sequence[int], block_size: int) -> np.ndarray:
    """``slots`` (one group's, from ``messages.slot_mapping``) with the slots of vLLM's null
    block set to -1: vLLM freed that window block, the group has no page there."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if not (ids == NULL_BLOCK).any():
        return slots
    null = (slots >= 0) & (slots // block_size == NULL_BLOCK)
    slots[null] = -1
    return slots


def check_hybrid(config: KVTierConfig, groups: CacheGroups, *, warn: bool = True) -> None:
    """What a model with sliding-window or Mamba layers (a hybrid model's several KV cache
    groups, or one window group, ``groups.py``) cannot run with: a ``ConfigError`` naming the
    field. ``warn``: also log what it runs with but loses (the scheduler side's connector
    warns; the workers' would repeat it)."""
    if not groups.tracked:
        return
    kinds = ", ".join(groups.kinds) or "one sliding-window group"
    if config.offload == "lazy":
        why = (
            "vLLM names the block holding a Mamba state only in the step that writes it"
            if groups.mambas
            else "vLLM frees their blocks while a request runs"
        )
        raise ConfigError(
            "offload",
            config.offload,
            f"is not supported for a model with sliding-window or Mamba layers (KV cache "
            f"groups {kinds}): {why}, before a lazy save could copy them; use offload=eager",
        )
    if groups.mambas and config.lookup == "index":
        raise ConfigError(
            "lookup",
            config.lookup,
            f"is not supported for a model with Mamba layers (KV cache groups {kinds}): its "
            "hits need a state entry the index does not track; use lookup=probe or auto",
        )
    windows = groups.window_sizes
    if warn and windows and min(windows) < config.chunk_size:
        logger.warning(
            "kvtier: chunk_size %d is larger than this model's smallest sliding window (%d "
            "tokens): a chunk that starts more than a window before the end of a hit or of a "
            "prefill step is not stored (vLLM has freed its window blocks); a chunk_size of at "
            "most the window stores every chunk",
            config.chunk_size,
            min(windows),
        )

    if not groups.hybrid:
        return
    if config.use_layerwise:
        raise ConfigError(
            "use_layerwise",
            True,
            f"is not supported for a hybrid model (KV cache groups {kinds}): each KV tensor "
            "holds a layer of every group, so no layer's pages are complete before the last "
            "group's layer has run",
        )
    if not config.load_async:
        raise ConfigError(
            "load_async",
            False,
            f"must be true for a hybrid model (KV cache groups {kinds}): vLLM takes a failed "
            "load of a model with several KV cache groups only from an asynchronous load",
        )


def hybrid_chunk_size(
    config: KVTierConfig, block_size: int, explicit: bool, states: bool = False
) -> int:
    """The chunk size to run with for vLLM's final ``block_size``: the configured one when it
    is a multiple (a set value that is not is a ``ConfigError`` naming both). Left at the
    default (not ``explicit``), a model with Mamba groups (``states``; vLLM raises its block
    size so one block holds a state) chunks by the block: vLLM offers states at block
    boundaries and kvtier stores them at chunk boundaries. Otherwise the default becomes the
    smallest multiple of the block size at least as large."""
    c = config.chunk_size
    if explicit:
        if c % block_size:
            raise ConfigError(
                "chunk_size", c, f"must be a multiple of vLLM's block size {block_size}"
            )
        return c
    chunk = block_size if states else -(-c // block_size) * block_size
    if chunk != c:
        logger.info(
            "kvtier: chunk_size %d (the default) -> %d for vLLM's block size %d%s",
            c,
            chunk,
            block_size,
            " (a model with Mamba layers: one state per block boundary)" if states else "",
        )
    return chunk
