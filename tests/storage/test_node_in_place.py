"""The node tier's reads in place (``kvtier.storage.backends.node_maps``): on a platform that
copies from any host memory, a hit is the shared pages themselves, mapped read-only and checked
once per process; a file replaced under its name is checked again; the pages of a file another
process deleted are not kept; node hits are not copied into the host tier; a write into a hit
faults instead of changing the chunk every process reads. Platforms that need pinned memory, and
sealed chunks, read into the host arena."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from node_worker import model_keys, node_backend, put, read
from storage_helpers import CHUNK, LAYOUT, chunk_value, meta
from test_node_tier import chunk_files, finished, worker

from kvtier.core.config import load_config
from kvtier.core.memory import HostArena
from kvtier.storage import codec
from kvtier.storage.manager import tiered_storage_manager

KEYS = model_keys("m")


def key(i: int):  # type: ignore[no-untyped-def]
    return KEYS.key(i.to_bytes(16, "little"))


def mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (deleted or not)."""
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_hit_is_the_shared_pages_mapped_once_not_a_copy(node_dir: Path) -> None:
    arena = HostArena.create(16 * meta().nbytes)
    writer = node_backend(node_dir, "m", arena)
    reader = node_backend(node_dir, "m", arena)
    try:
        for i in range(3):
            put(writer, arena, KEYS, i)
        free = arena.free_bytes
        first = reader.batched_get([key(i) for i in range(3)], arena.allocate)
        assert arena.free_bytes == free, "a node hit took no host arena memory"
        for i, obj in enumerate(first):
            assert obj is not None and obj.arena is None
            assert torch.equal(obj.tensor, chunk_value(i))
            assert obj.address % 256 == 0, "aligned as an arena object (the movers' word views)"
            obj.tensor.view(torch.uint8).view(torch.int64)  # a mover's view of it works
        assert all(mapped(p) for p in chunk_files(node_dir))
        (again,) = reader.batched_get([key(1)], arena.allocate)
        assert again is not None and first[1] is not None
        assert again.address == first[1].address, "the second hit reads the kept mapping"
        for obj in [*first, again]:
            assert obj is not None
            obj.release()
    finally:
        writer.close()
        reader.close()


def replace_with_damaged_copy(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - codec.TRAILER.size - 1] ^= 0xFF  # the payload's last byte
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(bytes(data))
    os.rename(tmp, path)  # another inode under the same name


def test_a_file_replaced_under_its_name_is_checked_again(node_dir: Path) -> None:
    arena = HostArena.create(16 * meta().nbytes)
    writer = node_backend(node_dir, "m", arena)
    reader = node_backend(node_dir, "m", arena)
    try:
        put(writer, arena, KEYS, 5)
        assert read(reader, arena, KEYS, range(5, 6)) == {"hits": [5], "wrong": []}
        (path,) = chunk_files(node_dir)
        replace_with_damaged_copy(path)
        # Not the kept mapping of the old file: the new one is checked, and its damage found
        assert read(reader, arena, KEYS, range(5, 6)) == {"hits": [], "wrong": []}
        assert not path.exists(), "the damaged file was deleted"
    finally:
        writer.close()
        reader.close()


def test_the_pages_of_a_file_deleted_elsewhere_are_not_kept(node_dir: Path) -> None:
    arena = HostArena.create(16 * meta().nbytes)
    writer = node_backend(node_dir, "m", arena)
    reader = node_backend(node_dir, "m", arena, node_rescan_s=0.05)
    try:
        put(writer, arena, KEYS, 1)
        put(writer, arena, KEYS, 2)
        (held,) = reader.batched_get([key(1)], arena.allocate)
        assert held is not None
        path = writer.path_of(key(1))  # type: ignore[attr-defined]
        path.unlink()  # another process evicts it
        assert torch.equal(held.tensor, chunk_value(1)), "a held hit stays valid"
        held.release()
        time.sleep(0.1)
        assert mapped(path)
        assert read(reader, arena, KEYS, range(2, 3))["hits"] == [2]  # any read prunes
        assert not mapped(path), "the deleted file's pages went back to the system"
        assert read(reader, arena, KEYS, range(1, 2))["hits"] == []
    finally:
        writer.close()
        reader.close()


def manager(node: Path, **cfg: object):  # type: ignore[no-untyped-def]
    config = load_config(
        overrides={"tiers": ["local_cpu", "node"], "node_path": str(node), "chunk_size": CHUNK}
        | cfg,
        env={},
    )
    arena = HostArena.create(32 * meta().nbytes)
    return tiered_storage_manager(
        config=config, arena=arena, layout=LAYOUT, namespace=key(0).namespace()
    )


