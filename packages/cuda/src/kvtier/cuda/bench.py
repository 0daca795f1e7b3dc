"""``kvtier bench transfer``: paged KV <-> pinned host throughput on one NVIDIA GPU.

In one run, per model shape (8B: 32 layers, 8 kv heads, head 128; small: 16 layers, 2 kv heads,
head 64; bf16, block 16, chunks of 256 tokens, flash-attn layout), it measures:

- ``limit``: one contiguous pinned-host copy of the same bytes, each direction, and both
  directions at once on two streams (what PCIe and the copy engines can do);
- ``torch``: core's TorchPagedConnector (index_select / index_copy_ per layer + copy);
- ``kvtier``: the CUDA connector (default settings), store, retrieve, and both at once
  (``store_and_load_async`` from one thread; two threads calling ``store()`` and ``load()`` is
  a variant, once as the connector issues them, from one of the threads, and once with each
  thread issuing its own call).

It also measures the one-kernel zero-copy mode, a call prepared as one group
(``first_group_bytes=0``) and a few staging-ring sizes (``variants``), so
the default can be chosen from numbers. Every path's bytes are checked against the torch
reference before timing. Times are host wall-clock medians of whole calls (each call returns
with its copies done), so host overhead counts. The rows the targets are read from (the limit,
kvtier's three calls and the streams) are measured together, each call once per round in turn,
so drift during the run falls on the reference and kvtier alike (``_measure_paired``).

It also measures a *stream* of calls (``streamed`` in the JSON): ``--stream-calls`` calls issued
back to back with the ``_async`` API, at most ``--in-flight`` of them outstanding (the caller
waits for the oldest before issuing another), as an engine's saver and loader keep transfers going;
the limit's stream is the same number of contiguous copies queued back to back. One call's
rows include its pipeline's fill and drain and the host work before its first DMA; a stream
overlaps them with the previous call's bytes, so it measures sustained throughput.
Writes ``transfer-<device>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.core.connector import TorchPagedConnector, Transfer
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena, MemoryObj, MemoryObjMeta

CHUNK = 256
BLOCK = 16
SHAPES = {"8b": (32, 8, 128), "small": (16, 2, 64)}
TARGETS = {"8b": 0.95, "small": 0.85}
DUPLEX_TARGET = 1.7


@dataclass
class _Case:
    shape: str
    layout: KVLayout
    caches: list[torch.Tensor]
    store_objs: list[MemoryObj]
    load_objs: list[MemoryObj]
    store_slots: list[torch.Tensor]
    load_slots: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(o.meta.nbytes for o in self.store_objs)

    def store_transfers(self) -> list[Transfer]:
        return [Transfer(o, s) for o, s in zip(self.store_objs, self.store_slots, strict=True)]

    def load_transfers(self) -> list[Transfer]:
        return [Transfer(o, s) for o, s in zip(self.load_objs, self.load_slots, strict=True)]


def _device_slug(name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")).lower()


def _median_seconds(fn: Callable[[], None], repeat: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _make_case(shape: str, chunks: int, arena: HostArena, seed: int) -> _Case:
    layers, heads, head = SHAPES[shape]
    layout = KVLayout(layers, heads, head, "bfloat16", BLOCK, PagedLayout.FLASH_NHD)
    blocks_per_chunk = CHUNK // BLOCK
    num_blocks = 2 * chunks * blocks_per_chunk + 7  # room for a store set and a load set
    gen = torch.Generator(device="cuda").manual_seed(seed)
    caches = [
        torch.randn(layout.expected_cache_shape(num_blocks), device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(layers)
    ]
    # Blocks in random order, as a long-running engine hands them out.
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    offsets = torch.arange(BLOCK)

    def slots_of(k: int) -> torch.Tensor:
        ids = perm[k * blocks_per_chunk : (k + 1) * blocks_per_chunk]
        return (ids[:, None] * BLOCK + offsets).reshape(-1)

    meta = MemoryObjMeta(layout.chunk_shape(CHUNK), torch.bfloat16, CHUNK)

    def objects() -> list[MemoryObj]:
        objs = []
        for _ in range(chunks):
            obj = arena.allocate(meta)
            if obj is None:
                raise MemoryError("benchmark arena too small")
            obj.tensor.normal_()
            objs.append(obj)
        return objs

    return _Case(
        shape=shape,
        layout=layout,
        caches=caches,
        store_objs=objects(),
        load_objs=objects(),
        store_slots=[slots_of(k) for k in range(chunks)],
        load_slots=[slots_of(chunks + k) for k in range(chunks)],
    )


def _release(case: _Case) -> None:
    for o in case.store_objs + case.load_objs:
        o.release()


def _check(case: _Case, conn, name: str) -> None:  # type: ignore[no-untyped-def]
    """The connector's bytes equal the torch reference's (store and load), or raise."""
    ref = TorchPagedConnector([c.clone() for c in case.caches], case.layout)
    conn.store(case.store_transfers())
    got = [o.tensor.clone() for o in case.store_objs]
    ref.store(case.store_transfers())
    if not all(torch.equal(a.view(torch.int16), o.tensor.view(torch.int16)) for a, o in zip(got, case.store_objs, strict=True)):
        raise AssertionError(f"{name}: stored bytes differ from the torch reference")
    conn.load(case.load_transfers())
    ref.load(case.load_transfers())
    torch.cuda.synchronize()
    for a, b in zip(conn.kv_caches, ref.kv_caches, strict=True):
        if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            raise AssertionError(f"{name}: loaded cache differs from the torch reference")


class _Pair:
    """Two persistent threads that run a store and a load at the same moment, on demand."""

    def __init__(self, store: Callable[[], None], load: Callable[[], None]) -> None:
        self._start = threading.Barrier(3, timeout=120)
        self._end = threading.Barrier(3, timeout=120)
        self._stop = False
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._loop, args=(f,), daemon=True) for f in (store, load)]
        for t in self._threads:
            t.start()

    def _loop(self, fn: Callable[[], None]) -> None:
        while True:
            self._start.wait()
            if self._stop:
                return
            try:
                fn()
            except BaseException as e:
                self._errors.append(e)
            self._end.wait()

    def __call__(self) -> None:
        self._start.wait()
        self._end.wait()
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        self._stop = True
        self._start.wait()
        for t in self._threads:
            t.join(timeout=30)


def _calls(case: _Case, conn) -> dict[str, Callable[[], None]]:  # type: ignore[no-untyped-def]
    """The case's whole calls on ``conn``, each returning with its copies done: ``store``,
    ``load`` and ``both`` (``store_and_load_async`` from one thread, both waited)."""
    stores, loads = case.store_transfers(), case.load_transfers()

    def both() -> None:
        for pending in conn.store_and_load_async(stores, loads):
            pending.wait()

    return {"store": lambda: conn.store(stores), "load": lambda: conn.load(loads), "both": both}


def _stream_calls(case: _Case, conn) -> dict[str, Callable[[], list[Any]]]:  # type: ignore[no-untyped-def]
    """The case's calls through the ``_async`` API, keyed like ``_measure_connector``'s rows:
    each issues one call and returns its pending transfers (``wait()`` each)."""
    stores, loads = case.store_transfers(), case.load_transfers()
    return {
        "store": lambda: [conn.store_async(stores)],
        "retrieve": lambda: [conn.load_async(loads)],
        "both": lambda: list(conn.store_and_load_async(stores, loads)),
    }


def _stream(issue: Callable[[], list[Any]], calls: int, in_flight: int) -> Callable[[], None]:
    """A call that makes ``calls`` calls of ``issue`` back to back, at most ``in_flight``
    outstanding (before a call the oldest is waited for when that many are), and waits for all."""
    if calls < 1 or in_flight < 1:
        raise ValueError(f"calls and in_flight must be >= 1, got {calls} and {in_flight}")

    def stream() -> None:
        outstanding: collections.deque[list[Any]] = collections.deque()
        for _ in range(calls):
            while len(outstanding) >= in_flight:
                for pending in outstanding.popleft():
                    pending.wait()
            outstanding.append(issue())
        while outstanding:
            for pending in outstanding.popleft():
                pending.wait()

    return stream


def _ab_medians(
    calls: dict[str, tuple[Callable[[], None], Callable[[], None]]], rounds: int, per_round: int = 3,
    warmup: int = 3,
) -> dict[str, float]:
    """Median seconds of each ``name: (fn, apply)``, A/B style: every round runs every call
    ``per_round`` times, ``apply()`` first (settings switched call by call on one connector), so
    a shared machine's drift falls on all of them alike. ``warmup`` untimed runs each first.

    The order rotates by one call each round, so every call runs after every other about
    equally often: a call that follows a different kind of call runs slower (the host's caches
    hold the other code path), and with a fixed order that cost fell on the same call every
    round. On one H200 it was worth 0.04-0.07 of the one-way limit to whichever of an A/B pair
    came first (``benchmarks/transfer_ops_ab.py`` run in both orders)."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for fn, apply in calls.values():
        apply()
        for _ in range(warmup):
            fn()
    names = list(calls)
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            fn, apply = calls[name]
            apply()
            for _ in range(per_round):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _ab_row(shape: str, chunks: int, name: str, seconds: float, moved: int, one_way_gbps: float, width: int) -> dict:
    """One row of an A/B script (``benchmarks/transfer_*_ab.py``): a call's median ``seconds``
    moving ``moved`` bytes, as GB/s and as a ratio to the one-way limit; printed as well."""
    gbps = moved / seconds / 1e9
    print(f"{name:{width}s} {seconds * 1e6:9.1f} us  {gbps:6.1f} GB/s  {gbps / one_way_gbps:5.3f}x one-way limit")
    return {"shape": shape, "chunks": chunks, "call": name, "us": round(seconds * 1e6, 1),
            "gbps": round(gbps, 2), "x_one_way_limit": round(gbps / one_way_gbps, 3)}


