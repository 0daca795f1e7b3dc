"""What a run of the demo or a benchmark shows: kvtier's progress and results on the screen, the
engines' own output (vLLM, torch, transformers, Triton, their worker processes) in a log file.

``EngineLog`` sends file descriptors 1 and 2 to the log for the duration (so a child process and
a C++ warning land there too) and hands back a rich ``Console`` on the terminal the run started
with. ``advice`` turns the log lines a user should act on into one short sentence each.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

# (a substring of the engine's log, what to tell the user): only what a user can act on.
ADVICE = (
    (
        "libtcmalloc is not found in LD_PRELOAD",
        "vLLM CPU runs without libtcmalloc preloaded: slower (vLLM's CPU install guide, "
        "'set LD_PRELOAD')",
    ),
    (
        "libiomp is not found in LD_PRELOAD",
        "vLLM CPU runs without Intel OpenMP (libiomp) preloaded: slower (vLLM's CPU install "
        "guide, 'set LD_PRELOAD')",
    ),
    (
        "Failed to create oneDNN linear",
        "vLLM fell back from oneDNN to torch's linear layers for this model: slower",
    ),
)


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """The ``--verbose`` flag of a command that runs engines under ``logged``."""
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the engines' own output (vLLM, torch, ...) here instead of in engine.log",
    )


def logged(out: Path, verbose: bool, body: Callable[[Any], int]) -> int:
    """``body(console)`` with the engines' output in ``out/engine.log`` (unless ``verbose``),
    then, on the screen, a line for each thing to act on and where the log is."""
    log_path = out / "engine.log"
    log_path.unlink(missing_ok=True)
    with EngineLog(log_path, verbose) as console:
        code = body(console)
        if not verbose:
            sys.stdout.flush()
            sys.stderr.flush()
            for line in advice(log_path):
                console.print(f"[yellow]note:[/] {line}")
            console.print(f"the engines' own output (vLLM, torch, ...): {log_path}")
    return code


def advice(log_path: Path) -> list[str]:
    """One line for each known, actionable condition the log shows (each once)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [line for needle, line in ADVICE if needle in text]


class EngineLog:
    """``with EngineLog(path, verbose) as console:`` the engines' output goes to ``path``
    (appended), kvtier's to ``console``; with ``verbose`` nothing is redirected."""

    def __init__(self, path: Path, verbose: bool = False) -> None:
        self.path = path
        self.verbose = verbose
        self._saved: list[int] = []
        self._terminal: IO[str] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> Any:
        from rich.console import Console

        # Long lines (paths, the verdict) are not cut into the table's width.
        if self.verbose:
            return Console(soft_wrap=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = [os.dup(1), os.dup(2)]
        # The terminal the run started on, for the console only.
        self._terminal = os.fdopen(os.dup(self._saved[0]), "w", buffering=1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.path, "ab")
        os.dup2(self._log.fileno(), 1)
        os.dup2(self._log.fileno(), 2)
        return Console(file=self._terminal, force_terminal=self._terminal.isatty(), soft_wrap=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.verbose:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self._saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        self._saved = []
        if self._log is not None:
            self._log.close()
        if self._terminal is not None:
            self._terminal.close()
