"""``kvtier bench e2e``: time to first token through vLLM, cold and warm, in three modes.

Model: a random Llama large enough that a cold 3000-token prefill takes about 2 s on a 2-core CPU
(hidden 1024, 8 layers, 16 heads, 8 kv heads). Workload: ``--docs`` documents of
``--doc-tokens`` tokens, one request at a time, ``max_tokens=1``; each document is sent twice
(cold, then warm: the same request again). Modes, each a fresh engine:

- ``no_connector``: vLLM alone, prefix caching off (the warm request recomputes everything);
- ``prefix_cache``: vLLM's own in-memory prefix cache, no connector;
- ``kvtier``: kvtier on its default tiers (host memory + disk), vLLM's prefix cache off, so the
  warm request is served by kvtier.

``kvtier_no_hit_overhead`` = kvtier's cold TTFT / no_connector's cold TTFT - 1 (what kvtier adds
to a request it cannot help: the lookup and the save). Writes ``e2e.json`` and ``e2e.png``.

``--model gemma3``: the same size as a Gemma 3 model, layers alternating sliding window (1024
tokens) and full attention, which vLLM serves with two KV cache groups (its hybrid memory
allocator on, with kvtier as without it). Writes ``e2e-gemma3.json`` and ``e2e-gemma3.png``,
with the KV bytes kvtier stores per prompt token next to those of the Llama model of the same
size. ``--model qwen3-next``: the same size, layers alternating Gated DeltaNet (a recurrent
state) and full attention, served by vLLM in its Mamba "align" mode, which needs prefix
caching: kvtier's warm request then follows a ``reset_prefix_cache`` so kvtier serves it.
``--model gemma4``: the same size with Gemma 4's structure (five sliding-window layers of head 64
to one full-attention layer of head 512): vLLM's window groups get blocks 8x the full group's.

``--workload doc-question`` (issue 20): each document gets ``1 + --warm-questions`` questions;
the first question is cold, the later ones (same document, another question: the prompts
diverge inside a chunk) warm. Modes ``prefix_cache``, ``kvtier`` and ``kvtier_restart`` (a fresh
kvtier engine after the ``kvtier`` one stopped: the later questions hit its disk tier; their
cold reference is the
``kvtier`` engine's first questions). Writes ``e2e-docq.json`` and ``e2e-docq.png``, with each
mode's warm/cold over ``prefix_cache``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.model import ModelSpec, build_model
from kvtier.bench.screen import add_verbose, logged
from kvtier.bench.workload import (
    BENCH_KVTIER,
    Engine,
    build_requests,
    machine_name,
    require_extras,
    results_dir,
)
from kvtier.core.config import default_cache_dir

BENCH_MODEL = ModelSpec(
    hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=2816
)
MODELS = {
    "llama": BENCH_MODEL,
    "gemma3": dataclasses.replace(BENCH_MODEL, architecture="gemma3", sliding_window=1024),
    "qwen3-next": dataclasses.replace(BENCH_MODEL, architecture="qwen3-next"),
    "gemma4": dataclasses.replace(BENCH_MODEL, architecture="gemma4", sliding_window=1024),
}
MODES = ("no_connector", "prefix_cache", "kvtier")
DOCQ_MODES = ("prefix_cache", "kvtier", "kvtier_restart")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="directory for e2e.json and e2e.png (default benchmarks/results)")
    p.add_argument("--workload", choices=("repeat", "doc-question"), default="repeat")
    p.add_argument("--model", choices=tuple(MODELS), default="llama", help="repeat workload")
    p.add_argument("--docs", type=int, default=None, help="default 4 (doc-question: 3)")
    p.add_argument("--doc-tokens", type=int, default=None, help="default 3000 (doc-question: 2000)")
    p.add_argument(
        "--warm-questions",
        type=int,
        default=3,
        help="doc-question: warm questions per document after the cold one (default 3)",
    )
    p.add_argument(
        "--gap-s",
        type=float,
        default=0.0,
        help="pause between a document's cold and warm request (default 0: the warm "
        "request comes at once, while kvtier may still be saving the cold one)",
    )
    p.add_argument(
        "--modes", default=None, help=f"comma-separated subset of {MODES} or {DOCQ_MODES}"
    )
    p.add_argument(
        "--cache-dir",
        default=os.path.join(default_cache_dir(), "bench-e2e"),
        help="where the benchmark model is built (default ~/.cache/kvtier/bench-e2e)",
    )
    add_verbose(p)
    args = p.parse_args(argv)
    docq = args.workload == "doc-question"
    args.docs = args.docs if args.docs is not None else (3 if docq else 4)
    args.doc_tokens = args.doc_tokens if args.doc_tokens is not None else (2000 if docq else 3000)
    args.modes = args.modes or ",".join(DOCQ_MODES if docq else MODES)
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    require_extras()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return logged(results_dir(args.out), args.verbose, lambda console: _main(args, console.out))


def _main(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    modes = [m for m in args.modes.split(",") if m]
    known = DOCQ_MODES if args.workload == "doc-question" else MODES
    unknown = set(modes) - set(known)
    if unknown:
        say(f"kvtier bench e2e: unknown mode(s) {sorted(unknown)}; known: {known}")
        return 2
    if args.workload == "doc-question":
        from kvtier.bench.docq import run_doc_question

        return run_doc_question(args, modes, BENCH_MODEL, say)
    spec = MODELS[args.model]
    mamba = spec.architecture == "qwen3-next"
    name = "model" if args.model == "llama" else f"model-{args.model}"
    model_dir = build_model(Path(args.cache_dir).expanduser() / name, spec)
    disk = Path(tempfile.mkdtemp(prefix="kvtier-bench-disk-"))
    results: dict[str, Any] = {}
    prompt_tokens = 0
    try:
        for mode in modes:
            # A Mamba hybrid runs with kvtier only in vLLM's "align" mode, which needs prefix
            # caching: its warm requests then start from an emptied prefix cache (below).
            engine = Engine(
                str(model_dir),
                prefix_caching=mode == "prefix_cache" or (mamba and mode == "kvtier"),
                kvtier=BENCH_KVTIER | {"local_disk_path": str(disk)} if mode == "kvtier" else None,
                max_model_len=max(4096, args.doc_tokens + 256),
            )
            try:
                docs = build_requests(engine.tokenizer, args.docs, args.doc_tokens, questions=1)
                engine.warm_up(args.doc_tokens)
                cold, warm, hits = [], [], []
                for d in docs:
                    tokens = d[0].tokens
                    prompt_tokens = len(tokens)
                    cold.append(engine.run(tokens, 1).ttft_s)
                    if mamba and mode == "kvtier":
                        engine.flush()
                        engine.llm.reset_prefix_cache()
                    time.sleep(args.gap_s)
                    res = engine.run(tokens, 1)
                    warm.append(res.ttft_s)
                    hits.append(res.loaded_tokens)
                    say(f"{mode:>13} doc {d[0].doc}: cold {cold[-1]:.3f} s, warm {warm[-1]:.3f} s")
                results[mode] = {
                    "ttft_cold_s": statistics.mean(cold),
                    "ttft_warm_s": statistics.mean(warm),
                    "ttft_cold_median_s": statistics.median(cold),
                    "ttft_warm_median_s": statistics.median(warm),
                    "ttft_cold_all_s": cold,
                    "ttft_warm_all_s": warm,
                }
                if mode == "kvtier":
                    results[mode]["warm_hit_tokens"] = hits
            finally:
                engine.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)

    for r in results.values():
        r["warm_over_cold"] = r["ttft_warm_s"] / r["ttft_cold_s"]
    report: dict[str, Any] = {
        "model": {
            "architecture": spec.architecture,
            "hidden_size": spec.hidden_size,
            "num_layers": spec.num_layers,
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "dtype": "bfloat16",
            **({"sliding_window": spec.sliding_window} if spec.architecture != "llama" else {}),
        },
        # What kvtier stores per prompt token (every layer's K and V: a hybrid model's window
        # layers in full, docs/hybrid.md), and the same for the Llama model of this size.
        "kvtier_bytes_per_token": _kv_bytes_per_token(spec),
        "llama_bytes_per_token": _kv_bytes_per_token(BENCH_MODEL),
        # Qwen3-Next: one state entry (every Gated DeltaNet layer's conv and SSM state, padded
        # to vLLM's page) where vLLM ended a prefill step at a chunk boundary.
        **({"state_bytes_per_entry": _state_bytes(spec)} if mamba else {}),
        "prompt_tokens": prompt_tokens,
        "docs": args.docs,
        "max_tokens": 1,
        "gap_s": args.gap_s,
        "machine": machine_name(),
        **results,
    }
    if "kvtier" in results and "no_connector" in results:
        report["kvtier_no_hit_overhead"] = (
            results["kvtier"]["ttft_cold_s"] / results["no_connector"]["ttft_cold_s"] - 1
        )
        report["kvtier_no_hit_overhead_median"] = (
            results["kvtier"]["ttft_cold_median_s"] / results["no_connector"]["ttft_cold_median_s"]
            - 1
        )
    if "kvtier" in results and "prefix_cache" in results:
        # A hit's cost next to vLLM's own prefix cache hitting the same blocks (issue 57's ratio).
        kv, pc = results["kvtier"], results["prefix_cache"]
        report["kvtier_warm_over_prefix_cache"] = kv["ttft_warm_s"] / pc["ttft_warm_s"]
        report["kvtier_warm_over_prefix_cache_median"] = (
            kv["ttft_warm_median_s"] / pc["ttft_warm_median_s"]
        )
    out = results_dir(args.out)
    stem = "e2e" if args.model == "llama" else f"e2e-{args.model}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    _chart(results, out / f"{stem}.png", args.model)

    say(f"\n{'mode':>13} {'cold s':>8} {'warm s':>8} {'warm/cold':>9}")
    for mode, r in results.items():
        say(
            f"{mode:>13} {r['ttft_cold_s']:8.3f} {r['ttft_warm_s']:8.3f} {r['warm_over_cold']:9.3f}"
        )
    if "kvtier_no_hit_overhead" in report:
        say(
            f"kvtier no-hit overhead: {report['kvtier_no_hit_overhead']:+.1%} (means), "
            f"{report['kvtier_no_hit_overhead_median']:+.1%} (medians)"
        )
    if "kvtier_warm_over_prefix_cache" in report:
        say(
            f"kvtier warm / vLLM's prefix cache warm: "
            f"{report['kvtier_warm_over_prefix_cache']:.2f}x (means), "
            f"{report['kvtier_warm_over_prefix_cache_median']:.2f}x (medians)"
        )
    say(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return 0


def _kv_bytes_per_token(spec: ModelSpec) -> int:
    """K and V of every attention layer, bf16 (Qwen3-Next: every other layer is Gated
    DeltaNet, whose state is stored once per state entry, not per token; Gemma 4: its
    full-attention layers' heads are 512, ``model.py``)."""
    if spec.architecture == "gemma4":
        full = sum(1 for i in range(spec.num_layers) if i % 6 == 5 or i == spec.num_layers - 1)
        window = spec.num_layers - full
        return 2 * spec.num_kv_heads * (window * spec.head_size + full * 512) * 2
    layers = spec.num_layers // 2 if spec.architecture == "qwen3-next" else spec.num_layers
    return 2 * layers * spec.num_kv_heads * spec.head_size * 2


def _state_bytes(spec: ModelSpec) -> int:
    """The unpadded recurrent state of the bench Qwen3-Next's Gated DeltaNet layers (conv
    state ``(kernel - 1, 2 * key + value dims)`` bf16, SSM state ``(value heads, 128, 128)``
    fp32, ``model.py``)."""
    conv = 3 * (2 * 2 * 128 + 4 * 128) * 2
    ssm = 4 * 128 * 128 * 4
    return spec.num_layers // 2 * (conv + ssm)


def _chart(results: dict[str, Any], path: Path, model: str = "llama") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], [results[m]["ttft_cold_s"] for m in modes], 0.4, label="cold")
    ax.bar([x + 0.2 for x in xs], [results[m]["ttft_warm_s"] for m in modes], 0.4, label="warm")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(modes)
    ax.set_ylabel("mean time to first token (s)")
    ax.set_title(f"kvtier bench e2e, {model} (vLLM CPU, one request at a time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