def _ab_limits(
    limit_issues: dict[str, Callable[[], list[Any]]], stream_calls: int, in_flight: int, keep: Callable[[], None]
) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """The references of an A/B with streamed rows (``_ab_medians`` entries, run under ``keep``,
    the connector's default setting): the contiguous copy one way and both ways, once as a call
    and once as a stream of ``stream_calls`` (``_limit_stream_calls``' issues)."""
    return {
        "limit one-way": (_waited(limit_issues["store"]), keep),
        "limit both": (_waited(limit_issues["both"]), keep),
        "limit one-way streamed": (_stream(limit_issues["store"], stream_calls, in_flight), keep),
        "limit both streamed": (_stream(limit_issues["both"], stream_calls, in_flight), keep),
    }


def _ab_streamed_rows(
    shape: str, chunks: int, nbytes: int, medians: dict[str, float], rounds: int, stream_calls: int,
    in_flight: int, width: int,
) -> list[dict]:
    """``_ab_row``s of an A/B measured with ``_ab_limits``: a call against the one-way copy, a
    stream (``streamed`` in its name; its time per call) against a stream of one-way copies,
    which runs ~5% faster than single ones. A row moves ``nbytes`` once when its name starts
    with ``limit one-way``, ``store`` or ``load``, twice otherwise (both directions). Prints a
    header first."""
    one_way = nbytes / medians["limit one-way"] / 1e9
    one_way_streamed = nbytes * stream_calls / medians["limit one-way streamed"] / 1e9
    print(f"== {shape}, {chunks} chunks a call ({nbytes / 2**20:.0f} MiB each way); "
          f"one-way limit {one_way:.1f} GB/s, streamed {one_way_streamed:.1f} GB/s; median of {3 * rounds}; "
          f"streams of {stream_calls}, {in_flight} in flight")
    rows = []
    for name, m in medians.items():
        is_stream = "streamed" in name
        one_direction = name.startswith(("limit one-way", "store", "load"))
        rows.append(_ab_row(
            shape, chunks, name, m / (stream_calls if is_stream else 1), nbytes * (1 if one_direction else 2),
            one_way_streamed if is_stream else one_way, width,
        ))
    return rows


