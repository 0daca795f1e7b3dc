"""On/off switches read from the environment (``KVTIER_CUDA_*``)."""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool) -> bool:
    """The setting ``name``: a switch that is on by default is turned off only by 0, false, no
    or off; one that is off by default is turned on only by 1, true, yes or on (any case, around
    spaces). Anything else, or no variable, keeps the default."""
    value = os.environ.get(name, "").strip().lower()
    return value not in _OFF if default else value in _ON
