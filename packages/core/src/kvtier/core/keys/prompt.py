"""``PromptHashes``: one prompt's token bytes and its hash chain (``kvtier.core.keys``), each
hash computed once, when first asked for.

A ``CacheEngine`` call makes one and hands it to the span planner, the hold check, the load plan
and the store writer; the vLLM scheduler keeps one per request
(``kvtier.vllm_integration.scheduler.prompts``), so its index asks about the hashes the engine
keys chunks with. A lookup that stops at the first chunk it lacks hashes only that far.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from kvtier.core.keys import KeyScope, Scope, TokenIds, chain_hash, tail_hashes, token_bytes


class ChainHashes(Sequence[bytes]):
    """``prefix_hashes`` of a prompt's token bytes ``arr``, chained from ``seed``, each hash
    computed when first asked for (and every hash before it)."""

    def __init__(self, arr: np.ndarray, chunk_size: int, seed: bytes) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self._arr = arr
        self._chunk = chunk_size
        self._len = len(arr) // chunk_size
        self._done: list[bytes] = []
        self._prev = seed

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        if isinstance(i, slice):
            wanted = range(*i.indices(self._len))
            self._upto(max(wanted, default=-1) + 1)
            return [self._done[j] for j in wanted]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        self._upto(i + 1)
        return self._done[i]

    def __iter__(self) -> Iterator[bytes]:
        self._upto(self._len)
        return iter(self._done)

    def _upto(self, n: int) -> None:
        """Hash the first ``n`` chunks (those not hashed yet)."""
        c = self._chunk
        for k in range(len(self._done), n):
            self._prev = chain_hash(self._prev, self._arr[k * c : (k + 1) * c])
            self._done.append(self._prev)


class PromptHashes:
    """One prompt's token bytes (``arr``, ``keys.token_bytes``) and hash chain under ``scope``:
    its full chunks' hashes (``full``), the block hashes after any full chunk
    (``tail_hashes``) and the hash naming any prefix a lookup can hit (``digest``)."""

    def __init__(self, tokens: TokenIds, scope: Scope, chunk_size: int, block_size: int) -> None:
        self.arr = token_bytes(tokens)
        self.scope = KeyScope.of(scope)
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.seed = self.scope.seed()
        self.full = ChainHashes(self.arr, chunk_size, self.seed)
        self._tails: dict[int, list[bytes]] = {}

    def chained_from(self, index: int) -> bytes:
        """The hash full chunk ``index`` and the blocks after chunk ``index - 1`` chain from."""
        return self.full[index - 1] if index else self.seed

    def tail_hashes(self, index: int) -> list[bytes]:
        """The hashes of the whole blocks after full chunk ``index - 1``, up to one block short
        of a chunk (``keys.tail_hashes``): the keys of a tail stored there, and of the aliases
        of a full chunk ``index`` (its leading blocks)."""
        out = self._tails.get(index)
        if out is None:
            c = self.chunk_size
            out = tail_hashes(self.arr, index * c, c, self.block_size, self.chained_from(index))
            self._tails[index] = out
        return out

    def digest(self, num_tokens: int) -> bytes:
        """The chain's hash at token ``num_tokens`` (full chunks, then whole blocks short of the
        next chunk, as a hit ends): it names the first ``num_tokens`` tokens and the scope,
        which is what a ``Hold`` was taken for."""
        index, rest = divmod(num_tokens, self.chunk_size)
        if not rest:
            return self.chained_from(index)
        blocks, partial = divmod(rest, self.block_size)
        tail = self.tail_hashes(index)
        if partial or blocks > len(tail):
            raise ValueError(f"no hit ends at token {num_tokens} of a {len(self.arr)}-token prompt")
        return tail[blocks - 1]
