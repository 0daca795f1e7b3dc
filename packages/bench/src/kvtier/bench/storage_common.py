"""Shared parts of the storage benchmark (``kvtier bench storage``): chunk shapes, the
interleaved ours-vs-reference timing loop (``Bench``), host arenas and objects filled with
random bytes, a tier built from config overrides, and the chart."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.core.config import load_config
from kvtier.core.keys import KeyFactory
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta
from kvtier.storage.backends.base import BackendContext, StorageBackend

TARGETS = {"local_cpu": 0.8, "local_disk": 0.8, "redis": 0.8}


@dataclass(frozen=True)
class Shape:
    name: str
    layout: KVLayout
    tokens: int
    batch: int

    @property
    def meta(self) -> MemoryObjMeta:
        return MemoryObjMeta(
            self.layout.chunk_shape(self.tokens), self.layout.chunk_dtype, self.tokens
        )


SHAPES = [
    Shape("8b", KVLayout(32, 8, 128, "bfloat16", 16, PagedLayout.LBHNC), 256, 4),
    Shape("small", KVLayout(16, 2, 64, "bfloat16", 16, PagedLayout.LBHNC), 256, 16),
]


def _median_gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Bench:
    """Collects the rows of one run; ``compare`` times ours and the reference in turn."""

    def __init__(self, repeat: int) -> None:
        self.repeat = repeat
        self.rows: list[dict[str, Any]] = []

    def compare(
        self,
        tier: str,
        shape: Shape,
        op: str,
        nbytes: int,
        ours: Callable[[int], Callable[[], Any]],
        ref: Callable[[int], Callable[[], Any]],
        cleanup: Callable[[], None] = lambda: None,
        variant: str | None = None,
    ) -> None:
        """``ours(round)``/``ref(round)`` prepare a round (untimed) and return the timed part."""
        t_ours: list[float] = []
        t_ref: list[float] = []
        for r in range(self.repeat + 1):  # round 0 warms up
            a = _timed(ref(r))
            cleanup()
            b = _timed(ours(r))
            cleanup()
            if r:
                t_ref.append(a)
                t_ours.append(b)
        g, rg = _median_gbps(nbytes, t_ours), _median_gbps(nbytes, t_ref)
        row = {
            "tier": tier,
            "shape": shape.name,
            "op": op,
            "chunk_bytes": shape.meta.nbytes,
            "batch": shape.batch,
            "gbps": round(g, 3),
            "reference_gbps": round(rg, 3),
            "ratio": round(g / rg, 3),
            "target": TARGETS[tier],
        }
        if variant:
            row["variant"] = variant
        self.rows.append(row)
        label = f"{op} {variant}" if variant else op
        print(
            f"{tier:<11}{shape.name:<7}{label:<16}{g:>9.2f}{rg:>11.2f}{g / rg:>8.2f}{TARGETS[tier]:>8.2f}",
            flush=True,
        )


def touched_arena(nbytes: int) -> HostArena:
    """A host arena whose pages are already faulted in, as a serving engine's are."""
    arena = HostArena.create(nbytes)
    arena.buffer.fill_(0)
    return arena


def _fill(obj: MemoryObj, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randint(0, 256, obj.meta.shape, dtype=torch.uint8, generator=g))


def make_backend(
    cls: type[StorageBackend], shape: Shape, arena: HostArena, **cfg: Any
) -> StorageBackend:
    """A ``cls`` tier for ``shape`` built from config overrides ``cfg`` (sealed if they set a
    key)."""
    config = load_config(overrides={"chunk_size": shape.tokens, **cfg}, env={})
    ns = KeyFactory("bench", shape.layout.fingerprint()).key(b"").namespace()
    key = config.encryption_key_bytes()
    sealer = None
    if key is not None:
        from kvtier.storage.sealing import Sealer

        sealer = Sealer(key)
    return cls(
        BackendContext(config=config, layout=shape.layout, namespace=ns, arena=arena, sealer=sealer)
    )


def filled_objects(shape: Shape) -> tuple[HostArena, list[MemoryObj]]:
    """A touched arena and ``shape.batch`` objects in it filled with random bytes."""
    meta = shape.meta
    arena = touched_arena(meta.nbytes * (2 * shape.batch + 2))
    objs = []
    for i in range(shape.batch):
        obj = arena.allocate(meta)
        assert obj is not None
        _fill(obj, i)
        objs.append(obj)
    return arena, objs


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    labels = [
        f"{r['tier']}\n{r['shape']} {r['op']}" + (f"\n{r['variant']}" if "variant" in r else "")
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    bars = ax.bar(
        range(len(rows)),
        [r["ratio"] for r in rows],
        color=["tab:blue" if r["ratio"] >= (r["target"] or 0) else "tab:orange" for r in rows],
    )
    for i, r in enumerate(rows):
        if r["target"] is not None:  # a cost measurement (sealed vs plain) has no target
            ax.hlines(r["target"], i - 0.4, i + 0.4, colors="black", linestyles="dashed")
        ax.text(
            i,
            r["ratio"] + 0.02,
            f"{r['gbps']:.1f}\n/{r['reference_gbps']:.1f}",
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("kvtier / reference throughput")
    ax.set_title("kvtier storage tiers vs. reference (dashed: target; labels GB/s ours/ref)")
    ax.set_ylim(0, max(1.2, max(r["ratio"] for r in rows) + 0.2))
    del bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
