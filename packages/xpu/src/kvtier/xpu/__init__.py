"""kvtier's Intel XPU platform: torch.xpu streams and events, pinned host memory, and a paged
connector that reuses core's torch paged copy with an optional device staging buffer.

Importing this package imports torch and kvtier.core only; it touches no device until a
connector is created.
"""

from kvtier.xpu.__about__ import __version__
from kvtier.xpu.connector import XPUPagedConnector
from kvtier.xpu.platform import XPUPlatform
from kvtier.xpu.probe import probe
from kvtier.xpu.streams import StreamAPI

__all__ = ["StreamAPI", "XPUPagedConnector", "XPUPlatform", "__version__", "probe"]
