"""The Redis tier against hostile links and entries: a trickling link, a cluster with a stopped
master, keys of another type at kvtier keys; its options and its routing."""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_helpers import CHUNK, LAYOUT, NAMESPACE, chunk_value, config, key, meta, put_chunk
from test_redis import FAST, entry_keys, redis_key, redis_manager, stored

from fixtures.redis_server import RedisCluster, RedisServer
from kvtier.core.errors import ConfigError
from kvtier.core.memory import HostArena
from kvtier.storage.backends.base import BackendContext
from kvtier.storage.backends.redis.backend import RedisBackend
from kvtier.storage.backends.redis.cluster import key_slot

pytestmark = pytest.mark.redis


def owner_port(cluster: RedisCluster, name: str) -> int:
    """The port of the master serving ``name``, as the cluster itself says (not the tier's
    routing, which these tests check)."""
    node = cluster.nodes[0]
    slot = node.command("CLUSTER", "KEYSLOT", name)
    for start, end, master, *_ in node.command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return int(master[1])
    raise AssertionError(f"no master serves slot {slot}")


class TrickleProxy:
    """A loopback TCP proxy to ``port``: requests pass at once, replies trickle one byte every
    ``every_s``. Every thread stops (bounded) on ``close``."""

    def __init__(self, port: int, every_s: float = 0.02) -> None:
        self.upstream = port
        self.every_s = every_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            for s in (client, server):
                s.settimeout(0.1)
            self._socks += [client, server]
            self._spawn(self._pump, client, server, 0.0)
            self._spawn(self._pump, server, client, self.every_s)

    def _pump(self, src: socket.socket, dst: socket.socket, every_s: float) -> None:
        pending = b""
        while not self._stop.is_set():
            try:
                if not pending:
                    pending = src.recv(1 << 16)
                    if not pending:
                        return
                if every_s:
                    dst.sendall(pending[:1])
                    pending = pending[1:]
                    time.sleep(every_s)
                else:
                    dst.sendall(pending)
                    pending = b""
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        for s in [self.listener, *self._socks]:
            s.close()
        for t in self._threads:
            t.join(5)


def test_a_trickling_link_is_bounded_by_the_call_deadline(make_manager, redis_clean):
    """Replies that trickle one byte every 20 ms: each call still ends within its 1 s deadline
    (the chunks are a few KiB: their bytes' allowance is negligible); per-read socket timeouts
    let a lookup take 6.5 s and a retrieve more than 45 s, a deadline per round trip 2 s."""
    stored(redis_manager(make_manager, redis_clean.url), *range(4))
    keys = [key(i) for i in range(4)]
    proxy = TrickleProxy(redis_clean.port)
    try:
        m = redis_manager(
            make_manager,
            f"redis://127.0.0.1:{proxy.port}/0",
            redis_timeout_s=1.0,
            backend_options={"redis": {"retry_interval_s": 0.0, "segment_bytes": 1024}},
        )
        for call in (
            lambda: m.batched_get(keys),
            lambda: m.contains(keys * 8),
            lambda: m.prefetch(keys).result(30),
        ):
            t0 = time.monotonic()
            call()
            assert time.monotonic() - t0 < 1.6  # one deadline per call, not one per round trip
        t0 = time.monotonic()
        assert m.batched_get(keys) == [None] * 4  # a head alone needs ~6 s at this rate
        assert time.monotonic() - t0 < 1.6
        for i in range(4, 8):  # writes too
            put_chunk(m, i)
        t0 = time.monotonic()
        m.flush(30)
        assert time.monotonic() - t0 < 2 * 2.5
    finally:
        proxy.close()


