"""Planning a transfer on the host: which rows go into which staging slot, and the run table.

Pure host logic (no device, no kernel): ``tests/cuda/test_plan.py`` checks its properties over
many random calls. A call's transfers are checked (``prepare``), split into groups prepared one
after another (``groups``), and each group's rows are packed into *pieces* (``plan``): one piece
fills one staging slot, costs one kernel launch, and moves its host bytes in as few DMAs as
adjacency allows. The run table (``RUN_WORDS`` int64s a run, see
``kvtier.cuda._triton_kernels``) describes each piece's rows to the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.core.connector import Transfer
from kvtier.core.errors import LayoutError
from kvtier.cuda.geometry import CallShape
from kvtier.cuda.memory import StagingRing

# A whole-call store's first piece: small, so the first DMA starts after a short gather.
FIRST_PIECE_BYTES = 4 << 20
# A whole-chunk load's last piece: small, so the scatter after the last DMA is short.
LAST_PIECE_BYTES = 4 << 20
# A whole-chunk call's first group: the host checks and plans this much before the first DMA.
FIRST_GROUP_BYTES = 8 << 20
# Each later group's cap, as a multiple of the previous one's (stores, both directions at once;
# a lone load).
GROUP_GROWTH = 2
LOAD_GROUP_GROWTH = 4

# A segment ``(transfer, start, stop, step, layer)``: object rows ``range(start, stop, step)`` of
# one transfer; ``layer`` (or -1) tags the segments of one layer.
Segment = tuple[int, int, int, int, int]


@dataclass(slots=True)
class Prepared:
    """One transfer, checked: where its bytes live and where its slots sit in the slot list."""

    obj: torch.Tensor  # the memory object's tensor (contiguous, on the host)
    host_ptr: int
    storage: (
        int  # identifies the object's buffer: adjacent objects of one buffer merge into one DMA
    )
    num_tokens: int
    row_bytes: int  # one row: num_tokens * hidden_size * itemsize
    slot_index: int  # element offset of this transfer's slots in the call's slot list
    has_holes: bool = False
    empty: bool = False  # every slot is -1: nothing to move


@dataclass(slots=True)
class Copy:
    """A contiguous host byte range and where it sits in a staging slot (one DMA)."""

    host_ptr: int
    storage: int
    slot_offset: int
    nbytes: int


@dataclass(slots=True)
class Piece:
    """Runs ``[start, stop)`` of a batch's run table: one kernel launch, one staging slot."""

    start: int
    stop: int
    max_tokens: int
    slot: int
    max_rows: int = 0  # the most rows one of its runs holds (the launch grid's second axis)
    cap: int = 0  # bytes of its slot this piece may fill
    nbytes: int = 0
    prefill: bool = False  # a store piece with -1 slots: its slot is filled from the host first
    copies: list[Copy] = field(default_factory=list)
    layers_done: list[int] = field(default_factory=list)


def same_copies(a: Piece, b: Piece) -> bool:
    """Whether two load pieces fill the same staging slot with the same host bytes."""
    return a.slot == b.slot and [(c.host_ptr, c.slot_offset, c.nbytes) for c in a.copies] == [
        (c.host_ptr, c.slot_offset, c.nbytes) for c in b.copies
    ]


def all_rows(count: int, shape: CallShape) -> list[Segment]:
    """Object order: each transfer's rows in a row, so its DMA is one contiguous copy."""
    return [(i, 0, shape.rows_per_obj, 1, -1) for i in range(count)]


def layer_rows(count: int, layer: int, shape: CallShape) -> list[Segment]:
    """One layer of every transfer: its K row and its V row (MLA: its one row)."""
    return [(i, layer, shape.rows_per_obj, shape.layout.num_layers, layer) for i in range(count)]


