"""Prompts and helpers the vLLM end-to-end tests share (block size 32, chunk 256).

A 700-token prompt stores chunks [0,256) [256,512) and the block-aligned tail [512,672); a repeat
loads 672 tokens (the most that leaves the last token to recompute). SHARED shares DOC's first
400 tokens: it hits DOC's first chunk and, through the second chunk's aliases, the 4 whole blocks
of the second it shares (it diverges inside it).

What a result is compared with: a cold request with vLLM without kvtier (``reference``); a hit
with vLLM's own prefix cache hitting the same blocks of the same prompts in the same mode, no
kvtier (``hit_reference``, ``prefix_cache_hits``). A hit computes only the suffix after the
cached blocks, in another shape than one full prefill: on CPUs whose kernels are not
batch-invariant (vLLM's ``amx`` attention on AMX CPUs, torch's linear on AVX2-only ones) that can
move logprobs and even flip a greedy token against a full recompute, exactly as vLLM's prefix
cache does. vLLM's prefix cache computes what a kvtier hit computes, so they must agree token for
token and logprob for logprob.
"""

from __future__ import annotations

import random

RNG = random.Random(1234)
DOC = [RNG.randrange(3, 3000) for _ in range(700)]
SHARED = DOC[:400] + [RNG.randrange(3, 3000) for _ in range(200)]  # shares 400 tokens with DOC
OTHER = [RNG.randrange(3, 3000) for _ in range(500)]
FULL_HIT = (len(DOC) - 1) // 32 * 32  # 672
PARTIAL_HIT = 384  # SHARED's whole blocks in common with DOC (it diverges inside DOC's 2nd chunk)


# Zeroed KV moves some logprob of the answer by far more than this (whole units).
CORRUPT_GAP = 0.05


def logprob_gap(a: dict, b: dict) -> float:
    """Largest difference between two runs' per-token logprobs."""
    return max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)), default=0.0)


def prefix_cache_hits(run_engine, **mode) -> dict[str, dict]:
    """vLLM's own prefix cache, no kvtier, in the given mode: DOC cold (``cold``), DOC again (a
    full hit of FULL_HIT tokens: ``doc``), SHARED (a partial hit of PARTIAL_HIT tokens:
    ``shared``). The reference of kvtier's hits on the same prompts in the same mode."""
    spec = {"kvtier": None, "prefix_caching": True, "report_cached_tokens": True, **mode}
    out = run_engine({**spec, "steps": [gen(DOC), gen(DOC), gen(SHARED)]})
    # The same computation as kvtier's hits: exactly as many tokens come from the cache.
    assert [r.pop("cached_tokens") for r in out] == [0, FULL_HIT, PARTIAL_HIT]
    return dict(zip(("cold", "doc", "shared"), out, strict=True))


def gen(prompt: list[int], salt: str | None = None) -> dict:
    return {"op": "generate", "prompt": prompt, "salt": salt}


STATS = {"op": "stats"}
# Waits for the worker's queued saves and checks (the saver thread runs them after the request
# may have returned): before a STATS that counts them.
FLUSH = {"op": "flush"}


def loaded_after_each(results: list) -> list[int]:
    """``loaded_tokens`` added by each generate step (the runs interleave generate and stats)."""
    counts = [r["loaded_tokens"] for r in results[1::2]]
    return [b - a for a, b in zip([0, *counts], counts, strict=False)]
