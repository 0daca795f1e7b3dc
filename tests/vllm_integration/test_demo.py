"""``kvtier demo`` end to end, shrunk (one short document): exit code, JSON and chart."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_demo_runs_and_reports(tmp_path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_RUNTIME_DIR"] = str(tmp_path)
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
            "4",
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "demo.json").read_text())
    assert (out / "demo.png").stat().st_size > 0
    assert report["mismatches"] == []
    (row,) = report["rows"]
    # Question 2 reuses at least the document's whole chunks (its tail holds question 1's
    # tokens); after the restart, question 1 is served from disk beyond the whole chunks.
    assert 512 <= row["hit_tokens_warm"] < row["prompt_tokens"]
    assert row["hit_tokens_restart"] > 512
    assert row["hit_tokens_warm"] % 32 == row["hit_tokens_restart"] % 32 == 0
    assert report["summary"]["ttft_warm_s"] > 0
    # Hits by tier, as vLLM's metrics (what /metrics serves) report them: the warm question
    # from host memory, the restarted engine's from disk.
    tiers = report["hit_tokens_by_tier"]
    assert tiers["kvtier"].get("local_cpu", 0) >= row["hit_tokens_warm"]
    assert tiers["kvtier after restart"].get("local_disk", 0) >= row["hit_tokens_restart"]
