"""What the page mover conformance suite runs against, and an oracle independent of the movers.

Every platform's mover is built the public way (``Platform.create_mover``) over KV views placed
exactly as vLLM 0.32's ``allocate_kv_cache`` places them (``fixtures.kv_views.replica_views``,
checked against vLLM's own in ``test_vllm_views.py``). The oracle defines a page's bytes as the
bytes of one manager block of one layer *in address order*, found by mapping the logical view's
elements to storage addresses: it never uses ``kvtier.core.platform.pages``.

``KVTIER_TEST_DEVICE`` picks the cache device: ``cpu`` (CI; the CUDA mover's Triton kernels run
under ``TRITON_INTERPRET=1``) or ``cuda`` (a GPU: every subject runs on CUDA tensors, the XPU
mover through torch.cuda's identical stream API).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from fixtures.kv_views import replica_views
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.core.platform import Platform
from kvtier.core.platform.mover import Transfer


@dataclass(frozen=True)
class Subject:
    """One platform mover with one set of options."""

    id: str
    platform: str
    options: dict[str, object] = field(default_factory=dict)


SUBJECTS = [
    Subject("cpu", "cpu"),
    # The CPU mover loading block by block (what it does where a block's pages are large,
    # ``BLOCK_COPY_BYTES``), on every case here: ``test_page_mover.platform`` lowers the bound.
    Subject("cpu-by-block", "cpu"),
    Subject("xpu", "xpu"),
    Subject("xpu-unstaged", "xpu", {"staging_buffer": False}),
    Subject("cuda", "cuda"),
    Subject("cuda-unstaged", "cuda", {"staging_buffer": False}),
]


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head: int
    block: int
    blocks: int
    lengths: tuple[int, ...]  # chunk lengths in blocks: a ragged batch


ON_GPU = os.environ.get("KVTIER_TEST_DEVICE", "cpu") == "cuda"
# The Triton interpreter runs every program in numpy: tiny on CPU, model-like on a GPU.
SHAPE = (
    Shape(layers=4, heads=8, head=128, block=16, blocks=160, lengths=(16, 16, 9))
    if ON_GPU
    else Shape(layers=2, heads=2, head=8, block=4, blocks=24, lengths=(2, 2, 1))
)


@dataclass(frozen=True)
class Case:
    """One geometry: a vLLM layout, MHA or MLA, and kernel blocks per manager block."""

    paged: PagedLayout
    mla: bool = False
    split: int = 1  # kernel blocks per manager block (vLLM's kernel block splitting)

    @property
    def id(self) -> str:
        return f"{self.paged.value}{'-mla' if self.mla else ''}{f'-split{self.split}' if self.split > 1 else ''}"


# Every layout, MHA and MLA; kernel block splitting where vLLM allows it (layer-outer layouts with
# dense pages: LHBNC only for MLA, whose one head makes its pages dense).
CASES = [Case(p, mla) for p in PagedLayout for mla in (False, True)] + [
    Case(PagedLayout.LBHNC, split=2),
    Case(PagedLayout.LBNHC, split=2),
    Case(PagedLayout.LHBNC, mla=True, split=2),
]
CASE_IDS = [c.id for c in CASES]


def make_layout(case: Case, dtype: str = "bfloat16", cache_dtype: str = "auto") -> KVLayout:
    s = SHAPE
    return KVLayout(
        num_layers=s.layers,
        num_kv_heads=1 if case.mla else s.heads,
        head_size=s.heads * s.head if case.mla else s.head,
        dtype=dtype,
        block_size=s.block,
        paged_layout=case.paged,
        use_mla=case.mla,
        cache_dtype=cache_dtype,
        interior="test",
    )


def make_platform(subject: Subject, device: torch.device) -> Platform:
    """The subject's platform, or a skip saying why it cannot run on ``device``."""
    if subject.platform == "cpu":
        from kvtier.core.platform.cpu import CPUPlatform

        return CPUPlatform()
    if subject.platform == "xpu":
        pytest.importorskip("kvtier.xpu", reason="kvtier-xpu is not installed")
        from kvtier.xpu import XPUPlatform

        return XPUPlatform()
    pytest.importorskip("triton", reason="kvtier-cuda's kernels need triton")
    pytest.importorskip("kvtier.cuda", reason="kvtier-cuda is not installed")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CUDA mover on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest.py)")
    if device.type not in ("cpu", "cuda"):
        pytest.skip(f"the CUDA mover runs on cuda (or cpu, interpreted), not {device}")
    from kvtier.cuda.platform import CUDAPlatform

    return CUDAPlatform()