def prepare(
    shape: CallShape,
    transfers: Sequence[Transfer],
    first_index: int = 0,
    out: torch.Tensor | None = None,
) -> tuple[list[Prepared], torch.Tensor]:
    """Check every transfer; return them with one int64 host tensor of the call's slots.

    ``out``: a host int64 buffer the slots are written to the start of (the table buffer they
    are uploaded from). Errors name the transfer (``first_index`` + its position): a
    ``LayoutError`` for an object that is not the layout's chunk, an ``IndexError`` for a slot
    outside ``[-1, total_slots)``; a released object raises when its tensor is read.
    """
    dtype = shape.layout.torch_dtype
    int64 = torch.int64
    host_slots: list[torch.Tensor] = []
    prepared: list[Prepared] = []
    start = 0
    for i, t in enumerate(transfers):
        mobj = t.obj
        meta = mobj.meta
        n = meta.num_tokens
        want = shape.chunk_shape(n)
        if meta.shape != want or meta.dtype != dtype:
            raise LayoutError(
                f"transfer {i + first_index}: memory object {meta.shape} {meta.dtype} does not match the "
                f"layout's chunk {want} {dtype}"
            )
        obj = mobj.tensor  # raises if the handle was released
        sl = t.slots
        if sl.dtype != int64 or not sl.is_cpu:
            sl = sl.to(device="cpu", dtype=int64)
        host_slots.append(sl)
        prepared.append(
            Prepared(
                obj, obj.data_ptr(), id(mobj.arena), n, n * shape.hd_bytes, start, empty=n == 0
            )
        )
        start += n
    if out is not None:
        slot_tensor = out[:start]
        if host_slots:
            torch.cat(host_slots, out=slot_tensor)
    else:
        slot_tensor = torch.cat(host_slots) if host_slots else torch.empty(0, dtype=int64)
    values = slot_tensor.numpy()
    # One reduction: as unsigned, -1 and every negative value are larger than any slot.
    if not (start and int(values.view(np.uint64).max()) < shape.total_slots):
        empties, holes = slot_ranges(
            values, [p.num_tokens for p in prepared], shape.total_slots, first_index
        )
        for p, empty, has_holes in zip(prepared, empties, holes, strict=True):
            p.empty, p.has_holes = empty, has_holes
    return prepared, slot_tensor


def slot_ranges(
    values: np.ndarray, lengths: list[int], total: int, first_index: int = 0
) -> tuple[list[bool], list[bool]]:
    """Per transfer: whether it has no slot at all (every one -1) and whether it has a -1.
    Raises IndexError naming the first transfer with a slot outside ``[-1, total)``."""
    starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
    counts = np.asarray(lengths, dtype=np.int64)
    lows = np.full(len(lengths), -1, dtype=np.int64)
    highs = np.full(len(lengths), -1, dtype=np.int64)
    if values.size:
        nonempty = counts > 0
        lows[nonempty] = np.minimum.reduceat(values, starts[nonempty])
        highs[nonempty] = np.maximum.reduceat(values, starts[nonempty])
        bad = np.flatnonzero((lows < -1) | (highs >= total))
        if bad.size:
            i = int(bad[0])
            raise IndexError(
                f"transfer {i + first_index}: slot values must be -1 or in [0, {total}), got [{lows[i]}, {highs[i]}]"
            )
    return (highs < 0).tolist(), (lows < 0).tolist()


def plan(
    ring: StagingRing,
    prepared: Sequence[Prepared],
    segments: Iterable[Segment],
    *,
    store: bool,
    slot_base: int = 0,
    first_piece_bytes: int | None = None,
    last_piece_bytes: int | None = None,
) -> tuple[list[Piece], list[tuple[int, ...]]]:
    """Pack row segments into pieces; return them and the run table's runs.

    ``slot_base``: the device address of the call's slot list. A segment becomes one run unless
    a piece boundary splits it. ``first_piece_bytes`` caps the first piece (a store's first
    gather is then short, so its first DMA starts early); ``last_piece_bytes`` makes the last
    piece about that small (a load's last scatter, which nothing overlaps, is then short).
    Claims ring slots in order (the caller holds the lane's lock).
    """
    segs = [sg for sg in segments if not prepared[sg[0]].empty]
    if not segs:
        return [], []
    ring.ensure(max(prepared[sg[0]].row_bytes for sg in segs))
    slot_bytes, slot_ptrs = ring.slot_bytes, ring.slot_ptrs
    runs: list[tuple[int, ...]] = []
    pieces: list[Piece] = []
    last_piece_of_layer: dict[int, Piece] = {}
    piece: Piece | None = None
    left_bytes = (
        sum(prepared[sg[0]].row_bytes * len(range(*sg[1:4])) for sg in segs)
        if last_piece_bytes
        else 0
    )
    # The current piece's state lives in locals (this loop runs once per chunk per call): bytes
    # used, capacity, its slot's address, its last host range.
    used = cap = base = 0
    last: Copy | None = None
    for i, start, stop, step, layer in segs:
        p = prepared[i]
        rb, n = p.row_bytes, p.num_tokens
        slot_list = slot_base + 8 * p.slot_index
        r = start
        left = (stop - start + step - 1) // step
        while left:
            fit = (cap - used) // rb
            if fit == 0:
                cap = slot_bytes
                if not pieces and first_piece_bytes:
                    cap = min(cap, max(first_piece_bytes, rb))
                elif last_piece_bytes and last_piece_bytes < left_bytes <= cap + last_piece_bytes:
                    cap = max(left_bytes - last_piece_bytes, rb)  # this piece and a short last one
                if piece is not None:
                    piece.stop, piece.nbytes = len(runs), used
                piece = Piece(
                    start=len(runs), stop=len(runs), max_tokens=0, slot=ring.claim(), cap=cap
                )
                pieces.append(piece)
                used, base, last = 0, slot_ptrs[piece.slot], None
                fit = cap // rb
            assert piece is not None
            k = fit if fit < left else left
            runs.append((r, step, k, base + used, rb, slot_list, n, 0))
            # The rows' host ranges, merged with the previous one when adjacent in one buffer
            # (objects carved back to back from one arena move in one DMA).
            for j in range(1 if step == 1 else k):
                nbytes = k * rb if step == 1 else rb
                addr = p.host_ptr + (r + j * step) * rb
                if (
                    last is not None
                    and last.host_ptr + last.nbytes == addr
                    and last.storage == p.storage
                ):
                    last.nbytes += nbytes
                else:
                    last = Copy(addr, p.storage, used, nbytes)
                    piece.copies.append(last)
                used += nbytes
            piece.prefill = piece.prefill or (store and p.has_holes)
            piece.max_rows = max(piece.max_rows, k)
            piece.max_tokens = max(piece.max_tokens, n)
            left_bytes -= k * rb
            r += k * step
            left -= k
        if layer >= 0 and piece is not None:
            last_piece_of_layer[layer] = piece
    assert piece is not None
    piece.stop, piece.nbytes = len(runs), used
    for layer, pc in last_piece_of_layer.items():
        pc.layers_done.append(layer)
    return pieces, runs


