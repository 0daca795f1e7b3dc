"""The Redis tier against a real redis-server (and a real 3-node cluster) on loopback."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from storage_helpers import CHUNK, LAYOUT, check_obj, chunk_value, key, meta, put_chunk

from fixtures.redis_client import RedisClient
from fixtures.redis_server import RedisServer

pytestmark = pytest.mark.redis

# 1 KiB segments: each 2 KiB test chunk travels as a head and two segments
FAST = {"backend_options": {"redis": {"retry_interval_s": 0.2, "segment_bytes": 1024}}}


def redis_manager(make_manager, url, **kw):
    opts = {"tiers": ["local_cpu", "redis"], "redis_url": url, **FAST, **kw}
    return make_manager(**opts)


def stored(m, *idx):
    for i in idx:
        put_chunk(m, i)
    assert m.flush(10)
    m.host.remove([key(i) for i in idx])


def redis_key(i: int) -> str:
    """The head's key; segment j is ``redis_key(i) + f":{j}"``."""
    return "kvtier:{" + key(i).to_string() + "}"


def entry_keys(i: int) -> list[str]:
    return [redis_key(i), redis_key(i) + ":0", redis_key(i) + ":1"]


def test_round_trip_and_namespace(make_manager, redis_clean):
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0, 1, 2)
    client = RedisClient(redis_clean.url)
    assert sorted(k.decode() for k in client.keys("*")) == sorted(
        k for i in range(3) for k in entry_keys(i)
    )
    assert client.ttl(redis_key(0)) == -1
    objs = m.batched_get([key(i) for i in range(4)])
    assert objs[3] is None
    for i in range(3):
        check_obj(objs[i], i)
        objs[i].release()
    assert m.stats.get("redis.hits") == 3
    assert m.host.contains([key(i) for i in range(3)]) == [True] * 3


@pytest.mark.parametrize("path", ["get", "get_non_blocking", "prefetch"])
def test_write_back_from_redis(make_manager, redis_clean, path):
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0)
    if path == "get":
        obj = m.get(key(0))
    elif path == "get_non_blocking":
        obj = m.get_non_blocking(key(0)).result(10)
    else:
        assert m.prefetch([key(0), key(1)]).result(10) == 1
        obj = m.host.batched_get([key(0)])[0]
    check_obj(obj, 0)
    obj.release()
    assert m.host.contains([key(0)]) == [True]
    assert m.stats.get("writeback.chunks") == 1


def test_prefetch_stops_where_the_middle_tier_misses(make_manager, redis_clean, tmp_path):
    """host: 0; disk: 1 and 4; redis: 2; nothing has 3. Prefetch may use 0..2 only."""
    m = make_manager(tiers=["local_cpu", "local_disk", "redis"], redis_url=redis_clean.url, **FAST)
    disk, red = m.lower
    for i in range(5):
        put_chunk(m, i)
    assert m.flush(10)
    keys = [key(i) for i in range(5)]
    m.host.remove(keys[1:])
    disk.remove([keys[0], keys[2], keys[3]])
    red.remove([keys[0], keys[1], keys[3], keys[4]])
    assert m.prefix_hits(keys) == 3
    assert m.prefetch(keys).result(10) == 3
    assert m.host.contains(keys) == [True, True, True, False, False]
    assert m.stats.get("local_disk.hits") == 1
    assert m.stats.get("redis.hits") == 1


def test_ttl_is_applied(make_manager, redis_clean):
    m = redis_manager(make_manager, redis_clean.url, redis_ttl_s=100)
    stored(m, 0)
    client = RedisClient(redis_clean.url)
    assert all(90 <= client.ttl(k) <= 100 for k in entry_keys(0))


