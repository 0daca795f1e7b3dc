"""The disk tier against what a hostile or broken file system puts at its paths: FIFOs,
directories, symlinks, devices, files changed behind its back, planted temporaries, a file
system that fills up below the budget. Each is a miss for that key alone, never a hang, never a
phantom hit, never a write through someone else's link."""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from storage_helpers import check_obj, disk_of, key, put_chunk, stored

GiB = 1 << 30


def get_bounded(m, k, timeout=10.0):
    """``m.get(k)`` on a thread: (finished, result)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(m.get(k)), daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (out[0] if out else None)


def test_fifo_at_a_chunk_path_is_a_miss_not_a_hang(make_manager):
    m = make_manager()
    stored(m, 0, 1)
    disk = disk_of(m)
    p0 = disk.path_of(key(0))
    p0.unlink()
    os.mkfifo(p0)
    fresh = disk.path_of(key(7))  # never stored: another process's name, say
    os.mkfifo(fresh)
    try:
        done, obj = get_bounded(m, key(0))
        assert done, "a read of a FIFO blocked"
        assert obj is None
        assert m.contains([key(7)]) == [False]
        done, obj = get_bounded(m, key(7))
        assert done and obj is None
    finally:  # unblock a reader stuck in open() (the behaviour this test guards against)
        for p in (p0, fresh):
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert not p0.exists() and not fresh.exists()
    assert m.stats.get("local_disk.corrupt") >= 2
    obj = m.get(key(1))
    check_obj(obj, 1)
    obj.release()


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("kind", ["empty_dir", "full_dir", "symlink_to_chunk", "symlink_to_device"])
def test_non_file_at_a_chunk_path_is_no_phantom_hit(make_manager, kind, o_direct):
    m = make_manager(local_disk_o_direct=o_direct)
    stored(m, 0, 1)
    disk = disk_of(m)
    p0, p1 = disk.path_of(key(0)), disk.path_of(key(1))
    p0.unlink()
    if kind == "empty_dir":
        p0.mkdir()
    elif kind == "full_dir":
        p0.mkdir()
        (p0 / "x").write_bytes(b"x")
    elif kind == "symlink_to_chunk":
        os.symlink(p1, p0)  # a valid chunk file, but another key's and through a link
    else:
        os.symlink("/dev/zero", p0)
    for _ in range(2):  # and stays a miss: no hit the tier cannot deliver, ever
        assert m.contains([key(0)]) == [False]
        assert m.prefix_hits([key(0), key(1)]) == 0
        assert m.get(key(0)) is None
    assert p1.is_file() and not p1.is_symlink()  # the link's target is untouched
    if kind != "full_dir":
        assert not os.path.lexists(p0)  # removed
        stored(m, 0)  # and the key can be stored again
        obj = m.get(key(0))
        check_obj(obj, 0)
        obj.release()
    obj = m.get(key(1))
    check_obj(obj, 1)
    obj.release()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other_key"])
def test_lookup_reports_no_hit_a_read_cannot_deliver(make_manager, damage):
    """After a restart (and for files changed behind the tier's back), a file whose header is
    not this key's, or whose length is not its header's, is a miss at lookup, not at the read."""
    m = make_manager()
    stored(m, 0, 1, 2)
    disk = disk_of(m)
    p1 = disk.path_of(key(1))
    if damage == "truncate":
        os.truncate(p1, p1.stat().st_size - 10)
    elif damage == "garbage":
        p1.write_bytes(os.urandom(p1.stat().st_size))
    else:
        p1.write_bytes(disk.path_of(key(2)).read_bytes())
    # the running tier (it wrote the file, then the file changed) and a restarted one
    assert m.prefix_hits([key(i) for i in range(3)]) == 1
    m.close()
    m2 = make_manager()
    assert m2.prefix_hits([key(i) for i in range(3)]) == 1
    assert m2.contains([key(i) for i in range(3)]) == [True, False, True]
    assert not p1.exists()


def test_a_cleared_directory_is_no_hit_for_a_running_tier(make_manager):
    m = make_manager()
    stored(m, 0, 1)
    disk = disk_of(m)
    for p in disk.dir.glob("*.kvc"):
        p.unlink()  # what `kvtier clear` does to a running deployment's directory
    assert m.prefix_hits([key(0), key(1)]) == 0


@pytest.mark.parametrize("o_direct", [False, True])
def test_planted_symlink_at_a_temporary_name_is_not_written_through(
    make_manager, tmp_path, monkeypatch, o_direct
):
    """The writer's temporary file must not follow a link planted where it will be created.
    Its name has a random part; here that part is made predictable so the link is planted at
    the very name the writer opens: the write must fail there, not land in the victim."""
    from types import SimpleNamespace

    from kvtier.storage.backends.disk import fileio as _disk_io

    m = make_manager(local_disk_o_direct=o_direct)
    disk = disk_of(m)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(_disk_io, "secrets", SimpleNamespace(token_hex=lambda n: "ab" * n))
    for name in (disk.file_name(key(0)), ".odirect"):
        os.symlink(victim, disk.dir / f".{name}.{os.getpid()}.{'ab' * 6}.tmp")
    put_chunk(m, 0)
    assert not m.flush(10), "a write through a planted link was acknowledged"
    assert victim.read_bytes() == b"precious"
    assert victim.is_file() and not victim.is_symlink()
    monkeypatch.undo()  # random names again: the next store lands
    m.host.remove([key(0)])
    stored(m, 0)
    obj = m.get(key(0))
    check_obj(obj, 0)
    obj.release()


def test_files_are_private(make_manager, tmp_path):
    old = os.umask(0o022)
    try:
        m = make_manager(local_disk_path=str(tmp_path / "a" / "b"))
        stored(m, 0)
    finally:
        os.umask(old)
    disk = disk_of(m)
    assert stat.S_IMODE(disk.path_of(key(0)).stat().st_mode) == 0o600
    assert stat.S_IMODE((disk.dir / "NAMESPACE").stat().st_mode) == 0o600
    for d in (disk.dir, disk.root, disk.root.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs (fits about a dozen test chunk files); skips where mounting is refused."""
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    try:
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs: {e}")
    if out.returncode:
        pytest.skip(f"cannot mount a tmpfs: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_full_file_system_below_the_budget_evicts_to_make_room(make_manager, small_fs):
    m = make_manager(local_disk_path=str(small_fs / "disk"), local_disk_size_gb=1.0)
    n = 40
    for i in range(n):  # one by one: each flush reports whether the chunk landed
        put_chunk(m, i)
        m.flush(10)
    m.host.remove([key(i) for i in range(n)])
    disk = disk_of(m)
    assert m.stats.get("local_disk.evicted") > 0
    # after the file system filled, stores went on: the newest chunks are all on disk
    assert m.stats.get("local_disk.store_skipped") <= 2, m.stats
    for i in range(n - 5, n):
        obj = m.get(key(i))
        check_obj(obj, i)
        obj.release()
    assert m.stats.get("local_disk.stored") >= n - 2
    assert len(disk) < n


def test_file_larger_than_any_chunk_is_not_read(make_manager):
    m = make_manager()
    stored(m, 0)
    disk = disk_of(m)
    p0 = disk.path_of(key(0))
    with open(p0, "r+b") as f:
        f.truncate(disk.max_file + (1 << 20))
    assert m.get(key(0)) is None
    assert not Path(p0).exists()