def random_bytes(shape: Sequence[int], device: torch.device, seed: int) -> torch.Tensor:
    if device.type == "cpu":  # numpy's generator: ~4x torch.randint's bytes a second on a CPU
        data = np.random.default_rng(seed).integers(0, 256, tuple(shape), dtype=np.uint8)
        return torch.from_numpy(data)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, device=device, generator=gen)


def make_caches(
    layout: KVLayout, case: Case, device: torch.device, seed: int
) -> list[torch.Tensor]:
    """vLLM-placed views of ``SHAPE.blocks`` blocks, their whole buffer filled with random bytes
    (random bits of the dtype: byte comparisons need no float semantics, NaNs included)."""
    kbs = layout.block_size // case.split if case.split > 1 else None
    views = replica_views(layout, SHAPE.blocks, device, kernel_block_size=kbs)
    storage = storage_bytes(views[0])
    storage.copy_(random_bytes(storage.shape, device, seed))
    return views


class Arenas:
    """The session's host arenas. On a GPU one per platform and device, shared by every test
    (pinning a 512 MiB arena costs ~0.3 s, which made the CUDA subjects take ~5.5 minutes): each
    test releases what it allocated and checks the arena is empty again (``Arenas.check``). On
    CPU a small pageable arena per test."""

    def __init__(self) -> None:
        self._shared: dict[tuple[str, str], HostArena] = {}

    def get(self, platform: Platform, device: torch.device) -> HostArena:
        """An empty arena for one test: pinned (registered, for CUDA) on a GPU, as in
        production; pageable on CPU."""
        if device.type == "cpu":
            return HostArena.create(4 << 20, pin_memory=False)
        key = (platform.name, str(device))
        arena = self._shared.get(key)
        if arena is None:
            arena = self._shared[key] = _gpu_arena(platform)
        return arena

    def check(self, arena: HostArena) -> None:
        """Fail a test that left objects in ``arena``; a leaking arena is dropped, so the next
        test starts from an empty one."""
        if arena.used_bytes:
            for key, shared in list(self._shared.items()):
                if shared is arena:
                    del self._shared[key]
            raise AssertionError(f"a test leaked host objects ({arena.used_bytes} bytes)")

    def close(self) -> None:
        for arena in self._shared.values():
            arena.close()
        self._shared.clear()


def _gpu_arena(platform: Platform) -> HostArena:
    if platform.name == "cuda":
        from kvtier.cuda.memory import wait_grown

        arena = platform.create_arena(512 << 20)  # pinned in the background: wait for all of it
        assert wait_grown(arena, 60.0), "the CUDA arena was not pinned in 60 s"
        return arena
    return HostArena.create(512 << 20, pin_memory=True)


