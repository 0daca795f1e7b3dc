"""The disk tier's store path: a chunk's header (or sealed payload) is built, its bytes reserved
against the budget (evicting least recently used files), and its file written; when the file
system fills up below the budget, the tier evicts to make room, caps its budget and retries once
(see ``local_disk``)."""

from __future__ import annotations

import errno
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvtier.storage import codec
from kvtier.storage._log import warn_throttled
from kvtier.storage.backends.disk.files import write_chunk_file

if TYPE_CHECKING:
    from kvtier.core.keys import ChunkKey
    from kvtier.core.memory import MemoryObj
    from kvtier.storage.backends.base import BackendContext
    from kvtier.storage.backends.disk.direct import DirectIO
    from kvtier.storage.backends.disk.index import DiskIndex

# After ENOSPC the budget is capped at what the tier held then, for this long.
FS_FULL_CAP_S = 60.0


class ChunkFiles(Protocol):
    """What a writer asks of the disk tier that owns it."""

    @property
    def name(self) -> str: ...

    dir: Path
    budget: int
    payload_align: int  # a payload starts at a multiple of this in its file (0: anywhere)

    def file_name(self, key: ChunkKey) -> str: ...

    def has_chunk_file(self, key: ChunkKey, name: str) -> bool:
        """Whether the chunk's file is there and good (the tier's lookup)."""
        ...

    def evict_files(self, names: list[str]) -> None:
        """Delete files the index gave up."""
        ...

    def bytes_of(self, obj: MemoryObj) -> memoryview:
        """The bytes of a host memory object."""
        ...


class DiskWriter:
    """Writes one chunk file at a time for the tier that owns it (``ChunkFiles``), under its
    budget."""

    def __init__(
        self, ctx: BackendContext, tier: ChunkFiles, index: DiskIndex, direct: DirectIO | None
    ) -> None:
        self.ctx = ctx
        self.tier = tier
        self.name = tier.name
        self.dir = tier.dir
        self._direct = direct
        self._index = index
        self.budget = tier.budget

    def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Store one chunk; whether it is on disk now (False: skipped, counted)."""
        name = self.tier.file_name(key)
        if self.tier.has_chunk_file(key, name):
            return True
        payload = self.tier.bytes_of(obj)
        # An alias entry (a few dozen bytes, one per block of a chunk) is never read in place:
        # padding it to a page would double what it takes on a memory file system.
        align = 0 if key.is_alias else self.tier.payload_align
        if self.ctx.sealer is not None:
            header, sealed = codec.seal(
                key,
                obj.meta,
                self.ctx.layout,
                payload,
                self.ctx.sealer,
                align=align,
            )
            payload = memoryview(sealed)
        else:
            header = codec.encode_header(key, obj.meta, self.ctx.layout, align=align)
        size = len(header) + payload.nbytes + codec.TRAILER.size
        if size > self.budget:
            self.ctx.stats.add(f"{self.name}.store_skipped")
            warn_throttled(
                "disk-budget",
                "kvtier disk tier: a %d-byte chunk exceeds the budget "
                "local_disk_size_gb=%s; not stored",
                size,
                self.ctx.config.local_disk_size_gb,
            )
            return False
        reserved, victims = self._index.reserve(size)
        self.tier.evict_files(victims)
        if not reserved:
            self.ctx.stats.add(f"{self.name}.store_skipped")
            warn_throttled(
                "disk-full-budget",
                "kvtier disk tier: budget full of chunks being read; chunk not stored",
            )
            return False
        st: os.stat_result | None = None
        # An alias is not fsync'ed: after a crash it is at worst a checksummed miss.
        write = functools.partial(
            write_chunk_file,
            self.dir,
            name,
            header,
            payload,
            self._direct,
            durable=not key.is_alias,
        )
        try:
            try:
                st = write()
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._make_room(size):
                    raise
                st = write()
        except OSError as e:
            self.ctx.stats.add(f"{self.name}.store_skipped")
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            warn_throttled(
                "disk-write",
                "kvtier disk tier: %s writing %s; chunk not stored",
                "disk full (nothing left to evict)" if full else e,
                self.dir,
            )
        finally:
            self._index.unreserve(size)
            if st is not None:
                self._index.record(name, st)
        if st is None:
            return False
        self.ctx.stats.add_entries(self.name, "stored", [key])
        return True

    def _make_room(self, size: int) -> bool:
        """The file system is full below the budget: cap the budget at what the tier holds now
        and evict until ``size`` more bytes fit; whether any room was made."""
        cap, victims = self._index.cap_at_used()
        self.tier.evict_files(victims)
        if victims:
            warn_throttled(
                "disk-enospc",
                "kvtier disk tier: file system full below the budget; "
                "evicted %d file(s) and capped the budget at %d bytes for %.0f s",
                len(victims),
                cap,
                FS_FULL_CAP_S,
            )
        return bool(victims)
