"""Which spans of a prompt are stored, and under which keys: the span arithmetic of
``CacheEngine`` (full chunks, tail blocks, aliases) and the hit computation over a
``StorageManager``.

A lookup takes the contiguous run of full-chunk hits; at the first full-chunk miss it walks the
prompt's tail keys there (one per whole block, up to one block short of a chunk). Each block is
found either as a stored tail entry (``save_unfull_chunk``) or through an alias
(``kvtier.core.keys.aliases``) of a stored full chunk whose first blocks the prompt shares; the
longer of the run of tail entries and the longest alias whose chunk is stored wins (an alias
hit is one span over the aliased chunk, loaded as a prefix of that chunk's object).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.keys import ChunkKey, KeyFactory, Scope, TokenIds
from kvtier.core.keys.aliases import Alias, decode_alias
from kvtier.core.keys.prompt import PromptHashes
from kvtier.core.memory.handles import ChunkSpan
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

    def prompt(self, tokens: TokenIds, scope: Scope) -> PromptHashes:
        """The hashes of ``tokens`` under ``scope``, for one engine call's spans."""
        return PromptHashes(tokens, scope, self.chunk_size, self.block_size)

    # -- spans -------------------------------------------------------------------------------
    def full(self, prompt: PromptHashes) -> list[ChunkSpan]:
        """The full chunks of the prompt."""
        c = self.chunk_size
        return [
            ChunkSpan(i * c, (i + 1) * c, self.keys.key(h, prompt.scope))
            for i, h in enumerate(prompt.full)
        ]

    def tail(self, prompt: PromptHashes, index: int) -> list[ChunkSpan]:
        """Block-sized spans after full chunk ``index - 1`` (see ``CacheEngine.tail_spans``)."""
        bs = self.block_size
        start = index * self.chunk_size
        return [
            ChunkSpan(start + i * bs, start + (i + 1) * bs, self.keys.key(h, prompt.scope))
            for i, h in enumerate(prompt.tail_hashes(index))
        ]

    def store(self, prompt: PromptHashes) -> list[ChunkSpan]:
        """Spans a store saves: full chunks, then (``tails``) the tail block by block."""
        spans = self.full(prompt)
        if self.tails:
            spans.extend(self.tail(prompt, len(spans)))
        return spans

    def aliases(self, prompt: PromptHashes, index: int) -> list[tuple[ChunkKey, Alias]]:
        """The alias entries of full chunk ``index`` of the prompt: one per leading run of
        1 .. n-1 of its blocks (none when ``write_aliases`` is off)."""
        if not self.write_aliases:
            return []
        target = prompt.full[index]
        bs = self.block_size
        return [
            (self.keys.alias_key(t, prompt.scope), Alias(t, target, j * bs))
            for j, t in enumerate(prompt.tail_hashes(index), 1)
        ]

    # -- hits --------------------------------------------------------------------------------
    def hits(self, prompt: PromptHashes) -> list[ChunkSpan]:
        """The contiguous run of stored spans covering a prefix of the prompt."""
        spans = self.full(prompt)
        n_hit = self.storage.prefix_hits([s.key for s in spans])
        hits = spans[:n_hit]
        tail = self.tail(prompt, n_hit)
        if not tail:
            return hits
        run = self.storage.prefix_hits([s.key for s in tail]) if self.tails else 0
        alias = self._longest_alias(prompt, n_hit, tail, run)
        if alias is not None:
            hits.append(alias)
        else:
            hits.extend(tail[:run])
        return hits

    def _longest_alias(
        self, prompt: PromptHashes, index: int, tail: Sequence[ChunkSpan], beyond: int
    ) -> ChunkSpan | None:
        """The span of the longest alias covering more than ``beyond`` of ``tail``'s blocks
        (those after full chunk ``index - 1``) whose chunk is stored; None if there is none."""
        candidates = list(tail[beyond:])
        if not candidates:
            return None
        hashes = prompt.tail_hashes(index)[beyond:]
        keys = [self.keys.alias_key(h, prompt.scope) for h in hashes]
        present = self.storage.contains(keys)
        start = tail[0].start
        for i in reversed(range(len(candidates))):
            if not present[i]:
                continue
            end = candidates[i].end
            target = self._resolve(keys[i], hashes[i], end - start, prompt.scope)
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
