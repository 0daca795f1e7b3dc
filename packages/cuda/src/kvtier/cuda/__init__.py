"""kvtier's CUDA platform: Triton gather/scatter kernels, copy-engine DMA on side streams, and a
pinned host arena made of one registration.

Importing this package is cheap: it imports neither triton nor initialises CUDA. The platform
class lives in ``kvtier.cuda.platform`` and is found through the ``kvtier.platforms`` entry
point (``kvtier.cuda.probe:probe``).
"""

from kvtier.cuda.__about__ import __version__

__all__ = ["__version__"]
