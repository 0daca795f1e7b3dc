"""One conformance suite for every platform's page mover (``kvtier.core.platform.mover``'s contract): the
CPU reference, the XPU mover (on CPU tensors here; on a GPU through torch.cuda) and the CUDA
mover (Triton interpreter here; ``KVTIER_TEST_DEVICE=cuda`` on a GPU), over views placed as
vLLM 0.32 places them, for every layout vLLM can resolve, MHA and MLA, with kernel block
splitting.

Every check compares bytes against an oracle that reads pages by storage address
(``device_cases.Oracle``), so the reference mover is tested like the others; a load is checked
against the *whole* storage, so a byte written outside the asked pages fails it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from device_cases import (
    CASE_IDS,
    CASES,
    ON_GPU,
    SHAPE,
    SUBJECTS,
    Arenas,
    Case,
    Objects,
    Oracle,
    Subject,
    lengths_of,
    make_caches,
    make_layout,
    make_platform,
    random_blocks,
    same_bytes,
    storage_bytes,
)

from fixtures.threads import run_concurrently
from kvtier.core.errors import LayoutError
from kvtier.core.layout import KVLayout, PagedLayout
from kvtier.core.memory import HostArena
from kvtier.core.platform import Platform
from kvtier.core.platform import mover as mover_module
from kvtier.core.platform.mover import PageMover, Transfer

ALL = pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
MODES = pytest.mark.parametrize("mode", ["whole", "layerwise", "per_layer"])
HOLES = pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
# Two geometries for the tests about calls rather than geometry: one page run per page
# (layer-outer) and one per head slot (head-outer, block-outer).
TWO = pytest.mark.parametrize(
    "case", [Case(PagedLayout.LBHNC), Case(PagedLayout.BHLNC)], ids=["LBHNC", "BHLNC"]
)


@pytest.fixture(params=SUBJECTS, ids=lambda s: s.id)
def subject(request: pytest.FixtureRequest) -> Subject:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def device(test_device: torch.device) -> torch.device:
    if test_device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("KVTIER_TEST_DEVICE=cuda but torch sees no CUDA device")
    return test_device


@pytest.fixture
def platform(subject: Subject, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> Platform:
    if subject.id == "cpu-by-block":
        monkeypatch.setattr(mover_module, "BLOCK_COPY_BYTES", 0)
    return make_platform(subject, device)


@pytest.fixture(scope="session")
def arenas() -> Iterator[Arenas]:
    kept = Arenas()
    yield kept
    kept.close()


@pytest.fixture
def arena(arenas: Arenas, platform: Platform, device: torch.device) -> Iterator[HostArena]:
    a = arenas.get(platform, device)
    a.tracked = []  # type: ignore[attr-defined]
    yield a
    for objs in a.tracked:  # type: ignore[attr-defined]
        objs.release()
    arenas.check(a)


def build(
    platform: Platform, subject: Subject, case: Case, device: torch.device, seed: int, **lay: str
) -> tuple[PageMover, Oracle]:
    layout = make_layout(case, **lay)
    caches = make_caches(layout, case, device, seed)
    mover = platform.create_mover(caches, layout, num_blocks=SHAPE.blocks, **subject.options)
    return mover, Oracle(caches, case.split)


def run_store(mover: PageMover, transfers: list[Transfer], mode: str) -> None:
    layers = mover.layout.num_layers
    if mode == "whole":
        mover.store(transfers)
    elif mode == "layerwise":
        assert list(mover.store_layerwise(transfers)) == list(range(layers))
    else:
        for layer in range(layers):
            mover.store_layer(layer, transfers)


def run_load(mover: PageMover, transfers: list[Transfer], mode: str) -> None:
    layers = mover.layout.num_layers
    if mode == "whole":
        mover.load(transfers)
    elif mode == "layerwise":
        assert list(mover.load_layerwise(transfers)) == list(range(layers))
    else:
        for layer in range(layers):
            mover.load_layer(layer, transfers)


def storage_of(mover: PageMover) -> torch.Tensor:
    return storage_bytes(mover.kv_caches[0]).cpu()


# -- the moves ----------------------------------------------------------------------------------
@HOLES
@MODES
@ALL
def test_store_copies_exactly_the_asked_pages(subject, platform, device, arena, case, mode, holes):
    mover, oracle = build(platform, subject, case, device, seed=1)
    blocks = random_blocks(SHAPE.lengths, seed=2, holes=holes, device=device)
    objs = Objects(arena, mover.layout, lengths_of(blocks), seed=3)
    before = objs.snapshot()
    run_store(mover, objs.transfers(blocks), mode)
    want = [oracle.after_store(b, ids.cpu()) for b, ids in zip(before, blocks, strict=True)]
    assert same_bytes(objs.snapshot(), want)
    assert torch.equal(storage_of(mover), oracle.storage), "a store wrote into the cache"


@HOLES
@MODES
@ALL
def test_load_writes_exactly_the_asked_pages(subject, platform, device, arena, case, mode, holes):
    mover, oracle = build(platform, subject, case, device, seed=4)
    blocks = random_blocks(SHAPE.lengths, seed=5, holes=holes, device=device)
    objs = Objects(arena, mover.layout, lengths_of(blocks), seed=6)
    before = objs.snapshot()
    run_load(mover, objs.transfers(blocks), mode)
    assert torch.equal(storage_of(mover), oracle.after_load(before, [b.cpu() for b in blocks]))
    assert same_bytes(objs.snapshot(), before), "a load wrote into its objects"


@ALL
def test_round_trip_into_other_blocks(subject, platform, device, arena, case):
    """Store from some blocks, load into others: each page lands byte for byte."""
    mover, oracle = build(platform, subject, case, device, seed=7)
    src = random_blocks(SHAPE.lengths, seed=8, holes=False, device=device)
    dst = random_blocks(
        SHAPE.lengths, seed=8, holes=False, device=device, offset=sum(SHAPE.lengths)
    )
    objs = Objects(arena, mover.layout, SHAPE.lengths, seed=9)
    mover.store(objs.transfers(src))
    mover.load(objs.transfers(dst))
    after = storage_of(mover)
    for s, d in zip(src, dst, strict=True):
        for a, b in zip(s.tolist(), d.tolist(), strict=True):
            for layer in range(mover.layout.num_layers):
                assert torch.equal(oracle.page(layer, a), oracle.page(layer, b, after))


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        ("float16", "auto"),
        ("float32", "auto"),
        ("float8_e4m3fn", "fp8_e4m3"),
        ("float8_e5m2", "fp8_e5m2"),
        ("uint8", "fp8"),
    ],
)
@pytest.mark.parametrize(
    "case",
    [Case(PagedLayout.LBHNC), Case(PagedLayout.BLHNC), Case(PagedLayout.LHBNC, mla=True)],
    ids=lambda c: c.id,
)
def test_every_kv_dtype_moves_bit_exact(subject, platform, device, arena, case, dtype, cache_dtype):
    mover, oracle = build(
        platform, subject, case, device, seed=10, dtype=dtype, cache_dtype=cache_dtype
    )
    src = random_blocks(SHAPE.lengths, seed=11, holes=False, device=device)
    dst = random_blocks(
        SHAPE.lengths, seed=11, holes=False, device=device, offset=sum(SHAPE.lengths)
    )
    objs = Objects(arena, mover.layout, SHAPE.lengths, seed=12)
    before = objs.snapshot()
    mover.store(objs.transfers(src))
    want = [oracle.after_store(b, s.cpu()) for b, s in zip(before, src, strict=True)]
    assert same_bytes(objs.snapshot(), want)
    mover.load(objs.transfers(dst))
    assert torch.equal(storage_of(mover), oracle.after_load(want, [d.cpu() for d in dst]))


# -- layer by layer -----------------------------------------------------------------------------
@TWO
def test_layerwise_load_has_each_layer_in_place_when_it_yields_it(
    subject, platform, device, arena, case
):
    mover, oracle = build(platform, subject, case, device, seed=13)
    blocks = random_blocks(SHAPE.lengths, seed=14, holes=True, device=device)
    objs = Objects(arena, mover.layout, lengths_of(blocks), seed=15)
    want = oracle.after_load(objs.snapshot(), [b.cpu() for b in blocks])
    for layer in mover.load_layerwise(objs.transfers(blocks)):
        now = storage_of(mover)
        for ids in blocks:
            for b in ids.tolist():
                if b >= 0:
                    addr = oracle.addresses(layer, b)
                    assert torch.equal(now[addr], want[addr]), f"layer {layer} not in place"


@TWO
def test_layerwise_store_has_captured_each_layer_when_it_yields_it(
    subject, platform, device, arena, case
):
    """Once the generator yields layer ``i`` the engine may overwrite it: scribbling over that
    layer's pages right after the yield changes nothing in what the store leaves in its
    objects (captured on the device or already on the host, as the platform likes)."""
    mover, oracle = build(platform, subject, case, device, seed=16)
    blocks = random_blocks(SHAPE.lengths, seed=17, holes=True, device=device)
    objs = Objects(arena, mover.layout, lengths_of(blocks), seed=18)
    before = objs.snapshot()
    want = [oracle.after_store(b, ids.cpu()) for b, ids in zip(before, blocks, strict=True)]
    storage = storage_bytes(mover.kv_caches[0])
    for layer in mover.store_layerwise(objs.transfers(blocks)):
        for ids in blocks:
            for b in ids.tolist():
                if b >= 0:
                    addr = oracle.addresses(layer, b).to(storage.device)
                    storage[addr] = storage[addr] ^ 0xFF  # the engine reuses the layer
    assert same_bytes(objs.snapshot(), want)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_closing_a_layerwise_generator_early_finishes_its_copies(
    subject, platform, device, arena, direction
):
    mover, oracle = build(platform, subject, Case(PagedLayout.LBHNC), device, seed=21)
    blocks = random_blocks(SHAPE.lengths, seed=22, holes=False, device=device)
    objs = Objects(arena, mover.layout, SHAPE.lengths, seed=23)
    before = objs.snapshot()
    gen = getattr(mover, f"{direction}_layerwise")(objs.transfers(blocks))
    assert next(gen) == 0
    gen.close()
    if direction == "store":
        want = [oracle.after_store(b, ids.cpu()) for b, ids in zip(before, blocks, strict=True)]
        assert same_bytes([g[:, 0] for g in objs.snapshot()], [w[:, 0] for w in want])
    else:
        want_storage = oracle.after_load(before, [b.cpu() for b in blocks])
        now = storage_of(mover)
        for ids in blocks:
            for b in ids.tolist():
                addr = oracle.addresses(0, b)
                assert torch.equal(now[addr], want_storage[addr])
    objs.release()  # nothing may still read or write them
    # and the mover goes on working
    again = Objects(arena, mover.layout, SHAPE.lengths, seed=24)
    snap = again.snapshot()
    mover.store(again.transfers(blocks))
    fresh = Oracle(mover.kv_caches, oracle.split)
    want = [fresh.after_store(b, ids.cpu()) for b, ids in zip(snap, blocks, strict=True)]
    assert same_bytes(again.snapshot(), want)


def test_empty_and_all_skipped_calls_move_nothing(subject, platform, device, arena):
    mover, oracle = build(platform, subject, Case(PagedLayout.LBHNC), device, seed=25)
    objs = Objects(arena, mover.layout, [SHAPE.lengths[-1]], seed=26)
    before = objs.snapshot()
    skip = objs.transfers([torch.full((SHAPE.lengths[-1],), -1, dtype=torch.long, device=device)])
    layers = list(range(mover.layout.num_layers))
    for transfers in ([], skip):
        mover.store(transfers)
        mover.load(transfers)
        assert list(mover.store_layerwise(transfers)) == layers
        assert list(mover.load_layerwise(transfers)) == layers
    assert torch.equal(storage_of(mover), oracle.storage)
    assert same_bytes(objs.snapshot(), before)


# -- one store and one load from two threads ----------------------------------------------------
def rounds_for(subject: Subject) -> int:
    """The interpreter is slow: fewer rounds for the CUDA mover on CPU."""
    if ON_GPU:
        return 100
    return 6 if subject.platform == "cuda" else 200


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    """Switch threads every 10 us (default 5 ms), so the two calls' steps interleave finely."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("load_mode", ["whole", "layerwise"])
@pytest.mark.parametrize("store_mode", ["whole", "layerwise"])
@TWO
def test_one_store_and_one_load_from_two_threads_move_exact_bytes(
    subject, platform, device, arena, case, store_mode, load_mode, frequent_thread_switches
):
    """vLLM's saver thread stores while the forward thread loads, round after round, on one
    mover: every round's objects and pages hold exactly the bytes of that call alone."""
    mover, oracle = build(platform, subject, case, device, seed=31)
    half = SHAPE.blocks // 2
    perm = torch.randperm(SHAPE.blocks, generator=torch.Generator().manual_seed(32))
    store_ids = [perm[:2].to(device), perm[2:4].to(device)]  # stores read these blocks
    load_ids = [perm[half : half + 2].to(device), perm[half + 2 : half + 4].to(device)]
    want_store = None
    for r in range(rounds_for(subject)):
        stored = Objects(arena, mover.layout, [2, 2], seed=100 + r)
        loaded = Objects(arena, mover.layout, [2, 2], seed=5000 + r)
        before_store, load_src = stored.snapshot(), loaded.snapshot()
        if want_store is None:
            want_store = [
                oracle.after_store(b, ids.cpu())
                for b, ids in zip(before_store, store_ids, strict=True)
            ]
        stores, loads = stored.transfers(store_ids), loaded.transfers(load_ids)
        run_concurrently(
            [
                lambda: run_store(mover, stores, store_mode),  # noqa: B023 (joined in the loop)
                lambda: run_load(mover, loads, load_mode),  # noqa: B023
            ],
            timeout_s=120,
        )
        assert same_bytes(stored.snapshot(), want_store), f"round {r}: store bytes"
        now = storage_of(mover)
        for obj, ids in zip(load_src, load_ids, strict=True):
            for j, b in enumerate(ids.tolist()):
                for layer in range(mover.layout.num_layers):
                    assert torch.equal(now[oracle.addresses(layer, b)], obj[j, layer]), (
                        f"round {r}: load bytes"
                    )
        stored.release()
        loaded.release()


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["past_the_cache", "below_minus_one"])
@pytest.mark.parametrize(
    "op", ["store", "load", "store_layer", "load_layer", "store_layerwise", "load_layerwise"]
)
def test_a_bad_block_id_is_an_index_error_and_writes_nothing(
    subject, platform, device, arena, op, bad
):
    mover, oracle = build(platform, subject, Case(PagedLayout.LBHNC), device, seed=41)
    objs = Objects(arena, mover.layout, [2], seed=42)
    before = objs.snapshot()
    wrong = SHAPE.blocks if bad == "past_the_cache" else -2
    transfers = objs.transfers([torch.tensor([3, wrong], device=device)])
    with pytest.raises(IndexError):
        if op.endswith("_layer"):
            getattr(mover, op)(0, transfers)
        elif op.endswith("wise"):
            list(getattr(mover, op)(transfers))
        else:
            getattr(mover, op)(transfers)
    assert torch.equal(storage_of(mover), oracle.storage)
    if op.startswith("load"):
        assert same_bytes(objs.snapshot(), before)


