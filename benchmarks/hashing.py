"""Chunk-hashing benchmark: ``python benchmarks/hashing.py`` (same as ``kvtier bench hashing``)."""

import sys

from kvtier.bench.hashing import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
