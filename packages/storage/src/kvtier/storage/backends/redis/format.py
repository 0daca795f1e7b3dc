"""How the Redis tier lays a chunk out in keys, and its options (see ``backends.redis.backend``)."""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import ConfigError
from kvtier.storage import codec

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.layout import KVLayout
    from kvtier.storage.sealing import Sealer

# After the codec trailer: the segment size, a CRC-32 of it (the codec's checksum covers the
# header and payload only: a flipped bit here is a miss like any other), the magic.
TAIL = struct.Struct("<II4s")
MAGIC = b"KVR2"
MIN_SEGMENT, MAX_SEGMENT = 1 << 10, 512 << 20
MIN_HEAD = codec.PREFIX.size + codec.TRAILER.size + TAIL.size
DEFAULTS: dict[str, Any] = {
    "key_prefix": "kvtier:",
    "retry_interval_s": 1.0,
    "segment_bytes": 1 << 20,
    "connections": 2,
    "min_throughput_mb_s": 50.0,
}


def head_key(prefix: bytes, key: ChunkKey) -> bytes:
    return prefix + b"{" + key.to_string().encode() + b"}"


def segment_keys(head: bytes, n: int) -> list[bytes]:
    """The keys of a chunk's ``n`` segments: the head's hash tag, so the head's shard."""
    return [head + b":%d" % i for i in range(n)]


def segment_count(payload_len: int, segment_bytes: int) -> int:
    """How many segments a payload of ``payload_len`` bytes travels as (at least one)."""
    return max(1, -(-payload_len // segment_bytes))


def encode_head(header: bytes, checksum: int, segment_bytes: int) -> bytes:
    """A head: the codec header (so a reader of the value's first bytes sees a codec header),
    the checksum trailer, then the segment size, its CRC and the magic."""
    return (
        header
        + codec.TRAILER.pack(checksum)
        + TAIL.pack(segment_bytes, _seg_check(segment_bytes), MAGIC)
    )


def _seg_check(segment_bytes: int) -> int:
    return zlib.crc32(struct.pack("<I", segment_bytes))


def parse_head(
    blob: object, *, key: ChunkKey, layout: KVLayout, max_tokens: int, sealer: Sealer | None = None
) -> tuple[codec.Header, bytes, int]:
    """``(header, trailer, segment_bytes)`` of a head read for ``key``; ``PayloadError`` unless
    every codec check passes (with ``sealer``: a sealed head whose key check matches this key;
    without: a plain head)."""
    if not isinstance(blob, bytes) or len(blob) < MIN_HEAD:
        raise codec.PayloadError("foreign: not a kvtier head")
    seg, check, magic = TAIL.unpack_from(blob, len(blob) - TAIL.size)
    if magic != MAGIC:
        raise codec.PayloadError("foreign: not a kvtier head")
    if check != _seg_check(seg) or not MIN_SEGMENT <= seg <= MAX_SEGMENT:
        raise codec.PayloadError("corrupt: the head's segment size")
    header_len, _ = codec.prefix_lengths(blob)
    if len(blob) != header_len + codec.TRAILER.size + TAIL.size:
        raise codec.PayloadError(f"truncated: head of {len(blob)} bytes")
    header = codec.decode_header(
        blob[:header_len], key=key, layout=layout, max_tokens=max_tokens, sealer=sealer
    )
    return header, blob[header_len : header_len + codec.TRAILER.size], seg


def options(opts: dict[str, Any]) -> dict[str, Any]:
    """``backend_options.redis`` with defaults filled in; a ``ConfigError`` naming the option."""
    unknown = set(opts) - set(DEFAULTS)
    if unknown:
        raise ConfigError(
            "backend_options.redis",
            sorted(unknown),
            f"unknown redis option(s); known: {sorted(DEFAULTS)}",
        )
    out = {**DEFAULTS, **opts}
    checks: dict[str, tuple[type, Callable[[Any], bool], str]] = {
        "key_prefix": (str, lambda v: "{" not in v and "}" not in v, "a string without '{' or '}'"),
        "retry_interval_s": (float, lambda v: 0 <= v < math.inf, "a number of seconds >= 0"),
        "segment_bytes": (
            int,
            lambda v: MIN_SEGMENT <= v <= MAX_SEGMENT,
            "an integer in [1 KiB, 512 MiB]",
        ),
        "connections": (int, lambda v: 1 <= v <= 64, "an integer in [1, 64]"),
        "min_throughput_mb_s": (float, lambda v: 0 < v < math.inf, "a positive number of MB/s"),
    }
    for name, (kind, ok, what) in checks.items():
        v = out[name]
        good = isinstance(v, kind | int) if kind is float else isinstance(v, kind)
        if isinstance(v, bool) or not good or not ok(v):
            raise ConfigError(f"backend_options.redis.{name}", v, f"must be {what}")
    return out
