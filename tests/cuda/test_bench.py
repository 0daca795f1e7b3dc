"""``kvtier bench transfer`` wiring (the measurement itself needs a GPU: nox -s bench)."""

from __future__ import annotations

import pytest
import torch

from kvtier.core.cli import main as kvtier_main
from kvtier.cuda.bench import _rows, device_slug


def test_device_names_become_file_slugs():
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"


def test_rows_carry_the_fields_the_results_promise():
    limit = {"store": 50.0, "retrieve": 50.0, "both": 90.0}
    rows = _rows("8b", "kvtier", {"store": 0.01, "both": 0.012}, 500_000_000, limit)
    assert [r["direction"] for r in rows] == ["store", "both"]
    store, both = rows
    assert {"shape", "direction", "impl", "gbps", "ratio_to_limit"} <= set(store)
    assert store["gbps"] == 50.0 and store["ratio_to_limit"] == 1.0
    assert both["gbps"] == pytest.approx(83.33, abs=0.01)
    assert both["x_one_direction_limit"] == pytest.approx(1.667, abs=0.001)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without a GPU"
)
def test_cli_says_a_gpu_is_needed(capsys):
    assert kvtier_main(["bench", "transfer"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out


def test_a_stream_keeps_at_most_in_flight_calls_outstanding_and_waits_for_all(monkeypatch):
    from kvtier.cuda import bench_cases

    monkeypatch.setattr(bench_cases.torch.cuda, "synchronize", lambda: None)
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

    stream = bench_cases.stream(issue, calls=7, in_flight=3)
    stream()
    stream()
    assert issued[0] == 2 * 7
    assert not outstanding and sorted(waited) == list(range(14))
    assert waited == sorted(waited)  # the oldest first
    assert peak[0] == 3  # the oldest is waited for before a 4th is issued
    with pytest.raises(ValueError, match="in_flight"):
        bench_cases.stream(issue, calls=1, in_flight=0)


def test_interleaved_medians_runs_every_call_in_every_round_after_its_setting(monkeypatch):
    """The paired measurement: calls take turns round by round (so drift hits all alike), in an
    order that rotates each round, each right after its own setting is applied, and each gets
    the median of its own times."""
    from kvtier.cuda import bench_cases

    monkeypatch.setattr(bench_cases.torch.cuda, "synchronize", lambda: None)
    log: list[str] = []
    clock = [0.0]
    monkeypatch.setattr(bench_cases.time, "perf_counter", lambda: clock[0])
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
    medians = bench_cases.interleaved_medians(calls, rounds=4, per_round=2, warmup=1)
    assert medians == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert log[:3] == ["a", "b", "c"]  # one untimed run each
    timed = log[3:]
    # The order rotates each round: every call follows every other alike.
    rounds = [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert timed == [name for order in rounds for name in order for _ in range(2)]
