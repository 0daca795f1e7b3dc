"""``kvtier demo``: long-document QA through vLLM with kvtier, cold vs warm, checked for equality.

1. Builds a small random Llama model and tokenizer under the user's cache dir if missing.
2. Starts vLLM with kvtier on the default tiers (host memory + a disk directory under the cache
   dir, wiped first so "cold" is cold) and vLLM's own prefix cache off, so every reuse is
   kvtier's. For each document: question 1 (cold: nothing cached) then question 2 (warm: the
   document is loaded from kvtier's host memory).
3. Restarts the engine (a new process, empty host memory) and asks question 1 again: the
   document now comes from the disk tier.
4. The check: the same requests in the same order through vLLM with its own prefix cache and no
   kvtier (question 1, question 2, and after every document question 1 again), greedy answers
   compared token for token. A hit computes only the prompt's suffix after the cached blocks;
   vLLM's prefix cache hitting the same blocks computes exactly that, so any difference is
   kvtier's. (A full recompute is not the reference: on CPUs where vLLM picks its AMX kernels a
   short suffix after a hit is not bit-identical to one long prefill, and vLLM's own prefix
   cache changes some greedy answers against it.)
5. For information, the same requests through vLLM without any cache (a full recompute): its
   time to first token, and how many answers of kvtier and of vLLM's prefix cache differ from it.

Prints a table of time to first token, writes ``demo.json`` and ``demo.png`` (``--out``, default
``results/`` under the cache directory, so a run leaves the checkout as it was) and exits 1 if
any kvtier answer differs from vLLM's prefix cache on the same request.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.model import ModelSpec, build_model
from kvtier.bench.screen import add_verbose, logged
from kvtier.bench.workload import (
    BLOCK_SIZE,
    Engine,
    Request,
    Result,
    build_requests,
    cpu_kind,
    require_extras,
    results_dir,
)
from kvtier.core.config import default_cache_dir

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
    add_verbose(p)
    # The negative control of the demo's test: zeros are stored over what every hit loads.
    p.add_argument("--corrupt-loaded-kv", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _quiet() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("vllm").setLevel(logging.WARNING)


# The requests of a document: question 1, question 2, and question 1 sent again later.
Q1, Q2, AGAIN = "q1", "q2", "q1 again"
KVTIER, RESTART, PREFIX_CACHE, RECOMPUTE = (
    "kvtier",
    "kvtier after restart",
    "vLLM prefix cache",
    "vLLM without cache",
)


@dataclass(frozen=True)
class Phase:
    name: str
    kvtier: bool
    prefix_caching: bool
    labels: tuple[str, ...]  # which of a document's requests it sends, in order
    again_after_all: bool = False  # AGAIN once every document's Q1 and Q2 ran


PHASES = (
    Phase(KVTIER, True, False, (Q1, Q2)),
    Phase(RESTART, True, False, (AGAIN,)),  # a new engine: the hits come from disk
    Phase(PREFIX_CACHE, False, True, (Q1, Q2), again_after_all=True),
    Phase(RECOMPUTE, False, False, (Q1, Q2)),
)


def _schedule(phase: Phase, docs: list[list[Request]]) -> list[tuple[str, Request]]:
    steps = [(label, d[1] if label == Q2 else d[0]) for d in docs for label in phase.labels]
    if phase.again_after_all:
        steps += [(AGAIN, d[0]) for d in docs]
    return steps


def _attention_isa(head_size: int) -> str:
    """The attention ISA vLLM CPU selects for the demo's bf16 KV in blocks of 32."""
    try:
        import torch
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(torch.bfloat16, BLOCK_SIZE, head_size))
    except Exception as e:  # a private vLLM function: say so rather than fail the demo
        return f"unknown ({type(e).__name__})"


def main(argv: list[str]) -> int:
    args = _parse(argv)
    require_extras()
    _quiet()
    if args.corrupt_loaded_kv:
        # The worker gets a function to run (``Engine.zero_stored_kv``).
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    out = results_dir(args.out or os.path.join(args.cache_dir, "results"))
    return logged(out, args.verbose, lambda console: _run(args, console, out))


