"""The Redis rows of ``kvtier bench storage``.

- ``op: write`` / ``read``: the tier's ``batched_put`` / ``batched_get`` of a batch of chunks
  (codec, checksums and the copy into the host arena included) against ``redis-benchmark`` (the
  C client shipped with the server) running ``SET`` / ``GET`` of values of the tier's segment
  size over the tier's connection count, unpipelined (``-P 1``), over as many distinct keys as
  the batch has segments (``-r``: one key read over and over is served from the server CPU's
  cache, which no batch of chunks is). Each round runs the reference
  then the tier, on the same private server; the row is the median of the rounds (with the
  spread of both sides). The exact command is in the row's ``reference``. Writes overwrite the
  batch's values each round, as redis-benchmark's ``SET`` overwrites its key: both measure
  storing, not the server growing its memory.
- ``variant: cluster-3``: the tier reading the chunks of a 4k-token hit (16) from a Redis Cluster
  of three masters on loopback, against the tier reading them from one server in the same rounds
  (target: > 1).
- ``variant: sealed`` (with ``cryptography`` installed): the tier with ``encryption_key`` set
  (AES-256-GCM) writing and reading the batch, against the same tier without a key in the same
  rounds: the cost of encryption at rest (no target).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from typing import Any

from kvtier.bench.storage_common import Bench, Shape, filled_objects, make_backend
from kvtier.bench.storage_redis_servers import PrivateRedis, redis_benchmark, start_servers
from kvtier.core.keys import KeyFactory
from kvtier.storage.backends.redis.backend import RedisBackend

TARGET = 0.8  # of redis-benchmark
READ_GBPS_TARGET = 2.0  # 8B-shaped reads: what beats recomputing the prefill on a GPU
CLUSTER_TARGET = 1.0  # of one server
CLUSTER_BATCH = 16  # chunks of a 4k-token hit


def _rate_row(
    b: Bench,
    shape: Shape,
    op: str,
    ours: list[float],
    ref: list[float],
    target: float | None,
    reference: str,
    **extra: Any,
) -> None:
    g, rg = statistics.median(ours), statistics.median(ref)
    row = {
        "tier": "redis",
        "shape": shape.name,
        "op": op,
        "chunk_bytes": shape.meta.nbytes,
        "batch": shape.batch,
        "gbps": round(g, 3),
        "reference": reference,
        "reference_gbps": round(rg, 3),
        "ratio": round(g / rg, 3),
        "target": target,
        "gbps_spread": [round(min(ours), 3), round(max(ours), 3)],
        "reference_gbps_spread": [round(min(ref), 3), round(max(ref), 3)],
        **extra,
    }
    b.rows.append(row)
    label = f"{op} {extra['variant']}" if "variant" in extra else op
    shown = "-" if target is None else f"{target:.2f}"
    print(
        f"{'redis':<11}{shape.name:<7}{label:<16}{g:>9.2f}{rg:>11.2f}{g / rg:>8.2f}{shown:>8}",
        flush=True,
    )


def _tier(shape: Shape, arena: Any, url: str, cluster: bool = False, **cfg: Any) -> RedisBackend:
    tier = make_backend(
        RedisBackend,
        shape,
        arena,
        tiers=["local_cpu", "redis"],
        redis_url=url,
        redis_cluster=cluster,
        redis_timeout_s=60.0,
        **cfg,
    )
    assert isinstance(tier, RedisBackend)
    return tier


class _Batch:
    """A batch of chunks with known contents in a touched host arena, and the timed calls."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.arena, self.objs = filled_objects(shape)
        self.keys = KeyFactory("bench", shape.layout.fingerprint())
        self.nbytes = shape.meta.nbytes * shape.batch

    def items(self, r: int) -> list[Any]:
        return [
            (self.keys.key(r.to_bytes(4, "little") + i.to_bytes(4, "little")), o)
            for i, o in enumerate(self.objs)
        ]

    def read(self, t: RedisBackend, r: int) -> float:
        ks = [k for k, _ in self.items(r)]
        t0 = time.perf_counter()
        got = t.batched_get(ks, self.arena.allocate)
        dt = time.perf_counter() - t0
        assert all(g is not None for g in got), "redis bench read missed"
        for g in got:
            g.release()  # type: ignore[union-attr]
        return self.nbytes / dt / 1e9

    def write(self, t: RedisBackend, r: int) -> float:
        t0 = time.perf_counter()
        t.batched_put(self.items(r))
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        for o in self.objs:
            o.release()


