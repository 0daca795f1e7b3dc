"""A kvtier process using the node tier, for tests/storage/test_node_tier.py (run as a script).

    node_worker.py NODE_DIR MODEL write FIRST COUNT    store chunks FIRST.. of MODEL
    node_worker.py NODE_DIR MODEL read FIRST COUNT     print JSON {"hits": [...], "wrong": [...]}
    node_worker.py NODE_DIR MODEL hang FIRST           store chunk FIRST, stopping mid-write
    node_worker.py NODE_DIR MODEL scribble FIRST       read chunk FIRST, then write into it

``hang`` writes half of the chunk file's bytes, prints ``writing`` and waits to be killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from storage_helpers import CHUNK, LAYOUT, chunk_value, meta

from kvtier.core.config import load_config
from kvtier.core.keys import KeyFactory
from kvtier.core.memory import HostArena
from kvtier.storage.backends.base import BackendContext, StorageBackend
from kvtier.storage.sealing import Sealer
from kvtier.storage.stats import StorageStats
from kvtier.storage.tiers import load_backend_class


def node_backend(node: Path, model: str, arena: HostArena, **cfg: Any) -> StorageBackend:
    config = load_config(
        overrides={"tiers": ["local_cpu", "node"], "node_path": str(node), "chunk_size": CHUNK}
        | cfg,
        env={},
    )
    keys = KeyFactory(model, LAYOUT.fingerprint())
    ctx = BackendContext(
        config=config,
        layout=LAYOUT,
        namespace=keys.key(b"").namespace(),
        arena=arena,
        stats=StorageStats(),
        options={},
        sealer=Sealer(key) if (key := config.encryption_key_bytes()) is not None else None,
    )
    return load_backend_class("node", config.plugins)(ctx)


def model_keys(model: str) -> KeyFactory:
    return KeyFactory(model, LAYOUT.fingerprint())


def put(backend: StorageBackend, arena: HostArena, keys: KeyFactory, i: int) -> None:
    obj = arena.allocate(meta())
    assert obj is not None
    obj.tensor.copy_(chunk_value(i))
    try:
        backend.batched_put([(keys.key(i.to_bytes(16, "little")), obj)])
    finally:
        obj.release()


def read(backend: StorageBackend, arena: HostArena, keys: KeyFactory, idx: range) -> dict:
    found = backend.batched_get([keys.key(i.to_bytes(16, "little")) for i in idx], arena.allocate)
    hits, wrong = [], []
    for i, obj in zip(idx, found, strict=True):
        if obj is None:
            continue
        (hits if torch.equal(obj.tensor, chunk_value(i)) else wrong).append(i)
        obj.release()
    return {"hits": hits, "wrong": wrong}


def main(argv: list[str]) -> int:
    node, model, what, first = Path(argv[0]), argv[1], argv[2], int(argv[3])
    arena = HostArena.create(64 * meta().nbytes)
    backend = node_backend(node, model, arena)
    keys = model_keys(model)
    if what == "write":
        for i in range(first, first + int(argv[4])):
            put(backend, arena, keys, i)
    elif what == "read":
        print(json.dumps(read(backend, arena, keys, range(first, first + int(argv[4])))))
    elif what == "hang":
        real = os.writev

        def half(fd: int, views: Any) -> int:
            total = sum(memoryview(v).nbytes for v in views)
            buf = b"".join(bytes(v) for v in views)[: total // 2]
            real(fd, [buf])
            print("writing", flush=True)
            time.sleep(600)  # killed here
            return total

        os.writev = half  # type: ignore[assignment]
        put(backend, arena, keys, first)
    elif what == "scribble":  # a bug writing into a hit: the process faults, nothing changes
        (obj,) = backend.batched_get([keys.key(first.to_bytes(16, "little"))], arena.allocate)
        assert obj is not None, "chunk to scribble on missed"
        print("read", flush=True)
        obj.tensor.view(torch.uint8).fill_(0)
        print("wrote", flush=True)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
