"""A small RESP2 client, kvtier's only one: the Redis tier's data path (values go straight
between the socket and the caller's memory) and the CLI's inventory (``kvtier.storage.inventory``).

Why not redis-py (or hiredis, valkey-glide): they return every value as a new ``bytes`` (glide's
sync ``get(buffer=)`` copies into a caller's buffer, but only after its own read buffer holds the
whole value), and redis-py joins a ``SET``'s arguments into one packed command. A KV chunk already
has its home (an arena object), so this client reads a bulk reply's payload with ``recv_into``
straight into a view of that object and writes a value with ``sendmsg`` from views of it: the
payload is touched only by the kernel's copy. Only what the tier uses is here: commands as
arguments, replies as simple strings, errors, integers, bulk strings and arrays.

Every blocking step takes a ``Deadline``: the socket timeout of each ``recv``/``send`` is the time
left of the whole call, so a link that trickles bytes cannot stretch a call past its deadline.
A connection whose call failed part-way is in an unknown state: callers close it.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvtier.storage.backends.redis.url import Endpoint

_CRLF = b"\r\n"
_READ_CHUNK = 64 << 10
# A reply header line ("$33554432\r\n", "-ERR ...") is short; a longer one is not RESP.
_MAX_LINE = 64 << 10


class RespError(Exception):
    """An error reply (``-WRONGTYPE ...``, ``-MOVED ...``): the command failed, the connection is
    fine. Returned in a reply's place, never raised by the reader."""

    @property
    def kind(self) -> str:
        return str(self).split(" ", 1)[0]


class ProtocolError(ConnectionError):
    """The byte stream is not the RESP the client expects: close the connection."""


class Deadline:
    """The end of a whole call; ``left()`` raises ``TimeoutError`` once it has passed."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        return left

    def extended(self, seconds: float) -> Deadline:
        """The same call's deadline moved ``seconds`` later (time allowed for its bytes, once a
        call knows how many it moves)."""
        later = Deadline(0.0)
        later.at = self.at + seconds
        return later


def command(*args: bytes | str | int) -> bytes:
    """One command with small arguments, packed."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def set_command(key: bytes, value_len: int, ttl: int | None) -> tuple[bytes, bytes]:
    """``SET key <value> [EX ttl]`` as ``(head, tail)``: send head, the value's bytes, tail."""
    n = 5 if ttl else 3
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (n, len(key), key, value_len)
    tail = _CRLF + (command("EX", ttl)[4:] if ttl else b"")
    return head, tail


