"""Storage-tier benchmark: ``python benchmarks/storage.py`` (same as ``kvtier bench storage``)."""

import sys

from kvtier.bench.storage import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
