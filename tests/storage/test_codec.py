"""The payload codec: a stored value decodes only into exactly the chunk that was asked for."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_helpers import CHUNK, KEYS, LAYOUT, chunk_value, key, meta

from kvtier.core.keys import KeyFactory
from kvtier.core.layout import KVLayout
from kvtier.storage import codec


def encode(i: int = 1, tokens: int = CHUNK, k=None, layout=LAYOUT, align: int = 0) -> bytes:
    t = chunk_value(i, tokens)
    payload = memoryview(t.view(torch.uint8).reshape(-1).numpy())
    header, tail = codec.encode(k or key(i), meta(tokens), layout, payload, align=align)
    return header + payload.tobytes() + tail


def decode(blob: bytes, i: int = 1):
    return codec.decode(blob, key=key(i), layout=LAYOUT, max_tokens=CHUNK)


@pytest.mark.parametrize("tokens", [1, 5, CHUNK])
def test_round_trip_gives_the_same_bytes(tokens):
    header, payload = decode(encode(3, tokens), 3)
    assert header.meta == meta(tokens)
    assert bytes(payload) == chunk_value(3, tokens).view(torch.uint8).numpy().tobytes()


def test_aligned_header_puts_the_payload_on_a_page():
    blob = encode(align=4096)
    header, _ = decode(blob)
    assert header.header_len % 4096 == 0


@pytest.mark.parametrize("tokens", [5, CHUNK])
def test_a_header_decodes_alike_however_its_json_is_written(tokens):
    """Another writer's spacing or field order (or padding) reads as the same chunk: the reader
    checks the fields, not the bytes this kvtier happens to write."""
    ours = codec.encode_header(key(4), meta(tokens), LAYOUT)
    fields = json.loads(ours[codec.PREFIX.size :])
    other = json.dumps(dict(reversed(fields.items())), indent=1).encode() + b"   "
    theirs = (
        codec.PREFIX.pack(codec.MAGIC, codec.FORMAT_VERSION, 0, len(other), meta(tokens).nbytes)
        + other
    )
    got = [
        codec.decode_header(h, key=key(4), layout=LAYOUT, max_tokens=CHUNK) for h in (ours, theirs)
    ]
    assert got[0].meta == got[1].meta == meta(tokens)
    assert got[0].key == got[1].key == key(4).to_string()
    assert (got[0].header_len, got[1].header_len) == (len(ours), len(theirs))
    assert got[1].crc_of_header == zlib.crc32(theirs)


def test_swapped_value_is_foreign():
    with pytest.raises(codec.PayloadError, match="foreign"):
        decode(encode(2), 1)


def test_other_model_or_rank_with_same_hash_is_foreign():
    other = KeyFactory("other-model", LAYOUT.fingerprint())
    with pytest.raises(codec.PayloadError, match="foreign"):
        decode(encode(1, k=key(1, other)), 1)
    rank1 = KeyFactory(KEYS.model, LAYOUT.fingerprint(), world_size=2, rank=1)
    with pytest.raises(codec.PayloadError, match="foreign"):
        decode(encode(1, k=key(1, rank1)), 1)


def test_other_layout_is_stale():
    # the same page bytes, another interior writer (the CPU ISA that packed K)
    other = KVLayout(2, 2, 8, "float16", LAYOUT.block_size, "LBHNC", interior="CPU_ATTN/amx")
    assert other.page_bytes == LAYOUT.page_bytes
    blob = encode(1, layout=other)
    with pytest.raises(codec.PayloadError, match="stale: layout"):
        decode(blob)


def test_other_format_version_is_stale():
    blob = bytearray(encode())
    struct.pack_into("<H", blob, 4, codec.FORMAT_VERSION + 1)
    with pytest.raises(codec.PayloadError, match="stale: format version"):
        decode(bytes(blob))


def test_more_tokens_than_a_chunk_is_rejected_before_reading():
    big = CHUNK * 2
    with pytest.raises(codec.PayloadError, match="token count"):
        decode(encode(1, tokens=big))


@pytest.mark.parametrize("cut", [0, 3, codec.PREFIX.size, codec.PREFIX.size + 10, -1, -100])
def test_truncated_is_rejected(cut):
    blob = encode()
    with pytest.raises(codec.PayloadError):
        decode(blob[:cut])


def test_trailing_garbage_is_rejected():
    with pytest.raises(codec.PayloadError, match="truncated"):
        decode(encode() + b"x")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_never_decode(data):
    with pytest.raises(codec.PayloadError):
        decode(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_after_a_valid_prefix_never_decode(tail):
    prefix = encode()[: codec.PREFIX.size]
    with pytest.raises(codec.PayloadError):
        decode(prefix + tail)


_BLOB = encode(7)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(_BLOB) - 1), st.integers(1, 255))
def test_any_single_byte_change_is_rejected(pos, delta):
    blob = bytearray(_BLOB)
    blob[pos] = (blob[pos] + delta) % 256
    with pytest.raises(codec.PayloadError):
        decode(bytes(blob), 7)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(_BLOB) - 1))
def test_any_truncation_is_rejected(n):
    with pytest.raises(codec.PayloadError):
        decode(_BLOB[:n], 7)


_PAYLOAD = bytes(torch.randint(0, 256, (3 * codec.SEGMENT + 999,), dtype=torch.uint8).numpy())


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(0, len(_PAYLOAD)),
    cuts=st.lists(st.integers(1, 3), max_size=6),
    order=st.randoms(use_true_random=False),
)
def test_pieces_hashed_in_any_order_give_the_in_order_checksum(length, cuts, order):
    """A payload hashed as pieces on whole checksum segments, in any order (the Redis tier's
    readers, each hashing the segment it just read), has the checksum of hashing it in order."""
    data = memoryview(_PAYLOAD)[:length]
    whole = codec.Checksum(123)
    whole.add(data)
    pieces, at = [], 0
    for n in cuts:
        if at >= length:
            break
        pieces.append((at, data[at : at + n * codec.SEGMENT]))
        at += n * codec.SEGMENT
    if at < length:
        pieces.append((at, data[at:]))
    order.shuffle(pieces)
    placed = codec.PlacedChecksum(123, length)
    for offset, piece in pieces:
        placed.add_now(offset, piece)
    assert placed.value() == whole.value()


@pytest.mark.parametrize(
    ("offset", "size"), [(1, codec.SEGMENT), (0, codec.SEGMENT - 1), (0, 2 * codec.SEGMENT + 1)]
)
def test_a_piece_off_the_checksum_segments_is_refused(offset, size):
    placed = codec.PlacedChecksum(0, 2 * codec.SEGMENT)
    with pytest.raises(ValueError, match="not on the checksum's segments"):
        placed.add_now(offset, _PAYLOAD[offset : offset + size])
