"""O_DIRECT reads and writes of chunk files (``local_disk_o_direct``).

O_DIRECT needs page-aligned buffers and lengths, and the host arena aligns objects to 256 bytes,
so each I/O thread goes through a page-aligned bounce buffer of one file's size: one extra copy,
overlapped with the checksum. A write pads to a page and truncates back to the file's length.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.errors import ConfigError
from kvtier.storage import codec
from kvtier.storage.backends.disk.fileio import PAGE, create_temp, remove_entry, round_up, write_all

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import MemoryObj, MemoryObjMeta
    from kvtier.storage.sealing import Sealer


class DirectIO:
    """O_DIRECT file I/O for one directory; a file system that refuses O_DIRECT is a
    ``ConfigError`` when this is built."""

    def __init__(self, directory: Path) -> None:
        self._tls = threading.local()
        try:
            fd, tmp = create_temp(directory, ".odirect", os.O_DIRECT)
        except OSError as e:
            raise ConfigError(
                "local_disk_o_direct", True, f"the file system of {directory} refuses O_DIRECT: {e}"
            ) from None
        try:
            os.write(fd, mmap.mmap(-1, PAGE))
        except OSError as e:
            raise ConfigError(
                "local_disk_o_direct", True, f"the file system of {directory} refuses O_DIRECT: {e}"
            ) from None
        finally:
            os.close(fd)
            remove_entry(directory / tmp)

    def _bounce(self, nbytes: int) -> memoryview:
        """This thread's page-aligned buffer, at least ``nbytes`` long."""
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = mmap.mmap(-1, round_up(nbytes, PAGE))
            self._tls.buf = buf
        return memoryview(buf)

    def write(self, fd: int, header: bytes, payload: memoryview) -> None:
        """Write header + payload + checksum trailer to the O_DIRECT file ``fd``."""
        total = len(header) + payload.nbytes + codec.TRAILER.size
        padded = round_up(total, PAGE)
        buf = self._bounce(padded)
        end = len(header) + payload.nbytes
        buf[: len(header)] = header
        cs = codec.Checksum(zlib.crc32(header))
        try:
            cs.add(payload)
            np.copyto(
                np.frombuffer(buf[len(header) : end], dtype=np.uint8),
                np.frombuffer(payload, dtype=np.uint8),
            )
        finally:
            cs.wait()  # the helpers must be done with the buffer
        buf[end:total] = codec.TRAILER.pack(cs.value())
        buf[total:padded] = bytes(padded - total)
        write_all(fd, [buf[:padded]])
        os.ftruncate(fd, total)

    def read(
        self,
        fd: int,
        size: int,
        *,
        key: ChunkKey,
        layout: KVLayout,
        max_tokens: int,
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
        sealer: Sealer | None = None,
    ) -> MemoryObj | None:
        """The chunk in the O_DIRECT file ``fd`` of ``size`` bytes (the caller bounds ``size``).
        Raises ``PayloadError`` for a bad file; None when host memory is full."""
        buf = self._bounce(round_up(max(size, 1), PAGE))
        done = 0
        while done < size:
            n = os.preadv(fd, [buf[done : round_up(size, PAGE)]], done)
            if n == 0 or (n % PAGE and done + n < size):
                break
            done += n
        if done != size:
            raise codec.PayloadError(f"truncated: read {done} of {size} bytes")
        return codec.decode_into_object(
            buf[:size],
            key=key,
            layout=layout,
            max_tokens=max_tokens,
            allocate=allocate,
            sealer=sealer,
        )
