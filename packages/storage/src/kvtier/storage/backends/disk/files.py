"""The chunk files of one disk-tier directory: its namespace directory and ``NAMESPACE`` marker,
the scan at start, and atomic writes (a temporary file, fsync'ed, renamed over the final name:
a reader sees nothing or the whole file)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
import zlib
from pathlib import Path

from kvtier.storage import codec
from kvtier.storage._log import warn_throttled
from kvtier.storage.backends.disk.direct import DirectIO
from kvtier.storage.backends.disk.fileio import create_temp, kind_of, remove_entry, write_all

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
NAMESPACE_FILE = "NAMESPACE"
# Temporary files older than this at start-up belong to a writer that died mid-write.
STALE_TMP_S = 300.0


def namespace_dir(root: Path, namespace: str) -> Path:
    """The directory of one namespace under the tier's root."""
    return root / hashlib.blake2b(namespace.encode(), digest_size=10).hexdigest()


def write_marker(directory: Path, namespace: str) -> None:
    """The namespace's name in ``NAMESPACE`` (read by ``kvtier ls``), written like a chunk."""
    try:
        if stat.S_ISREG(os.lstat(directory / NAMESPACE_FILE).st_mode):
            return
    except FileNotFoundError:
        pass
    fd, tmp = create_temp(directory, NAMESPACE_FILE)
    try:
        try:
            write_all(fd, [(namespace + "\n").encode()])
        finally:
            os.close(fd)
        remove_entry(directory / NAMESPACE_FILE)
        os.replace(directory / tmp, directory / NAMESPACE_FILE)
    except BaseException:
        remove_entry(directory / tmp)
        raise


def scan_chunks(directory: Path) -> tuple[list[tuple[float, str, int]], list[tuple[str, str]]]:
    """The chunk files in ``directory`` as ``(mtime, name, size)``, and the entries at chunk
    names that are not regular files as ``(name, kind)``; stale temporary files are removed."""
    now = time.time()
    found: list[tuple[float, str, int]] = []
    bad: list[tuple[str, str]] = []
    with os.scandir(directory) as it:
        for entry in it:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.endswith(SUFFIX):
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime, entry.name, st.st_size))
                else:
                    bad.append((entry.name, kind_of(st.st_mode)))
            elif entry.name.endswith(TMP_SUFFIX) and now - st.st_mtime > STALE_TMP_S:
                remove_entry(directory / entry.name)
    return found, bad


def write_chunk_file(
    directory: Path,
    name: str,
    header: bytes,
    payload: memoryview,
    direct: DirectIO | None,
    *,
    durable: bool = True,
) -> os.stat_result:
    """Write the chunk file ``name`` atomically (with O_DIRECT through ``direct``); the new
    file's ``fstat``. Raises ``OSError`` (the temporary file removed). ``durable=False`` skips
    the fsync: for alias entries, which a crash can only turn into a checksummed miss."""
    fd, tmp = create_temp(directory, name, os.O_DIRECT if direct is not None else 0)
    try:
        try:
            if direct is not None:
                direct.write(fd, header, payload)
            else:
                cs = codec.Checksum(zlib.crc32(header))
                try:
                    cs.add(payload)
                    write_all(fd, [header, payload])
                finally:
                    cs.wait()  # the helpers must be done with the buffer
                write_all(fd, [codec.TRAILER.pack(cs.value())])
            if durable:
                os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        try:
            os.replace(directory / tmp, directory / name)
        except OSError as e:
            # something planted at the name (a directory): remove it if it can be, once
            if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST) or not remove_entry(
                directory / name
            ):
                raise
            os.replace(directory / tmp, directory / name)
    except BaseException:
        try:
            remove_entry(directory / tmp)
        except OSError as e:
            warn_throttled("disk-unlink", "kvtier disk tier: cannot delete %s: %s", tmp, e)
        raise
    return st
