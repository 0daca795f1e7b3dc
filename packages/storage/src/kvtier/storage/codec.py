"""The payload format of every chunk that leaves process memory (disk files, Redis values).

::

    prefix   "<4sHHIQ": magic b"KVTC", format version, flags (0), meta_len, payload_len
    meta     meta_len bytes: UTF-8 JSON {"key", "layout", "dtype", "shape", "tokens"},
             padded with spaces so the payload starts at a multiple of ``align`` when asked
    payload  payload_len bytes: the chunk's tensor bytes ([2, layers, tokens, hidden] or MLA)
    trailer  "<I": the checksum: CRC-32 over prefix, meta and then the little-endian XXH3-64 of
             each 512 KiB segment of the payload (the last one may be shorter)

XXH3 hashes the payload at memory speed (about 24 GB/s a core here, against 4.4 for CRC-32),
so checking a value read from the page cache costs a fraction of reading it. Segment hashes are
independent, so ``Checksum`` computes them on helper threads in parallel (one
chunk's check is not bound to one core) and while the payload is written, sent, read or copied,
or (``add_now``) on a reading thread right after each segment lands, while it is in cache;
the checksum trails the payload so a writer never waits for it before sending. A
decoder accepts a payload only if *every* field agrees with what the reader asked for: the full
key string (so a value swapped between keys, or written by another model, layout or rank, is
foreign), the layout fingerprint, the dtype, the shape (which must be the layout's chunk shape
for ``tokens``) and the payload length; sizes are checked before anything is read into host
memory, and the checksum last. Anything else raises ``PayloadError``: the caller turns it into
a miss, counts it, logs it, and removes the entry. The checksum catches storage and transfer
corruption (it is not a defence against an adversary who can write to the tier: such a writer
could also write well-formed wrong KV).
"""

from __future__ import annotations

import functools
import json
import os
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvtier.core.layout import dtype_name
from kvtier.core.memory import MemoryObj, MemoryObjMeta

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout

MAGIC = b"KVTC"
FORMAT_VERSION = 2  # 2: payload segments hashed with XXH3-64 (1: CRC-32)
PREFIX = struct.Struct("<4sHHIQ")
TRAILER = struct.Struct("<I")
SEGMENT_DIGEST = struct.Struct("<Q")
# A meta section is a few hundred bytes; a larger one is not ours. Alignment padding is
# bounded by the largest alignment we write (one page for O_DIRECT).
MAX_META = 64 * 1024


class PayloadError(ValueError):
    """A stored payload is corrupt, truncated, foreign or stale; ``reason`` says which check."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class Header:
    """A parsed, checked header; ``header_len`` is where the payload starts."""

    key: str
    meta: MemoryObjMeta
    header_len: int
    payload_len: int
    crc_of_header: int

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len + TRAILER.size


@functools.lru_cache(maxsize=64)
def _fingerprint(layout: KVLayout) -> str:
    """``layout.fingerprint()``, computed once per layout (it serialises every field: a tenth of
    a 2 MiB chunk's read time when done per chunk)."""
    return layout.fingerprint()


def encode_header(key: ChunkKey, meta: MemoryObjMeta, layout: KVLayout, *, align: int = 0) -> bytes:
    """The header (prefix + meta) of the chunk ``meta`` stored under ``key``."""
    body = json.dumps(
        {
            "key": key.to_string(),
            "layout": _fingerprint(layout),
            "dtype": dtype_name(meta.dtype),
            "shape": list(meta.shape),
            "tokens": meta.num_tokens,
        },
        separators=(",", ":"),
    ).encode()
    if align > 1:
        pad = -(PREFIX.size + len(body)) % align
        body += b" " * pad
    if len(body) > MAX_META:
        raise ValueError(f"chunk header of {len(body)} bytes is too large")
    return PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), meta.nbytes) + body


def trailer(header: bytes, payload: memoryview | bytes) -> bytes:
    """The checksum trailer of ``header`` + ``payload``."""
    cs = Checksum(zlib.crc32(header))
    cs.add(payload)
    return TRAILER.pack(cs.value())


def encode(
    key: ChunkKey, meta: MemoryObjMeta, layout: KVLayout, payload: memoryview, *, align: int = 0
) -> tuple[bytes, bytes]:
    """``(header, trailer)`` of ``payload``: the stored value is header + payload + trailer."""
    if payload.nbytes != meta.nbytes:
        raise ValueError(f"payload has {payload.nbytes} bytes, its meta says {meta.nbytes}")
    header = encode_header(key, meta, layout, align=align)
    return header, trailer(header, payload)


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
        for seg in self._segments(data):
            self._parts.append(xxhash.xxh3_64_intdigest(seg))

    def wait(self) -> None:
        for part in self._parts:
            if not isinstance(part, int):
                part.exception()

    def value(self) -> int:
        crc = self._start
        for part in self._parts:
            digest = part if isinstance(part, int) else part.result()
            crc = zlib.crc32(SEGMENT_DIGEST.pack(digest), crc)
        return crc


def prefix_lengths(prefix: bytes | memoryview) -> tuple[int, int]:
    """``(header_len, payload_len)`` from the first ``PREFIX.size`` bytes, before trusting more.

    The whole stored value is ``header_len + payload_len + TRAILER.size`` bytes."""
    if len(prefix) < PREFIX.size:
        raise PayloadError(f"truncated: {len(prefix)} bytes, a header needs {PREFIX.size}")
    magic, version, flags, meta_len, payload_len = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise PayloadError("foreign: bad magic")
    if version != FORMAT_VERSION:
        raise PayloadError(f"stale: format version {version}, this kvtier reads {FORMAT_VERSION}")
    if flags != 0:
        raise PayloadError(f"unknown flags {flags:#x}")
    if meta_len > MAX_META:
        raise PayloadError(f"corrupt: meta length {meta_len}")
    return PREFIX.size + meta_len, payload_len


