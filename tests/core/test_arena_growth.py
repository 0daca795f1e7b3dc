"""The host arena is usable while it is pinned (issue 40): it grows segment by segment on a
background thread, objects come only from ready bytes, eviction sees the capacity there is, a
refused segment is used pageable, and ``close`` stops the growth cleanly."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from kvtier.core import CacheEngine, KVLayout, load_config
from kvtier.core.errors import OutOfHostMemory
from kvtier.core.memory import HostArena, MemoryObjMeta
from kvtier.core.memory.arena_growth import ArenaGrowth
from kvtier.core.platform.cpu import CPUPlatform

MiB = 1 << 20
SEGMENT = 4 * MiB
WAIT_S = 10.0


class SlowPins:
    """A pinning stub: the first ``free`` segments pin at once, the rest wait for ``gate``;
    ``refuse`` lists segment offsets it refuses."""

    def __init__(self, free: int = 1, refuse: tuple[int, ...] = ()) -> None:
        self.free = free
        self.refuse = refuse
        self.gate = threading.Event()
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[tuple[int, int]] = []
        self.calls = 0

    def pin(self, offset: int, n: int) -> bool:
        self.calls += 1
        if self.calls > self.free:
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        if offset in self.refuse:
            return False
        self.pinned.append((offset, n))
        return True

    def unpin(self, offset: int, n: int) -> None:
        self.unpinned.append((offset, n))


def meta(nbytes: int) -> MemoryObjMeta:
    return MemoryObjMeta((nbytes,), torch.uint8, 1)


def wait_for(pred, timeout: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached")


def test_objects_come_only_from_ready_bytes_while_it_grows() -> None:
    arena = HostArena(torch.empty(8 * SEGMENT, dtype=torch.uint8), ready_bytes=0)
    pins = SlowPins(free=1)
    growth = ArenaGrowth(arena, pins.pin, pins.unpin, segment_bytes=SEGMENT).start()
    wait_for(lambda: arena.capacity == SEGMENT)
    assert not growth.done and arena.target_bytes == 8 * SEGMENT
    # usable at once, up to what is ready; a bigger object is a miss for now, not an error
    objs = [arena.allocate(meta(MiB)) for _ in range(4)]
    assert all(o is not None for o in objs)
    assert arena.allocate(meta(MiB)) is None
    assert arena.allocate_evicting(meta(2 * SEGMENT), lambda: False) is None
    with pytest.raises(OutOfHostMemory):
        arena.allocate_evicting(meta(9 * SEGMENT), lambda: False)
    pins.gate.set()
    assert growth.wait(WAIT_S)
    assert arena.capacity == arena.target_bytes
    big = arena.allocate(meta(7 * SEGMENT))  # the grown bytes coalesce into one extent
    assert big is not None
    for o in [*objs, big]:
        o.release()  # type: ignore[union-attr]
    assert arena.used_bytes == 0
    arena.close()
    assert sorted(pins.unpinned) == sorted(pins.pinned) and len(pins.pinned) == 8


def test_stores_and_loads_run_and_evict_while_the_arena_grows() -> None:
    """An engine on a platform that pins in the background serves stores and loads from the
    first segment on; the host tier evicts at the capacity there is, then keeps more."""
    pins = SlowPins(free=1)

    class Pinning(CPUPlatform):
        pins_ranges = True
        pin_segment_bytes = 20 * 1024  # two 8 KiB chunks and their alias entries

        @property
        def has_pinned_memory(self) -> bool:
            return True

        def pin_host_range(self, address: int, nbytes: int) -> bool:
            return pins.pin(address, nbytes)

        def unpin_host_range(self, address: int, nbytes: int) -> None:
            pins.unpin(address, nbytes)

    layout = KVLayout(2, 2, 8, "bfloat16", 16)  # 8 KiB per 64-token chunk
    config = load_config(
        env={}, overrides={"chunk_size": 64, "tiers": ["local_cpu"], "local_cpu_size_gb": 1 / 1024}
    )
    engine = CacheEngine(config, layout, model="m", platform=Pinning())
    arena = engine.storage.arena  # type: ignore[attr-defined]
    # Pinned from its first segment on: no tier hands the platform other, pageable memory
    assert arena.for_pinned_copies and not arena.is_pinned
    wait_for(lambda: arena.capacity == 20 * 1024)
    caches = [torch.randn(layout.expected_cache_shape(64)).to(torch.bfloat16) for _ in range(2)]
    engine.register_kv_caches(caches)
    prompts = [np.arange(i * 1000, i * 1000 + 64) for i in range(6)]
    for i, p in enumerate(prompts):
        assert engine.store(p, torch.arange(i * 64, (i + 1) * 64)) == 64
    # two chunks fit the first segment: the older ones were evicted
    assert [engine.lookup(p) for p in prompts] == [0, 0, 0, 0, 64, 64]
    assert engine.retrieve(prompts[5], torch.arange(64, 128)).all()
    # prompt 5 was stored from blocks 20-23 and loaded into blocks 4-7
    assert torch.equal(caches[0][20:24].view(torch.uint8), caches[0][4:8].view(torch.uint8))
    pins.gate.set()
    wait_for(lambda: arena.capacity == arena.target_bytes)
    for i, p in enumerate(prompts):
        engine.store(p, torch.arange(i * 64, (i + 1) * 64))
    assert all(engine.lookup(p) == 64 for p in prompts)
    engine.close()
    assert sorted(pins.unpinned) == sorted(pins.pinned)


def test_close_during_growth_stops_it() -> None:
    arena = HostArena(torch.empty(8 * SEGMENT, dtype=torch.uint8), ready_bytes=0)
    pins = SlowPins(free=2)
    growth = ArenaGrowth(arena, pins.pin, pins.unpin, segment_bytes=SEGMENT).start()
    wait_for(lambda: pins.calls == 3)  # two pinned, the third waits at the gate
    closer = threading.Thread(target=arena.close)
    closer.start()
    pins.gate.set()  # the segment in flight finishes; nothing after it starts
    closer.join(WAIT_S)
    assert not closer.is_alive() and growth.done
    assert pins.calls == 3 and arena.capacity == 3 * SEGMENT
    assert sorted(pins.unpinned) == sorted(pins.pinned)
    obj = arena.allocate(meta(MiB))  # what grew stays usable
    assert obj is not None
    obj.release()


def test_a_refused_segment_is_used_pageable_with_a_warning(caplog) -> None:  # type: ignore[no-untyped-def]
    arena = HostArena(torch.empty(4 * SEGMENT, dtype=torch.uint8), ready_bytes=0)
    pins = SlowPins(free=4, refuse=(SEGMENT, 2 * SEGMENT))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        growth = ArenaGrowth(arena, pins.pin, pins.unpin, segment_bytes=SEGMENT).start()
        assert growth.wait(WAIT_S)
    assert arena.capacity == arena.target_bytes
    assert growth.refused_bytes == 2 * SEGMENT
    assert sum("could not be page-locked" in r.message for r in caplog.records) == 1
    arena.close()
    assert sorted(pins.unpinned) == [(0, SEGMENT), (3 * SEGMENT, SEGMENT)]


def test_a_platform_without_range_pinning_gives_a_ready_arena() -> None:
    arena = CPUPlatform().create_arena(MiB)
    assert arena.capacity == arena.target_bytes == MiB
    assert not arena.for_pinned_copies
    arena.close()
