"""A worker's control socket (``stats``, ``flush``) is private to its user: a planted or opened-up
runtime directory is refused, each end checks the other's user id, and replies are checked
before anything uses them (the drill, when the socket still carried lookups: another user
pre-created the directory world-writable, replaced the socket, read every lookup's tokens and
salt and answered arbitrary hit counts)."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import stat
import struct
import tempfile
import threading

import pytest

from kvtier.core.errors import ConfigError
from kvtier.vllm_integration.channel import (
    SUN_PATH_MAX,
    ChannelError,
    ControlClient,
    ControlServer,
    UnsafeRuntimeDir,
    flush_worker,
    query_worker_stats,
    socket_path,
)


@pytest.fixture
def runtime_base(tmp_path, monkeypatch):
    base = tmp_path / "run"
    base.mkdir()
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(base))
    return base / f"kvtier-{os.getuid()}"


def test_runtime_dir_is_created_private(runtime_base):
    old = os.umask(0)
    try:
        path = socket_path("engine", 0)
    finally:
        os.umask(old)
    assert os.path.dirname(path) == str(runtime_base)
    st = os.lstat(runtime_base)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


def test_xdg_runtime_dir_is_used_when_set(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_RUNTIME_DIR", raising=False)
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert socket_path("e", 1).startswith(str(xdg) + os.sep)


def test_engine_ids_that_share_a_start_get_sockets_of_their_own(runtime_base):
    """A socket name keeps the id's readable start and a digest of all of it: two long ids
    that differ only at their end never answer for each other."""
    a, b = "x" * 60 + "-prefill", "x" * 60 + "-decode"
    assert socket_path(a, 0) != socket_path(b, 0)
    assert socket_path(a, 0) == socket_path(a, 0) != socket_path(a, 1)


def test_a_deep_runtime_dir_gets_a_short_socket_name_then_a_named_error(tmp_path, monkeypatch):
    """A Unix socket's path has at most 107 bytes: in a deep runtime directory the name is the
    digest alone (the engine still starts and is reachable); deeper still, a ConfigError
    naming KVTIER_RUNTIME_DIR instead of the socket module's 'AF_UNIX path too long' from
    inside a vLLM worker."""
    engine = "kvtier-test-" + "e" * 40
    # Room for the digest-only name (about 20 bytes) but not the readable one.
    deep = tmp_path / ("d" * max(1, SUN_PATH_MAX - len(str(tmp_path)) - 32 - 25))
    deep.mkdir()
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(deep))
    path = socket_path(engine, 0)
    assert len(os.fsencode(path)) <= SUN_PATH_MAX
    assert os.path.basename(path).endswith("-r0.sock") and "kvtier-test" not in path
    server = ControlServer(path, lambda r: {"stats": {"n": 1}})
    client = ControlClient(path, 5.0)
    try:
        assert client.call({"op": "stats"}) == {"stats": {"n": 1}}
    finally:
        client.close()
        server.close()
    deeper = tmp_path / ("d" * (SUN_PATH_MAX - len(str(tmp_path))))
    deeper.mkdir()
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(deeper))
    with pytest.raises(ConfigError, match="KVTIER_RUNTIME_DIR"):
        socket_path(engine, 0)


@pytest.mark.parametrize(
    "plant", ["world_writable", "group_readable", "other_owner", "symlink", "file"]
)
def test_planted_runtime_dir_is_refused(runtime_base, tmp_path, plant):
    if plant == "world_writable":
        runtime_base.mkdir()
        runtime_base.chmod(0o777)
    elif plant == "group_readable":
        runtime_base.mkdir(mode=0o750)
        runtime_base.chmod(0o750)
    elif plant == "other_owner":
        if os.getuid() != 0:
            pytest.skip("needs root to make a directory owned by another user")
        runtime_base.mkdir(mode=0o700)
        os.chown(runtime_base, 12345, 12345)
    elif plant == "symlink":
        target = tmp_path / "attacker"
        target.mkdir(mode=0o700)
        runtime_base.symlink_to(target)
    else:
        runtime_base.write_text("x")
    with pytest.raises(UnsafeRuntimeDir, match="refuses the control socket directory"):
        socket_path("engine", 0)
    with pytest.raises(UnsafeRuntimeDir):  # and on every later use
        socket_path("e", 1)


def _fake_server(path: str, reply: object, seen: list) -> socket.socket:
    """A hostile server: records what it is sent, answers ``reply`` to everything."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)

    def run() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            try:
                (n,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
                seen.append(json.loads(conn.recv(n, socket.MSG_WAITALL)))
                blob = json.dumps(reply).encode()
                conn.sendall(struct.pack(">I", len(blob)) + blob)
                conn.recv(1 << 20)
            except OSError:
                pass

    threading.Thread(target=run, daemon=True).start()
    return srv


@pytest.mark.parametrize(
    ("op", "reply"),
    [
        ("stats", {"stats": 5}),
        ("stats", {"stats": [1, 2]}),
        ("stats", {}),
        ("flush", {"flushed": "yes"}),
        ("flush", {"flushed": 1}),
        ("flush", {}),
        ("flush", {"error": {"not": "text"}}),
    ],
)
def test_replies_out_of_shape_are_errors(runtime_base, op, reply):
    path = socket_path("engine", 0)
    seen: list = []
    srv = _fake_server(path, reply, seen)
    client = ControlClient(path, 2.0)
    try:
        with pytest.raises(ChannelError, match=r"bad .*reply"):
            client.call({"op": op})
        assert seen == [{"op": op}]
    finally:
        client.close()
        srv.close()


def test_a_good_reply_passes(runtime_base):
    path = socket_path("engine", 0)
    server = ControlServer(
        path, lambda r: {"stats": {"n": 1}} if r["op"] == "stats" else {"flushed": True}
    )
    client = ControlClient(path, 2.0)
    try:
        assert client.call({"op": "stats"}) == {"stats": {"n": 1}}
        assert client.call({"op": "flush"}) == {"flushed": True}
    finally:
        client.close()
        server.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a server as another user")
def test_a_server_of_another_user_is_refused():
    shared = tempfile.mkdtemp(prefix="kvtier-test-shared-")  # the other user must reach it
    os.chmod(shared, 0o777)
    path = os.path.join(shared, "s.sock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user's process: serve one hostile answer, then exit
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            srv = _fake_server(path, {"stats": {"loaded_tokens": 64}}, [])
            os.write(w, b"1")
            conn_wait = threading.Event()
            conn_wait.wait(5)
            srv.close()
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
        client = ControlClient(path, 2.0)
        with pytest.raises(ChannelError, match="user id 65534"):
            client.call({"op": "stats"})
        client.close()
    finally:
        os.close(r)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 0, -1, True, "5"])
def test_a_client_without_a_finite_positive_timeout_is_refused(timeout) -> None:
    """An infinite timeout was an ``OverflowError`` from the socket layer at the first call."""
    with pytest.raises(ValueError, match="timeout_s"):
        ControlClient("/nonexistent/kvtier.sock", timeout)
    if timeout == math.inf:
        with pytest.raises(ValueError, match="timeout_s"):
            flush_worker("no-such-engine", 0, timeout)
        with pytest.raises(ValueError, match="timeout_s"):
            query_worker_stats("no-such-engine", 0, timeout)
