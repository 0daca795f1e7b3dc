"""Host arena and memory objects: ownership is explicit and every byte comes back."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.errors import DoubleReleaseError, OutOfHostMemory
from kvtier.core.memory import HostArena, MemoryObjMeta


def meta(nbytes: int) -> MemoryObjMeta:
    return MemoryObjMeta((nbytes,), torch.uint8, 1)


def test_handles_free_once_when_last_holder_releases() -> None:
    arena = HostArena.create(4096)
    obj = arena.allocate(meta(1000))
    assert obj is not None and arena.used_bytes == 1024
    obj.tensor.fill_(7)
    twin = obj.share()
    obj.release()
    assert arena.used_bytes == 1024, "a second holder still has it"
    assert int(twin.tensor[0]) == 7
    twin.release()
    assert arena.used_bytes == 0
    with pytest.raises(DoubleReleaseError):
        twin.release()
    with pytest.raises(DoubleReleaseError):
        obj.share()
    with pytest.raises(DoubleReleaseError):
        _ = obj.tensor
    with pytest.raises(DoubleReleaseError):
        _ = obj.address


def test_context_manager_releases() -> None:
    arena = HostArena.create(4096)
    with arena.allocate(meta(10)) as obj:  # type: ignore[union-attr]
        assert not obj.released
    assert obj.released and arena.used_bytes == 0


def test_full_arena_fails_fast_and_eviction_terminates() -> None:
    arena = HostArena.create(4096)
    held = [arena.allocate(meta(1024)) for _ in range(4)]
    assert all(h is not None for h in held)
    assert arena.allocate(meta(1)) is None
    assert arena.allocate_evicting(meta(1), lambda: False) is None
    victims = list(held)

    def evict() -> bool:
        if not victims:
            return False
        victims.pop(0).release()  # type: ignore[union-attr]
        return True

    big = arena.allocate_evicting(meta(2048), evict)
    assert big is not None and len(victims) == 2
    with pytest.raises(OutOfHostMemory):
        arena.allocate_evicting(meta(8192), evict)
    big.release()
    for v in victims:
        v.release()  # type: ignore[union-attr]
    assert arena.used_bytes == 0


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), max_size=80))
def test_allocator_never_overlaps_and_coalesces(ops: list[tuple[bool, int]]) -> None:
    arena = HostArena.create(16384, alignment=64)
    live = []
    for alloc, size in ops:
        if alloc or not live:
            obj = arena.allocate(meta(size))
            if obj is not None:
                obj.tensor.fill_(len(live) % 250 + 1)
                live.append((obj, len(live) % 250 + 1))
        else:
            obj, _ = live.pop(size % len(live))
            obj.release()
        for o, mark in live:  # nobody wrote over anybody
            assert bool((o.tensor == mark).all())
    for o, _ in live:
        o.release()
    assert arena.used_bytes == 0
    assert arena.allocate(meta(16384)) is not None, "free extents coalesce back into one"


def test_many_threads_leave_the_arena_fully_free() -> None:
    arena = HostArena.create(1 << 20)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(400):
                if mine and rng.random() < 0.5:
                    obj = mine.pop(rng.randrange(len(mine)))
                    if rng.random() < 0.3:
                        twin = obj.share()
                        obj.release()
                        obj = twin
                    obj.release()
                else:
                    obj = arena.allocate(meta(rng.randint(1, 20000)))
                    if obj is not None:
                        mine.append(obj)
            for obj in mine:
                obj.release()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert arena.used_bytes == 0


def test_arena_rejects_bad_buffers() -> None:
    with pytest.raises(ValueError):
        HostArena(torch.zeros(10, dtype=torch.float32))
    with pytest.raises(ValueError):
        HostArena(torch.zeros(10, dtype=torch.uint8), alignment=3)
    with pytest.raises(ValueError, match="host"):
        HostArena(torch.empty(10, dtype=torch.uint8, device="meta"))


def test_objects_name_their_arena() -> None:
    a, b = HostArena.create(4096), HostArena.create(4096)
    meta = MemoryObjMeta((16,), torch.uint8, 1)
    x, y = a.allocate(meta), b.allocate(meta)
    assert x is not None and y is not None
    assert x.arena is a and y.arena is b and x.share().arena is a


@settings(max_examples=60, deadline=None)
@given(
    alignment=st.sampled_from([4, 8, 256]),
    start=st.sampled_from([0, 4, 64, 256]),
    objs=st.lists(
        st.tuples(
            st.sampled_from([torch.uint8, torch.bfloat16, torch.float16, torch.float32]),
            st.lists(st.integers(0, 5), min_size=1, max_size=4),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_object_tensors_are_their_own_bytes(
    alignment: int, start: int, objs: list[tuple[torch.dtype, list[int]]]
) -> None:
    """Every object's tensor has its meta's shape and dtype, is contiguous, and covers exactly
    the bytes of its byte view, at any offset the alignment allows; what one object holds never
    shows in another."""
    # the arena's buffer is a slice of a larger tensor, as when arenas share one allocation
    arena = HostArena(torch.zeros(4099 + start, dtype=torch.uint8)[start:], alignment=alignment)
    held = []
    for n, (dtype, shape) in enumerate(objs):
        meta = MemoryObjMeta(tuple(shape), dtype, 1)
        obj = arena.allocate(meta)
        assert obj is not None
        t = obj.tensor
        assert t.shape == tuple(shape) and t.dtype == dtype and t.is_contiguous()
        twin = obj.share()
        assert obj.address == t.data_ptr() == twin.address
        twin.release()
        view = obj.byte_view()
        assert view.nbytes == meta.nbytes
        if meta.nbytes:
            assert t.data_ptr() == torch.frombuffer(view, dtype=torch.uint8).data_ptr()
        t.view(torch.uint8).fill_(n)
        held.append((obj, n))
    for obj, n in held:
        assert bytes(obj.byte_view()) == bytes([n]) * obj.meta.nbytes
        obj.release()
    assert arena.used_bytes == 0


def test_an_object_below_its_dtype_alignment_is_refused_by_name() -> None:
    arena = HostArena(torch.zeros(64, dtype=torch.uint8), alignment=1)
    first = arena.allocate(meta(1))
    assert first is not None
    with pytest.raises(ValueError, match="not aligned"):
        arena.allocate(MemoryObjMeta((2,), torch.float32, 1))
    assert arena.used_bytes == 1  # the refused object's bytes went back
    first.release()


def test_objects_allocated_after_one_inside_inference_mode_can_be_written_outside_it() -> None:
    """The first object of a dtype may be allocated in vLLM's forward pass (inference mode, a
    layer-wise load); objects allocated later, outside it, are still written in place."""
    arena = HostArena(torch.zeros(4096, dtype=torch.uint8))
    m = MemoryObjMeta((4, 8), torch.float16, 1)
    with torch.inference_mode():
        first = arena.allocate(m)
        assert first is not None
        first.tensor.fill_(1.0)
    second = arena.allocate(m)
    assert second is not None
    second.tensor.fill_(2.0)
    second.tensor.copy_(torch.full((4, 8), 3.0, dtype=torch.float16))
    assert bool((second.tensor == 3.0).all())
    first.release()
    second.release()


def test_a_borrowed_object_keeps_the_handle_contract_outside_the_arena() -> None:
    from kvtier.core.memory import MemoryObj

    meta = MemoryObjMeta((2, 4), torch.bfloat16, 4)
    owner = torch.arange(8, dtype=torch.float32).to(torch.bfloat16).reshape(2, 4)
    obj = MemoryObj.borrowed(owner, meta)
    assert obj.arena is None and obj.holders == 1
    assert obj.address == owner.data_ptr() and torch.equal(obj.tensor, owner)
    twin = obj.share()
    assert obj.holders == 2
    obj.release()
    assert torch.equal(twin.tensor, owner), "a shared handle outlives its twin's release"
    with pytest.raises(DoubleReleaseError):
        obj.release()
    with pytest.raises(DoubleReleaseError):
        _ = obj.tensor
    twin.release()
    assert twin.holders == 0
    with pytest.raises(ValueError, match="does not match"):
        MemoryObj.borrowed(owner, MemoryObjMeta((4, 2), torch.bfloat16, 4))
    with pytest.raises(ValueError, match="contiguous"):
        MemoryObj.borrowed(owner.t(), MemoryObjMeta((4, 2), torch.bfloat16, 4))