@pytest.mark.parametrize("where", ["head", "segment"])
@pytest.mark.parametrize("kind", ["list", "hash"])
def test_a_key_of_another_type_is_a_miss_for_that_chunk_alone(
    make_manager, redis_clean, caplog, where, kind
):
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0, 1, 2)
    bad = redis_key(1) if where == "head" else redis_key(1) + ":1"
    redis_clean.command("DEL", bad)
    if kind == "list":
        redis_clean.command("RPUSH", bad, "x", "y")
    else:
        redis_clean.command("HSET", bad, "f", "v")
    with caplog.at_level(logging.WARNING, logger="kvtier.storage"):
        if where == "head":  # a lookup does not count it (and removes it)
            assert m.contains([key(0), key(1), key(2)]) == [True, False, True]
        objs = m.batched_get([key(0), key(1), key(2)])
    assert objs[1] is None
    for i in (0, 2):
        assert objs[i] is not None and objs[i].tensor.equal(chunk_value(i))
        objs[i].release()
    assert "WRONGTYPE" in caplog.text
    assert m.stats.get("redis.corrupt") == 1
    assert redis_clean.command("EXISTS", *entry_keys(1)) == 0  # removed
    m.host.remove([key(0), key(2)])
    stored(m, 1)  # and stored again
    obj = m.get(key(1))
    assert obj is not None and obj.tensor.equal(chunk_value(1))
    obj.release()


@pytest.mark.parametrize("damage", ["other_key", "garbage", "segment_gone"])
def test_lookup_reports_no_hit_a_read_cannot_deliver(make_manager, redis_clean, damage):
    """A head that is another chunk's, a head of garbage, or a head whose segment the server
    dropped (its own eviction, say) is not a hit at lookup, and it is removed there."""
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0, 1, 2)
    if damage == "other_key":
        redis_clean.command("COPY", redis_key(2), redis_key(1), "REPLACE")
    elif damage == "garbage":
        redis_clean.command("SET", redis_key(1), "x" * redis_clean.command("STRLEN", redis_key(1)))
    else:
        redis_clean.command("DEL", redis_key(1) + ":1")
    keys = [key(0), key(1), key(2)]
    assert m.contains(keys) == [True, False, True]
    assert m.stats.get("redis.corrupt") == 1
    assert redis_clean.command("EXISTS", *entry_keys(1)) == 0  # removed
    assert m.contains(keys) == [True, False, True]
    objs = m.batched_get(keys)
    assert objs[1] is None
    for i in (0, 2):
        assert objs[i] is not None and objs[i].tensor.equal(chunk_value(i))
        objs[i].release()


def test_a_wrong_type_head_is_replaced_by_the_next_store(make_manager, redis_clean):
    m = redis_manager(make_manager, redis_clean.url)
    redis_clean.command("RPUSH", redis_key(3), "x")
    stored(m, 3)
    obj = m.get(key(3))
    assert obj is not None and obj.tensor.equal(chunk_value(3))
    obj.release()


def test_a_server_out_of_memory_skips_the_store_and_leaves_nothing(make_manager, tmp_path):
    server = RedisServer(
        tmp_path / "oom", extra_args=["--maxmemory", "1", "--maxmemory-policy", "noeviction"]
    )
    server.start()
    try:
        m = redis_manager(make_manager, server.url)
        for i in range(3):
            put_chunk(m, i)
        m.flush(10)
        assert m.stats.get("redis.store_skipped") == 3 and m.stats.get("redis.stored") == 0
        assert server.command("DBSIZE") == 0
        m.host.remove([key(i) for i in range(3)])
        assert m.batched_get([key(i) for i in range(3)]) == [None] * 3
    finally:
        server.stop()


