"""Hostile input to the VSA module (issue 22): clear errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.nn import VideoSparseAttention

GRID = VideoGrid((2, 4, 4), tile=(2, 2, 2))  # 8 tiles
B, H, D, DIM = 1, 2, 8, 12


def _qkv(dtype=torch.float32):
    return [torch.randn(B, H, GRID.num_tokens, D, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "scale, error",
    [(-1.0, ValueError), (0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
     ("x", TypeError), (True, TypeError)],
)  # fmt: skip
def test_bad_scale_refused_in_the_constructor(scale, error):
    with pytest.raises(error, match="scale"):
        VideoSparseAttention(DIM, H, D, scale=scale)


def test_good_scale_is_kept_as_a_float():
    assert VideoSparseAttention(DIM, H, D, scale=1).scale == 1.0
    assert VideoSparseAttention(DIM, H, D).scale is None


def test_hidden_states_of_another_dtype(torch_backend):
    module = VideoSparseAttention(DIM, H, D, dtype=torch.float64)
    q, k, v = _qkv(torch.float64)
    hidden = torch.randn(B, GRID.num_tokens, DIM, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"hidden_states must have the dtype .*float64"):
        module(q, k, v, GRID, hidden_states=hidden, sparsity=0.5)


def test_hidden_states_on_another_device(torch_backend):
    module = VideoSparseAttention(DIM, H, D)
    q, k, v = _qkv()
    hidden = torch.randn(B, GRID.num_tokens, DIM, device="meta")
    with pytest.raises(ValueError, match="hidden_states is on meta"):
        module(q, k, v, GRID, hidden_states=hidden, sparsity=0.5)


def test_hidden_states_of_another_dtype_under_autocast(torch_backend):
    """Autocast casts F.linear's inputs itself: a bf16 hidden state meets fp32 weights."""
    module = VideoSparseAttention(DIM, H, D)
    q, k, v = _qkv()
    hidden = torch.randn(B, GRID.num_tokens, DIM, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = module(q, k, v, GRID, hidden_states=hidden, sparsity=0.5)
    assert o.shape == q.shape
