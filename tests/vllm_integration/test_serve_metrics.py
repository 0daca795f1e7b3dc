"""kvtier's metrics in a real ``vllm serve``'s ``/metrics``, scraped over HTTP.

One OpenAI server (vLLM CPU, default multiprocess mode: front end + EngineCore) with
KVTierConnector on host memory + disk and vLLM's own prefix cache off, so a repeated prompt is
kvtier's hit. The same prompt goes twice through ``/v1/completions``; ``/metrics`` is parsed with
``prometheus_client``'s parser and every number is checked against what the test made happen
(one full hit: ``FULL_HIT`` tokens), never against a timing. The server's process group is
killed at the end, whatever happens.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

# Block size 32: a 700-token prompt's repeat loads 672 tokens (the last one is always recomputed).
PROMPT = [random.Random(2468).randrange(3, 3000) for _ in range(700)]
FULL_HIT = (len(PROMPT) - 1) // 32 * 32
REQUEST_TIMEOUT_S = 180.0
METRICS_WAIT_S = 60.0


def scrape(server) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(server.metrics())
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, lab), v in samples.items()
        if n == name and all(dict(lab).get(k) == x for k, x in labels.items())
    )


def wait_for(server, name: str, at_least: float, **labels: str) -> dict:
    """Scrape until ``name`` reaches ``at_least`` (stats reach the front end a step after the
    output), at most ``METRICS_WAIT_S``; returns the last scrape either way."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        samples = scrape(server)
        if value(samples, name, **labels) >= at_least or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def complete(server, prompt: list[int]) -> dict:
    out = server.post(
        "/v1/completions",
        {"model": "bench", "prompt": prompt, "max_tokens": 4, "temperature": 0.0},
        timeout_s=REQUEST_TIMEOUT_S,
    )
    return out["choices"][0]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serve_metrics_carry_kvtier_series(vllm_model_dir: Path, tmp_path: Path) -> None:
    from kvtier.bench.serve_launcher import ServeConfig, VLLMServer, server_args

    cfg = ServeConfig(
        model=str(vllm_model_dir), kv_cache_bytes=64 << 20, max_model_len=2048, max_num_seqs=4
    )
    kvtier = {
        "tiers": ["local_cpu", "local_disk"],
        "local_disk_path": str(tmp_path / "disk"),
        "local_cpu_size_gb": 0.25,
        "verify_fraction": 0.0,  # the repeat must be loaded, never sampled
    }
    args = [
        *server_args(
            "kvtier_eager", cfg, kvtier=kvtier, engine_id=f"kvtier-serve-test-{os.getpid()}"
        ),
        "--no-enable-prefix-caching",
    ]  # the repeat must be kvtier's hit, not vLLM's
    server = VLLMServer(
        str(vllm_model_dir),
        args,
        tmp_path / "server.log",
        env={"KVTIER_RUNTIME_DIR": str(tmp_path)},
        start_timeout_s=480,
    )
    with server:
        pgid = server.process.proc.pid
        first = complete(server, PROMPT)
        # The repeat is sent once the first request's KV is stored (saved_tokens counts it).
        cold = wait_for(server, "vllm:kvtier_saved_tokens_total", FULL_HIT)
        assert value(cold, "vllm:kvtier_saved_tokens_total") >= FULL_HIT
        assert value(cold, "vllm:kvtier_lookup_hit_tokens_total") == 0
        second = complete(server, PROMPT)
        warm = wait_for(server, "vllm:kvtier_loaded_tokens_total", FULL_HIT)

    assert second["text"] == first["text"]  # the hit gives what the cold run computed
    assert value(warm, "vllm:kvtier_lookup_hit_tokens_total", tier="local_cpu") == FULL_HIT
    assert value(warm, "vllm:kvtier_loaded_tokens_total") == FULL_HIT
    assert value(warm, "vllm:kvtier_loaded_bytes_total") > 0
    assert value(warm, "vllm:kvtier_saved_bytes_total") > 0
    assert value(warm, "vllm:kvtier_lookups_total") >= 2
    assert value(warm, "vllm:kvtier_load_failed_blocks_total") == 0
    assert value(warm, "vllm:kvtier_load_seconds_count") == 1
    # Every scheduler step observes kvtier's wall and CPU time.
    steps = value(warm, "vllm:kvtier_scheduler_seconds_count")
    assert steps > 0 and value(warm, "vllm:kvtier_scheduler_cpu_seconds_count") == steps
    # And every worker step, on the forward thread (CPU time at most the wall time).
    worker_steps = value(warm, "vllm:kvtier_worker_seconds_count")
    assert worker_steps > 0 and value(warm, "vllm:kvtier_worker_cpu_seconds_count") == worker_steps
    worker_wall = value(warm, "vllm:kvtier_worker_seconds_sum")
    assert 0 < value(warm, "vllm:kvtier_worker_cpu_seconds_sum") <= worker_wall * 1.1 + 1e-3
    # kvtier's own threads (the saver copied and the writers stored the cold prompt's chunks).
    assert value(warm, "vllm:kvtier_background_cpu_seconds_total") > 0
    # vLLM's own counters see the same hit as external and split it by source.
    assert value(warm, "vllm:external_prefix_cache_hits_total") == FULL_HIT
    assert value(warm, "vllm:prompt_tokens_cached_by_source_total", source="host") == FULL_HIT
    assert value(warm, "vllm:prefix_cache_hits_total") == 0
    # Bounded labels only: vLLM's model name and engine index, and the tier.
    kvtier_labels = {k for (n, lab) in warm if n.startswith("vllm:kvtier_") for k, _ in lab}
    assert kvtier_labels <= {"model_name", "engine", "tier", "le"}
    # The whole process group (front end, EngineCore) is gone once its children are reaped.
    assert group_gone(pgid, within_s=15.0)


