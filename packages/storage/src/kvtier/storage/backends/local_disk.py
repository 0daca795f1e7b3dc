"""The local-disk tier: one file per chunk, an LRU by bytes, and an index rebuilt on start.

Layout: ``<local_disk_path>/<namespace digest>/<key digest>.kvc``, each file a header + payload
(``kvtier.storage.codec``). A file appears only complete: it is written to a temporary name in
the same directory, fsync'ed, then renamed over its final name, so a reader (this process or
another) sees either nothing or the whole file. The directory itself is not fsync'ed: after a
crash a rename may be lost, which is a miss, never a wrong hit.

Restart and sharing: the index is rebuilt from the directory when the tier starts (oldest
modification first, for LRU order), and a key this process has not indexed is looked up on disk,
so a second process using the same directory sees what the first wrote. Budget accounting is per
process: each process evicts only files it has indexed.

Every read is checked (key, layout, shape, dtype, length, checksum); a file that fails is a miss,
is counted as ``local_disk.corrupt``, logged, and deleted. A full disk or a chunk larger than the
budget skips the store with a warning (``local_disk.store_skipped``).

``local_disk_o_direct`` reads and writes files with O_DIRECT, bypassing the page cache (a large
KV working set then does not push the engine's other files out of it). O_DIRECT needs
page-aligned buffers and the host arena aligns objects to 256 bytes, so each I/O thread goes
through a page-aligned bounce buffer of one file's size (one extra copy, overlapped with the
checksum). A file system without O_DIRECT support is a config error at start.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.errors import ConfigError
from kvtier.storage import codec
from kvtier.storage._log import warn_throttled
from kvtier.storage.backends.base import BackendContext, StorageBackend

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj, MemoryObjMeta

logger = logging.getLogger("kvtier.storage")

GiB = 1 << 30
SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
# Temporary files older than this at start-up belong to a writer that died mid-write.
_STALE_TMP_S = 300.0


def namespace_dir(root: Path, namespace: str) -> Path:
    """The directory of one namespace under the tier's root."""
    return root / hashlib.blake2b(namespace.encode(), digest_size=10).hexdigest()


