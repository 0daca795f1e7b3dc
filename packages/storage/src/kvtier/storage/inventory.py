"""What a disk-tier directory or a Redis key prefix holds: the entries behind ``kvtier ls``,
``kvtier stats`` and ``kvtier clear``.

Each entry is identified by the key in its own header (``codec.stored_key``): model and salt id
are ``ChunkKey``'s, never guessed from a file or key name. A Redis key whose value has no
readable header (a piece of a chunk stored in several values, say) is attributed to the chunk
key its name carries between braces or after the prefix, when ``ChunkKey.from_string`` reads
it; anything else is listed as unreadable (``key`` None), and only a clear of everything removes
it.

Works on a stopped or running deployment: it only reads headers and deletes entries. A running
engine's disk tier sees a deleted chunk as a miss at its next lookup (it checks a file's identity
on every lookup), its Redis tier at once; copies already in that engine's host memory are out of
reach of this tool and stay until evicted (or the engine's cache is reset). Nothing here follows
a symlink or opens a non-regular file.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.core.keys import ALIAS_PREFIX, ChunkKey
from kvtier.storage import codec
from kvtier.storage.backends.disk.fileio import open_regular, remove_entry
from kvtier.storage.backends.disk.local_disk import SUFFIX
from kvtier.storage.backends.redis.cluster import SlotMap, key_slot
from kvtier.storage.backends.redis.resp import Connection, Deadline, command
from kvtier.storage.backends.redis.url import Endpoint, parse_url

# A header is a few hundred bytes: one read of this many covers it; a longer one is read again.
_HEAD_GUESS = 4096
_SCAN_COUNT = 1000


@dataclass(frozen=True)
class Entry:
    """One stored entry. ``where``: its file path or Redis key; ``key``: the chunk key it holds
    (None: unreadable); ``age_s``: disk, seconds since written; Redis, seconds since last
    accessed (the server keeps no creation time); None where unknown."""

    where: str
    key: ChunkKey | None
    nbytes: int
    age_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "key": self.key.to_string() if self.key else None,
            "model": self.key.model if self.key else None,
            "salt_id": self.key.salt_id if self.key else None,
            "bytes": self.nbytes,
            "age_s": None if self.age_s is None else round(self.age_s, 3),
        }


def _parse_key(text: str) -> ChunkKey | None:
    try:
        return ChunkKey.from_string(text)
    except ValueError:
        return None


def _key_of_header(head: bytes) -> ChunkKey | None:
    try:
        return _parse_key(codec.stored_key(head))
    except codec.PayloadError:
        return None


# -- disk ------------------------------------------------------------------------------------
class DiskInventory:
    """The chunk files under a disk tier's root (``local_disk_path``): every namespace
    directory below it, or the root itself if it holds chunk files."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"no disk-tier directory at {self.root}")

    def _dirs(self) -> list[Path]:
        dirs = [self.root]
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    dirs.append(Path(entry.path))
        return dirs

    def entries(self) -> Iterator[Entry]:
        now = time.time()
        for d in self._dirs():
            try:
                it = os.scandir(d)
            except OSError:
                continue
            with it:
                for entry in it:
                    if not entry.name.endswith(SUFFIX):
                        continue
                    yield self._entry(Path(entry.path), now)

    @staticmethod
    def _entry(path: Path, now: float) -> Entry:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return Entry(str(path), None, 0, None)
        age = max(0.0, now - st.st_mtime)
        if not stat.S_ISREG(st.st_mode):
            return Entry(str(path), None, 0, age)
        try:
            fd, st = open_regular(path)
        except OSError:
            return Entry(str(path), None, st.st_size, age)
        try:
            head = os.pread(fd, _HEAD_GUESS, 0)
            header_len, _ = codec.prefix_lengths(head)
            if header_len > len(head):
                head = os.pread(fd, header_len, 0)
            key = _key_of_header(head)
        except (OSError, codec.PayloadError):
            key = None
        finally:
            os.close(fd)
        return Entry(str(path), key, st.st_size, age)

    def remove(self, entries: Iterable[Entry]) -> int:
        """Delete ``entries``; how many were removed."""
        n = 0
        for e in entries:
            if remove_entry(Path(e.where)):
                n += 1
        return n

    def close(self) -> None:
        pass


