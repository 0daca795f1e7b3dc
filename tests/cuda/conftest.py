"""Shapes and helpers for the CUDA connector tests.

On CPU (tests-cpu) the Triton kernels run through ``TRITON_INTERPRET=1`` at tiny shapes; with
``KVTIER_TEST_DEVICE=cuda`` the same tests run at an 8B-like size on the GPU.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch

from fixtures.paged_shape import CacheShape, layout_for
from kvtier.core.connector import DeviceConnector, Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObjMeta

ON_GPU = os.environ.get("KVTIER_TEST_DEVICE", "cpu") == "cuda"
# Connector options that change which code runs: the C or the Python planner, and a staging
# ring kept between calls or released after each.
OPTION_SETS = {
    "default": {},
    "python-planner": {"native_planner": False},
    "ring-released": {"staging_buffer": False},
}


@dataclass(frozen=True)
class Shape(CacheShape):
    chunk: int


# The interpreter runs every program in numpy: keep rows and tokens few.
SHAPE = (
    Shape(layers=32, heads=8, head=128, block=16, blocks=256, chunk=256)
    if ON_GPU
    else Shape(layers=2, heads=2, head=8, block=4, blocks=12, chunk=8)
)


@pytest.fixture(scope="session")
def device(test_device: torch.device) -> torch.device:
    pytest.importorskip("triton", reason="kvtier-cuda's kernels need triton")
    if test_device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("KVTIER_TEST_DEVICE=cuda but torch sees no CUDA device")
    if test_device.type not in ("cpu", "cuda"):
        pytest.skip(f"the CUDA connector tests run on cpu (interpreter) or cuda, not {test_device}")
    if test_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on CPU the kernels need TRITON_INTERPRET=1 (set by tests/conftest.py)")
    return test_device


def reference_layout(layout: KVLayout) -> KVLayout:
    """The layout the torch reference runs with: fp8 as uint8 (CPU index_copy_ has no fp8)."""
    if layout.torch_dtype.itemsize == 1:
        return dataclasses.replace(layout, dtype="uint8")
    return layout


def make_layout(paged: PagedLayout, dtype: torch.dtype, shape: Shape = SHAPE) -> KVLayout:
    return layout_for(shape, paged, str(dtype).removeprefix("torch."))


def random_bytes_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random bits of ``t``'s dtype (fp8 included): byte comparisons need no float semantics."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    return raw.view(t.dtype).view(t.shape)


def make_caches(
    layout: KVLayout, device: torch.device, seed: int, blocks: int = SHAPE.blocks
) -> list[torch.Tensor]:
    """Per-layer paged caches of random bytes, generated on ``device`` (fast at GPU sizes)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = layout.expected_cache_shape(blocks)
    nbytes = layout.torch_dtype.itemsize
    for s in shape:
        nbytes *= s
    return [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
        .view(layout.torch_dtype)
        .view(shape)
        for _ in range(layout.num_layers)
    ]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (on its own device) for exact comparisons."""
    return t.contiguous().view(torch.uint8)


def assert_same_objects(mine: Objects, theirs: Objects) -> None:
    """Two sets of host objects hold the same bytes."""
    assert all(torch.equal(a, b) for a, b in zip(mine.bytes(), theirs.bytes(), strict=True))


def assert_same_caches(conn: DeviceConnector, ref: DeviceConnector) -> None:
    """Two connectors' paged caches hold the same bytes, layer by layer."""
    for a, b in zip(conn.kv_caches, ref.kv_caches, strict=True):
        assert torch.equal(as_bytes(a), as_bytes(b))


def assert_store_then_load_like(
    conn: DeviceConnector,
    ref: DeviceConnector,
    arena: HostArena,
    layout: KVLayout,
    lengths: list[int],
    store_slots: list[torch.Tensor],
    load_slots: list[torch.Tensor],
    seed: int,
) -> list[Objects]:
    """``conn`` and the reference ``ref`` store the same objects from ``store_slots`` (the objects
    must then match), then load the same fresh objects into ``load_slots`` (the caches must then
    match). Returns the objects made, for the caller to release."""
    mine, theirs = Objects(arena, layout, lengths, seed), Objects(arena, layout, lengths, seed)
    conn.store(mine.transfers(store_slots))
    ref.store(theirs.transfers(store_slots))
    assert_same_objects(mine, theirs)
    fresh, fresh_ref = (
        Objects(arena, layout, lengths, seed + 10),
        Objects(arena, layout, lengths, seed + 10),
    )
    conn.load(fresh.transfers(load_slots))
    ref.load(fresh_ref.transfers(load_slots))
    assert_same_caches(conn, ref)
    return [mine, theirs, fresh, fresh_ref]


def random_slots(total: int, lengths: list[int], seed: int, holes: str) -> list[torch.Tensor]:
    """Distinct random slots per chunk; ``holes``: "none", "prefix" (skipped prefix) or "scatter"."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(total, generator=gen)
    out, at = [], 0
    for n in lengths:
        s = perm[at : at + n].clone()
        at += n
        if holes == "prefix":
            s[: n // 2] = -1
        elif holes == "scatter":
            s[torch.rand(n, generator=gen) < 0.3] = -1
        out.append(s)
    return out


class Objects:
    """Host objects for a list of chunk lengths, filled with random bytes, from one arena."""

    def __init__(self, arena: HostArena, layout: KVLayout, lengths: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.objs = []
        for n in lengths:
            obj = arena.allocate(MemoryObjMeta(layout.chunk_shape(n), layout.torch_dtype, n))
            assert obj is not None
            obj.tensor.copy_(random_bytes_like(obj.tensor, gen))
            self.objs.append(obj)
        arena.tracked.append(self)

    def transfers(self, slots: list[torch.Tensor]) -> list[Transfer]:
        return [Transfer(o, s) for o, s in zip(self.objs, slots, strict=True)]

    def bytes(self) -> list[torch.Tensor]:
        return [as_bytes(o.tensor).clone() for o in self.objs]

    def release(self) -> None:
        for o in self.objs:
            if not o.released:
                o.release()


@pytest.fixture
def arena(device: torch.device):
    """A host arena (one registration, pinned, on CUDA); test objects are released at teardown."""
    if device.type == "cuda":
        from kvtier.cuda.platform import CUDAPlatform

        a = CUDAPlatform().create_arena(512 << 20)
    else:
        a = HostArena.create(1 << 20)
    a.tracked = []
    yield a
    for objs in a.tracked:
        objs.release()
    assert a.used_bytes == 0
