"""The small kernels beside the paged-row copy: a table copied by a kernel reading host memory."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cuda.kernels import WORDS_ALIGN, copy_words


@settings(max_examples=15, deadline=None)
@given(numel=st.integers(min_value=0, max_value=3000))
def test_copy_words_copies_exactly_the_rounded_count(device, numel):
    """The kernel reads a pinned host buffer in place (on a GPU) and writes the device buffer:
    the first ``numel`` words arrive, words past the rounded-up count are never touched."""
    size = -(-max(numel, 1) // WORDS_ALIGN) * WORDS_ALIGN + 64
    src = torch.arange(size, dtype=torch.int64) * 7 - 5
    if device.type == "cuda":
        src = src.pin_memory()
    dst = torch.full((size,), -1, dtype=torch.int64, device=device)
    copy_words(src, dst, numel)
    got = dst.cpu()
    rounded = -(-numel // WORDS_ALIGN) * WORDS_ALIGN
    assert torch.equal(got[:numel], src[:numel])
    assert torch.equal(got[:rounded], src[:rounded])
    assert bool((got[rounded:] == -1).all())


def test_copy_words_of_nothing_launches_nothing(device):
    dst = torch.full((16,), -1, dtype=torch.int64, device=device)
    assert copy_words(torch.zeros(16, dtype=torch.int64), dst, 0) is None
    assert bool((dst.cpu() == -1).all())