@pytest.fixture
def private_cluster(tmp_path):
    try:
        cluster = RedisCluster(
            tmp_path / "cluster", extra_args=["--cluster-require-full-coverage", "no"]
        )
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("how", ["killed", "paused"])
def test_a_cluster_with_a_stopped_master_answers_within_the_timeout(
    make_manager, private_cluster, how
):
    stored(
        redis_manager(make_manager, private_cluster.url, redis_cluster=True, redis_timeout_s=5.0),
        *range(12),
    )
    m = redis_manager(make_manager, private_cluster.url, redis_cluster=True, redis_timeout_s=1.0)
    keys = [key(i) for i in range(12)]
    victim = private_cluster.nodes[1]
    lost = {i for i in range(12) if owner_port(private_cluster, redis_key(i)) == victim.port}
    assert 0 < len(lost) < 12
    victim.stop() if how == "killed" else victim.pause()
    try:
        for _ in range(2):  # the first call finds the node dead, the second knows it
            t0 = time.monotonic()
            objs = m.batched_get(keys)
            assert time.monotonic() - t0 < 2.5
            for i, obj in enumerate(objs):
                if i in lost:
                    assert obj is None
                else:
                    assert obj is not None and obj.tensor.equal(chunk_value(i))
                    obj.release()
            t0 = time.monotonic()
            assert m.contains(keys) == [i not in lost for i in range(12)]
            assert time.monotonic() - t0 < 2.5
            m.host.remove(keys)
    finally:
        victim.resume()


# -- options, routing, layout ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts, field",
    [
        ({"segment_bytes": 10}, "backend_options.redis.segment_bytes"),
        ({"segment_bytes": True}, "backend_options.redis.segment_bytes"),
        ({"connections": 0}, "backend_options.redis.connections"),
        ({"min_throughput_mb_s": float("nan")}, "backend_options.redis.min_throughput_mb_s"),
        ({"retry_interval_s": float("inf")}, "backend_options.redis.retry_interval_s"),
        ({"key_prefix": "a{b}"}, "backend_options.redis.key_prefix"),
        ({"nope": 1}, "backend_options.redis"),
    ],
)
def test_bad_options_name_the_option(opts, field):
    with pytest.raises(ConfigError) as e:
        _backend({"redis_url": "redis://127.0.0.1:1/0"}, opts)
    assert e.value.field == field


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:99999/0", "redis://127.0.0.1:6379/x", "redis://:6379"]
)
def test_a_bad_url_is_a_config_error(url):
    with pytest.raises(ConfigError) as e:
        _backend({"redis_url": url}, {})
    assert e.value.field == "redis_url"


def test_a_tier_error_about_its_url_never_shows_the_password():
    with pytest.raises(ConfigError) as e:
        _backend({"redis_url": "unix://:hunter2@/tmp/redis.sock", "redis_cluster": True}, {})
    assert e.value.field == "redis_url" and "Cluster" in str(e.value)
    assert "hunter2" not in str(e.value) and "hunter2" not in repr(e.value.value)


@settings(deadline=None)
@given(k=st.binary(max_size=40) | st.text(alphabet="ab{}:", max_size=12).map(str.encode))
def test_key_slot_matches_the_servers_rule(redis_cluster, k):
    assert key_slot(k) == redis_cluster.nodes[0].command("CLUSTER", "KEYSLOT", k)


def _backend(cfg: dict, opts: dict, arena: HostArena | None = None) -> RedisBackend:
    c = config(Path(tempfile.gettempdir()), tiers=["local_cpu", "redis"], **cfg)
    return RedisBackend(
        BackendContext(
            config=c,
            layout=LAYOUT,
            namespace=NAMESPACE,
            arena=arena or HostArena.create(1 << 16),
            options=opts,
        )
    )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seg=st.integers(1024, 5000),
    tokens=st.lists(st.integers(1, CHUNK), min_size=1, max_size=4),
    conns=st.integers(1, 3),
)
def test_any_segment_size_round_trips(redis_clean, seg, tokens, conns):
    """Chunks of any length split at any segment size over any number of connections come back
    byte for byte."""
    redis_clean.flush()
    arena = HostArena.create(1 << 20)
    tier = _backend(
        {"redis_url": redis_clean.url}, {"segment_bytes": seg, "connections": conns}, arena
    )
    try:
        objs = []
        for i, n in enumerate(tokens):
            obj = arena.allocate(meta(n))
            obj.tensor.copy_(chunk_value(i, n))
            objs.append(obj)
        tier.batched_put([(key(i), o) for i, o in enumerate(objs)])
        for o in objs:
            o.release()
        got = tier.batched_get([key(i) for i in range(len(tokens))], arena.allocate)
        for i, (g, n) in enumerate(zip(got, tokens, strict=True)):
            assert g is not None and g.tensor.equal(chunk_value(i, n))
            g.release()
    finally:
        tier.close()
    assert arena.used_bytes == 0