def stored_key(buf: bytes | memoryview) -> str:
    """The key string a stored value's header names, checked only for being a well-formed
    header (inventory tools: what is this entry?). ``buf`` holds at least the whole header."""
    header_len, _ = prefix_lengths(buf)
    if len(buf) < header_len:
        raise PayloadError(f"truncated: {len(buf)} bytes, the header needs {header_len}")
    try:
        key = json.loads(bytes(memoryview(buf)[PREFIX.size : header_len]))["key"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise PayloadError(f"corrupt: unreadable meta ({type(e).__name__})") from None
    if not isinstance(key, str):
        raise PayloadError("corrupt: the key is not a string")
    return key


def decode_header(
    buf: bytes | memoryview, *, key: ChunkKey, layout: KVLayout, max_tokens: int
) -> Header:
    """Check the header at the start of ``buf`` against what the reader asked for.

    ``buf`` must hold at least the whole header (``prefix_lengths(...)[0]`` bytes). The payload
    itself is not looked at: call ``verify`` once it has been read.
    """

    header_len, payload_len = prefix_lengths(buf)
    if len(buf) < header_len:
        raise PayloadError(f"truncated: {len(buf)} bytes, the header needs {header_len}")
    view = memoryview(buf)
    try:
        fields = json.loads(bytes(view[PREFIX.size : header_len]))
        stored_key = fields["key"]
        fp = fields["layout"]
        dtype = fields["dtype"]
        shape = tuple(int(s) for s in fields["shape"])
        tokens = fields["tokens"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise PayloadError(f"corrupt: unreadable meta ({type(e).__name__})") from None
    want = key.to_string()
    if stored_key != want:
        raise PayloadError(f"foreign: stored under {str(stored_key)[:200]!r}, asked for {want!r}")
    if fp != _fingerprint(layout):
        raise PayloadError(f"stale: layout {fp!r}, expected {_fingerprint(layout)!r}")
    if dtype != layout.dtype:
        raise PayloadError(f"stale: dtype {dtype!r}, expected {layout.dtype!r}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 < tokens <= max_tokens:
        raise PayloadError(f"corrupt: token count {tokens!r}")
    if shape != layout.chunk_shape(tokens):
        raise PayloadError(f"corrupt: shape {shape}, expected {layout.chunk_shape(tokens)}")
    meta = MemoryObjMeta(shape, layout.torch_dtype, tokens)
    if payload_len != meta.nbytes:
        raise PayloadError(f"corrupt: payload length {payload_len}, shape needs {meta.nbytes}")
    return Header(want, meta, header_len, payload_len, zlib.crc32(view[:header_len]))


def check_trailer(crc: int, trailer_bytes: bytes | memoryview) -> None:
    """Raise ``PayloadError`` unless ``trailer_bytes`` holds ``crc`` (header + payload's CRC)."""
    if len(trailer_bytes) != TRAILER.size:
        raise PayloadError(f"truncated: trailer of {len(trailer_bytes)} bytes")
    if TRAILER.unpack(trailer_bytes)[0] != crc:
        raise PayloadError("corrupt: checksum mismatch")


def verify(header: Header, payload: memoryview | bytes, trailer_bytes: bytes | memoryview) -> None:
    """Raise ``PayloadError`` unless ``payload`` is exactly the bytes ``header`` was written for."""
    n = memoryview(payload).nbytes
    if n != header.payload_len:
        raise PayloadError(f"truncated: payload of {n} bytes, expected {header.payload_len}")
    cs = Checksum(header.crc_of_header)
    try:
        cs.add(payload)
    finally:
        cs.wait()
    check_trailer(cs.value(), trailer_bytes)


def decode(
    blob: bytes | memoryview, *, key: ChunkKey, layout: KVLayout, max_tokens: int
) -> tuple[Header, memoryview]:
    """Check a whole stored value; return its header and a view of its payload (no copy)."""
    header, payload, tail = split(blob, key=key, layout=layout, max_tokens=max_tokens)
    verify(header, payload, tail)
    return header, payload


def decode_into_object(
    blob: bytes | memoryview,
    *,
    key: ChunkKey,
    layout: KVLayout,
    max_tokens: int,
    allocate: Callable[[MemoryObjMeta], MemoryObj | None],
) -> MemoryObj | None:
    """A new host object holding ``blob``'s payload, checksummed while it is copied.

    Raises ``PayloadError`` for a bad value (nothing is kept); None when host memory is full.
    """
    header, payload, tail = split(blob, key=key, layout=layout, max_tokens=max_tokens)
    obj = allocate(header.meta)
    if obj is None:
        return None
    cs = Checksum(header.crc_of_header)
    try:
        cs.add(payload)
        np.copyto(np.frombuffer(obj.byte_view(), dtype=np.uint8), np.frombuffer(payload, dtype=np.uint8))
        cs.wait()
        check_trailer(cs.value(), tail)
    except BaseException:
        cs.wait()
        obj.release()
        raise
    return obj


def split(
    blob: bytes | memoryview, *, key: ChunkKey, layout: KVLayout, max_tokens: int
) -> tuple[Header, memoryview, memoryview]:
    """Check a whole stored value's header and length; return ``(header, payload, trailer)``
    views. The checksum is *not* checked: pass them to ``verify``."""
    header = decode_header(blob, key=key, layout=layout, max_tokens=max_tokens)
    view = memoryview(blob)
    if view.nbytes != header.total_len:
        raise PayloadError(f"truncated: {view.nbytes} bytes, expected {header.total_len}")
    end = header.header_len + header.payload_len
    return header, view[header.header_len : end], view[end:]
