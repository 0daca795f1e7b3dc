"""The device suite's views are vLLM's own, and pages written by vLLM's own CPU cache writer
round-trip byte for byte under every ISA this machine runs.

``fixtures.kv_views.replica_views`` (what the GPU suite builds, having no vLLM) must equal vLLM
0.32's ``allocate_kv_cache`` views in shape, strides and storage offset for every layout vLLM can
resolve, MHA and MLA, bf16 and fp8, with kernel block splitting.
"""

from __future__ import annotations

import functools

import pytest
import torch
from device_cases import CASE_IDS, CASES, Case, make_layout

from fixtures.kv_views import layer_names, replica_views, vllm_views
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.core.platform import mover as mover_module
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.core.platform.mover import Transfer

pytest.importorskip("vllm", reason="needs vLLM")

BLOCKS = 12


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"), [("bfloat16", "auto"), ("float8_e4m3fn", "fp8_e4m3")]
)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_replica_views_are_vllms_own(case: Case, dtype: str, cache_dtype: str) -> None:
    layout = make_layout(case, dtype=dtype, cache_dtype=cache_dtype)
    kbs = layout.block_size // case.split if case.split > 1 else None
    theirs = vllm_views(layout, BLOCKS, kernel_block_size=kbs)
    ours = replica_views(layout, BLOCKS, kernel_block_size=kbs)
    for name, mine in zip(layer_names(layout.num_layers), ours, strict=True):
        view = theirs[name]
        assert (view.shape, view.stride(), view.storage_offset(), view.dtype) == (
            mine.shape,
            mine.stride(),
            mine.storage_offset(),
            mine.dtype,
        ), name


ISAS = ["vec", "vec16", "amx"]


@functools.cache
def _writes(isa: str) -> bool:
    """Whether vLLM's loaded CPU kernels have ``isa``'s cache writer. Its AVX-512 builds write
    every ISA's packing on any such CPU (it only moves bytes; AMX instructions are for
    attention), so the AMX interior is tested without AMX; its AVX2 build (``_C_AVX2``, loaded on
    a CPU without AVX-512, where vLLM never picks ``amx``) has no ``amx`` writer."""
    from vllm import _custom_ops as ops

    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        return False  # a vLLM build without CPU kernels (the CUDA one: tests-vllm-next)
    key = torch.zeros(32, 1, 64, dtype=torch.bfloat16)
    k, v = torch.zeros(2, 1, 1, 32, 64, dtype=torch.bfloat16)
    try:
        ops.cpu_attn_reshape_and_cache(key, key, k, v, torch.arange(32), isa)
    except RuntimeError as exc:
        if "Unsupported CPU attention configuration" not in str(exc):
            raise
        return False
    return True


def _need_writer(isa: str) -> None:
    if not _writes(isa):
        pytest.skip(
            f"vLLM's loaded kernels have no {isa} CPU cache writer (its AVX2 build, or a build "
            "without CPU kernels)"
        )


def test_vllms_amx_writer_packs_k_otherwise_than_vec() -> None:
    """The same K written by vLLM's ``amx`` and ``vec`` writers: ``amx`` puts token 1's dims 0
    and 1 at elements 2 and 3 of the block, ``vec`` at 1 and 33 (MACHINE_FACTS). The pages
    differ, which is why the interior writer is part of the fingerprint."""
    from vllm import _custom_ops as ops

    _need_writer("amx")
    n, d = 32, 64
    key = torch.arange(n * d, dtype=torch.float32).reshape(n, 1, d).to(torch.bfloat16)
    pages = {}
    for isa in ("vec", "amx"):
        cache = torch.zeros(1, 1, 2 * n, d, dtype=torch.bfloat16)
        k, v = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, torch.zeros_like(key), k, v, torch.arange(n), isa)
        pages[isa] = k.flatten()
    assert pages["amx"][2:4].tolist() == key[1, 0, :2].tolist()
    assert [pages["vec"][1].item(), pages["vec"][33].item()] == key[1, 0, :2].tolist()
    assert not torch.equal(pages["amx"], pages["vec"])


@pytest.mark.parametrize("by_block", [False, True], ids=["index_copy", "by_block"])
@pytest.mark.parametrize("paged", [PagedLayout.LBHNC, PagedLayout.BLHNC], ids=lambda p: p.value)
@pytest.mark.parametrize("isa", ISAS)
def test_pages_written_by_vllms_cpu_writer_round_trip(
    isa: str, paged: PagedLayout, by_block: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM CPU's ``cpu_attn_reshape_and_cache`` packs K by ISA; kvtier copies the packed pages
    as they are: stored from some blocks and loaded into others, every byte lands, on both of
    the CPU mover's load paths (``by_block``: what it does for large blocks)."""
    from vllm import _custom_ops as ops

    _need_writer(isa)
    if by_block:
        monkeypatch.setattr(mover_module, "BLOCK_COPY_BYTES", 0)

    block = 16 if isa == "vec16" else 32
    heads, head = 2, 64
    layout = KVLayout(3, heads, head, "bfloat16", block, paged, interior=f"CPU_ATTN/{isa}")
    views = vllm_views(layout, BLOCKS)
    caches = [views[n] for n in layer_names(layout.num_layers)]
    src, dst = [3, 7, 1], [10, 0, 5]
    tokens = len(src) * block
    slots = torch.tensor([b * block + i for b in src for i in range(block)], dtype=torch.long)
    gen = torch.Generator().manual_seed(1)
    for cache in caches:
        key = torch.randn(tokens, heads, head, generator=gen).to(torch.bfloat16)
        value = torch.randn(tokens, heads, head, generator=gen).to(torch.bfloat16)
        kv = cache.view(BLOCKS, heads, 2 * block, head)
        key_cache, value_cache = kv.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        assert cache[src].abs().sum() > 0, "the writer wrote nothing"
    mover = CPUPlatform().create_mover(caches, layout, num_blocks=BLOCKS)
    arena = HostArena.create(4 << 20)
    obj = arena.allocate(MemoryObjMeta(layout.chunk_shape(tokens), torch.uint8, tokens))
    assert obj is not None
    with obj:
        mover.store([Transfer(obj, torch.tensor(src))])
        mover.load([Transfer(obj, torch.tensor(dst))])
    for cache in caches:
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(cache[s].view(torch.uint8), cache[d].view(torch.uint8))
