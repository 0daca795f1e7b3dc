"""Helpers of the XPU tests: KV views placed as vLLM 0.32 places them, host objects, and page
reads by a route independent of ``kvtier.core.platform.pages``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fixtures.kv_views import replica_views
from kvtier.core import HostArena, KVLayout, MemoryObj, MemoryObjMeta, PagedLayout, Transfer

NUM_BLOCKS = 24
BLOCK = 4


@dataclass(frozen=True)
class Geometry:
    """A KV layout and how many kernel blocks vLLM views one manager block as."""

    layout: KVLayout
    split: int = 1


def _layout(paged: PagedLayout, mla: bool = False) -> KVLayout:
    return KVLayout(
        3, 1 if mla else 2, 16 if mla else 8, "bfloat16", BLOCK, paged, use_mla=mla, interior="test"
    )


# Every vLLM layout (block-compact, block-outer and head-outer), MLA, and kernel block splitting.
GEOMETRIES = {
    **{p.value: Geometry(_layout(p)) for p in PagedLayout},
    "LBHNC-mla": Geometry(_layout(PagedLayout.LBHNC, mla=True)),
    "BHLNC-mla": Geometry(_layout(PagedLayout.BHLNC, mla=True)),
    "LBHNC-split2": Geometry(_layout(PagedLayout.LBHNC), split=2),
}

# Three chunks in blocks, the last one partial (2 of 4 blocks).
SIZES_3 = (4, 4, 2)


def xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def storage_bytes(view: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``view`` as a flat uint8 tensor (writing it writes the cache)."""
    storage = view.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=view.device)
    return raw.set_(storage, 0, (storage.nbytes(),), (1,))


def make_caches(
    geometry: Geometry, device: torch.device, seed: int = 0, separate: bool = False
) -> list[torch.Tensor]:
    """vLLM-placed views over one buffer of random bytes; ``separate``: each layer copied into
    a tensor of its own (layers in several storages, as a hand-built cache has them)."""
    lay = geometry.layout
    kbs = lay.block_size // geometry.split if geometry.split > 1 else None
    views = replica_views(lay, NUM_BLOCKS, device, kernel_block_size=kbs)
    raw = storage_bytes(views[0])
    g = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return [v.clone() for v in views] if separate else views


def make_arena(device: torch.device, nbytes: int = 1 << 20) -> HostArena:
    """Pinned where the device can pin (the real data path), pageable on CPU."""
    return HostArena.create(nbytes, pin_memory=device.type != "cpu")


def make_obj(arena: HostArena, layout: KVLayout, num_blocks: int, seed: int) -> MemoryObj:
    """A chunk of ``num_blocks`` blocks of random bytes."""
    tokens = num_blocks * layout.block_size
    obj = arena.allocate(MemoryObjMeta(layout.chunk_shape(tokens), layout.chunk_dtype, tokens))
    assert obj is not None
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randint(0, 256, obj.tensor.shape, dtype=torch.uint8, generator=g))
    return obj


def pages_of(
    cache: torch.Tensor, geometry: Geometry, raw: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Every manager block of one layer's view as bytes in address order, on the host: each
    block's elements mapped to storage addresses (never through ``kvtier.core.platform.pages``). ``raw``:
    a copy of the view's storage to read instead of the storage itself."""
    data = (storage_bytes(cache) if raw is None else raw).cpu()
    item, s = cache.element_size(), geometry.split
    out = []
    for block in range(NUM_BLOCKS):
        view = cache[block * s : (block + 1) * s]
        index = torch.zeros((), dtype=torch.long)
        for size, stride in zip(view.shape, view.stride(), strict=True):
            index = index.unsqueeze(-1) + torch.arange(size) * stride
        elems = index.flatten().sort().values + view.storage_offset()
        out.append(data[(elems.unsqueeze(1) * item + torch.arange(item)).flatten()])
    return out


def all_pages(caches: Sequence[torch.Tensor], geometry: Geometry) -> list[list[torch.Tensor]]:
    """``[layer][block]`` pages of every layer's view."""
    return [pages_of(c, geometry) for c in caches]


def transfers_for(
    objs: Sequence[MemoryObj], blocks: Sequence[Sequence[int]], device: torch.device
) -> list[Transfer]:
    return [
        Transfer(o, torch.tensor(list(b), dtype=torch.long, device=device))
        for o, b in zip(objs, blocks, strict=True)
    ]


def chunk_blocks(sizes: Sequence[int], seed: int, holes: bool) -> list[list[int]]:
    """Distinct random cache blocks per chunk; with ``holes``: a -1 prefix (the engine already
    has those blocks), a -1 in the middle, and one extra chunk that is all -1."""
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for n in sizes:
        out.append(perm[at : at + n].tolist())
        at += n
    if holes:
        out[0][:2] = [-1] * 2
        out[1][2] = -1
        out.append([-1] * 2)
    return out
