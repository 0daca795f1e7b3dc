"""The scheduler's index of stored chunks, fed by the workers after every step.

The scheduler must never wait inside ``schedule()`` (no socket, disk or Redis call there), yet
it has to know which prompts may hit. Each worker reports, through vLLM's worker-to-scheduler
connector metadata (``build_connector_worker_meta`` -> ``update_connector_output``):

- once, its key namespace (model, layout fingerprint, world size, key rank), so the scheduler
  can compute that rank's chunk keys from token ids alone;
- what its local tiers held at start (host memory and disk: a restarted engine hits its disk),
  and then the key of every chunk a save commits, and of the chunk's alias entries
  (``kvtier.core.aliases``: an alias lets a prompt hit the first blocks of a stored chunk);
- whether every tier can list its chunks (``complete``): a tier other engines also write
  (Redis) cannot, and then any prompt may hit there;
- the answers to the scheduler's probes (``probes.py``);
- loads answered by the index (``lookup: index``) that came up short: how much of the prompt
  the tiers still had, so the index stops promising the rest.

The scheduler also counts the chunks it has just asked the workers to save, so a request that
arrives while they are still being copied is probed (and the probe waits for the save).

The index is a filter, not a promise: it only decides whether a request is worth a probe (an
asynchronous lookup on the workers that also holds the chunks it finds). It may say "stored"
for a chunk evicted since (the probe then finds less, and the scheduler forgets that chunk), and
it forgets the oldest entries past a capacity the worker sizes from its tiers. A chunk counts
only when every rank holds its shard.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvtier.core.engine import CacheEngine
from kvtier.core.keys import ChunkKey, KeyFactory, Scope


@dataclass
class ProbeAnswer:
    """A worker's answer to one probe: the tokens it holds for the request (``hit``) and where
    each held chunk was found (``[[start, end, tier], ...]``)."""

    req_id: str
    hold_id: int
    hit: int
    sources: list[list[Any]] = field(default_factory=list)


@dataclass
class RankReport:
    """What one worker tells the scheduler after a step."""

    rank: int
    namespace: tuple[str, str, int, int]  # KeyFactory(model, layout_fp, world_size, rank)
    complete: bool  # every tier lists its chunks: nothing is stored that the index cannot know
    capacity: int  # how many chunk keys the scheduler keeps for this rank at most
    added: list[str] = field(default_factory=list)  # ChunkKey.digest() of chunks now stored
    answers: list[ProbeAnswer] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)  # digests gone from host memory
    host_only: bool = False  # host memory is the only tier: what it drops is gone
    # (tier, digests written, digests dropped) of lower tiers, for KV events only
    tier_events: list[tuple[str, list[str], list[str]]] = field(default_factory=list)
    # (request id, tokens found): loads answered by the index that found only a prefix
    short: list[tuple[str, int]] = field(default_factory=list)
    lower_tier: str = ""  # the tier below host memory the index lists ("": none)
    listed: int = 0  # how many of ``added`` were listed in lower tiers at start (the first ones)
    saves_copied: int = -1  # the last step whose saves this rank has all copied (``frees.py``)


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """One step's reports of every worker (vLLM aggregates the workers' objects)."""

    reports: dict[int, RankReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMeta):
            return self
        merged = dict(self.reports)
        for rank, rep in other.reports.items():
            mine = merged.get(rank)
            if mine is None:
                merged[rank] = rep
            else:
                merged[rank] = RankReport(
                    rank,
                    rep.namespace,
                    rep.complete,
                    rep.capacity,
                    mine.added + rep.added,
                    mine.answers + rep.answers,
                    mine.evicted + rep.evicted,
                    rep.host_only,
                    mine.tier_events + rep.tier_events,
                    mine.short + rep.short,
                    rep.lower_tier,
                    mine.listed + rep.listed,
                    max(mine.saves_copied, rep.saves_copied),
                )
        return KVTierWorkerMeta(merged)


class AliasHash(bytes):
    """A tail hash standing for its alias entry (``KeyFactory.alias_key``) rather than for a
    tail-block entry: ``PresenceIndex`` digests it as the alias's key, so expectations and
    forgetting (``expect``, ``forget``) take chunk, tail and alias hashes in one list."""


class _RankIndex:
    """One rank's chunk keys (digests), oldest first, at most ``capacity``; each marked True
    while it is in host memory (for the tier a hit answered by the index comes from)."""

    def __init__(self, report: RankReport) -> None:
        self.keys = KeyFactory(*report.namespace)
        self.complete = report.complete
        self.capacity = max(1, report.capacity)
        self.lower_tier = report.lower_tier
        self.digests: OrderedDict[str, bool] = OrderedDict()

    def add(self, digests: Sequence[str], in_host: bool = True) -> None:
        for d in digests:
            self.digests[d] = in_host
            self.digests.move_to_end(d)
        while len(self.digests) > self.capacity:
            self.digests.popitem(last=False)

    def left_host(self, digests: Sequence[str], gone: bool) -> None:
        """``digests`` left host memory: gone (host memory is the only tier) or now only in
        lower tiers."""
        for d in digests:
            if gone:
                self.digests.pop(d, None)
            elif d in self.digests:
                self.digests[d] = False

    def tier(self, digest: str | None) -> str:
        """Where the index says the chunk is: host memory, the lower tier, or "" (unknown)."""
        where = self.digests.get(digest) if digest is not None else None
        if where is None:
            return ""
        return "local_cpu" if where else self.lower_tier

    def digest(self, chunk_hash: bytes, scope: Scope) -> str:
        return self.keys.digest(chunk_hash, scope, alias=isinstance(chunk_hash, AliasHash))


class PresenceIndex:
    """The scheduler's view of what every rank stores (see the module docstring)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._ranks: dict[int, _RankIndex] = {}
        self.version = 0  # changes whenever what the index says may change

    @property
    def ready(self) -> bool:
        """Every rank has reported at least once."""
        return len(self._ranks) == self.num_ranks

    @property
    def complete(self) -> bool:
        """Ready, and no rank has a tier the index cannot list."""
        return self.ready and all(r.complete for r in self._ranks.values())

    def apply(self, report: RankReport) -> None:
        self.version += 1
        rank = self._ranks.get(report.rank)
        if rank is None:
            rank = self._ranks[report.rank] = _RankIndex(report)
        rank.complete = report.complete
        rank.lower_tier = report.lower_tier
        rank.add(report.added[: report.listed], in_host=False)
        rank.add(report.added[report.listed :])
        rank.left_host(report.evicted, gone=report.host_only)

    def digest(self, rank: int, chunk_hash: bytes, scope: Scope) -> str | None:
        """``rank``'s key digest of a chunk (None before that rank reported)."""
        r = self._ranks.get(rank)
        return r.digest(chunk_hash, scope) if r is not None else None

    def tier(self, chunk_hash: bytes, scope: Scope) -> str:
        """The tier rank 0 holds a chunk in, as far as the index knows ("": not known)."""
        r = self._ranks.get(0)
        return r.tier(r.digest(chunk_hash, scope)) if r is not None else ""

    def leading(self, hashes: Sequence[bytes], scope: Scope) -> int:
        """How many of ``hashes``, from the first, every rank stores (0 until ready)."""
        if not self.ready:
            return 0
        for i, h in enumerate(hashes):
            for rank in self._ranks.values():
                if rank.digest(h, scope) not in rank.digests:
                    return i
        return len(hashes)

    def longest(self, hashes: Sequence[bytes], scope: Scope) -> int:
        """The largest ``j`` such that every rank stores ``hashes[j - 1]`` (0: none, or not
        ready): the longest alias of a prompt's tail the index knows."""
        if not self.ready:
            return 0
        for j in range(len(hashes), 0, -1):
            h = hashes[j - 1]
            if all(r.digest(h, scope) in r.digests for r in self._ranks.values()):
                return j
        return 0

    def expect(self, hashes: Sequence[bytes], scope: Scope) -> None:
        """Count chunks a save was just asked for on every rank (the workers report them once
        committed; a request arriving meanwhile is probed, and the probe waits for the save)."""
        self.version += 1
        for rank in self._ranks.values():
            rank.add([rank.digest(h, scope) for h in hashes])

    def forget(self, rank: int, hashes: Sequence[bytes], scope: Scope) -> None:
        """A probe found these chunks missing on ``rank``: stop counting them."""
        r = self._ranks.get(rank)
        if r is None:
            return
        self.version += 1
        for h in hashes:
            r.digests.pop(r.digest(h, scope), None)

    def __len__(self) -> int:
        return sum(len(r.digests) for r in self._ranks.values())


def index_capacity(engine: CacheEngine) -> int:
    """How many keys the scheduler keeps for one rank: four times what host memory and the disk
    tier hold in full chunks (tail blocks are smaller), times the entries each full chunk comes
    with (itself and an alias per block but the last), at least 4096."""
    cfg = engine.config
    size_gb = cfg.local_cpu_size_gb + (cfg.local_disk_size_gb if "local_disk" in cfg.tiers else 0)
    chunk = max(1, engine.layout.chunk_nbytes(engine.chunk_size))
    per_chunk = max(1, engine.chunk_size // engine.layout.block_size)
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
        self._saves_copied = self._copied_sent = -1
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
                or self._saves_copied != self._copied_sent
            ):
                return None
            self._copied_sent = self._saves_copied
            tier_events, self._tier_events = self._tier_events, []
            added, self._added = self._added, []
            answers, self._answers = self._answers, []
            evicted, self._evicted = self._evicted, []
            short, self._short = self._short, []
            listed, self._listed = self._listed, 0
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
