"""What the device connector conformance suite runs against, and an oracle independent of them.

Every platform's connector is built the public way (``Platform.create_connector``). The oracle
reads and writes a paged KV tensor token by token through plain tensor views
(``token_rows``), never through a connector.

``KVTIER_TEST_DEVICE`` picks the cache device: ``cpu`` (CI; the CUDA connector's Triton kernels
run under ``TRITON_INTERPRET=1``) or ``cuda`` (a GPU: every subject runs on CUDA tensors, the
XPU connector through torch.cuda's identical stream API).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from fixtures.paged_shape import CacheShape, layout_for
from kvtier.core.connector import DeviceConnector, Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.core.platform import Platform

ALL_LAYOUTS = frozenset(PagedLayout)


@dataclass(frozen=True)
class Subject:
    """One platform connector with one set of options."""

    id: str
    platform: str
    options: dict[str, object] = field(default_factory=dict)
    layouts: frozenset[PagedLayout] = ALL_LAYOUTS
    # test function name -> reason: known deviations from the contract, reported to the owner.
    xfail: dict[str, str] = field(default_factory=dict)


SUBJECTS = [
    Subject("cpu", "cpu"),
    # whole loads staged in one piece; stores and layer-wise loads through the one-layer buffer
    Subject("xpu", "xpu"),
    # every batch layer by layer through the one-layer buffer
    Subject("xpu-layer-staging", "xpu", {"max_staging_bytes": 0}),
    Subject("xpu-unstaged", "xpu", {"staging_buffer": False}),
    Subject("cuda", "cuda", layouts=ALL_LAYOUTS - {PagedLayout.VLLM_CPU}),
    # no staging ring kept between calls; a one-row ring forces many pieces and ring reuse
    Subject(
        "cuda-unstaged-small-ring",
        "cuda",
        {"staging_buffer": False, "staging_slots": 2, "staging_slot_bytes": 1},
        layouts=ALL_LAYOUTS - {PagedLayout.VLLM_CPU},
    ),
]


@dataclass(frozen=True)
class Shape(CacheShape):
    lengths: tuple[int, ...]  # a ragged batch: the last chunk is partial


ON_GPU = os.environ.get("KVTIER_TEST_DEVICE", "cpu") == "cuda"
# The Triton interpreter runs every program in numpy: tiny on CPU, model-like on a GPU.
SHAPE = (
    Shape(layers=4, heads=8, head=128, block=16, blocks=160, lengths=(256, 256, 129))
    if ON_GPU
    else Shape(layers=2, heads=2, head=8, block=4, blocks=24, lengths=(8, 8, 5))
)
TOTAL_SLOTS = SHAPE.blocks * SHAPE.block


def make_platform(subject: Subject, device: torch.device) -> Platform:
    """The subject's platform, or a skip saying why it cannot run on ``device``."""
    if subject.platform == "cpu":
        from kvtier.core.platforms.cpu import CPUPlatform

        return CPUPlatform()
    if subject.platform == "xpu":
        pytest.importorskip("kvtier.xpu", reason="kvtier-xpu is not installed")
        from kvtier.xpu import XPUPlatform

        return XPUPlatform()
    pytest.importorskip("triton", reason="kvtier-cuda's kernels need triton")
    pytest.importorskip("kvtier.cuda", reason="kvtier-cuda is not installed")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "the CUDA connector on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest.py)"
        )
    if device.type not in ("cpu", "cuda"):
        pytest.skip(f"the CUDA connector runs on cuda (or cpu, interpreted), not {device}")
    from kvtier.cuda.platform import CUDAPlatform

    return CUDAPlatform()


def make_layout(paged: PagedLayout, dtype: str = "bfloat16") -> KVLayout:
    return layout_for(SHAPE, paged, dtype)


def random_bytes(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    """Random bits of ``dtype``: byte comparisons need no float semantics (NaNs included)."""
    numel = 1
    for s in shape:
        numel *= s
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(
        0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, device=device, generator=gen
    )
    return raw.view(dtype).view(tuple(shape))


def make_caches(layout: KVLayout, device: torch.device, seed: int) -> list[torch.Tensor]:
    shape = layout.expected_cache_shape(SHAPE.blocks)
    return [
        random_bytes(shape, layout.torch_dtype, device, seed * 1000 + i)
        for i in range(layout.num_layers)
    ]


def make_arena(platform: Platform, device: torch.device) -> HostArena:
    """Pinned (registered, for CUDA) on a GPU, as in production; pageable on CPU."""
    if device.type == "cpu":
        return HostArena.create(4 << 20, pin_memory=False)
    if platform.name == "cuda":
        return platform.create_arena(512 << 20)
    return HostArena.create(512 << 20, pin_memory=True)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).cpu()


def token_rows(
    layout: KVLayout, cache: torch.Tensor, slots: torch.Tensor | None = None
) -> torch.Tensor:
    """Every slot's KV of one layer (or only ``slots``'), ``[slots, 2, h*d]`` (MLA
    ``[slots, latent]``), read by tensor views alone (the layouts as ``PagedLayout`` documents
    them); a copy on the host."""
    rows = _rows_view(layout, cache.detach())
    if slots is not None:
        rows = rows[slots.to(rows.device)]
    return rows.cpu().clone()


