"""The control channel: a running engine's workers answer ``stats`` and ``flush`` requests.

Each worker process serves its connector's counters (``query_worker_stats``) and "drain every
queued save into every tier" (``flush_worker``, what a planned restart waits for) on a Unix
socket in a private directory, whatever process asks (tests, ``kvtier demo``, an operator's
script). Every call is bounded by a timeout; a slow, dead or missing worker is an error, never
a hang. The serving path never uses it: lookups go through the scheduler's presence index and
the workers' probes, carried by vLLM's own connector metadata.

Security: replies carry the engine's counters, so only this user may ask. The socket directory
is per user (``$KVTIER_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR`` if it exists, else the temp dir,
then ``kvtier-<uid>``), created ``0700`` and checked on every use: a directory, not a symlink,
owned by this user, no access for group or others; anything else (another user pre-created it,
or opened it up) is refused with ``UnsafeRuntimeDir``. Each end checks the other's user id
(``SO_PEERCRED``), and the client checks the shape of every reply before anything uses it.

Frames: 4-byte big-endian length + a JSON object. Nothing is unpickled from the socket.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import struct
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.private_dir import private_dir

logger = logging.getLogger("kvtier")

_LEN = struct.Struct(">I")
_MAX_HEADER = 1 << 20

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class UnsafeRuntimeDir(PermissionError):
    """The control socket directory is not private to this user; the message says why and how to
    fix it."""


def runtime_dir() -> Path:
    """This user's private directory for control sockets, created ``0700`` if missing and
    checked (see the module docstring); raises ``UnsafeRuntimeDir``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and not os.path.isdir(xdg):
        xdg = None  # set but missing (a session without a login manager): the temp dir
    base = Path(os.environ.get("KVTIER_RUNTIME_DIR") or xdg or tempfile.gettempdir())
    d = base / f"kvtier-{os.getuid()}"
    try:
        problem = private_dir(d)
    except OSError as e:
        raise UnsafeRuntimeDir(
            f"kvtier cannot create its control socket directory {d}: {e}; set "
            f"KVTIER_RUNTIME_DIR to a directory of yours"
        ) from None
    if problem:
        raise UnsafeRuntimeDir(
            f"kvtier refuses the control socket directory {d}: it {problem}. Another local user "
            f"may have planted it to answer in the workers' place; remove it, or set "
            f"KVTIER_RUNTIME_DIR (or XDG_RUNTIME_DIR) to a private directory"
        )
    return d


SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path less its NUL, Linux)


def socket_path(engine_id: str, rank: int) -> str:
    """Where rank ``rank`` of engine ``engine_id`` serves its control channel (the same path in
    every process): the engine id's readable start and a digest of all of it (two ids that
    share a start never share a socket), or the digest alone where the runtime directory is too
    deep for both; a directory too deep even for that is a ``ConfigError`` naming
    ``KVTIER_RUNTIME_DIR`` (a socket path has at most 107 bytes)."""
    d = runtime_dir()
    digest = hashlib.blake2b(engine_id.encode(), digest_size=6).hexdigest()
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:32]
    for name in (f"{safe}-{digest}-r{rank}.sock", f"{digest}-r{rank}.sock"):
        path = str(d / name)
        if len(os.fsencode(path)) <= SUN_PATH_MAX:
            return path
    raise ConfigError(
        "KVTIER_RUNTIME_DIR",
        str(d.parent),
        f"too deep for a control socket ({path!r} is {len(os.fsencode(path))} bytes, a Unix "
        f"socket's path at most {SUN_PATH_MAX}): set KVTIER_RUNTIME_DIR to a shorter directory",
    )


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("control channel closed")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    blob = json.dumps(message).encode()
    sock.sendall(_LEN.pack(len(blob)) + blob)


