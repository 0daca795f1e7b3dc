"""File primitives of the disk tier: safe opens, whole reads and writes, bad-entry removal.

Every open of a chunk path refuses to follow a symlink and never blocks (``O_NOFOLLOW |
O_NONBLOCK``); what it opened is checked with ``fstat`` and anything but a regular file (a FIFO,
a directory, a device, a socket) is refused with ``NotRegular``, so nothing planted at a chunk
path can hang a read or pose as a chunk. Temporary files are created with ``O_EXCL |
O_NOFOLLOW`` and mode ``0600`` under a random name, so a planted file or symlink is never
written through.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.storage import codec

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import MemoryObj, MemoryObjMeta
    from kvtier.storage.sealing import Sealer

PAGE = 4096
FILE_MODE = 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# errnos an open of a non-regular entry gives: a symlink with O_NOFOLLOW (ELOOP), a directory
# opened for writing or with O_DIRECT (EISDIR, EINVAL), a FIFO or socket without a peer (ENXIO).
_NOT_REGULAR_ERRNOS = {errno.ELOOP, errno.EISDIR, errno.EINVAL, errno.ENXIO, errno.ENOTDIR}


class NotRegular(OSError):
    """A chunk path holds something other than a regular file (``kind`` says what)."""

    def __init__(self, path: Path | str, kind: str) -> None:
        self.kind = kind
        super().__init__(f"{path} is a {kind}, not a regular file")


def kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def open_regular(path: Path | str, extra_flags: int = 0) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only without following a symlink or blocking; ``(fd, fstat)``.

    Raises ``FileNotFoundError`` when nothing is there, ``NotRegular`` for anything that is not
    a regular file, other ``OSError`` for I/O failures."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC | extra_flags)
    except OSError as e:
        if e.errno in _NOT_REGULAR_ERRNOS:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                raise e from None
            if not stat.S_ISREG(st.st_mode):
                raise NotRegular(path, kind_of(st.st_mode)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(path, kind_of(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def create_temp(directory: Path, name: str, extra_flags: int = 0) -> tuple[int, str]:
    """A new temporary file for ``name`` in ``directory`` (``O_EXCL``, no symlink, ``0600``);
    ``(fd, temporary name)``."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | extra_flags
    return os.open(directory / tmp, flags, FILE_MODE), tmp


def remove_entry(path: Path) -> bool:
    """Remove whatever sits at ``path`` (a file, a link, a FIFO, an empty directory); True if
    nothing is left. A non-empty directory is left in place (False: the caller bypasses it);
    an entry that cannot be deleted for another reason raises that ``OSError``."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except (IsADirectoryError, PermissionError):
        # unlink of a directory is EISDIR on Linux, EPERM elsewhere; a file the process may
        # not delete is reported as what it is, not as a directory.
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise
        except FileNotFoundError:
            return True
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False


def write_all(fd: int, parts: Sequence[memoryview | bytes]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def read_into(fd: int, view: memoryview, offset: int, tail: memoryview | None = None) -> int:
    """Read up to ``view.nbytes`` bytes at ``offset`` into ``view`` (and, with ``tail``, the
    bytes after them into ``tail``, in the same ``preadv``); the count read (short at end of
    file)."""
    views = [view] if tail is None else [view, tail]
    want = sum(v.nbytes for v in views)
    done = 0
    while done < want:
        n = os.preadv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return done


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def read_checksummed(
    fd: int, view: memoryview, offset: int, cs: codec.Checksum, trailer: memoryview
) -> None:
    """Read ``view.nbytes`` bytes at ``offset`` into ``view``, one checksum segment at a time,
    each hashed into ``cs`` on this thread right after it is read, while it is still in this
    core's cache (hashing on helper threads afterwards reads every byte from memory a second
    time, and their hand-offs cost more than the hash), and the ``trailer.nbytes`` bytes after
    the payload into ``trailer`` with the last segment. Raises ``PayloadError`` if the file is
    short."""
    last = max(0, (view.nbytes - 1) // codec.SEGMENT * codec.SEGMENT)
    for start in range(0, view.nbytes, codec.SEGMENT):
        seg = view[start : start + codec.SEGMENT]
        tail = trailer if start == last else None
        want = seg.nbytes + (trailer.nbytes if tail is not None else 0)
        if read_into(fd, seg, offset + start, tail) != want:
            raise codec.PayloadError("truncated: file ended inside the payload")
        cs.add_now(seg)


_HEAD_GUESS = 4096


def read_header(
    fd: int,
    size: int,
    *,
    key: ChunkKey,
    layout: KVLayout,
    max_tokens: int,
    sealer: Sealer | None = None,
) -> codec.Header:
    """Check the header of the open chunk file ``fd`` of ``size`` bytes against ``key``; the
    file's length must be exactly what the header says. Raises ``PayloadError``."""
    head = os.pread(fd, _HEAD_GUESS, 0)  # a header is a few hundred bytes: one read, mostly
    header_len, payload_len = codec.prefix_lengths(head)
    if size != header_len + payload_len + codec.TRAILER.size:
        raise codec.PayloadError(
            f"truncated: file of {size} bytes, header says "
            f"{header_len + payload_len + codec.TRAILER.size}"
        )
    if header_len > len(head):
        head = os.pread(fd, header_len, 0)
    return codec.decode_header(
        head[:header_len], key=key, layout=layout, max_tokens=max_tokens, sealer=sealer
    )


