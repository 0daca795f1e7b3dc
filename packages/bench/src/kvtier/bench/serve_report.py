"""``kvtier bench serve``'s results: one row per run (from vLLM's client and the server's
``/metrics``), ratios to vLLM's prefix cache, issue 19's and 57's targets, the console table.

Bytes moved: ``kvtier_saved_bytes`` is the KV kvtier copied off the device during the run
(``vllm:kvtier_saved_bytes``), ``saved_bytes_per_request`` that over the completed requests;
they compare the offload modes (``kvtier_eager`` copies every computed prompt, ``kvtier_lazy``
only what vLLM is about to evict).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from kvtier.bench.serve_plot import Scrape

SCHED_HISTOGRAM = "vllm:kvtier_scheduler_seconds"
SCHED_CPU_HISTOGRAM = "vllm:kvtier_scheduler_cpu_seconds"
WORKER_CPU_HISTOGRAM = "vllm:kvtier_worker_cpu_seconds"
BACKGROUND_CPU = "vllm:kvtier_background_cpu_seconds_total"
REFERENCE = "prefix_cache"
LIMIT = "prefix_cache_all"  # vLLM's prefix cache with KV memory for the whole working set
KVTIER_MODES = ("kvtier_eager", "kvtier_lazy")
# Row field -> name of its ratio to the reference mode (``<name>_vs_prefix_cache``).
RATIOS = {
    "ttft_mean_s": "ttft_mean",
    "ttft_p99_s": "ttft_p99",
    "req_per_s": "req_per_s",
    "tok_per_s": "tok_per_s",
}


def row(
    mode: str,
    workload: str,
    concurrency: int,
    res: dict[str, Any],
    before: Scrape,
    after: Scrape,
    first: list[bool] | None = None,
) -> dict[str, Any]:
    """One run's row: vLLM's client's result ``res`` (with ``--save-detailed``'s per-request
    ``ttfts``) and the server's metrics around it. ``first``: per request, whether it was the
    first of its prefix (``Workload.first_of_prefix``), to split the mean TTFT."""
    ttfts = res.get("ttfts") or []
    split: dict[str, float | None] = {"ttft_first_mean_s": None, "ttft_repeat_mean_s": None}
    if first is not None and len(first) == len(ttfts):
        for key, want in (("ttft_first_mean_s", True), ("ttft_repeat_mean_s", False)):
            xs = [t for t, f in zip(ttfts, first, strict=True) if f is want]
            split[key] = sum(xs) / len(xs) if xs else None
    prompt = after.delta(before, "vllm:prompt_tokens_total")
    cached = after.delta(before, "vllm:prompt_tokens_cached_total")
    external = after.delta(
        before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    step: dict[str, float | None] = {}
    for field, name in (
        ("sched", SCHED_HISTOGRAM),
        ("sched_cpu", SCHED_CPU_HISTOGRAM),
        ("worker_cpu", WORKER_CPU_HISTOGRAM),
    ):
        for q in (50, 99):
            seconds = after.quantile(before, name, q / 100)
            step[f"{field}_p{q}_ms"] = None if seconds is None else seconds * 1e3
    # kvtier's CPU time on vLLM's scheduler and forward threads, as a share of the run's wall
    # time: both threads run each step in turn, so this bounds what kvtier's hooks cost.
    for field, name in (("sched_cpu", SCHED_CPU_HISTOGRAM), ("worker_cpu", WORKER_CPU_HISTOGRAM)):
        used = after.delta(before, f"{name}_sum") if after.has(f"{name}_sum") else None
        step[f"{field}_share"] = used / res["duration"] if used is not None else None
    # kvtier's own threads (writers, checksums, readers, probes, loader, saver), summed over the
    # workers: CPU they took from the cores vLLM computes on.
    background = after.delta(before, BACKGROUND_CPU) if after.has(BACKGROUND_CPU) else None
    step["background_cpu_share"] = background / res["duration"] if background is not None else None
    hits = {
        tier: after.delta(before, "vllm:kvtier_lookup_hit_tokens_total", tier=tier)
        for tier in after.by_label("vllm:kvtier_lookup_hit_tokens_total", "tier")
    }
    saved_bytes = after.delta(before, "vllm:kvtier_saved_bytes_total")
    return {
        "workload": workload,
        "mode": mode,
        "concurrency": concurrency,
        "ttft_mean_s": res["mean_ttft_ms"] / 1e3,
        "ttft_p99_s": res["p99_ttft_ms"] / 1e3,
        "ttft_median_s": res["median_ttft_ms"] / 1e3,
        **split,
        "itl_mean_s": res["mean_itl_ms"] / 1e3,
        "req_per_s": res["request_throughput"],
        "tok_per_s": res["total_token_throughput"],
        "output_tok_per_s": res["output_throughput"],
        "completed": res["completed"],
        "failed": res["failed"],
        "duration_s": res["duration"],
        "hit_rate": cached / prompt if prompt else None,
        "external_hit_rate": external / prompt if prompt else None,
        "kvtier_hit_tokens": {t: n for t, n in hits.items() if n},
        "kvtier_loaded_tokens": after.delta(before, "vllm:kvtier_loaded_tokens_total"),
        "kvtier_saved_tokens": after.delta(before, "vllm:kvtier_saved_tokens_total"),
        "kvtier_saved_bytes": saved_bytes,
        # verification by recompute (verify_fraction): requests computed instead of loaded
        "kvtier_verify_requests": after.delta(before, "vllm:kvtier_verify_requests_total"),
        "kvtier_verify_tokens": after.delta(before, "vllm:kvtier_verify_tokens_total"),
        "saved_bytes_per_request": saved_bytes / res["completed"] if res["completed"] else None,
        "preemptions": after.delta(before, "vllm:num_preemptions_total"),
        **step,
    }


def add_ratios(
    results: list[dict[str, Any]], reference: str = REFERENCE, modes: tuple[str, ...] = ()
) -> None:
    """``<name>_vs_<reference>`` in every row of ``modes`` (all other modes when empty): its
    value over the ``reference`` mode's row of the same workload and concurrency."""
    ref = {(r["workload"], r["concurrency"]): r for r in results if r["mode"] == reference}
    for r in results:
        base = ref.get((r["workload"], r["concurrency"]))
        if base is None or r["mode"] == reference or (modes and r["mode"] not in modes):
            continue
        for key, name in RATIOS.items():
            if base[key]:
                r[f"{name}_vs_{reference}"] = r[key] / base[key]


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 57's targets (A) and issue 19's (B) for each kvtier mode that ran, each with what
    this run measured (None where a row is missing): a ratio's median over the rounds, and its
    ``range`` over them."""
    by = {(r["workload"], r["mode"], r["concurrency"]): r for r in results}
    modes = [m for m in KVTIER_MODES if any(r["mode"] == m for r in results)] or ["kvtier_eager"]
    out: list[dict[str, Any]] = []
    for mode in modes:
        out += _a_targets(by, mode) + _b_targets(by, results, mode)
    return out


def _a_targets(by: dict[tuple[str, str, int], dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for c, ttft_goal, rps_goal in ((4, 0.5, 1.6), (16, 0.65, 1.5)):
        k, lm = by.get(("A", mode, c)), by.get(("A", "lmcache", c))
        for key, goal, better in (
            ("ttft_mean_vs_prefix_cache", ttft_goal, "le"),
            ("req_per_s_vs_prefix_cache", rps_goal, "ge"),
        ):
            v = k.get(key) if k else None
            met = None if v is None else (v <= goal if better == "le" else v >= goal)
            out.append(
                {
                    "target": f"A c={c} {mode} {key} {'<=' if better == 'le' else '>='} {goal}",
                    "measured": v,
                    "range": k.get(f"{key}_range") if k else None,
                    "met": met,
                }
            )
        if c == 4:
            v = k.get(f"req_per_s_vs_{LIMIT}") if k else None
            out.append(
                {
                    "target": f"A c=4 {mode} req_per_s_vs_{LIMIT} >= 0.9",
                    "measured": v,
                    "range": k.get(f"req_per_s_vs_{LIMIT}_range") if k else None,
                    "met": None if v is None else v >= 0.9,
                }
            )
        if k and lm:
            # Ratios to LMCache's server taken within each round (medians over the rounds).
            ttft, rps = k.get("ttft_mean_vs_lmcache"), k.get("req_per_s_vs_lmcache")
            out.append(
                {
                    "target": f"A c={c} {mode} ahead of lmcache by 10% on mean TTFT and req/s",
                    "measured": {"ttft_mean_vs_lmcache": ttft, "req_per_s_vs_lmcache": rps},
                    "range": [
                        k.get("ttft_mean_vs_lmcache_range"),
                        k.get("req_per_s_vs_lmcache_range"),
                    ],
                    "met": None if ttft is None or rps is None else ttft <= 0.9 and rps >= 1.1,
                }
            )
    return out


def _b_targets(
    by: dict[tuple[str, str, int], dict[str, Any]], results: list[dict[str, Any]], mode: str
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for c in sorted({r["concurrency"] for r in results if r["workload"] == "B"}):
        k = by.get(("B", mode, c))
        for key, lo in (("req_per_s_vs_prefix_cache", 0.97), ("ttft_p99_vs_prefix_cache", None)):
            v = k.get(key) if k else None
            met = None if v is None else (v >= 0.97 if lo else v <= 1.03)
            out.append(
                {
                    "target": f"B c={c} {mode} {key} within 3%",
                    "measured": v,
                    "range": k.get(f"{key}_range") if k else None,
                    "met": met,
                }
            )
    return out


def source_revision() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes) when kvtier runs from one."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty=+dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def table(console: Any, results: list[dict[str, Any]], skipped: dict[str, str]) -> None:
    from rich.table import Table

    t = Table(title="kvtier bench serve (vLLM's own client)")
    for col in (
        "wl",
        "mode",
        "conc",
        "TTFT mean s",
        "TTFT p99 s",
        "TTFT 1st/rep s",
        "ITL ms",
        "req/s",
        "tok/s",
        "hit rate",
        "TTFT/pc",
        "req/s/pc",
        "req/s/all",
        "sched p50/p99 ms",
        "sched CPU p50/p99 ms",
        "kvtier CPU % sched/worker/bg",
        "saved KiB/req",
    ):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(
            r["workload"],
            r["mode"],
            str(r["concurrency"]),
            f"{r['ttft_mean_s']:.3f}",
            f"{r['ttft_p99_s']:.3f}",
            f"{_fmt(r.get('ttft_first_mean_s'))}/{_fmt(r.get('ttft_repeat_mean_s'))}",
            f"{r['itl_mean_s'] * 1e3:.1f}",
            f"{r['req_per_s']:.2f}",
            f"{r['tok_per_s']:.0f}",
            "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}",
            _ratio(r, "ttft_mean_vs_prefix_cache"),
            _ratio(r, "req_per_s_vs_prefix_cache"),
            _ratio(r, f"req_per_s_vs_{LIMIT}"),
            _p50_p99(r, "sched"),
            _p50_p99(r, "sched_cpu"),
            _shares(r),
            _kib(r.get("saved_bytes_per_request")),
        )
    console.print(t)
    for mode, why in skipped.items():
        console.print(f"skipped {mode}: {why[:300]}")


def _p50_p99(r: dict[str, Any], name: str) -> str:
    """``p50/p99`` of a row's ``<name>_p50_ms`` and ``<name>_p99_ms`` ("-" when not measured)."""
    p50, p99 = r.get(f"{name}_p50_ms"), r.get(f"{name}_p99_ms")
    return "-" if p50 is None or p99 is None else f"{p50:.3f}/{p99:.3f}"


def _shares(r: dict[str, Any]) -> str:
    """``sched/worker/background`` CPU shares of the run's wall time, in percent ("-" when not
    measured)."""
    shares = [r.get(f"{k}_share") for k in ("sched_cpu", "worker_cpu", "background_cpu")]
    return "/".join("-" if x is None else f"{x * 100:.2f}" for x in shares)


def _ratio(r: dict[str, Any], key: str) -> str:
    """A ratio to the prefix cache, with its range over the rounds when there were several."""
    lo_hi = r.get(f"{key}_range") if r.get("rounds", 1) > 1 else None
    return _fmt(r.get(key)) + (f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi else "")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _kib(x: float | None) -> str:
    return "-" if x is None else f"{x / 1024:.0f}"
