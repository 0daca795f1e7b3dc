"""Processes sharing one disk-tier directory share its budget: each counts the files the others
wrote (and forgets those they deleted) when it rescans the directory before writing, so the
directory stays within ``local_disk_size_gb`` and nobody reports a hit it cannot deliver. Each
process is a storage manager of its own here (its own index, as a separate process has)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_helpers import (
    LAYOUT,
    NAMESPACE,
    check_obj,
    config,
    disk_of,
    key,
    put_chunk,
)

from kvtier.core.memory import HostArena
from kvtier.storage.backends.disk.local_disk import SUFFIX
from kvtier.storage.manager import TieredStorageManager, tiered_storage_manager

GiB = 1 << 30


class Processes:
    """``n`` storage managers writing one disk directory, each with ``budget`` bytes."""

    def __init__(self, root: Path, n: int, budget: int, rescan_s: float = 0.0) -> None:
        self.root = root
        self.arenas = [HostArena.create(1 << 22) for _ in range(n)]
        self.managers: list[TieredStorageManager] = [
            tiered_storage_manager(
                config=config(
                    root,
                    local_disk_size_gb=budget / GiB,
                    local_disk_rescan_s=rescan_s,
                ),
                arena=arena,
                layout=LAYOUT,
                namespace=NAMESPACE,
            )
            for arena in self.arenas
        ]
        self.dir = disk_of(self.managers[0]).dir

    def store(self, p: int, i: int) -> None:
        """Process ``p`` writes chunk ``i`` to the directory and drops it from host memory."""
        m = self.managers[p]
        put_chunk(m, i)
        m.flush(10)
        m.host.remove([key(i)])

    def on_disk(self) -> int:
        return sum(f.stat().st_size for f in self.dir.iterdir() if f.name.endswith(SUFFIX))

    def check_reads(self, p: int, keys: range) -> None:
        """Whatever process ``p``'s lookup reports is there, with the right bytes."""
        m = self.managers[p]
        m.host.remove([key(i) for i in keys])
        for i, present in zip(keys, m.contains([key(i) for i in keys]), strict=True):
            if present:
                obj = m.get(key(i))
                check_obj(obj, i)
                assert obj is not None
                obj.release()

    def close(self) -> None:
        for m in self.managers:
            m.close()
        for arena in self.arenas:
            assert arena.used_bytes == 0


def file_bytes(tmp_path: Path) -> int:
    """The size of one chunk's file."""
    procs = Processes(tmp_path / "probe", 1, 1 << 30)
    try:
        procs.store(0, 0)
        return procs.on_disk()
    finally:
        procs.close()


def test_two_processes_keep_one_directory_within_the_budget(tmp_path) -> None:
    size = file_bytes(tmp_path)
    procs = Processes(tmp_path / "shared", 2, int(4.5 * size))
    try:
        for i in range(3):
            procs.store(0, i)
        for i in range(10, 13):
            procs.store(1, i)  # counts the first process's three files, evicts to make room
        assert procs.on_disk() <= 4.5 * size
        procs.store(0, 3)  # the first forgets what the second evicted, counts what it wrote
        assert procs.on_disk() <= 4.5 * size
        for p in (0, 1):
            assert disk_of(procs.managers[p]).used_bytes <= 4.5 * size
            procs.check_reads(p, range(14))
    finally:
        procs.close()


def test_files_another_process_deleted_are_forgotten_not_evicted_for(tmp_path) -> None:
    """A file another process evicted leaves this one's count at its next rescan: it does not
    evict good files to make room for a ghost."""
    size = file_bytes(tmp_path)
    procs = Processes(tmp_path / "shared", 2, int(4.5 * size))
    try:
        for i in range(3):
            procs.store(0, i)
        procs.check_reads(0, range(1))  # chunk 0 becomes the first process's most recent
        for i in (10, 11):
            procs.store(1, i)  # the second evicts the oldest file, chunk 0
        procs.store(0, 3)
        assert procs.on_disk() == 4 * size  # one file evicted for chunk 3, not two
        procs.check_reads(0, range(14))
    finally:
        procs.close()


def test_between_rescans_a_process_does_not_see_the_others_files(tmp_path) -> None:
    """The documented bound: with a long rescan interval each process fills its own budget."""
    size = file_bytes(tmp_path)
    procs = Processes(tmp_path / "shared", 2, int(2.5 * size), rescan_s=3600.0)
    try:
        for p in (0, 1):
            for i in range(2):
                procs.store(p, 10 * p + i)
        assert procs.on_disk() == 4 * size
    finally:
        procs.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    writes=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7)), min_size=1, max_size=14),
    budget_files=st.integers(1, 5),
    reader=st.integers(0, 2),
)
def test_any_interleaving_of_writers_stays_within_the_budget_and_serves_only_what_it_holds(
    tmp_path, writes: list[tuple[int, int]], budget_files: int, reader: int
) -> None:
    size = file_bytes(tmp_path)
    with tempfile.TemporaryDirectory(dir=tmp_path) as root:
        procs = Processes(Path(root), 3, int((budget_files + 0.5) * size))
        try:
            for p, i in writes:
                procs.store(p, i)
                assert procs.on_disk() <= (budget_files + 0.5) * size
            procs.check_reads(reader, range(8))
        finally:
            procs.close()
