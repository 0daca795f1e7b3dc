"""A tier under quarantine answers every read with a miss until it ends; ``remove`` forgets a
chunk in every tier. On the tiered manager (host memory + disk) and the host-only one."""

from __future__ import annotations

import pytest
from storage_helpers import ARENA_BYTES, check_obj, key, put_chunk

from kvtier.core.memory import HostArena
from kvtier.core.quarantine import Quarantine
from kvtier.core.storage import HostMemoryStorageManager


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reads(m, i: int) -> dict[str, object]:
    """What every read path of ``m`` says about chunk ``i`` (handles released)."""
    got = m.batched_get([key(i)])[0]
    if got is not None:
        got.release()
    host = m.host_get([key(i)])[0]
    if host is not None:
        host.release()
    return {
        "contains": m.contains([key(i)])[0],
        "prefix": m.prefix_hits([key(i)]),
        "get": got is not None,
        "host_get": host is not None,
    }


def test_a_quarantine_ends_on_time_and_a_later_end_is_kept():
    clock = Clock()
    q = Quarantine(clock)
    q.add("redis", 10)
    q.add("redis", 5)  # shorter: the longer one stays
    assert q.blocked("redis") and not q.blocked("local_disk")
    assert q.active() == {"redis": 10}
    clock.now += 9.9
    assert q.blocked("redis")
    clock.now += 0.2
    assert not q.blocked("redis") and q.active() == {}
    q.add("redis", 0)
    assert not q.blocked("redis")


def test_a_quarantined_lower_tier_is_a_miss_on_every_read_path(make_manager):
    m = make_manager()
    put_chunk(m, 1)
    assert m.flush(10)
    m.host.remove([key(1)])
    m.quarantined._clock = clock = Clock()
    m.quarantine("local_disk", 30)
    assert reads(m, 1) == {"contains": False, "prefix": 0, "get": False, "host_get": False}
    assert m.prefetch([key(1)]).result(10) == 0
    assert m.host.contains([key(1)]) == [False], "nothing was written back from it"
    clock.now += 31
    assert reads(m, 1)["get"] is True  # read from disk again (and written back)


def test_a_quarantined_host_tier_misses_and_lower_tiers_still_answer(make_manager):
    m = make_manager()
    put_chunk(m, 2)
    assert m.flush(10)
    m.quarantine("local_cpu", 30)
    r = reads(m, 2)
    assert r["host_get"] is False and r["get"] is True, "the disk copy is still served"
    m.quarantine("local_disk", 30)
    assert reads(m, 2) == {"contains": False, "prefix": 0, "get": False, "host_get": False}


def test_writes_still_reach_a_quarantined_tier(make_manager):
    m = make_manager()
    m.quarantine("local_disk", 30)
    put_chunk(m, 3)
    assert m.flush(10)
    assert m.lower[0].contains([key(3)]) == [True]


def test_remove_forgets_a_chunk_in_every_tier(make_manager):
    m = make_manager()
    put_chunk(m, 4)
    put_chunk(m, 5)
    assert m.flush(10)
    m.remove([key(4)])
    assert m.host.contains([key(4)]) == [False]
    assert m.lower[0].contains([key(4)]) == [False]
    assert m.batched_get([key(4)]) == [None]
    obj = m.get(key(5))
    check_obj(obj, 5)
    obj.release()


def test_the_host_only_manager_removes_and_quarantines():
    arena = HostArena.create(ARENA_BYTES)
    m = HostMemoryStorageManager(arena)
    try:
        put_chunk(m, 6)  # type: ignore[arg-type]
        put_chunk(m, 7)  # type: ignore[arg-type]
        m.remove([key(6)])
        assert m.contains([key(6), key(7)]) == [False, True]
        m.quarantine("local_cpu", 30)
        assert m.contains([key(7)]) == [False] and m.batched_get([key(7)]) == [None]
    finally:
        m.close()
    assert arena.used_bytes == 0


@pytest.mark.parametrize("seconds", [0, -1])
def test_a_quarantine_of_no_time_blocks_nothing(make_manager, seconds):
    m = make_manager()
    put_chunk(m, 8)
    m.quarantine("local_cpu", seconds)
    assert reads(m, 8)["get"] is True


def test_a_quarantined_tier_is_never_named_as_a_chunks_source(make_manager):
    """The source label decides which tier a wrong chunk quarantines: a chunk read from disk
    while host memory is quarantined must be blamed on the disk."""
    from kvtier.core.engine.sources import chunk_sources

    m = make_manager()
    put_chunk(m, 9)
    assert m.flush(10)
    assert chunk_sources(m, [key(9)]) == ["local_cpu"]
    m.quarantine("local_cpu", 30)
    assert chunk_sources(m, [key(9)]) == ["local_disk"]
