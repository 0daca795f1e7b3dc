"""``kvtier ls`` / ``stats`` / ``clear`` against a real disk directory and a real redis-server,
both filled by a CacheEngine, while that engine is still running and after it stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvtier.core import CacheEngine, KVLayout, load_config
from kvtier.core.cli import main as kvtier
from kvtier.core.keys import model_id, salt_id
from kvtier.core.platform.cpu import CPUPlatform

BLOCK, CHUNK, NUM_BLOCKS = 16, 32, 64
LAYOUT = KVLayout(
    num_layers=2,
    num_kv_heads=2,
    head_size=8,
    dtype="float16",
    block_size=BLOCK,
    paged_layout="LBHNC",
)
MODEL = "org/test-model"
PROMPTS = {  # salt -> tokens (3 full chunks + a 1-block tail each: 4 chunk entries)
    "tenant-a": list(range(1000, 1000 + 3 * CHUNK + BLOCK)),
    "tenant-b": list(range(5000, 5000 + 3 * CHUNK + BLOCK)),
    None: list(range(9000, 9000 + 3 * CHUNK + BLOCK)),
}
PER_PROMPT = 4
ALIASES = 3  # one alias entry per full chunk (its first block: kvtier.core.keys.aliases)
ENTRIES = PER_PROMPT + ALIASES


def engine(tmp_path, **cfg) -> CacheEngine:
    config = load_config(
        env={},
        overrides={
            "chunk_size": CHUNK,
            "local_cpu_size_gb": 0.01,
            "local_disk_path": str(tmp_path / "disk"),
            **cfg,
        },
    )
    e = CacheEngine(config, LAYOUT, model=MODEL, platform=CPUPlatform())
    g = torch.Generator().manual_seed(0)
    e.register_kv_caches(
        [
            torch.randn(LAYOUT.expected_cache_shape(NUM_BLOCKS), generator=g).to(torch.float16)
            for _ in range(LAYOUT.num_layers)
        ]
    )
    return e


def fill(e: CacheEngine) -> None:
    for salt, tokens in PROMPTS.items():
        assert e.store(tokens, torch.arange(len(tokens)), scope=salt) == len(tokens)
    assert e.storage.flush(30), e.storage.last_flush


def lower_hits(e: CacheEngine, salt) -> int:
    """Chunks of ``salt``'s prompt the lower tiers hold, as the running engine sees them."""
    keys = [s.key for s in e.store_spans(PROMPTS[salt], salt)]
    e.storage.host.remove(keys)
    return e.storage.prefix_hits(keys)


def run(capsys, *argv: str) -> tuple[int, object]:
    rc = kvtier(list(argv))
    out = capsys.readouterr().out
    return rc, (json.loads(out) if "--json" in argv else out)


def groups_by_salt(result) -> dict:
    (source,) = result
    return {g["salt_id"]: g for g in source["groups"]}


def check_stats(result, files_bytes: int | None = None) -> None:
    groups = groups_by_salt(result)
    assert set(groups) == {salt_id(s) for s in PROMPTS}
    for g in groups.values():
        assert g["model"] == model_id(MODEL)
        assert g["chunks"] == PER_PROMPT and g["entries"] >= ENTRIES
        assert g["aliases"] == ALIASES
        assert g["bytes"] > PER_PROMPT * LAYOUT.chunk_nbytes(BLOCK)
        assert g["oldest_s"] is not None and g["newest_s"] is not None
    if files_bytes is not None:
        assert sum(g["bytes"] for g in groups.values()) == files_bytes


def test_disk_stats_ls_and_clear_one_salt_on_a_running_deployment(tmp_path, capsys):
    e = engine(tmp_path)
    try:
        fill(e)
        disk = str(tmp_path / "disk")
        files = [p for p in (tmp_path / "disk").rglob("*.kvc")]
        rc, result = run(capsys, "stats", "--disk", disk, "--json")
        assert rc == 0
        check_stats(result, sum(p.stat().st_size for p in files))

        rc, result = run(capsys, "ls", "--disk", disk, "--json", "--salt", "tenant-a")
        (source,) = result
        assert rc == 0 and len(source["entries"]) == ENTRIES
        assert {x["salt_id"] for x in source["entries"]} == {salt_id("tenant-a")}
        chunk_keys = {x["key"] for x in source["entries"] if "@alias-" not in x["key"]}
        assert chunk_keys == {
            s.key.to_string() for s in e.store_spans(PROMPTS["tenant-a"], "tenant-a")
        }

        rc, text = run(capsys, "stats", "--disk", disk)
        assert rc == 0 and f"{3 * PER_PROMPT} chunks" in text and salt_id("tenant-b") in text

        rc, result = run(
            capsys, "clear", "--disk", disk, "--salt", "tenant-a", "--dry-run", "--json"
        )
        assert result[0]["matched"] == ENTRIES and result[0]["removed"] == 0
        assert lower_hits(e, "tenant-a") == PER_PROMPT

        rc, result = run(capsys, "clear", "--disk", disk, "--salt", "tenant-a", "--json")
        assert rc == 0 and result[0]["removed"] == ENTRIES
        # the running engine's disk tier no longer reports them; the other salts are untouched
        assert lower_hits(e, "tenant-a") == 0
        assert lower_hits(e, "tenant-b") == PER_PROMPT
        assert lower_hits(e, None) == PER_PROMPT
    finally:
        e.close()
    # a restarted engine: salt a misses, the others hit
    e2 = engine(tmp_path)
    try:
        assert e2.lookup(PROMPTS["tenant-a"], scope="tenant-a") == 0
        assert e2.lookup(PROMPTS["tenant-b"], scope="tenant-b") == len(PROMPTS["tenant-b"])
    finally:
        e2.close()
    # clear everything of a stopped deployment, through the installed command
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.core.cli",
            "clear",
            "--disk",
            str(tmp_path / "disk"),
            "--salt-id",
            "-",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"removed {ENTRIES} of {ENTRIES}" in out.stdout
    rc, result = run(capsys, "clear", "--disk", disk, "--json")
    assert result[0]["removed"] == ENTRIES  # tenant-b's
    assert not list((tmp_path / "disk").rglob("*.kvc"))


