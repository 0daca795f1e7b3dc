"""The page geometry kvtier reads from vLLM: the KV cache config's spec, its block count, the
resolved layout, over views from vLLM's own ``allocate_kv_cache``; and a chunk written under one
interior writer (vLLM CPU's ISA) is a miss under another, on every tier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from fixtures.kv_views import layer_names, vllm_kv_cache_config, vllm_views
from kvtier.core import CacheEngine, load_config
from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.platform.cpu import CPUPlatform
from kvtier.vllm_integration.layout import CacheSpec, group_spec, layer_index, page_layout

BLOCKS = 9


def geometry(paged: PagedLayout, mla: bool = False, dtype: str = "bfloat16") -> KVLayout:
    return KVLayout(3, 1 if mla else 2, 32 if mla else 16, dtype, 16, paged, use_mla=mla)


def registered(want: KVLayout, kernel_block_size: int | None = None):  # type: ignore[no-untyped-def]
    config = vllm_kv_cache_config(want, BLOCKS)
    views = vllm_views(want, BLOCKS, kernel_block_size=kernel_block_size)
    spec = group_spec(config, list(views))  # type: ignore[arg-type]
    return page_layout(
        views,
        spec,
        paged_layout=want.paged_layout,
        num_blocks=BLOCKS,
        cache_dtype=want.cache_dtype,
        interior="CPU_ATTN/vec",
    )


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("paged", list(PagedLayout), ids=lambda p: p.value)
def test_every_layout_vllm_allocates_is_read_and_moved(paged: PagedLayout, mla: bool) -> None:
    want = geometry(paged, mla)
    reg = registered(want)
    assert reg.layout.page_bytes == want.page_bytes
    assert (reg.layout.num_layers, reg.layout.use_mla, reg.layout.paged_layout) == (3, mla, paged)
    assert list(reg.layer_of) == layer_names(3)
    mover = CPUPlatform().create_mover(reg.caches, reg.layout, num_blocks=reg.num_blocks)
    assert mover.num_blocks == BLOCKS


def test_kernel_blocks_count_as_manager_blocks() -> None:
    """vLLM views a 16-token block as two 8-token kernel blocks: the views' first dimension
    counts kernel blocks, block ids from the scheduler count manager blocks."""
    reg = registered(geometry(PagedLayout.LBHNC), kernel_block_size=8)
    assert reg.caches[0].shape[0] == 2 * BLOCKS
    mover = CPUPlatform().create_mover(reg.caches, reg.layout, num_blocks=reg.num_blocks)
    assert mover.num_blocks == BLOCKS and mover.runs.page_bytes == reg.layout.page_bytes


def test_layers_are_ordered_by_index() -> None:
    want = geometry(PagedLayout.LBHNC)
    views = vllm_views(want, BLOCKS)
    shuffled = {n: views[n] for n in reversed(list(views))}
    reg = page_layout(
        shuffled,
        CacheSpec.of(vllm_kv_cache_config(want, BLOCKS).kv_cache_groups[0].kv_cache_spec),  # type: ignore[attr-defined]
        paged_layout=want.paged_layout,
        num_blocks=BLOCKS,
        cache_dtype="auto",
        interior="x",
    )
    assert [layer_index(n) for n in reg.layer_of] == [0, 1, 2]
    assert all(a is views[n] for a, n in zip(reg.caches, layer_names(3), strict=True))


def test_what_kvtier_cannot_move_is_a_clear_error() -> None:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    want = geometry(PagedLayout.LBHNC)
    config = vllm_kv_cache_config(want, BLOCKS)
    names = layer_names(3)
    two_groups = type(
        config
    )(  # type: ignore[operator]
        num_blocks=BLOCKS,
        kv_cache_tensors=config.kv_cache_tensors,  # type: ignore[attr-defined]
        kv_cache_groups=[
            KVCacheGroupSpec(names[:2], config.kv_cache_groups[0].kv_cache_spec),  # type: ignore[attr-defined]
            KVCacheGroupSpec(names[2:], config.kv_cache_groups[0].kv_cache_spec),  # type: ignore[attr-defined]
        ],
    )
    with pytest.raises(LayoutError, match="2 KV cache groups"):
        group_spec(two_groups, names)
    mamba = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.bfloat16,))
    with pytest.raises(LayoutError, match="MambaSpec"):
        CacheSpec.of(mamba)
    views = vllm_views(want, BLOCKS)
    with pytest.raises(LayoutError, match="no KV tensors"):
        page_layout(
            {},
            CacheSpec.of(config.kv_cache_groups[0].kv_cache_spec),
            paged_layout=want.paged_layout,
            num_blocks=BLOCKS,
            cache_dtype="auto",
            interior="x",
        )  # type: ignore[attr-defined]
    flat = {n: v.flatten(1) for n, v in views.items()}
    with pytest.raises(LayoutError, match="logical"):
        page_layout(
            flat,
            CacheSpec.of(config.kv_cache_groups[0].kv_cache_spec),
            paged_layout=want.paged_layout,
            num_blocks=BLOCKS,
            cache_dtype="auto",
            interior="x",
        )  # type: ignore[attr-defined]


@pytest.mark.parametrize("tier", ["local_cpu", "local_disk", "redis"])
def test_a_chunk_of_another_interior_is_a_miss(tier: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    """The same pages, packed by another CPU ISA (``vec`` vs ``amx`` pack K differently): never
    loaded. The host tier is shared by both engines here; disk and Redis are what hosts share."""
    from kvtier.storage.manager import TieredStorageManager

    tiers = ["local_cpu"] if tier == "local_cpu" else ["local_cpu", tier]
    overrides: dict[str, object] = {
        "chunk_size": 32,
        "tiers": tiers,
        "local_cpu_size_gb": 0.01,
        "local_disk_path": str(tmp_path / "disk"),
    }
    if tier == "redis":
        overrides["redis_url"] = request.getfixturevalue("redis_clean").url
    config = load_config(env={}, overrides=overrides)
    tokens = np.arange(64, dtype=np.int64)
    slots = torch.arange(64)

    def engine(isa: str, storage: object = None) -> CacheEngine:
        lay = KVLayout(2, 2, 16, "bfloat16", 16, PagedLayout.LBHNC, interior=f"CPU_ATTN/{isa}")
        eng = CacheEngine(config, lay, model="m", platform=CPUPlatform(), storage=storage)  # type: ignore[arg-type]
        views = [torch.randn(lay.expected_cache_shape(8)).to(torch.bfloat16) for _ in range(2)]
        eng.register_kv_caches(views)
        return eng

    vec = engine("vec")
    assert vec.store(tokens, slots) == 64
    assert vec.storage.flush(10)
    shared = vec.storage if tier == "local_cpu" else None
    amx = engine("amx", shared)
    assert amx.lookup(tokens) == 0
    assert not amx.retrieve(tokens, slots).any()
    same = engine("vec", shared)
    assert same.lookup(tokens) == 64, "the control: the same interior hits"
    for e in {id(x): x for x in (vec, amx, same)}.values():
        if isinstance(e.storage, TieredStorageManager) or e.storage is not shared:
            e.close()
