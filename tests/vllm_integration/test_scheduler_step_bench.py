"""``benchmarks/scheduler_step.py`` runs end to end and records every case (it is not a timing
test: the numbers are only checked to be measured, never against a bound)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_step.py"


def test_scheduler_step_benchmark_records_every_case(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("scheduler_step_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--lengths", "512", "--repeat", "2", "--running", "3", "--step-tokens", "256"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "scheduler-step.json").read_text())
    cases = {r["case"] for r in report["results"]}
    assert cases == {"prefill_step", "report", "hit_probe", "hit_answer", "decode"}
    for row in report["results"]:
        assert row["prompt_tokens"] == 512
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert row["reference_ms"] > 0
    assert (tmp_path / "scheduler-step.png").stat().st_size > 0
