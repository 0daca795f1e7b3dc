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

from kvtier.core.keys import KeyFactory
from kvtier.storage.bench_common import Bench, Shape, filled_objects, make_backend


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


def bench_disk(b: Bench, shape: Shape, disk_dir: Path, *, sealed: bool = False) -> None:
    """The disk tier against raw file I/O; ``sealed``: with ``encryption_key`` (AES-256-GCM),
    rows with variant ``sealed`` (put, page-cache get)."""
    from kvtier.storage.backends.local_disk import LocalDiskBackend

    arena, objs = filled_objects(shape)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=disk_dir))
    raw_dir = root / "raw"
    raw_dir.mkdir()
    extra = {"encryption_key": os.urandom(32).hex()} if sealed else {}
    disk = make_backend(LocalDiskBackend, shape, arena, local_disk_path=str(root / "tier"),
                    local_disk_size_gb=64.0, **extra)
    assert isinstance(disk, LocalDiskBackend)
    keys = KeyFactory("bench", shape.layout.fingerprint())
    nbytes = shape.meta.nbytes * shape.batch
    sink = [np.empty(shape.meta.nbytes, dtype=np.uint8) for _ in range(shape.batch)]

    def k(r: int, i: int):
        return keys.key(r.to_bytes(4, "little") + i.to_bytes(4, "little"))

    def clear() -> None:
        disk.remove([k(r, i) for r in range(b.repeat + 1) for i in range(shape.batch)])
        for p in raw_dir.iterdir():
            p.unlink()

    def raw_put(r: int) -> Callable[[], None]:
        def run() -> None:
            for i, o in enumerate(objs):
                _write_raw(str(raw_dir / f"{i}"), o.byte_view())
        return run

    def put(r: int) -> Callable[[], None]:
        return lambda: disk.batched_put([(k(r, i), o) for i, o in enumerate(objs)])

    cold = False

    def raw_get(r: int) -> Callable[[], None]:
        raw_put(r)()
        if cold:
            _drop_cache(raw_dir)

        def run() -> None:
            for i, buf in enumerate(sink):
                _read_raw(str(raw_dir / f"{i}"), buf.data)
        return run

    def get(r: int) -> Callable[[], None]:
        put(r)()
        if cold:
            _drop_cache(disk.dir)

        def run() -> None:
            got = disk.batched_get([k(r, i) for i in range(shape.batch)], arena.allocate)
            assert all(g is not None for g in got), "disk bench read missed"
            for g in got:
                g.release()  # type: ignore[union-attr]
        return run

    try:
        if sealed:
            b.compare("local_disk", shape, "put", nbytes, put, raw_put, clear, variant="sealed")
            b.compare("local_disk", shape, "get", nbytes, get, raw_get, clear,
                      variant="page-cache sealed")
            return
        b.compare("local_disk", shape, "put", nbytes, put, raw_put, clear)
        b.compare("local_disk", shape, "get", nbytes, get, raw_get, clear, variant="page-cache")
        cold = True
        b.compare("local_disk", shape, "get", nbytes, get, raw_get, clear, variant="from-device")
    finally:
        disk.close()
        for o in objs:
            o.release()
        shutil.rmtree(root, ignore_errors=True)
