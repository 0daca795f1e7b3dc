"""``kvtier demo`` end to end, shrunk (one document of 700 tokens): its own check, JSON and chart.

The demo runs on its own settings (its model, bf16, block size 32: on a CPU with AMX vLLM picks
its ``amx`` attention for these) and its own check: each kvtier answer equals vLLM's own prefix
cache on the same requests. The negative control runs the same demo with zeros stored over
everything its hits load: the check must then fail.

vLLM runs in process here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a multiprocess engine starts
several times slower on 2 cores (docs/testing.md), and nothing the demo checks, draws or prints
depends on the mode. kvtier across processes is tested in test_e2e_tp.py (TP 2: front end,
scheduler and two workers in four processes), test_e2e_verify.py (multiprocess mode) and
test_serve_metrics.py (``vllm serve``, its metrics crossing from the engine's process);
``python3 dev.py demo`` runs the demo as users do (multiprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's cache directory, shared by the module's runs: the model is built once."""
    pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")
    return tmp_path_factory.mktemp("demo-cache")


def run_demo(
    cache: Path, tmp_path: Path, *extra: str, in_process: bool = False
) -> tuple[int, str, dict[str, Any], str]:
    """``(exit code, the output's tail, demo.json, everything the screen showed)``; vLLM's
    default multiprocess mode, or ``in_process`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_RUNTIME_DIR"] = str(tmp_path)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.core.cli",
            "demo",
            "--docs",
            "1",
            "--doc-tokens",
            "700",
            "--max-tokens",
            "8",
            "--out",
            str(out),
            "--cache-dir",
            str(cache),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    engine_log = out / "engine.log"
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    if engine_log.exists():
        log += "\n--- engine.log ---\n" + engine_log.read_text(errors="replace")[-3000:]
    assert (out / "demo.png").stat().st_size > 0, log
    screen = proc.stdout + proc.stderr
    return proc.returncode, log, json.loads((out / "demo.json").read_text()), screen


def test_demo_answers_equal_vllms_prefix_cache(demo_cache, tmp_path) -> None:
    rc, log, report, screen = run_demo(demo_cache, tmp_path, in_process=True)
    assert rc == 0, log
    # The screen is kvtier's: its table and verdict, no engine log line; those are one file away.
    words = " ".join(screen.split())
    assert "kvtier demo: time to first token" in words, screen
    assert "identical to vLLM's own prefix cache on the same requests: yes" in words, screen
    assert not [line for line in screen.splitlines() if "WARNING" in line or " INFO " in line]
    engine_log = tmp_path / "out" / "engine.log"
    assert str(engine_log) in words
    assert "vllm" in engine_log.read_text().lower()
    assert (report["block_size"], report["dtype"]) == (32, "bfloat16")
    assert report["attention_isa"] in ("vec", "vec16", "amx"), report["attention_isa"]
    assert report["mismatches"] == []
    # Every request was checked (cold, warm, restart), each hit against vLLM's prefix cache
    # hitting exactly as many tokens: the same computation with only kvtier switched off.
    checks = report["checks"]
    assert [c["request"] for c in checks] == ["q1", "q2", "q1 again"]
    assert all(c["same_as_prefix_cache"] for c in checks)
    for c in checks:
        assert c["hit_tokens_kvtier"] == c["hit_tokens_prefix_cache"], c
    # A full recompute is information only: counted, never failed on.
    assert set(report["differ_from_recompute"]) == {"kvtier", "vllm_prefix_cache", "of"}
    assert report["differ_from_recompute"]["of"] == 3
    (row,) = report["rows"]
    # Question 2 reuses at least the document's whole chunks (its tail holds question 1's
    # tokens); after the restart, question 1 is served from disk beyond the whole chunks.
    assert 512 <= row["hit_tokens_warm"] < row["prompt_tokens"]
    assert row["hit_tokens_restart"] > 512
    assert row["hit_tokens_warm"] % 32 == row["hit_tokens_restart"] % 32 == 0
    assert row["hit_tokens_warm"] == row["hit_tokens_prefix_cache_warm"]
    summary = report["summary"]
    assert summary["ttft_warm_s"] > 0
    assert summary["warm_over_prefix_cache"] == pytest.approx(
        summary["ttft_warm_s"] / summary["ttft_prefix_cache_warm_s"]
    )
    assert "kvtier warm / vLLM's prefix cache warm" in words
    # Hits by tier, as vLLM's metrics (what /metrics serves) report them: the warm question
    # from host memory, the restarted engine's from disk.
    tiers = report["hit_tokens_by_tier"]
    assert tiers["kvtier"].get("local_cpu", 0) >= row["hit_tokens_warm"]
    assert tiers["kvtier after restart"].get("local_disk", 0) >= row["hit_tokens_restart"]


def test_demo_check_fails_when_the_loaded_kv_is_corrupt(demo_cache, tmp_path) -> None:
    """The negative control: the same demo with zeros stored over what each hit loads. The hits
    are still taken, and the check fails on both of them (the cold question is untouched). The
    full recompute, information only, is not run."""
    rc, log, bad, _ = run_demo(demo_cache, tmp_path, "--corrupt-loaded-kv", in_process=True)
    assert rc == 1, log
    assert bad["corrupt_loaded_kv"] is True
    assert bad["differ_from_recompute"] is None and bad["summary"]["ttft_no_kvtier_s"] is None
    (row,) = bad["rows"]
    assert row["hit_tokens_warm"] == row["hit_tokens_prefix_cache_warm"] >= 512
    assert row["hit_tokens_restart"] > 512
    assert sorted((m["phase"], m["request"]) for m in bad["mismatches"]) == [
        ("kvtier", "q2"),
        ("kvtier after restart", "q1 again"),
    ]