def storage_bytes(view: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``view`` as a flat uint8 tensor (writing it writes the cache)."""
    storage = view.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def page_offsets(view: torch.Tensor, split: int) -> torch.Tensor:
    """Storage byte offsets of a manager block's page from its block's start, ascending: every
    element of its ``split`` kernel blocks, each element's bytes (the same for every block)."""
    item = view.element_size()
    sizes = (split, *view.shape[1:-1], view.shape[-1] * item)
    strides = (*(s * item for s in view.stride()[:-1]), 1)
    rel = torch.zeros((), dtype=torch.long)
    for size, stride in zip(sizes, strides, strict=True):
        rel = rel.unsqueeze(-1) + torch.arange(size, dtype=torch.long) * stride
    return rel.reshape(-1).sort().values


def page_addresses(
    view: torch.Tensor, block: int, split: int, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """Storage byte addresses of manager block ``block``'s page in the logical view, ascending
    (``offsets``: ``page_offsets(view, split)``, computed once for many blocks)."""
    rel = page_offsets(view, split) if offsets is None else offsets
    item = view.element_size()
    return view.storage_offset() * item + block * split * view.stride(0) * item + rel


class Oracle:
    """Pages read and written by address, never through a mover."""

    def __init__(self, views: Sequence[torch.Tensor], split: int) -> None:
        self.views = list(views)
        self.split = split
        self.storage = storage_bytes(self.views[0]).cpu()
        self._addr: dict[tuple[int, int], torch.Tensor] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    def addresses(self, layer: int, block: int) -> torch.Tensor:
        key = (layer, block)
        if key not in self._addr:
            view = self.views[layer]
            if layer not in self._offsets:
                self._offsets[layer] = page_offsets(view, self.split)
            self._addr[key] = page_addresses(view, block, self.split, self._offsets[layer])
        return self._addr[key]

    def page(self, layer: int, block: int, storage: torch.Tensor | None = None) -> torch.Tensor:
        src = self.storage if storage is None else storage
        return src[self.addresses(layer, block)]

    def after_store(self, before: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """An object that held ``before`` after a store from ``blocks``."""
        want = before.clone()
        for j, b in enumerate(blocks.tolist()):
            if b >= 0:
                for layer in range(len(self.views)):
                    want[j, layer] = self.page(layer, b)
        return want

    def after_load(
        self, objects: Sequence[torch.Tensor], blocks: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """The whole storage after a load of ``objects`` into ``blocks``."""
        want = self.storage.clone()
        for obj, ids in zip(objects, blocks, strict=True):
            for j, b in enumerate(ids.tolist()):
                if b >= 0:
                    for layer in range(len(self.views)):
                        want[self.addresses(layer, b)] = obj[j, layer]
        return want


class Objects:
    """Host objects of ``lengths`` blocks each, filled with random bytes; released at teardown
    by the ``arena`` fixture."""

    def __init__(
        self, arena: HostArena, layout: KVLayout, lengths: Sequence[int], seed: int
    ) -> None:
        self.layout = layout
        self.objs: list[MemoryObj] = []
        for i, n in enumerate(lengths):
            tokens = n * layout.block_size
            obj = arena.allocate(
                MemoryObjMeta(layout.chunk_shape(tokens), layout.chunk_dtype, tokens)
            )
            assert obj is not None, "test arena too small"
            obj.tensor.copy_(random_bytes(obj.tensor.shape, torch.device("cpu"), seed * 1000 + i))
            self.objs.append(obj)
        tracked: list[Objects] = arena.tracked  # type: ignore[attr-defined]
        tracked.append(self)

    def transfers(self, blocks: Sequence[torch.Tensor]) -> list[Transfer]:
        return [Transfer(o, b) for o, b in zip(self.objs, blocks, strict=True)]

    def snapshot(self) -> list[torch.Tensor]:
        return [o.tensor.detach().cpu().clone() for o in self.objs]

    def release(self) -> None:
        for o in self.objs:
            if not o.released:
                o.release()


def random_blocks(
    lengths: Sequence[int], seed: int, holes: bool, device: torch.device, offset: int = 0
) -> list[torch.Tensor]:
    """Distinct random cache blocks per chunk, from ``offset`` on; with ``holes``: a -1 first
    block (the engine has it already), a -1 inside the second chunk, and an extra chunk that is
    all -1."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(SHAPE.blocks, generator=gen)
    out, at = [], offset
    for n in lengths:
        out.append(perm[at : at + n].clone())
        at += n
    if holes:
        out[0][0] = -1
        out[1][len(out[1]) // 2] = -1
        out.append(torch.full((lengths[-1],), -1, dtype=torch.long))
    return [b.to(device) for b in out]


def lengths_of(blocks: Sequence[torch.Tensor]) -> list[int]:
    return [int(b.numel()) for b in blocks]


def same_bytes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(
        torch.equal(
            x.detach().cpu().contiguous().view(torch.uint8),
            y.detach().cpu().contiguous().view(torch.uint8),
        )
        for x, y in zip(a, b, strict=True)
    )