@pytest.mark.parametrize("sealed", [False, True])
def test_node_hits_are_not_copied_into_the_host_tier(node_dir: Path, sealed: bool) -> None:
    cfg = {"encryption_key": "3c" * 32} if sealed else {}
    first, second = manager(node_dir, **cfg), manager(node_dir, **cfg)
    try:
        for i in range(4):
            obj = first.arena.allocate(meta())
            obj.tensor.copy_(chunk_value(i))
            first.put(key(i), obj)
            obj.release()
        assert first.flush(30.0)
        got = second.batched_get([key(i) for i in range(4)])
        assert all(obj is not None for obj in got)
        for i, obj in enumerate(got):
            assert torch.equal(obj.tensor, chunk_value(i))  # type: ignore[union-attr]
            obj.release()  # type: ignore[union-attr]
        assert second.stats.get("node.hits") == 4
        # In place: one copy on the node. Sealed: decrypted into this process's host memory,
        # kept there as a lower-tier hit always was.
        assert len(second.host) == (4 if sealed else 0)
    finally:
        first.close()
        second.close()


def test_platforms_that_need_pinned_memory_read_into_the_arena(node_dir: Path) -> None:
    arena = HostArena.create(16 * meta().nbytes)
    writer = node_backend(node_dir, "m", arena)
    put(writer, arena, KEYS, 4)
    arena.for_pinned_copies = True  # as a CUDA or XPU platform's arena, pinned or being pinned
    reader = node_backend(node_dir, "m", arena)
    try:
        (obj,) = reader.batched_get([key(4)], arena.allocate)
        assert obj is not None and obj.arena is arena
        assert torch.equal(obj.tensor, chunk_value(4))
        obj.release()
    finally:
        writer.close()
        reader.close()


def test_a_file_whose_payload_is_not_aligned_is_read_into_the_arena(
    node_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.storage.backends.node import NodeBackend

    arena = HostArena.create(16 * meta().nbytes)
    with monkeypatch.context() as m:  # a file as written before payloads were page-aligned
        m.setattr(NodeBackend, "payload_align", 0)
        writer = node_backend(node_dir, "m", arena)
        put(writer, arena, KEYS, 7)
        writer.close()
    (path,) = chunk_files(node_dir)
    header_len, _ = codec.prefix_lengths(path.read_bytes()[: codec.PREFIX.size])
    assert header_len % 256, "this layout's header leaves the payload unaligned"
    reader = node_backend(node_dir, "m", arena)
    try:
        (obj,) = reader.batched_get([key(7)], arena.allocate)
        assert obj is not None and obj.arena is arena
        assert torch.equal(obj.tensor, chunk_value(7))
        obj.release()
    finally:
        reader.close()


def test_an_alias_entry_is_not_padded_to_a_page_and_reads_back(node_dir: Path) -> None:
    from kvtier.core.keys.aliases import Alias, alias_objects

    arena = HostArena.create(16 * meta().nbytes)
    backend = node_backend(node_dir, "m", arena)
    try:
        alias_key = KEYS.alias_key(b"t" * 16)
        [(k, obj)], _ = alias_objects([(alias_key, Alias(b"t" * 16, b"c" * 16, 8))], arena.allocate)
        want = obj.tensor.clone()
        backend.batched_put([(k, obj)])
        obj.release()
        put(backend, arena, KEYS, 1)
        sizes = sorted(p.stat().st_size for p in chunk_files(node_dir))
        assert sizes[0] < 4096 < sizes[1], "the alias's file is unpadded, the chunk's aligned"
        (got,) = backend.batched_get([alias_key], arena.allocate)
        assert got is not None and torch.equal(got.tensor, want)
        got.release()
    finally:
        backend.close()


def test_a_write_into_a_hit_faults_and_changes_no_chunk(node_dir: Path) -> None:
    finished(worker(node_dir, "m", "write", 6, 1))
    proc = worker(node_dir, "m", "scribble", 6)
    out, _ = proc.communicate(timeout=120)
    assert out.split() == ["read"], "the write into the hit did not go through"
    assert proc.returncode in (-signal.SIGSEGV, -signal.SIGBUS)
    assert read_in_fresh_process(node_dir) == {"hits": [6], "wrong": []}


def read_in_fresh_process(node: Path) -> dict:
    return json.loads(finished(worker(node, "m", "read", 6, 1)))
