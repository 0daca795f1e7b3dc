"""Helpers of the XPU tests: small paged KV caches, host objects and raw-tensor reads."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core import HostArena, KVLayout, MemoryObj, MemoryObjMeta, PagedLayout, Transfer

NUM_BLOCKS = 24
BLOCK = 4

LAYOUTS = {
    "nhd": KVLayout(3, 2, 8, "bfloat16", BLOCK, PagedLayout.FLASH_NHD),
    "block_first": KVLayout(3, 2, 8, "bfloat16", BLOCK, PagedLayout.FLASH_BLOCK_FIRST),
    "mla": KVLayout(3, 1, 16, "bfloat16", BLOCK, PagedLayout.MLA, use_mla=True),
}

# Three chunks, the last one partial (8 of 16 tokens).
SIZES_3 = (16, 16, 8)


def xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def make_caches(layout: KVLayout, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = layout.expected_cache_shape(NUM_BLOCKS)
    return [
        torch.randn(shape, generator=g).to(layout.torch_dtype).to(device)
        for _ in range(layout.num_layers)
    ]


def make_arena(device: torch.device, nbytes: int = 1 << 20) -> HostArena:
    """Pinned where the device can pin (the real data path), pageable on CPU."""
    return HostArena.create(nbytes, pin_memory=device.type != "cpu")


def make_obj(arena: HostArena, layout: KVLayout, num_tokens: int, seed: int) -> MemoryObj:
    obj = arena.allocate(
        MemoryObjMeta(layout.chunk_shape(num_tokens), layout.torch_dtype, num_tokens)
    )
    assert obj is not None
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(layout.torch_dtype))
    return obj


def token_value(cache: torch.Tensor, layout: KVLayout, slot: int) -> torch.Tensor:
    """One token's K and V (MLA: latent) read straight from the paged tensor, on the host:
    ``[2, h*d]`` (MLA ``[latent]``). Independent of the connectors' indexing."""
    b, o = divmod(slot, layout.block_size)
    if layout.paged_layout is PagedLayout.FLASH_NHD:
        return cache[:, b, o].flatten(1).cpu()
    if layout.paged_layout is PagedLayout.FLASH_BLOCK_FIRST:
        return cache[b, :, o].flatten(1).cpu()
    return cache[b, o].cpu()


def obj_token(obj: MemoryObj, layout: KVLayout, layer: int, i: int) -> torch.Tensor:
    return obj.tensor[layer, i] if layout.use_mla else obj.tensor[:, layer, i]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so comparisons are bit-exact (not value-equal)."""
    return t.detach().cpu().contiguous().view(torch.uint8)


def transfers_for(
    objs: Sequence[MemoryObj], slots: Sequence[Sequence[int]], device: torch.device
) -> list[Transfer]:
    return [
        Transfer(o, torch.tensor(list(s), dtype=torch.long, device=device))
        for o, s in zip(objs, slots, strict=True)
    ]


def chunk_slots(sizes: Sequence[int], seed: int, holes: bool) -> list[list[int]]:
    """Distinct random slots per chunk; with ``holes``: a -1 prefix (the engine already has those
    tokens), a -1 in the middle, and one extra chunk that is all -1."""
    perm = torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for n in sizes:
        out.append(perm[at : at + n].tolist())
        at += n
    if holes:
        out[0][:5] = [-1] * 5
        out[1][7] = -1
        out.append([-1] * 8)
    return out
