"""Rounds of ``kvtier bench serve``: each mode's server started once per round, and the rounds
combined into one row per workload x mode x concurrency.

On a small shared machine two servers of the same build differ by more than some targets
(workload B's 3%): one run per mode cannot tell kvtier's cost from the server it happened to
get. With ``--rounds N`` every mode gets N servers, in an order that reverses every other round
(a slow drift of the machine then weighs on every mode alike), and each ratio to vLLM's prefix
cache is taken within a round, where both servers ran side by side, before the rounds are
combined.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypeGuard

from kvtier.bench.serve_report import KVTIER_MODES, LIMIT, REFERENCE, add_ratios


def schedule(modes: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, mode)`` in the order the servers run: the modes in order, then reversed."""
    out: list[tuple[int, str]] = []
    for k in range(rounds):
        out += [(k, m) for m in (modes if k % 2 == 0 else list(reversed(modes)))]
    return out


def combine(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload x mode x concurrency from ``runs`` (rows with a ``round``): each
    number is the median over the rounds; each ``*_vs_prefix_cache`` and ``*_vs_prefix_cache_all``
    ratio (and a kvtier mode's ``*_vs_lmcache``) is the median of the ratios within each round, with ``<ratio>_range`` (its
    lowest and highest) beside it; ``rounds`` is how many rounds the row has. Adds the per-round
    ratios to ``runs``."""
    for k in sorted({r["round"] for r in runs}):
        rows = [r for r in runs if r["round"] == k]
        add_ratios(rows)
        add_ratios(rows, LIMIT)
        add_ratios(rows, "lmcache", KVTIER_MODES)
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["mode"], r["concurrency"]), []).append(r)
    out = []
    for (workload, mode, c), rows in groups.items():
        merged = _median(rows)
        merged.pop("round", None)
        merged.update(workload=workload, mode=mode, concurrency=c, rounds=len(rows))
        if mode != REFERENCE:
            ends = (f"_vs_{REFERENCE}", f"_vs_{LIMIT}", "_vs_lmcache")
            for key in [k for k in merged if k.endswith(ends)]:
                values = [r[key] for r in rows if r.get(key) is not None]
                merged[f"{key}_range"] = [min(values), max(values)] if values else None
        out.append(merged)
    return out


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Field by field: the median of the numbers (None where no row has one), dicts merged the
    same way, anything else from the first row."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        values = [r.get(key) for r in rows]
        numbers = [v for v in values if _is_number(v)]
        dicts = [v for v in values if isinstance(v, dict)]
        if numbers:
            out[key] = statistics.median(numbers)
        elif dicts:
            out[key] = _median(dicts)
        else:
            out[key] = values[0]
    return out


def _is_number(v: object) -> TypeGuard[float]:
    return isinstance(v, int | float) and not isinstance(v, bool)
