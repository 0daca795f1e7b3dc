"""KV layout metadata: shapes, fingerprints, and clear errors for tensors that do not fit."""

from __future__ import annotations

import pytest
import torch

from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout


def layout(**kw: object) -> KVLayout:
    base: dict[str, object] = dict(
        num_layers=2,
        num_kv_heads=4,
        head_size=8,
        dtype="bfloat16",
        block_size=16,
        paged_layout=PagedLayout.FLASH_NHD,
    )
    base.update(kw)
    return KVLayout(**base)  # type: ignore[arg-type]


def test_fingerprint_covers_every_field() -> None:
    ref = layout().fingerprint()
    assert ref == layout().fingerprint()
    for change in (
        dict(num_layers=3),
        dict(num_kv_heads=2),
        dict(head_size=16),
        dict(dtype="float16"),
        dict(block_size=32),
        dict(paged_layout=PagedLayout.VLLM_CPU),
        dict(paged_layout=PagedLayout.FLASH_BLOCK_FIRST),
    ):
        assert layout(**change).fingerprint() != ref, change


def test_chunk_shapes_and_sizes() -> None:
    lay = layout()
    assert lay.chunk_shape(10) == (2, 2, 10, 32)
    assert lay.chunk_nbytes(10) == 2 * 2 * 10 * 32 * 2
    mla = layout(num_kv_heads=1, head_size=64, paged_layout=PagedLayout.MLA, use_mla=True)
    assert mla.chunk_shape(10) == (2, 10, 64)
    assert mla.chunk_nbytes(10) == 2 * 10 * 64 * 2


@pytest.mark.parametrize("pl", list(PagedLayout))
def test_expected_shapes_are_accepted(pl: PagedLayout) -> None:
    mla = pl is PagedLayout.MLA
    lay = layout(paged_layout=pl, use_mla=mla, num_kv_heads=1 if mla else 4)
    cache = torch.zeros(lay.expected_cache_shape(7), dtype=torch.bfloat16)
    assert lay.num_blocks_of(cache) == 7


def test_wrong_tensors_get_clear_errors() -> None:
    lay = layout()
    with pytest.raises(LayoutError, match="dtype"):
        lay.num_blocks_of(torch.zeros(2, 5, 16, 4, 8, dtype=torch.float16))
    with pytest.raises(LayoutError, match="does not match"):
        lay.num_blocks_of(torch.zeros(2, 5, 32, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="num_layers"):
        layout(num_layers=0)
    with pytest.raises(LayoutError, match="dtype"):
        layout(dtype="int7")
    with pytest.raises(LayoutError, match="use_mla"):
        layout(paged_layout=PagedLayout.MLA)
    with pytest.raises(ValueError):
        layout(paged_layout="paged_by_magic")
