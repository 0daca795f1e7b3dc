"""Child processes for the serving benchmark: a command in its own process group on loopback,
waited for over HTTP within a bounded time, and always killed with its whole group.

``vllm_command`` runs vLLM's command line through ``kvtier.bench.serve_launcher``
(see there why), possibly with another environment's python (``foreign_python_env``).
"""

from __future__ import annotations

import os
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

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_command(*args: str, python: str | None = None) -> list[str]:
    """The ``vllm`` command line: this module run by ``python`` (default the current one)."""
    return [python or sys.executable, "-m", "kvtier.bench.serve_launcher", *args]


def foreign_python_env() -> dict[str, str]:
    """What another environment's python needs to run this module: its source directory on
    ``PYTHONPATH`` (the module imports nothing of kvtier's; ``kvtier`` is a namespace package)."""
    src = str(Path(__file__).resolve().parents[2])
    return {"PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


def server_env(extra: dict[str, str] | None) -> dict[str, str]:
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
                env=server_env(self.env),
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