def _write_all(fd: int, parts: Sequence[memoryview | bytes]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


_PAGE = 4096


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# Reads go in pieces so the checksum of one overlaps the read of the next (a multiple of the
# codec's checksum segment).
_SEGMENT = 2 * codec.SEGMENT


def _read_checksummed(fd: int, view: memoryview, offset: int, cs: codec.Checksum) -> None:
    """Read ``view.nbytes`` bytes at ``offset`` into ``view``, each piece hashed into ``cs`` as
    soon as it is in. Raises ``PayloadError`` if the file is short."""
    try:
        for start in range(0, view.nbytes, _SEGMENT):
            seg = view[start : start + _SEGMENT]
            if _read_into(fd, seg, offset + start) != seg.nbytes:
                raise codec.PayloadError("truncated: file ended inside the payload")
            cs.add(seg)
    finally:
        # never hand the buffer back (or fail) while a helper thread still reads it
        cs.wait()


class LocalDiskBackend(StorageBackend):
    """One file per chunk under a byte budget. See the module docstring."""

    name = "local_disk"

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.budget = int(cfg.local_disk_size_gb * GiB)
        self.max_tokens = cfg.chunk_size
        self.root = cfg.disk_path()
        self.dir = namespace_dir(self.root, ctx.namespace)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            marker = self.dir / "NAMESPACE"
            if not marker.exists():
                marker.write_text(ctx.namespace + "\n")
        except OSError as e:
            raise ConfigError("local_disk_path", str(self.root), f"cannot be used: {e}") from None
        self.o_direct = cfg.local_disk_o_direct
        if self.o_direct:
            self._check_o_direct()
        self._bounce_tls = threading.local()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, oldest first
        self._reading: dict[str, int] = {}
        self._used = 0
        self._reserved = 0
        self._rebuild_index()

    # -- O_DIRECT --------------------------------------------------------------------------------
    def _check_o_direct(self) -> None:
        probe = self.dir / f".odirect.{os.getpid()}{TMP_SUFFIX}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
            try:
                os.write(fd, mmap.mmap(-1, _PAGE))
            finally:
                os.close(fd)
        except OSError as e:
            raise ConfigError("local_disk_o_direct", True,
                              f"the file system of {self.dir} refuses O_DIRECT: {e}") from None
        finally:
            probe.unlink(missing_ok=True)

    def _bounce(self, nbytes: int) -> memoryview:
        """This thread's page-aligned buffer, at least ``nbytes`` long."""
        buf = getattr(self._bounce_tls, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = mmap.mmap(-1, _round_up(nbytes, _PAGE))
            self._bounce_tls.buf = buf
        return memoryview(buf)

    def _write_direct(self, fd: int, header: bytes, payload: memoryview) -> None:
        total = len(header) + payload.nbytes + codec.TRAILER.size
        padded = _round_up(total, _PAGE)
        buf = self._bounce(padded)
        end = len(header) + payload.nbytes
        buf[: len(header)] = header
        cs = codec.Checksum(zlib.crc32(header))
        try:
            cs.add(payload)
            np.copyto(np.frombuffer(buf[len(header) : end], dtype=np.uint8),
                      np.frombuffer(payload, dtype=np.uint8))
        finally:
            cs.wait()  # the helpers must be done with the buffer
        buf[end:total] = codec.TRAILER.pack(cs.value())
        buf[total:padded] = bytes(padded - total)
        _write_all(fd, [buf[:padded]])
        os.ftruncate(fd, total)

    def _read_direct(
        self, fd: int, size: int, key: ChunkKey, allocate: Callable[[MemoryObjMeta], MemoryObj | None]
    ) -> MemoryObj | None:
        """Raises ``PayloadError`` for a bad file; None when host memory is full."""
        largest = codec.PREFIX.size + codec.MAX_META + self.ctx.layout.chunk_nbytes(self.max_tokens)
        if size > largest + codec.TRAILER.size:
            raise codec.PayloadError(f"corrupt: file of {size} bytes is larger than any chunk")
        buf = self._bounce(_round_up(max(size, 1), _PAGE))
        done = 0
        while done < size:
            n = os.preadv(fd, [buf[done : _round_up(size, _PAGE)]], done)
            if n == 0 or (n % _PAGE and done + n < size):
                break
            done += n
        if done != size:
            raise codec.PayloadError(f"truncated: read {done} of {size} bytes")
        return codec.decode_into_object(buf[:size], key=key, layout=self.ctx.layout,
                                        max_tokens=self.max_tokens, allocate=allocate)

    # -- index ---------------------------------------------------------------------------------
    def _rebuild_index(self) -> None:
        now = time.time()
        found: list[tuple[float, str, int]] = []
        with os.scandir(self.dir) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(SUFFIX):
                    found.append((st.st_mtime, entry.name, st.st_size))
                elif entry.name.endswith(TMP_SUFFIX) and now - st.st_mtime > _STALE_TMP_S:
                    self._unlink(entry.name)
        found.sort()
        for _, name, size in found:
            self._index[name] = size
            self._used += size
        if found:
            logger.info("kvtier disk tier %s: %d chunk file(s), %d bytes", self.dir, len(found), self._used)
        self._evict_to(0)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    @staticmethod
    def file_name(key: ChunkKey) -> str:
        return key.digest() + SUFFIX

    def path_of(self, key: ChunkKey) -> Path:
        return self.dir / self.file_name(key)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(self.dir / name)
        except FileNotFoundError:
            pass
        except OSError as e:
            warn_throttled("disk-unlink", "kvtier disk tier: cannot delete %s: %s", name, e)

    def _forget(self, name: str) -> None:
        """Drop ``name`` from the index (caller holds the lock)."""
        size = self._index.pop(name, None)
        if size is not None:
            self._used -= size

    def _evict_to(self, incoming: int) -> bool:
        """Evict LRU files until ``incoming`` more bytes fit the budget (caller holds the lock
        or is the constructor); False if files being read are all that is left."""
        victims: list[str] = []
        skipped = 0
        while self._used + self._reserved + incoming > self.budget and skipped < len(self._index):
            name, size = next(iter(self._index.items()))
            if self._reading.get(name):
                self._index.move_to_end(name)
                skipped += 1
                continue
            del self._index[name]
            self._used -= size
            victims.append(name)
        for name in victims:
            self._unlink(name)
        self.ctx.stats.add(f"{self.name}.evicted", len(victims))
        return self._used + self._reserved + incoming <= self.budget

    def _lookup(self, name: str) -> bool:
        """Whether ``name`` exists: the index, else the directory (another process wrote it)."""
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
                return True
        try:
            size = os.stat(self.dir / name).st_size
        except OSError:
            return False
        with self._lock:
            if name not in self._index:
                self._index[name] = size
                self._used += size
        return True

    # -- interface -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self._lookup(self.file_name(k)) for k in keys]

    def batched_put(self, items: Sequence[tuple[ChunkKey, MemoryObj]]) -> None:
        for key, obj in items:
            self._put_one(key, obj)

    def _put_one(self, key: ChunkKey, obj: MemoryObj) -> None:
        name = self.file_name(key)
        if self._lookup(name):
            return
        payload = obj.byte_view()
        header = codec.encode_header(key, obj.meta, self.ctx.layout)
        size = len(header) + payload.nbytes + codec.TRAILER.size
        if size > self.budget:
            self.ctx.stats.add(f"{self.name}.store_skipped")
            warn_throttled("disk-budget", "kvtier disk tier: a %d-byte chunk exceeds the budget "
                           "local_disk_size_gb=%s; not stored", size, self.ctx.config.local_disk_size_gb)
            return
        with self._lock:
            if not self._evict_to(size):
                self.ctx.stats.add(f"{self.name}.store_skipped")
                warn_throttled("disk-full-budget", "kvtier disk tier: budget full of chunks being "
                               "read; chunk not stored")
                return
            self._reserved += size
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        ok = False
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.o_direct else 0)
            fd = os.open(self.dir / tmp, flags, 0o644)
            try:
                if self.o_direct:
                    self._write_direct(fd, header, payload)
                else:
                    cs = codec.Checksum(zlib.crc32(header))
                    try:
                        cs.add(payload)
                        _write_all(fd, [header, payload])
                    finally:
                        cs.wait()  # the helpers must be done with the buffer
                    _write_all(fd, [codec.TRAILER.pack(cs.value())])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.dir / tmp, self.dir / name)
            ok = True
        except OSError as e:
            self._unlink(tmp)
            self.ctx.stats.add(f"{self.name}.store_skipped")
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            warn_throttled(
                "disk-write", "kvtier disk tier: %s writing %s; chunk not stored",
                "disk full" if full else e, self.dir,
            )
        finally:
            with self._lock:
                self._reserved -= size
                if ok:
                    self._forget(name)
                    self._index[name] = size
                    self._used += size
        if ok:
            self.ctx.stats.add(f"{self.name}.stored")

    def batched_get(
        self,
        keys: Sequence[ChunkKey],
        allocate: Callable[[MemoryObjMeta], MemoryObj | None],
    ) -> list[MemoryObj | None]:
        return [self._get_one(k, allocate) for k in keys]

    def _get_one(
        self, key: ChunkKey, allocate: Callable[[MemoryObjMeta], MemoryObj | None]
    ) -> MemoryObj | None:
        name = self.file_name(key)
        with self._lock:
            self._reading[name] = self._reading.get(name, 0) + 1
        try:
            try:
                fd = os.open(self.dir / name, os.O_RDONLY | (os.O_DIRECT if self.o_direct else 0))
            except FileNotFoundError:
                with self._lock:
                    self._forget(name)
                return None
            try:
                return self._read(fd, key, name, allocate)
            finally:
                os.close(fd)
        except OSError as e:
            warn_throttled("disk-read", "kvtier disk tier: cannot read %s: %s", name, e)
            self.ctx.stats.add(f"{self.name}.errors")
            return None
        finally:
            with self._lock:
                left = self._reading[name] - 1
                if left:
                    self._reading[name] = left
                else:
                    del self._reading[name]

    def _read(
        self, fd: int, key: ChunkKey, name: str, allocate: Callable[[MemoryObjMeta], MemoryObj | None]
    ) -> MemoryObj | None:
        size = os.fstat(fd).st_size
        if self.o_direct:
            try:
                obj = self._read_direct(fd, size, key, allocate)
            except codec.PayloadError as e:
                self._reject(name, e)
                return None
            if obj is None:
                self.ctx.stats.add(f"{self.name}.no_host_memory")
                return None
            self._touch(name, size)
            return obj
        try:
            prefix = os.pread(fd, codec.PREFIX.size, 0)
            header_len, payload_len = codec.prefix_lengths(prefix)
            if size != header_len + payload_len + codec.TRAILER.size:
                raise codec.PayloadError(f"truncated: file of {size} bytes, header says "
                                         f"{header_len + payload_len + codec.TRAILER.size}")
            head = os.pread(fd, header_len, 0)
            header = codec.decode_header(head, key=key, layout=self.ctx.layout, max_tokens=self.max_tokens)
        except codec.PayloadError as e:
            self._reject(name, e)
            return None
        obj = allocate(header.meta)
        if obj is None:
            self.ctx.stats.add(f"{self.name}.no_host_memory")
            return None
        try:
            cs = codec.Checksum(header.crc_of_header)
            _read_checksummed(fd, obj.byte_view(), header.header_len, cs)
            tail = os.pread(fd, codec.TRAILER.size, header.header_len + header.payload_len)
            codec.check_trailer(cs.value(), tail)
        except codec.PayloadError as e:
            obj.release()
            self._reject(name, e)
            return None
        except BaseException:
            obj.release()
            raise
        self._touch(name, size)
        return obj

    def _touch(self, name: str, size: int) -> None:
        """Mark ``name`` just read (most recent in the LRU)."""
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            else:  # written by another process: now this one counts it against its budget
                self._index[name] = size
                self._used += size

    def _reject(self, name: str, err: codec.PayloadError) -> None:
        self.ctx.stats.add(f"{self.name}.corrupt")
        logger.warning("kvtier disk tier: %s rejected (%s); deleted", self.dir / name, err.reason)
        with self._lock:
            self._forget(name)
        self._unlink(name)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            name = self.file_name(key)
            with self._lock:
                self._forget(name)
            self._unlink(name)
