"""``kvtier ls``, ``kvtier stats`` and ``kvtier clear``: look into and clear a disk-tier directory
(``--disk PATH``), the node tier's (``--node PATH``: the same files, in shared memory) or a Redis
key prefix (``--redis URL [--prefix P]``), of a stopped or running deployment. Without
``--disk``/``--node``/``--redis`` the tiers of the kvtier config (``--config FILE``,
``KVTIER_*`` variables) are used. ``--salt TEXT`` (the cache salt requests carry) or
``--salt-id ID`` (as ``stats`` shows it; ``-`` for unsalted chunks) and ``--model NAME`` narrow
every command to those chunks. The Redis user name and password come from the config
(``KVTIER_REDIS_USERNAME``/``KVTIER_REDIS_PASSWORD``), never from the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvtier.core.config import KVTierConfig, load_config, mask_url
from kvtier.core.errors import ConfigError
from kvtier.core.keys import model_id, salt_id
from kvtier.storage.inventory import DiskInventory, Entry, RedisInventory, select, summarize

_DEFAULT_PREFIX = "kvtier:"


def _parser(command: str, about: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"kvtier {command}", description=about)
    p.add_argument("--disk", metavar="PATH", help="a disk-tier directory (local_disk_path)")
    p.add_argument("--node", metavar="PATH", help="a node-tier directory (node_path)")
    p.add_argument(
        "--redis", metavar="URL", help="a Redis/Valkey URL (redis://, rediss://, unix://)"
    )
    p.add_argument(
        "--prefix", help=f"the Redis key prefix (default: the config's, else {_DEFAULT_PREFIX!r})"
    )
    p.add_argument("--cluster", action="store_true", help="the Redis URL is a Redis Cluster node")
    p.add_argument(
        "--config", metavar="FILE", help="a kvtier config file (else $KVTIER_CONFIG_FILE)"
    )
    who = p.add_mutually_exclusive_group()
    who.add_argument("--salt", help="only the chunks of this cache salt")
    who.add_argument("--salt-id", help="only the chunks of this salt id ('-': no salt)")
    p.add_argument("--model", help="only the chunks of this model")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _sources(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """``[(label, inventory)]`` for the tiers named on the command line, else in the config."""
    cfg: KVTierConfig = load_config(args.config)
    disk, node, url = args.disk, args.node, args.redis
    if disk is None and node is None and url is None:
        disk = str(cfg.disk_path()) if "local_disk" in cfg.tiers else None
        node = str(cfg.node_dir()) if "node" in cfg.tiers else None
        url = cfg.redis_url if "redis" in cfg.tiers else None
        if disk is None and node is None and url is None:
            raise ConfigError(
                "tiers",
                cfg.tiers,
                "has none of local_disk, node, redis: pass --disk, --node or --redis",
            )
    out: list[tuple[str, Any]] = []
    if node is not None:
        out.append((f"node {node}", DiskInventory(node)))
    if disk is not None:
        out.append((f"disk {disk}", DiskInventory(disk)))
    if url is not None:
        prefix = args.prefix
        if prefix is None:
            prefix = str(cfg.backend_options.get("redis", {}).get("key_prefix", _DEFAULT_PREFIX))
        if args.redis is not None:
            load_config(
                args.config, overrides={"redis_url": url}
            )  # the URL is checked like config's
        inv = RedisInventory.connect(
            url,
            prefix,
            cluster=args.cluster or cfg.redis_cluster,
            username=cfg.redis_username,
            password=cfg.redis_password,
            timeout_s=max(cfg.redis_timeout_s, 5.0),
        )
        out.append((f"redis {mask_url(url)} prefix {prefix!r}", inv))
    return out


def _chosen(args: argparse.Namespace, inv: Any) -> list[Entry]:
    sid = salt_id(args.salt) if args.salt is not None else args.salt_id
    model = model_id(args.model) if args.model is not None else None
    return select(inv.entries(), salt_id=sid, model=model)


def _age(s: float | None) -> str:
    if s is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def _run(command: str, about: str, argv: list[str], body: Any, *, dry_run: bool = False) -> int:
    parser = _parser(command, about)
    if dry_run:
        parser.add_argument("--dry-run", action="store_true", help="count what would be removed")
    args = parser.parse_args(argv)
    try:
        sources = _sources(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"kvtier {command}: {e}", file=sys.stderr)
        return 2
    results = []
    rc = 0
    for label, inv in sources:
        try:
            results.append(body(args, label, inv))
        except Exception as e:  # a server down or a directory gone: say which, go on
            print(f"kvtier {command}: {label}: {type(e).__name__}: {e}", file=sys.stderr)
            rc = 1
        finally:
            inv.close()
    if args.json:
        print(json.dumps(results, indent=1))
    return rc


def _ls(args: argparse.Namespace, label: str, inv: Any) -> dict[str, Any]:
    entries = _chosen(args, inv)
    if not args.json:
        print(f"# {label}: {len(entries)} entries")
        for e in sorted(entries, key=lambda e: (e.age_s is None, -(e.age_s or 0))):
            model = e.key.model if e.key else "?"
            salt = e.key.salt_id if e.key else "?"
            print(f"{_age(e.age_s):>7} {e.nbytes:>12} {model} {salt} {e.where}")
    return {"source": label, "entries": [e.as_dict() for e in entries]}


def _stats(args: argparse.Namespace, label: str, inv: Any) -> dict[str, Any]:
    rows = summarize(_chosen(args, inv))
    if not args.json:
        chunks = sum(r["chunks"] for r in rows)
        nbytes = sum(r["bytes"] for r in rows)
        print(f"# {label}: {chunks} chunks, {nbytes} bytes")
        print(
            f"{'model':<32} {'salt id':<14} {'chunks':>8} {'bytes':>14} {'oldest':>8} {'newest':>8}"
        )
        for r in rows:
            model = r["model"] if r["model"] is not None else "(unreadable)"
            salt = r["salt_id"] if r["salt_id"] is not None else ""
            print(
                f"{model:<32} {salt:<14} {r['chunks']:>8} {r['bytes']:>14} "
                f"{_age(r['oldest_s']):>8} {_age(r['newest_s']):>8}"
            )
    return {"source": label, "groups": rows}


def _clear(args: argparse.Namespace, label: str, inv: Any) -> dict[str, Any]:
    entries = _chosen(args, inv)
    removed = 0 if args.dry_run else inv.remove(entries)
    if not args.json:
        verb = "would remove" if args.dry_run else "removed"
        print(
            f"{label}: {verb} {len(entries) if args.dry_run else removed} of {len(entries)} entries"
        )
    return {"source": label, "matched": len(entries), "removed": removed}


def ls_main(argv: list[str]) -> int:
    return _run("ls", "List the entries of a disk-tier directory or Redis prefix.", argv, _ls)


def stats_main(argv: list[str]) -> int:
    return _run(
        "stats",
        "Chunks, bytes and ages per model and salt of a disk-tier directory or Redis prefix.",
        argv,
        _stats,
    )


def clear_main(argv: list[str]) -> int:
    return _run(
        "clear",
        "Remove chunks (all, or one salt or model) from a disk-tier directory or "
        "Redis prefix, of a stopped or running deployment.",
        argv,
        _clear,
        dry_run=True,
    )
