"""The CUDA connector's options: one typed, checked object (``CUDAOptions``).

``Platform.create_connector(kv_caches, layout, **options)`` and ``CUDAPagedConnector(...,
**options)`` both go through ``CUDAOptions.from_options``: an unknown or misspelt name, or a
value of the wrong type, is a ``TypeError`` naming it; a value out of range a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CUDAOptions:
    """What a user may choose about a CUDA connector.

    - ``staging_buffer`` (config ``device_staging_buffer``; the meaning every platform shares):
      True keeps the device staging rings allocated between calls; False releases a ring once
      each call is issued (a layer-by-layer call: once it ends), so the connector holds no
      staging memory between calls, only its small table buffers (each call allocates its ring
      again, through torch's caching allocator).
    - ``staging_slots`` (>= 2, double buffering) and ``staging_slot_bytes`` (> 0): the staging
      ring of each direction. The two rings cost ``2 * staging_slots * staging_slot_bytes`` of
      device memory; a slot grows to fit one row when a row is larger.
    - ``native_planner``: plan ordinary whole-chunk groups with the compiled C planner
      (``kvtier.cuda._native``; compiled at first use, with a Python fallback when it cannot be).
      False always plans in Python (same plans, more host time).
    """

    staging_buffer: bool = True
    staging_slots: int = 2
    staging_slot_bytes: int = 32 << 20
    native_planner: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = type(f.default)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise TypeError(
                    f"CUDA connector option {f.name} must be a {want.__name__}, got {value!r}"
                )
        if self.staging_slots < 2:
            raise ValueError(
                f"CUDA connector option staging_slots must be >= 2 (double buffering), got {self.staging_slots}"
            )
        if self.staging_slot_bytes <= 0:
            raise ValueError(
                f"CUDA connector option staging_slot_bytes must be > 0, got {self.staging_slot_bytes}"
            )

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> CUDAOptions:
        """``options`` by name; raises ``TypeError`` naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown CUDA connector option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)  # type: ignore[arg-type]
