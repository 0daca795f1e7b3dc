"""The tiered manager over host memory and disk: write-back, prefix rules, queue, lifecycle."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from storage_helpers import ARENA_BYTES, LAYOUT, NAMESPACE, check_obj, config, key, meta, put_chunk

from kvtier.core.errors import ConfigError
from kvtier.core.memory import HostArena
from kvtier.core.storage import storage_manager_for as core_create
from kvtier.storage.backends.base import BackendContext
from kvtier.storage.backends.disk.local_disk import LocalDiskBackend
from kvtier.storage.backends.local_cpu import LocalCPUBackend
from kvtier.storage.manager import TieredStorageManager
from kvtier.storage.stats import StorageStats


def only_on_disk(m, *idx):
    """Store chunks ``idx`` through the manager, then drop them from host memory."""
    for i in idx:
        put_chunk(m, i)
    assert m.flush(10)
    m.host.remove([key(i) for i in idx])


def test_core_factory_finds_the_tiered_manager(tmp_path):
    arena = HostArena.create(ARENA_BYTES)
    m = core_create(config(tmp_path), arena, LAYOUT, NAMESPACE)
    try:
        assert isinstance(m, TieredStorageManager)
        assert [t.name for t in m.tiers] == ["local_cpu", "local_disk"]
    finally:
        m.close()
    assert arena.used_bytes == 0


def test_put_then_get_from_host(make_manager):
    m = make_manager()
    put_chunk(m, 1)
    obj = m.get(key(1))
    check_obj(obj, 1)
    obj.release()
    assert m.get(key(2)) is None
    assert m.stats.get("writeback.chunks") == 0


@pytest.mark.parametrize("path", ["get", "batched_get", "get_non_blocking", "prefetch"])
def test_lower_tier_hit_is_written_back_on_every_read_path(make_manager, path):
    m = make_manager()
    only_on_disk(m, 0, 1)
    assert m.host.contains([key(0), key(1)]) == [False, False]
    if path == "get":
        objs = [m.get(key(0)), m.get(key(1))]
    elif path == "batched_get":
        objs = m.batched_get([key(0), key(1)])
    elif path == "get_non_blocking":
        objs = [m.get_non_blocking(key(0)).result(10), m.get_non_blocking(key(1)).result(10)]
    else:
        assert m.prefetch([key(0), key(1)]).result(10) == 2
        objs = []
    for i, obj in enumerate(objs):
        check_obj(obj, i)
        obj.release()
    assert m.host.contains([key(0), key(1)]) == [True, True]
    assert m.stats.get("writeback.chunks") == 2
    for i in (0, 1):
        obj = m.host.batched_get([key(i)])[0]
        check_obj(obj, i)
        obj.release()


def test_host_hits_are_not_written_back(make_manager):
    m = make_manager()
    put_chunk(m, 0)
    assert m.flush(10)
    m.get(key(0)).release()
    assert m.prefetch([key(0)]).result(10) == 1
    m.batched_get([key(0)])[0].release()
    assert m.stats.get("writeback.chunks") == 0


def test_prefetch_uses_only_the_contiguous_prefix(make_manager):
    m = make_manager()
    only_on_disk(m, 0, 1, 3, 4)  # chunk 2 is nowhere
    keys = [key(i) for i in range(5)]
    assert m.prefetch(keys).result(10) == 2
    assert m.host.contains(keys) == [True, True, False, False, False]
    assert m.stats.get("writeback.chunks") == 2
    assert m.prefix_hits(keys) == 2


def test_prefix_mixes_tiers_in_order(make_manager):
    m = make_manager()
    only_on_disk(m, 1, 3)
    put_chunk(m, 0)
    put_chunk(m, 2)
    assert m.flush(10)
    keys = [key(i) for i in range(5)]
    assert m.prefix_hits(keys) == 4
    assert m.prefetch(keys).result(10) == 4
    assert m.host.contains(keys) == [True, True, True, True, False]


class CountingDisk(LocalDiskBackend):
    """The real disk tier, recording which keys each lookup asked about."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.asked: list[list] = []

    def contains(self, keys):
        self.asked.append(list(keys))
        return super().contains(keys)


def build(tmp_path, tier_classes, arena_bytes=ARENA_BYTES, **kw):
    cfg = config(tmp_path, **kw)
    arena = HostArena.create(arena_bytes)
    stats = StorageStats()
    ctx = BackendContext(config=cfg, layout=LAYOUT, namespace=NAMESPACE, arena=arena, stats=stats)
    tiers = [cls(ctx) for cls in tier_classes]
    return TieredStorageManager(
        tiers,
        arena=arena,
        stats=stats,
        write_queue_size=cfg.write_queue_size,
        io_threads=cfg.io_threads,
    ), arena


def test_lookups_ask_lower_tiers_only_past_what_upper_tiers_hold(tmp_path):
    m, arena = build(tmp_path, [LocalCPUBackend, CountingDisk])
    disk = m.lower[0]
    try:
        for i in range(3):
            put_chunk(m, i)
        assert m.flush(10)
        keys = [key(i) for i in range(5)]
        disk.asked.clear()
        assert m.prefix_hits(keys) == 3
        assert disk.asked == [keys[3:]]
        disk.asked.clear()
        assert m.contains(keys) == [True, True, True, False, False]
        assert disk.asked == [keys[3:]]
    finally:
        m.close()
    assert arena.used_bytes == 0


class BlockedDisk(LocalDiskBackend):
    """The real disk tier whose writes wait for a gate (a slow medium)."""

    gate = threading.Event()

    def batched_put(self, items):
        assert self.gate.wait(30)
        super().batched_put(items)


