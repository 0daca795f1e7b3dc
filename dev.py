#!/usr/bin/env python3
"""Bootstrap with nothing but python3: ``python3 dev.py demo`` or ``python3 dev.py test``.

Creates ``.venv-tools`` with nox in it (once), then runs the nox session. ``test`` is the
``tests-cpu`` session; any other word is a nox session name. Arguments after ``--`` reach pytest
(``python3 dev.py test -- -k disk``) or the demo (``python3 dev.py demo -- --help``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TOOLS = ROOT / ".venv-tools"
ALIASES = {"test": "tests-cpu", "tests": "tests-cpu"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    session = ALIASES.get(argv[0], argv[0])
    rest = argv[1:]
    bindir = TOOLS / ("Scripts" if os.name == "nt" else "bin")
    nox = bindir / "nox"
    if not nox.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(TOOLS)
        subprocess.run(
            [str(bindir / "python"), "-m", "pip", "install", "-q", "nox>=2024.4.15"], check=True
        )
    cmd = [str(nox), "-f", str(ROOT / "noxfile.py"), "-s", session, *rest]
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
