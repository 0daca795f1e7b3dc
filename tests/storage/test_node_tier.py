"""The node tier (``kvtier.storage.backends.node``): one memory tier for every kvtier process of a
host. Processes here are real ones (``node_worker.py``) where the claim is about processes:
chunks written by several at once read back exactly in all of them, a writer killed mid-write
leaves nothing readable, a restart keeps what was written. One budget holds across namespaces;
the directory is refused when it is not private or not memory. Round trips, damage, namespaces
and LRU within a namespace are the conformance suite's (tests/conformance)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from node_worker import model_keys, node_backend, put, read
from storage_helpers import meta

from kvtier.core.errors import ConfigError
from kvtier.core.memory import HostArena
from kvtier.storage.backends.disk.local_disk import SUFFIX, TMP_SUFFIX
from kvtier.storage.backends.node import file_system_of

HERE = Path(__file__).parent
GiB = 1 << 30


def worker(node: Path, model: str, *args: object) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    cmd = [sys.executable, str(HERE / "node_worker.py"), str(node), model, *map(str, args)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"node worker failed (rc={proc.returncode})"
    return out


def chunk_files(node: Path) -> list[Path]:
    return sorted(node.rglob(f"*{SUFFIX}"))


def test_processes_write_and_read_each_others_chunks_exactly(node_dir: Path) -> None:
    writers = [worker(node_dir, "m", "write", 100 * p, 12) for p in range(3)]
    for w in writers:
        finished(w)
    readers = [worker(node_dir, "m", "read", 100 * p, 12) for p in range(3)]
    for p, r in enumerate(readers):
        got = json.loads(finished(r))
        assert got == {"hits": list(range(100 * p, 100 * p + 12)), "wrong": []}
    # One copy of each chunk on the node, whoever wrote or read it
    assert len(chunk_files(node_dir)) == 36


def test_a_writer_killed_mid_write_leaves_nothing_readable(node_dir: Path) -> None:
    finished(worker(node_dir, "m", "write", 0, 2))
    hung = worker(node_dir, "m", "hang", 7)
    assert hung.stdout is not None and hung.stdout.readline().strip() == "writing"
    hung.send_signal(signal.SIGKILL)
    hung.wait(timeout=30)
    partial = list(node_dir.rglob(f"*{TMP_SUFFIX}"))
    assert partial, "the killed writer's half-written file is there, under a temporary name"
    assert json.loads(finished(worker(node_dir, "m", "read", 7, 1))) == {"hits": [], "wrong": []}
    assert json.loads(finished(worker(node_dir, "m", "read", 0, 2)))["hits"] == [0, 1]
    finished(worker(node_dir, "m", "write", 7, 1))  # restarted, it stores the chunk whole
    assert json.loads(finished(worker(node_dir, "m", "read", 7, 1))) == {"hits": [7], "wrong": []}


def test_what_a_process_wrote_outlives_it(node_dir: Path) -> None:
    finished(worker(node_dir, "m", "write", 0, 4))
    arena = HostArena.create(16 * meta().nbytes)
    backend = node_backend(node_dir, "m", arena)
    try:
        assert read(backend, arena, model_keys("m"), range(4)) == {
            "hits": [0, 1, 2, 3],
            "wrong": [],
        }
    finally:
        backend.close()


def test_one_budget_for_every_namespace_least_recently_used_first(node_dir: Path) -> None:
    arena = HostArena.create(64 * meta().nbytes)
    probe = node_backend(node_dir.parent / "probe", "m", arena)
    put(probe, arena, model_keys("m"), 0)
    size, largest = probe.used_bytes, probe.max_file
    probe.close()
    limit = 6 * size + largest  # six chunks, and room for the next write
    budget = limit / GiB
    a = node_backend(node_dir, "model-a", arena, node_size_gb=budget, node_rescan_s=0)
    b = node_backend(node_dir, "model-b", arena, node_size_gb=budget, node_rescan_s=0)
    ka, kb = model_keys("model-a"), model_keys("model-b")
    try:
        for i in range(4):
            put(a, arena, ka, i)
        os.utime(a.path_of(ka.key((0).to_bytes(16, "little"))), (1, 1))  # a's oldest
        for i in range(4):
            put(b, arena, kb, i)  # b's writes make room by evicting a's least recent
        assert sum(f.stat().st_size for f in chunk_files(node_dir)) <= limit
        assert read(b, arena, kb, range(4)) == {"hits": [0, 1, 2, 3], "wrong": []}
        kept = read(a, arena, ka, range(4))["hits"]
        assert kept == list(range(4 - len(kept), 4)) and 0 not in kept, "a's oldest went first"
        assert a.used_bytes + b.used_bytes <= limit
    finally:
        a.close()
        b.close()


def test_a_directory_not_private_or_not_memory_is_refused(node_dir: Path, tmp_path) -> None:
    arena = HostArena.create(4 * meta().nbytes)
    open_dir = node_dir.parent / "open"
    open_dir.mkdir(mode=0o755, parents=True)
    open_dir.chmod(0o755)
    with pytest.raises(ConfigError, match=r"node_path.*mode 755"):
        node_backend(open_dir, "m", arena)
    link = node_dir.parent / "link"
    link.symlink_to(open_dir)
    with pytest.raises(ConfigError, match=r"node_path.*not a directory"):
        node_backend(link, "m", arena)
    if file_system_of(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("the test's temporary directory is in memory here")
    with pytest.raises(ConfigError, match=r"node_path.*not a memory file system"):
        node_backend(tmp_path / "on-disk", "m", arena)


def test_another_users_directory_is_refused(node_dir: Path, monkeypatch) -> None:
    node_dir.mkdir(mode=0o700, parents=True)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(node_dir).st_uid + 1)
    with pytest.raises(ConfigError, match=r"node_path.*belongs to user id"):
        node_backend(node_dir, "m", HostArena.create(4 * meta().nbytes))


def test_the_file_system_is_the_last_mount_of_the_longest_mount_point(tmp_path) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 0:20 / / rw - overlay overlay rw\n"
        "25 22 0:23 / /dev/shm rw - ext4 /dev/sda1 rw\n"
        "30 25 0:27 / /dev/shm rw - tmpfs tmpfs rw\n"
        "31 22 0:28 / /data\\040dir rw - tmpfs tmpfs rw\n"
        "malformed\n"
    )
    assert file_system_of(Path("/dev/shm/kvtier-0"), str(table)) == "tmpfs"
    assert file_system_of(Path("/dev/shmx"), str(table)) == "overlay"
    assert file_system_of(Path("/data dir/x"), str(table)) == "tmpfs"
    assert file_system_of(Path("/x"), str(tmp_path / "missing")) is None


def test_the_node_s_usage_is_every_namespace_s(node_dir: Path) -> None:
    from types import SimpleNamespace

    from kvtier.core.metrics import storage_values

    arena = HostArena.create(16 * meta().nbytes)
    for model, first in (("model-a", 0), ("model-b", 10)):
        b = node_backend(node_dir, model, arena)
        for i in range(first, first + 3):
            put(b, arena, model_keys(model), i)
        b.close()
    files = chunk_files(node_dir)
    c = node_backend(node_dir, "model-c", arena)
    try:
        assert c.node_usage == (sum(f.stat().st_size for f in files), 6)
        out: dict = {}
        storage_values(SimpleNamespace(tiers=[c]), out)
        assert out["node_used_bytes"] == {"": c.node_usage[0]} and out["node_chunks"] == {"": 6}
        assert out["tier_used_bytes"] == {"node": 0}  # model-c's own
    finally:
        c.close()


def test_a_directory_under_one_anyone_may_change_is_refused(node_dir: Path) -> None:
    open_parent = node_dir.parent / "shared"
    open_parent.mkdir(parents=True)
    open_parent.chmod(0o777)  # no sticky bit: anyone could rename the node directory away
    with pytest.raises(ConfigError, match=r"node_path.*every user may write"):
        node_backend(open_parent / "node", "m", HostArena.create(4 * meta().nbytes))
    created = node_dir.parent / "new" / "deeper" / "node"
    node_backend(created, "m", HostArena.create(4 * meta().nbytes)).close()
    assert (created.parent.stat().st_mode & 0o777) == 0o700, "missing parents are created 0700"


def test_another_deployments_sealed_chunk_is_a_miss_not_deleted(node_dir: Path) -> None:
    arena = HostArena.create(8 * meta().nbytes)
    keyed = node_backend(node_dir, "m", arena, encryption_key="5a" * 32)
    plain = node_backend(node_dir, "m", arena)
    try:
        put(keyed, arena, model_keys("m"), 3)
        (name,) = chunk_files(node_dir)
        assert read(plain, arena, model_keys("m"), range(3, 4)) == {"hits": [], "wrong": []}
        assert name.exists(), "the other deployment's chunk is still there"
        assert read(keyed, arena, model_keys("m"), range(3, 4)) == {"hits": [3], "wrong": []}
    finally:
        keyed.close()
        plain.close()
