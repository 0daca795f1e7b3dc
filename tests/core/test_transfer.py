"""``Transfer``: one block id per object block, integers only, held as contiguous int64 on the
host (the CUDA mover's native issuer reads them in place; the conformance suite moves ids of
other forms on every platform)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.core.platform.mover import Transfer

LAYOUT = KVLayout(2, 2, 16, "bfloat16", 16, PagedLayout.LBHNC)


def _object(arena: HostArena, blocks: int):  # type: ignore[no-untyped-def]
    tokens = blocks * LAYOUT.block_size
    obj = arena.allocate(MemoryObjMeta(LAYOUT.chunk_shape(tokens), torch.uint8, tokens))
    assert obj is not None
    return obj


def test_a_transfer_needs_one_block_id_per_object_block() -> None:
    arena = HostArena.create(1 << 20)
    with _object(arena, 2) as obj, pytest.raises(ValueError, match="block ids"):
        Transfer(obj, torch.tensor([1, 2, 3]))
    with _object(arena, 2) as obj, pytest.raises(ValueError, match="block ids"):
        Transfer(obj, torch.tensor([[1, 2]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool, torch.complex64])
def test_block_ids_that_are_not_integers_are_a_value_error(dtype: torch.dtype) -> None:
    arena = HostArena.create(1 << 20)
    with _object(arena, 1) as obj, pytest.raises(ValueError, match="integers"):
        Transfer(obj, torch.tensor([1], dtype=dtype))


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(-1, 1000), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
    step=st.integers(1, 3),
)
def test_ids_are_kept_as_contiguous_int64_on_the_host_with_their_values(ids, dtype, step) -> None:  # type: ignore[no-untyped-def]
    """Any integer dtype and stride: the same values, as a tensor a mover can read in place;
    ids already in that form are a view of the caller's storage, not a copy."""
    if dtype is torch.uint8:
        ids = [i % 256 for i in ids]
    elif dtype is torch.int16:
        ids = [max(-1, min(i, 32767)) for i in ids]
    given_ids = torch.tensor([v for i in ids for v in [i] * step], dtype=dtype)[::step]
    arena = HostArena.create(1 << 22)
    with _object(arena, len(ids)) as obj:
        t = Transfer(obj, given_ids)
        assert t.blocks.dtype is torch.int64 and t.blocks.is_contiguous() and t.blocks.is_cpu
        assert t.blocks.tolist() == ids
        if dtype is torch.int64 and step == 1:
            assert t.blocks.data_ptr() == given_ids.data_ptr()


def test_a_transfer_keeps_its_ids_when_the_callers_tensor_is_resized_or_repointed() -> None:
    """The shared form is a view: the caller's ``resize_``/``set_`` leaves the transfer with as
    many ids as its object has blocks (a mover reads that many from the data pointer)."""
    arena = HostArena.create(1 << 22)
    with _object(arena, 3) as obj:
        ids = torch.tensor([4, -1, 9])
        t = Transfer(obj, ids)
        ids.resize_(1)
        assert t.blocks.tolist() == [4, -1, 9]
        ids.set_(torch.tensor([1, 2, 3, 4, 5]))
        assert t.blocks.tolist() == [4, -1, 9]
        ids.fill_(0)
        assert t.blocks.tolist() == [4, -1, 9]