def _ab_cases(cases: Sequence[str], run: Callable[[str, int], list[dict]]) -> list[dict]:
    """An A/B script's rows for each ``shape:chunks`` of ``cases`` (``run(shape, chunks)``),
    the device's cached memory released between cases."""
    rows: list[dict] = []
    for case in cases:
        shape, chunks = case.split(":")
        rows += run(shape, int(chunks))
        torch.cuda.empty_cache()
    return rows


def _settings(spec: str, conn: object) -> dict[str, Any]:
    """``"NAME=VALUE[,NAME=VALUE...]"`` as connector settings for an A/B script or a trace:
    each NAME must be an existing attribute of ``conn`` and VALUE is read as that attribute's
    type (a bool from ``1/0/true/false/on/off``, an int with an optional ``MiB`` suffix, or a
    str). Raises ValueError naming the setting at fault."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name:
            raise ValueError(f"setting {item!r}: expected NAME=VALUE")
        if not hasattr(conn, name):
            raise ValueError(f"setting {name!r}: the connector has no such attribute")
        current = getattr(conn, name)
        if isinstance(current, bool):
            words = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
            if text.lower() not in words:
                raise ValueError(f"setting {name!r}: {text!r} is not a bool (1/0, true/false, on/off)")
            out[name] = words[text.lower()]
        elif isinstance(current, int):
            scale = 1 << 20 if text.lower().endswith("mib") else 1
            digits = text[:-3] if scale > 1 else text
            try:
                out[name] = int(digits) * scale
            except ValueError:
                raise ValueError(f"setting {name!r}: {text!r} is not an int") from None
        elif isinstance(current, str):
            out[name] = text
        else:
            raise ValueError(f"setting {name!r}: only bool, int and str attributes can be set, not {type(current).__name__}")
    return out


def _write_ab(rows: list[dict], out: Path, stem: str, suffix: str = "") -> None:
    """An A/B script's rows to ``OUT/<stem>-<device>[-suffix].json``."""
    name = torch.cuda.get_device_name()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{_device_slug(name)}{'-' + suffix if suffix else ''}.json"
    path.write_text(json.dumps({"device": name, "results": rows}, indent=1))
    print(f"wrote {path}")


