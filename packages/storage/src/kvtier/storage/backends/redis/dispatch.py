"""How the Redis tier spreads a batch over its servers (``nodes.Nodes``): keys grouped by
the server that holds them, each server's share dealt over its connections, one small command
per key pipelined per server, and a batch's segment reads run as read jobs (``redis.jobs``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.storage.backends.redis.chunk import ChunkRead
from kvtier.storage.backends.redis.format import segment_keys
from kvtier.storage.backends.redis.jobs import UNREACHABLE, get_job
from kvtier.storage.backends.redis.nodes import Job, Nodes
from kvtier.storage.backends.redis.resp import Connection, Deadline, RespError


def by_node(nodes: Nodes, heads: Sequence[bytes], deadline: Deadline) -> dict[str, list[int]]:
    """Indices of ``heads`` grouped by the server that holds them (unroutable ones left out)."""
    route = nodes.router(deadline)
    groups: dict[str, list[int]] = defaultdict(list)
    if route is not None:
        for i, h in enumerate(heads):
            addr = route(h)
            if addr is not None:
                groups[addr].append(i)
    return groups


def lanes_of(nodes: Nodes, address: str, items: list[Any]) -> list[tuple[str, list[Any]]]:
    """``items`` of one server dealt round-robin over its connections."""
    n = min(nodes.connections, len(items))
    return [(address, items[i::n]) for i in range(n)]


def pipelined(
    nodes: Nodes, groups: dict[str, list[int]], packed: Callable[[int], bytes], deadline: Deadline
) -> dict[int, object]:
    """Send one small command per index, pipelined per server; each index's reply (or the
    exception its server's job ended with)."""

    def job(idxs: list[int]) -> Callable[[Connection, Deadline], list[object]]:
        def run(conn: Connection, dl: Deadline) -> list[object]:
            conn.send([b"".join(packed(i) for i in idxs)], dl)
            return [conn.read_reply(dl) for _ in idxs]

        return run

    jobs: list[Job[list[object]]] = [(a, job(idxs)) for a, idxs in groups.items()]
    out: dict[int, object] = {}
    for (_, idxs), result in zip(groups.items(), nodes.run(jobs, deadline), strict=True):
        for n, i in enumerate(idxs):
            reply = out[i] = result if isinstance(result, BaseException) else result[n]
            if isinstance(reply, RespError) and reply.kind in ("MOVED", "ASK"):
                nodes.topology_changed()
    return out


def read_segments(
    nodes: Nodes,
    reads: list[ChunkRead],
    heads: list[bytes],
    groups: dict[str, list[int]],
    dl: Deadline,
) -> None:
    """Read every segment of ``reads`` straight into its object; mark the chunks that fail."""
    by_index = {r.index: r for r in reads}
    jobs: list[Job[None]] = []
    lanes: list[list[tuple[ChunkRead, int, bytes]]] = []
    for address, idxs in groups.items():
        segs = []
        for i in idxs:
            r = by_index.get(i)
            if r is None:
                continue
            for s, k in enumerate(segment_keys(heads[i], r.segments)):
                segs.append((r, s, k))
        for addr, lane in lanes_of(nodes, address, segs):
            lanes.append(lane)
            jobs.append((addr, get_job(lane, nodes.topology_changed)))
    for lane, result in zip(lanes, nodes.run(jobs, dl), strict=True):
        if isinstance(result, BaseException):
            for r, _, _ in lane:
                r.fail(UNREACHABLE)
