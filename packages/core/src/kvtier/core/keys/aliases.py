"""Aliases: hits at block granularity inside stored full chunks, without copying KV.

Two prompts that diverge inside a full chunk share that chunk's first blocks, but not its key
(a chunk hash covers the whole chunk). When full chunk ``i`` (hash ``h_i``) is stored, the tail
hashes of its first ``j`` blocks, ``t_1 .. t_{n-1}`` (``keys.tail_hashes`` chained from
``h_{i-1}``: exactly the keys a prompt diverging after block ``j`` looks up for its tail), each
get an *alias* entry ``t_j -> (h_i, j blocks)`` stored under ``KeyFactory.alias_key(t_j)``.

An alias entry is a small ordinary stored object (``ALIAS_NBYTES`` bytes of uint8) that goes
through every tier's ordinary put/get path, so every tier (host memory, disk, Redis) keeps,
evicts, checksums, namespaces and seals it like a chunk, with no code of its own. The codec
tells the two kinds apart by the key (``ChunkKey.is_alias``): an alias key only ever decodes
to an alias payload, a chunk key only to KV. An alias whose chunk is gone (dangling), or whose
record does not name exactly what was asked for, is a miss, never wrong KV.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.memory import MemoryObj, MemoryObjMeta

MAGIC = b"KVTA"
VERSION = 1
# magic, version, reserved, tokens covered, tail hash (the alias's own), target chunk hash
RECORD = struct.Struct("<4sHHI16s16s")
ALIAS_NBYTES = RECORD.size


@dataclass(frozen=True)
class Alias:
    """``tail_hash`` stands for the first ``num_tokens`` tokens of the chunk ``target_hash``."""

    tail_hash: bytes
    target_hash: bytes
    num_tokens: int


def alias_meta(num_tokens: int) -> MemoryObjMeta:
    """The stored shape of an alias covering ``num_tokens`` tokens."""
    return MemoryObjMeta((ALIAS_NBYTES,), torch.uint8, num_tokens)


def is_alias_meta(meta: MemoryObjMeta) -> bool:
    return meta.dtype == torch.uint8 and meta.shape == (ALIAS_NBYTES,)


def encode_alias(
    alias: Alias, allocate: Callable[[MemoryObjMeta], MemoryObj | None]
) -> MemoryObj | None:
    """A new host object holding ``alias`` (None when host memory is full)."""
    obj = allocate(alias_meta(alias.num_tokens))
    if obj is None:
        return None
    obj.byte_view()[:] = RECORD.pack(
        MAGIC, VERSION, 0, alias.num_tokens, alias.tail_hash, alias.target_hash
    )
    return obj


def alias_objects(
    aliases: Sequence[tuple[ChunkKey, Alias]], allocate: Callable[[MemoryObjMeta], MemoryObj | None]
) -> tuple[list[tuple[ChunkKey, MemoryObj]], int]:
    """Host objects of ``aliases`` (the caller releases them), and how many host memory had no
    room for."""
    out = []
    for key, alias in aliases:
        obj = encode_alias(alias, allocate)
        if obj is not None:
            out.append((key, obj))
    return out, len(aliases) - len(out)


def decode_alias(obj: MemoryObj, tail_hash: bytes, num_tokens: int) -> bytes | None:
    """The target chunk hash ``obj`` records, if it is the alias of ``tail_hash`` covering
    ``num_tokens`` tokens; None for anything else (not an alias, another alias, corrupt)."""
    if not is_alias_meta(obj.meta) or obj.num_tokens != num_tokens:
        return None
    magic, version, _, tokens, tail, target = RECORD.unpack(bytes(obj.byte_view()))
    if magic != MAGIC or version != VERSION or tokens != num_tokens or tail != tail_hash:
        return None
    return bytes(target)
