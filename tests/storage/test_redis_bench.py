"""``kvtier bench storage --tiers redis`` runs end to end on a tiny scale and writes the rows the
issue asks for (each against redis-benchmark, measured in the same run). Speed is not asserted."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from kvtier.bench import storage as bench

pytestmark = pytest.mark.redis


@pytest.mark.skipif(
    not all(shutil.which(b) for b in ("redis-server", "redis-benchmark", "redis-cli")),
    reason="redis-server, redis-benchmark and redis-cli are needed",
)
def test_redis_rows(tmp_path):
    assert (
        bench.main(["--tiers", "redis", "--shapes", "small", "--quick", "--out", str(tmp_path)])
        == 0
    )
    rows = json.loads((tmp_path / "storage.json").read_text())["results"]
    plain = [r for r in rows if "variant" not in r]
    assert {(r["tier"], r["shape"], r["op"]) for r in plain} == {
        ("redis", "small", "write"),
        ("redis", "small", "read"),
    }
    for r in plain:
        assert r["reference"].startswith("redis-benchmark -h 127.0.0.1 -p ")
        assert " -r " in r["reference"]
        assert (
            f"-d {r['segment_bytes']} " in r["reference"]
            and f"-c {r['connections']} " in r["reference"]
        )
        assert r["gbps"] > 0 and r["reference_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["reference_gbps"], rel=0.01)
    (cluster,) = [r for r in rows if r.get("variant") == "cluster-3"]
    assert cluster["op"] == "read" and cluster["batch"] == 16 and cluster["target"] == 1.0
    if importlib.util.find_spec("cryptography") is not None:
        sealed = [r for r in rows if r.get("variant") == "sealed"]
        assert sorted(r["op"] for r in sealed) == ["read", "write"]
        for r in sealed:
            assert r["reference"] == "this tier without encryption_key, same rounds"
            assert r["target"] is None and r["gbps"] > 0 and r["reference_gbps"] > 0