def _run(args: argparse.Namespace, console: Any, out: Path) -> int:
    from rich.progress import Progress
    from rich.table import Table

    cache = Path(args.cache_dir).expanduser()
    model_dir = cache / "model"
    disk_dir = cache / "disk"
    with console.status("building the demo model (once)"):
        build_model(model_dir, DEMO_MODEL)
    shutil.rmtree(disk_dir, ignore_errors=True)
    # Every hit is compared with vLLM's prefix cache: no request is sampled for verification
    # (which would compute it instead of loading it).
    kvtier_cfg = {
        "local_disk_path": str(disk_dir),
        "local_cpu_size_gb": 1.0,
        "verify_fraction": 0.0,
    }

    answers: dict[str, dict[tuple[int, str], Result]] = {}
    by_tier: dict[str, dict[str, int]] = {}  # phase -> tier -> hit tokens, from vLLM's metrics
    docs: list[list[Request]] = []
    # The negative control checks kvtier against vLLM's prefix cache only: the full recompute
    # (information, not part of the check) is left out.
    phases = [p for p in PHASES if not (args.corrupt_loaded_kv and p.name == RECOMPUTE)]
    with Progress(console=console, transient=False) as progress:
        for phase in phases:
            task = progress.add_task(f"{phase.name}: starting vLLM", total=None)
            engine = Engine(
                str(model_dir),
                kvtier=kvtier_cfg if phase.kvtier else None,
                prefix_caching=phase.prefix_caching,
                max_model_len=max(4096, args.doc_tokens + 256),
            )
            try:
                if not docs:
                    docs = build_requests(engine.tokenizer, args.docs, args.doc_tokens)
                steps = _schedule(phase, docs)
                engine.warm_up(args.doc_tokens)
                progress.update(task, description=phase.name, total=len(steps), completed=0)
                got = answers.setdefault(phase.name, {})
                for label, r in steps:
                    if args.corrupt_loaded_kv and phase.kvtier and label != Q1:
                        engine.zero_stored_kv(docs[r.doc][0].tokens)  # what this hit loads
                    got[(r.doc, label)] = engine.run(r.tokens, args.max_tokens)
                    progress.advance(task)
                if not engine.flush():
                    console.print("[yellow]kvtier did not finish writing to disk in time")
                if phase.kvtier:
                    by_tier[phase.name] = engine.hit_tokens_by_tier()
            finally:
                engine.close()

    kv = {**answers[KVTIER], **answers[RESTART]}
    ref, base = answers[PREFIX_CACHE], answers.get(RECOMPUTE)
    checks = []
    for doc, label in ((d[0].doc, label) for d in docs for label in (Q1, Q2, AGAIN)):
        res = kv[(doc, label)]
        recomputed = base[(doc, Q1 if label == AGAIN else label)].tokens if base else None
        checks.append(
            {
                "doc": doc,
                "request": label,
                "kvtier_phase": RESTART if label == AGAIN else KVTIER,
                "hit_tokens_kvtier": res.cached_tokens,
                "hit_tokens_prefix_cache": ref[(doc, label)].cached_tokens,
                "same_as_prefix_cache": res.tokens == ref[(doc, label)].tokens,
                "kvtier_same_as_recompute": res.tokens == recomputed if base else None,
                "prefix_cache_same_as_recompute": (
                    ref[(doc, label)].tokens == recomputed if base else None
                ),
            }
        )
    mismatches = [
        {"phase": c["kvtier_phase"], "doc": c["doc"], "request": c["request"]}
        for c in checks
        if not c["same_as_prefix_cache"]
    ]
    hit_gaps = [c for c in checks if c["hit_tokens_kvtier"] != c["hit_tokens_prefix_cache"]]
    differ_from_recompute = (
        {
            "kvtier": sum(not c["kvtier_same_as_recompute"] for c in checks),
            "vllm_prefix_cache": sum(not c["prefix_cache_same_as_recompute"] for c in checks),
            "of": len(checks),
        }
        if base
        else None
    )

    rows: list[dict[str, Any]] = []
    for d in docs:
        doc = d[0].doc
        rows.append(
            {
                "doc": doc,
                "prompt_tokens": len(d[1].tokens),
                "ttft_no_kvtier_s": base[(doc, Q2)].ttft_s if base else None,
                "ttft_cold_s": kv[(doc, Q1)].ttft_s,
                "ttft_warm_s": kv[(doc, Q2)].ttft_s,
                "ttft_restart_s": kv[(doc, AGAIN)].ttft_s,
                "ttft_prefix_cache_warm_s": ref[(doc, Q2)].ttft_s,
                "hit_tokens_warm": kv[(doc, Q2)].loaded_tokens,
                "hit_tokens_restart": kv[(doc, AGAIN)].loaded_tokens,
                "hit_tokens_prefix_cache_warm": ref[(doc, Q2)].cached_tokens,
            }
        )
    warm_prompt = sum(len(d[1].tokens) for d in docs)
    summary: dict[str, Any] = {
        "ttft_no_kvtier_s": statistics.mean(r["ttft_no_kvtier_s"] for r in rows) if base else None,
        "ttft_cold_s": statistics.mean(r["ttft_cold_s"] for r in rows),
        "ttft_warm_s": statistics.mean(r["ttft_warm_s"] for r in rows),
        "ttft_restart_s": statistics.mean(r["ttft_restart_s"] for r in rows),
        "ttft_prefix_cache_warm_s": statistics.mean(r["ttft_prefix_cache_warm_s"] for r in rows),
        "hit_rate_warm": sum(r["hit_tokens_warm"] for r in rows) / warm_prompt,
        "hit_rate_restart": sum(r["hit_tokens_restart"] for r in rows)
        / sum(len(d[0].tokens) for d in docs),
    }
    summary["warm_over_cold"] = summary["ttft_warm_s"] / summary["ttft_cold_s"]
    # A hit's cost against the same hit in vLLM's own prefix cache (the limit of any offload).
    summary["warm_over_prefix_cache"] = summary["ttft_warm_s"] / summary["ttft_prefix_cache_warm_s"]

    table = Table(title="kvtier demo: time to first token (s), one request at a time")
    for col in (
        "doc",
        "prompt tokens",
        "no cache",
        "kvtier cold",
        "kvtier warm (memory)",
        "after restart (disk)",
        "vLLM prefix cache warm",
        "hit tokens",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["doc"]),
            str(row["prompt_tokens"]),
            _seconds(row["ttft_no_kvtier_s"]),
            f"{row['ttft_cold_s']:.3f}",
            f"{row['ttft_warm_s']:.3f}",
            f"{row['ttft_restart_s']:.3f}",
            f"{row['ttft_prefix_cache_warm_s']:.3f}",
            f"{row['hit_tokens_warm']} / {row['hit_tokens_restart']}",
        )
    table.add_row(
        "mean",
        "",
        _seconds(summary["ttft_no_kvtier_s"]),
        f"{summary['ttft_cold_s']:.3f}",
        f"{summary['ttft_warm_s']:.3f}",
        f"{summary['ttft_restart_s']:.3f}",
        f"{summary['ttft_prefix_cache_warm_s']:.3f}",
        f"{summary['hit_rate_warm']:.0%} / {summary['hit_rate_restart']:.0%}",
    )
    console.print(table)
    cpu = cpu_kind()
    isa = _attention_isa(DEMO_MODEL.head_size)
    n = len(checks)
    console.print(
        f"warm/cold TTFT: {summary['warm_over_cold']:.3f}; kvtier warm / vLLM's prefix cache "
        f"warm: {summary['warm_over_prefix_cache']:.2f}x. CPU: {cpu}; vLLM's attention ISA: {isa}."
    )
    console.print(
        f"the check: kvtier's answers identical to vLLM's own prefix cache on the same requests: "
        f"{'yes' if not mismatches else 'NO'} ({n - len(mismatches)} of {n})"
    )
    if differ_from_recompute:
        console.print(
            "for information, answers that differ from a full recompute (vLLM without any "
            f"cache): kvtier {differ_from_recompute['kvtier']} of {n}, vLLM's prefix cache "
            f"{differ_from_recompute['vllm_prefix_cache']} of {n}"
        )
    if hit_gaps:
        console.print(
            "[yellow]kvtier's hit differs from vLLM's prefix cache's on: "
            + ", ".join(
                f"doc {c['doc']} {c['request']} ({c['hit_tokens_kvtier']} vs "
                f"{c['hit_tokens_prefix_cache']} tokens)"
                for c in hit_gaps
            )
        )
    console.print(
        "hit tokens by tier (vllm:kvtier_lookup_hit_tokens): "
        + "; ".join(
            f"{phase}: " + (", ".join(f"{t} {n}" for t, n in tiers.items()) or "none")
            for phase, tiers in by_tier.items()
        )
    )

    report: dict[str, Any] = {
        "model": {"path": str(model_dir), **DEMO_MODEL.__dict__},
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "max_tokens": args.max_tokens,
        "block_size": BLOCK_SIZE,
        "dtype": "bfloat16",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "attention_isa": isa,
        "corrupt_loaded_kv": args.corrupt_loaded_kv,
        "rows": rows,
        "summary": summary,
        "reference": "vLLM's own prefix cache, no kvtier, the same requests in the same order",
        "mismatches": mismatches,
        "differ_from_recompute": differ_from_recompute,
        "checks": checks,
        "hit_tokens_by_tier": by_tier,
    }
    (out / "demo.json").write_text(json.dumps(report, indent=2))
    _chart(rows, out / "demo.png")
    console.print(f"wrote {out / 'demo.json'} and {out / 'demo.png'}")
    if mismatches:
        console.print(f"[red]answers differ from vLLM's prefix cache: {mismatches}")
        return 1
    return 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("no cache", "ttft_no_kvtier_s"),
        ("kvtier cold", "ttft_cold_s"),
        ("kvtier warm (memory)", "ttft_warm_s"),
        ("after restart (disk)", "ttft_restart_s"),
        ("vLLM prefix cache warm", "ttft_prefix_cache_warm_s"),
    ]
    series = [(label, key) for label, key in series if rows[0][key] is not None]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        xs = [r["doc"] + i * width for r in rows]
        ax.bar(xs, [r[key] for r in rows], width, label=label)
    ax.set_xticks([r["doc"] + 0.4 - width / 2 for r in rows])
    ax.set_xticklabels([f"doc {r['doc']}" for r in rows])
    ax.set_ylabel("time to first token (s)")
    ax.set_title("kvtier demo: long-document QA on vLLM (CPU)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
