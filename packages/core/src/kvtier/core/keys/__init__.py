"""Chunk keys and prefix-chained chunk hashing.

A prompt is cut into chunks of ``chunk_size`` tokens. Chunk ``i``'s hash covers every token before
it: ``h_i = blake2b(h_{i-1} || tokens of chunk i)``, seeded by the request's ``KeyScope`` (cache
salt, adapter identity, weights generation), so two prompts share a chunk key exactly when they
share the whole prefix up to the end of that chunk *and* their scope. The hash depends only on
token ids (as little-endian int64) and the scope's strings, never on Python's ``hash()``, so keys
agree across processes, hash seeds and machines.

What the tokens cannot say (an image behind placeholder tokens) must be folded into the token ids
by the caller before hashing: the vLLM connector replaces each multimodal item's placeholder
positions with ids derived from the item's content hash (``kvtier.vllm_integration.identity``).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

HASH_VERSION = b"kvtier-chunk-v2"
DIGEST_SIZE = 16
# An alias key's chunk-hash field: this prefix, then the hex tail hash it stands for. No chunk
# or tail key can be one (theirs is bare hex), so a tier, the codec and ``kvtier ls`` can tell
# an alias entry from KV by its key alone.
ALIAS_PREFIX = "alias-"
# A recurrent-state entry's chunk-hash field (``kvtier.core.engine.states``): this prefix, then the hex
# hash of the prefix the state ends.
STATE_PREFIX = "state-"

TokenIds = Sequence[int] | np.ndarray | torch.Tensor

_MODEL_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def token_bytes(tokens: TokenIds) -> np.ndarray:
    """Token ids as a contiguous little-endian int64 array (the bytes that are hashed).

    Only integer ids in ``[0, 2**63)`` are accepted; float, bool or other arrays, and ids out of
    that range, raise ``ValueError`` (a float truncated to an int, or a uint64 that wraps, would
    hash as some other prompt's tokens)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"token ids must be integers, got a tensor of {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    elif isinstance(tokens, list | tuple) and any(
        issubclass(t, bool | np.bool_) for t in set(map(type, tokens))
    ):
        raise ValueError("token ids must be integers, got a bool among them")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i8")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype} values (first: {arr[0]!r})")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"token id {int(arr.max())} is out of range: ids are below 2**63")
    if arr.dtype.kind == "i" and arr.min() < 0:
        raise ValueError(f"token id {int(arr.min())} is negative")
    return np.ascontiguousarray(arr, dtype="<i8")


@dataclass(frozen=True)
class KeyScope:
    """Everything per request, besides its tokens, that changes the KV and so seeds the chain.

    - ``salt``: the request's cache salt (tenants that must not share KV); its ``salt_id`` is
      also written into the key, so a tier can list or clear one salt.
    - ``adapter``: the identity of a LoRA adapter on the request (name, path and content
      digest); adapters on k/v projections change the KV, so base and adapter never share.
    - ``generation``: the weights generation of the engine (a new one after every cache reset
      following a weight update); chunks of older weights become unreachable.

    Empty strings mean the same as ``None``.
    """

    salt: str | None = None
    adapter: str | None = None
    generation: str | None = None

    def __post_init__(self) -> None:
        for name in ("salt", "adapter", "generation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"KeyScope.{name} must be a str or None, got {value!r}")
            if value == "":
                object.__setattr__(self, name, None)

    @classmethod
    def of(cls, scope: KeyScope | str | None) -> KeyScope:
        """A scope from a scope, a bare cache salt, or None."""
        if isinstance(scope, KeyScope):
            return scope
        if scope is not None and not isinstance(scope, str):
            raise ValueError(f"scope must be a cache salt (str), a KeyScope or None, got {scope!r}")
        return cls(salt=scope)

    def seed(self) -> bytes:
        """The chain's first hash: the hash version and every field that is set."""
        h = hashlib.blake2b(HASH_VERSION, digest_size=DIGEST_SIZE)
        for tag, value in (
            (b"salt", self.salt),
            (b"adapter", self.adapter),
            (b"generation", self.generation),
        ):
            if value:
                data = value.encode()
                h.update(b"\x00" + tag + b"\x00" + len(data).to_bytes(8, "little") + data)
        return h.digest()


Scope = KeyScope | str | None


def salt_seed(scope: Scope) -> bytes:
    """The chain's seed for a cache salt or a full ``KeyScope``."""
    return KeyScope.of(scope).seed()


def chain_hash(prev: bytes, token_arr: np.ndarray) -> bytes:
    """``H(prev || tokens)``: the hash of one chunk (full or partial) after the prefix ``prev``."""
    h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE)
    h.update(token_arr.tobytes())
    return h.digest()


