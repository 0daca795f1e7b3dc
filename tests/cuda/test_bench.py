"""``kvtier bench transfer`` wiring (the measurement itself needs a GPU: nox -s bench)."""

from __future__ import annotations

import pytest
import torch

from kvtier.core.cli import main as kvtier_main
from kvtier.cuda.bench import _device_slug, _rows


def test_device_names_become_file_slugs():
    assert _device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert _device_slug("NVIDIA H200") == "h200"
    assert _device_slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"


def test_rows_carry_the_fields_the_results_promise():
    limit = {"store": 50.0, "retrieve": 50.0, "both": 90.0}
    rows = _rows("8b", "kvtier", {"store": 0.01, "both": 0.012}, 500_000_000, limit)
    assert [r["direction"] for r in rows] == ["store", "both"]
    store, both = rows
    assert {"shape", "direction", "impl", "gbps", "ratio_to_limit"} <= set(store)
    assert store["gbps"] == 50.0 and store["ratio_to_limit"] == 1.0
    assert both["gbps"] == pytest.approx(83.33, abs=0.01)
    assert both["x_one_direction_limit"] == pytest.approx(1.667, abs=0.001)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cli_says_a_gpu_is_needed(capsys):
    assert kvtier_main(["bench", "transfer"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out


def test_a_stream_keeps_at_most_in_flight_calls_outstanding_and_waits_for_all(monkeypatch):
    from kvtier.cuda import bench

    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    outstanding: list[int] = []
    peak = [0]
    issued = [0]
    waited: list[int] = []

    class Pending:
        def __init__(self, k: int) -> None:
            self.k = k

        def wait(self) -> None:
            outstanding.remove(self.k)
            waited.append(self.k)

    def issue() -> list[Pending]:
        k = issued[0]
        issued[0] += 1
        outstanding.append(k)
        peak[0] = max(peak[0], len(outstanding))
        return [Pending(k)]

    stream = bench._stream(issue, calls=7, in_flight=3)
    stream()
    stream()
    assert issued[0] == 2 * 7
    assert not outstanding and sorted(waited) == list(range(14))
    assert waited == sorted(waited)  # the oldest first
    assert peak[0] == 3  # the oldest is waited for before a 4th is issued
    with pytest.raises(ValueError, match="in_flight"):
        bench._stream(issue, calls=1, in_flight=0)


def test_ab_medians_runs_every_call_in_every_round_after_its_setting(monkeypatch):
    """The paired measurement: calls take turns round by round (so drift hits all alike), in an
    order that rotates each round, each right after its own setting is applied, and each gets
    the median of its own times."""
    from kvtier.cuda import bench

    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    log: list[str] = []
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    setting = [""]

    def call(name: str, seconds: float):  # type: ignore[no-untyped-def]
        def fn() -> None:
            assert setting[0] == name  # its own setting is in force
            log.append(name)
            clock[0] += seconds
        return fn

    def apply(name: str):  # type: ignore[no-untyped-def]
        return lambda: setting.__setitem__(0, name)

    calls = {n: (call(n, t), apply(n)) for n, t in (("a", 1.0), ("b", 2.0), ("c", 3.0))}
    medians = bench._ab_medians(calls, rounds=4, per_round=2, warmup=1)
    assert medians == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert log[:3] == ["a", "b", "c"]  # one untimed run each
    timed = log[3:]
    # The order rotates each round: every call follows every other alike.
    rounds = [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert timed == [name for order in rounds for name in order for _ in range(2)]


def test_ab_rows_give_gbps_and_the_ratio_to_the_one_way_limit(capsys):
    from kvtier.cuda import bench

    row = bench._ab_row("small", 16, "both x", 0.001, 100_000_000, 50.0, 10)
    assert row == {"shape": "small", "chunks": 16, "call": "both x", "us": 1000.0, "gbps": 100.0,
                   "x_one_way_limit": 2.0}
    assert "2.000x one-way limit" in capsys.readouterr().out


def test_ab_streamed_rows_compare_calls_with_calls_and_streams_with_streams(capsys):
    """A call is divided by the one-way copy, a stream (per call) by the streamed copy; rows
    named for one direction move the bytes once, the others twice."""
    from kvtier.cuda import bench

    mb = 1_000_000
    medians = {
        "limit one-way": 0.01, "limit one-way streamed": 0.04, "limit both": 0.02,
        "store x": 0.01, "load streamed x": 0.04, "both x": 0.01, "streamed y": 0.04,
    }
    rows = bench._ab_streamed_rows("small", 16, 100 * mb, medians, rounds=1, stream_calls=4, in_flight=2, width=20)
    ratio = {r["call"]: r["x_one_way_limit"] for r in rows}
    # one-way copy: 10 GB/s a call, 10 GB/s streamed (4 calls in 0.04 s)
    assert ratio == {"limit one-way": 1.0, "limit one-way streamed": 1.0, "limit both": 1.0,
                     "store x": 1.0, "load streamed x": 1.0, "both x": 2.0, "streamed y": 2.0}
    assert [r["us"] for r in rows] == [10000.0, 10000.0, 20000.0, 10000.0, 10000.0, 10000.0, 10000.0]
    assert "one-way limit 10.0 GB/s, streamed 10.0 GB/s" in capsys.readouterr().out


def test_ab_cases_runs_each_shape_and_chunk_count_in_turn(monkeypatch):
    from kvtier.cuda import bench

    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    seen: list[tuple[str, int]] = []

    def run(shape: str, chunks: int) -> list[dict]:
        seen.append((shape, chunks))
        return [{"shape": shape, "chunks": chunks}]

    rows = bench._ab_cases(["small:16", "8b:4"], run)
    assert seen == [("small", 16), ("8b", 4)]
    assert rows == [{"shape": "small", "chunks": 16}, {"shape": "8b", "chunks": 4}]


def test_settings_are_read_as_the_connectors_attribute_types():
    from kvtier.cuda import bench

    class Conn:
        _flag = False
        _bytes = 0
        _lead = "load"
        _odd = 1.5

    conn = Conn()
    got = bench._settings(" _flag=on, _bytes=4MiB ,_lead=store,", conn)
    assert got == {"_flag": True, "_bytes": 4 << 20, "_lead": "store"}
    assert bench._settings("_flag=0,_bytes=12", conn) == {"_flag": False, "_bytes": 12}
    assert bench._settings("", conn) == {}
    for spec, named in [
        ("_nope=1", "'_nope'"), ("_flag=maybe", "'_flag'"), ("_bytes=four", "'_bytes'"),
        ("_odd=2", "'_odd'"), ("_flag", "'_flag'"), ("=1", "'=1'"),
    ]:
        with pytest.raises(ValueError, match=named):
            bench._settings(spec, conn)
