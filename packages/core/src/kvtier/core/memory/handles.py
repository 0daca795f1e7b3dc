"""What a ``CacheEngine`` hands out: chunk spans, holds on looked-up prefixes, layer-wise
retrieval jobs, and its counters."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.memory import MemoryObj


@dataclass(frozen=True)
class ChunkSpan:
    """Tokens ``[start, end)`` of a prompt, stored under ``key``.

    ``stored_tokens``: how many tokens the object under ``key`` holds when that is more than the
    span (an alias hit: the span is the first blocks of a stored chunk); 0 means exactly the
    span's."""

    start: int
    end: int
    key: ChunkKey
    stored_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def object_tokens(self) -> int:
        """Tokens of the stored object the span is loaded from (its first ``num_tokens``)."""
        return max(self.stored_tokens, self.num_tokens)


@dataclass
class EngineStats:
    lookups: int = 0
    lookup_hit_tokens: int = 0
    stored_tokens: int = 0
    store_skipped_chunks: int = 0
    retrieved_tokens: int = 0
    retrieve_misses: int = 0
    store_abandoned_chunks: int = 0
    aliases_skipped: int = 0
    stored_states: int = 0  # recurrent-state entries stored (``kvtier.core.engine.states``)
    state_misses: int = 0  # loads whose state entry was gone: nothing loaded
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class Hold:
    """Host objects of a looked-up prefix, kept until ``release()`` (idempotent).

    ``num_tokens`` is the hit length; pass the hold to ``retrieve``/``retrieve_layerwise`` to load
    from exactly these objects. A hold pins host memory: release it when the load is done or the
    request goes away.
    """

    def __init__(
        self,
        spans: list[ChunkSpan],
        objs: list[MemoryObj],
        digest: bytes,
        sources: list[str] | None = None,
        state: tuple[int, MemoryObj] | None = None,
        state_source: str = "",
    ) -> None:
        self.spans = spans
        self.objs = objs
        self.digest = digest  # ``PromptHashes.digest``: the tokens and scope it was taken for
        # A state layout's state entry at the hit's end (``kvtier.core.engine.states``): (end, object),
        # and the tier it was read from.
        self.state = state
        self.state_source = state_source
        # The tier each held chunk was found in (``CacheEngine.chunk_sources``), for metrics.
        self.sources: list[str] = list(sources) if sources is not None else []
        self._lock = threading.Lock()
        self._released = False

    @property
    def num_tokens(self) -> int:
        return self.spans[-1].end if self.spans else 0

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        for obj in self.objs:
            obj.release()
        if self.state is not None:
            self.state[1].release()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class RetrieveJob:
    """A layer-wise retrieval: ``mask`` (tokens that will be loaded) is known up front; iterating
    ``layers`` loads layer by layer (each yielded index is ready for attention)."""

    mask: torch.Tensor
    layers: Iterator[int]
