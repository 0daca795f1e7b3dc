"""The ``kvtier`` command. Subcommands come from the ``kvtier.cli`` entry-point group, so each
package adds its own (``demo`` and ``bench ...`` from kvtier-bench, ``ls``/``stats``/``clear``
from kvtier-storage).

An entry named ``"bench.storage"`` is run as ``kvtier bench storage``. Each entry point is a
``main(argv: list[str]) -> int``.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

_EXTRA_HINT = {
    "demo": "demo",
    "bench.e2e": "demo",
    "bench.serve": "demo",
    "bench.storage": "bench,redis",
    "bench.transfer": "bench,cuda",
    "bench.xpu": "bench,xpu",
    "bench.hashing": "bench",
}


def _commands() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="kvtier.cli")}


def _usage(commands: dict[str, str]) -> str:
    names = sorted(set(commands) | set(_EXTRA_HINT))
    lines = ["usage: kvtier COMMAND [ARGS...]", "", "commands:"]
    for name in names:
        note = "" if name in commands else f"  (install kvtier[{_EXTRA_HINT[name]}])"
        lines.append(f"  {name.replace('.', ' ')}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(commands))
        return 0
    name, rest = argv[0], argv[1:]
    if name == "bench":
        if not rest or rest[0].startswith("-"):
            print(_usage(commands))
            return 2
        name, rest = f"bench.{rest[0]}", rest[1:]
    if name not in commands:
        if name in _EXTRA_HINT:
            print(
                f"kvtier {name.replace('.', ' ')}: install kvtier[{_EXTRA_HINT[name]}] to use it",
                file=sys.stderr,
            )
        else:
            print(
                f"kvtier: unknown command {name.replace('.', ' ')!r}\n\n{_usage(commands)}",
                file=sys.stderr,
            )
        return 2
    module, _, attr = commands[name].partition(":")
    func = getattr(__import__(module, fromlist=[attr]), attr)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
