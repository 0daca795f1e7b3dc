"""The disk tier's rows of ``kvtier bench storage``: the tier's ``batched_put``/``batched_get``
against raw ``write`` + ``fsync`` and ``preadv`` of the same bytes, reads from the page cache and
from the device; with ``sealed``, the same with ``encryption_key`` set."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvtier.bench.storage_common import Bench, Shape, filled_objects, make_backend
from kvtier.core.keys import ChunkKey, KeyFactory


def _write_raw(path: str, view: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < view.nbytes:
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_raw(path: str, view: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < view.nbytes:
            n = os.preadv(fd, [view[done:]], done)
            if not n:
                raise OSError(f"{path} is short")
            done += n
    finally:
        os.close(fd)


def _drop_cache(directory: Path) -> None:
    """Evict a directory's (clean, fsync'ed) files from the page cache: the next read hits the
    device."""
    for p in directory.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _DiskRounds:
    """One shape's batch on the disk tier and as raw files side by side; each method prepares a
    round (untimed) and returns its timed part, as ``Bench.compare`` expects."""

    def __init__(self, b: Bench, shape: Shape, disk_dir: Path, sealed: bool) -> None:
        from kvtier.storage.backends.disk.local_disk import LocalDiskBackend

        self.repeat, self.batch = b.repeat, shape.batch
        self.arena, self.objs = filled_objects(shape)
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=disk_dir))
        self.raw_dir = self.root / "raw"
        self.raw_dir.mkdir()
        extra = {"encryption_key": os.urandom(32).hex()} if sealed else {}
        disk = make_backend(
            LocalDiskBackend,
            shape,
            self.arena,
            local_disk_path=str(self.root / "tier"),
            local_disk_size_gb=64.0,
            **extra,
        )
        assert isinstance(disk, LocalDiskBackend)
        self.disk = disk
        self.keys = KeyFactory("bench", shape.layout.fingerprint())
        self.sink = [np.empty(shape.meta.nbytes, dtype=np.uint8) for _ in range(shape.batch)]
        self.cold = False  # reads from the device: files evicted from the page cache first

    def key(self, r: int, i: int) -> ChunkKey:
        return self.keys.key(r.to_bytes(4, "little") + i.to_bytes(4, "little"))

    def clear(self) -> None:
        self.disk.remove(
            [self.key(r, i) for r in range(self.repeat + 1) for i in range(self.batch)]
        )
        for p in self.raw_dir.iterdir():
            p.unlink()

    def raw_put(self, r: int) -> Callable[[], None]:
        def run() -> None:
            for i, o in enumerate(self.objs):
                _write_raw(str(self.raw_dir / f"{i}"), o.byte_view())

        return run

    def put(self, r: int) -> Callable[[], None]:
        return lambda: self.disk.batched_put([(self.key(r, i), o) for i, o in enumerate(self.objs)])

    def raw_get(self, r: int) -> Callable[[], None]:
        self.raw_put(r)()
        if self.cold:
            _drop_cache(self.raw_dir)

        def run() -> None:
            for i, buf in enumerate(self.sink):
                _read_raw(str(self.raw_dir / f"{i}"), buf.data)

        return run

    def get(self, r: int) -> Callable[[], None]:
        self.put(r)()
        if self.cold:
            _drop_cache(self.disk.dir)

        def run() -> None:
            got = self.disk.batched_get(
                [self.key(r, i) for i in range(self.batch)], self.arena.allocate
            )
            assert all(g is not None for g in got), "disk bench read missed"
            for g in got:
                g.release()  # type: ignore[union-attr]

        return run

    def close(self) -> None:
        self.disk.close()
        for o in self.objs:
            o.release()
        shutil.rmtree(self.root, ignore_errors=True)


def bench_disk(b: Bench, shape: Shape, disk_dir: Path, *, sealed: bool = False) -> None:
    """The disk tier against raw file I/O; ``sealed``: with ``encryption_key`` (AES-256-GCM),
    rows with variant ``sealed`` (put, page-cache get)."""
    d = _DiskRounds(b, shape, disk_dir, sealed)
    nbytes = shape.meta.nbytes * shape.batch
    try:
        if sealed:
            b.compare(
                "local_disk", shape, "put", nbytes, d.put, d.raw_put, d.clear, variant="sealed"
            )
            b.compare(
                "local_disk",
                shape,
                "get",
                nbytes,
                d.get,
                d.raw_get,
                d.clear,
                variant="page-cache sealed",
            )
            return
        b.compare("local_disk", shape, "put", nbytes, d.put, d.raw_put, d.clear)
        b.compare(
            "local_disk", shape, "get", nbytes, d.get, d.raw_get, d.clear, variant="page-cache"
        )
        d.cold = True
        b.compare(
            "local_disk", shape, "get", nbytes, d.get, d.raw_get, d.clear, variant="from-device"
        )
    finally:
        d.close()
