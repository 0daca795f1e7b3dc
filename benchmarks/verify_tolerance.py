"""How far recomputed KV is from stored KV, and how far wrong KV is: what the default
verification tolerances (``kvtier.core.verify.DEFAULT_TOLERANCE``) are chosen from.

Real vLLM (multiprocess, CPU), the demo's model, kvtier on host memory with
``verify_fraction=1.0``. Per dtype: the documents' first questions are computed one at a time and
stored; then every question of every document is sent in one batch, so each hit is recomputed in
another batch shape (chunked prefill mixes requests) and compared with what was stored: the
largest error of a right chunk. Then two planted faults, each checked by one request: zeros under
a document's keys, and another document's first chunk under a document's first key: the smallest
error of a wrong chunk. Prints a table, writes ``verify-tolerance.json`` and a PNG.

    python benchmarks/verify_tolerance.py [--dtypes bfloat16,float32] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # functions sent to workers


def _plant_other(worker: Any, prompt: list[int], source: list[int]) -> int:
    """In the worker: ``source``'s stored first chunk put under ``prompt``'s first chunk key."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = get_kv_transfer_group().engine
    obj = engine.storage.get(engine.full_spans(source)[0].key)
    if obj is None:
        return 0
    with obj:
        engine.storage.put(engine.full_spans(prompt)[0].key, obj)
    return 1


def _stats(engine_id: str) -> dict[str, int]:
    from kvtier.vllm_integration.channel import query_worker_stats

    return query_worker_stats(engine_id, 0)


def run_dtype(model: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    from kvtier.bench.workload import Engine, build_requests

    config = {
        "tiers": ["local_cpu"],
        "local_cpu_size_gb": 1.0,
        "verify_fraction": 1.0,
        "verify_quarantine_s": 0.0,  # the controls must not stop later checks
    }
    engine = Engine(model, kvtier=config, dtype=dtype, max_model_len=args.doc_tokens + 256)
    try:
        docs = build_requests(engine.tokenizer, args.docs, args.doc_tokens, args.questions)
        for reqs in docs:
            engine.run(reqs[0].tokens, 2)
        assert engine.flush()
        batch = [TokensPrompt(prompt_token_ids=r.tokens) for reqs in docs for r in reqs]
        engine.llm.generate(batch, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert engine.flush()
        right = _stats(engine.engine_id)
        # Another document's chunk first: the running minimum of wrong-chunk errors is then its
        # error; zeros are caught at exactly 1 (mean |0 - fresh| / mean |fresh|).
        planted = sum(
            engine.llm.collective_rpc(_plant_other, args=(docs[1][0].tokens, docs[0][0].tokens))
        )
        assert planted, "nothing to plant"
        engine.run(docs[1][1].tokens, 2)
        assert engine.flush()
        other = _stats(engine.engine_id)
        engine.zero_stored_kv(docs[0][0].tokens)
        engine.run(docs[0][1].tokens, 2)
        assert engine.flush()
        zeros = _stats(engine.engine_id)
    finally:
        engine.close()
    return {
        "dtype": dtype,
        "right_chunks": right["verify_chunks"],
        "false_alarms": right["verify_mismatches"],
        "worst_right_error": right["verify_worst_ok_ppm"] / 1e6,
        "other_caught": other["verify_mismatches"] - right["verify_mismatches"],
        "other_least_error": other["verify_least_bad_ppm"] / 1e6,
        "zeros_caught": zeros["verify_mismatches"] - other["verify_mismatches"],
        "zeros_least_error": zeros["verify_least_bad_ppm"] / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=1536)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    import torch

    from kvtier.bench.demo import DEMO_MODEL
    from kvtier.bench.model import build_model
    from kvtier.bench.workload import cpu_kind
    from kvtier.core.verify import DEFAULT_TOLERANCE

    model = Path(tempfile.gettempdir()) / "kvtier-verify-model"
    build_model(model, DEMO_MODEL)
    rows = []
    for dtype in args.dtypes.split(","):
        row = run_dtype(str(model), dtype, args)
        row["tolerance"] = DEFAULT_TOLERANCE[getattr(torch, dtype)]
        rows.append(row)
        print(
            f"{dtype:9} right chunks {row['right_chunks']:4} false alarms {row['false_alarms']} "
            f"worst right {row['worst_right_error']:.2e} | tolerance {row['tolerance']:.2e} | "
            f"zeros caught {row['zeros_caught']} (least {row['zeros_least_error']:.2f}) "
            f"other prompt caught {row['other_caught']} (least {row['other_least_error']:.2f})",
            flush=True,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": {
            "cpu": cpu_kind(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "workload": {"docs": args.docs, "doc_tokens": args.doc_tokens, "questions": args.questions},
        "rows": rows,
    }
    (out / "verify-tolerance.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(rows, out / "verify-tolerance.png")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    floor = 1e-6  # an error of 0 (bit-identical) drawn at the floor
    bars = [
        ("worst right chunk", "worst_right_error", "tab:green", -0.2),
        ("zeros planted", "zeros_least_error", "tab:red", 0.0),
        ("another prompt's chunk", "other_least_error", "tab:purple", 0.2),
    ]
    for i, r in enumerate(rows):
        for label, field, color, dx in bars:
            ax.bar(i + dx, max(r[field], floor), 0.2, color=color, label=label if not i else None)
        ax.hlines(
            r["tolerance"],
            i - 0.35,
            i + 0.35,
            colors="black",
            linestyles="dashed",
            label="tolerance" if not i else None,
        )
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["dtype"] for r in rows])
    ax.set_ylabel("page error")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("verification: recomputed vs wrong KV (vLLM CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
