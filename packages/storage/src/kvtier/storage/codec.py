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
alias record (``kvtier.core.aliases``: ``"kind": "alias"``, a short uint8 vector), so neither can
be served as the other.
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kvtier.core.layout import dtype_name
from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.storage.checksum import SEGMENT as SEGMENT
from kvtier.storage.checksum import Checksum
from kvtier.storage.sealing import NONCE_BYTES, TAG_BYTES, SealError

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout
    from kvtier.storage.sealing import Sealer

MAGIC = b"KVTC"
FORMAT_VERSION = 2  # 2: payload segments hashed with XXH3-64 (1: CRC-32)
PREFIX = struct.Struct("<4sHHIQ")
TRAILER = struct.Struct("<I")
# A meta section is a few hundred bytes; a larger one is not ours. Alignment padding is
# bounded by the largest alignment we write (one page for O_DIRECT).
MAX_META = 64 * 1024
# flags
SEALED = 0x1
# The largest alias payload a reader accepts (a record is a few dozen bytes).
MAX_ALIAS_PAYLOAD = 4096
ALIAS_KIND = "alias"


class PayloadError(ValueError):
    """A stored payload is corrupt, truncated, foreign or stale; ``reason`` says which check."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class Header(NamedTuple):
    """A parsed, checked header; ``header_len`` is where the payload starts. (A tuple: it is
    built once per chunk read, on the read path.)"""

    key: str
    meta: MemoryObjMeta
    header_len: int
    payload_len: int
    crc_of_header: int
    sealed: bool = False
    nonce: bytes = b""
    raw: bytes = b""  # the header's bytes (a sealed payload's authenticated data)

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len + TRAILER.size


@functools.lru_cache(maxsize=64)
def _fingerprint(layout: KVLayout) -> str:
    """``layout.fingerprint()``, computed once per layout (it serialises every field: a tenth of
    a 2 MiB chunk's read time when done per chunk)."""
    return layout.fingerprint()


@functools.lru_cache(maxsize=64)
def _chunk_fields(layout: KVLayout, tokens: int) -> tuple[bytes, MemoryObjMeta, int] | None:
    """A plain chunk of ``tokens`` tokens: its header's JSON after the key (``,"layout":...,
    "tokens":N}``), its meta and its byte count; None where a header cannot be written this way (the
    layout names its dtype other than ``dtype_name``)."""
    meta = MemoryObjMeta(layout.chunk_shape(tokens), layout.torch_dtype, tokens)
    if dtype_name(meta.dtype) != layout.dtype:
        return None
    rest: dict[str, object] = {
        "layout": _fingerprint(layout),
        "dtype": layout.dtype,
        "shape": list(meta.shape),
        "tokens": tokens,
    }
    return b"," + json.dumps(rest, separators=(",", ":")).encode()[1:], meta, meta.nbytes


def _key_field(key: ChunkKey) -> bytes:
    return b'{"key":' + json.dumps(key.to_string()).encode()


def encode_header(
    key: ChunkKey,
    meta: MemoryObjMeta,
    layout: KVLayout,
    *,
    align: int = 0,
    nonce: bytes | None = None,
    key_check: str | None = None,
) -> bytes:
    """The header (prefix + meta) of the chunk ``meta`` stored under ``key``; with ``nonce`` and
    ``key_check``, the header of a sealed payload (see ``seal``)."""
    known = None if nonce is not None or key.is_alias else _chunk_fields(layout, meta.num_tokens)
    if known is not None and known[1] == meta:
        body = _key_field(key) + known[0]  # the bytes json.dumps gives for the fields below
        return _finish_header(body, 0, meta.nbytes, align)
    fields: dict[str, object] = {
        "key": key.to_string(),
        "layout": _fingerprint(layout),
        "dtype": dtype_name(meta.dtype),
        "shape": list(meta.shape),
        "tokens": meta.num_tokens,
    }
    if key.is_alias:
        if meta.dtype != torch.uint8 or len(meta.shape) != 1 or meta.nbytes > MAX_ALIAS_PAYLOAD:
            raise ValueError(f"an alias entry is a short uint8 vector, got {meta}")
        fields["kind"] = ALIAS_KIND
    flags, payload_len = 0, meta.nbytes
    if nonce is not None:
        fields["nonce"] = nonce.hex()
        fields["kcv"] = key_check or ""
        flags, payload_len = SEALED, meta.nbytes + TAG_BYTES
    body = json.dumps(fields, separators=(",", ":")).encode()
    return _finish_header(body, flags, payload_len, align)


def _finish_header(body: bytes, flags: int, payload_len: int, align: int) -> bytes:
    if align > 1:
        pad = -(PREFIX.size + len(body)) % align
        body += b" " * pad
    if len(body) > MAX_META:
        raise ValueError(f"chunk header of {len(body)} bytes is too large")
    return PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(body), payload_len) + body


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
    if flags & ~SEALED:
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
    buf: bytes | memoryview,
    *,
    key: ChunkKey,
    layout: KVLayout,
    max_tokens: int,
    sealer: Sealer | None = None,
) -> Header:
    """Check the header at the start of ``buf`` against what the reader asked for.

    ``buf`` must hold at least the whole header (``prefix_lengths(...)[0]`` bytes). The payload
    itself is not looked at: call ``verify`` once it has been read. With ``sealer`` (encryption
    on) only sealed values are accepted, without it only plain ones: a plain value planted in an
    encrypted tier, or a sealed one read without the key, is a ``PayloadError``.
    """

    header_len, payload_len = prefix_lengths(buf)
    sealed = bool(PREFIX.unpack_from(buf)[2] & SEALED)
    if sealed and sealer is None:
        raise PayloadError("sealed: encrypted, and this reader has no encryption_key")
    if not sealed and sealer is not None:
        raise PayloadError("unsealed: encryption_key is set, plain values are refused")
    if len(buf) < header_len:
        raise PayloadError(f"truncated: {len(buf)} bytes, the header needs {header_len}")
    view = memoryview(buf)
    raw = bytes(view[:header_len])
    if not sealed and not key.is_alias:
        # A whole chunk's header as this kvtier writes it: every field is what this reader asks
        # for, byte for byte, so parsing it would find nothing to refuse. Anything else (fewer
        # tokens, another writer's spacing) is parsed.
        known = _chunk_fields(layout, max_tokens)
        if (
            known is not None
            and payload_len == known[2]
            and raw[PREFIX.size :].rstrip(b" ") == _key_field(key) + known[0]
        ):
            return Header(
                key.to_string(), known[1], header_len, payload_len, zlib.crc32(raw), raw=raw
            )
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
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 < tokens <= max_tokens:
        raise PayloadError(f"corrupt: token count {tokens!r}")
    meta = _payload_meta(key, layout, fields.get("kind"), dtype, shape, tokens)
    need = meta.nbytes + (TAG_BYTES if sealed else 0)
    if payload_len != need:
        raise PayloadError(f"corrupt: payload length {payload_len}, shape needs {need}")
    nonce = b""
    if sealed:
        try:
            nonce = bytes.fromhex(fields["nonce"])
        except (KeyError, TypeError, ValueError):
            nonce = b""
        if len(nonce) != NONCE_BYTES:
            raise PayloadError("corrupt: sealed value without a valid nonce")
        assert sealer is not None
        if fields.get("kcv") != sealer.key_check(key.salt_id, nonce):
            raise PayloadError("sealed: encrypted under another key (key check)")
    return Header(want, meta, header_len, payload_len, zlib.crc32(raw), sealed, nonce, raw)


