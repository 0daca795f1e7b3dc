"""The connector's stats payload (``kvtier.vllm_integration.stats``) on its own: per-interval
deltas add up to the cumulative values, aggregation over workers sums counters and keeps the
latest gauges, and Prometheus series carry only bounded labels."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.vllm_integration.stats import (
    PROM_PREFIX,
    KVTierPromMetrics,
    KVTierStats,
    StatsTracker,
)

TIERS = st.sampled_from(["", "local_cpu", "local_disk", "redis"])
# A run of cumulative snapshots: each step adds a non-negative amount to some (metric, tier).
STEPS = st.lists(
    st.lists(
        st.tuples(
            st.sampled_from(["loaded_tokens", "lookup_hit_tokens", "evictions"]),
            TIERS,
            st.integers(0, 1000),
        ),
        max_size=4,
    ),
    max_size=12,
)


@given(STEPS)
def test_deltas_add_up_to_the_cumulative_values(steps) -> None:
    tracker = StatsTracker()
    cumulative: dict[str, dict[str, int]] = {}
    total = KVTierStats()
    for step in steps:
        for name, tier, n in step:
            per = cumulative.setdefault(name, {})
            per[tier] = per.get(tier, 0) + n
        delta = tracker.delta({k: dict(v) for k, v in cumulative.items()})
        if delta is not None:
            assert not delta.is_empty()
            total = total.aggregate(delta)  # type: ignore[assignment]
    want = {k: {t: v for t, v in per.items() if v} for k, per in cumulative.items()}
    assert {k: v for k, v in total.data["counters"].items() if v} == {
        k: v for k, v in want.items() if v
    }
    assert tracker.delta({k: dict(v) for k, v in cumulative.items()}) is None  # nothing new


def test_aggregate_sums_counters_keeps_latest_gauges_and_joins_samples() -> None:
    a = KVTierStats(
        data={
            "counters": {"loaded_tokens": {"": 5}},
            "gauges": {"host_arena_used_bytes": {"": 10}},
            "samples": {"load_seconds": {"": [0.1]}},
        }
    )
    b = KVTierStats(
        data={
            "counters": {"loaded_tokens": {"": 7}, "evictions": {"local_cpu": 2}},
            "gauges": {"host_arena_used_bytes": {"": 30}},
            "samples": {"load_seconds": {"": [0.3]}},
        }
    )
    a.aggregate(b)
    assert a.data["counters"] == {"loaded_tokens": {"": 12}, "evictions": {"local_cpu": 2}}
    assert a.data["gauges"] == {"host_arena_used_bytes": {"": 30}}
    assert a.data["samples"] == {"load_seconds": {"": [0.1, 0.3]}}
    r = a.reduce()
    assert r["loaded_tokens"] == 12 and r["evictions[local_cpu]"] == 2
    assert r["load_seconds_count"] == 2 and r["load_seconds_avg"] == pytest.approx(0.2)
    assert KVTierStats().is_empty()


def test_prom_metrics_label_only_engine_model_and_tier() -> None:
    registry = CollectorRegistry()

    def bind(cls):
        return lambda *a, **kw: cls(*a, registry=registry, **kw)

    class Config:
        kv_transfer_config = None

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}
    prom = KVTierPromMetrics(Config(), types, ["model_name", "engine"], {0: ["m", "0"]})  # type: ignore[arg-type]
    prom.observe(
        {
            "counters": {"lookup_hit_tokens": {"local_disk": 64}},
            "gauges": {"tier_used_bytes": {"local_disk": 4096}},
            "samples": {"load_seconds": {"": [0.002, 0.004]}},
        }
    )
    labels = {"model_name": "m", "engine": "0", "tier": "local_disk"}
    assert registry.get_sample_value(PROM_PREFIX + "lookup_hit_tokens_total", labels) == 64
    assert registry.get_sample_value(PROM_PREFIX + "tier_used_bytes", labels) == 4096
    assert (
        registry.get_sample_value(
            PROM_PREFIX + "load_seconds_count", {"model_name": "m", "engine": "0"}
        )
        == 2
    )
    for family in registry.collect():
        for s in family.samples:
            assert set(s.labels) <= {"model_name", "engine", "tier", "le"}
