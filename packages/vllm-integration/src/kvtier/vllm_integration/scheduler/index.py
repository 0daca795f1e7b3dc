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
arrives while they are still being copied is probed (and the probe waits for the save).

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
