"""A ``CacheEngine`` used on its own: its counters through ``kvtier.core.metrics.EngineCollector``
(a ``prometheus_client`` collector), and the tier each held chunk came from (``Hold.sources``),
over the real tiered manager with a real disk directory.

The exposition is scraped with ``prometheus_client.generate_latest`` and parsed back with its
text parser, as a Prometheus server would read it.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.core import CacheEngine
from kvtier.core.metrics import METRICS, EngineCollector

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytest.importorskip("kvtier.storage")
from fixtures.tiered_engine import CHUNK, LAYOUT, caches, tiered_engine  # noqa: E402

NUM_BLOCKS = 24
TOKENS = list(range(1000, 1000 + 3 * CHUNK + 5))  # three full chunks (the tail is not saved)


def engine(tmp_path, **cfg) -> CacheEngine:
    e = tiered_engine(tmp_path, **cfg)  # host memory and disk unless cfg names other tiers
    e.register_kv_caches(caches(0, NUM_BLOCKS))
    return e


def scrape(e: CacheEngine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = prometheus_client.CollectorRegistry()
    registry.register(EngineCollector(e, model="m"))
    text = prometheus_client.generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_collector_and_sources_host_then_disk(tmp_path) -> None:
    slots = torch.arange(len(TOKENS))
    a = engine(tmp_path)
    try:
        assert a.store(TOKENS, slots) == 3 * CHUNK
        assert a.storage.flush(30)
        with a.hold(TOKENS) as hold:
            assert hold.num_tokens == 3 * CHUNK
            assert hold.sources == ["local_cpu"] * 3
        got = scrape(a)
    finally:
        a.close()
    per_token = LAYOUT.bytes_per_token()
    assert got[("kvtier_saved_tokens_total", (("model", "m"),))] == 3 * CHUNK
    assert got[("kvtier_saved_bytes_total", (("model", "m"),))] == 3 * CHUNK * per_token
    assert got[("kvtier_lookups_total", (("model", "m"),))] == 1
    assert (
        got[("kvtier_lookup_hit_tokens_total", (("model", "m"), ("tier", "local_cpu")))]
        == 3 * CHUNK
    )
    assert got[("kvtier_tier_stored_chunks_total", (("model", "m"), ("tier", "local_disk")))] == 3
    assert got[("kvtier_tier_used_bytes", (("model", "m"), ("tier", "local_disk")))] > 0
    assert got[("kvtier_host_arena_used_bytes", (("model", "m"),))] > 0
    # Every exported name is one of METRICS, with the kvtier_ prefix; labels are bounded.
    names = {n.removeprefix("kvtier_").removesuffix("_total") for n, _ in got}
    assert names <= set(METRICS)
    assert {k for _, labels in got for k, _ in labels} <= {"model", "tier"}

    # A new engine on the same directory: the chunks come from disk; one is damaged.
    b = engine(tmp_path)
    try:
        disk = b.storage.lower[0]
        third = b.full_spans(TOKENS)[2].key
        path = disk.path_of(third)
        data = bytearray(path.read_bytes())
        data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
        path.write_bytes(bytes(data))
        with b.hold(TOKENS) as hold:
            assert hold.num_tokens == 2 * CHUNK  # the damaged chunk is a miss, never served
            assert hold.sources == ["local_disk"] * 2
        with b.hold(TOKENS) as hold:  # now written back into host memory
            assert hold.sources == ["local_cpu"] * 2
        got = scrape(b)
    finally:
        b.close()
    tier = lambda t: (("model", "m"), ("tier", t))  # noqa: E731
    assert got[("kvtier_lookup_hit_tokens_total", tier("local_disk"))] == 2 * CHUNK
    assert got[("kvtier_lookup_hit_tokens_total", tier("local_cpu"))] == 2 * CHUNK
    assert got[("kvtier_hit_chunks_total", tier("local_disk"))] == 2
    assert got[("kvtier_corrupt_payloads_total", tier("local_disk"))] == 1


@pytest.mark.redis
def test_chunks_found_only_in_redis_are_labelled_redis(tmp_path, redis_clean) -> None:
    """Three tiers; a second engine with an empty disk directory shares only Redis: its hits
    are labelled redis (vLLM's hit sources count them as external_unspecified)."""
    tiers = {"tiers": ["local_cpu", "local_disk", "redis"], "redis_url": redis_clean.url}
    a = engine(tmp_path / "a", **tiers)
    try:
        assert a.store(TOKENS, torch.arange(len(TOKENS))) == 3 * CHUNK
        assert a.storage.flush(30)
    finally:
        a.close()
    b = engine(tmp_path / "b", **tiers)
    try:
        with b.hold(TOKENS) as hold:
            assert hold.num_tokens == 3 * CHUNK
            assert hold.sources == ["redis"] * 3
        assert b.hit_tokens_by_tier() == {"redis": 3 * CHUNK}
        got = scrape(b)
    finally:
        b.close()
    assert got[("kvtier_hit_chunks_total", (("model", "m"), ("tier", "redis")))] == 3
