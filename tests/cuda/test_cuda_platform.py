"""The CUDA platform: cheap import and detection, discovery, mover options, the CacheEngine
over it, and its host arena: usable while it is pinned in the background (issue 40), its copies
split where one registration ends."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import BLOCKS, ON_GPU, make_layout, make_views
from kvtier.core.errors import PlatformError
from kvtier.core.layout import PagedLayout
from kvtier.core.memory import HostArena, MemoryObj
from kvtier.core.platform import discover_platforms, resolve_platform_class
from kvtier.core.platform.pages import page_view
from kvtier.cuda.detect import PLATFORM_PATH, detect
from kvtier.cuda.memory import PAGE, HostRegistrations, pieces, row_pieces

GiB = 1 << 30
MiB = 1 << 20


def test_importing_the_package_its_platform_and_mover_is_cheap():
    code = (
        "import sys, kvtier.cuda, kvtier.cuda.detect, kvtier.cuda.platform, kvtier.cuda.mover\n"
        "import torch\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "kvtier.cuda.detect.detect()\n"
        "assert 'triton' not in sys.modules, 'detect imported triton'\n"
        "assert not torch.cuda.is_initialized(), 'detect initialised CUDA'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_entry_point_names_detect():
    pyproject = Path(__file__).parents[2] / "packages" / "cuda" / "pyproject.toml"
    text = pyproject.read_text()
    group = text.split('[project.entry-points."kvtier.platforms"]')[1].split("[")[0]
    assert group.strip() == 'cuda = "kvtier.cuda.detect:detect"'


def test_detect_answers_for_this_machine():
    if ON_GPU:
        assert detect() == PLATFORM_PATH
        assert discover_platforms()["cuda"] == PLATFORM_PATH
    elif torch.version.cuda is None:
        assert detect() is None
        with pytest.raises(PlatformError, match="not available"):
            resolve_platform_class("cuda")


def test_detect_respects_an_empty_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect() is None


def test_cuda_outranks_the_cpu_and_xpu_platforms_and_names_its_device():
    from kvtier.core.platform.cpu import CPUPlatform
    from kvtier.cuda.platform import CUDAPlatform

    assert CUDAPlatform.priority > CPUPlatform.priority
    xpu = pytest.importorskip("kvtier.xpu.platform", reason="kvtier-xpu is not installed")
    assert CUDAPlatform.priority > xpu.XPUPlatform.priority
    assert CUDAPlatform().has_pinned_memory
    assert CUDAPlatform(1).device == torch.device("cuda", 1)


def test_create_mover_checks_its_own_options(device):
    from kvtier.cuda.mover import CUDAPageMover, MoverOptions
    from kvtier.cuda.platform import CUDAPlatform

    layout = make_layout()
    views = make_views(layout, device, seed=1)
    mover = CUDAPlatform().create_mover(views, layout, staging_slots=3, staging_slot_bytes=4096)
    assert isinstance(mover, CUDAPageMover) and mover.num_blocks == BLOCKS
    assert mover.options == MoverOptions(staging_slots=3, staging_slot_bytes=4096)
    for removed in ("native_planner", "max_staging_bytes"):
        with pytest.raises(TypeError, match=f"unknown cuda mover option.*{removed}"):
            CUDAPlatform().create_mover(views, layout, **{removed: 1})
    with pytest.raises(TypeError, match="staging_slot_bytes"):
        CUDAPlatform().create_mover(views, layout, staging_slot_bytes=True)
    with pytest.raises(ValueError, match="staging_slots"):
        CUDAPlatform().create_mover(views, layout, staging_slots=1)
    with pytest.raises(ValueError, match="staging_slot_bytes"):
        CUDAPlatform().create_mover(views, layout, staging_slot_bytes=0)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("staging", [True, False])
def test_the_cache_engine_runs_on_the_cuda_platform(device, staging, layerwise):
    """CacheEngine registers vLLM-placed views with the CUDA platform (passing its generic
    options) and a stored prefix comes back page for page into other blocks."""
    from kvtier.core import CacheEngine, HostArena, HostMemoryStorageManager, load_config
    from kvtier.cuda.platform import CUDAPlatform

    layout = make_layout(PagedLayout.BLNHC)
    views = make_views(layout, device, seed=3)
    platform = CUDAPlatform()
    chunk = 4 * layout.block_size
    size = 4 * layout.chunk_nbytes(chunk) + (1 << 20)  # and room for alias entries
    if device.type == "cuda":
        from kvtier.cuda.memory import wait_grown

        arena = platform.create_arena(size)
        assert wait_grown(arena, 30.0)
    else:
        arena = HostArena.create(size)
    config = load_config(
        env={},
        overrides={"chunk_size": chunk, "tiers": ["local_cpu"], "device_staging_buffer": staging},
    )
    engine = CacheEngine(
        config,
        layout,
        model="test/model",
        platform=platform,
        storage=HostMemoryStorageManager(arena),
    )
    engine.register_kv_caches(views)
    assert engine.mover is not None and engine.mover.options.staging_buffer is staging  # type: ignore[attr-defined]
    n = 2 * chunk
    perm = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(4))
    src, dst = (
        perm[: n // layout.block_size],
        perm[n // layout.block_size : 2 * n // layout.block_size],
    )

    def slots(blocks: torch.Tensor) -> torch.Tensor:  # on the device, as vLLM's are
        rows = blocks[:, None] * layout.block_size + torch.arange(layout.block_size)
        return rows.reshape(-1).to(device)

    tokens = list(range(1000, 1000 + n))
    if layerwise:
        assert list(engine.store_layerwise(tokens, slots(src))) == list(range(layout.num_layers))
    else:
        assert engine.store(tokens, slots(src)) == n
    runs = engine.mover.runs
    stored = [page_view(v, runs)[src.to(device)] for v in views]
    if layerwise:
        job = engine.retrieve_layerwise(tokens, slots(dst))
        assert list(job.layers) == list(range(layout.num_layers))
        mask = job.mask
    else:
        mask = engine.retrieve(tokens, slots(dst))
    assert bool(mask.all())
    for view, pages in zip(views, stored, strict=True):
        assert torch.equal(page_view(view, runs)[dst.to(device)], pages)


# -- host registrations (CPU: the driver calls are stubs) ----------------------------------------


class Stubs:
    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.refuse = refuse
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> bool:
        if address in self.refuse:
            return False
        self.registered.append((address, nbytes))
        return True

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_registrations_take_whole_pages_that_no_neighbour_holds():
    """The arena's buffer is not page-aligned: neighbouring segments share a page, which the
    driver would refuse to register twice."""
    stubs = Stubs()
    regs = HostRegistrations(stubs.register, stubs.unregister)
    base, seg = 10 * PAGE + 64, 4 * PAGE
    assert all(regs.register(base + k * seg, seg) for k in range(3))
    assert stubs.registered == [(10 * PAGE, 5 * PAGE), (15 * PAGE, 4 * PAGE), (19 * PAGE, 4 * PAGE)]
    assert regs.cuts == (10 * PAGE, 15 * PAGE, 19 * PAGE, 23 * PAGE)
    # a range whose pages are all held already needs no registration of its own
    assert regs.register(12 * PAGE + 100, 50) and len(stubs.registered) == 3
    with pytest.raises(ValueError, match="already registered"):
        regs.register(base, seg)
    regs.unregister(base + seg)
    assert stubs.unregistered == [15 * PAGE]
    assert regs.cuts == (10 * PAGE, 15 * PAGE, 19 * PAGE, 23 * PAGE)
    regs.unregister_within(base, base + 3 * seg)
    assert sorted(stubs.unregistered) == [10 * PAGE, 15 * PAGE, 19 * PAGE]
    assert regs.cuts == () and regs.registered(0, 1 << 40) == []
    assert regs.register(base, seg)  # all of it gone, the small one too (it had nothing to undo)


def test_a_refused_range_leaves_its_pages_to_the_next_one():
    base, seg = 10 * PAGE + 64, 4 * PAGE
    stubs = Stubs(refuse=(15 * PAGE,))
    regs = HostRegistrations(stubs.register, stubs.unregister)
    assert regs.register(base, seg)
    assert not regs.register(base + seg, seg)  # pageable: nothing recorded
    assert regs.register(base + 2 * seg, seg)
    # the refused range's last page goes with the next registration
    assert stubs.registered == [(10 * PAGE, 5 * PAGE), (18 * PAGE, 5 * PAGE)]
    assert regs.cuts == (10 * PAGE, 15 * PAGE, 18 * PAGE, 23 * PAGE)


def _regions(cuts: tuple[int, ...], a: int, b: int) -> bool:
    """Whether no cut lies strictly inside [a, b)."""
    return not any(a < c < b for c in cuts)


def test_copies_split_where_registrations_end():
    rng = random.Random(5)
    for _ in range(300):
        cuts = tuple(sorted(rng.sample(range(1, 4000), rng.randint(0, 12))))
        start = rng.randrange(0, 2000)
        width, pitch = rng.randint(1, 300), 0
        pitch = width + rng.randint(0, 300)
        rows = rng.randint(1, 12)
        # a contiguous copy
        n = rows * pitch
        parts = pieces(cuts, start, start + n)
        assert sum(p for _, p in parts) == n and parts[0][0] == 0
        assert all(off + m == nxt for (off, m), (nxt, _) in itertools.pairwise(parts))
        assert all(_regions(cuts, start + off, start + off + m) for off, m in parts)
        # a strided copy: every row's bytes exactly once, no piece's extent across a cut
        seen: list[tuple[int, int]] = []
        for r, k, off, w in row_pieces(cuts, start, pitch, width, rows):
            first = start + r * pitch + off
            assert _regions(cuts, first, first + (k - 1) * pitch + w)
            seen += [(r + i, start + (r + i) * pitch + off + j) for i in range(k) for j in range(w)]
        want = [(r, start + r * pitch + j) for r in range(rows) for j in range(width)]
        assert sorted(seen) == want


def test_the_platform_pins_ranges_and_an_unpinned_arena_is_ready_at_once():
    from kvtier.cuda.platform import CUDAPlatform

    assert CUDAPlatform.pins_ranges
    arena = CUDAPlatform().create_arena(1 * MiB, pin_memory=False)
    assert arena.capacity == arena.target_bytes == MiB and not arena.is_pinned


# -- on a GPU: real cudaHostRegister ---------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (KVTIER_TEST_DEVICE=cuda)")


def _wait(pred: Callable[[], bool], timeout: float = 30.0) -> float:
    t0 = time.perf_counter()
    while not pred():
        assert time.perf_counter() - t0 < timeout, "condition not reached"
        time.sleep(0.001)
    return time.perf_counter() - t0


def _registered(arena: HostArena) -> list[tuple[int, int]]:
    from kvtier.cuda.memory import REGISTRATIONS

    start = arena.buffer.data_ptr()
    return REGISTRATIONS.registered(start, start + arena.buffer.numel())


def _round_trip(obj: MemoryObj) -> None:
    """A DMA from the device into ``obj`` and back, checked; one copy per registration it
    meets (as the mover's lane splits them)."""
    from kvtier.cuda.memory import REGISTRATIONS

    n = obj.tensor.numel()
    host = obj.tensor.view(-1)
    dev = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    back = torch.empty_like(dev)
    parts = pieces(REGISTRATIONS.cuts, host.data_ptr(), host.data_ptr() + n)
    for off, k in parts:
        host[off : off + k].copy_(dev[off : off + k], non_blocking=True)
    for off, k in parts:
        back[off : off + k].copy_(host[off : off + k], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, dev)


@pytest.mark.cuda
@gpu
def test_gpu_an_arena_is_usable_while_it_is_pinned_and_grows_to_full():
    from kvtier.core.memory import MemoryObjMeta
    from kvtier.cuda.memory import wait_grown
    from kvtier.cuda.platform import CUDAPlatform

    assert resolve_platform_class() is CUDAPlatform
    size = 2 * GiB + 12345
    torch.zeros(1, device="cuda")  # CUDA up, as in a serving engine
    t0 = time.perf_counter()
    arena = CUDAPlatform().create_arena(size)
    assert arena.buffer.numel() == size  # exactly what was asked (torch would round up)
    assert arena.capacity < arena.target_bytes
    meta = MemoryObjMeta((32 * MiB,), torch.uint8, 1)
    first = None
    while first is None:
        first = arena.allocate(meta)
        assert time.perf_counter() - t0 < 10.0
    grown_then = arena.capacity
    _round_trip(first)
    assert time.perf_counter() - t0 < 2.0  # the first store and load: long before 2 GiB is pinned
    assert grown_then < arena.target_bytes and first.tensor.is_pinned()
    assert wait_grown(arena, 60.0)
    # every byte pinned, in ranges that meet end to end
    regs = _registered(arena)
    start = arena.buffer.data_ptr()
    assert regs[0][0] <= start and regs[-1][1] >= start + arena.target_bytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(regs))
    last = arena.allocate(MemoryObjMeta((arena.free_bytes - 256,), torch.uint8, 1))
    assert last is not None and last.tensor.is_pinned()
    _round_trip(last)
    first.release()
    last.release()
    arena.close()
    assert _registered(arena) == []


