"""KV page geometry: chunk shapes, fingerprints, pages derived from a view's strides, and clear
errors for layouts and views that do not fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fixtures.kv_views import replica_views
from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.platform.pages import block_runs, page_runs


def layout(**kw: object) -> KVLayout:
    base: dict[str, object] = dict(
        num_layers=2,
        num_kv_heads=4,
        head_size=8,
        dtype="bfloat16",
        block_size=16,
        paged_layout=PagedLayout.LBHNC,
    )
    base.update(kw)
    return KVLayout(**base)  # type: ignore[arg-type]


def test_fingerprint_covers_every_field() -> None:
    """Pages are interchangeable only between identical geometries and interiors: every field
    changes the fingerprint (one change per field, so a new field without a line here fails)."""
    ref = layout().fingerprint()
    assert ref == layout().fingerprint()
    changes = {
        "num_layers": 3,
        "num_kv_heads": 2,
        "head_size": 16,
        "dtype": "float16",
        "block_size": 32,
        "paged_layout": PagedLayout.BLHNC,
        "use_mla": True,
        "cache_dtype": "fp8_e4m3",
        "interior": "CPU_ATTN/amx",
        "content_bytes": 64,
        "groups": ("SlidingWindowSpec/128", "FullAttentionSpec"),
        "states": ("MambaSpec/gated_delta_net/3x1024:bfloat16,4x128x128:float32",),
        "group_block_sizes": (128, 16),
    }
    assert set(changes) == {f.name for f in dataclasses.fields(KVLayout)}
    two = ("SlidingWindowSpec/64", "FullAttentionSpec")
    for name, value in changes.items():
        extra: dict[str, object] = {"num_kv_heads": 1} if name == "use_mla" else {}
        base = ref
        if name == "group_block_sizes":  # only with groups: against the same groups without
            extra, base = {"groups": two}, layout(groups=two).fingerprint()
        assert layout(**{name: value, **extra}).fingerprint() != base, name
    amx, vec = layout(interior="CPU_ATTN/amx"), layout(interior="CPU_ATTN/vec")
    assert amx.page_bytes == vec.page_bytes and amx.fingerprint() != vec.fingerprint()


def test_groups_keep_the_one_group_fingerprint_and_order_matters() -> None:
    """A one-group engine's stored chunks stay valid (no ``groups`` field in its digest); two
    group orders are two chunk row orders, so two fingerprints."""
    ref = layout()
    assert dataclasses.replace(ref, groups=()).fingerprint() == ref.fingerprint()
    assert dataclasses.replace(ref, states=()).fingerprint() == ref.fingerprint()
    a = layout(groups=("SlidingWindowSpec/128", "FullAttentionSpec"))
    b = layout(groups=("FullAttentionSpec", "SlidingWindowSpec/128"))
    assert a.fingerprint() != b.fingerprint()
    assert "groups SlidingWindowSpec/128 + FullAttentionSpec" in a.describe()


def test_hybrid_chunk_holds_every_groups_pages() -> None:
    one, two = layout(), layout(groups=("SlidingWindowSpec/64", "FullAttentionSpec"))
    assert two.num_groups == 2 and one.num_groups == 1
    assert two.chunk_shape(32) == (4, 2, one.page_bytes)
    assert two.bytes_per_token() == 2 * one.bytes_per_token()
    assert two.chunk_nbytes(32) == 2 * one.chunk_nbytes(32)


def test_groups_of_several_block_sizes_hold_a_section_each() -> None:
    """Gemma 4: window groups of 128-token blocks beside a full-attention group of 16-token
    blocks (pages of one size). kvtier's block is 128 tokens and holds one window block and 8
    full blocks; a chunk stays whole kvtier blocks, block-major."""
    one = layout()
    g4 = layout(
        groups=("SlidingWindowSpec/64", "SlidingWindowSpec/64", "FullAttentionSpec"),
        group_block_sizes=(128, 128, 16),
    )
    assert g4.block_tokens == 128 and g4.group_rows == (1, 1, 8) and g4.rows_per_block == 10
    assert g4.slot_block_sizes == (128, 128, 16)
    assert g4.chunk_shape(256) == (20, 2, one.page_bytes)
    assert g4.chunk_nbytes(256) == 20 * 2 * one.page_bytes
    assert "(blocks 128/128/16)" in g4.describe()
    with pytest.raises(LayoutError, match="whole blocks of 128"):
        g4.chunk_shape(64)
    same = layout(groups=("SlidingWindowSpec/64", "FullAttentionSpec"))
    assert same.block_tokens == 16 and same.group_rows == (1, 1)


@pytest.mark.parametrize("sizes", [(128,), (128, 0), (128, True), [128, 16]])
def test_bad_group_block_sizes_are_named(sizes: object) -> None:
    with pytest.raises(LayoutError, match=r"KVLayout\.group_block_sizes"):
        layout(groups=("SlidingWindowSpec/64", "FullAttentionSpec"), group_block_sizes=sizes)


@pytest.mark.parametrize("groups", [("FullAttentionSpec",), ["a", "b"], ("a", ""), ("a", 3)])
def test_bad_groups_are_named(groups: object) -> None:
    with pytest.raises(LayoutError, match=r"KVLayout\.groups"):
        layout(groups=groups)


def test_chunk_shapes_and_sizes() -> None:
    lay = layout()
    page = 4 * 16 * 2 * 8 * 2  # heads * block * (K and V of head 8) * bf16
    assert lay.page_bytes == page
    assert lay.chunk_shape(32) == (2, 2, page)
    assert lay.chunk_nbytes(32) == 2 * 2 * page
    assert lay.chunk_dtype == torch.uint8
    mla = layout(num_kv_heads=1, head_size=64, use_mla=True)
    assert mla.page_bytes == 16 * 64 * 2
    assert mla.chunk_shape(16) == (1, 2, 16 * 64 * 2)
    packed = layout(content_bytes=20)  # a quantized cell: values and scales, vLLM's byte count
    assert packed.page_bytes == 4 * 16 * 20
    with pytest.raises(LayoutError, match="whole blocks"):
        lay.chunk_shape(10)


@pytest.mark.parametrize("pl", list(PagedLayout), ids=lambda p: p.value)
def test_pages_come_from_the_strides(pl: PagedLayout) -> None:
    """One run per page for block-compact layouts, one per head slot for head-outer ones; a
    block's every layer is one run for block-outer, block-compact ones."""
    lay = layout(paged_layout=pl)
    views = replica_views(lay, 7)
    runs = page_runs(views[0], 7)
    assert runs.page_bytes == lay.page_bytes
    head_outer = pl in (PagedLayout.LHBNC, PagedLayout.BHLNC)
    assert runs.runs_per_page == (lay.num_kv_heads if head_outer else 1)
    assert block_runs(views, runs) == (pl in (PagedLayout.BLHNC, PagedLayout.BLNHC))


def test_kernel_blocks_make_one_page() -> None:
    """A manager block viewed as two kernel blocks: a page spans both."""
    lay = layout()
    views = replica_views(lay, 5, kernel_block_size=8)
    assert views[0].shape[0] == 10
    runs = page_runs(views[0], 5)
    assert runs.page_bytes == lay.page_bytes and runs.runs_per_page == 1


def test_wrong_layouts_and_views_get_clear_errors() -> None:
    with pytest.raises(LayoutError, match="num_layers"):
        layout(num_layers=0)
    with pytest.raises(LayoutError, match="dtype"):
        layout(dtype="int7")
    with pytest.raises(LayoutError, match="MLA"):
        layout(use_mla=True)
    with pytest.raises(LayoutError, match="LBHNC"):
        layout(paged_layout="flash_nhd")
    with pytest.raises(LayoutError, match="content_bytes"):
        layout(content_bytes=-1)
    with pytest.raises(LayoutError, match="manager blocks"):
        page_runs(torch.zeros(7, 4, 16, 16), 2)
    with pytest.raises(LayoutError, match="contiguous"):
        page_runs(torch.zeros(7, 4, 16, 16).transpose(2, 3), 7)