def _arena(chunks: int, shapes: Sequence[str]) -> HostArena:
    """A pinned arena holding a case's store and load objects of ``chunks`` chunks of the largest
    of ``shapes``, and the plain copies' buffers of ``_limit_calls``."""
    from kvtier.cuda.platform import CUDAPlatform

    largest = max(_chunk_nbytes(s) for s in shapes)
    return CUDAPlatform().create_arena(4 * chunks * largest + (64 << 20))


def _measure_paired(
    case: _Case, conn, arena: HostArena, repeat: int, warmup: int, stream_calls: int, in_flight: int  # type: ignore[no-untyped-def]
) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
    """The rows the targets are read from, measured together: seconds per call of the limit
    (``_limit_stream_calls``) and of ``conn`` (``store``, ``retrieve``, ``both``: one call each),
    and, with ``stream_calls``, of both as streams (``_stream``, per call). Every call runs once
    per round, in turn (``_ab_medians``), so a machine whose PCIe or host speed drifts during
    the run (seen on shared H200 hosts: the plain copy both ways from 1.69x to 1.84x the
    one-way copy within one session) slows the reference and kvtier alike.

    Returns ``(limit, kvtier, limit streamed, kvtier streamed)``; the streamed dicts are empty
    without ``stream_calls``."""
    issues, release = _limit_stream_calls(case.nbytes, arena)
    mine = _calls(case, conn)
    mine_async = _stream_calls(case, conn)
    calls: dict[str, Callable[[], None]] = {}
    for d in ("store", "retrieve", "both"):
        calls[f"limit {d}"] = _waited(issues[d])
        calls[f"kvtier {d}"] = mine["load" if d == "retrieve" else d]
        if stream_calls > 0:
            calls[f"limit-streamed {d}"] = _stream(issues[d], stream_calls, in_flight)
            calls[f"kvtier-streamed {d}"] = _stream(mine_async[d], stream_calls, in_flight)
    try:
        medians = _ab_medians({k: (fn, _nothing) for k, fn in calls.items()}, repeat, per_round=1, warmup=warmup)
    finally:
        release()
    out: tuple[dict[str, float], ...] = ({}, {}, {}, {})
    for k, m in medians.items():
        impl, d = k.split()
        i = ("limit", "kvtier", "limit-streamed", "kvtier-streamed").index(impl)
        out[i][d] = m / (stream_calls if i >= 2 else 1)
    return out[0], out[1], out[2], out[3]


