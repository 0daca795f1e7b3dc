"""Which spans of a prompt are stored, and under which keys: the span arithmetic of
``CacheEngine`` (full chunks, tail blocks, aliases) and the hit computation over a
``StorageManager``.

A lookup takes the contiguous run of full-chunk hits; at the first full-chunk miss it walks the
prompt's tail keys there (one per whole block, up to one block short of a chunk). Each block is
found either as a stored tail entry (``save_unfull_chunk``) or through an alias
(``kvtier.core.aliases``) of a stored full chunk whose first blocks the prompt shares; the
longer of the run of tail entries and the longest alias whose chunk is stored wins (an alias
hit is one span over the aliased chunk, loaded as a prefix of that chunk's object).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.core.aliases import Alias, decode_alias
from kvtier.core.handles import ChunkSpan
from kvtier.core.keys import ChunkKey, KeyFactory, Scope, prefix_hashes, salt_seed, tail_hashes
from kvtier.core.storage import StorageManager


class SpanPlanner:
    """Spans, hits and aliases of prompts for one engine's keys and storage."""

    def __init__(
        self,
        keys: KeyFactory,
        storage: StorageManager,
        *,
        chunk_size: int,
        block_size: int,
        tails: bool,
    ) -> None:
        self.keys = keys
        self.storage = storage
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.tails = tails  # save_unfull_chunk: tail blocks are stored as their own entries
        # Whether a store writes each full chunk's alias entries (off: only to measure what
        # they cost; hits inside chunks then need the stored prompt's tail entries).
        self.write_aliases = True

    # -- spans -------------------------------------------------------------------------------
    def full(self, arr: np.ndarray, scope: Scope) -> list[ChunkSpan]:
        """The full chunks of ``arr``."""
        c = self.chunk_size
        return [
            ChunkSpan(i * c, (i + 1) * c, self.keys.key(h, scope))
            for i, h in enumerate(prefix_hashes(arr, c, scope))
        ]

    @staticmethod
    def prev_hash(spans: Sequence[ChunkSpan], index: int, scope: Scope) -> bytes:
        """The hash that chunk ``index``'s tail (or chunk) is chained from."""
        return bytes.fromhex(spans[index - 1].key.chunk_hash) if index else salt_seed(scope)

    def tail(
        self, arr: np.ndarray, index: int, scope: Scope, spans: Sequence[ChunkSpan] | None = None
    ) -> list[ChunkSpan]:
        """Block-sized spans after full chunk ``index - 1`` (see ``CacheEngine.tail_spans``)."""
        if spans is None:
            spans = self.full(arr[: index * self.chunk_size], scope)
        bs = self.block_size
        start = index * self.chunk_size
        hashes = tail_hashes(arr, start, self.chunk_size, bs, self.prev_hash(spans, index, scope))
        return [
            ChunkSpan(start + i * bs, start + (i + 1) * bs, self.keys.key(h, scope))
            for i, h in enumerate(hashes)
        ]

    def store(self, arr: np.ndarray, scope: Scope) -> list[ChunkSpan]:
        """Spans a store saves: full chunks, then (``tails``) the tail block by block."""
        spans = self.full(arr, scope)
        if self.tails:
            spans.extend(self.tail(arr, len(spans), scope, spans))
        return spans

    def aliases(
        self, arr: np.ndarray, index: int, scope: Scope, spans: Sequence[ChunkSpan]
    ) -> list[tuple[ChunkKey, Alias]]:
        """The alias entries of full chunk ``index`` of ``arr`` (``spans``: its full chunks):
        one per leading run of 1 .. n-1 of its blocks (none when ``write_aliases`` is off)."""
        if not self.write_aliases:
            return []
        target = bytes.fromhex(spans[index].key.chunk_hash)
        bs = self.block_size
        out = []
        for j, span in enumerate(self.tail(arr[: spans[index].end], index, scope, spans), 1):
            t = bytes.fromhex(span.key.chunk_hash)
            out.append((self.keys.alias_key(t, scope), Alias(t, target, j * bs)))
        return out

    def alias_keys_of(
        self, arr: np.ndarray, spans: Sequence[ChunkSpan], scope: Scope
    ) -> list[ChunkKey]:
        """The alias keys of the full chunks among ``spans`` (a hit, from token 0)."""
        full = [s for s in spans if s.num_tokens == self.chunk_size]
        return [k for i in range(len(full)) for k, _ in self.aliases(arr, i, scope, full)]

    # -- hits --------------------------------------------------------------------------------
    def hits(self, arr: np.ndarray, scope: Scope) -> list[ChunkSpan]:
        """The contiguous run of stored spans covering a prefix of ``arr``."""
        spans = self.full(arr, scope)
        n_hit = self.storage.prefix_hits([s.key for s in spans])
        hits = spans[:n_hit]
        tail = self.tail(arr, n_hit, scope, spans)
        if not tail:
            return hits
        run = self.storage.prefix_hits([s.key for s in tail]) if self.tails else 0
        alias = self._longest_alias(tail, run, scope)
        if alias is not None:
            hits.append(alias)
        else:
            hits.extend(tail[:run])
        return hits

    def _longest_alias(
        self, tail: Sequence[ChunkSpan], beyond: int, scope: Scope
    ) -> ChunkSpan | None:
        """The span of the longest alias covering more than ``beyond`` of ``tail``'s blocks
        whose chunk is stored; None if there is none."""
        candidates = list(tail[beyond:])
        if not candidates:
            return None
        hashes = [bytes.fromhex(s.key.chunk_hash) for s in candidates]
        keys = [self.keys.alias_key(h, scope) for h in hashes]
        present = self.storage.contains(keys)
        start = tail[0].start
        for i in reversed(range(len(candidates))):
            if not present[i]:
                continue
            end = candidates[i].end
            target = self._resolve(keys[i], hashes[i], end - start, scope)
            if target is not None:
                return ChunkSpan(start, end, target, self.chunk_size)
        return None

    def _resolve(
        self, key: ChunkKey, tail_hash: bytes, num_tokens: int, scope: Scope
    ) -> ChunkKey | None:
        """The key of the stored chunk the alias ``key`` names, if it is an alias of exactly
        ``tail_hash`` over ``num_tokens`` tokens and that chunk is stored."""
        obj = self.storage.get(key)
        if obj is None:
            return None
        try:
            target = decode_alias(obj, tail_hash, num_tokens)
        finally:
            obj.release()
        if target is None:
            return None
        chunk = self.keys.key(target, scope)
        return chunk if self.storage.contains([chunk])[0] else None