DAMAGES = [
    "byte",
    "truncate",
    "swap",
    "foreign",
    "missing-segment",
    "head-checksum",
    "head-foreign",
]


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_value_is_a_miss_and_is_deleted(make_manager, redis_clean, caplog, damage):
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0, 1)
    client = RedisClient(redis_clean.url)
    seg0, seg1 = redis_key(0) + ":1", redis_key(1) + ":1"
    v0, v1 = client.get(seg0), client.get(seg1)
    if damage == "byte":
        b = bytearray(v0)
        b[len(b) // 2] ^= 1
        client.set(seg0, bytes(b))
    elif damage == "truncate":
        client.set(seg0, v0[:-1])
    elif damage == "swap":  # same lengths, other chunk's bytes: only the checksum can tell
        client.set(seg0, v1)
        client.set(seg1, v0)
    elif damage == "foreign":
        client.set(seg0, b"some other application's value")
    elif damage == "missing-segment":
        client.delete(seg0)
    elif damage == "head-checksum":
        h = bytearray(client.get(redis_key(0)))
        h[-9] ^= 1  # the trailer's last byte (segment size and magic follow it)
        client.set(redis_key(0), bytes(h))
    else:
        client.set(redis_key(0), client.get(redis_key(1)))  # chunk 1's head under chunk 0's key
    with caplog.at_level(logging.WARNING, logger="kvtier.storage"):
        assert m.get(key(0)) is None
    assert "rejected" in caplog.text
    assert m.stats.get("redis.corrupt") == 1
    assert client.exists(*entry_keys(0)) == 0
    if damage == "swap":
        assert m.get(key(1)) is None
        assert client.exists(*entry_keys(1)) == 0
    else:
        obj = m.get(key(1))
        check_obj(obj, 1)
        obj.release()


def test_killed_server_gives_misses_then_recovers(make_manager, redis_clean):
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0)
    redis_clean.stop()
    t0 = time.monotonic()
    assert m.get(key(0)) is None
    assert m.contains([key(0)]) == [False]
    assert m.prefetch([key(0)]).result(10) == 0
    put_chunk(m, 1)  # the write to redis fails in the background
    assert not m.flush(10)  # returns, reporting the write that did not land
    assert m.last_flush.not_stored == {"redis.store_skipped": 1}
    assert m.stats.get("redis.store_skipped") == 1
    assert time.monotonic() - t0 < 8  # bounded by the 0.5 s timeouts, not hung
    assert m.stats.get("redis.errors") >= 1
    redis_clean.start()  # back, empty
    deadline = time.monotonic() + 10
    m.host.remove([key(2)])
    while time.monotonic() < deadline:
        put_chunk(m, 2)
        m.flush(10)  # False while the tier still counts the server down
        m.host.remove([key(2)])
        obj = m.get(key(2))
        if obj is not None:
            check_obj(obj, 2)
            obj.release()
            break
        time.sleep(0.1)
    else:
        pytest.fail("the redis tier did not recover after the server came back")


def test_a_restarted_server_costs_one_error_and_counts_one_reconnect(make_manager, redis_clean):
    """A server restarted under a live tier has reset every pooled connection: the first failure
    drops them all (one error and one down period, not one per pooled connection), the next
    connection is counted as a reconnect, and the kvtier_redis_reconnects metric reports it."""
    from kvtier.core.metrics import storage_values

    m = redis_manager(
        make_manager,
        redis_clean.url,
        backend_options={
            "redis": {"retry_interval_s": 0.3, "segment_bytes": 1024, "connections": 4}
        },
    )
    stored(m, 0, 1, 2, 3)
    for i, obj in enumerate(m.batched_get([key(i) for i in range(4)])):  # four connections at
        check_obj(obj, i)  # once, idle in the pool afterwards
        obj.release()
    assert (m.stats.get("redis.errors"), m.stats.get("redis.reconnects")) == (0, 0)
    redis_clean.stop()
    redis_clean.start()  # back on the same port, empty
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        put_chunk(m, 9)
        m.flush(10)  # the first one meets a reset connection; then misses while marked down
        m.host.remove([key(9)])
        obj = m.get(key(9))
        if obj is not None:
            check_obj(obj, 9)
            obj.release()
            break
        time.sleep(0.05)
    else:
        pytest.fail("the redis tier did not recover after the restart")
    assert m.stats.get("redis.errors") == 1
    assert m.stats.get("redis.reconnects") == 1
    values: dict = {}
    storage_values(m, values)
    assert values["redis_reconnects"] == {"redis": 1}
    assert values["tier_errors"] == {"redis": 1}


def test_hung_server_gives_misses_within_the_timeout(make_manager, redis_clean):
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0)
    redis_clean.pause()
    try:
        t0 = time.monotonic()
        assert m.get(key(0)) is None
        assert m.contains([key(1)]) == [False]
        assert time.monotonic() - t0 < 5
    finally:
        redis_clean.resume()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        obj = m.get(key(0))
        if obj is not None:
            check_obj(obj, 0)
            obj.release()
            break
        time.sleep(0.1)
    else:
        pytest.fail("the redis tier did not recover after the server resumed")


def test_unreachable_at_start_is_only_misses(make_manager):
    m = redis_manager(make_manager, "redis://127.0.0.1:1/0")
    put_chunk(m, 0)
    m.flush(10)
    m.host.remove([key(0)])
    assert m.get(key(0)) is None
    assert m.stats.get("redis.store_skipped") + m.stats.get("redis.errors") >= 1


