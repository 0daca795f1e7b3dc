"""The payload format of every chunk that leaves process memory (disk files, Redis values).

::

    prefix   "<4sHHIQ": magic b"KVTC", format version, flags, meta_len, payload_len
    meta     meta_len bytes: UTF-8 JSON {"key", "layout", "dtype", "shape", "tokens"} (and
             "nonce", "kcv" when sealed; "kind": "alias" for an alias entry), padded with
             spaces so the payload starts at a multiple of ``align`` when asked
    payload  payload_len bytes: the chunk's tensor bytes ([2, layers, tokens, hidden] or MLA);
             with flag ``SEALED`` (``encryption_key``) the AES-256-GCM ciphertext of those bytes
             and its 16-byte tag, the header being the authenticated data (``sealing``)
    trailer  "<I": the checksum: CRC-32 over prefix, meta and then the little-endian XXH3-64 of
             each 512 KiB segment of the payload (the last one may be shorter)

The checksum (``checksum.Checksum``) trails the payload so a writer never waits for it. A
decoder accepts a payload only if *every* field agrees with what the reader asked for: the full
key string (so a value swapped between keys, or written by another model, layout or rank, is
foreign), the layout fingerprint, the dtype, the shape (which must be the layout's chunk shape
for ``tokens``) and the payload length; sizes are checked before anything is read into host
memory, and the checksum last. Anything else raises ``PayloadError``: the caller turns it into
a miss, counts it, logs it, and removes the entry. The checksum catches storage and transfer
corruption (it is not a defence against an adversary who can write to the tier: such a writer
could also write well-formed wrong KV).

Two payload kinds exist, told apart by the key asked for: a chunk key (``ChunkKey.is_alias``
false) only ever decodes to KV (the layout's chunk shape and dtype); an alias key only to an
alias record (``kvtier.core.keys.aliases``: ``"kind": "alias"``, a short uint8 vector), so neither can
be served as the other.

The header (its bytes, writing it, checking it) lives in ``_codec_header``; this module builds
and checks whole stored values: the trailer, sealing, and decoding a payload into host memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.storage._codec_header import (
    ALIAS_KIND,
    FORMAT_VERSION,
    MAGIC,
    MAX_ALIAS_PAYLOAD,
    MAX_META,
    PREFIX,
    SEALED,
    TRAILER,
    Header,
    PayloadError,
    decode_header,
    encode_header,
    prefix_lengths,
    stored_key,
)
from kvtier.storage.checksum import SEGMENT, Checksum, PlacedChecksum
from kvtier.storage.sealing import SealError

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout
    from kvtier.storage.sealing import Sealer

# The header's names are part of this module's API (``codec.PayloadError``, ``codec.PREFIX``...).
__all__ = [
    "ALIAS_KIND",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_ALIAS_PAYLOAD",
    "MAX_META",
    "PREFIX",
    "SEALED",
    "SEGMENT",
    "TRAILER",
    "Checksum",
    "Header",
    "PayloadError",
    "PlacedChecksum",
    "check_checksums",
    "check_trailer",
    "decode",
    "decode_header",
    "decode_into_object",
    "encode",
    "encode_header",
    "prefix_lengths",
    "seal",
    "split",
    "stored_key",
    "trailer",
    "unseal",
    "unseal_in_place",
]


def seal(
    key: ChunkKey,
    meta: MemoryObjMeta,
    layout: KVLayout,
    payload: memoryview,
    sealer: Sealer,
    *,
    align: int = 0,
) -> tuple[bytes, bytes]:
    """``(header, sealed payload)`` of ``payload`` under ``key``, sealed with the key of the
    chunk's salt; store header + sealed payload + the trailer of both."""
    if payload.nbytes != meta.nbytes:
        raise ValueError(f"payload has {payload.nbytes} bytes, its meta says {meta.nbytes}")
    nonce = sealer.new_nonce()
    header = encode_header(
        key, meta, layout, align=align, nonce=nonce, key_check=sealer.key_check(key.salt_id, nonce)
    )
    return header, sealer.seal(key.salt_id, nonce, header, payload)