def prefix_hashes(tokens: TokenIds, chunk_size: int, scope: Scope = None) -> list[bytes]:
    """Hashes of every *full* chunk of ``tokens`` (a trailing partial chunk is not included)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    arr = token_bytes(tokens)
    prev = salt_seed(scope)
    out: list[bytes] = []
    for start in range(0, len(arr) - chunk_size + 1, chunk_size):
        prev = chain_hash(prev, arr[start : start + chunk_size])
        out.append(prev)
    return out


def tail_hashes(
    arr: np.ndarray, start: int, chunk_size: int, block_size: int, prev: bytes
) -> list[bytes]:
    """Hashes of the block-sized spans of a prompt's tail after token ``start`` (the end of its
    last full chunk, whose hash is ``prev``): whole blocks up to one block short of a chunk, each
    chained onto the previous hash. A tail hash never equals a full-chunk hash (their inputs
    differ in length)."""
    room = min(len(arr) - start, chunk_size - block_size)
    out: list[bytes] = []
    for s0 in range(start, start + room - block_size + 1, block_size):
        prev = chain_hash(prev, arr[s0 : s0 + block_size])
        out.append(prev)
    return out


@dataclass(frozen=True, order=True)
class ChunkKey:
    """The identity of one stored chunk.

    ``(model, layout fingerprint, world size, rank, salt id, chunk hash)``. The chunk hash is
    already seeded by the salt; the salt id is kept so a namespace can be listed or dropped per
    salt. ``to_string`` is stable and parseable by ``from_string``.
    """

    model: str
    layout_fp: str
    world_size: int
    rank: int
    salt_id: str
    chunk_hash: str

    def to_string(self) -> str:
        return (
            f"kvtier@{self.model}@{self.layout_fp}@{self.world_size}x{self.rank}"
            f"@{self.salt_id}@{self.chunk_hash}"
        )

    @classmethod
    def from_string(cls, text: str) -> ChunkKey:
        parts = text.split("@")
        if len(parts) != 6 or parts[0] != "kvtier":
            raise ValueError(f"not a kvtier chunk key: {text!r}")
        _, model, layout_fp, ws_rank, salt_id, chunk_hash = parts
        ws, _, rank = ws_rank.partition("x")
        return cls(model, layout_fp, int(ws), int(rank), salt_id, chunk_hash)

    @property
    def is_alias(self) -> bool:
        """Whether this key names an alias entry (``kvtier.core.keys.aliases``), not KV."""
        return self.chunk_hash.startswith(ALIAS_PREFIX)

    @property
    def is_state(self) -> bool:
        """Whether this key names a recurrent-state entry (``kvtier.core.engine.states``), not KV."""
        return self.chunk_hash.startswith(STATE_PREFIX)

    def namespace(self) -> str:
        """Everything but the chunk hash: the prefix under which a tier keeps this engine's chunks."""
        return self.to_string().rsplit("@", 1)[0]

    def digest(self) -> str:
        """A fixed-length hex name for the key (file names, short logs)."""
        return _digest(self.to_string())


def _digest(key_string: str) -> str:
    """``ChunkKey.digest`` of the key whose ``to_string`` is ``key_string``."""
    return hashlib.blake2b(key_string.encode(), digest_size=16).hexdigest()


def model_id(model: str) -> str:
    """A model name made safe to sit inside a key (no '@', '/', whitespace)."""
    safe = _MODEL_SAFE.sub("_", model)
    return safe or "model"


def salt_id(scope: Scope) -> str:
    """The salt's short id in a key (``-`` for none); a scope's adapter and generation are not
    part of it (they are in the chain's seed)."""
    return _salt_id(KeyScope.of(scope).salt)


@functools.lru_cache(maxsize=1024)
def _salt_id(salt: str | None) -> str:
    """``salt_id`` of a cache salt, kept for the salts in use: every key carries it."""
    if not salt:
        return "-"
    return hashlib.blake2b(salt.encode(), digest_size=6).hexdigest()


@dataclass(frozen=True)
class KeyFactory:
    """Makes the chunk keys of one engine (model, layout, parallel rank)."""

    model: str
    layout_fp: str
    world_size: int = 1
    rank: int = 0

    def key(self, chunk_hash: bytes, scope: Scope = None) -> ChunkKey:
        return self._key(chunk_hash.hex(), scope)

    def alias_key(self, tail_hash: bytes, scope: Scope = None) -> ChunkKey:
        """The key of the alias entry for the tail hash ``tail_hash`` (see ``ALIAS_PREFIX``)."""
        return self._key(ALIAS_PREFIX + tail_hash.hex(), scope)

    def state_key(self, chunk_hash: bytes, scope: Scope = None) -> ChunkKey:
        """The key of the recurrent-state entry at the end of the prefix hashed ``chunk_hash``
        (see ``STATE_PREFIX``)."""
        return self._key(STATE_PREFIX + chunk_hash.hex(), scope)

    def digest(self, chunk_hash: bytes, scope: Scope = None, *, alias: bool = False) -> str:
        """``key(chunk_hash, scope).digest()`` (``alias_key``'s with ``alias``) without building
        the key: the scheduler's index digests every chunk, tail-block and alias hash of each
        prompt it sees, inside vLLM's scheduler step."""
        hash_field = (ALIAS_PREFIX if alias else "") + chunk_hash.hex()
        return _digest(f"{self._key_prefix}{salt_id(scope)}@{hash_field}")

    @cached_property
    def _key_prefix(self) -> str:
        """``ChunkKey.to_string`` of this factory's keys up to the salt id (its last two
        fields left empty, and the separator between them cut)."""
        blank = ChunkKey(model_id(self.model), self.layout_fp, self.world_size, self.rank, "", "")
        return blank.to_string()[:-1]

    def _key(self, hash_field: str, scope: Scope) -> ChunkKey:
        return ChunkKey(
            model_id(self.model),
            self.layout_fp,
            self.world_size,
            self.rank,
            salt_id(scope),
            hash_field,
        )