def groups(
    transfers: Sequence[Transfer],
    token_bytes: int,
    *,
    first: int,
    slot_bytes: int,
    growth: int,
    whole: bool = False,
) -> list[tuple[int, int, int]]:
    """Split a whole-chunk call into runs of transfers ``(lo, hi, tokens)``: ``first`` bytes (at
    most a staging slot) first, then ``growth`` times the previous cap each (a transfer larger
    than the cap is a group of its own). Preparing a group costs the host a fraction of its
    bytes' PCIe time, so a larger group is still ready before the previous group's DMAs end,
    and a call of N bytes costs only log(N) batch overheads. ``whole`` (or ``first`` 0): one
    group, the whole call."""
    out: list[tuple[int, int, int]] = []
    whole = whole or first == 0
    start, acc, tokens, cap = 0, 0, 0, min(first, slot_bytes)
    for i, t in enumerate(transfers):
        n = t.obj.meta.num_tokens
        nbytes = n * token_bytes
        if acc and acc + nbytes > cap and not whole:
            out.append((start, i, tokens))
            start, acc, tokens, cap = i, 0, 0, growth * cap
        acc += nbytes
        tokens += n
    out.append((start, len(transfers), tokens))
    return out


def eager_piece(
    ring: StagingRing,
    transfers: Sequence[Transfer],
    shape: CallShape,
    *,
    last_piece_bytes: int | None,
) -> Piece | None:
    """A whole-chunk load's first piece, found before anything is checked or planned, for the
    caller to DMA at once (moving bytes into a staging slot needs no slot list, no table and no
    ordering after the engine's stream); None when there is nothing to start this way.

    The piece is whole objects of the group's leading ones, adjacent ones merged, as ``plan``
    packs them when told that first piece's size: the group's batch skips its own first DMA
    when its plan's first piece is the same (``same_copies``), else it issues it and the eager
    bytes are overwritten (the cost of a mismatch is bandwidth, never bytes).
    ``last_piece_bytes``: the group is the call's last, so the piece leaves the load's short
    last piece to the plan.
    """
    per_token = shape.token_bytes
    sizes: list[int] = []
    for t in transfers:
        meta = t.obj.meta
        nbytes = meta.num_tokens * per_token
        if nbytes == 0 or meta.nbytes != nbytes:
            break
        sizes.append(nbytes)
    total = sum(sizes)
    ring.ensure(max(sizes, default=0) // shape.rows_per_obj)
    budget = ring.slot_bytes
    if last_piece_bytes and last_piece_bytes < total <= budget + last_piece_bytes:
        budget = total - last_piece_bytes
    piece = Piece(start=0, stop=0, max_tokens=0, slot=ring.next_slot)
    last_copy: Copy | None = None
    used = 0
    for t, nbytes in zip(transfers, sizes, strict=False):
        if used + nbytes > budget:
            break
        mobj = t.obj
        addr, storage = mobj.tensor.data_ptr(), id(mobj.arena)
        if (
            last_copy is not None
            and last_copy.host_ptr + last_copy.nbytes == addr
            and last_copy.storage == storage
        ):
            last_copy.nbytes += nbytes
        else:
            last_copy = Copy(addr, storage, used, nbytes)
            piece.copies.append(last_copy)
        used += nbytes
    if not used:
        return None
    piece.nbytes = used
    return piece
