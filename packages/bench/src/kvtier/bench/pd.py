"""``kvtier bench pd``: a prefill/decode pair sharing KV through Redis, against one instance.

The pair: a prefill ``vllm serve`` (kvtier, ``kv_role: kv_producer``) and a decode ``vllm serve``
(kvtier, ``kv_consumer``) on host memory + a private ``redis-server``, each bound to its own CPU
core, behind ``kvtier.vllm_integration.pd_proxy`` (vLLM's disaggregated-serving proxy pattern:
the prefill instance computes the prompt and announces what it stored, the decode instance loads it and
generates). The reference: one ``vllm serve`` with vLLM's own prefix cache on both cores. Both
are driven by vLLM's own client (``vllm bench serve``, the ``prefix_repetition`` dataset, the
same seed) at each ``--concurrency``; the table has TTFT, ITL and throughput, their ratios to the
reference, and how many answers are equal (greedy). Writes ``pd.json`` and ``pd.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.model import build_model
from kvtier.bench.serve_launcher import BenchClient, ServeConfig, VLLMServer, server_args
from kvtier.bench.serve_plan import BENCH_MODEL, WARMUP_SEED, Workload
from kvtier.bench.serve_plot import Scrape
from kvtier.bench.serve_process import Process, free_port, wait_http
from kvtier.bench.workload import cpu_kind, require_extras, results_dir
from kvtier.core.config import default_cache_dir

METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench pd", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4", help="comma-separated client concurrencies")
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--per-prefix", type=int, default=4, help="requests per prefix")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-mib", type=int, default=256, help="vLLM's KV cache per server")
    p.add_argument("--cache-dir", default=os.path.join(default_cache_dir(), "bench-pd"))
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--run-timeout-s", type=float, default=1200.0)
    return p.parse_args(argv)


def _env(cores: str) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _runs(
    name: str,
    url: str,
    scrape: Any,
    client: BenchClient,
    w: Workload,
    args: argparse.Namespace,
    model: str,
    logs: Path,
) -> list[dict[str, Any]]:
    """Warm up, then one ``vllm bench serve`` run per concurrency against ``url``."""
    warm = Workload("warm-up", 2, 2, w.prefix_len, w.suffix_len, 2)
    client.run(warm.argv(url, model, 2, WARMUP_SEED, logs / f"{name}-warm-up.json"), 600.0)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        result = logs / f"{name}-c{c}.json"
        before = scrape()
        client.run(w.argv(url, model, c, w.seed(c), result), args.run_timeout_s)
        time.sleep(1.0)  # the last step's stats reach the front end after its output
        after = scrape()
        res = json.loads(result.read_text())
        row = {"setup": name, "concurrency": c, **{m: res.get(m) for m in METRICS}}
        row["completed"], row["failed"] = res.get("completed"), res.get("failed")
        row["loaded_tokens"] = after.delta(before, "vllm:kvtier_loaded_tokens_total")
        row["texts"] = res.get("generated_texts", [])
        rows.append(row)
    return rows


def run_one(cfg: ServeConfig, w: Workload, args: argparse.Namespace, logs: Path) -> list[dict]:
    """The reference: one instance, vLLM's prefix cache, both cores."""
    with (
        BenchClient(logs / "client-one.log") as client,
        VLLMServer(
            cfg.model,
            server_args("prefix_cache", cfg),
            logs / "server-one.log",
            env=_env("0-1"),
            start_timeout_s=args.start_timeout_s,
        ) as server,
    ):
        scrape = lambda: Scrape.parse(server.metrics())  # noqa: E731
        return _runs("one instance", server.url, scrape, client, w, args, cfg.model, logs)


