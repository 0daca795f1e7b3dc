"""A worker's reports to the scheduler's index of stored chunks (``scheduler/index.py``): its key
namespace, what its tiers held at start, every chunk a save commits, probe answers and
shortfalls, sent with each step's output.
"""

from __future__ import annotations

import threading

from kvtier.core.engine import CacheEngine
from kvtier.core.keys import ChunkKey
from kvtier.vllm_integration.messages import KVTierWorkerMeta, ProbeAnswer, RankReport


def index_capacity(engine: CacheEngine) -> int:
    """How many keys the scheduler keeps for one rank: four times what host memory and the disk
    tier hold in full chunks (tail blocks are smaller), times the entries each full chunk comes
    with (itself and an alias per block but the last), at least 4096."""
    cfg = engine.config
    size_gb = cfg.local_cpu_size_gb + (cfg.local_disk_size_gb if "local_disk" in cfg.tiers else 0)
    chunk = max(1, engine.layout.chunk_nbytes(engine.chunk_size))
    per_chunk = max(1, engine.chunk_size // engine.layout.block_tokens)
    return max(4096, 4 * per_chunk * int(size_gb * (1 << 30) / chunk))


class PresenceFeed:
    """A worker's side of the index: collects what to report (thread-safe: saves commit on the
    saver thread, probes answer on the probe threads)."""

    def __init__(self, rank: int, engine: CacheEngine, tier_events: bool = False) -> None:
        """``tier_events``: also report lower-tier writes and drops (for KV events)."""
        self.rank = rank
        keys = engine.keys
        self._namespace = (keys.model, keys.layout_fp, keys.world_size, keys.rank)
        self._capacity = index_capacity(engine)
        self._lock = threading.Lock()
        self._answers: list[ProbeAnswer] = []
        self._evicted: list[str] = []
        self._short: list[tuple[str, int]] = []
        self._quarantined: list[tuple[str, float]] = []
        self._saves_copied = self._copied_sent = -1
        self._weights: tuple[int, str, bool] | None = None
        self._sent_once = False
        self._host_only = list(engine.config.tiers) == ["local_cpu"]
        self._lower_tier = next((t for t in engine.config.tiers if t != "local_cpu"), "")
        engine.storage.watch_host_removals(self._dropped)
        self._tier_events: list[tuple[str, list[str], list[str]]] = []
        if tier_events:
            engine.storage.watch_tiers(self._tier_event)
        # Listen first, then list: a chunk stored in between is reported twice, never missed.
        self._added: list[str] = []
        engine.watch_stores(self._stored)
        listed, self._complete = _inventory(engine)
        with self._lock:
            self._added = listed + self._added
            self._listed = len(listed)

    def _stored(self, keys: list[ChunkKey]) -> None:
        digests = [k.digest() for k in keys]
        with self._lock:
            self._added.extend(digests)

    def _dropped(self, keys: list[ChunkKey]) -> None:
        digests = [k.digest() for k in keys]
        with self._lock:
            self._evicted.extend(digests)

    def _tier_event(self, tier: str, stored: list[str], dropped: list[str]) -> None:
        with self._lock:
            self._tier_events.append((tier, stored, dropped))

    def answer(self, answer: ProbeAnswer) -> None:
        with self._lock:
            self._answers.append(answer)

    def shortfall(self, req_id: str, found: int) -> None:
        """A load answered by the index found only the first ``found`` tokens of the prompt."""
        with self._lock:
            self._short.append((req_id, found))

    def quarantined(self, tiers: list[tuple[str, float]]) -> None:
        """A verification quarantined ``tiers`` (name, seconds)."""
        with self._lock:
            self._quarantined.extend(tiers)

    def weights(self, epoch: int, digest: str, changed: bool) -> None:
        """This rank's live weights digest as of weights epoch ``epoch``, and whether it differs
        from the rank's at start."""
        with self._lock:
            self._weights = (epoch, digest, changed)

    def saves_copied(self, step: int) -> None:
        """The worker's saver has copied every save of the steps up to ``step``."""
        with self._lock:
            self._saves_copied = max(self._saves_copied, step)

    def take(self) -> KVTierWorkerMeta | None:
        """This step's report (None when there is nothing new to say)."""
        with self._lock:
            if self._sent_once and not (
                self._added
                or self._answers
                or self._evicted
                or self._tier_events
                or self._short
                or self._quarantined
                or self._weights
                or self._saves_copied != self._copied_sent
            ):
                return None
            self._copied_sent = self._saves_copied
            tier_events, self._tier_events = self._tier_events, []
            added, self._added = self._added, []
            answers, self._answers = self._answers, []
            evicted, self._evicted = self._evicted, []
            short, self._short = self._short, []
            quarantined, self._quarantined = self._quarantined, []
            listed, self._listed = self._listed, 0
            weights, self._weights = self._weights, None
            self._sent_once = True
        report = RankReport(
            self.rank,
            self._namespace,
            self._complete,
            self._capacity,
            added,
            answers,
            evicted,
            self._host_only,
            tier_events,
            short,
            self._lower_tier,
            listed,
            self._copied_sent,
            quarantined,
            weights,
        )
        return KVTierWorkerMeta({self.rank: report})


def _inventory(engine: CacheEngine) -> tuple[list[str], bool]:
    """The digests every tier of ``engine`` can list, and whether all of them can."""
    tiers = getattr(engine.storage, "tiers", None)
    if tiers is None:  # host memory only: nothing is stored before this process starts
        return [], True
    listed: list[str] = []
    complete = True
    for tier in tiers:
        digests = tier.digests()
        if digests is None:
            complete = False
        else:
            listed.extend(digests)
    return listed, complete
