"""Which tier held each chunk of a hit: the labels of vLLM's hit sources and of the
``hit_tokens_by_tier`` metric (metrics only: what is loaded is the held data)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.memory.handles import ChunkSpan
from kvtier.core.storage import StorageManager


def chunk_sources(storage: StorageManager, keys: Sequence[ChunkKey]) -> list[str]:
    """The tier name holding each of ``keys`` (all stored), host memory first, quarantined tiers
    left out (they are not read). The host tier's index is asked first; lower tiers but the last
    only with more than one lower tier (disk: a stat per chunk not in host memory); a key none of
    them holds is labelled with the last tier. A chunk that moves between tiers meanwhile may be
    labelled either way. The label decides which tier a wrong chunk puts in quarantine
    (``kvtier.core.verify``)."""
    host = getattr(storage, "host", None)
    if host is None:
        return ["local_cpu"] * len(keys)
    readable = storage.readable  # type: ignore[attr-defined]
    lower = readable(storage.lower)  # type: ignore[attr-defined]
    if keys and readable([host]):
        out = [str(host.name) if h else "" for h in host.contains(keys)]
    else:
        out = [""] * len(keys)
    rest = [i for i, name in enumerate(out) if not name]
    for tier in lower[:-1]:
        if not rest:
            break
        found = tier.contains([keys[i] for i in rest])
        for i, f in zip(rest, found, strict=True):
            if f:
                out[i] = str(tier.name)
        rest = [i for i in rest if not out[i]]
    last = str(lower[-1].name) if lower else "unknown"
    for i in rest:
        out[i] = last
    return out


class TierHits:
    """Tokens found by ``CacheEngine.hold`` so far, by the tier that held each chunk."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, int] = {}

    def count(self, spans: Sequence[ChunkSpan], sources: Sequence[str]) -> None:
        with self._lock:
            for span, tier in zip(spans, sources, strict=True):
                self._tokens[tier] = self._tokens.get(tier, 0) + span.num_tokens

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._tokens)
