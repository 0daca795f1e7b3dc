#!/usr/bin/env bash
# Run python with kvtier-core and kvtier-cuda from their src/ folders, on a GPU machine that has
# torch and triton but no kvtier install:  bash benchmarks/gpu_python.sh SCRIPT_OR_-m ARGS...
# Entry points are declared through a generated .dist-info, so plugin discovery and the `kvtier`
# CLI work as installed.
set -euo pipefail
SITE=$(mktemp -d)
python3 - "$SITE" <<'PY'
import sys, tomllib, pathlib
site = pathlib.Path(sys.argv[1])
for pkg in ("core", "cuda", "storage", "bench"):
    meta = tomllib.loads(pathlib.Path(f"packages/{pkg}/pyproject.toml").read_text())["project"]
    d = site / f"{meta['name'].replace('-', '_')}-0.0.0.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: 0.0.0\n")
    lines = []
    for group, eps in meta.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
    (d / "entry_points.txt").write_text("\n".join(lines) + "\n")
PY
export PYTHONPATH="$SITE:$PWD/packages/core/src:$PWD/packages/cuda/src:$PWD/packages/storage/src:$PWD/packages/bench/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec python3 "$@"
