"""The scheduler's index of stored chunks, fed by the workers after every step.

The scheduler must never wait inside ``schedule()`` (no socket, disk or Redis call there), yet
it has to know which prompts may hit. Each worker reports, through vLLM's worker-to-scheduler
connector metadata (``build_connector_worker_meta`` -> ``update_connector_output``):

- once, its key namespace (model, layout fingerprint, world size, key rank), so the scheduler
  can compute that rank's chunk keys from token ids alone;
- what its local tiers held at start (host memory and disk: a restarted engine hits its disk),
  and then the key of every chunk a save commits, and of the chunk's alias entries
  (``kvtier.core.keys.aliases``: an alias lets a prompt hit the first blocks of a stored chunk);
- whether every tier can list its chunks (``complete``): a tier other engines also write
  (Redis) cannot, and then any prompt may hit there;
- the answers to the scheduler's probes (``scheduler/prompts.py``);
- loads answered by the index (``lookup: index``) that came up short: how much of the prompt
  the tiers still had, so the index stops promising the rest.

The scheduler also counts the chunks it has just asked the workers to save, so a request that
arrives while they are still being copied is probed (and the probe waits for the save). Such a
chunk counts as being saved until every rank reports that step's saves copied
(``RankReport.saves_copied``); only then is it in host memory for a load in the step that
schedules its request (``where``, ``scheduler/sync_loads.py``).

The index is a filter, not a promise: it only decides whether a request is worth a probe (an
asynchronous lookup on the workers that also holds the chunks it finds). It may say "stored"
for a chunk evicted since (the probe then finds less, and the scheduler forgets that chunk), and
it forgets the oldest entries past a capacity the worker sizes from its tiers. A chunk counts
only when every rank holds its shard.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.core.keys import KeyFactory, Scope
from kvtier.vllm_integration.messages import AliasHash, RankReport

# Where a prompt's hit is (``PresenceIndex.where``).
HOST, SAVING, OTHER = "host", "saving", "other"


class _RankIndex:
    """One rank's chunk keys (digests), oldest first, at most ``capacity``; each marked True
    while it is in host memory (for the tier a hit answered by the index comes from)."""

    def __init__(self, report: RankReport) -> None:
        self.keys = KeyFactory(*report.namespace)
        self.complete = report.complete
        self.capacity = max(1, report.capacity)
        self.lower_tier = report.lower_tier
        self.digests: OrderedDict[str, bool] = OrderedDict()
        # Chunks a save was asked for and the step that asked, oldest first, until the rank
        # reports that step's saves copied (``copied``).
        self.saving: OrderedDict[str, int] = OrderedDict()
        self.copied = -1

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

    def expect(self, digests: Sequence[str], step: int) -> None:
        for d in digests:
            self.saving[d] = step
            self.saving.move_to_end(d)
        self.add(digests)

    def saves_copied(self, step: int) -> None:
        self.copied = max(self.copied, step)
        while self.saving and next(iter(self.saving.values())) <= self.copied:
            self.saving.popitem(last=False)

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
        rank.saves_copied(report.saves_copied)

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

    def where(self, hashes: Sequence[bytes], scope: Scope) -> str:
        """``HOST`` if every rank has each of ``hashes`` in host memory with no save of it in
        flight, else ``SAVING`` if each is in host memory or being saved there, else ``OTHER``
        (a lower tier, unknown, or not ready)."""
        if not self.ready:
            return OTHER
        out = HOST
        for r in self._ranks.values():
            for h in hashes:
                d = r.digest(h, scope)
                if r.digests.get(d) is not True:
                    return OTHER
                if d in r.saving:
                    out = SAVING
        return out

    def expect(self, hashes: Sequence[bytes], scope: Scope, step: int) -> None:
        """Count chunks a save was just asked for on every rank, in scheduler step ``step``
        (the workers report them once committed; a request arriving meanwhile is probed, and
        the probe waits for the save)."""
        self.version += 1
        for rank in self._ranks.values():
            rank.expect([rank.digest(h, scope) for h in hashes], step)

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
