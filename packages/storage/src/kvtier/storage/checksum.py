"""The trailer checksum of a stored value (``codec``): CRC-32 over the header and then the
little-endian XXH3-64 of each ``SEGMENT`` of the payload, the segments hashed on helper threads.

XXH3 hashes the payload at memory speed (about 24 GB/s a core here, against 4.4 for CRC-32),
and the segment hashes are independent, so one value's check is not bound to one core and runs
while the payload is written, sent, read or copied.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

SEGMENT = 512 << 10

_crc_pool: ThreadPoolExecutor | None = None
_crc_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _crc_pool
    with _crc_pool_lock:
        if _crc_pool is None:
            workers = max(2, min(8, os.cpu_count() or 2))
            _crc_pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-crc")
        return _crc_pool


class Checksum:
    """The trailer checksum of one value, its payload segments hashed on helper threads.

    ``add`` payload bytes in order, in pieces whose sizes are multiples of ``SEGMENT`` (except
    the last piece). The segment hashes run on helper threads, so the caller overlaps its own I/O
    or copies with the hashing. The caller must keep the added buffers alive and unchanged until
    ``value()`` or ``wait()`` returns; call ``wait()`` in a ``finally`` on error paths.
    """

    def __init__(self, header_crc: int) -> None:
        self._start = header_crc
        self._parts: list[Future[int] | int] = []
        self._tail = False

    def _segments(self, data: memoryview | bytes) -> list[memoryview]:
        view = memoryview(data).cast("B")
        if self._tail:
            raise ValueError("payload pieces after a partial segment")
        segs = [view[start : start + SEGMENT] for start in range(0, view.nbytes, SEGMENT)]
        if segs:
            self._tail = segs[-1].nbytes < SEGMENT
        return segs

    def add(self, data: memoryview | bytes) -> None:
        for seg in self._segments(data):
            self._parts.append(_pool().submit(xxhash.xxh3_64_intdigest, seg))

    def add_now(self, data: memoryview | bytes) -> None:
        """Like ``add``, but hashed on the calling thread before it returns: for bytes that
        just landed in this core's cache (a reader hashing each segment as it reads it), which
        a helper thread would read again from memory."""
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n <= SEGMENT and not self._tail:  # one segment (a reader's usual piece): no slicing
            self._tail = n < SEGMENT
            self._parts.append(xxhash.xxh3_64_intdigest(data))
            return
        for seg in self._segments(data):
            self._parts.append(xxhash.xxh3_64_intdigest(seg))

    def wait(self) -> None:
        for part in self._parts:
            if not isinstance(part, int):
                part.exception()

    def value(self) -> int:
        digests = [part if isinstance(part, int) else part.result() for part in self._parts]
        # the segment digests' little-endian bytes, in order (one crc32 call over them all)
        return zlib.crc32(struct.pack(f"<{len(digests)}Q", *digests), self._start)
