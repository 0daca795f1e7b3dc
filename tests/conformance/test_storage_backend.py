"""One conformance suite for every storage tier (``kvtier.storage.backends.base``'s contract):
local_cpu, local_disk, redis (a real redis-server on loopback) and a third-party tier registered
in the ``kvtier.backends`` entry-point group as a plugin package would register it.

The contract: puts are kept and read back bit for bit (whole and partial chunks, in batches);
missing keys, damaged values and values moved to another key are misses, never wrong KV, and a
damaged value is dropped; namespaces never meet; a reader's object is its own; a lower tier with
no host memory to read into answers a miss and keeps the entry; tiers with a budget evict the
least recently used entries no reader holds.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import torch
from storage_cases import (
    CHUNK,
    DAMAGE,
    LAYOUT,
    MEDIA,
    NAMESPACE,
    OTHER_NAMESPACE,
    DictMedium,
    DiskMedium,
    Medium,
    RedisMedium,
    chunk_value,
    config,
    key,
    meta,
    other_key,
)

from fixtures.threads import run_concurrently
from kvtier.core import platform as platform_mod
from kvtier.core.config import KVTierConfig
from kvtier.core.memory import HostArena, MemoryObj
from kvtier.storage.backends.base import BackendContext, StorageBackend
from kvtier.storage.sealing import Sealer
from kvtier.storage.stats import StorageStats
from kvtier.storage.tiers import BACKEND_GROUP, load_backend_class

# redis_sealed: the redis tier with encryption_key set (payloads sealed with AES-256-GCM)
TIERS = ["local_cpu", "local_disk", "node", "redis", "redis_sealed", "dict_tier"]
KEY = "5a" * 32
_media_ids = itertools.count(1)


@pytest.fixture
def plugin_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dict_tier`` is in the ``kvtier.backends`` group, next to the installed tiers."""
    real = platform_mod.entry_points
    extra = EntryPoint("dict_tier", "storage_cases:DictBackend", BACKEND_GROUP)

    def with_plugin(*, group: str) -> list[EntryPoint]:
        found = list(real(group=group))
        return [*found, extra] if group == BACKEND_GROUP else found

    monkeypatch.setattr(platform_mod, "entry_points", with_plugin)


@dataclass
class Tier:
    """The tier under test, its medium (None: it keeps host objects) and how to build more."""

    name: str
    config: KVTierConfig
    arena: HostArena
    medium: Medium | None
    backend: StorageBackend = field(init=False)
    built: list[StorageBackend] = field(default_factory=list)

    def build(self, namespace: str = NAMESPACE, **overrides: Any) -> StorageBackend:
        """Another instance, as the manager builds one (entry point + context)."""
        cfg = self.config.replace(**overrides) if overrides else self.config
        cls = load_backend_class(self.name, cfg.plugins)
        key_bytes = cfg.encryption_key_bytes()
        ctx = BackendContext(
            config=cfg,
            layout=LAYOUT,
            namespace=namespace,
            arena=self.arena,
            stats=StorageStats(),
            options=dict(cfg.backend_options.get(self.name, {})),
            sealer=Sealer(key_bytes) if key_bytes is not None else None,
        )
        backend = cls(ctx)
        self.built.append(backend)
        return backend

    def _of(self, backend: StorageBackend | None) -> StorageBackend:
        return self.backend if backend is None else backend  # (a tier with len() 0 is falsy)

    @property
    def stats(self) -> StorageStats:
        return self.backend.ctx.stats

    def put(self, *idx: int, tokens: int = CHUNK, backend: StorageBackend | None = None) -> None:
        """One batched put of chunks ``idx``; the caller's handles are released afterwards."""
        objs = []
        for i in idx:
            obj = self.arena.allocate(meta(tokens))
            assert obj is not None, "test arena too small"
            obj.tensor.copy_(chunk_value(i, tokens))
            objs.append(obj)
        try:
            self._of(backend).batched_put([(key(i), o) for i, o in zip(idx, objs, strict=True)])
        finally:
            for o in objs:
                o.release()

    def get(self, *idx: int, backend: StorageBackend | None = None) -> list[MemoryObj | None]:
        return self._of(backend).batched_get([key(i) for i in idx], self.arena.allocate)

    def contains(self, *idx: int, backend: StorageBackend | None = None) -> list[bool]:
        return self._of(backend).contains([key(i) for i in idx])


def assert_chunk(obj: MemoryObj | None, i: int, tokens: int = CHUNK) -> None:
    assert obj is not None, f"chunk {i} missed"
    assert obj.num_tokens == tokens and tuple(obj.tensor.shape) == LAYOUT.chunk_shape(tokens)
    assert torch.equal(obj.tensor.view(torch.uint8), chunk_value(i, tokens).view(torch.uint8)), (
        f"chunk {i} has wrong bytes"
    )


