"""The page geometry of the KV cache vLLM hands over, read from vLLM, never guessed from a shape.

vLLM 0.32 (RFC #42082) allocates the KV cache in one backing buffer and hands a connector, on
every platform, per-layer logical views ``[kernel_blocks, H, N, C]`` whose strides follow the
resolved ``KVCacheLayout``. What kvtier needs comes from vLLM's own objects:

- the resolved layout: ``cache_config.get_resolved_kv_cache_layout()`` (the engine core
  resolves it once and records it in every worker), else ``KVCacheConfig.kv_cache_layout``;
- the cache spec of the layers' KV cache group (``KVCacheConfig.kv_cache_groups``): manager
  block size, head slots, head size, content bytes per cell (fp8 packing included), MLA;
- the manager block count (``KVCacheConfig.num_blocks``): with kernel block splitting the
  views' first dimension counts kernel blocks;
- the interior writer: the layers' attention backend and, for vLLM CPU, the ISA its builder
  selected (``amx``, ``vec``, ``vec16``, ... pack K differently), found as vLLM finds it.

The page positions themselves come from the views' strides (``kvtier.core.platform.pages``). A hybrid
model's groups (``groups.py``) share those views: kvtier moves the primary group's and keys the
chunk rows by group; a Mamba group's states sit in the same pages and are named by
``KVLayout.states`` (state entries, ``kvtier.core.engine.states``). What kvtier cannot move (groups of another kind or geometry, a spec without
per-layer views) is a ``LayoutError`` naming it and what is supported.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout, dtype_name
from kvtier.vllm_integration.group_views import shared_views
from kvtier.vllm_integration.groups import cache_groups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if not found:
        raise LayoutError(f"cannot find a layer index in KV cache name {name!r}")
    return int(found[-1])


def ordered_names(kv_caches: Mapping[str, torch.Tensor]) -> list[str]:
    """The layer names in layer order (the dict's order is not guaranteed to be it)."""
    names = sorted(kv_caches, key=layer_index)
    indices = [layer_index(n) for n in names]
    if len(set(indices)) != len(indices):
        raise LayoutError(f"two KV tensors claim the same layer: {names}")
    return names


@dataclass(frozen=True)
class CacheSpec:
    """What kvtier reads of one vLLM attention cache spec (``AttentionSpec``)."""

    block_size: int
    num_heads: int  # head slots of the page (vLLM's ``num_heads``)
    head_size: int
    content_bytes: int  # per head slot and token (vLLM's ``state_content_size_bytes``)
    use_mla: bool
    kind: str  # the spec's class name (FullAttentionSpec, MLAAttentionSpec, ...)

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's block."""
        return self.num_heads * self.block_size * self.content_bytes

    @classmethod
    def of(cls, spec: Any) -> CacheSpec:
        from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

        if not isinstance(spec, AttentionSpec):
            raise LayoutError(
                f"kvtier moves attention KV pages; a {type(spec).__name__} cache (Mamba or "
                f"linear-attention state) is not supported"
            )
        return cls(
            block_size=int(spec.block_size),
            num_heads=int(spec.num_heads),
            head_size=int(spec.head_size),
            content_bytes=int(spec.state_content_size_bytes),
            use_mla=isinstance(spec, MLAAttentionSpec),
            kind=type(spec).__name__,
        )


def group_spec(kv_cache_config: KVCacheConfig, layer_names: Sequence[str]) -> CacheSpec:
    """The one cache spec of the group holding ``layer_names``; a ``LayoutError`` when they
    span several groups or their per-layer specs differ."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    wanted = set(layer_names)
    groups = [g for g in kv_cache_config.kv_cache_groups if wanted & set(g.layer_names)]
    if len(groups) != 1:
        raise LayoutError(
            f"layers {sorted(wanted)} span {len(groups)} KV cache groups; a cache spec is read "
            "per group"
        )
    spec = groups[0].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        specs = {CacheSpec.of(spec.kv_cache_specs[n]) for n in layer_names}
        if len(specs) != 1:
            raise LayoutError(f"the layers' cache specs differ: {sorted(map(str, specs))}")
        return specs.pop()
    return CacheSpec.of(spec)


def evened_groups(specs: Sequence[CacheSpec], writers: Sequence[str]) -> bool:
    """Whether the groups' pages differ in geometry or interior writer (vLLM evened their
    sizes out with different block sizes: Gemma 4), not only in kind (full attention and
    sliding window of one geometry stay as they were, their fingerprints too)."""
    shapes = {dataclasses.replace(s, kind="") for s in specs}
    return len(shapes) > 1 or len(set(writers)) > 1


def geometry(spec: CacheSpec, interior: str) -> str:
    """A group's page geometry and interior writer, as its name in ``KVLayout.groups`` carries
    them where the groups differ: ``block x heads x head size x content bytes, writer``."""
    mla = " mla" if spec.use_mla else ""
    return (
        f"{spec.block_size}x{spec.num_heads}x{spec.head_size}x{spec.content_bytes}{mla},{interior}"
    )


def resolved_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> PagedLayout:
    """The ``KVCacheLayout`` vLLM resolved for this engine."""
    name: str | None = None
    try:
        name = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except (AttributeError, ValueError):
        name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        raise LayoutError(
            "vLLM has not resolved its KV cache layout (cache_config.kv_cache_layout and "
            "KVCacheConfig.kv_cache_layout are unset); kvtier reads the layout from vLLM"
        )
    try:
        return PagedLayout(str(name))
    except ValueError:
        raise LayoutError(
            f"vLLM's KV cache layout {name!r} is not one kvtier moves "
            f"({', '.join(p.value for p in PagedLayout)})"
        ) from None


def interior_writer(
    vllm_config: VllmConfig, layer_names: Sequence[str], spec: CacheSpec, cache_dtype: str
) -> str:
    """The attention backend that writes these layers' pages, with the ISA on vLLM CPU (its
    ``amx`` kernels pack K otherwise than ``vec``/``vec16``): the ISA the layers were given by
    the backend's metadata builder, else the one vLLM's own selection returns."""
    context = vllm_config.compilation_config.static_forward_context
    backends, isas = set(), set()
    for name in layer_names:
        layer = context.get(name)
        backend = getattr(layer, "attn_backend", None)
        backends.add(backend.get_name() if backend is not None else "unknown")
        isa = getattr(layer, "isa", None)
        if isa:
            isas.add(str(isa))
    if len(backends) != 1:
        raise LayoutError(f"the layers use several attention backends: {sorted(backends)}")
    backend_name = backends.pop()
    if backend_name != "CPU_ATTN":
        return backend_name
    if not isas:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        dtype = vllm_config.model_config.dtype  # resolved to a torch dtype by vLLM's config
        if not isinstance(dtype, torch.dtype):
            raise LayoutError(f"vLLM's model dtype {dtype!r} is not resolved to a torch dtype")
        isas.add(_get_attn_isa(dtype, spec.block_size, spec.head_size, cache_dtype))
    if len(isas) != 1:
        raise LayoutError(f"the layers were given several CPU attention ISAs: {sorted(isas)}")
    return f"{backend_name}/{isas.pop()}"


@dataclass(frozen=True)
class Registered:
    """The KV tensors vLLM registered, as kvtier moves them."""

    layout: KVLayout
    caches: list[torch.Tensor]  # in layer order
    layer_of: dict[str, int]  # vLLM's layer name -> position in ``caches``
    num_blocks: int  # manager blocks


def page_layout(
    kv_caches: Mapping[str, torch.Tensor],
    spec: CacheSpec,
    *,
    paged_layout: PagedLayout,
    num_blocks: int,
    cache_dtype: str,
    interior: str,
    groups: tuple[str, ...] = (),
    names: Sequence[str] | None = None,
) -> Registered:
    """The ``KVLayout`` of views ``kv_caches`` of a cache with ``spec`` (checked against the
    views' pages when the mover is built); ``names``: the views kvtier moves, in order (default:
    every one, in layer order)."""
    if not kv_caches:
        raise LayoutError("register_kv_caches got no KV tensors")
    names = list(names) if names is not None else ordered_names(kv_caches)
    caches = [kv_caches[n] for n in names]
    for name, cache in zip(names, caches, strict=True):
        if cache.dim() != 4:
            raise LayoutError(
                f"KV tensor {name!r} of shape {tuple(cache.shape)} is not vLLM's logical "
                f"[blocks, heads, tokens, content] view"
            )
        if cache.dtype != caches[0].dtype:
            raise LayoutError(f"KV tensor {name!r} is {cache.dtype}, not {caches[0].dtype}")
    layout = KVLayout(
        num_layers=len(caches),
        num_kv_heads=spec.num_heads,
        head_size=spec.head_size,
        dtype=dtype_name(caches[0].dtype),
        block_size=spec.block_size,
        paged_layout=paged_layout,
        use_mla=spec.use_mla,
        cache_dtype=cache_dtype,
        interior=interior,
        content_bytes=spec.content_bytes,
        groups=groups,
    )
    return Registered(layout, caches, {n: i for i, n in enumerate(names)}, num_blocks)


def read_registration(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
) -> Registered:
    """What ``register_kv_caches`` got, read through vLLM's config (see the module doc)."""
    groups = cache_groups(kv_cache_config)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    paged_layout = resolved_layout(vllm_config, kv_cache_config)
    num_blocks = int(kv_cache_config.num_blocks)
    if not groups.hybrid:
        names = ordered_names(kv_caches)
        spec = group_spec(kv_cache_config, names)
        return page_layout(
            kv_caches,
            spec,
            paged_layout=paged_layout,
            num_blocks=num_blocks,
            cache_dtype=cache_dtype,
            interior=interior_writer(vllm_config, names, spec, cache_dtype),
        )
    all_groups = kv_cache_config.kv_cache_groups
    rows = groups.rows
    specs = [group_spec(kv_cache_config, all_groups[g].layer_names) for g in rows]
    spec = specs[rows.index(groups.primary)]
    writers = [
        interior_writer(vllm_config, all_groups[g].layer_names, s, cache_dtype)
        for g, s in zip(rows, specs, strict=True)
    ]
    kinds = [groups.kinds[g] for g in rows]
    evened = evened_groups(specs, writers)
    for kind, other in zip(kinds, specs, strict=True):
        differ = [
            f.name
            for f in dataclasses.fields(spec)
            if f.name != "kind" and getattr(other, f.name) != getattr(spec, f.name)
        ]
        if differ and other.page_bytes != spec.page_bytes:
            raise LayoutError(
                f"the {kind} group's pages ({other}) differ from the "
                f"{groups.kinds[groups.primary]} group's ({spec}) in {', '.join(differ)}, "
                f"and their sizes ({other.page_bytes} and {spec.page_bytes} bytes) too; "
                "kvtier stores hybrid models whose groups' pages vLLM evened out to one size. "
                "Serve this model without kvtier"
            )
    if evened:
        # Groups of several geometries (Gemma 4): each group's is part of its name, so the
        # fingerprint tells their pages apart; the mover reads every page through the
        # primary group's views, whose pages are the same bytes (shared_views checks it).
        kinds = [f"{k}@{geometry(s, w)}" for k, s, w in zip(kinds, specs, writers, strict=True)]
    reps, position = shared_views(
        kv_cache_config, kv_caches, groups.primary, groups.mambas, evened=evened
    )
    reg = page_layout(
        kv_caches,
        spec,
        paged_layout=paged_layout,
        num_blocks=num_blocks,
        cache_dtype=cache_dtype,
        interior=writers[rows.index(groups.primary)],
        groups=tuple(kinds) if len(rows) > 1 else (),
        names=reps,
    )
    if groups.block_sizes:
        sizes = tuple(s.block_size for s in specs)
        reg = dataclasses.replace(
            reg, layout=dataclasses.replace(reg.layout, group_block_sizes=sizes)
        )
    if groups.mambas:
        states = tuple(groups.kinds[g] for g in groups.mambas)
        reg = dataclasses.replace(reg, layout=dataclasses.replace(reg.layout, states=states))
    return dataclasses.replace(reg, layer_of=position)


def pages_verifiable(cache_dtype: str, kv_cache_config: KVCacheConfig | None) -> bool:
    """Whether the pages of the engine's cache can be compared as numbers by verification
    (``kvtier.core.verify.verify_dtype``), read from vLLM's cache spec on the scheduler, where
    no KV tensor exists: False for a cache that packs scales next to its values. True when
    there is no single attention group to read (the workers then say what they find)."""
    from kvtier.core.verify import verify_dtype

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        return True
    try:
        spec = group_spec(kv_cache_config, groups[0].layer_names)  # type: ignore[arg-type]
        first = groups[0].kv_cache_spec
        dtype = getattr(first, "dtype", None) or next(iter(first.kv_cache_specs.values())).dtype
        layout = KVLayout(
            num_layers=1,
            num_kv_heads=spec.num_heads,
            head_size=spec.head_size,
            dtype=dtype_name(dtype),
            block_size=spec.block_size,
            use_mla=spec.use_mla,
            cache_dtype=cache_dtype,
            content_bytes=spec.content_bytes,
        )
    except (LayoutError, AttributeError, StopIteration, KeyError):
        return True
    return verify_dtype(layout) is not None
