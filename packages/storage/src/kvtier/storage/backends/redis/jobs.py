"""The per-connection jobs of the Redis tier's writes and reads (run by ``nodes.Nodes``).

A write job SETs each chunk's segments, then its head, on one connection; a read job GETs
segments straight into the host objects that will hold them. Neither sends a whole lane at once
(a server asked for many large values at once copies them all into its buffers first, out of its
cache; measured slower: docs/storage-redis.md): reads keep ``IN_FLIGHT`` segments asked for per
connection, writes ``WRITE_WINDOW`` bytes of values unacknowledged.

Data path (``redis.resp``): segments are read with ``recv_into`` straight into the arena object
that will hold the chunk and written with ``sendmsg`` from it (no intermediate copy); a batch's
segments are pipelined over ``connections`` connections per server (default 2), and in a
cluster every shard is served in parallel. Each segment is hashed for the chunk's checksum by
the thread that moves it: as it lands (reads, ``redis.chunk``), right before it is sent (writes).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.storage import codec
from kvtier.storage.backends.redis.chunk import ChunkRead
from kvtier.storage.backends.redis.format import encode_head, segment_keys
from kvtier.storage.backends.redis.resp import (
    Connection,
    Deadline,
    RespError,
    command,
    set_command,
)

IN_FLIGHT = 2  # segments asked for and not yet read, per connection
# Value bytes sent and not yet acknowledged, per connection. Deeper than reads' window: each
# segment is hashed on the connection's thread before it is sent, and on two cores the server
# must have queued work while that thread hashes (docs/storage-redis.md).
WRITE_WINDOW = 4 << 20
UNREACHABLE = "its server failed or refused the read"


def put_job(
    chunks: list[int],
    views: list[memoryview],
    heads: list[bytes],
    headers: list[bytes],
    sums: list[codec.Checksum],
    *,
    segment_bytes: int,
    ttl: int | None,
) -> Callable[[Connection, Deadline], list[object]]:
    """SET each chunk's segments, then its head, on one connection (the server applies one
    connection's commands in order, so a head is never there before its segments); for each
    chunk, None or the first reply that was not OK. Each segment is hashed into its chunk's
    checksum right before it is sent, on this thread (the send then copies it from the cache);
    with a segment size that is not a multiple of the checksum's piece, the whole chunk is
    hashed before its first segment."""
    seg = segment_bytes
    per_segment = seg % codec.SEGMENT == 0
    # (chunk, what to hash first, command, value bytes); command None: the chunk's head
    plan: list[tuple[int, memoryview | None, list[bytes | memoryview] | None, int]] = []
    for i in chunks:
        n = max(1, -(-views[i].nbytes // seg))
        for s, k in enumerate(segment_keys(heads[i], n)):
            view = views[i][s * seg : (s + 1) * seg]
            cmd_head, cmd_tail = set_command(k, view.nbytes, ttl)
            hashed = view if per_segment else (views[i] if s == 0 else None)
            plan.append((i, hashed, [cmd_head, view, cmd_tail], view.nbytes))
        plan.append((i, None, None, 0))

    def parts(
        entry: tuple[int, memoryview | None, list[bytes | memoryview] | None, int],
    ) -> list[bytes | memoryview]:
        i, hashed, cmd, _ = entry
        if cmd is not None:
            if hashed is not None:
                sums[i].add_now(hashed)
            return cmd
        body = encode_head(headers[i], sums[i].value(), seg)
        cmd_head, cmd_tail = set_command(heads[i], len(body), ttl)
        return [cmd_head + body + cmd_tail]

    def run(conn: Connection, dl: Deadline) -> list[object]:
        # up to WRITE_WINDOW value bytes unacknowledged, not the whole lane: a whole lane at
        # once lands in the server's query buffers first (measured slower: docs/storage-redis.md)
        bad: dict[int, object] = {}
        sent = 0
        flying = 0
        for n, (i, _, _, size) in enumerate(plan):
            while sent < len(plan) and (sent == n or flying < WRITE_WINDOW):
                flying += plan[sent][3]
                conn.send(parts(plan[sent]), dl)
                sent += 1
            reply = conn.read_reply(dl)
            flying -= size
            if reply != "OK":
                bad.setdefault(i, reply)
        return [bad.get(i) for i in chunks]

    return run


def get_job(
    lane: list[tuple[ChunkRead, int, bytes]], on_moved: Callable[[], None]
) -> Callable[[Connection, Deadline], None]:
    """GET each segment of ``lane`` on one connection straight into its view; each chunk is told
    when its segment landed, or why not. ``on_moved``: a reply said the slot moved (cluster)."""
    cmds = [command(b"GET", k) for _, _, k in lane]
    window = IN_FLIGHT

    def run(conn: Connection, dl: Deadline) -> None:
        # Two segments in flight, not the whole lane: a server asked for many large values
        # at once copies them all into its output buffers first, out of its cache (measured
        # slower: docs/storage-redis.md).
        conn.send([b"".join(cmds[:window])], dl)
        for n, (r, s, _) in enumerate(lane):
            if n + window < len(cmds):
                conn.send([cmds[n + window]], dl)
            view = r.segment_view(s)
            got = conn.read_into(view, dl)
            problem = None
            if got != view.nbytes:
                state = isinstance(got, RespError) and got.kind != "WRONGTYPE"
                problem = UNREACHABLE if state else segment_problem(got, view.nbytes)
                if state and got.kind in ("MOVED", "ASK"):  # type: ignore[union-attr]
                    on_moved()
            r.landed(s, problem)  # hashed here, while the next segment is on its way

    return run


def segment_problem(got: int | RespError | None, want: int) -> str:
    if got is None:
        return "a segment is missing"
    if isinstance(got, RespError):
        return f"segment: {got}"
    return f"truncated: a segment of {got} bytes, expected {want}"
