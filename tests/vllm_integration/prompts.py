"""Prompts and helpers the vLLM end-to-end tests share (block size 32, chunk 256).

A 700-token prompt stores chunks [0,256) [256,512) and the block-aligned tail [512,672); a repeat
loads 672 tokens (the most that leaves the last token to recompute). SHARED shares DOC's first
400 tokens: it hits DOC's first chunk and, through the second chunk's aliases, the 4 whole blocks
of the second it shares (it diverges inside it).
"""

from __future__ import annotations

import random

RNG = random.Random(1234)
DOC = [RNG.randrange(3, 3000) for _ in range(700)]
SHARED = DOC[:400] + [RNG.randrange(3, 3000) for _ in range(200)]  # shares 400 tokens with DOC
OTHER = [RNG.randrange(3, 3000) for _ in range(500)]
FULL_HIT = (len(DOC) - 1) // 32 * 32  # 672
PARTIAL_HIT = 384  # SHARED's whole blocks in common with DOC (it diverges inside DOC's 2nd chunk)


TOLERANCE_FLOOR = 5e-3  # where the prefix cache moves nothing, a partial hit may still move a bit


def logprob_gap(a: dict, b: dict) -> float:
    """Largest difference between two runs' per-token logprobs."""
    return max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)), default=0.0)


def assert_partial_hit_close(result: dict, reference: dict, tolerance: float) -> None:
    assert result["tokens"] == reference["tokens"]
    assert logprob_gap(result, reference) <= tolerance


def prefix_cache_tolerance(run_engine, reference_shared: dict, **mode) -> float:
    """Twice the largest logprob move of vLLM's own prefix cache on the partial-hit prompt (it
    reuses DOC's blocks for SHARED), in the given mode, no kvtier; at least the floor."""
    out = run_engine(
        {"kvtier": None, "prefix_caching": True, **mode, "steps": [gen(DOC), gen(SHARED)]}
    )
    assert out[1]["tokens"] == reference_shared["tokens"]
    return max(2 * logprob_gap(out[1], reference_shared), TOLERANCE_FLOOR)


def gen(prompt: list[int], salt: str | None = None) -> dict:
    return {"op": "generate", "prompt": prompt, "salt": salt}


STATS = {"op": "stats"}


def loaded_after_each(results: list) -> list[int]:
    """``loaded_tokens`` added by each generate step (the runs interleave generate and stats)."""
    counts = [r["loaded_tokens"] for r in results[1::2]]
    return [b - a for a, b in zip([0, *counts], counts, strict=False)]