def group_gone(pgid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_scrape_deltas_and_histogram_quantiles() -> None:
    """What ``kvtier bench serve`` reads from two scrapes: counter deltas with label filters and
    quantiles of the observations between them, interpolated inside a bucket."""
    pytest.importorskip("prometheus_client")
    from kvtier.bench.serve_plot import Scrape

    def page(hits: int, buckets: dict[str, int]) -> str:
        lines = [
            "# TYPE t counter",
            f't_total{{tier="local_cpu"}} {hits}',
            't_total{tier="local_disk"} 5',
            "# TYPE h histogram",
        ]
        lines += [f'h_bucket{{le="{le}"}} {n}' for le, n in buckets.items()]
        top = list(buckets.values())[-1]
        lines += [f"h_count {top}", "h_sum 1.0"]
        return "\n".join(lines) + "\n"

    before = Scrape.parse(page(10, {"0.001": 4, "0.01": 4, "0.1": 4, "+Inf": 4}))
    # 100 new observations: 50 at or under 1 ms, 40 in (1, 10] ms, 10 in (10, 100] ms.
    after = Scrape.parse(page(25, {"0.001": 54, "0.01": 94, "0.1": 104, "+Inf": 104}))
    assert after.delta(before, "t_total") == 15
    assert after.delta(before, "t_total", tier="local_disk") == 0
    assert after.quantile(before, "h", 0.5) == pytest.approx(0.001)
    assert after.quantile(before, "h", 0.7) == pytest.approx(0.001 + 0.009 * 20 / 40)
    assert after.quantile(before, "h", 0.99) == pytest.approx(0.01 + 0.09 * 9 / 10)
    assert after.quantile(after, "h", 0.5) is None  # nothing observed in between
    assert after.quantile(before, "missing", 0.5) is None


def test_the_first_request_of_each_prefix_is_found_in_the_clients_order(
    vllm_model_dir: Path,
) -> None:
    """``bench serve`` splits a run's mean TTFT into the first request of each prefix (a miss in
    every mode) and the repeats, from vLLM's own dataset rebuilt with the run's seed: exactly
    one first per prefix, in an order that differs from seed to seed (the client shuffles)."""
    pytest.importorskip("vllm", reason="kvtier bench serve drives vLLM")
    from kvtier.bench.serve_plan import Workload
    from kvtier.bench.serve_plot import Scrape
    from kvtier.bench.serve_report import row

    w = Workload("A", num_prefixes=5, per_prefix=3, prefix_len=64, suffix_len=8, output_len=2)
    first = w.first_of_prefix(str(vllm_model_dir), w.seed(4))
    assert len(first) == 15 and sum(first) == 5 and first[0]
    assert first != w.first_of_prefix(str(vllm_model_dir), w.seed(16))
    ttfts = [1.0 if f else 0.25 for f in first]
    res = {
        "mean_ttft_ms": 500.0,
        "p99_ttft_ms": 1000.0,
        "median_ttft_ms": 250.0,
        "mean_itl_ms": 10.0,
        "request_throughput": 1.0,
        "total_token_throughput": 100.0,
        "output_throughput": 10.0,
        "completed": 15,
        "failed": 0,
        "duration": 15.0,
        "ttfts": ttfts,
    }
    empty = Scrape.parse("")
    r = row("kvtier_eager", "A", 4, res, empty, empty, first)
    assert (r["ttft_first_mean_s"], r["ttft_repeat_mean_s"]) == (1.0, 0.25)
    r = row("kvtier_eager", "A", 4, res, empty, empty, first[:-1])  # not this run's requests
    assert r["ttft_first_mean_s"] is None and r["ttft_repeat_mean_s"] is None
    assert r["sched_cpu_share"] is None and r["worker_cpu_share"] is None  # no kvtier series

    assert r["background_cpu_share"] is None

    def cpu_page(sched: float, worker: float, background: float, steps: int) -> str:
        lines = []
        for name, total in (("scheduler", sched), ("worker", worker)):
            h = f"vllm:kvtier_{name}_cpu_seconds"
            lines += [f"# TYPE {h} histogram", f'{h}_bucket{{le="+Inf"}} {steps}']
            lines += [f"{h}_count {steps}", f"{h}_sum {total}"]
        c = "vllm:kvtier_background_cpu_seconds"
        lines += [f"# TYPE {c} counter", f"{c}_total {background}"]
        return "\n".join(lines) + "\n"

    # Over the run's 15 s: 0.3 s of kvtier CPU on the scheduler thread, 0.15 s on the worker's,
    # 0.75 s on kvtier's own threads.
    r = row(
        "kvtier_eager",
        "A",
        4,
        res,
        Scrape.parse(cpu_page(1.0, 2.0, 4.0, 10)),
        Scrape.parse(cpu_page(1.3, 2.15, 4.75, 90)),
        first,
    )
    assert r["sched_cpu_share"] == pytest.approx(0.02)
    assert r["worker_cpu_share"] == pytest.approx(0.01)
    assert r["background_cpu_share"] == pytest.approx(0.05)


def test_targets_are_judged_for_each_kvtier_mode() -> None:
    """Issue 57's targets for workload A and 19's for B, for every kvtier mode that ran (lazy
    offload too), from the rows' ratios to vLLM's prefix cache and LMCache's server; a missing
    row is 'not measured', never 'met'."""
    from kvtier.bench.serve_report import add_ratios, targets

    def row(workload: str, mode: str, c: int, ttft: float, rps: float, p99: float) -> dict:
        return {
            "workload": workload,
            "mode": mode,
            "concurrency": c,
            "ttft_mean_s": ttft,
            "ttft_p99_s": p99,
            "req_per_s": rps,
            "tok_per_s": rps * 100,
            "ttft_mean_vs_prefix_cache": ttft,
            "req_per_s_vs_prefix_cache": rps,
            "ttft_p99_vs_prefix_cache": p99,
        }

    rows = [
        row("A", "kvtier_eager", 16, 0.6, 2.0, 1.0),
        row("A", "lmcache", 16, 0.7, 1.7, 1.0),
        row("A", "kvtier_eager", 4, 0.6, 2.0, 1.0),
        row("A", "kvtier_lazy", 4, 0.4, 1.7, 1.0),
        row("A", "lmcache", 4, 0.5, 1.8, 1.0),
        row("B", "kvtier_eager", 1, 1.0, 0.95, 1.0),
        row("B", "kvtier_lazy", 1, 1.0, 0.99, 1.02),
    ]
    add_ratios(rows, "lmcache", ("kvtier_eager", "kvtier_lazy"))
    got = {t["target"]: t["met"] for t in targets(rows)}
    ahead = "ahead of lmcache by 10% on mean TTFT and req/s"
    assert got[f"A c=16 kvtier_eager {ahead}"] is True  # 0.86x TTFT, 1.18x req/s
    assert got["A c=16 kvtier_eager ttft_mean_vs_prefix_cache <= 0.65"] is True
    assert got["A c=4 kvtier_eager ttft_mean_vs_prefix_cache <= 0.5"] is False
    assert got["A c=4 kvtier_lazy ttft_mean_vs_prefix_cache <= 0.5"] is True
    assert got["A c=4 kvtier_lazy req_per_s_vs_prefix_cache >= 1.6"] is True
    assert got[f"A c=4 kvtier_lazy {ahead}"] is False  # 0.8x TTFT, but 0.94x req/s
    assert got[f"A c=4 kvtier_eager {ahead}"] is False  # 1.2x TTFT, 1.11x req/s
    assert got["A c=16 kvtier_lazy req_per_s_vs_prefix_cache >= 1.5"] is None
    assert got["B c=1 kvtier_eager req_per_s_vs_prefix_cache within 3%"] is False
    assert got["B c=1 kvtier_lazy req_per_s_vs_prefix_cache within 3%"] is True
    assert got["B c=1 kvtier_lazy ttft_p99_vs_prefix_cache within 3%"] is True


@pytest.mark.parametrize(
    ("tiers", "named"), [("local_cpu,bogus", "bogus"), ("local_cpu,local_cpu", "twice")]
)
def test_bench_serve_refuses_a_bad_tier_list_before_starting_anything(
    tiers: str, named: str, capsys, tmp_path: Path
) -> None:
    pytest.importorskip("vllm", reason="kvtier bench serve drives vLLM")
    from kvtier.bench.serve import main

    assert main(["--kvtier-tiers", tiers, "--cache-dir", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "--kvtier-tiers" in out and named in out
    assert not any(tmp_path.iterdir())  # no model built, no server started
