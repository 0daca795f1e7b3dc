"""The Redis/Valkey tier (single server or Redis Cluster).

Layout: a chunk is stored as a *head* and *segments*, all under one hash tag (so in a cluster a
chunk lives on one shard, and a stopped shard loses only its own chunks)::

    <prefix>{<chunk key string>}        head: codec header, trailer, segment size (u32),
                                        its CRC-32 (u32), b"KVR2"
    <prefix>{<chunk key string>}:<i>    segment i: payload bytes [i * size, (i + 1) * size)

The payload travels as segments of ``segment_bytes`` (``backend_options.redis``, default 1 MiB)
because servers move values of a MiB or two several times faster than one 32 MiB value. The head
(``codec`` header and checksum trailer) is written after the segments on the same connection
(the server applies one connection's commands in order): a reader that finds a head finds a
whole chunk, or a miss. The key string carries the engine's namespace (model, layout
fingerprint, world size, rank, salt), so engines of different models or layouts share a server
without meeting.

Data path: ``redis.jobs`` (segments read straight into the arena object, written from it,
pipelined over ``connections`` connections per server, every cluster shard in parallel), dealt
over servers and connections by ``redis.dispatch``.

A read accepts a chunk only if the head passes every ``codec`` check (key, layout, dtype, shape,
length), every segment has exactly its length, and the checksum over header and payload
matches. Anything else (a missing, foreign, corrupt or truncated segment, a key of another type
such as a list or a hash) is a miss for that chunk alone, counted (``redis.corrupt``), logged and
deleted; the other chunks of the batch still hit. ``contains`` reads and checks whole heads and
asks whether every segment exists, so a lookup does not count a chunk a read cannot deliver
(only a payload whose bytes changed is left for the read's checksum to find).

Encryption at rest (``encryption_key``, ``sealing``): the stored payload is the chunk's
AES-256-GCM ciphertext and tag (``codec.seal``: the head's codec header, which names the key and
carries the nonce, is the authenticated data), segmented and checksummed like a plain payload.
A read lands the ciphertext in the arena object (``redis.chunk``), checks the checksum, then
decrypts in place and checks the tag. A head that is plain, or sealed under another key (its key
check), and a payload whose tag fails are misses, counted (``redis.corrupt`` and
``redis.sealed_rejected``) and deleted, as is a sealed head read without a key.
Engines with different keys must not share a ``key_prefix``: each deletes what the other wrote.

URLs: ``redis://``, ``rediss://`` (TLS) and ``unix://``; ``redis_username``/``redis_password``
override the URL's credentials; ``redis.cluster`` routes by hash slot (``CLUSTER SLOTS``).

Time: every call has one deadline, ``redis_timeout_s`` plus the bytes it moves at
``min_throughput_mb_s`` (default 50 MB/s). A read or a lookup is two round trips (heads, then
segments; deleting rejected entries, if any, under the same deadline): the heads get half of
``redis_timeout_s``, so a stalled shard leaves the others time for their segments. Every
connect, send and receive within it waits at most the time left, so a server that trickles
bytes cannot stretch a call. A failed or timed-out server is marked down for
``retry_interval_s`` (default 1 s): its keys answer misses at once without touching the network
(other shards keep serving), then the next call tries again on a new connection (the failed
server's pooled ones are dropped with the first failure). Failures count as ``redis.errors``,
connections opened again after one as ``redis.reconnects`` (metric ``redis_reconnects``). A server out of memory (or any
other error reply) skips that chunk's store with a warning, and what did land of it is removed.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, ClassVar

from kvtier.core.errors import ConfigError
from kvtier.core.memory import MemoryObjMeta
from kvtier.storage import codec
from kvtier.storage._log import warn_throttled
from kvtier.storage._views import ArenaBytes
from kvtier.storage.backends.base import BackendContext, StorageBackend
from kvtier.storage.backends.redis.chunk import ChunkRead
from kvtier.storage.backends.redis.dispatch import by_node, lanes_of, pipelined, read_segments
from kvtier.storage.backends.redis.format import (
    head_key,
    options,
    parse_head,
    segment_count,
    segment_keys,
)
from kvtier.storage.backends.redis.jobs import UNREACHABLE, put_job
from kvtier.storage.backends.redis.nodes import Job, Nodes
from kvtier.storage.backends.redis.resp import (
    Deadline,
    RespError,
    command,
)
from kvtier.storage.backends.redis.url import parse_url
from kvtier.storage.sealing import TAG_BYTES

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj

logger = logging.getLogger("kvtier.storage")


class RedisBackend(StorageBackend):
    """Chunks in Redis/Valkey. See the module docstring."""

    name = "redis"
    seals_payloads: ClassVar[bool] = True

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        if not cfg.redis_url:
            raise ConfigError(
                "redis_url", cfg.redis_url, "the redis tier is enabled but has no URL"
            )
        if cfg.redis_cluster and cfg.redis_url.startswith("unix://"):
            raise ConfigError(
                "redis_url", cfg.redis_url, "a Redis Cluster is reached over TCP, not unix://"
            )
        opts = options(dict(ctx.options))
        self.prefix = str(opts["key_prefix"]).encode()
        self.segment_bytes = int(opts["segment_bytes"])
        self.retry_interval_s = float(opts["retry_interval_s"])
        self.bytes_per_s = float(opts["min_throughput_mb_s"]) * 1e6
        self.timeout_s = cfg.redis_timeout_s
        self.ttl = cfg.redis_ttl_s or None
        self.max_tokens = cfg.chunk_size
        self._bytes = ArenaBytes(ctx.arena)
        largest = ctx.layout.max_entry_nbytes(cfg.chunk_size)
        # a sealed payload is a tag longer (and may be one we cannot open, removed all the same)
        self._max_segments = max(1, -(-(largest + TAG_BYTES) // self.segment_bytes))
        self.nodes = Nodes(
            parse_url(cfg.redis_url, cfg.redis_username, cfg.redis_password),
            cluster=cfg.redis_cluster,
            connect_timeout_s=cfg.redis_connect_timeout_s,
            retry_interval_s=self.retry_interval_s,
            connections=int(opts["connections"]),
            on_error=lambda: self.ctx.stats.add(f"{self.name}.errors"),
            on_reconnect=lambda: self.ctx.stats.add(f"{self.name}.reconnects"),
        )

    # -- deadlines (keys are grouped by server and pipelined in redis_dispatch) ----------------
    def _deadline(self, nbytes: int = 0) -> Deadline:
        return Deadline(self.timeout_s + nbytes / self.bytes_per_s)

    def _head_deadline(self) -> tuple[Deadline, Deadline]:
        """A two-round-trip call's deadlines: the heads' (half of ``redis_timeout_s``, so a
        stalled shard leaves the others time for their segments) and the whole call's."""
        first = Deadline(self.timeout_s / 2)
        return first, first.extended(self.timeout_s / 2)

    # -- lookups -------------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """A hit only for a chunk a read could deliver: its head passes every codec check for
        this key (with ``encryption_key``, its key check too) and all of its segments exist. A
        bad head, or a head whose segments are gone (evicted by the server, say), is rejected
        as a read would. The payload's checksum is left to the read. One deadline for both
        round trips."""
        heads = [head_key(self.prefix, k) for k in keys]
        first, dl = self._head_deadline()
        groups = by_node(self.nodes, heads, first)
        replies = pipelined(self.nodes, groups, lambda i: command(b"GET", heads[i]), first)
        bad: dict[int, str] = {}
        wanted: dict[int, int] = {}  # index -> its segment count
        for i, key in enumerate(keys):
            parsed = self._head(i, key, replies.get(i), bad)
            if parsed is not None:
                wanted[i] = segment_count(parsed[0].payload_len, parsed[2])
        hits: set[int] = set()
        if wanted:
            found = pipelined(
                self.nodes,
                {
                    a: mine
                    for a, idxs in groups.items()
                    if (mine := [i for i in idxs if i in wanted])
                },
                lambda i: command(b"EXISTS", *segment_keys(heads[i], wanted[i])),
                dl,
            )
            for i, n in wanted.items():
                got = found.get(i)
                if got == n:
                    hits.add(i)
                elif isinstance(got, int):
                    bad[i] = f"truncated: {n - got} of {n} segments missing"
                # else the server failed this round trip: a miss, nothing removed
        if bad:
            self._reject(keys, bad, dl)
        return [i in hits for i in range(len(keys))]

    # -- writes --------------------------------------------------------------------------------
    def batched_put(self, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> None:
        if not items:
            return
        dl = self._deadline(sum(obj.meta.nbytes for _, obj in items))
        heads = [head_key(self.prefix, k) for k, _ in items]
        groups = by_node(self.nodes, heads, dl)
        headers, views = self._payloads(items)
        sums = [codec.Checksum(zlib.crc32(h)) for h in headers]
        failed: dict[int, object] = {i: "no server owns its slot" for i in range(len(items))}
        jobs: list[Job[list[object]]] = []
        lanes: list[list[int]] = []
        job = partial(put_job, views=views, heads=heads, headers=headers, sums=sums)
        for address, idxs in groups.items():
            for i in idxs:
                failed.pop(i)
            # whole chunks per connection
            for addr, lane in lanes_of(self.nodes, address, idxs):
                lanes.append(lane)
                jobs.append((addr, job(lane, segment_bytes=self.segment_bytes, ttl=self.ttl)))
        for lane, result in zip(lanes, self.nodes.run(jobs, dl), strict=True):
            for n, i in enumerate(lane):
                why = result if isinstance(result, BaseException) else result[n]
                if why is not None:
                    failed[i] = why
        if any(
            isinstance(why, RespError) and why.kind in ("MOVED", "ASK") for why in failed.values()
        ):
            self.nodes.topology_changed()  # slots moved: read the map again before the next call
        if failed:
            self.ctx.stats.add(f"{self.name}.store_skipped", len(failed))
            warn_throttled(
                "redis-set",
                "kvtier redis tier: %d chunk(s) not stored: %s",
                len(failed),
                next(iter(failed.values())),
            )
            # a head may have landed after a refused segment: take such chunks back
            self.remove([items[i][0] for i, why in failed.items() if isinstance(why, RespError)])
        self.ctx.stats.add_entries(
            self.name, "stored", (key for i, (key, _) in enumerate(items) if i not in failed)
        )

    def _payloads(
        self, items: Sequence[tuple[ChunkKey, MemoryObj]]
    ) -> tuple[list[bytes], list[memoryview]]:
        """Each chunk's codec header and the payload to store: a view of its object, or (with
        ``encryption_key``) its ciphertext and tag, a new buffer."""
        sealer = self.ctx.sealer
        if sealer is None:
            return (
                [codec.encode_header(k, obj.meta, self.ctx.layout) for k, obj in items],
                [self._bytes.of(obj) for _, obj in items],
            )
        headers, views = [], []
        for k, obj in items:
            header, sealed = codec.seal(k, obj.meta, self.ctx.layout, self._bytes.of(obj), sealer)
            headers.append(header)
            views.append(memoryview(sealed))
        return headers, views

    # -- reads ---------------------------------------------------------------------------------
    def batched_get(
        self,
        keys: Sequence[ChunkKey],
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    ) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        if not keys:
            return out
        first, dl = self._head_deadline()
        heads = [head_key(self.prefix, k) for k in keys]
        groups = by_node(self.nodes, heads, first)
        replies = pipelined(self.nodes, groups, lambda i: command(b"GET", heads[i]), first)
        bad: dict[int, str] = {}
        reads: list[ChunkRead] = []
        for i, key in enumerate(keys):
            r = self._open(i, key, replies.get(i), allocate, bad)
            if r is not None:
                reads.append(r)
        try:
            # the segments are a second round trip under the call's deadline, moved later by
            # their bytes' allowance: a server that failed the first is marked down by now
            dl = dl.extended(sum(r.head.payload_len for r in reads) / self.bytes_per_s)
            read_segments(self.nodes, reads, heads, groups, dl)
            for r in reads:
                r.check(keys[r.index], self.ctx.sealer)
                if r.failed is None:
                    out[r.index] = r.obj
                else:
                    bad[r.index] = r.failed
                    r.obj.release()
        except BaseException:
            for r in reads:
                if out[r.index] is None:
                    r.obj.release()
            raise
        if bad:
            self._reject(keys, bad, dl)
        return out

    def _head(
        self, i: int, key: ChunkKey, reply: object, bad: dict[int, str]
    ) -> tuple[codec.Header, bytes, int] | None:
        """Chunk ``i``'s head, checked (``parse_head``); None for a miss (``bad`` says why when
        the entry must go)."""
        if isinstance(reply, RespError):
            if reply.kind == "WRONGTYPE":  # another type at our key: bad entry (other errors are
                bad[i] = f"head: {reply}"  # the server's state: CLUSTERDOWN, LOADING, MOVED...)
            return None
        if reply is None or isinstance(reply, BaseException):  # a miss, or its server failed
            return None
        try:
            return parse_head(
                reply,
                key=key,
                layout=self.ctx.layout,
                max_tokens=self.max_tokens,
                sealer=self.ctx.sealer,
            )
        except codec.PayloadError as e:
            bad[i] = e.reason
            return None

    def _open(
        self,
        i: int,
        key: ChunkKey,
        reply: object,
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
        bad: dict[int, str],
    ) -> ChunkRead | None:
        """Check chunk ``i``'s head and allocate its object; None for a miss."""
        parsed = self._head(i, key, reply, bad)
        if parsed is None:
            return None
        head, trailer, seg = parsed
        obj = allocate(head.meta)
        if obj is None:
            self.ctx.stats.add(f"{self.name}.no_host_memory")
            return None
        return ChunkRead(i, head, trailer, obj, seg, self._bytes.of(obj))

    def _reject(self, keys: Sequence[ChunkKey], bad: dict[int, str], dl: Deadline) -> None:
        """Count, log and delete rejected entries (the deletion within the call's deadline ``dl``;
        an entry left behind is rejected again by the next read)."""
        gone = [keys[i] for i, why in bad.items() if why != UNREACHABLE]
        for i, why in bad.items():
            if why != UNREACHABLE:
                self.ctx.stats.add(f"{self.name}.corrupt")
                if why.startswith(("sealed", "unsealed")):  # codec's reasons for a failed seal
                    self.ctx.stats.add(f"{self.name}.sealed_rejected")
                logger.warning(
                    "kvtier redis tier: value of %s rejected (%s); deleted",
                    keys[i].to_string(),
                    why,
                )
        if gone:
            self._remove(gone, dl)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        self._remove(keys, self._deadline())

    def _remove(self, keys: Sequence[ChunkKey], dl: Deadline) -> None:
        if not keys:
            return
        heads = [head_key(self.prefix, k) for k in keys]
        pipelined(
            self.nodes,
            by_node(self.nodes, heads, dl),
            lambda i: command(b"DEL", heads[i], *segment_keys(heads[i], self._max_segments)),
            dl,
        )

    def close(self) -> None:
        self.nodes.close()