def bench_redis(b: Bench, shape: Shape, server: PrivateRedis, cluster: PrivateRedis | None) -> None:
    batch = _Batch(shape)
    tier = _tier(shape, batch.arena, server.url)
    seg, conns = tier.segment_bytes, tier.nodes.connections
    keyspace = shape.batch * -(-shape.meta.nbytes // seg)  # as many distinct values as the tier's
    extra = {"segment_bytes": seg, "connections": conns}
    try:
        for op in ("write", "read"):
            ours, ref = [], []
            cmd = ""
            if op == "write":  # like redis-benchmark's SETs, each round overwrites its values
                tier.batched_put(batch.items(0))
            for r in range(b.repeat + 1):  # round 0 warms up
                rg, cmd = redis_benchmark(
                    server.port,
                    "set" if op == "write" else "get",
                    seg,
                    conns,
                    batch.nbytes,
                    keyspace,
                )
                if op == "read":
                    tier.batched_put(batch.items(r))
                g = batch.write(tier, 0) if op == "write" else batch.read(tier, r)
                if op == "read":
                    server.flush()
                if r:
                    ours.append(g)
                    ref.append(rg)
            server.flush()
            _rate_row(
                b,
                shape,
                op,
                ours,
                ref,
                TARGET,
                cmd,
                **extra,
                **(
                    {"target_gbps": READ_GBPS_TARGET} if op == "read" and shape.name == "8b" else {}
                ),
            )
    finally:
        tier.close()
        batch.close()
    if cluster is not None:
        _bench_cluster(b, shape, server, cluster)
    if importlib.util.find_spec("cryptography") is not None:
        _bench_sealed(b, shape, server)


def _bench_sealed(b: Bench, shape: Shape, server: PrivateRedis) -> None:
    """The batch written and read with ``encryption_key`` set and without, round by round."""
    batch = _Batch(shape)
    plain = _tier(shape, batch.arena, server.url)
    sealed = _tier(shape, batch.arena, server.url, encryption_key=os.urandom(32).hex())
    try:
        rates: dict[tuple[str, bool], list[float]] = {
            (op, s): [] for op in ("write", "read") for s in (False, True)
        }
        for r in range(b.repeat + 1):
            for is_sealed, t in ((False, plain), (True, sealed)):
                w = batch.write(t, r)
                g = batch.read(t, r)
                server.flush()
                if r:
                    rates[("write", is_sealed)].append(w)
                    rates[("read", is_sealed)].append(g)
        for op in ("write", "read"):
            _rate_row(
                b,
                shape,
                op,
                rates[(op, True)],
                rates[(op, False)],
                None,
                "this tier without encryption_key, same rounds",
                variant="sealed",
                segment_bytes=plain.segment_bytes,
                connections=plain.nodes.connections,
            )
    finally:
        plain.close()
        sealed.close()
        batch.close()


def _bench_cluster(b: Bench, shape: Shape, server: PrivateRedis, cluster: PrivateRedis) -> None:
    """The batch of a 4k-token hit read from three shards and from one server, round by round.
    (A chunk lives on one shard: a batch of a few chunks lands unevenly on three.)"""
    big = Shape(shape.name, shape.layout, shape.tokens, CLUSTER_BATCH)
    batch = _Batch(big)
    one = _tier(big, batch.arena, server.url)
    three = _tier(big, batch.arena, cluster.url, cluster=True)
    try:
        ours, ref = [], []
        for r in range(b.repeat + 1):
            one.batched_put(batch.items(r))
            three.batched_put(batch.items(r))
            g1, g3 = batch.read(one, r), batch.read(three, r)
            server.flush()
            cluster.flush()
            if r:
                ours.append(g3)
                ref.append(g1)
        _rate_row(
            b,
            big,
            "read",
            ours,
            ref,
            CLUSTER_TARGET,
            "this tier reading the same batch from one redis-server",
            variant="cluster-3",
            segment_bytes=one.segment_bytes,
            connections=one.nodes.connections,
        )
    finally:
        one.close()
        three.close()
        batch.close()


__all__ = ["PrivateRedis", "bench_redis", "redis_benchmark", "start_servers"]