@pytest.mark.parametrize("layer", [-1, SHAPE.layers])
@pytest.mark.parametrize("op", ["store_layer", "load_layer"])
def test_a_layer_out_of_range_is_an_index_error(subject, platform, device, arena, op, layer):
    mover, _ = build(platform, subject, Case(PagedLayout.LBHNC), device, seed=43)
    objs = Objects(arena, mover.layout, [1], seed=44)
    with pytest.raises(IndexError):
        getattr(mover, op)(layer, objs.transfers([torch.tensor([1], device=device)]))


def test_an_object_of_another_geometry_is_a_layout_error(subject, platform, device, arena):
    mover, _ = build(platform, subject, Case(PagedLayout.LBHNC), device, seed=45)
    other = make_layout(Case(PagedLayout.LBHNC), dtype="float32")
    objs = Objects(arena, other, [1], seed=46)
    with pytest.raises(LayoutError):
        mover.store(objs.transfers([torch.tensor([1], device=device)]))


@pytest.mark.parametrize("form", ["int32", "strided", "resized"])
@TWO
def test_block_ids_of_any_integer_dtype_and_stride_move_the_same_pages(
    subject, platform, device, arena, case, form
):
    """Ids given as int32, or as a strided view, on the test device: the same bytes as the
    int64 ids (``Transfer`` keeps them as contiguous int64 on the host; a mover that read the
    given tensor in place would read other ids). Host int64 ids that the caller shrinks and
    points elsewhere after building the transfers still move the pages they named (a mover
    reading the caller's tensor would read past it, or other ids)."""
    mover, oracle = build(platform, subject, case, device, seed=48)
    blocks = random_blocks(SHAPE.lengths, seed=49, holes=True, device=device)
    if form == "int32":
        given = [b.to(torch.int32) for b in blocks]
    elif form == "strided":
        given = [torch.stack([b, torch.full_like(b, -7)], 1)[:, 0] for b in blocks]
    else:
        given = [b.to("cpu", torch.int64, copy=True).contiguous() for b in blocks]
    objs = Objects(arena, mover.layout, lengths_of(blocks), seed=50)
    transfers = objs.transfers(given)
    if form == "resized":
        for ids in given:
            ids.resize_(1)
            ids.set_(torch.full((len(blocks[0]) + 2,), SHAPE.blocks - 1, dtype=torch.int64))
    before = objs.snapshot()
    mover.store(transfers)
    want = [oracle.after_store(b, ids.cpu()) for b, ids in zip(before, blocks, strict=True)]
    assert same_bytes(objs.snapshot(), want)
    into = random_blocks(SHAPE.lengths, seed=51, holes=True, device=device)
    loaded = Objects(arena, mover.layout, lengths_of(into), seed=52)
    sent = loaded.snapshot()
    mover.load(loaded.transfers([b.to(torch.int32) for b in into]))
    assert torch.equal(storage_of(mover), oracle.after_load(sent, [b.cpu() for b in into]))