def test_node_tier_by_flag_and_by_config(tmp_path, capsys, node_dir, monkeypatch):
    """The node tier's directory is read like a disk tier's: by ``--node``, or from the config
    when it names the ``node`` tier."""
    e = engine(tmp_path, tiers=["local_cpu", "node"], node_path=str(node_dir))
    try:
        fill(e)
        files = list(node_dir.rglob("*.kvc"))
        rc, result = run(capsys, "stats", "--node", str(node_dir), "--json")
        assert rc == 0
        check_stats(result, sum(p.stat().st_size for p in files))
        monkeypatch.setenv("KVTIER_TIERS", "local_cpu,node")
        monkeypatch.setenv("KVTIER_NODE_PATH", str(node_dir))
        rc, result = run(capsys, "clear", "--salt", "tenant-a", "--json")
        assert rc == 0 and result[0]["removed"] == ENTRIES
        assert lower_hits(e, "tenant-a") == 0
        assert lower_hits(e, "tenant-b") == PER_PROMPT
    finally:
        e.close()


def test_disk_lists_unreadable_entries_and_refuses_a_missing_directory(tmp_path, capsys):
    e = engine(tmp_path)
    try:
        fill(e)
    finally:
        e.close()
    ns = next(p for p in (tmp_path / "disk").iterdir() if p.is_dir())
    (ns / ("0" * 32 + ".kvc")).write_bytes(b"garbage")
    os.mkfifo(ns / ("1" * 32 + ".kvc"))  # never opened for reading: no hang
    rc, result = run(capsys, "stats", "--disk", str(tmp_path / "disk"), "--json")
    groups = groups_by_salt(result)
    assert groups[None]["entries"] == 2 and groups[None]["chunks"] == 0
    rc, result = run(capsys, "clear", "--disk", str(tmp_path / "disk"), "--json")
    assert result[0]["removed"] == 3 * ENTRIES + 2
    rc, _ = run(capsys, "stats", "--disk", str(tmp_path / "nowhere"))
    assert rc == 2


def test_redis_stats_ls_and_clear(tmp_path, capsys, redis_clean):
    e = engine(tmp_path, tiers=["local_cpu", "redis"], redis_url=redis_clean.url)
    try:
        fill(e)
        redis_clean.command("RPUSH", "kvtier:not-a-chunk", "x")  # a wrong-type key under the prefix
        redis_clean.command("SET", "other:key", "untouched")  # outside the prefix
        rc, result = run(capsys, "stats", "--redis", redis_clean.url, "--json")
        assert rc == 0
        groups = groups_by_salt(result)
        assert groups.pop(None)["entries"] == 1
        check_stats([{"groups": list(groups.values())}])

        rc, result = run(capsys, "ls", "--redis", redis_clean.url, "--json", "--model", MODEL)
        assert len(result[0]["entries"]) >= 3 * PER_PROMPT
        assert all(x["key"] for x in result[0]["entries"])

        rc, result = run(
            capsys, "clear", "--redis", redis_clean.url, "--salt", "tenant-b", "--json"
        )
        assert rc == 0 and result[0]["matched"] >= PER_PROMPT
        assert lower_hits(e, "tenant-b") == 0
        assert lower_hits(e, "tenant-a") == PER_PROMPT

        rc, result = run(capsys, "clear", "--redis", redis_clean.url, "--json")
        assert lower_hits(e, "tenant-a") == 0 and lower_hits(e, None) == 0
        assert redis_clean.command("EXISTS", "kvtier:not-a-chunk") == 0
        assert redis_clean.command("GET", "other:key") == "untouched"
    finally:
        e.close()


def test_redis_down_is_an_error_naming_the_source(capsys):
    rc = kvtier(["stats", "--redis", "redis://user:hunter2@127.0.0.1:1/0"])
    err = capsys.readouterr().err
    assert rc == 1 and "redis" in err and "hunter2" not in err


def test_bad_arguments_are_refused(capsys):
    assert kvtier(["stats", "--redis", "redis://127.0.0.1:99999"]) == 2
    assert "redis_url" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kvtier(["ls", "--salt", "a", "--salt-id", "b", "--disk", "."])


def test_redis_cluster_stats_and_clear_every_shard(tmp_path, capsys, redis_cluster):
    redis_cluster.flush()
    e = engine(
        tmp_path, tiers=["local_cpu", "redis"], redis_url=redis_cluster.url, redis_cluster=True
    )
    try:
        fill(e)
        rc, result = run(capsys, "stats", "--redis", redis_cluster.url, "--cluster", "--json")
        assert rc == 0
        check_stats(result)
        rc, result = run(
            capsys,
            "clear",
            "--redis",
            redis_cluster.url,
            "--cluster",
            "--salt",
            "tenant-a",
            "--json",
        )
        assert rc == 0 and result[0]["matched"] >= PER_PROMPT
        assert lower_hits(e, "tenant-a") == 0
        assert lower_hits(e, "tenant-b") == PER_PROMPT
    finally:
        e.close()
