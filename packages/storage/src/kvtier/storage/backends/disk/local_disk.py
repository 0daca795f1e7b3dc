"""The local-disk tier: one file per chunk, an LRU by bytes, and an index rebuilt on start.

Layout: ``<local_disk_path>/<namespace digest>/<key digest>.kvc``, each file a header + payload
(``kvtier.storage.codec``). A file appears only complete: it is written to a temporary name in
the same directory (created ``O_EXCL | O_NOFOLLOW``), fsync'ed, then renamed over its final
name, so a reader (this process or another) sees either nothing or the whole file. The directory
itself is not fsync'ed: after a crash a rename may be lost, which is a miss, never a wrong hit.
Files are ``0600`` and the directories this tier creates ``0700``: KV is user data.

Restart and sharing: the index is rebuilt from the directory when the tier starts (oldest
modification first, for LRU order), and a key this process has not indexed is looked up on disk,
so a second process using the same directory sees what the first wrote. A vLLM engine answers
lookups from its index of the tier, which holds what was there at its start and what it wrote;
with ``local_disk_shared`` (instances running at once on one directory) it probes instead, so
it sees what the others write while it runs. Processes sharing a
directory share its budget: before a batch of writes, at most every ``local_disk_rescan_s``, the
tier scans the directory, counts the files other processes wrote (as its most recently used) and
forgets those they deleted, then evicts to the budget. Between scans the directory can hold up to
what the other processes wrote since. A scan costs a few microseconds a file (about 86 ms for
20,000 files on a 2-core VM); a directory of many files is scanned less often, so that scans
take at most 1% of the writing thread's time.

Lookups answer only what a read can deliver: ``contains`` checks that the entry is a regular file
(``lstat``) and, the first time it sees that file (after a restart, or written or replaced by
another process), that its header is this key's and its length the header's; a file that fails
is a miss, deleted. A file this process wrote or fully read is trusted while its inode, size and
mtime stay the same. Payload bit rot is found by the checksum on the read (a miss, counted).

A batch read runs on up to four threads, each reading whole chunks and hashing every segment as
it lands (``disk.readers``).

Every open refuses symlinks and never blocks (``disk.fileio.open_regular``): a FIFO, directory,
device or socket at a chunk path is a miss for that key, removed (a non-empty directory is
bypassed), counted as ``local_disk.corrupt``. Every read is bounded by the file's size, which is
checked against the largest chunk before anything is read. Every read is checked (key, layout,
shape, dtype, length, checksum); a file that fails is a miss, counted, logged, and deleted.

Full disks: a chunk larger than the budget skips the store with a warning
(``local_disk.store_skipped``). A file system that fills up below the budget (ENOSPC) makes the
tier evict its least recently used files to make room and retry once; for a minute after, the
tier's budget is capped at what it held when the file system filled, so later stores evict first
instead of failing. The store path (budget, eviction, the retry) is ``disk.writer``.

``local_disk_o_direct`` reads and writes files with O_DIRECT, bypassing the page cache (a large
KV working set then does not push the engine's other files out of it); see ``disk.direct``. A
file system without O_DIRECT support is a config error at start.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.core.errors import ConfigError
from kvtier.core.private_dir import make_private_dirs
from kvtier.storage import codec
from kvtier.storage._log import warn_throttled
from kvtier.storage._views import ArenaBytes
from kvtier.storage.backends.base import BackendContext, StorageBackend, refuse_options
from kvtier.storage.backends.disk.direct import DirectIO
from kvtier.storage.backends.disk.fileio import (
    NotRegular,
    kind_of,
    open_regular,
    read_chunk,
    read_header,
    remove_entry,
)
from kvtier.storage.backends.disk.files import (
    NAMESPACE_FILE,
    SUFFIX,
    TMP_SUFFIX,
    namespace_dir,
    scan_chunks,
    write_marker,
)
from kvtier.storage.backends.disk.index import DiskIndex, ScanPacer
from kvtier.storage.backends.disk.readers import BatchReaders
from kvtier.storage.backends.disk.writer import FS_FULL_CAP_S, DiskWriter

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj, MemoryObjMeta

logger = logging.getLogger("kvtier.storage")

# The file layout's names stay importable from here.
__all__ = ["NAMESPACE_FILE", "SUFFIX", "TMP_SUFFIX", "LocalDiskBackend", "namespace_dir"]

GiB = 1 << 30


@dataclass(frozen=True)
class DiskSettings:
    """Where a tier of chunk files keeps them and how much it may keep."""

    path_field: str  # the config key of its directory (named in errors)
    root: Path
    budget: int  # bytes
    rescan_s: float
    o_direct: bool
    # Other running processes write the directory: lookups probe it (``digests()`` None).
    shared: bool


class LocalDiskBackend(StorageBackend):
    """One file per chunk under a byte budget. See the module docstring."""

    name = "local_disk"
    seals_payloads = True
    payload_align = 0  # files are read into the arena: a payload may start anywhere

    @classmethod
    def settings(cls, cfg: KVTierConfig) -> DiskSettings:
        return DiskSettings(
            "local_disk_path",
            cfg.disk_path(),
            int(cfg.local_disk_size_gb * GiB),
            cfg.local_disk_rescan_s,
            cfg.local_disk_o_direct,
            cfg.local_disk_shared,
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        refuse_options(ctx, self.name, f"see the config keys {self.name}_*")
        settings = self.settings(cfg)
        self.budget = settings.budget
        self.max_tokens = cfg.chunk_size
        self.root = settings.root
        self.dir = namespace_dir(self.root, ctx.namespace)
        self._dir_slash = f"{self.dir}{os.sep}"  # reads open by string: a Path join costs more
        try:
            make_private_dirs(self.dir)
            if not stat.S_ISDIR(os.lstat(self.dir).st_mode):
                raise NotADirectoryError(f"{self.dir} is not a directory")
            write_marker(self.dir, ctx.namespace)
        except OSError as e:
            raise ConfigError(settings.path_field, str(self.root), f"cannot be used: {e}") from None
        self.o_direct = settings.o_direct
        self.shared = settings.shared
        self._direct = DirectIO(self.dir) if self.o_direct else None
        # The largest file a chunk of this layout can make: nothing larger is read.
        self.max_file = (
            codec.PREFIX.size
            + codec.MAX_META
            + ctx.layout.max_entry_nbytes(self.max_tokens)
            + codec.TRAILER.size
        )
        self._index = DiskIndex(self.budget, FS_FULL_CAP_S)
        self._readers = BatchReaders()
        self._bytes = ArenaBytes(ctx.arena)
        self._read_chunk = (
            self._direct.read
            if self._direct is not None
            else functools.partial(read_chunk, view_of=self._bytes.of)
        )
        self._removal_listeners: list[Callable[[list[str]], None]] = []
        self._rescans = ScanPacer(settings.rescan_s)
        self._writer = DiskWriter(ctx, self, self._index, self._direct)
        self._rebuild_index()

    # -- index ---------------------------------------------------------------------------------
    def _scan_files(self) -> list[tuple[float, str, int]]:
        """The directory's chunk files as ``(mtime, name, bytes)``, oldest first; entries at
        chunk names that are not regular files are removed."""
        found, bad = scan_chunks(self.dir)
        for name, kind in bad:
            self._bad_entry(name, kind)
        found.sort()
        return found

    def _scan(self) -> list[tuple[str, int]]:
        """The directory's chunk files as ``(name, bytes)``, oldest first."""
        return [(name, size) for _, name, size in self._scan_files()]

    def _rebuild_index(self) -> None:
        self._index.load(self._scan())
        if len(self._index):
            logger.info(
                "kvtier disk tier %s: %d chunk file(s), %d bytes",
                self.dir,
                len(self._index),
                self._index.used,
            )
        self.evict_files(self._index.evict_to_budget())

    def _rescan_if_due(self) -> None:
        """Count what other processes wrote to (and deleted from) the directory, then evict to
        the budget; at most every ``local_disk_rescan_s``, one thread at a time."""
        if not self._rescans.begin():
            return
        try:
            since = self._index.epoch()
            try:
                found = self._scan()
            except OSError as e:
                warn_throttled("disk-scan", "kvtier disk tier: cannot scan %s: %s", self.dir, e)
                return
            self._index.sync(found, since)
            self._rescanned()
            self.evict_files(self._index.evict_to_budget())
        finally:
            self._rescans.end()

    def _rescanned(self) -> None:
        """After a rescan, before evicting to the budget (the node tier shares one budget
        between every namespace of its directory)."""

    @property
    def used_bytes(self) -> int:
        return self._index.used

    def __len__(self) -> int:
        return len(self._index)

    def digests(self) -> list[str] | None:
        """The chunks this tier indexes; None when other running processes write the directory
        (``local_disk_shared``; the node tier always): what they write after this engine listed
        it is seen only by a probe, so lookups probe (as for Redis)."""
        if self.shared:
            return None
        return [name[: -len(SUFFIX)] for name in self._index]

    @staticmethod
    def file_name(key: ChunkKey) -> str:
        return key.digest() + SUFFIX

    def path_of(self, key: ChunkKey) -> Path:
        return self.dir / self.file_name(key)

    def bytes_of(self, obj: MemoryObj) -> memoryview:
        return self._bytes.of(obj)

    def _unlink(self, name: str) -> None:
        try:
            if not remove_entry(self.dir / name):
                warn_throttled(
                    "disk-unlink",
                    "kvtier disk tier: cannot delete %s (a non-empty "
                    "directory); that key is bypassed",
                    name,
                )
        except OSError as e:
            warn_throttled("disk-unlink", "kvtier disk tier: cannot delete %s: %s", name, e)

    def watch_removals(self, listener: Callable[[list[str]], None]) -> bool:
        self._removal_listeners.append(listener)
        return True

    def _dropped(self, names: list[str]) -> None:
        if names:
            digests = [n[: -len(SUFFIX)] for n in names]
            for listener in self._removal_listeners:
                listener(digests)

    def evict_files(self, victims: list[str]) -> None:
        for name in victims:
            self._unlink(name)
        self.ctx.stats.add(f"{self.name}.evicted", len(victims))
        self._dropped(victims)

    def _bad_entry(self, name: str, kind: str) -> None:
        """Something not a chunk file sits at a chunk path: a miss; remove it (or bypass it)."""
        self.ctx.stats.add(f"{self.name}.corrupt")
        warn_throttled(
            "disk-bad-entry",
            "kvtier disk tier: %s is a %s, not a chunk file; treated as a miss and removed",
            self.dir / name,
            kind,
        )
        self._index.forget(name)
        self._unlink(name)

    def _io_error(self, path: Path, err: OSError) -> None:
        warn_throttled("disk-read", "kvtier disk tier: cannot read %s: %s", path, err)
        self.ctx.stats.add(f"{self.name}.errors")

    def has_chunk_file(self, key: ChunkKey, name: str) -> bool:
        """Whether a read of ``key`` can deliver: a regular file whose header is ``key``'s."""
        path = self.dir / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._index.forget(name)
            return False
        except OSError as e:
            warn_throttled("disk-stat", "kvtier disk tier: cannot stat %s: %s", path, e)
            self.ctx.stats.add(f"{self.name}.errors")
            return False
        if not stat.S_ISREG(st.st_mode):
            self._bad_entry(name, kind_of(st.st_mode))
            return False
        if self._index.trusted(name, st):
            return True
        try:
            fd, st = open_regular(path)
            try:
                read_header(
                    fd,
                    st.st_size,
                    key=key,
                    layout=self.ctx.layout,
                    max_tokens=self.max_tokens,
                    sealer=self.ctx.sealer,
                )
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._index.forget(name)
            return False
        except NotRegular as e:
            self._bad_entry(name, e.kind)
            return False
        except codec.PayloadError as e:
            self._reject(name, e)
            return False
        except OSError as e:
            self._io_error(path, e)
            return False
        self._index.record(name, st)
        return True

    # -- interface -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.has_chunk_file(k, self.file_name(k)) for k in keys]

    def batched_put(self, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> None:
        self._rescan_if_due()
        put = self._writer.put
        for key, obj in items:
            put(key, obj)

    def batched_get(
        self,
        keys: Sequence[ChunkKey],
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    ) -> list[MemoryObj | None]:
        return self._readers.map(lambda i: self._get_one(keys[i], allocate), len(keys))

    def _get_one(
        self, key: ChunkKey, allocate: Callable[[MemoryObjMeta], MemoryObj | None]
    ) -> MemoryObj | None:
        name = self.file_name(key)
        self._index.begin_read(name)
        try:
            try:
                fd, st = open_regular(self._dir_slash + name, os.O_DIRECT if self.o_direct else 0)
            except FileNotFoundError:
                self._index.forget(name)
                return None
            except NotRegular as e:
                self._bad_entry(name, e.kind)
                return None
            try:
                return self._read(fd, st, key, name, allocate)
            finally:
                os.close(fd)
        except OSError as e:
            self._io_error(self.dir / name, e)
            return None
        finally:
            self._index.end_read(name)

    def _read(
        self,
        fd: int,
        st: os.stat_result,
        key: ChunkKey,
        name: str,
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    ) -> MemoryObj | None:
        try:
            self._check_size(st)
            obj = self._read_chunk(
                fd,
                st.st_size,
                key=key,
                layout=self.ctx.layout,
                max_tokens=self.max_tokens,
                allocate=allocate,
                sealer=self.ctx.sealer,
            )
        except codec.PayloadError as e:
            self._reject(name, e)
            return None
        if obj is None:
            self.ctx.stats.add(f"{self.name}.no_host_memory")
            return None
        self._index.record(name, self._read_hit(fd, st))
        return obj

    def _check_size(self, st: os.stat_result) -> None:
        """Raise ``PayloadError`` for a file larger than any chunk of this layout (before
        anything of it is read)."""
        if st.st_size > self.max_file:
            raise codec.PayloadError(
                f"corrupt: file of {st.st_size} bytes is larger than any chunk"
            )

    def _read_hit(self, fd: int, st: os.stat_result) -> os.stat_result:
        """A chunk file was read whole: its identity to trust from now on (the node tier marks
        it recently used, which changes its modification time)."""
        return st

    def _reject(self, name: str, err: codec.PayloadError) -> None:
        self.ctx.stats.add(f"{self.name}.corrupt")
        if err.reason.startswith(("sealed", "unsealed")):
            self.ctx.stats.add(f"{self.name}.sealed_rejected")
        logger.warning("kvtier disk tier: %s rejected (%s); deleted", self.dir / name, err.reason)
        self._index.forget(name)
        self._unlink(name)
        self._dropped([name])

    def close(self) -> None:
        self._readers.close()

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            name = self.file_name(key)
            self._index.forget(name)
            self._unlink(name)
        self._dropped([self.file_name(k) for k in keys])