def run_pair(cfg: ServeConfig, w: Workload, args: argparse.Namespace, logs: Path) -> list[dict]:
    """The pair behind the proxy, sharing a private Redis."""
    from kvtier.bench.storage_redis_servers import PrivateRedis

    redis = PrivateRedis()
    try:
        kvtier = {
            "tiers": ["local_cpu", "redis"],
            "redis_url": redis.url,
            "local_cpu_size_gb": 0.5,
            "verify_fraction": 0.0,  # a consumer never samples; the producer never loads
        }
        with contextlib.ExitStack() as stack:
            servers = []
            for role, cores in (("kv_producer", "0"), ("kv_consumer", "1")):
                a = server_args(
                    "kvtier_eager", cfg, kvtier=kvtier, kv_role=role, engine_id=f"kvtier-pd-{role}"
                )
                log = logs / f"server-{role}.log"
                servers.append(
                    stack.enter_context(
                        VLLMServer(
                            cfg.model, a, log, env=_env(cores), start_timeout_s=args.start_timeout_s
                        )
                    )
                )
            prefill, decode = servers
            port = free_port()
            proxy = Process(
                [
                    sys.executable,
                    "-m",
                    "kvtier.vllm_integration.pd_proxy",
                    "--prefill",
                    prefill.url,
                    "--decode",
                    decode.url,
                    "--port",
                    str(port),
                ],
                logs / "proxy.log",
            )
            url = f"http://127.0.0.1:{port}"
            proxy.start_then(lambda: wait_http(proxy, url + "/health", 60.0, "the P/D proxy"))
            stack.callback(proxy.stop)
            client = stack.enter_context(BenchClient(logs / "client-pair.log"))
            scrape = lambda: Scrape.parse(decode.metrics())  # noqa: E731
            return _runs("prefill/decode", url, scrape, client, w, args, cfg.model, logs)
    finally:
        redis.close()


def main(argv: list[str]) -> int:
    args = parse(argv)
    require_extras()
    cache = Path(args.cache_dir).expanduser()
    model = str(build_model(cache / "model", BENCH_MODEL))
    w = Workload(
        "pd", args.num_prefixes, args.per_prefix, args.prefix_len, args.suffix_len, args.output_len
    )
    cfg = ServeConfig(
        model, args.kv_cache_mib << 20, max_model_len=args.prefix_len + args.suffix_len + 256
    )
    out = results_dir(args.out)
    logs = cache / "logs"
    one = run_one(cfg, w, args, logs)
    pair = run_pair(cfg, w, args, logs)
    for p, o in zip(pair, one, strict=True):
        for m in METRICS:
            if p.get(m) is not None and o.get(m):
                p[f"{m}_vs_one"] = p[m] / o[m]
        p["equal_answers"] = sum(a == b for a, b in zip(p["texts"], o["texts"], strict=False))
    rows = one + pair
    for r in rows:
        r.pop("texts", None)
    machine = f"{cpu_kind()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    report = {"machine": machine, "workload": vars(args), "rows": rows}
    (out / "pd.json").write_text(json.dumps(report, indent=2) + "\n")
    _table(rows)
    _chart(rows, out / "pd.png", machine)
    print(f"wrote {out / 'pd.json'} and {out / 'pd.png'}")
    print(f"the servers' and the clients' own output: {logs}")
    return 0 if all(not r.get("failed") for r in rows) else 1


def _table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'setup':<16}{'conc':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'tok/s':>8}"
        f"{'loaded':>8}{'equal':>7}"
    )
    for r in rows:
        print(
            f"{r['setup']:<16}{r['concurrency']:>5}{r['median_ttft_ms'] or 0:>9.0f}m"
            f"{r['p99_ttft_ms'] or 0:>9.0f}m{r['median_itl_ms'] or 0:>8.1f}m"
            f"{r['output_throughput'] or 0:>8.1f}{int(r['loaded_tokens']):>8}"
            f"{r.get('equal_answers', ''):>7}"
        )


def _chart(rows: list[dict[str, Any]], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, (metric, label) in zip(
        axes,
        (
            ("median_ttft_ms", "TTFT p50 (ms)"),
            ("median_itl_ms", "ITL p50 (ms)"),
            ("output_throughput", "output tok/s"),
        ),
        strict=True,
    ):
        for setup in ("one instance", "prefill/decode"):
            mine = [r for r in rows if r["setup"] == setup]
            ax.plot([r["concurrency"] for r in mine], [r[metric] or 0 for r in mine], "o-")
        ax.set_xlabel("concurrency")
        ax.set_title(label)
    axes[0].legend(["one instance, vLLM prefix cache", "prefill/decode via kvtier + Redis"])
    fig.suptitle(f"kvtier bench pd: vLLM CPU, {machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