def release(objs: list[MemoryObj | None]) -> None:
    for o in objs:
        if o is not None:
            o.release()


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest, tmp_path: Path, plugin_registered: None) -> Iterator[Tier]:
    name: str = request.param
    sealed = name == "redis_sealed"
    if sealed:
        pytest.importorskip("cryptography", reason="kvtier[encryption] is not installed")
        name = "redis"
    arena = HostArena.create(64 * meta().nbytes)
    kw: dict[str, Any] = {"tiers": ["local_cpu"] if name == "local_cpu" else ["local_cpu", name]}
    medium: Medium | None = None
    medium_id = 0
    if name == "local_disk":
        medium = DiskMedium(tmp_path / "disk")
    elif name == "node":
        node = request.getfixturevalue("node_dir")
        kw.update(node_path=str(node))
        medium = DiskMedium(node)
    elif name == "redis":
        server = request.getfixturevalue("redis_clean")
        # 1 KiB segments: each 2 KiB chunk is stored as several values
        kw.update(
            redis_url=server.url,
            backend_options={"redis": {"retry_interval_s": 0.2, "segment_bytes": 1024}},
            **({"encryption_key": KEY} if sealed else {}),
        )
        medium = RedisMedium(server.url)
    elif name == "dict_tier":
        medium_id = next(_media_ids)
        kw.update(backend_options={"dict_tier": {"medium": medium_id}})
    t = Tier(name, config(tmp_path, **kw), arena, medium)
    t.backend = t.build()
    if name == "dict_tier":
        t.medium = DictMedium(MEDIA[medium_id])
    yield t
    for b in t.built:
        b.close()
    MEDIA.pop(medium_id, None)
    assert arena.used_bytes == 0, f"{name} leaked {arena.used_bytes} bytes of host memory"


def lower_only(tier: Tier) -> Medium:
    if tier.medium is None:
        pytest.skip(f"{tier.name} keeps host objects: nothing leaves process memory")
    return tier.medium


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [CHUNK, 5], ids=["full", "partial"])
def test_a_batch_put_is_read_back_bit_for_bit(tier: Tier, tokens: int) -> None:
    tier.put(0, 1, 2, tokens=tokens)
    assert tier.contains(0, 1, 2) == [True, True, True]
    objs = tier.get(2, 0, 1)  # any order
    for i, obj in zip((2, 0, 1), objs, strict=True):
        assert_chunk(obj, i, tokens)
    release(objs)
    again = tier.get(0)  # the reader's release took nothing from the tier
    assert_chunk(again[0], 0, tokens)
    release(again)


def test_missing_keys_are_misses_in_a_batch(tier: Tier) -> None:
    tier.put(0, 2)
    objs = tier.get(0, 1, 2, 3)
    assert [o is not None for o in objs] == [True, False, True, False]
    assert_chunk(objs[0], 0)
    assert_chunk(objs[2], 2)
    release(objs)
    assert tier.contains(0, 1, 2, 3) == [True, False, True, False]
    assert tier.backend.prefix_length([key(i) for i in (0, 1, 2)]) == 1
    assert tier.backend.prefix_length([key(1), key(0)]) == 0
    b = tier.backend
    assert b.contains([]) == [] and b.batched_get([], tier.arena.allocate) == []
    b.batched_put([])
    b.remove([])


def test_remove_forgets_keys_and_ignores_missing_ones(tier: Tier) -> None:
    tier.put(0, 1)
    tier.backend.remove([key(0), key(5)])
    assert tier.contains(0, 1, 5) == [False, True, False]
    objs = tier.get(0, 1)
    assert objs[0] is None
    assert_chunk(objs[1], 1)
    release(objs)


def test_a_readers_object_is_its_own(tier: Tier) -> None:
    """An object a reader holds keeps its bytes whatever the tier does next."""
    tier.put(0)
    (held,) = tier.get(0)
    tier.backend.remove([key(0)])
    tier.put(1)
    assert_chunk(held, 0)
    assert held is not None
    held.release()


def test_puts_and_gets_from_several_threads(tier: Tier) -> None:
    """The manager writes from several threads while others read: each key's bytes stay its own."""

    def worker(base: int) -> None:
        for r in range(5):
            i = base * 100 + r
            tier.put(i)
            objs = tier.get(i)
            assert_chunk(objs[0], i)
            release(objs)

    run_concurrently([functools.partial(worker, b) for b in range(4)], timeout_s=60)


