"""kvtier's metrics through vLLM's connector stats: ``vllm:kvtier_*`` series.

Each side of the connector keeps a ``StatsTracker``. ``get_kv_connector_stats`` (called by vLLM
after every step, on the worker and on the scheduler) returns a ``KVTierStats`` with what changed
since the last call: counter increments, gauges that moved, and latency samples. vLLM sums the
workers' stats and the scheduler's (``aggregate``), hands them to its loggers, and
``KVTierPromMetrics`` (registered through ``build_prom_metrics``) adds them to Prometheus series
named ``vllm:kvtier_<metric>`` for each of ``kvtier.core.metrics.METRICS``, labelled with vLLM's
own labels (model name, engine index) and ``tier`` where the metric has one.

Counters are summed over workers (with tensor parallelism each rank loads its own shard, so
tokens count once per rank and bytes add up to the whole); gauges keep the latest value seen.
The payload is plain ``dict[str, dict[str, number | list]]`` so it crosses vLLM's process
boundaries (msgpack) unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvtier.core.metrics import COUNTER, GAUGE, HISTOGRAM, LATENCY_BUCKETS, METRICS, Values

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PROM_PREFIX = "vllm:kvtier_"
_KINDS = {COUNTER: "counters", GAUGE: "gauges", HISTOGRAM: "samples"}
# Latency samples kept between two collections at most (vLLM collects after every step).
MAX_SAMPLES = 4096


def _empty() -> dict[str, Any]:
    return {"counters": {}, "gauges": {}, "samples": {}}


@dataclass
class KVTierStats(KVConnectorStats):
    """One interval's changes: ``data = {"counters": {metric: {tier: n}}, "gauges": {...},
    "samples": {metric: {tier: [seconds, ...]}}}`` (tier ``""`` for untiered metrics)."""

    def __post_init__(self) -> None:
        for part in ("counters", "gauges", "samples"):
            self.data.setdefault(part, {})

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        od = other.data
        for name, per in od.get("counters", {}).items():
            mine = self.data["counters"].setdefault(name, {})
            for tier, n in per.items():
                mine[tier] = mine.get(tier, 0) + n
        for name, per in od.get("gauges", {}).items():
            self.data["gauges"].setdefault(name, {}).update(per)
        for name, per in od.get("samples", {}).items():
            mine = self.data["samples"].setdefault(name, {})
            for tier, xs in per.items():
                mine.setdefault(tier, []).extend(xs)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for part in ("counters", "gauges"):
            for name, per in self.data[part].items():
                for tier, v in per.items():
                    out[f"{name}[{tier}]" if tier else name] = v
        for name, per in self.data["samples"].items():
            for tier, xs in per.items():
                key = f"{name}[{tier}]" if tier else name
                out[f"{key}_count"] = len(xs)
                out[f"{key}_avg"] = round(sum(xs) / len(xs), 6) if xs else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "gauges", "samples"))


class Counters:
    """Named counters bumped from several threads (the worker's loads, saves and resets)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._values[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def values(self, names: tuple[str, ...]) -> Values:
        """``names``' values as ``StatsTracker.delta`` takes them."""
        now = self.snapshot()
        return {k: {"": now[k]} for k in names}


class StepTimer:
    """kvtier's time inside each vLLM step on one thread, observed as ``<name>_seconds`` (wall
    time) and ``<name>_cpu_seconds`` (the thread's CPU time: the wall time less what the thread
    spent waiting for a core or the GIL, which other threads hold). ``name`` is ``scheduler``
    (vLLM's scheduler thread) or ``worker`` (a worker's forward thread)."""

    def __init__(self, metrics: StatsTracker, name: str) -> None:
        self._metrics = metrics
        self._wall_name, self._cpu_name = f"{name}_seconds", f"{name}_cpu_seconds"
        self._seconds = 0.0
        self._cpu_seconds = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the time spent inside into this step's observations."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._cpu_seconds += time.thread_time() - c0
            self._seconds += time.perf_counter() - t0

    def end_step(self) -> None:
        """Record kvtier's time in the step that just ended."""
        self._metrics.observe(self._wall_name, self._seconds)
        self._metrics.observe(self._cpu_name, self._cpu_seconds)
        self._seconds = self._cpu_seconds = 0.0


class StatsTracker:
    """Turns cumulative values (``kvtier.core.metrics.engine_values`` and the connector's own
    counters) into per-interval ``KVTierStats``; collects latency samples (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: Values = {}
        self._samples: dict[str, dict[str, list[float]]] = {}
        self._dropped_samples = 0

    def observe(self, name: str, seconds: float, tier: str = "") -> None:
        with self._lock:
            per = self._samples.setdefault(name, {}).setdefault(tier, [])
            if len(per) < MAX_SAMPLES:
                per.append(seconds)
            else:
                self._dropped_samples += 1

    def delta(self, values: Values) -> KVTierStats | None:
        """What changed since the last call (None when nothing did)."""
        data = _empty()
        with self._lock:
            for name, per in values.items():
                spec = METRICS.get(name)
                if spec is None or spec.kind == HISTOGRAM:
                    continue
                last = self._last.setdefault(name, {})
                for tier, v in per.items():
                    before = last.get(tier, 0)
                    if spec.kind == COUNTER and v > before:
                        data["counters"].setdefault(name, {})[tier] = v - before
                    elif spec.kind == GAUGE and (v != before or tier not in last):
                        data["gauges"].setdefault(name, {})[tier] = v
                    last[tier] = v
            data["samples"], self._samples = self._samples, {}
        stats = KVTierStats(data=data)
        return None if stats.is_empty() else stats


class KVTierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_*`` Prometheus series, fed from ``KVTierStats`` payloads."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        self._bound: dict[tuple[int, str, str], Any] = {}
        for name, spec in METRICS.items():
            labels = [*labelnames, "tier"] if spec.tiered else list(labelnames)
            kwargs: dict[str, Any] = {
                "name": PROM_PREFIX + name,
                "documentation": spec.doc,
                "labelnames": labels,
            }
            if spec.kind == COUNTER:
                cls: Any = self._counter_cls
            elif spec.kind == GAUGE:
                cls = self._gauge_cls
                kwargs["multiprocess_mode"] = "mostrecent"
            else:
                cls = self._histogram_cls
                kwargs["buckets"] = LATENCY_BUCKETS
            self._families[name] = cls(**kwargs)
        # Untiered series exist (at 0) from the start, as vLLM's own do.
        for engine_idx in per_engine_labelvalues:
            for name, spec in METRICS.items():
                if not spec.tiered:
                    self._metric(name, "", engine_idx)

    def _metric(self, name: str, tier: str, engine_idx: int) -> Any:
        key = (engine_idx, name, tier)
        m = self._bound.get(key)
        if m is None:
            values = list(self.per_engine_labelvalues[engine_idx])
            if METRICS[name].tiered:
                values.append(tier)
            m = self._bound[key] = self._families[name].labels(*values)
        return m

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per in transfer_stats_data.get("counters", {}).items():
            if name in METRICS:
                for tier, n in per.items():
                    self._metric(name, tier, engine_idx).inc(n)
        for name, per in transfer_stats_data.get("gauges", {}).items():
            if name in METRICS:
                for tier, v in per.items():
                    self._metric(name, tier, engine_idx).set(v)
        for name, per in transfer_stats_data.get("samples", {}).items():
            if name in METRICS:
                for tier, xs in per.items():
                    m = self._metric(name, tier, engine_idx)
                    for x in xs:
                        m.observe(x)
