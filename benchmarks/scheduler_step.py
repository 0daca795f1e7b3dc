"""What kvtier's scheduler hooks cost per vLLM scheduler step, for long prompts (issue 19).

Drives ``SchedulerSide`` (the scheduler half of ``KVTierConnector``) with real vLLM request and
scheduler-output objects and real worker parts in-process (``tests/vllm_integration/
sched_harness.py``: a ``CacheEngine`` with host memory per rank, its hold table and report
feed), and times the hooks vLLM calls from ``schedule()`` and ``update_from_output()``, as
``KVTierConnector`` counts them into ``vllm:kvtier_scheduler_seconds``. For each prompt length:

- ``miss``: a new prompt nothing has stored; the index rules it out (first lookup, which
  hashes the prompt, and the step that prefills it and plans its saves, in one step: the worst
  case; chunked prefill spreads it over several);
- ``report``: the workers' report of that prompt's stored chunks reaching the index;
- ``hit_probe`` / ``hit_answer``: a prompt sharing all but its last block with a stored one:
  the lookup that sends the probe, then the step in which the answer arrives and vLLM gets the
  hit (lookup, allocation, the step's metadata with the load);
- ``decode``: a step of ``--running`` requests decoding one token each.

Reference, measured in the same run: vLLM's own block hashing of the same prompt (vLLM's
``get_request_block_hasher`` with sha256, which vLLM runs once for every request when its
prefix cache is on). Goal from issue 19: under 0.5 ms for a 16k-token prompt.

    python benchmarks/scheduler_step.py [--lengths 2048,16384] [--repeat 30]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm_integration"))

import sched_harness as sh
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.outputs import KVConnectorOutput

GOAL_MS = 0.5


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def _cached_output(reqs: list[Any], computed: list[int], scheduled: list[int]) -> SchedulerOutput:
    """A step continuing ``reqs`` (already running): ``scheduled[i]`` tokens after
    ``computed[i]``, no new blocks."""
    cached = CachedRequestData.make_empty()
    cached.req_ids = [r.request_id for r in reqs]
    cached.resumed_req_ids = set()
    cached.new_token_ids = [[] for _ in reqs]
    cached.all_token_ids = {}
    cached.new_block_ids = [None for _ in reqs]
    cached.num_computed_tokens = list(computed)
    cached.num_output_tokens = [0 for _ in reqs]
    out = sh.empty_output()
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = {r.request_id: n for r, n in zip(reqs, scheduled, strict=True)}
    out.total_num_scheduled_tokens = sum(scheduled)
    return out


def _new_output(req: Any, blocks: list[int], scheduled: int) -> SchedulerOutput:
    out = sh.empty_output()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (blocks,))]
    out.num_scheduled_tokens = {req.request_id: scheduled}
    out.total_num_scheduled_tokens = scheduled
    return out


def _round(
    harness: Any,
    rng: np.random.Generator,
    length: int,
    running: int,
    step_tokens: int,
    times: dict[str, list[float]],
) -> None:
    """One prompt of ``length`` tokens through every case (see the module docstring)."""
    sched = harness.sched
    hasher = sh.block_hasher()
    tokens = rng.integers(10, 3000, length).tolist()
    first = sh.request(tokens)
    _, ms = _timed(lambda: hasher(first))
    times["vllm_block_hash"].append(ms)
    # A miss: lookup (the index rules it out), then the prefill in steps of
    # ``step_tokens`` (each plans the saves of the chunks it completes).
    blocks = list(range(-(-length // sh.BLOCK)))

    def lookup_and_alloc() -> int:
        n, _ = sched.get_num_new_matched_tokens(first, 0)
        sched.update_state_after_alloc(first, _Blocks(length), 0)
        return n or 0

    n, ms = _timed(lookup_and_alloc)
    assert n == 0, n
    metas = []
    for start in range(0, length, step_tokens):
        todo = min(step_tokens, length - start)
        if start == 0:
            out = _new_output(first, blocks, todo)
        else:
            out = _cached_output([first], [start], [todo])
        meta, t_build = _timed(lambda out=out: sched.build_connector_meta(out))
        times["prefill_step"].append(ms + t_build)
        ms = 0.0
        metas.append(meta)
    for meta in metas:
        harness.deliver(meta)
        for rank in harness.ranks:
            for spec in meta.saves:
                rank.engine.store(spec.tokens, torch.arange(len(spec.tokens)), scope=spec.scope)
    reports = [rank.feed.take() for rank in harness.ranks]
    _, ms = _timed(
        lambda: sched.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=reports[0])
        )
    )
    times["report"].append(ms)
    # A hit: all but the last block shared.
    second = sh.request(tokens[: length - sh.BLOCK] + rng.integers(10, 3000, sh.BLOCK).tolist())
    (n, _), t_probe = _timed(lambda: sched.get_num_new_matched_tokens(second, 0))
    assert n is None, n
    times["hit_probe"].append(t_probe)
    meta = sched.build_connector_meta(sh.empty_output())
    harness.deliver(meta)
    harness.report()

    def answered() -> tuple[int, Any]:
        n, _ = sched.get_num_new_matched_tokens(second, 0)
        sched.update_state_after_alloc(second, _Blocks(length), n or 0)
        return n or 0, sched.build_connector_meta(sh.empty_output())

    (n, meta), ms = _timed(answered)
    assert n >= length - 2 * sh.BLOCK - 256 and len(meta.loads) == 1, n
    times["hit_answer"].append(ms)
    for rank in harness.ranks:  # the load would take the hold: let it go
        hold = rank.holds.take(meta.loads[0].req_id, meta.loads[0].hold_id)
        if hold is not None:
            hold.release()
    for r in (first, second):
        r.num_computed_tokens = length
        sched.request_finished(r, [])
    # Decode steps of ``running`` requests.
    reqs = [sh.request(rng.integers(10, 3000, 64).tolist()) for _ in range(running)]
    for i, r in enumerate(reqs):  # their prefill (and its saves), not timed
        sched.get_num_new_matched_tokens(r, 0)
        sched.update_state_after_alloc(r, None, 0)  # type: ignore[arg-type]
        harness.deliver(harness.prefill(r, [2 * i, 2 * i + 1]))
    out = _cached_output(reqs, [65] * len(reqs), [1] * len(reqs))
    _, ms = _timed(lambda: sched.build_connector_meta(out))
    times["decode"].append(ms)
    for r in reqs:
        r.num_computed_tokens = 65
        sched.request_finished(r, [])
    harness.deliver(sched.build_connector_meta(sh.empty_output()))
    harness.report()


def measure(
    length: int, repeat: int, running: int, step_tokens: int, seed: int
) -> dict[str, list[float]]:
    """Per-case times (ms) over ``repeat`` prompts of ``length`` tokens."""
    # Host memory for a few prompts' chunks and aliases (each request's are freed after it).
    harness = sh.Harness.create(
        chunk_size=256,
        arena_chunks=4 * (length // 256) + 16,
        cache_blocks=-(-length // sh.BLOCK) + 1,
    )
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {
        k: []
        for k in ("prefill_step", "report", "hit_probe", "hit_answer", "decode", "vllm_block_hash")
    }
    try:
        for _ in range(repeat):
            _round(harness, rng, length, running, step_tokens, times)
    finally:
        harness.close()
    return times


class _Blocks:
    """What ``update_state_after_alloc`` reads of vLLM's ``KVCacheBlocks``."""

    def __init__(self, length: int) -> None:
        self._ids = list(range(-(-length // sh.BLOCK)))

    def get_block_ids(self) -> tuple[list[int]]:
        return (self._ids,)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,16384", help="prompt lengths in tokens")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--running", type=int, default=16, help="requests in a decode step")
    p.add_argument(
        "--step-tokens",
        type=int,
        default=2048,
        help="prefill tokens per step (vLLM's max_num_batched_tokens; default 2048)",
    )
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and PNG")
    args = p.parse_args(argv)
    from tqdm import tqdm

    rows = []
    for length in tqdm([int(x) for x in args.lengths.split(",")], desc="prompt lengths"):
        # One unrecorded round first: imports, first allocations.
        measure(length, 1, args.running, args.step_tokens, seed=2**32 - 1)
        times = measure(length, args.repeat, args.running, args.step_tokens, seed=length)
        ref = statistics.median(times["vllm_block_hash"])
        for case, xs in times.items():
            if case == "vllm_block_hash":
                continue
            rows.append(
                {
                    "prompt_tokens": length,
                    "case": case,
                    "p50_ms": statistics.median(xs),
                    "p99_ms": _pct(xs, 0.99),
                    "max_ms": max(xs),
                    "reference": "vLLM's block hashing of the same prompt (sha256), median",
                    "reference_ms": ref,
                    "ratio_p50": statistics.median(xs) / ref,
                    "goal_ms": GOAL_MS,
                }
            )
    print(
        f"\n{'tokens':>7} {'case':>11} {'p50 ms':>8} {'p99 ms':>8} {'vLLM hash ms':>12} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7} {r['case']:>11} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} "
            f"{r['reference_ms']:12.3f} {r['ratio_p50']:6.2f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "scheduler_step",
        "machine": {
            "processor": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0],
        },
        "params": {
            "repeat": args.repeat,
            "running": args.running,
            "step_tokens": args.step_tokens,
            "chunk_size": 256,
            "block_size": sh.BLOCK,
        },
        "results": rows,
    }
    (out / "scheduler-step.json").write_text(json.dumps(report, indent=2))
    _chart(rows, out / "scheduler-step.png")
    print(f"wrote {out / 'scheduler-step.json'} and {out / 'scheduler-step.png'}")
    return 0


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in rows})
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(lengths)
    for i, n in enumerate(lengths):
        ys = [
            next(r["p99_ms"] for r in rows if r["case"] == c and r["prompt_tokens"] == n)
            for c in cases
        ]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=f"{n} tokens (p99)")
    ax.axhline(GOAL_MS, color="grey", ls="--", label=f"goal {GOAL_MS} ms")
    ax.set_xticks([j + width * (len(lengths) - 1) / 2 for j in range(len(cases))], cases)
    ax.set_ylabel("kvtier scheduler hooks per step (ms)")
    ax.set_title("benchmarks/scheduler_step.py")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