# -- redis -----------------------------------------------------------------------------------
def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisInventory:
    """The keys under ``prefix`` on a Redis/Valkey server, or on every master of a cluster:
    ``SCAN`` on each, then ``GETRANGE`` of each value's header, ``STRLEN`` and ``OBJECT
    IDLETIME``, pipelined on the same connection. It speaks RESP through the tier's own client
    (``backends.redis.resp``); connections open at first use, one per server, and every round
    trip has ``timeout_s``."""

    def __init__(
        self, endpoint: Endpoint, prefix: str, *, cluster: bool = False, timeout_s: float = 5.0
    ) -> None:
        self.endpoint = endpoint
        self.prefix = prefix
        self.cluster = cluster
        self.timeout_s = timeout_s
        self._slots: SlotMap | None = None
        self._conns: dict[str, Connection] = {}

    @classmethod
    def connect(
        cls,
        url: str,
        prefix: str,
        *,
        cluster: bool = False,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float = 5.0,
    ) -> RedisInventory:
        """The inventory of ``url`` (``username``/``password`` override the URL's)."""
        endpoint = parse_url(url, username, password)
        return cls(endpoint, prefix, cluster=cluster, timeout_s=timeout_s)

    # -- servers -------------------------------------------------------------------------------
    def _slot_map(self) -> SlotMap:
        if self._slots is None:
            deadline = Deadline(self.timeout_s)
            self._slots = SlotMap.load(self.endpoint, self.timeout_s, deadline, [])
        return self._slots

    def _servers(self) -> list[Endpoint]:
        if not self.cluster:
            return [self.endpoint]
        return [self.endpoint.at(host, port) for host, port in self._slot_map().nodes()]

    def _owner(self, name: bytes) -> Endpoint | None:
        if not self.cluster:
            return self.endpoint
        owner = self._slot_map().owner(key_slot(name))
        return None if owner is None else self.endpoint.at(*owner)

    def _pipeline(self, server: Endpoint, commands: Sequence[bytes]) -> list[object]:
        """Send ``commands`` to ``server`` at once; their replies (error replies as
        ``RespError``)."""
        conn = self._conns.get(server.address)
        deadline = Deadline(self.timeout_s)
        if conn is None or conn.closed:
            conn = self._conns[server.address] = Connection(server, self.timeout_s, deadline)
        try:
            conn.send([b"".join(commands)], deadline)
            return [conn.read_reply(deadline) for _ in commands]
        except BaseException:
            conn.close()
            raise

    # -- entries -------------------------------------------------------------------------------
    def _attribute(self, name: str, head: object) -> ChunkKey | None:
        if isinstance(head, bytes) and head:
            key = _key_of_header(head)
            if key is not None:
                return key
        rest = name[len(self.prefix) :]
        start = rest.find("{")
        end = rest.find("}", start + 1)
        if start >= 0 and end > start:
            key = _parse_key(rest[start + 1 : end])
            if key is not None:
                return key
        return _parse_key(rest)

    def _batch(self, server: Endpoint, names: Sequence[bytes]) -> list[Entry]:
        commands = []
        for n in names:
            commands += [
                command("GETRANGE", n, 0, _HEAD_GUESS - 1),
                command("STRLEN", n),
                command("OBJECT", "IDLETIME", n),
            ]
        replies = self._pipeline(server, commands)
        out = []
        for i, raw in enumerate(names):
            head, size, idle = replies[3 * i : 3 * i + 3]
            name = raw.decode(errors="replace")
            if isinstance(head, bytes) and len(head) >= codec.PREFIX.size:
                try:
                    header_len, _ = codec.prefix_lengths(head)
                    if header_len > len(head):
                        whole = command("GETRANGE", raw, 0, header_len - 1)
                        (head,) = self._pipeline(server, [whole])
                except codec.PayloadError:
                    pass
            out.append(
                Entry(
                    name,
                    self._attribute(name, head),
                    size if isinstance(size, int) else 0,
                    float(idle) if isinstance(idle, int) else None,
                )
            )
        return out

    def _scan(self, server: Endpoint) -> Iterator[list[bytes]]:
        """The names under the prefix on ``server``, one ``SCAN`` page at a time."""
        pattern = _glob_escape(self.prefix) + "*"
        cursor = b"0"
        while True:
            scan = command("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT)
            (reply,) = self._pipeline(server, [scan])
            match reply:
                case [bytes() as cursor, list() as names]:
                    yield [n for n in names if isinstance(n, bytes)]
                case _:
                    raise ConnectionError(f"{server.address}: SCAN answered {reply!r}")
            if cursor == b"0":
                return

    def entries(self) -> Iterator[Entry]:
        for server in self._servers():
            batch: list[bytes] = []
            for names in self._scan(server):
                batch += names
                if len(batch) >= _SCAN_COUNT:
                    yield from self._batch(server, batch)
                    batch = []
            if batch:
                yield from self._batch(server, batch)

    def remove(self, entries: Iterable[Entry]) -> int:
        """``UNLINK`` ``entries`` (each on the server that owns it); how many keys were
        removed."""
        by_server: dict[str, tuple[Endpoint, list[bytes]]] = {}
        for e in entries:
            name = e.where.encode()
            server = self._owner(name)
            if server is not None:
                by_server.setdefault(server.address, (server, []))[1].append(name)
        n = 0
        for server, names in by_server.values():
            for i in range(0, len(names), _SCAN_COUNT):
                replies = self._pipeline(
                    server, [command("UNLINK", name) for name in names[i : i + _SCAN_COUNT]]
                )
                n += sum(r for r in replies if isinstance(r, int))
        return n

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


# -- selection and summary -------------------------------------------------------------------
def select(
    entries: Iterable[Entry], *, salt_id: str | None = None, model: str | None = None
) -> list[Entry]:
    """The entries of one salt id and/or one model (both None: all, unreadable ones included)."""
    if salt_id is None and model is None:
        return list(entries)
    return [
        e
        for e in entries
        if e.key is not None
        and (salt_id is None or e.key.salt_id == salt_id)
        and (model is None or e.key.model == model)
    ]


def summarize(entries: Iterable[Entry]) -> list[dict[str, Any]]:
    """One row per (model, salt id): chunks (distinct chunk keys), aliases (distinct alias keys,
    ``kvtier.core.keys.aliases``), entries, bytes, oldest and newest age; unreadable entries in a row
    of their own (model and salt None)."""
    groups: dict[tuple[str | None, str | None], dict[str, Any]] = {}
    for e in entries:
        g: tuple[str | None, str | None] = (e.key.model, e.key.salt_id) if e.key else (None, None)
        row = groups.setdefault(
            g,
            {
                "model": g[0],
                "salt_id": g[1],
                "keys": set(),
                "entries": 0,
                "bytes": 0,
                "oldest_s": None,
                "newest_s": None,
            },
        )
        row["entries"] += 1
        row["bytes"] += e.nbytes
        if e.key is not None:
            row["keys"].add(e.key.to_string())
        if e.age_s is not None:
            row["oldest_s"] = e.age_s if row["oldest_s"] is None else max(row["oldest_s"], e.age_s)
            row["newest_s"] = e.age_s if row["newest_s"] is None else min(row["newest_s"], e.age_s)
    rows = []
    for g in sorted(groups, key=lambda t: (t[0] is None, t[0] or "", t[1] or "")):
        row = groups[g]
        keys = row.pop("keys")
        aliases = sum(1 for k in keys if k.rsplit("@", 1)[-1].startswith(ALIAS_PREFIX))
        row["chunks"] = len(keys) - aliases if g != (None, None) else 0
        row["aliases"] = aliases
        rows.append(row)
    return rows
