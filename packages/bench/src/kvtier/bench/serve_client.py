"""vLLM's benchmark client (``vllm bench serve``) kept in one long-lived process.

``BenchClient`` is the driver's side; ``bench_loop`` is the client process's side, run by
``python -m kvtier.bench.serve_launcher bench-loop FD``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

from kvtier.bench.serve_process import Process, ServerError, server_env, vllm_command


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
                env=server_env(None),
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


def bench_loop(done_fd: int) -> None:
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
