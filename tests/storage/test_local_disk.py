"""The disk tier's own behaviour: atomic files, restart index, O_DIRECT, write errors, sharing between
processes. Round trips, damaged and foreign files, namespaces and the budget's LRU eviction are in
tests/conformance/test_storage_backend.py (every tier runs them)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from storage_helpers import check_obj, chunk_value, key, meta, put_chunk

from kvtier.storage.backends.disk.local_disk import SUFFIX, TMP_SUFFIX

GiB = 1 << 30


def disk_of(m):
    (disk,) = m.lower
    return disk


def stored(m, *idx, landed=True):
    for i in idx:
        put_chunk(m, i)
    assert m.flush(10) == landed, m.last_flush
    m.host.remove([key(i) for i in idx])


def test_files_are_complete_and_no_temporaries_remain(make_manager):
    m = make_manager()
    stored(m, 0, 1, 2)
    disk = disk_of(m)
    names = sorted(p.name for p in disk.dir.iterdir())
    assert names == sorted([disk.file_name(key(i)) for i in range(3)] + ["NAMESPACE"])
    assert len(disk) == 3
    for i in range(3):
        assert disk.path_of(key(i)).stat().st_size > meta().nbytes


def test_chunk_larger_than_the_budget_is_skipped_with_a_warning(make_manager, caplog):
    m = make_manager(local_disk_size_gb=1000 / GiB)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage"):
        stored(m, 0, landed=False)
    assert m.stats.get("local_disk.store_skipped") == 1
    assert m.last_flush.not_stored == {"local_disk.store_skipped": 1}
    assert "exceeds the budget" in caplog.text
    assert m.get(key(0)) is None


def test_restart_rebuilds_the_index_in_lru_order(make_manager, tmp_path):
    m = make_manager()
    stored(m, 0, 1, 2)
    disk = disk_of(m)
    now = time.time()
    for age, i in ((30, 1), (20, 0), (10, 2)):
        os.utime(disk.path_of(key(i)), (now - age, now - age))
    stale = disk.dir / f".x.1.2{TMP_SUFFIX}"
    stale.write_bytes(b"half a chunk")
    os.utime(stale, (now - 3600, now - 3600))
    m.close()

    m2 = make_manager()
    disk2 = disk_of(m2)
    assert list(disk2._index) == [disk2.file_name(key(i)) for i in (1, 0, 2)]
    assert not stale.exists()
    objs = m2.batched_get([key(i) for i in range(3)])
    for i, obj in enumerate(objs):
        check_obj(obj, i)
        obj.release()
    assert m2.stats.get("local_disk.hits") == 3


def corrupt_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_second_process_sees_what_the_first_wrote(make_manager, tmp_path):
    m = make_manager()
    stored(m, 0, 1, 2)
    disk_root = disk_of(m).root
    code = f"""
from kvtier.core.memory import HostArena
from kvtier.storage.manager import tiered_storage_manager
from storage_helpers import LAYOUT, NAMESPACE, check_obj, config, key
from pathlib import Path
cfg = config(Path({str(tmp_path)!r}), local_disk_path={str(disk_root)!r})
arena = HostArena.create(1 << 22)
m = tiered_storage_manager(config=cfg, arena=arena, layout=LAYOUT, namespace=NAMESPACE)
assert m.prefix_hits([key(i) for i in range(4)]) == 3
for i, obj in enumerate(m.batched_get([key(i) for i in range(3)])):
    check_obj(obj, i)
    obj.release()
m.close()
assert arena.used_bytes == 0
print("OK")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    assert out.stdout.strip() == "OK", out.stderr
    # and the other way: a chunk written after this process started is found on disk
    other = make_manager()
    stored(other, 5)
    assert m.contains([key(5)]) == [True]
    obj = m.get(key(5))
    check_obj(obj, 5)
    obj.release()


def test_write_error_skips_the_store_with_a_warning(make_manager, caplog):
    m = make_manager()
    disk = disk_of(m)
    disk.dir.chmod(0o500)
    try:
        if os.access(disk.dir, os.W_OK):
            pytest.skip("running as a user who can write to a read-only directory (root)")
        with caplog.at_level(logging.WARNING, logger="kvtier.storage"):
            stored(m, 0, landed=False)
    finally:
        disk.dir.chmod(0o755)
    assert m.stats.get("local_disk.store_skipped") == 1
    assert "not stored" in caplog.text


def test_full_disk_skips_the_store(tmp_path):
    """A file-size limit makes writes fail like a full disk (EFBIG): the store is skipped."""
    code = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from pathlib import Path
from kvtier.core.memory import HostArena
from kvtier.storage.manager import tiered_storage_manager
from storage_helpers import LAYOUT, NAMESPACE, config, key, put_chunk
arena = HostArena.create(1 << 22)
m = tiered_storage_manager(config=config(Path({str(tmp_path)!r})), arena=arena, layout=LAYOUT,
                           namespace=NAMESPACE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
put_chunk(m, 0)
assert not m.flush(10)
assert m.stats.get("local_disk.store_skipped") == 1, m.stats
m.host.remove([key(0)])
assert m.get(key(0)) is None
m.close()
assert arena.used_bytes == 0
print("OK")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    assert out.stdout.strip() == "OK", out.stderr
    assert "not stored" in out.stderr
    assert not [p for p in (tmp_path / "disk").rglob("*") if p.name.endswith((SUFFIX, TMP_SUFFIX))]


@pytest.mark.parametrize("tokens", [16, 5])
def test_o_direct_round_trip_restart_and_corruption(make_manager, tokens):
    m = make_manager(local_disk_o_direct=True)
    for i in range(3):
        obj = m.allocate(meta(tokens))
        with obj:
            obj.tensor.copy_(chunk_value(i, tokens))
            m.put(key(i), obj)
    assert m.flush(10)
    m.close()
    m2 = make_manager(local_disk_o_direct=True)
    disk = disk_of(m2)
    corrupt_byte(disk.path_of(key(2)), disk.path_of(key(2)).stat().st_size // 2)
    objs = m2.batched_get([key(i) for i in range(3)])
    for i in range(2):
        check_obj(objs[i], i)
        objs[i].release()
    assert objs[2] is None
    assert m2.stats.get("local_disk.corrupt") == 1
    assert not disk.path_of(key(2)).exists()
    # files written with O_DIRECT read back without it, and the other way round
    plain = make_manager(local_disk_o_direct=False)
    m2.close()
    obj = plain.get(key(0))
    check_obj(obj, 0)
    obj.release()


def test_a_file_that_cannot_be_deleted_is_not_called_a_directory(tmp_path, monkeypatch) -> None:
    """remove_entry used to answer "a non-empty directory" for any file unlink refused."""
    from kvtier.storage.backends.disk import fileio as _disk_io

    victim = tmp_path / "chunk.kv"
    victim.write_bytes(b"x")

    def refuse(path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(_disk_io.os, "unlink", refuse)
    with pytest.raises(PermissionError):
        _disk_io.remove_entry(victim)
    monkeypatch.undo()
    empty = tmp_path / "a-directory"
    empty.mkdir()
    assert _disk_io.remove_entry(empty) is True
