"""Stream ordering on a real accelerator: each test slows one stream down with a long kernel so
that a missing wait (engine <-> transfer stream, host <-> transfer stream) shows up as wrong
bytes instead of passing by luck. On CPU every copy is synchronous, so they skip there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from xpu_helpers import (
    SIZES_3,
    bits,
    chunk_slots,
    make_arena,
    make_caches,
    make_obj,
    obj_token,
    token_value,
)

from kvtier.core import KVLayout, MemoryObj, Transfer
from kvtier.xpu import XPUPagedConnector
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


def _slow_transfers(conn: XPUPagedConnector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the connector issues on one of its transfer streams first waits behind a long
    kernel on that stream (through the public ``conn.streams``): a missing wait then reads or
    frees bytes before the transfer ran."""
    real_use = conn.streams.use

    @contextlib.contextmanager
    def slow_use(stream: Stream) -> Iterator[None]:
        with real_use(stream):
            _busy(conn.device)
            yield

    monkeypatch.setattr(conn.streams, "use", slow_use)


def _setup(
    layout: KVLayout, device: torch.device, staging: str, seed: int
) -> tuple[
    list[torch.Tensor], list[torch.Tensor], list[MemoryObj], list[list[int]], XPUPagedConnector
]:
    slots = chunk_slots(SIZES_3, seed=seed, holes=False)
    caches = make_caches(layout, device, seed=seed)
    originals = [c.cpu().clone() for c in caches]
    objs = [make_obj(make_arena(device), layout, n, seed=seed + i) for i, n in enumerate(SIZES_3)]
    on, cap = STAGINGS[staging]
    conn = XPUPagedConnector(caches, layout, staging_buffer=on, max_staging_bytes=cap)
    return caches, originals, objs, slots, conn


def _transfers(
    objs: list[MemoryObj], slots: list[list[int]], device: torch.device
) -> list[Transfer]:
    return [Transfer(o, torch.tensor(s, device=device)) for o, s in zip(objs, slots, strict=True)]


def _objs_hold(
    objs: list[MemoryObj], slots: list[list[int]], layout: KVLayout, caches: list[torch.Tensor]
) -> bool:
    return all(
        torch.equal(
            bits(obj_token(o, layout, layer, i)), bits(token_value(caches[layer], layout, slot))
        )
        for layer in range(layout.num_layers)
        for o, s in zip(objs, slots, strict=True)
        for i, slot in enumerate(s)
    )


# whole-object staging, layer-at-a-time staging (cap 0), no staging
STAGINGS = {"whole": (True, 256 << 20), "layer": (True, 0), "off": (False, 0)}
STAGING = pytest.mark.parametrize("staging", sorted(STAGINGS))


@STAGING
def test_store_waits_for_the_engines_pending_writes(
    layout: KVLayout, accel: torch.device, staging: str
) -> None:
    caches, _, objs, slots, conn = _setup(layout, accel, staging, seed=1)
    new = [torch.randn(c.shape, device=accel).to(c.dtype) for c in caches]
    # Built first: creating device tensors from host data would wait for the busy stream.
    transfers = _transfers(objs, slots, accel)
    # Warm the allocator: a fresh device allocation can synchronise the whole device, which
    # would hide a missing wait.
    conn.store(transfers)
    _busy(accel)  # the engine is still computing ...
    for c, n in zip(caches, new, strict=True):
        c.copy_(n)  # ... the KV it then asks to store
    conn.store(transfers)
    # No explicit synchronisation: store() returned, so the host objects are final.
    assert _objs_hold(objs, slots, layout, [n.cpu() for n in new])


@STAGING
def test_store_returns_only_when_host_objects_are_written(
    layout: KVLayout, accel: torch.device, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, originals, objs, slots, conn = _setup(layout, accel, staging, seed=2)
    _slow_transfers(conn, monkeypatch)
    conn.store(_transfers(objs, slots, accel))
    assert _objs_hold(objs, slots, layout, originals)


@STAGING
def test_layerwise_store_orders_the_engines_overwrite_after_the_capture(
    layout: KVLayout, accel: torch.device, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, originals, objs, slots, conn = _setup(layout, accel, staging, seed=3)
    _slow_transfers(conn, monkeypatch)
    for layer in conn.store_layerwise(_transfers(objs, slots, accel)):
        caches[layer].fill_(7.0)  # issued on the engine's stream right after the yield
    assert _objs_hold(objs, slots, layout, originals)


@STAGING
def test_layerwise_load_orders_the_engines_reads_after_the_layer(
    layout: KVLayout, accel: torch.device, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, _, objs, slots, conn = _setup(layout, accel, staging, seed=4)
    _slow_transfers(conn, monkeypatch)
    seen = []
    for layer in conn.load_layerwise(_transfers(objs, slots, accel)):
        seen.append(caches[layer].clone())  # attention reading the layer, on the engine's stream
    assert _objs_hold(objs, slots, layout, [s.cpu() for s in seen])


@STAGING
def test_load_returns_only_when_host_objects_may_be_reused(
    layout: KVLayout, accel: torch.device, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, _, objs, slots, conn = _setup(layout, accel, staging, seed=5)
    want = [o.tensor.clone() for o in objs]
    _slow_transfers(conn, monkeypatch)
    conn.load(_transfers(objs, slots, accel))
    for o in objs:
        o.tensor.fill_(-3.0)  # the arena hands the bytes to someone else
    for layer in range(layout.num_layers):
        for w, s in zip(want, slots, strict=True):
            for i, slot in enumerate(s):
                got = token_value(caches[layer], layout, slot)
                exp = w[layer, i] if layout.use_mla else w[:, layer, i]
                assert torch.equal(bits(got), bits(exp))
