"""Probes: the asynchronous lookups that replace a blocking one inside ``schedule()``.

When the scheduler's index (``scheduler/index.py``) says a waiting request may hit beyond what vLLM
already has, or a tier the index cannot list (Redis) may hold more, the scheduler sends a probe
to every worker with the next step's metadata and answers vLLM "not yet" (``None``: the request
stays waiting, others are scheduled). Each worker runs the probe on its own threads: it looks
the prompt up in every tier and *holds* what it finds (``worker/holds.py``; lower-tier hits are read
into host memory now, like a prefetch), then reports the hit with its next step's output. Once
every rank has answered, vLLM's next call gets the hit (the minimum over ranks), and the load
reads exactly the held chunks. A probe not answered within ``lookup_timeout_s`` is a miss.

``IndexedPrompt`` holds a request's chunk hashes (``kvtier.core.keys.prompt``: the engine's own, full
chunks, then block-sized tail spans, and the alias keys those tail hashes name:
``kvtier.core.keys.aliases``), computed once per request and only as far as they are needed, so the
index predicts the hit a probe finds.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.core.keys import KeyScope, prompt
from kvtier.vllm_integration.messages import AliasHash
from kvtier.vllm_integration.scheduler.index import OTHER, PresenceIndex

logger = logging.getLogger("kvtier")


@dataclass
class Probe:
    """A probe the scheduler is waiting for (or has the answers of)."""

    hold_id: int
    sent_at: float
    answers: dict[int, int] = field(default_factory=dict)  # rank -> hit tokens
    sources: list[list[Any]] = field(default_factory=list)  # rank 0's, for hit-source metrics
    expired: bool = False
    # Answered by the scheduler's index (``lookup: index``): nothing was sent, nothing is held.
    indexed: bool = False
    receipts: set[int] = field(default_factory=set)  # ranks that found the producer's receipt

    def answered(self, num_ranks: int) -> bool:
        return self.expired or len(self.answers) >= num_ranks

    @property
    def hit(self) -> int:
        if self.expired or not self.answers:
            return 0
        return min(self.answers.values())

    @property
    def settled(self) -> bool:
        """Whether every rank found the request's hand-over receipt before its chunks: what
        they found is all its producer wrote (``kvtier.core.keys.receipts``)."""
        return not self.expired and bool(self.answers) and self.receipts >= set(self.answers)

    @property
    def agreed(self) -> bool:
        """Whether every rank found the same hit (a Mamba hybrid's hit needs it: each rank's
        hold keeps only the state at its own hit's end)."""
        return len(set(self.answers.values())) <= 1


class IndexedPrompt(prompt.PromptHashes):
    """One prompt's hashes (``kvtier.core.keys.prompt``, the ones ``CacheEngine`` keys chunks with)
    and what the scheduler asks its index about them."""

    def __init__(
        self, tokens: np.ndarray, scope: KeyScope, chunk_size: int, block_size: int, tails: bool
    ) -> None:
        super().__init__(tokens, scope, chunk_size, block_size)
        self.tails = tails  # the engine stores tail blocks (save_unfull_chunk)

    def tail(self, index: int) -> list[bytes]:
        """Hashes of the stored tail blocks after full chunk ``index - 1`` (none without
        ``tails``)."""
        return self.tail_hashes(index) if self.tails else []

    def aliases(self, index: int) -> list[bytes]:
        """The alias hashes a prompt looks up after full chunk ``index - 1``."""
        return [AliasHash(h) for h in self.tail_hashes(index)]

    def indexed_hit(self, index: PresenceIndex) -> int:
        """Tokens the index says every rank stores: the run of full chunks, then the longer of
        the run of tail blocks and the longest alias (as ``CacheEngine.hit_spans`` finds them)."""
        n = index.leading(self.full, self.scope)
        tokens = n * self.chunk_size
        tail = self.tail(n)
        run = index.leading(tail, self.scope) if tail else 0
        aliases = self.aliases(n)
        alias = index.longest(aliases, self.scope) if aliases else 0
        return tokens + max(run, alias) * self.block_size

    def _hit_tail(self, index: PresenceIndex, n: int, blocks: int) -> list[bytes]:
        """The hashes of a hit's first ``blocks`` blocks after full chunk ``n - 1``: the run of
        stored tail blocks when the index knows the last of them on rank 0, else the alias into
        a stored chunk that covers them ([] if there is neither)."""
        tail = self.tail(n)
        if len(tail) >= blocks and index.tier(tail[blocks - 1], self.scope):
            return tail[:blocks]
        aliases = self.aliases(n)
        return aliases[blocks - 1 : blocks] if len(aliases) >= blocks else []

    def where(self, index: PresenceIndex, hit: int) -> str:
        """Where every rank has the chunks of the first ``hit`` tokens (at most the indexed
        hit): ``index.HOST``, ``index.SAVING`` or ``index.OTHER`` (``PresenceIndex.where``)."""
        c, bs = self.chunk_size, self.block_size
        n = min(hit // c, len(self.full))
        blocks = (hit - n * c) // bs
        last = self._hit_tail(index, n, blocks) if blocks else []
        if blocks and not last:
            return OTHER
        return index.where(list(self.full[:n]) + last, self.scope)

    def indexed_sources(self, index: PresenceIndex, hit: int) -> list[list[Any]]:
        """``[[start, end, tier], ...]`` of the first ``hit`` tokens (at most the indexed hit),
        by the tier the index says rank 0 holds each span in (for hit-source metrics)."""
        c, bs = self.chunk_size, self.block_size
        n = min(hit // c, len(self.full))
        out: list[list[Any]] = [
            [i * c, (i + 1) * c, index.tier(self.full[i], self.scope)] for i in range(n)
        ]
        blocks = (hit - n * c) // bs
        if blocks:
            last = self._hit_tail(index, n, blocks)
            tier = index.tier(last[-1], self.scope) if last else ""
            out.append([n * c, n * c + blocks * bs, tier])
        return out

    def saved_aliases(self, skip: int, end: int) -> list[bytes]:
        """The alias hashes a save of tokens ``[0, end)`` stores from token ``skip`` on (those
        of its full chunks), for ``PresenceIndex.expect``."""
        c = self.chunk_size
        out: list[bytes] = []
        for i in range(skip // c, end // c):
            out.extend(self.aliases(i)[: c // self.block_size - 1])
        return out

    def saved_spans(self, skip: int, end: int) -> list[tuple[bytes, int, int]]:
        """``(hash, start, end)`` of the spans a save of tokens ``[0, end)`` stores from token
        ``skip`` on: full chunks, and the tail blocks when ``end`` is the whole prompt."""
        c, bs = self.chunk_size, self.block_size
        out = [(self.full[i], i * c, (i + 1) * c) for i in range(skip // c, end // c)]
        if end == len(self.arr):
            n = end // c
            out += [(h, n * c + k * bs, n * c + (k + 1) * bs) for k, h in enumerate(self.tail(n))]
        return out

    def missing_after(self, hit: int) -> list[bytes]:
        """The hashes of the entries that would have extended a hit of ``hit`` tokens: the next
        full chunk, the next tail block, and every longer alias."""
        n, rest = divmod(hit, self.chunk_size)
        out = [self.full[n]] if rest == 0 and n < len(self.full) else []
        k = rest // self.block_size
        tail = self.tail(n)
        if k < len(tail):
            out.append(tail[k])
        out.extend(self.aliases(n)[k:])
        return out


class Sightings:
    """How many requests contained each chunk (``store_threshold``): a bounded count by chunk
    hash (the hash covers the whole prefix and the scope, so it names one chunk)."""

    def __init__(self, threshold: int, capacity: int = 1 << 18) -> None:
        self.threshold = threshold
        self.capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def see(self, hashes: IndexedPrompt) -> None:
        """One request with this prompt arrived."""
        if self.threshold <= 1:
            return
        for h in [*hashes.full, *hashes.tail(len(hashes.full))]:
            self._counts[h] = self._counts.get(h, 0) + 1
            self._counts.move_to_end(h)
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)

    def storable(self, hashes: IndexedPrompt) -> int:
        """Tokens of the prompt whose chunks were seen often enough (a prefix: a chunk's every
        sighting is also one of the chunks before it)."""
        if self.threshold <= 1:
            return len(hashes.arr)
        n = 0
        while n < len(hashes.full) and self._counts.get(hashes.full[n], 0) >= self.threshold:
            n += 1
        tokens = n * hashes.chunk_size
        if n == len(hashes.full):
            for h in hashes.tail(n):
                if self._counts.get(h, 0) < self.threshold:
                    break
                tokens += hashes.block_size
        return tokens