def _read_sealed(fd: int, dst: memoryview, header: codec.Header) -> bytes:
    """Read a sealed file's ciphertext into ``dst`` (each checksum segment hashed as it lands,
    like ``read_checksummed``; the segments run over ciphertext + tag) and return its tag."""
    n = dst.nbytes
    total = header.payload_len  # n + the tag
    cs = codec.Checksum(header.crc_of_header)
    tag = b""
    for start in range(0, total, codec.SEGMENT):
        end = min(start + codec.SEGMENT, total)
        head = dst[min(start, n) : min(end, n)]
        if read_into(fd, head, header.header_len + start) != head.nbytes:
            raise codec.PayloadError("truncated: file ended inside the payload")
        if end <= n:
            cs.add_now(head)
            continue
        tag_at = max(start, n)
        part = os.pread(fd, end - tag_at, header.header_len + tag_at)
        tag += part
        cs.add_now(bytes(head) + part)
    if len(tag) != total - n:
        raise codec.PayloadError("truncated: file ended inside the tag")
    codec.check_trailer(cs.value(), os.pread(fd, codec.TRAILER.size, header.header_len + total))
    return tag


def read_chunk(
    fd: int,
    size: int,
    *,
    key: ChunkKey,
    layout: KVLayout,
    max_tokens: int,
    allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    sealer: Sealer | None = None,
    view_of: Callable[[MemoryObj], memoryview] | None = None,
) -> MemoryObj | None:
    """The chunk in the open file ``fd`` of ``size`` bytes (bounded by the caller), read into a
    new host object and checked (a sealed one read as ciphertext, checked, then decrypted in
    place). ``view_of(obj)``: ``obj.byte_view()``, faster (``_views.ArenaBytes``). Raises
    ``PayloadError`` for a bad file; None when host memory is full."""
    header = read_header(fd, size, key=key, layout=layout, max_tokens=max_tokens, sealer=sealer)
    obj = allocate(header.meta)
    if obj is None:
        return None
    try:
        view = obj.byte_view() if view_of is None else view_of(obj)
        if header.sealed:
            assert sealer is not None  # read_header refuses a sealed file without one
            tag = _read_sealed(fd, view, header)
            codec.unseal_in_place(header, view, tag, key, sealer)
        else:
            cs = codec.Checksum(header.crc_of_header)
            trailer = memoryview(bytearray(codec.TRAILER.size))
            read_checksummed(fd, view, header.header_len, cs, trailer)
            codec.check_trailer(cs.value(), trailer)
    except BaseException:
        obj.release()
        raise
    return obj