def _recv(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > _MAX_HEADER:
        raise ConnectionError(f"control channel message of {n} bytes is too large")
    message = json.loads(_recv_exact(sock, n))
    if not isinstance(message, dict):
        raise ConnectionError("control channel message is not an object")
    return message


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (None where the system
    cannot say)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i")))
    return int(uid)


def _check_reply(request: dict[str, Any], reply: dict[str, Any]) -> None:
    """Raise ``ConnectionError`` unless ``reply`` has the shape ``request`` calls for."""
    if "error" in reply:
        if not isinstance(reply["error"], str):
            raise ConnectionError(f"bad error reply {str(reply)[:200]}")
        return
    op = request.get("op")
    if op == "flush" and not isinstance(reply.get("flushed"), bool):
        raise ConnectionError(f"bad flush reply {str(reply)[:200]}")
    elif op == "stats" and not isinstance(reply.get("stats"), dict):
        raise ConnectionError(f"bad stats reply {str(reply)[:200]}")


def _is_served(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _close_and_unlink(sock: socket.socket, path: str) -> None:
    try:
        sock.close()
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ControlServer:
    """Serves ``handler`` on a Unix socket from daemon threads until ``close``.

    ``handler(request)`` runs on a server thread; it must be thread-safe. An exception in it is
    sent back as ``{"error": ...}`` (the client raises ``ChannelError``).
    """

    def __init__(self, path: str, handler: Handler) -> None:
        self.path = path
        self._handler = handler
        if os.path.exists(path):
            if _is_served(path):
                raise ChannelError(
                    f"another live engine serves {path}: two engines share an engine_id; give "
                    f"each its own (kv_transfer_config.engine_id) or leave it unset"
                )
            os.unlink(path)  # left behind by a process that died
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._closed = threading.Event()
        # Unlinks the socket file on close(), on garbage collection and at interpreter exit.
        self._finalizer = weakref.finalize(self, _close_and_unlink, self._sock, path)
        self._thread = threading.Thread(
            target=self._accept_loop, name="kvtier-control", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), name="kvtier-control-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            uid = peer_uid(conn)
            if uid is not None and uid != os.getuid():
                logger.warning(
                    "kvtier control channel %s: refused a connection from user id %d",
                    self.path,
                    uid,
                )
                return
            while not self._closed.is_set():
                try:
                    request = _recv(conn)
                except (OSError, ConnectionError, ValueError):
                    return
                try:
                    reply = self._handler(request)
                except Exception as e:  # reported to the client
                    logger.warning("kvtier control request failed: %s", e)
                    reply = {"error": f"{type(e).__name__}: {e}"}
                try:
                    _send(conn, reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed.set()
        self._finalizer()


class ControlClient:
    """A connection to one worker's ``ControlServer``; every call is bounded by ``timeout_s``.

    Thread-safe (one call at a time). On any failure the connection is dropped and the call
    raises ``ChannelError``; the next call reconnects.
    """

    def __init__(self, path: str, timeout_s: float) -> None:
        """``timeout_s``: a finite number of seconds above 0 (``ValueError`` otherwise: an
        unbounded call is what the channel exists to avoid)."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise ValueError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be finite and above 0, got {timeout_s!r}")
        self.path = path
        self.timeout_s = float(timeout_s)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout_s)
            try:
                s.connect(self.path)
                uid = peer_uid(s)
                if uid is not None and uid != os.getuid():
                    raise ConnectionError(f"the socket is served by user id {uid}, not this user")
            except (OSError, ConnectionError):
                s.close()
                raise
            self._sock = s
        return self._sock

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            try:
                sock = self._connect()
                _send(sock, request)
                reply = _recv(sock)
                _check_reply(request, reply)
            except (OSError, ConnectionError, ValueError) as e:
                self.close_locked()
                raise ChannelError(f"kvtier control channel {self.path}: {e}") from e
        if "error" in reply:
            raise ChannelError(f"kvtier worker failed the request: {reply['error']}")
        return reply

    def close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


class ChannelError(ConnectionError):
    """The worker could not be asked (not up, gone, too slow) or failed to answer."""


def flush_worker(engine_id: str, rank: int = 0, timeout_s: float = 30.0) -> bool:
    """Wait until a running engine's queued saves reached every tier (before a planned restart)."""
    client = ControlClient(socket_path(engine_id, rank), timeout_s + 5.0)
    try:
        return bool(client.call({"op": "flush", "timeout_s": timeout_s})["flushed"])
    finally:
        client.close()


def query_worker_stats(engine_id: str, rank: int = 0, timeout_s: float = 5.0) -> dict[str, Any]:
    """The worker-side connector's counters for a running engine (tests, monitoring)."""
    client = ControlClient(socket_path(engine_id, rank), timeout_s)
    try:
        return client.call({"op": "stats"})["stats"]
    finally:
        client.close()
