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

from kvtier.core.affinity import enter_background

SEGMENT = 512 << 10

_crc_pool: ThreadPoolExecutor | None = None
_crc_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _crc_pool
    with _crc_pool_lock:
        if _crc_pool is None:
            workers = max(2, min(8, os.cpu_count() or 2))
            _crc_pool = ThreadPoolExecutor(
                workers, thread_name_prefix="kvtier-crc", initializer=enter_background
            )
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
        segs = self._segments(data)
        if len(segs) == 1:  # hashing one segment costs less than handing it to a helper
            self._parts.append(xxhash.xxh3_64_intdigest(segs[0]))
            return
        for seg in segs:
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
        return combine(
            self._start, [part if isinstance(part, int) else part.result() for part in self._parts]
        )


def combine(header_crc: int, digests: list[int]) -> int:
    """The checksum from the header's CRC and the payload's segment digests, in order: the
    digests' little-endian bytes, one crc32 call over them all."""
    return zlib.crc32(struct.pack(f"<{len(digests)}Q", *digests), header_crc)


class PlacedChecksum:
    """``Checksum``'s value for a payload whose pieces land out of order, on several threads:
    ``add_now(offset, data)`` hashes ``data``, the payload's bytes at ``offset``, on the calling
    thread (the reader that just received them, so they are still in its cache). ``offset`` is a
    multiple of ``SEGMENT`` and ``data``'s length too, unless it ends the payload."""

    def __init__(self, header_crc: int, payload_len: int) -> None:
        self._start = header_crc
        self._digests = [0] * -(-payload_len // SEGMENT)
        self._len = payload_len

    def add_now(self, offset: int, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        if offset % SEGMENT or (end % SEGMENT and end != self._len) or end > self._len:
            raise ValueError(f"piece [{offset}, {end}) is not on the checksum's segments")
        first = offset // SEGMENT
        for n, at in enumerate(range(0, view.nbytes, SEGMENT)):
            # one list slot per segment: threads filling different slots need no lock
            self._digests[first + n] = xxhash.xxh3_64_intdigest(view[at : at + SEGMENT])

    def value(self) -> int:
        """The checksum, once every piece of the payload was added."""
        return combine(self._start, self._digests)
