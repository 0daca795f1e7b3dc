"""Stream ordering on a real accelerator: each test slows one stream down with a long kernel so
that a missing wait (engine <-> transfer stream, host <-> transfer stream) shows up as wrong
bytes instead of passing by luck. On CPU every copy is synchronous, so they skip there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from xpu_helpers import (
    NUM_BLOCKS,
    SIZES_3,
    Geometry,
    all_pages,
    chunk_blocks,
    make_arena,
    make_caches,
    make_obj,
    pages_of,
    storage_bytes,
    transfers_for,
)

from kvtier.core import MemoryObj
from kvtier.xpu import XPUPageMover, XPUPlatform
from kvtier.xpu.streams import Stream


@pytest.fixture
def accel(device: torch.device) -> torch.device:
    if device.type == "cpu":
        pytest.skip(
            "CPU copies are synchronous: stream ordering is observable on an accelerator only"
        )
    return device


def _busy(device: torch.device) -> None:
    """Tens of milliseconds of work on the current stream of ``device``.

    On CUDA a spin kernel that holds one block, leaving the GPU free for the other stream's work
    (a missing wait then surely runs that work early); elsewhere a chain of matmuls.
    """
    if device.type == "cuda":
        torch.cuda._sleep(50_000_000)
        return
    x = torch.randn(4096, 4096, device=device)
    for _ in range(12):
        x = x @ x
        x = x / x.norm()


def _slow_transfers(mover: XPUPageMover, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the mover issues on one of its transfer streams first waits behind a long
    kernel on that stream (through the public ``mover.streams``): a missing wait then reads or
    frees bytes before the transfer ran."""
    real_use = mover.streams.use

    @contextlib.contextmanager
    def slow_use(stream: Stream) -> Iterator[None]:
        with real_use(stream):
            _busy(mover.device)
            yield

    monkeypatch.setattr(mover.streams, "use", slow_use)


def _setup(
    geometry: Geometry, device: torch.device, staging: str, seed: int
) -> tuple[list[torch.Tensor], list[MemoryObj], list[list[int]], XPUPageMover]:
    blocks = chunk_blocks(SIZES_3, seed=seed, holes=False)
    caches = make_caches(geometry, device, seed=seed)
    arena = make_arena(device)
    objs = [make_obj(arena, geometry.layout, n, seed=seed + i) for i, n in enumerate(SIZES_3)]
    on, cap = STAGINGS[staging]
    mover = XPUPlatform().create_mover(
        caches, geometry.layout, num_blocks=NUM_BLOCKS, staging_buffer=on, max_staging_bytes=cap
    )
    return caches, objs, blocks, mover


def _objs_hold(
    objs: list[MemoryObj], blocks: list[list[int]], pages: list[list[torch.Tensor]]
) -> bool:
    """Every object holds the ``[layer][block]`` pages of its blocks."""
    return all(
        torch.equal(o.tensor[i, layer], pages[layer][block])
        for o, chunk in zip(objs, blocks, strict=True)
        for i, block in enumerate(chunk)
        for layer in range(len(pages))
    )


# whole-batch staging, one chunk per group (bound 0), no staging kept
STAGINGS = {"whole": (True, 256 << 20), "grouped": (True, 0), "off": (False, 256 << 20)}
STAGING = pytest.mark.parametrize("staging", sorted(STAGINGS))


@STAGING
def test_store_waits_for_the_engines_pending_writes(
    geometry: Geometry, accel: torch.device, staging: str
) -> None:
    caches, objs, blocks, mover = _setup(geometry, accel, staging, seed=1)
    raw = storage_bytes(caches[0])
    new = torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=accel)
    # Built first: creating device tensors from host data would wait for the busy stream.
    transfers = transfers_for(objs, blocks, accel)
    # Warm the allocator: a fresh device allocation can synchronise the whole device, which
    # would hide a missing wait.
    mover.store(transfers)
    _busy(accel)  # the engine is still computing ...
    raw.copy_(new)  # ... the KV it then asks to store
    mover.store(transfers)
    # No explicit synchronisation: store() returned, so the host objects are final.
    assert _objs_hold(objs, blocks, all_pages(caches, geometry))


@STAGING
def test_store_returns_only_when_host_objects_are_written(
    geometry: Geometry, accel: torch.device, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, objs, blocks, mover = _setup(geometry, accel, staging, seed=2)
    originals = all_pages(caches, geometry)
    _slow_transfers(mover, monkeypatch)
    mover.store(transfers_for(objs, blocks, accel))
    assert _objs_hold(objs, blocks, originals)


@STAGING
def test_layerwise_store_waits_for_each_layers_pending_write(
    geometry: Geometry, accel: torch.device, staging: str
) -> None:
    caches, objs, blocks, mover = _setup(geometry, accel, staging, seed=6)
    new = [torch.randn(c.shape, device=accel).to(c.dtype) for c in caches]
    transfers = transfers_for(objs, blocks, accel)
    list(mover.store_layerwise(transfers))  # warm the allocator (see above)
    steps = mover.store_layerwise(transfers)
    for layer, (c, n) in enumerate(zip(caches, new, strict=True)):
        _busy(accel)  # the engine computes this layer ...
        c.copy_(n)  # ... writes it, and saves it
        assert next(steps) == layer
    assert next(steps, None) is None
    assert _objs_hold(objs, blocks, all_pages(caches, geometry))


@STAGING
def test_layerwise_store_orders_the_engines_overwrite_after_the_capture(
    geometry: Geometry, accel: torch.device, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, objs, blocks, mover = _setup(geometry, accel, staging, seed=3)
    originals = all_pages(caches, geometry)
    _slow_transfers(mover, monkeypatch)
    for layer in mover.store_layerwise(transfers_for(objs, blocks, accel)):
        caches[layer].fill_(7.0)  # issued on the engine's stream right after the yield
    assert _objs_hold(objs, blocks, originals)


@STAGING
def test_layerwise_load_orders_the_engines_reads_after_the_layer(
    geometry: Geometry, accel: torch.device, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, objs, blocks, mover = _setup(geometry, accel, staging, seed=4)
    _slow_transfers(mover, monkeypatch)
    seen = []
    for layer in mover.load_layerwise(transfers_for(objs, blocks, accel)):
        # attention reading the layer, on the engine's stream
        seen.append(storage_bytes(caches[layer]).clone())
    pages = [pages_of(c, geometry, raw) for c, raw in zip(caches, seen, strict=True)]
    assert _objs_hold(objs, blocks, pages)


@STAGING
def test_load_returns_only_when_host_objects_may_be_reused(
    geometry: Geometry, accel: torch.device, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, objs, blocks, mover = _setup(geometry, accel, staging, seed=5)
    want = [o.tensor.clone() for o in objs]
    _slow_transfers(mover, monkeypatch)
    mover.load(transfers_for(objs, blocks, accel))
    for o in objs:
        o.tensor.fill_(0xA5)  # the arena hands the bytes to someone else
    pages = all_pages(caches, geometry)
    for w, chunk in zip(want, blocks, strict=True):
        for i, block in enumerate(chunk):
            for layer in range(geometry.layout.num_layers):
                assert torch.equal(pages[layer][block], w[i, layer])