def unseal_in_place(
    header: Header, data: memoryview, tag: bytes, key: ChunkKey, sealer: Sealer
) -> None:
    """Decrypt a sealed value's ciphertext ``data`` in place (``tag``: its last 16 bytes);
    ``PayloadError`` if the tag fails (``data`` then holds garbage)."""
    try:
        sealer.open_in_place(key.salt_id, header.nonce, header.raw, data, tag)
    except SealError as e:
        raise PayloadError(str(e)) from None


def unseal(header: Header, sealed: memoryview | bytes, key: ChunkKey, sealer: Sealer) -> bytes:
    """The plaintext payload of a sealed value whose ``header`` was checked (``decode_header``
    with the sealer); ``PayloadError`` if its tag fails."""
    try:
        return sealer.open(key.salt_id, header.nonce, header.raw, sealed)
    except SealError as e:
        raise PayloadError(str(e)) from None


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


def check_trailer(crc: int, trailer_bytes: bytes | memoryview) -> None:
    """Raise ``PayloadError`` unless ``trailer_bytes`` holds ``crc`` (header + payload's CRC)."""
    if len(trailer_bytes) != TRAILER.size:
        raise PayloadError(f"truncated: trailer of {len(trailer_bytes)} bytes")
    if TRAILER.unpack(trailer_bytes)[0] != crc:
        raise PayloadError("corrupt: checksum mismatch")


def check_checksums(
    header: Header, payload: memoryview | bytes, trailer_bytes: bytes | memoryview
) -> None:
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
    blob: bytes | memoryview,
    *,
    key: ChunkKey,
    layout: KVLayout,
    max_tokens: int,
    sealer: Sealer | None = None,
) -> tuple[Header, memoryview]:
    """Check a whole stored value; return its header and a view of its payload (no copy; a
    sealed payload is opened into new bytes)."""
    header, payload, tail = split(
        blob, key=key, layout=layout, max_tokens=max_tokens, sealer=sealer
    )
    check_checksums(header, payload, tail)
    if header.sealed:
        assert sealer is not None  # decode_header refuses a sealed value without one
        return header, memoryview(unseal(header, payload, key, sealer))
    return header, payload


def decode_into_object(
    blob: bytes | memoryview,
    *,
    key: ChunkKey,
    layout: KVLayout,
    max_tokens: int,
    allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    sealer: Sealer | None = None,
) -> MemoryObj | None:
    """A new host object holding ``blob``'s payload, checksummed while it is copied (a sealed
    payload: checksummed, then opened, then copied).

    Raises ``PayloadError`` for a bad value (nothing is kept); None when host memory is full.
    """
    header, payload, tail = split(
        blob, key=key, layout=layout, max_tokens=max_tokens, sealer=sealer
    )
    if header.sealed:
        assert sealer is not None  # decode_header refuses a sealed value without one
        check_checksums(header, payload, tail)
        payload = memoryview(unseal(header, payload, key, sealer))
        obj = allocate(header.meta)
        if obj is not None:
            np.copyto(
                np.frombuffer(obj.byte_view(), dtype=np.uint8),
                np.frombuffer(payload, dtype=np.uint8),
            )
        return obj
    obj = allocate(header.meta)
    if obj is None:
        return None
    cs = Checksum(header.crc_of_header)
    try:
        cs.add(payload)
        np.copyto(
            np.frombuffer(obj.byte_view(), dtype=np.uint8), np.frombuffer(payload, dtype=np.uint8)
        )
        cs.wait()
        check_trailer(cs.value(), tail)
    except BaseException:
        cs.wait()
        obj.release()
        raise
    return obj


def split(
    blob: bytes | memoryview,
    *,
    key: ChunkKey,
    layout: KVLayout,
    max_tokens: int,
    sealer: Sealer | None = None,
) -> tuple[Header, memoryview, memoryview]:
    """Check a whole stored value's header and length; return ``(header, payload, trailer)``
    views. The checksum is *not* checked: pass them to ``check_checksums`` (and a sealed payload to
    ``unseal``)."""
    header = decode_header(blob, key=key, layout=layout, max_tokens=max_tokens, sealer=sealer)
    view = memoryview(blob)
    if view.nbytes != header.total_len:
        raise PayloadError(f"truncated: {view.nbytes} bytes, expected {header.total_len}")
    end = header.header_len + header.payload_len
    return header, view[header.header_len : end], view[end:]
