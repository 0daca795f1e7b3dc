"""kvtier's CUDA platform: a page mover (a Triton kernel gathers pages into device staging, the
copy engine moves them to pinned host memory on side streams) and a pinned host arena made of
one registration.

Importing this package is cheap: it imports neither triton nor initialises CUDA. The platform
class lives in ``kvtier.cuda.platform`` and is found through the ``kvtier.platforms`` entry
point (``kvtier.cuda.detect:detect``).
"""

from kvtier.cuda.__about__ import __version__

__all__ = ["__version__"]
