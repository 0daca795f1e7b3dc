"""What ``kvtier bench serve`` reads from a server's ``/metrics`` and how it draws ``serve.png``.

``Scrape`` parses Prometheus text (``prometheus_client``'s parser) into samples;
``Scrape.delta`` and ``Scrape.quantile`` compare two scrapes of the same server taken before and
after a run, so every number covers that run only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Scrape:
    """The samples of one ``/metrics`` page: ``(name, sorted label pairs) -> value``."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
        return cls(out)

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        return sum(
            v
            for (n, lab), v in self.samples.items()
            if n == name and all(dict(lab).get(k) == x for k, x in labels.items())
        )

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, lab), v in self.samples.items():
            if n == name and label in dict(lab):
                key = dict(lab)[label]
                out[key] = out.get(key, 0.0) + v
        return out

    def delta(self, before: Scrape, name: str, **labels: str) -> float:
        return self.total(name, **labels) - before.total(name, **labels)

    def quantile(self, before: Scrape, histogram: str, q: float) -> float | None:
        """``q`` of the observations ``histogram`` got between ``before`` and this scrape, by
        linear interpolation inside the bucket that holds it (as Prometheus'
        ``histogram_quantile``); None when the histogram is absent or got none."""
        name = histogram + "_bucket"
        if not self.has(name):
            return None
        now, then = self.by_label(name, "le"), before.by_label(name, "le")
        buckets = sorted(
            ((float(le), now[le] - then.get(le, 0.0)) for le in now), key=lambda b: b[0]
        )
        if not buckets or buckets[-1][1] <= 0:
            return None
        rank = q * buckets[-1][1]
        lower, below = 0.0, 0.0
        for upper, cumulative in buckets:
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower
                inside = cumulative - below
                frac = (rank - below) / inside if inside > 0 else 1.0
                return lower + (upper - lower) * frac
            lower, below = upper, cumulative
        return lower


def chart(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """Mean TTFT and request throughput against concurrency, one line per mode, a row per
    workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(len(workloads), 2, figsize=(10, 3.6 * len(workloads)), squeeze=False)
    for row, w in zip(axes, workloads, strict=True):
        rows = [r for r in results if r["workload"] == w]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["concurrency"], r) for r in rows if r["mode"] == mode)
            xs = [c for c, _ in pts]
            row[0].plot(xs, [r["ttft_mean_s"] for _, r in pts], marker="o", label=mode)
            row[1].plot(xs, [r["req_per_s"] for _, r in pts], marker="o", label=mode)
        for ax, what in zip(row, ("mean TTFT (s)", "requests / s"), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max concurrency")
            ax.set_ylabel(what)
            ax.set_title(f"workload {w}: {what}")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
