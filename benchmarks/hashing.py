"""Chunk-hashing benchmark: ``python benchmarks/hashing.py`` (same as ``kvtier bench hashing``)."""

import sys

from kvtier.core.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