def _nothing() -> None:
    pass


def _measure_connector(case: _Case, conn, repeat: int, warmup: int, both: str | None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median seconds per call; ``both``: None, "async" (one thread runs
    ``store_and_load_async``) or "threads" (a thread calls store(), another load())."""
    calls = _calls(case, conn)
    out = {
        "store": _median_seconds(calls["store"], repeat, warmup),
        "retrieve": _median_seconds(calls["load"], repeat, warmup),
    }
    if both == "async":
        out["both"] = _median_seconds(calls["both"], repeat, warmup)
    elif both == "threads":
        pair = _Pair(calls["store"], calls["load"])
        try:
            out["both"] = _median_seconds(pair, repeat, warmup)
        finally:
            pair.close()
    return out


class _Queued:
    """A copy queued on a stream, waited like a PendingTransfer."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def wait(self) -> None:
        self._event.synchronize()


def _limit_stream_calls(nbytes: int, arena: HostArena) -> tuple[dict[str, Callable[[], list[Any]]], Callable[[], None]]:
    """One contiguous copy of ``nbytes`` each way (pinned host <-> device, each on its own
    stream), and both at once, as calls keyed ``store``/``retrieve``/``both`` that queue the
    copies and return their waiters (for ``_stream``); and the call that releases
    their host objects."""
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    objs = [arena.allocate(MemoryObjMeta((nbytes,), torch.uint8, 1)) for _ in range(2)]
    held = [o for o in objs if o is not None]

    def release() -> None:
        for o in held:
            o.release()

    if len(held) < 2:
        release()
        raise MemoryError("benchmark arena too small")
    host_out, host_in = held[0].tensor, held[1].tensor
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h() -> list[Any]:
        with torch.cuda.stream(s1):
            host_out.copy_(dev_out, non_blocking=True)
        return [_Queued(s1)]

    def h2d() -> list[Any]:
        with torch.cuda.stream(s2):
            dev_in.copy_(host_in, non_blocking=True)
        return [_Queued(s2)]

    return {"store": d2h, "retrieve": h2d, "both": lambda: d2h() + h2d()}, release


def _limit_calls(nbytes: int, arena: HostArena) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """``_limit_stream_calls``, each call returning with its copies done."""
    issues, release = _limit_stream_calls(nbytes, arena)
    return {name: _waited(issue) for name, issue in issues.items()}, release


def _waited(issue: Callable[[], list[Any]]) -> Callable[[], None]:
    """``issue`` as a call that returns with its copies done."""
    def call() -> None:
        for q in issue():
            q.wait()
    return call


def _chunk_nbytes(shape: str) -> int:
    """Bytes of one chunk of ``shape`` (bf16, flash layout), as the benchmark stores it."""
    return KVLayout(*SHAPES[shape], "bfloat16", BLOCK, PagedLayout.FLASH_NHD).chunk_nbytes(CHUNK)


def _rows(shape: str, impl: str, seconds: dict[str, float], nbytes: int, limit_gbps: dict[str, float]) -> list[dict]:
    rows = []
    one_way = (limit_gbps["store"] + limit_gbps["retrieve"]) / 2
    for direction, s in seconds.items():
        moved = nbytes * (2 if direction == "both" else 1)
        gbps = moved / s / 1e9
        row = {
            "shape": shape,
            "direction": direction,
            "impl": impl,
            "gbps": round(gbps, 2),
            "ratio_to_limit": round(gbps / limit_gbps[direction], 3),
            "bytes": moved,
            "seconds": s,
        }
        if direction == "both":
            # The duplex target: both directions at once vs one direction of the contiguous copy.
            row["x_one_direction_limit"] = round(gbps / one_way, 3)
        rows.append(row)
    return rows


def _plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = (result["results"] + [r for r in result["variants"] if r.get("config") == "zerocopy"]
            + [r for r in result.get("streamed", []) if r["impl"] == "kvtier-streamed"])
    groups = [(s, d) for s in SHAPES for d in ("store", "retrieve", "both")]
    impls = ["torch", "kvtier", "kvtier-streamed", "kvtier-zerocopy"]
    impls = [i for i in impls if any(r["impl"] == i for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        ys = []
        for s, d in groups:
            match = [r for r in rows if r["shape"] == s and r["direction"] == d and r["impl"] == impl]
            ys.append(match[0]["ratio_to_limit"] if match else 0.0)
        ax.bar([g + k * width for g in range(len(groups))], ys, width, label=impl)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([g + width for g in range(len(groups))])
    ax.set_xticklabels([f"{s}\n{d}" for s, d in groups])
    ax.set_ylabel("fraction of the contiguous pinned copy")
    ax.set_title(f"paged KV transfer on {result['device']} (limit: " + ", ".join(
        f"{r['shape']} {r['direction']} {r['gbps']} GB/s" for r in result["results"]
        if r["impl"] == "limit" and r["shape"] == "8b") + ")", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--chunks", type=int, default=16, help="256-token chunks per call (default 16)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--device-name", help="name in the output files (default: from the GPU)")
    ap.add_argument("--suffix", default="", help="appended to the output file names")
    ap.add_argument("--no-variants", action="store_true", help="skip zerocopy and ring-size variants")
    ap.add_argument("--stream-calls", type=int, default=8,
                    help="calls per stream in the streamed rows (default 8; 0 skips them)")
    ap.add_argument("--in-flight", type=int, default=2,
                    help="streamed rows: most calls outstanding at once (default 2)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvtier bench transfer needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return 2

    from kvtier.cuda.connector import CUDAPagedConnector

    name = torch.cuda.get_device_name()
    slug = args.device_name or _device_slug(name)
    arena = _arena(args.chunks, args.shapes)
    results: list[dict] = []
    variants: list[dict] = []
    streamed: list[dict] = []
    configs: list[tuple[str, dict[str, Any]]] = [] if args.no_variants else [
        ("zerocopy", {"mode": "zerocopy"}),
        ("one group", {"first_group_bytes": 0}),
        ("ring 4x8MiB", {"staging_slots": 4, "staging_slot_bytes": 8 << 20}),
        ("ring 2x64MiB", {"staging_slots": 2, "staging_slot_bytes": 64 << 20}),
    ]
    print(f"device: {name}; {args.chunks} chunks of {CHUNK} tokens per call; median of {args.repeat}")
    print(f"{'shape':<6} {'direction':<9} {'impl':<22} {'GB/s':>7} {'ratio':>6}")
    for shape in args.shapes:
        case = _make_case(shape, args.chunks, arena, seed=len(results))
        conn = CUDAPagedConnector(case.caches, case.layout)
        _check(case, conn, "kvtier")
        limit_s, kvtier_s, stream_limit_s, stream_s = _measure_paired(
            case, conn, arena, args.repeat, args.warmup, args.stream_calls, args.in_flight
        )
        limit_gbps = {d: case.nbytes * (2 if d == "both" else 1) / s / 1e9 for d, s in limit_s.items()}
        rows = _rows(shape, "limit", limit_s, case.nbytes, limit_gbps)
        torch_conn = TorchPagedConnector(case.caches, case.layout)
        rows += _rows(shape, "torch", _measure_connector(case, torch_conn, max(3, args.repeat // 4), 1, both=None),
                      case.nbytes, limit_gbps)
        rows += _rows(shape, "kvtier", kvtier_s, case.nbytes, limit_gbps)
        results += rows
        if configs:
            trows = [r for r in _rows(shape, "kvtier-two-threads",
                                       _measure_connector(case, conn, args.repeat, args.warmup, both="threads"),
                                       case.nbytes, limit_gbps) if r["direction"] == "both"]
            for r in trows:
                r["config"] = "two threads"
            # The same connector with each thread issuing its own call (no combining, see
            # CUDAPagedConnector._issue): what two threads cost without it.
            combine, conn._combine = conn._combine, False
            try:
                srows = [r for r in _rows(shape, "kvtier-two-threads-apart",
                                           _measure_connector(case, conn, args.repeat, args.warmup, both="threads"),
                                           case.nbytes, limit_gbps) if r["direction"] == "both"]
            finally:
                conn._combine = combine
            for r in srows:
                r["config"] = "two threads, each issuing its own call (combine_calls=False)"
            trows += srows
            variants += trows
            rows += trows
        for label, opts in configs:
            vconn = CUDAPagedConnector(case.caches, case.layout, **opts)
            _check(case, vconn, label)
            vrows = _rows(shape, "kvtier-" + label.replace(" ", "-"),
                          _measure_connector(case, vconn, args.repeat, args.warmup, both="async"),
                          case.nbytes, limit_gbps)
            for r in vrows:
                r["config"] = label
            variants += vrows
            rows += vrows
            del vconn
        if stream_s:
            stream_gbps = {d: case.nbytes * (2 if d == "both" else 1) / s / 1e9 for d, s in stream_limit_s.items()}
            srows = _rows(shape, "limit", stream_limit_s, case.nbytes, stream_gbps) + _rows(
                shape, "kvtier", stream_s, case.nbytes, stream_gbps)
            for r in srows:
                r["impl"] += "-streamed"
                r["calls_per_stream"] = args.stream_calls
                r["in_flight"] = args.in_flight
            streamed += srows
            rows += srows
        for r in rows:
            extra = f"  ({r['x_one_direction_limit']}x one-way limit)" if "x_one_direction_limit" in r else ""
            print(f"{r['shape']:<6} {r['direction']:<9} {r['impl']:<22} {r['gbps']:>7.2f} {r['ratio_to_limit']:>6.3f}{extra}")
        _release(case)
        del conn, torch_conn, case
        torch.cuda.empty_cache()
    result = {
        "benchmark": "transfer",
        "device": name,
        "device_slug": slug,
        "torch": torch.__version__,
        "chunks_per_call": args.chunks,
        "chunk_tokens": CHUNK,
        "block_size": BLOCK,
        "dtype": "bfloat16",
        "layout": PagedLayout.FLASH_NHD.value,
        "timing": (
            "host wall-clock median of whole calls (copies complete on return); the limit, kvtier and streamed "
            "rows measured together, each call once per round in turn"
        ),
        "targets": {"per_direction": TARGETS, "both_x_one_direction_limit": DUPLEX_TARGET},
        "verified_against_torch_reference": True,
        "results": results,
        "variants": variants,
        "streamed": streamed,
        "streamed_timing": (
            f"host wall-clock median of {args.stream_calls} calls issued back to back (the _async API, at most "
            f"{args.in_flight} outstanding), divided by the calls; the limit: as many contiguous copies queued back to back"
        ) if streamed else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"transfer-{slug}{'-' + args.suffix if args.suffix else ''}"
    out = args.out / f"{stem}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if _plot(result, args.out / f"{stem}.png"):
        print(f"wrote {args.out / f'{stem}.png'}")
    return 0