def _rows_view(layout: KVLayout, c: torch.Tensor) -> torch.Tensor:
    n, b, h, d = SHAPE.blocks, layout.block_size, layout.num_kv_heads, layout.head_size
    if layout.paged_layout is PagedLayout.FLASH_NHD:  # [2, n, b, h, d]
        return c.permute(1, 2, 0, 3, 4).reshape(n * b, 2, h * d)
    if layout.paged_layout is PagedLayout.FLASH_BLOCK_FIRST:  # [n, 2, b, h, d]
        return c.permute(0, 2, 1, 3, 4).reshape(n * b, 2, h * d)
    if layout.paged_layout is PagedLayout.VLLM_CPU:  # [n, h, b, 2d]: K^T [d, b] then V [b, d]
        halves = c.reshape(n, h, 2, d * b)
        k = halves[:, :, 0].reshape(n, h, d, b).permute(0, 3, 1, 2)
        v = halves[:, :, 1].reshape(n, h, b, d).permute(0, 2, 1, 3)
        return torch.stack((k, v), dim=2).reshape(n * b, 2, h * d)
    return c.reshape(n * b, d)  # MLA [n, b, d]


def object_rows(layout: KVLayout, obj_tensor: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer of an object as ``[tokens, 2, h*d]`` (MLA ``[tokens, latent]``), on the host."""
    t = obj_tensor.detach().cpu()
    return t[layer] if layout.use_mla else t[:, layer].transpose(0, 1)


class Objects:
    """Host objects for ``lengths`` tokens each, filled with random bytes; released at teardown
    by the ``arena`` fixture."""

    def __init__(
        self, arena: HostArena, layout: KVLayout, lengths: Sequence[int], seed: int
    ) -> None:
        self.layout = layout
        self.objs: list[MemoryObj] = []
        for i, n in enumerate(lengths):
            obj = arena.allocate(MemoryObjMeta(layout.chunk_shape(n), layout.torch_dtype, n))
            assert obj is not None, "test arena too small"
            obj.tensor.copy_(
                random_bytes(
                    obj.tensor.shape, layout.torch_dtype, torch.device("cpu"), seed * 1000 + i
                )
            )
            self.objs.append(obj)
        tracked: list[Objects] = arena.tracked  # type: ignore[attr-defined]
        tracked.append(self)

    def transfers(self, slots: Sequence[torch.Tensor]) -> list[Transfer]:
        return [Transfer(o, s) for o, s in zip(self.objs, slots, strict=True)]

    def snapshot(self) -> list[torch.Tensor]:
        return [o.tensor.detach().cpu().clone() for o in self.objs]

    def release(self) -> None:
        for o in self.objs:
            if not o.released:
                o.release()


def random_slots(
    lengths: Sequence[int], seed: int, holes: bool, device: torch.device, offset: int = 0
) -> list[torch.Tensor]:
    """Distinct random slots per chunk, from ``offset`` on; with ``holes``: a -1 prefix (tokens
    the engine already has), a -1 inside the second chunk, and an extra chunk that is all -1."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(TOTAL_SLOTS, generator=gen)
    out, at = [], offset
    for n in lengths:
        out.append(perm[at : at + n].clone())
        at += n
    if holes:
        out[0][: lengths[0] // 2 + 1] = -1
        out[1][lengths[1] // 2] = -1
        out.append(torch.full((lengths[-1],), -1, dtype=torch.long))
    return [s.to(device) for s in out]


def lengths_of(slots: Sequence[torch.Tensor]) -> list[int]:
    return [int(s.numel()) for s in slots]


def expected_objects(
    layout: KVLayout,
    caches: Sequence[torch.Tensor],
    before: Sequence[torch.Tensor],
    slots: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """What a store of ``slots`` leaves in objects that held ``before``."""
    rows = [token_rows(layout, c) for c in caches]
    out = []
    for old, s in zip(before, slots, strict=True):
        want = old.clone()
        s = s.cpu()
        valid = (s >= 0).nonzero().squeeze(1)
        for layer in range(layout.num_layers):
            object_rows(layout, want, layer)[valid] = rows[layer][s[valid]]
        out.append(want)
    return out


def expected_cache_rows(
    layout: KVLayout,
    caches_before: Sequence[torch.Tensor],
    objects: Sequence[torch.Tensor],
    slots: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """Per layer, every slot's KV after a load of ``objects`` into ``slots``."""
    out = []
    for layer, c in enumerate(caches_before):
        rows = token_rows(layout, c).clone()
        for obj, s in zip(objects, slots, strict=True):
            s = s.cpu()
            valid = (s >= 0).nonzero().squeeze(1)
            rows[s[valid]] = object_rows(layout, obj, layer)[valid]
        out.append(rows)
    return out


def same_bytes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(a, b, strict=True))


def cache_rows(conn: DeviceConnector) -> list[torch.Tensor]:
    return [token_rows(conn.layout, c) for c in conn.kv_caches]
