"""``kvtier demo``: long-document QA through vLLM with kvtier, cold vs warm, checked for equality.

1. Builds a small random Llama model and tokenizer under the user's cache dir if missing.
2. Starts vLLM with kvtier on the default tiers (host memory + a disk directory under the cache
   dir, wiped first so "cold" is cold) and vLLM's own prefix cache off, so every reuse is
   kvtier's. For each document: question 1 (cold: nothing cached) then question 2 (warm: the
   document is loaded from kvtier's host memory).
3. Restarts the engine (a new process, empty host memory) and asks question 1 again: the
   document now comes from the disk tier.
4. Runs every request on vLLM without kvtier and compares the greedy answers token for token.

Prints a table of time to first token, writes ``demo.json`` and ``demo.png`` (``--out``, default
``results/`` under the cache directory, so a run leaves the checkout as it was) and exits 1 if
any answer differs from the one without kvtier.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
from pathlib import Path
from typing import Any

from kvtier.core.config import default_cache_dir
from kvtier.vllm_integration.model import ModelSpec, build_model
from kvtier.vllm_integration.workload import (
    Engine,
    Request,
    Result,
    build_requests,
    require_extras,
    results_dir,
)

DEMO_MODEL = ModelSpec(
    hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1024
)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", help="directory for demo.json and demo.png (default: CACHE_DIR/results)"
    )
    p.add_argument("--docs", type=int, default=4, help="number of documents (default 4)")
    p.add_argument(
        "--doc-tokens", type=int, default=3000, help="tokens per document (default 3000)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="answer length (default 16)")
    p.add_argument(
        "--cache-dir",
        default=os.path.join(default_cache_dir(), "demo"),
        help="model and disk-tier directory (default ~/.cache/kvtier/demo)",
    )
    return p.parse_args(argv)


def _quiet() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("vllm").setLevel(logging.WARNING)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    require_extras()
    _quiet()
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    cache = Path(args.cache_dir).expanduser()
    model_dir = cache / "model"
    disk_dir = cache / "disk"
    with console.status("building the demo model (once)"):
        build_model(model_dir, DEMO_MODEL)
    shutil.rmtree(disk_dir, ignore_errors=True)
    kvtier_cfg = {"local_disk_path": str(disk_dir), "local_cpu_size_gb": 1.0}

    answers: dict[str, dict[tuple[int, int], Result]] = {}
    by_tier: dict[str, dict[str, int]] = {}  # phase -> tier -> hit tokens, from vLLM's metrics
    with Progress(console=console, transient=False) as progress:
        phases = [
            ("kvtier", kvtier_cfg, "both"),
            ("kvtier after restart", kvtier_cfg, "first"),
            ("vLLM without kvtier", None, "both"),
        ]
        docs: list[list[Request]] = []
        for name, cfg, which in phases:
            task = progress.add_task(f"{name}: starting vLLM", total=None)
            engine = Engine(
                str(model_dir), kvtier=cfg, max_model_len=max(4096, args.doc_tokens + 256)
            )
            try:
                if not docs:
                    docs = build_requests(engine.tokenizer, args.docs, args.doc_tokens)
                reqs = [r for d in docs for r in (d if which == "both" else d[:1])]
                engine.warm_up(args.doc_tokens)
                progress.update(task, description=name, total=len(reqs), completed=0)
                got = answers.setdefault(name, {})
                for r in reqs:
                    got[(r.doc, r.question)] = engine.run(r.tokens, args.max_tokens)
                    progress.advance(task)
                if not engine.flush():
                    console.print("[yellow]kvtier did not finish writing to disk in time")
                if cfg is not None:
                    by_tier[name] = engine.hit_tokens_by_tier()
            finally:
                engine.close()

    kv, restart, base = (answers[n] for n, _, _ in phases)
    rows = []
    for d in docs:
        q1, q2 = d[0], d[1]
        rows.append(
            {
                "doc": q1.doc,
                "prompt_tokens": len(q2.tokens),
                "ttft_no_kvtier_s": base[(q2.doc, 1)].ttft_s,
                "ttft_cold_s": kv[(q1.doc, 0)].ttft_s,
                "ttft_warm_s": kv[(q2.doc, 1)].ttft_s,
                "ttft_restart_s": restart[(q1.doc, 0)].ttft_s,
                "hit_tokens_warm": kv[(q2.doc, 1)].loaded_tokens,
                "hit_tokens_restart": restart[(q1.doc, 0)].loaded_tokens,
            }
        )
    mismatches = [
        {"phase": name, "doc": key[0], "question": key[1] + 1}
        for name, got in (("kvtier", kv), ("kvtier after restart", restart))
        for key, res in got.items()
        if res.tokens != base[key].tokens
    ]
    warm_prompt = sum(len(d[1].tokens) for d in docs)
    summary = {
        "ttft_no_kvtier_s": statistics.mean(r["ttft_no_kvtier_s"] for r in rows),
        "ttft_cold_s": statistics.mean(r["ttft_cold_s"] for r in rows),
        "ttft_warm_s": statistics.mean(r["ttft_warm_s"] for r in rows),
        "ttft_restart_s": statistics.mean(r["ttft_restart_s"] for r in rows),
        "hit_rate_warm": sum(r["hit_tokens_warm"] for r in rows) / warm_prompt,
        "hit_rate_restart": sum(r["hit_tokens_restart"] for r in rows)
        / sum(len(d[0].tokens) for d in docs),
    }
    summary["warm_over_cold"] = summary["ttft_warm_s"] / summary["ttft_cold_s"]

    table = Table(title="kvtier demo: time to first token (s), one request at a time")
    for col in (
        "doc",
        "prompt tokens",
        "no kvtier",
        "kvtier cold",
        "kvtier warm (memory)",
        "after restart (disk)",
        "hit tokens",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["doc"]),
            str(row["prompt_tokens"]),
            f"{row['ttft_no_kvtier_s']:.3f}",
            f"{row['ttft_cold_s']:.3f}",
            f"{row['ttft_warm_s']:.3f}",
            f"{row['ttft_restart_s']:.3f}",
            f"{row['hit_tokens_warm']} / {row['hit_tokens_restart']}",
        )
    table.add_row(
        "mean",
        "",
        f"{summary['ttft_no_kvtier_s']:.3f}",
        f"{summary['ttft_cold_s']:.3f}",
        f"{summary['ttft_warm_s']:.3f}",
        f"{summary['ttft_restart_s']:.3f}",
        f"{summary['hit_rate_warm']:.0%} / {summary['hit_rate_restart']:.0%}",
    )
    console.print(table)
    console.print(
        f"warm/cold TTFT: {summary['warm_over_cold']:.3f}; answers identical to vLLM "
        f"without kvtier: {'yes' if not mismatches else 'NO'}"
    )
    console.print(
        "hit tokens by tier (vllm:kvtier_lookup_hit_tokens): "
        + "; ".join(
            f"{phase}: " + (", ".join(f"{t} {n}" for t, n in tiers.items()) or "none")
            for phase, tiers in by_tier.items()
        )
    )

    out = results_dir(args.out or os.path.join(args.cache_dir, "results"))
    report: dict[str, Any] = {
        "model": {"path": str(model_dir), **DEMO_MODEL.__dict__},
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "rows": rows,
        "summary": summary,
        "mismatches": mismatches,
        "hit_tokens_by_tier": by_tier,
    }
    (out / "demo.json").write_text(json.dumps(report, indent=2))
    _chart(rows, out / "demo.png")
    console.print(f"wrote {out / 'demo.json'} and {out / 'demo.png'}")
    if mismatches:
        console.print(f"[red]answers differ from vLLM without kvtier: {mismatches}")
        return 1
    return 0


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("no kvtier", "ttft_no_kvtier_s"),
        ("kvtier cold", "ttft_cold_s"),
        ("kvtier warm (memory)", "ttft_warm_s"),
        ("after restart (disk)", "ttft_restart_s"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        xs = [r["doc"] + i * width for r in rows]
        ax.bar(xs, [r[key] for r in rows], width, label=label)
    ax.set_xticks([r["doc"] + 0.4 - width / 2 for r in rows])
    ax.set_xticklabels([f"doc {r['doc']}" for r in rows])
    ax.set_ylabel("time to first token (s)")
    ax.set_title("kvtier demo: long-document QA on vLLM (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