def _payload_meta(
    key: ChunkKey,
    layout: KVLayout,
    kind: object,
    dtype: object,
    shape: tuple[int, ...],
    tokens: int,
) -> MemoryObjMeta:
    """The payload's meta, if its kind, dtype and shape are what ``key`` holds: KV in the
    layout's chunk shape for a chunk key, a short uint8 alias record for an alias key."""
    if key.is_alias:
        if kind != ALIAS_KIND:
            raise PayloadError(f"foreign: an alias key holds a payload of kind {kind!r}")
        if dtype != "uint8" or len(shape) != 1 or not 0 < shape[0] <= MAX_ALIAS_PAYLOAD:
            raise PayloadError(f"corrupt: alias of dtype {dtype!r} and shape {shape}")
        return MemoryObjMeta(shape, torch.uint8, tokens)
    if kind is not None:
        raise PayloadError(f"foreign: a chunk key holds a payload of kind {kind!r}")
    if dtype != layout.dtype:
        raise PayloadError(f"stale: dtype {dtype!r}, expected {layout.dtype!r}")
    if shape != layout.chunk_shape(tokens):
        raise PayloadError(f"corrupt: shape {shape}, expected {layout.chunk_shape(tokens)}")
    return MemoryObjMeta(shape, layout.torch_dtype, tokens)


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
    verify(header, payload, tail)
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
        verify(header, payload, tail)
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
    views. The checksum is *not* checked: pass them to ``verify`` (and a sealed payload to
    ``unseal``)."""
    header = decode_header(blob, key=key, layout=layout, max_tokens=max_tokens, sealer=sealer)
    view = memoryview(blob)
    if view.nbytes != header.total_len:
        raise PayloadError(f"truncated: {view.nbytes} bytes, expected {header.total_len}")
    end = header.header_len + header.payload_len
    return header, view[header.header_len : end], view[end:]
