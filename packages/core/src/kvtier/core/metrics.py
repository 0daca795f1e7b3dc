"""kvtier's metrics: one table of names, read from a ``CacheEngine``'s counters.

``METRICS`` names every series kvtier exports, with its kind and whether it carries a ``tier``
label (``local_cpu``, ``local_disk``, ``redis``, ...). Labels are bounded on purpose: the tier
and, where the exporter adds it, the model. Never a salt, adapter or request id.

``engine_values(engine)`` reads a ``CacheEngine``'s cumulative counters and current gauges
(engine counters, the storage manager's per-tier counters, host-arena and tier usage) as
``{metric: {tier: value}}`` (``""`` for a metric without a tier). Two exporters use it:

- ``EngineCollector``: a ``prometheus_client`` collector for a ``CacheEngine`` used on its own
  (``REGISTRY.register(EngineCollector(engine))``; needs the ``metrics`` extra of kvtier-core);
- kvtier's vLLM connector, which sends per-step deltas of the same values through vLLM's
  connector stats, where they appear as ``vllm:kvtier_*``.

Latency histograms (``*_seconds``) are observed by the vLLM connector around its lookups, loads,
saves and scheduler steps; ``LATENCY_BUCKETS`` are their bucket bounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.core.engine import CacheEngine

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True)
class MetricDef:
    kind: str
    doc: str
    tiered: bool = False


METRICS: dict[str, MetricDef] = {
    # CacheEngine
    "lookups": MetricDef(COUNTER, "Prefix lookups answered by the cache engine."),
    "lookup_hit_tokens": MetricDef(
        COUNTER, "Tokens found by lookups, by the tier that held each chunk.", tiered=True
    ),
    "loaded_tokens": MetricDef(COUNTER, "Tokens whose KV was loaded into the engine's cache."),
    "loaded_bytes": MetricDef(COUNTER, "Bytes of KV loaded into the engine's cache."),
    "saved_tokens": MetricDef(COUNTER, "Tokens whose KV was stored (host tier)."),
    "saved_bytes": MetricDef(COUNTER, "Bytes of KV stored (host tier)."),
    "store_skipped_chunks": MetricDef(COUNTER, "Chunks not stored because host memory was full."),
    "retrieve_misses": MetricDef(
        COUNTER, "Retrievals that found fewer chunks than their lookup (evicted or bad)."
    ),
    # Storage manager, per tier
    "hit_chunks": MetricDef(COUNTER, "Chunks read, by the tier that had them.", tiered=True),
    "tier_stored_chunks": MetricDef(COUNTER, "Chunks written to a lower tier.", tiered=True),
    "evictions": MetricDef(COUNTER, "Chunks evicted, by tier.", tiered=True),
    "corrupt_payloads": MetricDef(
        COUNTER, "Stored payloads that failed their checks (served as misses).", tiered=True
    ),
    "rejected_payloads": MetricDef(
        COUNTER, "Sealed payloads that did not authenticate (foreign or tampered).", tiered=True
    ),
    "tier_errors": MetricDef(
        COUNTER, "Failed tier operations (I/O errors, Redis errors), by tier.", tiered=True
    ),
    "redis_reconnects": MetricDef(
        COUNTER,
        "Connections to a Redis server opened again after one to it failed (one per "
        "failure: a restart, a reset link), by tier.",
        tiered=True,
    ),
    "write_failures": MetricDef(COUNTER, "Chunks a lower tier failed to write.", tiered=True),
    "write_queue_drops": MetricDef(
        COUNTER, "Chunks not written to lower tiers because the write queue was full or closing."
    ),
    "prefetched_chunks": MetricDef(COUNTER, "Chunks brought into host memory by prefetches."),
    "host_arena_used_bytes": MetricDef(GAUGE, "Bytes allocated in the host-memory arena."),
    "host_arena_capacity_bytes": MetricDef(
        GAUGE, "Usable bytes of the host-memory arena (grows while it is pinned)."
    ),
    "host_arena_target_bytes": MetricDef(GAUGE, "Configured size of the host-memory arena."),
    "tier_used_bytes": MetricDef(GAUGE, "Bytes a tier indexes (host memory, disk).", tiered=True),
    "node_used_bytes": MetricDef(
        GAUGE,
        "Bytes in the node tier of the whole host (every process, model and rank sharing its "
        "directory), at this process's last rescan.",
    ),
    "node_chunks": MetricDef(
        GAUGE, "Chunk files in the node tier of the whole host, at this process's last rescan."
    ),
    # vLLM connector (worker side)
    "load_failed_blocks": MetricDef(
        COUNTER, "Blocks a load could not fill (reported to vLLM as load errors)."
    ),
    "loads_without_hold": MetricDef(
        COUNTER, "Loads whose lookup hold had expired (they read the tiers again)."
    ),
    "save_errors": MetricDef(COUNTER, "Save jobs that failed."),
    "saves_abandoned": MetricDef(
        COUNTER, "Times unfinished saves were abandoned before block reuse."
    ),
    "verify_chunks": MetricDef(
        COUNTER, "Stored chunks a verification found equal to the KV vLLM recomputed."
    ),
    "verify_mismatches": MetricDef(
        COUNTER,
        "Stored chunks a verification found wrong (removed; their tier quarantined), by the "
        "tier that served them.",
        tiered=True,
    ),
    "hold_expiries": MetricDef(COUNTER, "Lookup holds released unused after their time limit."),
    "lookup_seconds": MetricDef(HISTOGRAM, "Time a worker took to answer one lookup."),
    "load_seconds": MetricDef(HISTOGRAM, "Time of one request's load, end to end."),
    "save_seconds": MetricDef(HISTOGRAM, "Time of one save job on the saver thread."),
    "worker_seconds": MetricDef(
        HISTOGRAM,
        "Time kvtier's hooks took on a worker's forward thread in one step (loads started and "
        "finished, saves handed to the saver, finished requests, the report to the scheduler).",
    ),
    "worker_cpu_seconds": MetricDef(
        HISTOGRAM,
        "CPU time kvtier's hooks used on a worker's forward thread in one step (worker_seconds "
        "without the time the thread waited for a core or the GIL).",
    ),
    "background_cpu_seconds": MetricDef(
        COUNTER,
        "CPU time used by kvtier's own threads in a worker's process (tier writers, checksums, "
        "disk and Redis readers, probes, the loader and saver), read at most once a second.",
    ),
    # vLLM connector (scheduler side)
    "scheduler_seconds": MetricDef(
        HISTOGRAM, "Time kvtier's hooks took in one scheduler step (index lookups, metadata)."
    ),
    "scheduler_cpu_seconds": MetricDef(
        HISTOGRAM,
        "CPU time kvtier's hooks used in one scheduler step (scheduler_seconds without the "
        "time the thread waited for a core or the GIL).",
    ),
    "lookup_failures": MetricDef(
        COUNTER, "Lookups the scheduler could not complete (channel error or timeout: a miss)."
    ),
    "verify_requests": MetricDef(
        COUNTER, "Requests with a hit sampled for verification (computed instead of loaded)."
    ),
    "verify_tokens": MetricDef(
        COUNTER, "Prefill tokens verified requests computed instead of loading (the cost)."
    ),
}

# StorageStats names ``<tier>.<event>`` -> metric.
_TIER_EVENTS = {
    "hits": "hit_chunks",
    "stored": "tier_stored_chunks",
    "evicted": "evictions",
    "corrupt": "corrupt_payloads",
    "sealed_rejected": "rejected_payloads",
    "errors": "tier_errors",
    "write_failed": "write_failures",
    "reconnects": "redis_reconnects",
}
# Untiered StorageStats names -> metric.
_EVENTS = {
    "write_queue.dropped": "write_queue_drops",
    "write_queue.dropped_at_close": "write_queue_drops",
    "prefetch.chunks": "prefetched_chunks",
}

Values = dict[str, dict[str, float]]


def _add(out: Values, name: str, value: float, tier: str = "") -> None:
    per = out.setdefault(name, {})
    per[tier] = per.get(tier, 0) + value


def storage_values(storage: Any, out: Values) -> None:
    """Add a storage manager's counters (its ``stats.snapshot()``, if it has one) and usage
    gauges to ``out``."""
    stats = getattr(storage, "stats", None)
    snapshot = stats.snapshot() if stats is not None and hasattr(stats, "snapshot") else {}
    for name, n in snapshot.items():
        if name in _EVENTS:
            _add(out, _EVENTS[name], n)
            continue
        tier, _, event = name.rpartition(".")
        if tier and event in _TIER_EVENTS and "." not in tier:
            _add(out, _TIER_EVENTS[event], n, tier)
    arena = getattr(storage, "arena", None)
    if arena is not None:
        out["host_arena_used_bytes"] = {"": arena.used_bytes}
        out["host_arena_capacity_bytes"] = {"": arena.capacity}
        out["host_arena_target_bytes"] = {"": arena.target_bytes}
    for tier in getattr(storage, "tiers", ()):
        used = getattr(tier, "used_bytes", None)
        if isinstance(used, int):
            out.setdefault("tier_used_bytes", {})[str(tier.name)] = used
        node = getattr(tier, "node_usage", None)
        if node is not None:
            out["node_used_bytes"], out["node_chunks"] = {"": node[0]}, {"": node[1]}


def engine_values(engine: CacheEngine) -> Values:
    """Cumulative counters and current gauges of ``engine`` (see the module docstring)."""
    s = engine.stats
    per_token = engine.layout.bytes_per_token()
    out: Values = {
        "lookups": {"": s.lookups},
        "loaded_tokens": {"": s.retrieved_tokens},
        "loaded_bytes": {"": s.retrieved_tokens * per_token},
        "saved_tokens": {"": s.stored_tokens},
        "saved_bytes": {"": s.stored_tokens * per_token},
        "store_skipped_chunks": {"": s.store_skipped_chunks},
        "retrieve_misses": {"": s.retrieve_misses},
        "lookup_hit_tokens": dict(engine.hit_tokens_by_tier()),
    }
    storage_values(engine.storage, out)
    return out


class EngineCollector:
    """A ``prometheus_client`` collector of one ``CacheEngine``'s ``METRICS`` (no histograms:
    those are observed by the vLLM connector). Series are named ``<prefix><metric>`` with a
    ``model`` label (``model`` given here, default the engine's model identity) and ``tier``
    where the metric has one."""

    def __init__(
        self, engine: CacheEngine, *, prefix: str = "kvtier_", model: str | None = None
    ) -> None:
        self.engine = engine
        self.prefix = prefix
        self.model = model if model is not None else engine.keys.model

    def describe(self) -> Iterator[Any]:
        return iter(())  # values are read at collect time; nothing is checked at registration

    def collect(self) -> Iterator[Any]:
        try:
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        except ImportError as e:  # pragma: no cover - the optional extra is missing
            raise ImportError(
                "EngineCollector needs prometheus-client: install kvtier-core[metrics]"
            ) from e
        values = engine_values(self.engine)
        for name, spec in METRICS.items():
            if spec.kind == HISTOGRAM or name not in values:
                continue
            labels = ["model", "tier"] if spec.tiered else ["model"]
            family_cls = CounterMetricFamily if spec.kind == COUNTER else GaugeMetricFamily
            family = family_cls(self.prefix + name, spec.doc, labels=labels)
            for tier, value in sorted(values[name].items()):
                family.add_metric([self.model, tier] if spec.tiered else [self.model], value)
            yield family