@pytest.mark.cuda
@gpu
def test_gpu_close_during_growth_stops_it_and_unregisters():
    from kvtier.core.memory import MemoryObjMeta
    from kvtier.cuda.platform import CUDAPlatform

    arena = CUDAPlatform().create_arena(4 * GiB)
    _wait(lambda: arena.capacity > 0)
    obj = arena.allocate(MemoryObjMeta((MiB,), torch.uint8, 1))
    assert obj is not None
    arena.close()
    stopped = arena.capacity
    assert stopped < arena.target_bytes
    assert _registered(arena) == []
    time.sleep(0.3)
    assert arena.capacity == stopped  # nothing grows after close
    assert not obj.tensor.is_pinned()
    _round_trip(obj)  # what grew stays usable (pageable now)
    cudart = torch.cuda.cudart()  # and its pages can be registered again
    ptr = arena.buffer.data_ptr()
    assert cudart.cudaHostRegister(ptr, 64 * MiB, 1) == cudart.cudaError.success
    assert cudart.cudaHostUnregister(ptr) == cudart.cudaError.success
    obj.release()


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_gpu_the_engine_stores_and_loads_while_the_arena_grows(device, layerwise):
    """Stores and loads through the CacheEngine while segments are being registered; 1 MiB
    segments (one refused: pageable) so that every chunk object crosses registrations, and
    the mover's copies (whole rows and, layer by layer, strided pages) are split there."""
    from kvtier.cuda.platform import CUDAPlatform

    class SmallGatedSegments(CUDAPlatform):
        """1 MiB segments; the 6th refused; the 25th waits for ``gate``."""

        pin_segment_bytes = MiB

        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            self.gate = threading.Event()

        def pin_host_range(self, address: int, nbytes: int) -> bool:
            self.calls += 1
            if self.calls > 24:
                assert self.gate.wait(60.0), "the test never opened the gate"
            if self.calls == 6:
                return False  # refused: this segment stays pageable
            return super().pin_host_range(address, nbytes)

    platform = SmallGatedSegments()
    try:
        _engine_while_growing(platform, device, layerwise)
    finally:
        platform.gate.set()  # a failed test leaves no thread waiting