def test_password_acl_user_and_unix_socket(make_manager, tmp_path):
    sock = tmp_path / "r.sock"
    server = RedisServer(
        tmp_path / "auth",
        extra_args=[
            "--requirepass",
            "s3cret",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
        ],
    )
    try:
        server.start()
        RedisClient(server.url, password="s3cret")(
            "ACL", "SETUSER", "kv", "on", ">kvpw", "~kvtier:*", "+@all"
        )
        m = redis_manager(make_manager, server.url, redis_password="s3cret")
        stored(m, 0)
        obj = m.get(key(0))
        check_obj(obj, 0)
        obj.release()
        acl = redis_manager(make_manager, server.url, redis_username="kv", redis_password="kvpw")
        obj = acl.get(key(0))
        check_obj(obj, 0)
        obj.release()
        wrong = redis_manager(make_manager, server.url, redis_password="nope")
        assert wrong.get(key(0)) is None
        unix = redis_manager(make_manager, f"unix://{sock}", redis_password="s3cret")
        obj = unix.get(key(0))
        check_obj(obj, 0)
        obj.release()
    finally:
        server.stop()


def test_a_second_process_sees_what_the_first_wrote(make_manager, redis_clean, tmp_path):
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0, 1)
    code = f"""
from pathlib import Path
from kvtier.core.memory import HostArena
from kvtier.storage.manager import tiered_storage_manager
from storage_helpers import LAYOUT, NAMESPACE, check_obj, config, key
cfg = config(Path({str(tmp_path / "p2")!r}), tiers=["local_cpu", "redis"], redis_url={redis_clean.url!r})
arena = HostArena.create(1 << 22)
m = tiered_storage_manager(config=cfg, arena=arena, layout=LAYOUT, namespace=NAMESPACE)
assert m.prefix_hits([key(i) for i in range(3)]) == 2
for i, obj in enumerate(m.batched_get([key(0), key(1)])):
    check_obj(obj, i)
    obj.release()
m.close()
assert arena.used_bytes == 0
print("OK")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    assert out.stdout.strip() == "OK", out.stderr


def test_cluster_round_trip(make_manager, redis_cluster):
    redis_cluster.flush()
    m = redis_manager(make_manager, redis_cluster.url, redis_cluster=True)
    stored(m, *range(12))
    keys = [key(i) for i in range(13)]
    assert m.prefix_hits(keys) == 12
    node = redis_cluster.nodes[0]

    def slot(name: str) -> int:  # as the server computes it
        return node.command("CLUSTER", "KEYSLOT", name)

    owners = {slot(redis_key(i)) // 5462 for i in range(12)}
    assert len(owners) > 1  # the chunks really are spread over several masters
    for i in range(12):  # and each chunk's head and segments live on one of them
        assert {slot(k) for k in entry_keys(i)} == {slot(redis_key(i))}
    objs = m.batched_get(keys)
    assert objs[12] is None
    for i in range(12):
        check_obj(objs[i], i)
        objs[i].release()
    m.host.remove(keys)
    assert m.prefetch(keys).result(10) == 12


def test_partial_chunk_round_trip(make_manager, redis_clean):
    m = redis_manager(make_manager, redis_clean.url)
    obj = m.allocate(meta(CHUNK // 2))
    with obj:
        obj.tensor.copy_(chunk_value(9, CHUNK // 2))
        m.put(key(9), obj)
    assert m.flush(10)
    m.host.remove([key(9)])
    got = m.get(key(9))
    assert got.meta.shape == LAYOUT.chunk_shape(CHUNK // 2)
    check_obj(got, 9)
    got.release()


def test_close_during_a_hung_read_is_bounded_and_leaks_nothing(make_manager, redis_clean):
    m = redis_manager(make_manager, redis_clean.url)
    stored(m, 0, 1)
    redis_clean.pause()
    try:
        futs = [m.prefetch([key(0), key(1)]), m.get_non_blocking(key(1))]
        time.sleep(0.05)
        t0 = time.monotonic()
        m.close()
        assert time.monotonic() - t0 < 10
    finally:
        redis_clean.resume()
    assert futs[0].cancelled() or futs[0].result(10) == 0
    assert futs[1].cancelled() or futs[1].result(10) is None
    assert m.arena.used_bytes == 0


def test_a_parsed_url_never_shows_its_password():
    from kvtier.core.errors import ConfigError
    from kvtier.storage.backends.redis.url import parse_url

    for url, password in (
        ("redis://kv:s3cret@127.0.0.1:6379/0", None),
        ("rediss://127.0.0.1:6380/1?ssl_cert_reqs=none", "s3cret"),
        ("unix:///tmp/r.sock?db=2", "s3cret"),
    ):
        ep = parse_url(url, None, password)
        assert ep.password == "s3cret"
        assert "s3cret" not in repr(ep)
    with pytest.raises(ConfigError) as bad:
        parse_url("redis://kv:s3cret@127.0.0.1:99999/0", None, None)
    assert "s3cret" not in str(bad.value)
