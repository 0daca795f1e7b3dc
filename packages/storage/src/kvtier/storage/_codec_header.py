"""The header of a stored chunk (see ``codec`` for the whole format): its bytes, writing it, and
checking it against what a reader asked for before any payload is read.

The header names the key, layout fingerprint, dtype, shape and token count of its payload (and
the nonce and key check of a sealed one); ``decode_header`` refuses one that is foreign, stale,
corrupt or sealed differently from what the reader expects, with ``PayloadError``.
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvtier.core.layout import dtype_name
from kvtier.core.memory import MemoryObjMeta
from kvtier.storage.sealing import NONCE_BYTES, TAG_BYTES

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
# A recurrent-state entry (``kvtier.core.engine.states``): one block of each state group.
STATE_KIND = "state"


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
    meta = MemoryObjMeta(layout.chunk_shape(tokens), layout.chunk_dtype, tokens)
    rest: dict[str, object] = {
        "layout": _fingerprint(layout),
        "dtype": dtype_name(layout.chunk_dtype),
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
    plain = nonce is None and not key.is_alias and not key.is_state
    known = _chunk_fields(layout, meta.num_tokens) if plain else None
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
    elif key.is_state:
        if meta.dtype != layout.chunk_dtype or meta.shape != layout.state_shape:
            raise ValueError(f"a state entry is {layout.state_shape} bytes, got {meta}")
        fields["kind"] = STATE_KIND
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
    itself is not looked at: call ``codec.check_checksums`` once it has been read. With ``sealer`` (encryption
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
    if not sealed and not key.is_alias and not key.is_state:
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
    if key.is_state:
        if kind != STATE_KIND:
            raise PayloadError(f"foreign: a state key holds a payload of kind {kind!r}")
        if dtype != dtype_name(layout.chunk_dtype) or not layout.states:
            raise PayloadError(f"corrupt: state of dtype {dtype!r}")
        if shape != layout.state_shape or tokens != layout.block_size:
            raise PayloadError(f"corrupt: state of shape {shape}, expected {layout.state_shape}")
        return MemoryObjMeta(shape, layout.chunk_dtype, tokens)
    if kind is not None:
        raise PayloadError(f"foreign: a chunk key holds a payload of kind {kind!r}")
    want = dtype_name(layout.chunk_dtype)
    if dtype != want:
        raise PayloadError(f"stale: dtype {dtype!r}, expected {want!r}")
    if not isinstance(tokens, int) or tokens <= 0 or tokens % layout.block_tokens:
        raise PayloadError(f"corrupt: {tokens!r} tokens, not whole blocks of {layout.block_tokens}")
    if shape != layout.chunk_shape(tokens):
        raise PayloadError(f"corrupt: shape {shape}, expected {layout.chunk_shape(tokens)}")
    return MemoryObjMeta(shape, layout.chunk_dtype, tokens)
