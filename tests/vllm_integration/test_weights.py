"""The weights by their content (``weights.py``): what changes the digest and what does not."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (install kvtier[vllm])")

from kvtier.core.errors import LayoutError
from kvtier.vllm_integration import weights
from kvtier.vllm_integration.weights import (
    combine,
    digest_tensors,
    file_digest,
    files_digest,
    find_model,
    model_digest,
    weight_files,
)


@pytest.fixture(autouse=True)
def fresh_digests(monkeypatch) -> None:
    """Each test starts with no file digest remembered in this process."""
    monkeypatch.setattr(weights, "_DIGESTS", {})


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 16), torch.nn.Linear(16, 4096), torch.nn.Linear(4096, 8)
    ).to(torch.bfloat16)


def test_the_same_weights_give_the_same_digest_wherever_they_live() -> None:
    a, b = small_model(0), small_model(0)
    assert model_digest(a) == model_digest(b)
    assert model_digest(a) != model_digest(small_model(1))


@settings(max_examples=40, deadline=None)
@given(layer=st.integers(0, 2), flat=st.integers(0, 1 << 30), delta=st.sampled_from([1, -1]))
def test_changing_any_one_element_of_any_tensor_changes_the_digest(layer, flat, delta) -> None:
    """One element changed by the smallest step its bits allow (not one of the sampled
    positions, in general): the word sum sees it."""
    model = small_model(0)
    before = model_digest(model)
    param = list(model.parameters())[layer]
    raw = param.data.view(-1).view(torch.int16)
    raw[flat % raw.numel()] += delta
    assert model_digest(model) != before


def test_names_shapes_and_dtypes_are_part_of_the_digest() -> None:
    t = torch.arange(64, dtype=torch.float32)
    base = digest_tensors([("w", t)])
    assert digest_tensors([("v", t)]) != base
    assert digest_tensors([("w", t.view(8, 8))]) != base
    assert digest_tensors([("w", t.view(torch.int32))]) != base
    assert digest_tensors([("w", t), ("x", t)]) == digest_tensors([("x", t), ("w", t)])


def test_tensors_past_float_precision_are_sampled_to_their_last_element() -> None:
    big = torch.zeros((1 << 24) + 3, dtype=torch.int8)
    before = digest_tensors([("w", big)])
    big[-1] = 1
    assert digest_tensors([("w", big)]) != before


def test_engines_combine_their_ranks_in_rank_order() -> None:
    assert combine({0: "a"}) == "a"
    assert combine({0: "a", 1: "b"}) == combine({1: "b", 0: "a"})
    assert combine({0: "a", 1: "b"}) != combine({0: "b", 1: "a"})


def test_a_checkpoint_digest_is_its_content_not_its_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "model.safetensors").write_bytes(b"\x01" * 1000 + b"weights")
        (tmp_path / d / "config.json").write_text("{}")
    fx, fy = weight_files(str(tmp_path / "x")), weight_files(str(tmp_path / "y"))
    assert [f.name for f in fx] == ["model.safetensors"]  # not the config
    assert files_digest(fx) == files_digest(fy)
    first = files_digest(fx)
    # Replaced in place with other bytes of the same size: another checkpoint.
    (tmp_path / "x" / "model.safetensors").write_bytes(b"\x01" * 1000 + b"weightz")
    assert files_digest(fx) != first
    assert files_digest(fy) == first


def test_a_file_rewritten_in_place_with_its_old_mtime_is_read_again(tmp_path, monkeypatch) -> None:
    """The digest cache is keyed by the file's version (inode, size, mtime, ctime): ``cp -p``
    over the old file keeps the inode and sets the old mtime, but not the ctime."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"a" * 4096)
    st = f.stat()
    first = file_digest(f)
    with open(f, "r+b") as h:
        h.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(f) != first


def test_large_files_are_hashed_in_pieces_the_same_way_every_time(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("kvtier.vllm_integration.weights.SEGMENT", 1000)
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(10_500))
    one = file_digest(f, workers=1)
    for p in (tmp_path / "cache" / "kvtier" / "weights").iterdir():
        p.unlink()
    weights._DIGESTS.clear()  # read it again, not this process's memory of it
    assert file_digest(f, workers=4) == one


def test_no_model_among_the_callers_is_a_named_error() -> None:
    with pytest.raises(LayoutError, match="could not find the model"):
        find_model()


def test_the_model_runner_is_found_from_its_callee() -> None:
    class Runner:
        def __init__(self) -> None:
            self.model = small_model()

        def get_model(self) -> torch.nn.Module:
            return self.model

        def initialize_kv_cache(self) -> torch.nn.Module:
            return find_model()

    runner = Runner()
    assert runner.initialize_kv_cache() is runner.model
