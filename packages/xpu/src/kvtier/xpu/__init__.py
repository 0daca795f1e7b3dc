"""kvtier's Intel XPU platform: torch.xpu streams and events, pinned host memory, and a page
mover that runs core's torch page copy on transfer streams through device staging buffers.

Importing this package imports torch and kvtier.core only; it touches no device until a
mover is created.
"""

from kvtier.xpu.__about__ import __version__
from kvtier.xpu.detect import detect
from kvtier.xpu.mover import XPUPageMover
from kvtier.xpu.platform import XPUPlatform
from kvtier.xpu.streams import StreamAPI

__all__ = ["StreamAPI", "XPUPageMover", "XPUPlatform", "__version__", "detect"]