class Connection:
    """One connection to one server. Not thread-safe: one call uses it at a time."""

    def __init__(self, ep: Endpoint, connect_timeout_s: float, deadline: Deadline) -> None:
        timeout = min(connect_timeout_s, deadline.left())
        if ep.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(ep.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ep.tls is not None:
            try:
                sock = ep.tls.wrap_socket(sock, server_hostname=ep.host)
            except BaseException:
                sock.close()
                raise
        # Non-blocking from here on: each recv/send is tried at once and only waits (poll, for
        # the time left of the call) when it would block; a socket timeout would cost an ioctl
        # per call and a poll before every recv.
        sock.setblocking(False)
        self.sock = sock
        self.address = ep.address
        self._vectored = ep.tls is None
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._buf = bytearray(_READ_CHUNK)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self.closed = False
        try:
            hello: list[bytes] = []
            if ep.password is not None:
                hello.append(command("AUTH", *([ep.username] if ep.username else []), ep.password))
            if ep.db:
                hello.append(command("SELECT", ep.db))
            if hello:
                self.send(hello, deadline)
                for _ in hello:
                    reply = self.read_reply(deadline)
                    if isinstance(reply, RespError):
                        # the server's words (WRONGPASS, NOAUTH) carry no secret
                        raise ConnectionRefusedError(f"{self.address}: {reply}")
        except BaseException:
            self.close()
            raise

    # -- waiting -------------------------------------------------------------------------------
    def _wait(self, write: bool, deadline: Deadline) -> None:
        """Block until the socket can be written (or read), or the call's deadline passes."""
        self._poller.modify(self.sock, select.POLLOUT if write else select.POLLIN)
        if not self._poller.poll(deadline.left() * 1000 + 1):
            deadline.left()  # raises once the time is up
            raise TimeoutError(f"{self.address}: no progress before the call's deadline")

    def _recv_into(self, out: memoryview, deadline: Deadline) -> int:
        while True:
            deadline.left()
            try:
                n = self.sock.recv_into(out)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
                self._wait(isinstance(e, ssl.SSLWantWriteError), deadline)  # TLS may need to write
                continue
            if not n:
                raise ConnectionResetError(f"{self.address}: connection closed by the server")
            return n

    def _send_some(self, views: list[memoryview], deadline: Deadline) -> int:
        while True:
            deadline.left()
            try:
                if self._vectored:
                    return self.sock.sendmsg(views[:512])
                return self.sock.send(views[0])
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
                self._wait(
                    not isinstance(e, ssl.SSLWantReadError), deadline
                )  # TLS may need to read

    # -- sending -------------------------------------------------------------------------------
    def send(self, parts: Sequence[bytes | memoryview], deadline: Deadline) -> None:
        """Send ``parts`` in order, without joining them (``sendmsg``; TLS: one at a time)."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        i = 0
        while i < len(views):
            sent = self._send_some(views[i:], deadline)
            while sent and i < len(views):
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    # -- receiving -----------------------------------------------------------------------------
    def _fill(self, deadline: Deadline) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                raise ProtocolError(f"{self.address}: reply line longer than {_MAX_LINE} bytes")
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        self._end += self._recv_into(self._view[self._end :], deadline)

    def _line(self, deadline: Deadline) -> bytes:
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start : i])
                self._start = i + 2
                return line
            self._fill(deadline)

    def _exact(self, out: memoryview, deadline: Deadline) -> None:
        """Fill ``out`` completely: first from what is buffered, then straight from the socket."""
        got = min(self._end - self._start, out.nbytes)
        out[:got] = self._view[self._start : self._start + got]
        self._start += got
        while got < out.nbytes:
            got += self._recv_into(out[got:], deadline)

    def _crlf(self, deadline: Deadline) -> None:
        while self._end - self._start < 2:
            self._fill(deadline)
        if self._view[self._start : self._start + 2] != _CRLF:
            raise ProtocolError(f"{self.address}: bulk string not followed by CRLF")
        self._start += 2

    def _skip(self, n: int, deadline: Deadline) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, scratch.nbytes)
            self._exact(scratch[:k], deadline)
            n -= k

    def read_reply(self, deadline: Deadline) -> object:
        """One reply: str (simple), RespError, int, bytes or None (bulk), list (array)."""
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode(errors="replace")
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        try:
            n = int(rest)
        except ValueError:
            raise ProtocolError(f"{self.address}: unexpected reply {line[:80]!r}") from None
        if kind == b":":
            return n
        if kind == b"$":
            if n < 0:
                return None
            data = bytearray(n)
            self._exact(memoryview(data), deadline)
            self._crlf(deadline)
            return bytes(data)
        if kind == b"*":
            return None if n < 0 else [self.read_reply(deadline) for _ in range(n)]
        raise ProtocolError(f"{self.address}: unexpected reply {line[:80]!r}")

    def read_into(self, out: memoryview, deadline: Deadline) -> int | RespError | None:
        """A bulk reply read straight into ``out`` if it has exactly ``out.nbytes`` bytes.

        Returns ``out.nbytes`` on success, None for a missing key, the RespError of an error
        reply, or the reply's length when it differs (its bytes are skipped; ``out`` may be
        partly written). Anything else (an integer, an array) is a ProtocolError."""
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind != b"$":
            raise ProtocolError(f"{self.address}: expected a bulk string, got {line[:80]!r}")
        try:
            n = int(rest)
        except ValueError:
            raise ProtocolError(f"{self.address}: bad bulk length {line[:80]!r}") from None
        if n < 0:
            return None
        if n == out.nbytes:
            self._exact(out, deadline)
        else:
            self._skip(n, deadline)
        self._crlf(deadline)
        return n

    def call(self, args: Iterable[bytes | str | int], deadline: Deadline) -> object:
        self.send([command(*args)], deadline)
        return self.read_reply(deadline)

    def abort(self) -> None:
        """Wake a thread blocked on this connection (close(): its call ends with an error)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class Pool:
    """Idle connections to one server, reused across calls; a connection that failed is closed,
    never returned. ``close`` wakes every call blocked on this server. ``on_connect`` is called
    after each new connection is established (``Nodes`` counts reconnects with it)."""

    def __init__(
        self,
        ep: Endpoint,
        connect_timeout_s: float,
        max_idle: int,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        self.ep = ep
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._on_connect = on_connect
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()
        self._closed = False

    def get(self, deadline: Deadline) -> Connection:
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("the redis tier is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = Connection(self.ep, self.connect_timeout_s, deadline)
            if self._on_connect is not None:
                self._on_connect()
        with self._lock:
            self._busy.add(conn)
        return conn

    def put(self, conn: Connection, ok: bool) -> None:
        with self._lock:
            self._busy.discard(conn)
            keep = ok and not conn.closed and not self._closed and len(self._idle) < self.max_idle
            if keep:
                self._idle.append(conn)
        if not keep:
            conn.close()

    def discard_idle(self) -> None:
        """Close the idle connections: after one to this server failed (a restart, a reset
        link), they were opened before it and would each fail their next call too."""
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for c in idle:
            c.close()
        for c in busy:
            c.abort()
