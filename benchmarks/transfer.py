"""Paged KV transfer benchmark: ``python benchmarks/transfer.py`` (same as ``kvtier bench transfer``).

Needs an NVIDIA GPU; writes ``benchmarks/results/transfer-<device>.json`` and ``.png``.
"""

import sys

from kvtier.bench.transfer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
