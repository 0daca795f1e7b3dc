"""Streams and events on a real GPU: a call, on one stream or in groups across two, is ordered
after the caller's current stream (not only the default one), a layer-by-layer load orders each layer before the caller's stream reads
it, repeated calls launch the kept compiled kernel, and a thread that never touched CUDA can
call. (Speed is measured by ``kvtier bench transfer``, not asserted.)"""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import ON_GPU, Objects, make_layout, make_views, random_blocks, storage_bytes, twin
from kvtier.core.layout import PagedLayout
from kvtier.cuda.platform import CUDAPlatform

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)"),
]

LENGTHS = [16, 16, 16]
# About 50 ms of GPU time: long enough that a copy not ordered after it would see stale KV.
SLEEP_CYCLES = 100_000_000


@pytest.fixture(
    params=[
        (paged, groups)
        for paged in (PagedLayout.LBHNC, PagedLayout.BHLNC)
        for groups in (False, True)
    ],
    ids=lambda p: f"{p[0].value}-{'groups' if p[1] else 'one-stream'}",
)
def setup(request, device, arena):  # type: ignore[no-untyped-def]
    paged, groups = request.param
    layout = make_layout(paged)
    views = make_views(layout, device, seed=1)
    # a whole call that fits one slot runs on the copy stream alone; a larger one, in groups
    # across the kernel and copy streams
    row = layout.num_layers * layout.page_bytes
    options = {"staging_slot_bytes": 8 * row} if groups else {}
    mover = CUDAPlatform().create_mover(views, layout, **options)
    objs = Objects(arena, layout, LENGTHS, 2)
    for _ in range(2):  # first use allocates (and may synchronise the device): not in the test
        mover.store(objs.transfers(random_blocks(LENGTHS, seed=3)))
        mover.load(objs.transfers(random_blocks(LENGTHS, seed=3)))
    torch.cuda.synchronize()
    return layout, views, mover


def test_a_store_reads_what_the_callers_stream_wrote_before_it(setup, arena):
    layout, views, mover = setup
    blocks = random_blocks(LENGTHS, seed=4)
    new = torch.randint_like(storage_bytes(views[0]), 0, 256)
    objs = Objects(arena, layout, LENGTHS, 5)
    torch.cuda.synchronize()
    # The engine's compute stream, not the legacy default stream: work on that one orders
    # every (blocking) stream after it implicitly, which would hide a missing event.
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(SLEEP_CYCLES)  # the forward pass is still running...
        storage_bytes(views[0]).copy_(new)  # ...and writes the KV last
        mover.store(objs.transfers(blocks))
    ref = twin(views, layout)
    want = Objects(arena, layout, LENGTHS, 5)
    ref.store(want.transfers(blocks))
    assert all(torch.equal(a, b) for a, b in zip(objs.snapshot(), want.snapshot(), strict=True))


def test_a_load_waits_for_what_the_callers_stream_still_reads(setup, arena):
    layout, views, mover = setup
    blocks = random_blocks(LENGTHS, seed=6)
    before = storage_bytes(views[0]).clone()
    objs = Objects(arena, layout, LENGTHS, 7)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(SLEEP_CYCLES)
        seen = storage_bytes(views[0]).clone()  # attention still reading the old blocks
        mover.load(objs.transfers(blocks))
        torch.cuda.current_stream().synchronize()
    assert torch.equal(seen, before)


def test_a_layerwise_load_orders_each_layer_before_the_callers_stream_reads_it(setup, arena):
    layout, views, mover = setup
    blocks = random_blocks(LENGTHS, seed=8)
    ids = torch.cat(blocks).to(views[0].device)
    objs = Objects(arena, layout, LENGTHS, 9)
    ref = twin(views, layout)
    ref.load(objs.transfers(blocks))
    seen = []
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for layer in mover.load_layerwise(objs.transfers(blocks)):
            seen.append(views[layer][ids].clone())  # queued at once, no host wait
        torch.cuda.current_stream().synchronize()
    for layer, got in enumerate(seen):
        want = ref.kv_caches[layer][ids]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"layer {layer}"


def test_repeated_calls_launch_the_kept_compiled_kernels(setup, arena):
    layout, views, mover = setup
    assert mover._kernels._kept, "the warm-up calls kept no compiled kernel"
    blocks = random_blocks(LENGTHS, seed=10)
    ref = twin(views, layout)
    mine, theirs = Objects(arena, layout, LENGTHS, 11), Objects(arena, layout, LENGTHS, 11)
    mover.store(mine.transfers(blocks))
    ref.store(theirs.transfers(blocks))
    assert all(torch.equal(a, b) for a, b in zip(mine.snapshot(), theirs.snapshot(), strict=True))


def test_a_thread_that_never_touched_cuda_can_call(setup, arena):
    layout, views, mover = setup
    blocks = random_blocks(LENGTHS, seed=12)
    mine = Objects(arena, layout, LENGTHS, 13)
    errors: list[BaseException] = []

    def body() -> None:
        try:
            mover.store(mine.transfers(blocks))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and not errors, errors
    ref = twin(views, layout)
    theirs = Objects(arena, layout, LENGTHS, 13)
    ref.store(theirs.transfers(blocks))
    assert all(torch.equal(a, b) for a, b in zip(mine.snapshot(), theirs.snapshot(), strict=True))
