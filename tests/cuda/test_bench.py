"""``kvtier bench transfer`` wiring (the measurement itself needs a GPU: nox -s bench): its views
are vLLM's, its rows carry their fields, the targets are read from the worst layout."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from fixtures.kv_views import replica_views
from kvtier.bench.transfer import _rows, _threaded, target_check
from kvtier.bench.transfer_cases import Case, Pair, device_slug, layout_of, vllm_views
from kvtier.core.cli import main as kvtier_main
from kvtier.core.layout import PagedLayout


def test_device_names_become_file_slugs():
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"


@pytest.mark.parametrize("paged", list(PagedLayout), ids=lambda p: p.value)
@pytest.mark.parametrize("shape", ["8b", "small"])
def test_the_bench_views_are_the_ones_vllm_builds(shape, paged):
    """The bench may not import tests/: its copy of vLLM's placement must match the replica the
    suite checks against vLLM's own allocator."""
    layout = layout_of(shape, paged)
    mine, theirs = vllm_views(layout, 3, "cpu"), replica_views(layout, 3, "cpu")
    for a, b in zip(mine, theirs, strict=True):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (
            b.shape,
            b.stride(),
            b.storage_offset(),
            b.dtype,
        )
    assert mine[0].untyped_storage().nbytes() == theirs[0].untyped_storage().nbytes()


def _case(shape: str, nbytes: int) -> Case:
    obj = SimpleNamespace(meta=SimpleNamespace(nbytes=nbytes))
    return Case(shape, layout_of(shape, PagedLayout.BLHNC), [], [obj], [], [], [])  # type: ignore[list-item]


def test_rows_carry_the_fields_the_results_promise():
    limit = {"store": 50.0, "load": 50.0, "both": 90.0}
    rows = _rows(_case("8b", 500_000_000), "kvtier", {"store": 0.01, "both": 0.012}, limit)
    assert [r["direction"] for r in rows] == ["store", "both"]
    store, both = rows
    assert {"shape", "layout", "direction", "impl", "gbps", "ratio_to_limit"} <= set(store)
    assert store["layout"] == "BLHNC"
    assert store["gbps"] == 50.0 and store["ratio_to_limit"] == 1.0
    assert both["gbps"] == pytest.approx(83.33, abs=0.01)
    assert both["x_one_direction_limit"] == pytest.approx(1.667, abs=0.001)


def test_targets_are_read_from_the_worst_layout():
    def row(shape, layout, impl, direction, ratio, x=None):  # type: ignore[no-untyped-def]
        r = {"shape": shape, "layout": layout, "impl": impl, "direction": direction}
        r["ratio_to_limit"] = ratio
        if x is not None:
            r["x_one_direction_limit"] = x
        return r

    results = [
        row("8b", "LBHNC", "kvtier", "store", 0.99),
        row("8b", "LHBNC", "kvtier", "load", 0.96),
        row("8b", "LBHNC", "kvtier", "both", 0.9, 1.8),
        row("small", "LBHNC", "kvtier", "both", 0.9, 1.65),
        row("small", "LBHNC", "limit-threads", "both", 0.7, 1.3),
        row("small", "BHLNC", "limit-threads", "both", 0.6, 1.2),
        row("8b", "LBHNC", "limit-threads", "both", 0.8, 1.4),
    ]
    streamed = [
        row("small", "BHLNC", "kvtier-streamed", "store", 0.96),
        row("small", "BHLNC", "kvtier-streamed", "both", 0.95, 1.72),
    ]
    got = target_check(results, streamed)
    assert got["8b per_call"] == {
        "target": 0.97,
        "worst": 0.96,
        "worst_at": "LHBNC load",
        "met": False,
    }
    assert got["small streamed"]["met"] is True
    assert got["both x one-way limit"]["worst_at"] == "small LBHNC"
    # read at the worst row's shape and layout, not the lowest anywhere
    assert got["both x one-way limit"]["plain_copies_same_threads"] == 1.3
    assert got["streamed both x one-way limit"]["met"] is True
    assert got["streamed both x one-way limit"]["plain_copies_same_threads"] is None


def test_both_rows_are_also_read_against_the_copies_through_the_same_threads():
    limit = {"store": 50.0, "load": 50.0, "both": 90.0}
    case = _case("small", 500_000_000)
    rows = _rows(case, "kvtier", {"both": 0.012}, limit)
    rows += _rows(case, "limit-threads", {"both": 0.015}, limit)
    _threaded(rows, "kvtier", "limit-threads")
    assert rows[0]["x_threaded_limit"] == pytest.approx(1.25, abs=0.001)
    assert "x_threaded_limit" not in rows[1]


def test_a_pair_runs_both_calls_at_once_and_passes_on_their_errors():
    """Each call waits until the other one has started: only two threads at once get past."""
    both = threading.Barrier(2, timeout=10)
    pair = Pair(both.wait, both.wait)
    try:
        for _ in range(3):
            pair()
    finally:
        pair.close()

    def fails() -> None:
        raise RuntimeError("the load failed")

    pair = Pair(lambda: None, fails)
    try:
        with pytest.raises(RuntimeError, match="the load failed"):
            pair()
    finally:
        pair.close()


def test_a_pair_that_timed_out_refuses_later_calls():
    """A late thread would report on the next call: the pair is broken instead."""
    release = threading.Event()
    pair = Pair(lambda: None, lambda: release.wait(10), timeout=0.05)
    try:
        with pytest.raises(TimeoutError):
            pair()
        release.set()
        with pytest.raises(RuntimeError, match="timed out earlier"):
            pair()
    finally:
        release.set()
        pair.close()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without a GPU"
)
def test_cli_says_a_gpu_is_needed(capsys):
    assert kvtier_main(["bench", "transfer"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out


def test_layouts_are_named_as_vllm_names_them():
    from kvtier.bench import transfer as bench

    with pytest.raises(SystemExit):
        bench.main(["--layouts", "flash_nhd"])
