"""Hostile input to STA (issue 22): refused before anything runs, the same class and message on
every backend."""

from __future__ import annotations

import pytest
import torch

from helpers import BACKENDS, forbid_calls
from vidsparse.layout import VideoGrid
from vidsparse.ops import sliding_tile_attn as sta_module
from vidsparse.ops.sliding_tile_attn import sliding_tile_attn

GRID = VideoGrid((4, 8, 8), tile=(4, 4, 4))  # 4 tiles of 64 tokens


@pytest.fixture
def no_launch(monkeypatch):
    forbid_calls(monkeypatch, sta_module, "block_sparse_attn_unchecked")


def _qkv(D=16):
    return [torch.randn(1, 2, GRID.num_tokens, D) for _ in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0, -1.0])
def test_bad_scale_refused_before_any_launch(request, no_launch, backend, scale):
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        sliding_tile_attn(*_qkv(), GRID, (1, 1, 1), scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_head_dim_names_head_dim(request, no_launch, backend):
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match=r"head_dim .* must be positive"):
        sliding_tile_attn(*_qkv(D=0), GRID, (1, 1, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flag", ["no", 1, None])
def test_tiled_must_be_a_bool(request, no_launch, backend, flag):
    request.getfixturevalue(backend)
    with pytest.raises(TypeError, match="tiled must be a bool"):
        sliding_tile_attn(*_qkv(), GRID, (1, 1, 1), tiled=flag)