def _engine_while_growing(platform: Any, device: torch.device, layerwise: bool) -> None:
    from kvtier.core import CacheEngine, HostMemoryStorageManager, load_config
    from kvtier.cuda.memory import wait_grown

    layout = make_layout(PagedLayout.LBHNC)
    views = make_views(layout, device, seed=11)
    arena = platform.create_arena(96 * MiB)
    chunk = 4 * layout.block_size
    _wait(lambda: arena.capacity >= 24 * MiB)
    config = load_config(env={}, overrides={"chunk_size": chunk, "tiers": ["local_cpu"]})
    engine = CacheEngine(
        config, layout, model="m", platform=platform, storage=HostMemoryStorageManager(arena)
    )
    engine.register_kv_caches(views)
    runs = engine.mover.runs  # type: ignore[union-attr]
    n = 2 * chunk
    per = n // layout.block_size
    perm = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(12))

    def slots(blocks: torch.Tensor) -> torch.Tensor:  # on the device, as vLLM's are
        rows = blocks[:, None] * layout.block_size + torch.arange(layout.block_size)
        return rows.reshape(-1).to(device)

    def round_trip(i: int) -> None:
        src = perm[(2 * i) * per : (2 * i + 1) * per]
        dst = perm[(2 * i + 1) * per : (2 * i + 2) * per]
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + n))
        if layerwise:
            assert len(list(engine.store_layerwise(tokens, slots(src)))) == layout.num_layers
        else:
            assert engine.store(tokens, slots(src)) == n
        stored = [page_view(v, runs)[src.to(device)] for v in views]
        if layerwise:
            job = engine.retrieve_layerwise(tokens, slots(dst))
            list(job.layers)
            mask = job.mask
        else:
            mask = engine.retrieve(tokens, slots(dst))
        assert bool(mask.all())
        for view, pages in zip(views, stored, strict=True):
            assert torch.equal(page_view(view, runs)[dst.to(device)], pages)

    # 4 MiB a prompt: while it grows, then at full size (objects further up the arena)
    for i in range(3):
        round_trip(i)
    assert arena.capacity == 24 * MiB  # it was still growing
    platform.gate.set()
    assert wait_grown(arena, 60.0)
    for i in range(3, BLOCKS // (2 * per)):
        round_trip(i)
    assert platform.calls == 96
    engine.close()
    assert _registered(arena) == []
