"""The node tier: host memory every kvtier process of one host shares, and which outlives them.

Several vLLM instances on one host (data-parallel replicas, a prefill and a decode instance,
servers of several models) each have their own ``local_cpu`` tier: a hot prefix is held once per
process, a neighbour's prefix is reached only through the disk, and a restart empties the
memory. The node tier is one cache for all of them, in memory, that survives any of them.

Mechanism: the disk tier's chunk files (``disk.local_disk``: one sealed file per chunk, header,
payload and checksummed trailer) in a directory on a memory file system (``node_path``, by
default ``/dev/shm/kvtier-<uid>``, a tmpfs), with the OS doing the sharing: its pages are the
memory, every process reads the same files, a file appears only whole (written to a temporary
name, then renamed), so a writer killed mid-write leaves nothing anyone reads as a chunk (its
temporary file is removed later), and the files stay until ``kvtier clear``, eviction or a
reboot. Nothing new to trust: the disk tier's checks (key, layout, length, checksum, sealing)
run on every read.

One budget for the node (``node_size_gb``): every process, model and rank under ``node_path``
shares it. Each process rescans the whole directory before writing, at most every
``node_rescan_s``, and evicts the least recently used files of every namespace (a read marks a
file used: its modification time) until the node has room for one more chunk; between rescans
its own writes evict its own least recently used files within what the others leave. Another namespace's file
deleted under its process is a miss there, as a file another process deleted is in the disk tier.

Reads are in place where the platform copies from any host memory (an unpinned arena: the CPU
platform): a chunk file is mapped and checked once per process and handed out without a copy
(``node_maps``), so a hit costs one copy from the shared pages into the KV cache. Sealed chunks,
and platforms whose copies need pinned memory (CUDA, XPU), read into the host arena as the disk
tier does.

The directory must be private: created ``0700``, and refused (a ``ConfigError`` naming
``node_path``) when it is a symlink, another user's, open to group or others, or not on a
memory file system (``/proc/self/mountinfo``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.memory import MemoryObj, MemoryObjMeta
from kvtier.core.private_dir import private_dir
from kvtier.storage import codec
from kvtier.storage._log import warn_throttled
from kvtier.storage.backends.base import BackendContext
from kvtier.storage.backends.disk.fileio import PAGE, read_header, remove_entry
from kvtier.storage.backends.disk.files import scan_chunks
from kvtier.storage.backends.disk.local_disk import DiskSettings, GiB, LocalDiskBackend
from kvtier.storage.backends.node_maps import MappedChunks, map_file
from kvtier.storage.checksum import Checksum

# A payload read in place must start at a multiple of this (the host arena's alignment, which
# the movers' views assume); files written before payloads were page-aligned read into the arena.
IN_PLACE_ALIGN = 256

# File systems whose files are memory: what the node tier may live on.
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # (hugetlbfs refuses write(): nothing could be stored)


def file_system_of(path: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``path`` is on (the longest mount point above it, the last
    mounted on top); None where the mount table cannot be read."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, fs = -1, None
    for line in lines:
        fields = line.split()
        try:
            mount_point = fields[4].replace("\\040", " ")
            fs_type = fields[fields.index("-") + 1]
        except (IndexError, ValueError):
            continue
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= best:
            best, fs = len(mount_point), fs_type
    return fs


def private_node_dir(path: Path) -> Path:
    """``path``, created ``0700`` if missing and checked: a directory of this user's, closed to
    others, on a memory file system; else a ``ConfigError`` naming ``node_path``."""
    try:
        problem = private_dir(path, parents=True)
    except OSError as e:
        raise ConfigError("node_path", str(path), f"cannot be created: {e}") from None
    if problem is None:
        fs = file_system_of(path)
        if fs not in MEMORY_FILE_SYSTEMS:
            problem = (
                f"is on {fs or 'a file system the mount table does not show'}, not a memory "
                f"file system ({', '.join(MEMORY_FILE_SYSTEMS)}): the node tier keeps its "
                f"chunks in memory (use the local_disk tier for a disk)"
            )
    if problem:
        raise ConfigError(
            "node_path",
            str(path),
            f"{problem}; another user may have planted it, or it is the wrong directory",
        )
    return path


class NodeBackend(LocalDiskBackend):
    """The node tier (see the module docstring): the disk tier's files in shared memory, under
    one budget for the host."""

    name = "node"
    # Payloads start on a page: a mapping hands them out in place, aligned for every view.
    payload_align = PAGE

    @classmethod
    def settings(cls, cfg: KVTierConfig) -> DiskSettings:
        root = private_node_dir(cfg.node_dir())
        return DiskSettings(
            "node_path", root, int(cfg.node_size_gb * GiB), cfg.node_rescan_s, False, True
        )

    def __init__(self, ctx: BackendContext) -> None:
        self.node_budget = int(ctx.config.node_size_gb * GiB)
        self.others_bytes = 0  # what the other namespaces held at the last rescan
        self.others_chunks = 0
        self._own_mtimes: dict[str, float] = {}
        # A read marks its file used (its mtime) unless it was marked this recently: eviction
        # orders files at rescans, every node_rescan_s, so finer marks change nothing.
        self._touch_s = min(1.0, ctx.config.node_rescan_s / 2)
        # In place where the platform copies from any host memory (see the module docstring).
        self._maps = (
            None
            if ctx.arena.for_pinned_copies
            else MappedChunks(self.node_budget, ctx.config.node_rescan_s)
        )
        super().__init__(ctx)
        self._share_node()

    def _scan(self) -> list[tuple[str, int]]:
        found = self._scan_files()
        self._own_mtimes = {name: mtime for mtime, name, _ in found}
        return [(name, size) for _, name, size in found]

    def _rescanned(self) -> None:
        self._share_node()

    def _share_node(self) -> None:
        """Evict the node's least recently used files, of any namespace, until it fits its
        budget; then this namespace may use what the others leave."""
        others: list[tuple[float, Path, int]] = []
        try:
            with os.scandir(self.root) as it:
                dirs = [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
            for d in dirs:
                if d == self.dir:
                    continue
                found, _ = scan_chunks(d)
                others.extend((mtime, d / name, size) for mtime, name, size in found)
        except OSError as e:
            warn_throttled("node-scan", "kvtier node tier: cannot scan %s: %s", self.root, e)
            return
        own = [
            (self._own_mtimes.get(name, float("inf")), self.dir / name, size)
            for name, size in self._index.sizes()
        ]
        total = sum(size for _, _, size in others) + sum(size for _, _, size in own)
        # Room for the write that follows, taken from the node's least recently used.
        target = max(0, self.node_budget - self.max_file)
        evicted: list[str] = []
        deleted: list[Path] = []
        if total > target:
            for _, path, size in sorted([*others, *own], key=lambda e: e[0]):
                if total <= target:
                    break
                if path.parent == self.dir:
                    if self._index.reading(path.name):
                        continue  # this process reads it now: the next rescan may take it
                    self._index.forget(path.name)
                    evicted.append(path.name)
                else:
                    try:
                        remove_entry(path)
                    except OSError as e:
                        warn_throttled(
                            "node-evict", "kvtier node tier: cannot delete %s: %s", path, e
                        )
                        continue
                    deleted.append(path)
                total -= size
        self.evict_files(evicted)
        gone = set(deleted)
        kept = [size for _, path, size in others if path not in gone]
        self.others_chunks = len(kept)
        self.others_bytes = sum(kept)
        self._index.budget = max(0, self.node_budget - self.others_bytes)

    @property
    def node_usage(self) -> tuple[int, int]:
        """``(bytes, chunk files)`` of the whole node tier, at this process's last rescan."""
        return self.others_bytes + self._index.used, self.others_chunks + len(self._index)

    # -- reads in place ------------------------------------------------------------------------
    def batched_get(
        self,
        keys: Sequence[ChunkKey],
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    ) -> list[MemoryObj | None]:
        if self._maps is None:
            return super().batched_get(keys, allocate)
        self._maps.prune_if_due(lambda name: os.stat(self._dir_slash + name))
        # Chunks already mapped cost an open and an fstat: read here, as handing them to the
        # reader threads costs more. The others are mapped and checked on the reader threads.
        names = [self.file_name(k) for k in keys]
        out: list[MemoryObj | None] = [None] * len(keys)
        rest = []
        for i, name in enumerate(names):
            if name in self._maps:
                out[i] = self._get_one(keys[i], allocate)
            else:
                rest.append(i)
        if rest:
            got = self._readers.map(lambda j: self._get_one(keys[rest[j]], allocate), len(rest))
            for i, obj in zip(rest, got, strict=True):
                out[i] = obj
        return out

    def _read(
        self,
        fd: int,
        st: os.stat_result,
        key: ChunkKey,
        name: str,
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    ) -> MemoryObj | None:
        if self._maps is None:
            return super()._read(fd, st, key, name, allocate)
        mapped = self._maps.get(name, st)
        if mapped is None:
            try:
                checked = self._map_checked(fd, st, key)
            except codec.PayloadError as e:
                self._reject(name, e)
                return None
            if checked is None:  # sealed (decrypted into host memory) or not aligned
                return super()._read(fd, st, key, name, allocate)
            mapped = self._maps.put(name, st, *checked)
        self._index.record(name, self._read_hit(fd, st))
        return MemoryObj.borrowed(mapped.payload, mapped.meta)

    def _map_checked(
        self, fd: int, st: os.stat_result, key: ChunkKey
    ) -> tuple[torch.Tensor, MemoryObjMeta] | None:
        """The open chunk file mapped, its header and checksum checked over the mapping: the
        payload as the chunk's tensor. None for a sealed file or an unaligned payload (read
        into the arena instead). Raises ``PayloadError``."""
        self._check_size(st)
        header = read_header(
            fd,
            st.st_size,
            key=key,
            layout=self.ctx.layout,
            max_tokens=self.max_tokens,
            sealer=self.ctx.sealer,
        )
        if header.sealed or header.header_len % IN_PLACE_ALIGN:
            return None
        whole = map_file(fd, st.st_size)
        end = header.header_len + header.payload_len
        payload = whole[header.header_len : end]
        # Hashed on this reader thread as it faults the pages in (``codec.check_checksums``
        # hands segments to helper threads, which read them from memory a second time).
        cs = Checksum(header.crc_of_header)
        cs.add_now(memoryview(payload.numpy()))  # type: ignore[arg-type]
        codec.check_trailer(cs.value(), whole[end:].numpy().tobytes())
        meta = header.meta
        return payload.view(meta.dtype).view(meta.shape), meta

    def _dropped(self, names: list[str]) -> None:
        if self._maps is not None:
            self._maps.drop(names)
        super()._dropped(names)

    def close(self) -> None:
        if self._maps is not None:
            self._maps.clear()
        super().close()

    def _read_hit(self, fd: int, st: os.stat_result) -> os.stat_result:
        if time.time() - st.st_mtime < self._touch_s:
            return st  # marked used recently enough for the next rescan's order
        try:
            os.utime(fd)  # recently used, for every process's eviction
            return os.fstat(fd)
        except OSError:
            return st

    def _reject(self, name: str, err: codec.PayloadError) -> None:
        if err.reason.startswith(("sealed", "unsealed")):
            # Another deployment's chunk, sealed under another key (or none): not damaged, and
            # not this process's to delete. A miss here.
            self.ctx.stats.add(f"{self.name}.sealed_rejected")
            self._index.forget(name)
            return
        super()._reject(name, err)
