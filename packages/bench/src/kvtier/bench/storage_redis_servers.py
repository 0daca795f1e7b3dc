"""Private Redis servers and the C client's reference for the Redis rows of ``kvtier bench
storage``: throwaway ``redis-server`` processes on free loopback ports (one server, or a cluster of
``masters``), and ``redis_benchmark``, the GB/s of ``redis-benchmark`` moving values of a given
size over a given number of connections."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.storage.backends.redis.resp import Connection, Deadline, Endpoint, command


def _free_port() -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 <= 65535:
            return port
    raise RuntimeError("no free port")


class PrivateRedis:
    """Throwaway redis-server processes on free loopback ports, no persistence: one server, or
    ``masters`` joined into a cluster."""

    def __init__(self, masters: int = 0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.dir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
        self.ports = [_free_port() for _ in range(max(1, masters))]
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for i, port in enumerate(self.ports):
                args = [
                    binary,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self.dir,
                    "--proto-max-bulk-len",
                    "1gb",
                ]
                if masters:
                    args += [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(Path(self.dir) / f"nodes-{i}.conf"),
                    ]
                self.procs.append(
                    subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
            for port in self.ports:
                self._wait(port)
            if masters:
                self._join()
        except BaseException:
            self.close()
            raise
        self.port = self.ports[0]
        self.url = f"redis://127.0.0.1:{self.port}" + ("" if masters else "/0")

    @staticmethod
    def _wait(port: int) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                Connection(Endpoint("127.0.0.1", port), 0.5, Deadline(1)).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not start within 10 s")

    def _join(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is not installed")
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(b"cluster_state:ok" in self.call(p, "CLUSTER", "INFO") for p in self.ports):  # type: ignore[operator]
                return
            time.sleep(0.1)
        raise RuntimeError("the bench cluster did not become ok within 30 s")

    @staticmethod
    def call(port: int, *args: Any) -> object:
        conn = Connection(Endpoint("127.0.0.1", port), 1, Deadline(60))
        try:
            return conn.call(args, Deadline(60))
        finally:
            conn.close()

    def flush(self) -> None:
        for p in self.ports:
            self.call(p, "FLUSHALL")

    def version(self) -> str:
        out = subprocess.run(
            [shutil.which("redis-server") or "redis-server", "--version"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip()

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_benchmark(
    port: int, op: str, size: int, conns: int, total: int, keyspace: int = 0
) -> tuple[float, str]:
    """GB/s of ``redis-benchmark`` running ``op`` (set/get) on values of ``size`` bytes over
    ``conns`` connections, about ``total`` bytes in all; and the command line. ``keyspace``: the
    number of distinct keys (``-r``; 0: one key, which the server then serves from the CPU's
    cache)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise FileNotFoundError("redis-benchmark is not installed")
    if op == "get":  # the keys redis-benchmark reads: key:__rand_int__, or key:<12 digits> with -r
        names = [b"key:%012d" % i for i in range(keyspace)] if keyspace else [b"key:__rand_int__"]
        conn = Connection(Endpoint("127.0.0.1", port), 1, Deadline(60))
        try:
            value = b"x" * size
            for name in names:
                conn.send([command("SET", name, value)], Deadline(60))
                conn.read_reply(Deadline(60))
        finally:
            conn.close()
    n = max(256, 4 * conns, total // size)  # at least 256 values: a short run is mostly set-up
    cmd = [
        "redis-benchmark",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-t",
        op,
        "-d",
        str(size),
        "-n",
        str(n),
        "-c",
        str(conns),
        "-P",
        "1",
        *(["-r", str(keyspace)] if keyspace else []),
        "--csv",
    ]
    out = subprocess.run(
        [binary, *cmd[1:]], capture_output=True, text=True, timeout=300, check=True
    )
    rows = [
        line.split(",") for line in out.stdout.splitlines() if line.startswith(f'"{op.upper()}"')
    ]
    if not rows:
        raise RuntimeError(f"redis-benchmark printed no {op} row: {out.stdout[-500:]}")
    rps = float(rows[-1][1].strip('"'))
    return rps * size / 1e9, " ".join(cmd)


def start_servers(with_cluster: bool) -> tuple[PrivateRedis, PrivateRedis | None]:
    server = PrivateRedis()
    cluster = None
    if with_cluster:
        try:
            cluster = PrivateRedis(masters=3)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            print(f"redis cluster row skipped: {e}", flush=True)
    return server, cluster
