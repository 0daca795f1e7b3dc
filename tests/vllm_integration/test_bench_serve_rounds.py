"""``kvtier bench serve --rounds``: the servers' order, and how rounds become one row."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("prometheus_client", reason="bench serve's reports parse /metrics")

from kvtier.bench.serve_report import targets
from kvtier.bench.serve_rounds import combine, schedule


@given(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=5, unique=True), st.integers(1, 6))
def test_every_round_runs_every_mode_once_in_alternating_order(modes, rounds) -> None:
    order = schedule(modes, rounds)
    assert len(order) == len(modes) * rounds
    for k in range(rounds):
        mine = [m for r, m in order if r == k]
        assert mine == (modes if k % 2 == 0 else modes[::-1])
    # rounds run one after another
    assert [r for r, _ in order] == sorted(r for r, _ in order)


def _row(mode: str, rnd: int, rps: float, p99: float, workload: str = "B", c: int = 4) -> dict:
    return {
        "workload": workload,
        "mode": mode,
        "concurrency": c,
        "round": rnd,
        "ttft_mean_s": p99 / 2,
        "ttft_p99_s": p99,
        "req_per_s": rps,
        "tok_per_s": rps * 600,
        "hit_rate": None,
        "kvtier_hit_tokens": {"local_cpu": rps * 10},
        "sched_p50_ms": None,
    }


positive = st.floats(0.1, 100.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(positive, positive, positive, positive), min_size=1, max_size=7))
def test_ratios_are_medians_of_the_ratios_within_each_round(rounds) -> None:
    runs = []
    for k, (pc_rps, pc_p99, kv_rps, kv_p99) in enumerate(rounds):
        runs += [_row("prefix_cache", k, pc_rps, pc_p99), _row("kvtier_eager", k, kv_rps, kv_p99)]
    rows = {r["mode"]: r for r in combine(runs)}
    kv, pc = rows["kvtier_eager"], rows["prefix_cache"]
    paired = [kv_rps / pc_rps for pc_rps, _, kv_rps, _ in rounds]
    assert kv["req_per_s_vs_prefix_cache"] == pytest.approx(statistics.median(paired))
    assert kv["req_per_s_vs_prefix_cache_range"] == pytest.approx([min(paired), max(paired)])
    p99 = [kv_p99 / pc_p99 for _, pc_p99, _, kv_p99 in rounds]
    assert kv["ttft_p99_vs_prefix_cache"] == pytest.approx(statistics.median(p99))
    assert kv["req_per_s"] == pytest.approx(statistics.median(r[2] for r in rounds))
    assert kv["kvtier_hit_tokens"]["local_cpu"] == pytest.approx(kv["req_per_s"] * 10)
    assert kv["rounds"] == pc["rounds"] == len(rounds)
    assert "round" not in kv and kv["hit_rate"] is None and kv["sched_p50_ms"] is None
    assert "req_per_s_vs_prefix_cache" not in pc


def test_a_ratio_of_medians_is_not_what_is_reported() -> None:
    """Pairing matters: here the medians' ratio is 0.75, the rounds' ratios 1.5, 0.5, 1.1."""
    runs = []
    for k, (pc, kv) in enumerate([(1.0, 1.5), (2.0, 1.0), (3.0, 3.3)]):
        runs += [_row("prefix_cache", k, pc, 1.0), _row("kvtier_lazy", k, kv, 1.0)]
    kv_row = next(r for r in combine(runs) if r["mode"] == "kvtier_lazy")
    assert kv_row["req_per_s_vs_prefix_cache"] == pytest.approx(1.1)
    targets_by = {t["target"]: t for t in targets(combine(runs))}
    b = targets_by["B c=4 kvtier_lazy req_per_s_vs_prefix_cache within 3%"]
    assert b["met"] is True and b["range"] == pytest.approx([0.5, 1.5])  # no slower than 0.97x


def test_rows_of_different_runs_do_not_mix() -> None:
    runs = [
        _row("prefix_cache", 0, 1.0, 1.0, "A", 4),
        _row("prefix_cache", 0, 2.0, 1.0, "A", 16),
        _row("kvtier_eager", 0, 3.0, 1.0, "A", 4),
        _row("kvtier_eager", 0, 3.0, 1.0, "A", 16),
        _row("prefix_cache", 0, 4.0, 1.0, "B", 4),
    ]
    rows = {(r["workload"], r["mode"], r["concurrency"]): r for r in combine(runs)}
    assert len(rows) == 5
    assert rows[("A", "kvtier_eager", 4)]["req_per_s_vs_prefix_cache"] == pytest.approx(3.0)
    assert rows[("A", "kvtier_eager", 16)]["req_per_s_vs_prefix_cache"] == pytest.approx(1.5)


def test_kvtier_is_compared_with_lmcache_within_each_round() -> None:
    """Round by round: kvtier faster in one, slower in two (by less than it won by): the median
    of the paired ratios says it did not beat LMCache, whatever the medians of the rows say."""
    runs = []
    for k, (lm, kv) in enumerate([(4.0, 3.0), (2.0, 2.2), (3.0, 3.3)]):
        runs += [_row("lmcache", k, 1.0, lm, "A", 4), _row("kvtier_eager", k, 1.0, kv, "A", 4)]
    rows = {r["mode"]: r for r in combine(runs)}
    kv = rows["kvtier_eager"]
    assert kv["ttft_mean_vs_lmcache"] == pytest.approx(1.1)
    assert kv["ttft_mean_vs_lmcache_range"] == pytest.approx([0.75, 1.1])
    assert "ttft_mean_vs_lmcache" not in rows["lmcache"]
    beats = next(t for t in targets(list(rows.values())) if "ahead of lmcache" in t["target"])
    assert beats["met"] is False


def test_every_mode_is_also_a_ratio_to_the_all_in_memory_limit() -> None:
    """vLLM's prefix cache with KV memory for the whole working set is the limit of any
    offloading: kvtier's req/s over it, within each round, is a target at c=4."""
    from kvtier.bench.serve_launcher import ServeConfig, server_args

    runs = []
    for k, (limit, kv) in enumerate([(10.0, 9.5), (12.0, 10.0), (11.0, 10.5)]):
        runs += [
            _row("prefix_cache_all", k, limit, 1.0, "A", 4),
            _row("kvtier_eager", k, kv, 1.0, "A", 4),
        ]
    rows = {r["mode"]: r for r in combine(runs)}
    kv = rows["kvtier_eager"]
    # Within each round: 0.95, 0.83, 0.95 (not the ratio of the medians, 10 / 11)
    assert kv["req_per_s_vs_prefix_cache_all"] == pytest.approx(0.95)
    assert kv["req_per_s_vs_prefix_cache_all_range"] == pytest.approx([10 / 12, 10.5 / 11])
    limit = next(t for t in targets(list(rows.values())) if "prefix_cache_all" in t["target"])
    assert limit["met"] is True
    cfg = ServeConfig(
        "m", kv_cache_bytes=16 << 20, max_model_len=2048, all_in_memory_bytes=64 << 20
    )
    for mode, want in (("prefix_cache", 16 << 20), ("prefix_cache_all", 64 << 20)):
        args = server_args(mode, cfg)
        assert args[args.index("--kv-cache-memory-bytes") + 1] == str(want)