def test_full_write_queue_drops_lower_copies_without_blocking(tmp_path):
    BlockedDisk.gate.clear()
    m, arena = build(tmp_path, [LocalCPUBackend, BlockedDisk], write_queue_size=2, io_threads=1)
    try:
        t0 = time.monotonic()
        for i in range(12):
            put_chunk(m, i)
        assert time.monotonic() - t0 < 5  # the writer is stuck; put must not wait for it
        dropped = m.stats.get("write_queue.dropped")
        assert dropped >= 12 - 2 - 8  # queue holds 2, the writer took at most one batch
        assert m.host.contains([key(i) for i in range(12)]) == [True] * 12
        assert not m.flush(0.1)
        BlockedDisk.gate.set()
        assert m.flush(10)
        assert m.stats.get("local_disk.stored") == 12 - dropped
    finally:
        BlockedDisk.gate.set()
        m.close()
    assert arena.used_bytes == 0


def test_close_drops_queued_writes_and_releases_everything(tmp_path):
    BlockedDisk.gate.clear()
    m, arena = build(tmp_path, [LocalCPUBackend, BlockedDisk], write_queue_size=16, io_threads=1)
    for i in range(6):
        put_chunk(m, i)
    threading.Timer(0.5, BlockedDisk.gate.set).start()
    m.close()
    assert arena.used_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        m.get(key(0))


def test_host_eviction_is_lru_and_by_bytes(make_manager):
    m = make_manager(arena_bytes=4 * meta().nbytes, tiers=["local_cpu"])
    for i in range(4):
        put_chunk(m, i)
    m.get(key(0)).release()  # 0 is now the most recent
    put_chunk(m, 4)
    assert m.host.contains([key(i) for i in range(5)]) == [True, False, True, True, True]
    put_chunk(m, 5)
    assert m.host.contains([key(i) for i in range(6)]) == [True, False, False, True, True, True]
    assert m.host.used_bytes == 4 * meta().nbytes


def test_borrowed_objects_survive_eviction_pressure(make_manager):
    m = make_manager(arena_bytes=4 * meta().nbytes, tiers=["local_cpu"])
    for i in range(4):
        put_chunk(m, i)
    held = [m.get(key(0)), m.get(key(1))]
    for i in range(10, 30):
        put_chunk(m, i)
    for i, obj in enumerate(held):
        check_obj(obj, i)
    assert m.host.contains([key(0), key(1)]) == [True, True]
    for obj in held:
        obj.release()
    for i in range(40, 44):
        put_chunk(m, i)
    assert m.host.contains([key(0), key(1)]) == [False, False]


def test_everything_borrowed_means_allocate_fails_fast(make_manager):
    m = make_manager(arena_bytes=2 * meta().nbytes, tiers=["local_cpu"])
    put_chunk(m, 0)
    put_chunk(m, 1)
    held = [m.get(key(0)), m.get(key(1))]
    assert m.allocate(meta()) is None
    for obj in held:
        obj.release()
    obj = m.allocate(meta())
    assert obj is not None
    obj.release()


def test_tiers_must_start_with_host_memory(tmp_path):
    with pytest.raises(ConfigError, match="tiers"):
        core_create(
            config(tmp_path, tiers=["local_disk"]), HostArena.create(ARENA_BYTES), LAYOUT, NAMESPACE
        )


def test_unknown_tier_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no storage backend named 'tape'"):
        core_create(
            config(tmp_path, tiers=["local_cpu", "tape"]),
            HostArena.create(ARENA_BYTES),
            LAYOUT,
            NAMESPACE,
        )


def test_without_redis_py_the_redis_tier_and_inventory_still_work(tmp_path):
    """The tier and the CLI's Redis inventory speak RESP themselves: kvtier needs no redis-py."""
    code = f"""
import sys
sys.modules["redis"] = None  # as if redis-py were not installed
import kvtier.storage
from kvtier.core.config import load_config
from kvtier.core.memory import HostArena
from kvtier.core.storage import storage_manager_for
from storage_helpers import LAYOUT, NAMESPACE, key
cfg = load_config(overrides={{"tiers": ["local_cpu", "redis"], "redis_url": "redis://127.0.0.1:1",
                  "local_disk_path": {str(tmp_path)!r}, "redis_connect_timeout_s": 0.5}}, env={{}})
m = storage_manager_for(cfg, HostArena.create(1 << 20), LAYOUT, NAMESPACE)
assert m.get(key(0)) is None  # nothing listens there: a miss
m.close()
from kvtier.storage.inventory import RedisInventory
inv = RedisInventory.connect("redis://127.0.0.1:1", "kvtier:", timeout_s=0.5)
try:
    list(inv.entries())
except ConnectionRefusedError:
    print("OK")
"""
    here = str(__import__("pathlib").Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=here
    )
    assert out.stdout.strip() == "OK", out.stderr


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"local_disk": {"o_direct": True}}, "backend_options.local_disk.o_direct"),
        ({"local_cpu": {"size_gb": 1}}, "backend_options.local_cpu.size_gb"),
        ({"rediss": {"segment_bytes": 1 << 20}}, "backend_options.rediss"),  # not a tier here
        ({"redis": {"connections": 2}}, "backend_options.redis"),  # redis not in tiers
    ],
)
def test_backend_options_a_tier_cannot_use_are_errors_naming_them(make_manager, options, field):
    with pytest.raises(ConfigError) as e:
        make_manager(backend_options=options)
    assert e.value.field == field
