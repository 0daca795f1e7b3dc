"""Shapes and helpers for the CUDA mover's own tests (the contract is the conformance suite's).

On CPU (tests-cpu) the Triton kernels run through ``TRITON_INTERPRET=1`` at tiny shapes; with
``KVTIER_TEST_DEVICE=cuda`` the same tests run at a model-like size on the GPU. Views are placed
as vLLM 0.32 places them (``fixtures.kv_views.replica_views``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fixtures.kv_views import replica_views
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.core.platform.mover import PageMover, TorchPageMover, Transfer

ON_GPU = os.environ.get("KVTIER_TEST_DEVICE", "cpu") == "cuda"
# (layers, heads, head, block, blocks): the interpreter runs every program in numpy.
SHAPE = (8, 8, 128, 16, 160) if ON_GPU else (2, 2, 8, 4, 24)
LAYERS, HEADS, HEAD, BLOCK, BLOCKS = SHAPE


@pytest.fixture(scope="session")
def device(test_device: torch.device) -> torch.device:
    pytest.importorskip("triton", reason="kvtier-cuda's kernels need triton")
    if test_device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("KVTIER_TEST_DEVICE=cuda but torch sees no CUDA device")
    if test_device.type not in ("cpu", "cuda"):
        pytest.skip(f"the CUDA mover tests run on cpu (interpreter) or cuda, not {test_device}")
    if test_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on CPU the kernels need TRITON_INTERPRET=1 (set by tests/conftest.py)")
    return test_device


def make_layout(paged: PagedLayout = PagedLayout.LBHNC, **fields: object) -> KVLayout:
    base: dict[str, object] = {
        "num_layers": LAYERS,
        "num_kv_heads": HEADS,
        "head_size": HEAD,
        "dtype": "bfloat16",
        "block_size": BLOCK,
        "paged_layout": paged,
    }
    return KVLayout(**{**base, **fields})  # type: ignore[arg-type]


def storage_bytes(view: torch.Tensor) -> torch.Tensor:
    storage = view.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def make_views(
    layout: KVLayout, device: torch.device, seed: int, blocks: int = BLOCKS
) -> list[torch.Tensor]:
    """vLLM-placed views whose whole buffer holds random bytes."""
    views = replica_views(layout, blocks, device)
    raw = storage_bytes(views[0])
    gen = torch.Generator(device=device).manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device, generator=gen))
    return views


def twin(views: list[torch.Tensor], layout: KVLayout) -> TorchPageMover:
    """The torch reference over a copy of ``views``' buffer."""
    copy = replica_views(layout, int(views[0].shape[0]), views[0].device)
    storage_bytes(copy[0]).copy_(storage_bytes(views[0]))
    return TorchPageMover(copy, layout, int(views[0].shape[0]))


def same_cache(a: PageMover, b: PageMover) -> bool:
    return torch.equal(storage_bytes(a.kv_caches[0]).cpu(), storage_bytes(b.kv_caches[0]).cpu())


class Objects:
    """Host objects of ``lengths`` blocks each, filled with random bytes, from one arena."""

    def __init__(self, arena: HostArena, layout: KVLayout, lengths: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.objs: list[MemoryObj] = []
        for n in lengths:
            tokens = n * layout.block_size
            meta = MemoryObjMeta(layout.chunk_shape(tokens), torch.uint8, tokens)
            obj = arena.allocate(meta)
            assert obj is not None
            obj.tensor.copy_(
                torch.randint(0, 256, obj.tensor.shape, dtype=torch.uint8, generator=gen)
            )
            self.objs.append(obj)
        arena.tracked.append(self)  # type: ignore[attr-defined]

    def transfers(self, blocks: list[torch.Tensor]) -> list[Transfer]:
        return [Transfer(o, b) for o, b in zip(self.objs, blocks, strict=True)]

    def snapshot(self) -> list[torch.Tensor]:
        return [o.tensor.clone() for o in self.objs]

    def release(self) -> None:
        for o in self.objs:
            if not o.released:
                o.release()


def random_blocks(lengths: list[int], seed: int, offset: int = 0) -> list[torch.Tensor]:
    """Distinct random block ids for chunks of ``lengths`` blocks."""
    perm = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))[offset:]
    out, at = [], 0
    for n in lengths:
        out.append(perm[at : at + n].clone())
        at += n
    return out


@pytest.fixture
def arena(device: torch.device) -> Iterator[HostArena]:
    """A host arena (one segment, so one registration, pinned, on CUDA); test objects are
    released at teardown."""
    if device.type == "cuda":
        from kvtier.cuda.memory import wait_grown
        from kvtier.cuda.platform import CUDAPlatform

        a = CUDAPlatform().create_arena(256 << 20)
        assert wait_grown(a, 30.0), "the arena was not pinned in 30 s"
    else:
        a = HostArena.create(1 << 20)
    a.tracked = []  # type: ignore[attr-defined]
    yield a
    for objs in a.tracked:  # type: ignore[attr-defined]
        objs.release()
    assert a.used_bytes == 0


@pytest.fixture(scope="session")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The native issuer's library (``kvtier/cuda/_issue.c``), built for this session."""
    from kvtier.cuda import native

    if native._compiler() is None:
        pytest.skip("no C compiler here: the native issuer is not built")
    return native.load(native.build(out_dir=tmp_path_factory.mktemp("native")))


def chunk_objects(arena: HostArena, layout: KVLayout, lengths: list[int]) -> list[MemoryObj]:
    """Unfilled host objects of ``lengths`` blocks of ``layout``, allocated one after another."""
    objs = []
    for n in lengths:
        tokens = n * layout.block_size
        obj = arena.allocate(MemoryObjMeta(layout.chunk_shape(tokens), torch.uint8, tokens))
        assert obj is not None
        objs.append(obj)
    return objs
