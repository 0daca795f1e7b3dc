"""The disk tier's batch reads, which run on several threads: every chunk lands at its key's
position, bad files are misses for their key alone, and an error in one read releases what the
others delivered before it propagates."""

from __future__ import annotations

import threading

import pytest
from storage_helpers import check_obj, disk_of, key, stored


@pytest.mark.parametrize("o_direct", [False, True])
def test_a_mixed_batch_lands_in_order(make_manager, o_direct):
    m = make_manager(local_disk_o_direct=o_direct)
    good = [0, 1, 3, 4, 6, 8, 9, 11]
    bad = [5, 10]
    stored(m, *good, *bad)
    disk = disk_of(m)
    for i in bad:
        path = disk.path_of(key(i))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    want = list(range(12))  # 2 and 7 were never stored
    got = disk.batched_get([key(i) for i in want], m.arena.allocate)
    assert len(got) == len(want)
    for i, obj in zip(want, got, strict=True):
        if i in good:
            check_obj(obj, i)
            obj.release()
        else:
            assert obj is None, i
    assert m.stats.get("local_disk.corrupt") == len(bad)
    assert not any(disk.path_of(key(i)).exists() for i in bad)


def test_a_failing_read_releases_the_other_chunks(make_manager):
    m = make_manager()
    stored(m, *range(8))
    disk = disk_of(m)
    calls = 0
    lock = threading.Lock()

    def allocate(meta):
        nonlocal calls
        with lock:
            calls += 1
            if calls == 4:
                raise RuntimeError("allocator bug")
        return m.arena.allocate(meta)

    with pytest.raises(RuntimeError, match="allocator bug"):
        disk.batched_get([key(i) for i in range(8)], allocate)
    assert m.arena.used_bytes == 0
    # the tier still serves every chunk afterwards
    objs = disk.batched_get([key(i) for i in range(8)], m.arena.allocate)
    for i, obj in enumerate(objs):
        check_obj(obj, i)
        obj.release()


def test_reads_after_close_still_deliver(make_manager):
    m = make_manager()
    stored(m, 0, 1, 2)
    disk = disk_of(m)
    disk.close()
    objs = disk.batched_get([key(i) for i in range(3)], m.arena.allocate)
    for i, obj in enumerate(objs):
        check_obj(obj, i)
        obj.release()
