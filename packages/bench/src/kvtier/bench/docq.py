"""``kvtier bench e2e --workload doc-question`` (issue 20): a document, then a second question.

Each of ``--docs`` documents of ``--doc-tokens`` tokens gets ``1 + --warm-questions``
questions. The first question is sent cold; each later one (the same document, another
question: the prompts diverge inside the document's last chunk, at the same block) is a warm
request. Several warm requests per cold one keep the warm mean steady (a warm request takes
about 2% of a cold one here). vLLM's prefix cache reuses every whole block
the two share; kvtier must too (its aliases), and after a restart. Modes, each a fresh engine,
``max_tokens=1``, one request at a time:

- ``prefix_cache``: vLLM's own prefix cache, no connector;
- ``kvtier``: kvtier (host memory + disk), vLLM's prefix cache off;
- ``kvtier_restart``: a new kvtier engine on the ``kvtier`` engine's disk directory; only the
  later questions are sent (their cold reference is the ``kvtier`` engine's first questions).

Reports each mode's mean TTFT cold and warm, warm/cold, warm hit tokens, and warm/cold over
``prefix_cache``'s (issue 20's target: at most 1.1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.model import ModelSpec, build_model
from kvtier.bench.workload import (
    BENCH_KVTIER,
    Engine,
    Request,
    build_requests,
    machine_name,
    results_dir,
)

TARGET = 1.1


def _engine(model_dir: Path, mode: str, disk: Path, doc_tokens: int) -> Engine:
    return Engine(
        str(model_dir),
        prefix_caching=mode == "prefix_cache",
        kvtier=BENCH_KVTIER | {"local_disk_path": str(disk)} if mode != "prefix_cache" else None,
        max_model_len=max(4096, doc_tokens + 256),
    )


def _run_mode(
    engine: Engine,
    docs: list[list[Request]],
    mode: str,
    doc_tokens: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    engine.warm_up(doc_tokens)
    cold, warm, hits = [], [], []
    for d in docs:
        first = d[0]
        if mode != "kvtier_restart":
            cold.append(engine.run(first.tokens, 1).ttft_s)
        for later in d[1:]:
            res = engine.run(later.tokens, 1)
            warm.append(res.ttft_s)
            hits.append(res.loaded_tokens)
            say(
                f"{mode:>15} doc {first.doc} q{later.question + 1}: {len(first.tokens)}/"
                f"{len(later.tokens)} tokens, cold {cold[-1] if cold else float('nan'):.3f} s, "
                f"warm {warm[-1]:.3f} s, loaded {hits[-1]}"
            )
    if mode == "kvtier":
        assert engine.flush(), "kvtier's disk writes did not land"
    return {"cold": cold, "warm": warm, "hits": hits}


def run_doc_question(
    args: argparse.Namespace,
    modes: list[str],
    spec: ModelSpec,
    say: Callable[[str], None] = print,
) -> int:
    """``say``: where its progress and table go (the screen, beside the engines' log)."""
    model_dir = build_model(Path(args.cache_dir).expanduser() / "model", spec)
    disk = Path(tempfile.mkdtemp(prefix="kvtier-bench-disk-"))
    raw: dict[str, dict[str, Any]] = {}
    lengths: list[tuple[int, ...]] = []
    try:
        for mode in modes:
            engine = _engine(model_dir, mode, disk, args.doc_tokens)
            try:
                docs = build_requests(
                    engine.tokenizer, args.docs, args.doc_tokens, 1 + args.warm_questions
                )
                lengths = [tuple(len(q.tokens) for q in d) for d in docs]
                raw[mode] = _run_mode(engine, docs, mode, args.doc_tokens, say)
            finally:
                engine.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    if "kvtier_restart" in raw and "kvtier" in raw:
        raw["kvtier_restart"]["cold"] = raw["kvtier"]["cold"]
    results: dict[str, Any] = {}
    for mode, r in raw.items():
        if not r["cold"]:
            continue
        row = {
            "ttft_cold_s": statistics.mean(r["cold"]),
            "ttft_warm_s": statistics.mean(r["warm"]),
            "ttft_cold_all_s": r["cold"],
            "ttft_warm_all_s": r["warm"],
            "warm_hit_tokens": r["hits"],
        }
        row["warm_over_cold"] = row["ttft_warm_s"] / row["ttft_cold_s"]
        results[mode] = row
    if "prefix_cache" in results:
        base = results["prefix_cache"]["warm_over_cold"]
        for row in results.values():
            row["over_prefix_cache"] = row["warm_over_cold"] / base
    report = {
        "workload": "doc-question",
        "model": vars(spec),
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "warm_questions": args.warm_questions,
        "prompt_tokens": lengths,
        "max_tokens": 1,
        "target_over_prefix_cache": TARGET,
        "machine": machine_name(),
        **results,
    }
    out = results_dir(args.out)
    (out / "e2e-docq.json").write_text(json.dumps(report, indent=2, default=str))
    _chart(results, out / "e2e-docq.png")
    say(f"\n{'mode':>15} {'cold s':>8} {'warm s':>8} {'warm/cold':>9} {'/prefix':>8} {'hit':>6}")
    for mode, r in results.items():
        say(
            f"{mode:>15} {r['ttft_cold_s']:8.3f} {r['ttft_warm_s']:8.3f} "
            f"{r['warm_over_cold']:9.3f} {r.get('over_prefix_cache', float('nan')):8.2f} "
            f"{statistics.mean(r['warm_hit_tokens']):6.0f}"
        )
    say(f"wrote {out / 'e2e-docq.json'} and {out / 'e2e-docq.png'}")
    return 0


def _chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(modes, [results[m]["warm_over_cold"] for m in modes])
    if "prefix_cache" in results:
        ax.axhline(
            TARGET * results["prefix_cache"]["warm_over_cold"],
            color="grey",
            ls="--",
            label=f"{TARGET}x prefix cache",
        )
        ax.legend()
    ax.set_ylabel("warm / cold TTFT (second question / first)")
    ax.set_title("kvtier bench e2e --workload doc-question (vLLM CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