# -- never wrong KV ---------------------------------------------------------------------------
def stored_names(medium: Medium, tier: Tier, i: int) -> list[str]:
    """The medium's names that putting chunk ``i`` creates."""
    before = set(medium.names())
    tier.put(i)
    names = sorted(set(medium.names()) - before)
    assert names, f"{tier.name} stored nothing visible for chunk {i}"
    return names


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_value_is_a_miss_and_is_dropped(
    tier: Tier, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    medium = lower_only(tier)
    tier.put(1)
    for name in stored_names(medium, tier, 0):
        medium.write(name, DAMAGE[damage](medium.read(name)))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert tier.get(0) == [None]
    assert any(r.levelno >= logging.WARNING for r in caplog.records), (
        "a damaged value was not logged"
    )
    assert tier.contains(0) == [False]
    assert tier.stats.get(f"{tier.name}.corrupt") >= 1
    objs = tier.get(1)  # the neighbour is untouched
    assert_chunk(objs[0], 1)
    release(objs)


def test_a_chunk_that_lost_part_of_its_values_is_a_miss(tier: Tier) -> None:
    """Entries vanish underneath a tier (another engine's eviction, a TTL, a cleaner): a chunk
    stored as several values with one gone, or a file gone, is a miss, never a short read."""
    medium = lower_only(tier)
    tier.put(1)
    names = stored_names(medium, tier, 0)
    medium.delete(names[-1])
    assert tier.get(0) == [None]
    objs = tier.get(1)
    assert_chunk(objs[0], 1)
    release(objs)


def test_a_value_moved_to_another_key_is_a_miss(tier: Tier) -> None:
    """A value copied under another key's name (a swap, a stale rename) is foreign."""
    medium = lower_only(tier)
    names0 = stored_names(medium, tier, 0)
    names1 = stored_names(medium, tier, 1)
    assert len(names0) == len(names1)
    for src, dst in zip(names0, names1, strict=True):
        medium.write(dst, medium.read(src))
    assert tier.get(1) == [None]
    objs = tier.get(0)
    assert_chunk(objs[0], 0)
    release(objs)


def test_namespaces_never_meet(tier: Tier) -> None:
    """Another model (or layout, rank, salt generation) on the same medium, with the same token
    hashes, sees nothing of this one's chunks, and the other way round."""
    other = tier.build(namespace=OTHER_NAMESPACE)
    tier.put(0)
    assert other.contains([other_key(0)]) == [False]
    assert other.batched_get([other_key(0)], tier.arena.allocate) == [None]
    assert tier.backend.contains([other_key(0)]) == [False]
    obj = tier.arena.allocate(meta())
    assert obj is not None
    with obj:
        obj.tensor.copy_(chunk_value(7))
        other.batched_put([(other_key(1), obj)])
    assert tier.contains(1) == [False]
    assert other.contains([other_key(1)]) == [True]


def test_another_instance_on_the_same_medium_reads_what_was_written(tier: Tier) -> None:
    """A restarted engine (or another one sharing the tier) reads the stored values."""
    lower_only(tier)
    tier.put(0, 1)
    again = tier.build()
    assert tier.contains(0, 1, 2, backend=again) == [True, True, False]
    objs = tier.get(0, 1, backend=again)
    assert_chunk(objs[0], 0)
    assert_chunk(objs[1], 1)
    release(objs)


def test_no_host_memory_to_read_into_is_a_miss_that_keeps_the_entry(tier: Tier) -> None:
    lower_only(tier)
    tier.put(0)
    got = tier.backend.batched_get([key(0)], lambda m: None)
    if tier.name == "node":  # read in place: a hit needs no host memory (see test_node_in_place)
        assert got[0] is not None and got[0].arena is None
        assert_chunk(got[0], 0)
        got[0].release()
    else:
        assert got == [None]
    assert tier.contains(0) == [True]
    objs = tier.get(0)
    assert_chunk(objs[0], 0)
    release(objs)


# -- capacity -----------------------------------------------------------------------------------
def test_a_budget_evicts_the_least_recently_used_entries_no_reader_holds(tier: Tier) -> None:
    if tier.name == "local_cpu":
        evict = tier.backend.evict_one  # type: ignore[attr-defined]
        tier.put(0)
        tier.put(1)
        tier.put(2)
        release(tier.get(0))  # 0 is now the most recent
        held = tier.get(1)  # 1 is the oldest, but a reader holds it
        assert evict() and tier.contains(0, 1, 2) == [True, True, False]
        assert evict() and tier.contains(0, 1, 2) == [False, True, False]
        assert not evict(), "the only entry left is held by a reader"
        assert_chunk(held[0], 1)
        release(held)
        assert evict() and tier.contains(1) == [False]
    elif tier.name in ("local_disk", "node"):
        medium = lower_only(tier)
        file_bytes = len(medium.read(stored_names(medium, tier, 99)[0]))
        budget = 3.5 * file_bytes / (1 << 30)
        if tier.name == "node":
            path = Path(tier.config.node_path).parent / "small"
            small = tier.build(node_size_gb=budget, node_path=str(path))
        else:
            path = Path(tier.config.local_disk_path).parent / "small"
            small = tier.build(local_disk_size_gb=budget, local_disk_path=str(path))
        for i in range(3):
            tier.put(i, backend=small)
        release(tier.get(0, backend=small))  # 0 is now the most recent
        tier.put(3, backend=small)
        assert tier.contains(0, 1, 2, 3, backend=small) == [True, False, True, True]
    else:
        pytest.skip(
            f"{tier.name} has no byte budget of its own (Redis evicts by the server's "
            "maxmemory policy)"
        )