def test_fast_options_are_valid():
    _backend({"redis_url": "redis://127.0.0.1:1/0"}, FAST["backend_options"]["redis"])


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("seg", [512 << 10, 1 << 20, 700 << 10], ids=["512k", "1m", "700k"])
def test_big_chunks_round_trip_and_catch_damage(redis_clean, seg, sealed):
    """A 4 MiB chunk in segments that are whole checksum pieces (hashed by the threads that send
    and read them, as they go) or not (hashed whole), plain or sealed: it comes back byte for
    byte, and one flipped byte in a middle segment is a miss."""
    from kvtier.core.keys import KeyFactory
    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import MemoryObjMeta
    from kvtier.storage.sealing import Sealer

    layout = KVLayout(
        num_layers=4,
        num_kv_heads=8,
        head_size=128,
        dtype="float16",
        block_size=16,
        paged_layout="LBHNC",
    )
    keys = KeyFactory("big-model", layout.fingerprint())
    secret = "ab" * 32
    c = config(
        Path(tempfile.gettempdir()),
        tiers=["local_cpu", "redis"],
        redis_url=redis_clean.url,
        chunk_size=256,
        **({"encryption_key": secret} if sealed else {}),
    )
    arena = HostArena.create(16 << 20)
    tier = RedisBackend(
        BackendContext(
            config=c,
            layout=layout,
            namespace=keys.key(b"").namespace(),
            arena=arena,
            options={"segment_bytes": seg, "connections": 2},
            sealer=Sealer(bytes.fromhex(secret)) if sealed else None,
        )
    )
    try:
        redis_clean.flush()
        m = MemoryObjMeta(layout.chunk_shape(256), layout.chunk_dtype, 256)
        obj = arena.allocate(m)
        obj.byte_view()[:] = bytes(range(256)) * (m.nbytes // 256)
        k = keys.key(b"big")
        tier.batched_put([(k, obj)])
        (got,) = tier.batched_get([k], arena.allocate)
        assert got is not None and got.byte_view() == obj.byte_view()
        got.release()
        name = "kvtier:{" + k.to_string() + "}:2"
        bit = 1000 * 8 + 7  # the low bit of byte 1000
        redis_clean.command("SETBIT", name, bit, 1 - redis_clean.command("GETBIT", name, bit))
        assert tier.batched_get([k], arena.allocate) == [None]
        assert tier.ctx.stats.get("redis.corrupt") == 1
        obj.release()
    finally:
        tier.close()
    assert arena.used_bytes == 0


def test_writes_follow_a_slot_that_moved(make_manager, private_cluster):
    """A slot moved to another master (as a resharding does): the write that meets MOVED is
    skipped, the slot map is read again, and the next write lands on the new owner."""
    m = redis_manager(make_manager, private_cluster.url, redis_cluster=True, redis_timeout_s=5.0)
    stored(m, 0)  # the tier has read the slot map
    slot = key_slot(redis_key(7).encode())
    owner = owner_port(private_cluster, redis_key(7))
    target = next(n for n in private_cluster.nodes if n.port != owner)
    target_id = target.command("CLUSTER", "MYID")
    for n in private_cluster.nodes:  # an empty slot: ownership moves without migrating keys
        n.command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    put_chunk(m, 7)
    m.flush(10)
    assert m.stats.get("redis.store_skipped") == 1
    m.host.remove([key(7)])
    stored(m, 7)
    m.host.remove([key(7)])
    obj = m.get(key(7))
    assert obj is not None and obj.tensor.equal(chunk_value(7))
    obj.release()
    assert target.command("EXISTS", redis_key(7)) == 1