def test_views_that_do_not_match_the_layout_are_layout_errors(subject, platform, device):
    layout = make_layout(Case(PagedLayout.LBHNC))
    caches = make_caches(layout, Case(PagedLayout.LBHNC), device, seed=47)
    wrong_heads = KVLayout(
        layout.num_layers,
        layout.num_kv_heads + 1,
        layout.head_size,
        layout.dtype,
        layout.block_size,
    )
    with pytest.raises(LayoutError, match="pages"):
        platform.create_mover(caches, wrong_heads, num_blocks=SHAPE.blocks, **subject.options)
    with pytest.raises(LayoutError, match="layers"):
        platform.create_mover(caches[:1], layout, num_blocks=SHAPE.blocks, **subject.options)
    with pytest.raises(LayoutError):
        platform.create_mover(caches, layout, num_blocks=SHAPE.blocks + 1, **subject.options)


def test_options_mean_the_same_on_every_platform(subject, platform, device):
    layout = make_layout(Case(PagedLayout.LBHNC))
    caches = make_caches(layout, Case(PagedLayout.LBHNC), device, seed=48)
    with pytest.raises(TypeError, match="no_such_option"):
        platform.create_mover(caches, layout, no_such_option=True)
    with pytest.raises(TypeError, match="staging_buffer"):
        platform.create_mover(caches, layout, staging_buffer="yes")
    for value in (True, False):
        platform.create_mover(caches, layout, staging_buffer=value)


@pytest.mark.parametrize("shared_blocks", [1])
@MODES
@TWO
def test_a_chunk_prefix_load_writes_only_the_shared_blocks(
    subject, platform, device, arena, case, mode, shared_blocks
):
    """An alias hit loads the first blocks of a stored chunk: a transfer of the whole object
    whose block ids are -1 past the shared blocks writes exactly the shared pages."""
    mover, oracle = build(platform, subject, case, device, seed=51)
    blocks = random_blocks(SHAPE.lengths[:2], seed=52, holes=False, device=device)
    for b in blocks:
        b[shared_blocks:] = -1  # the rest of each stored chunk is not the prompt's
    objs = Objects(arena, mover.layout, lengths_of(blocks), seed=53)
    before = objs.snapshot()
    run_load(mover, objs.transfers(blocks), mode)
    assert torch.equal(storage_of(mover), oracle.after_load(before, [b.cpu() for b in blocks]))
    assert same_bytes(objs.snapshot(), before)
