"""Hostile input to VSA (issue 22): refused before anything runs (no tiling, no launch), the
same class and message on every backend, or a correct result where the input is legal."""

from __future__ import annotations

import pytest
import torch

import vidsparse
from helpers import BACKENDS, forbid_calls
from vidsparse.layout import VideoGrid
from vidsparse.ops.video_sparse_attn import interface

GRID = VideoGrid((4, 4, 8), tile=(4, 4, 4))  # 2 tiles


@pytest.fixture
def no_launch(monkeypatch):
    """Either backend's compute fails the test: the error must come first."""
    forbid_calls(monkeypatch, interface, "video_sparse_attn_ref", "_video_sparse_attn_composed")


def _qkv(B=1, H=2, D=16, dtype=torch.float32, requires_grad=False):
    return [
        torch.randn(B, H, GRID.num_tokens, D, dtype=dtype).requires_grad_(requires_grad)
        for _ in range(4)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0, -1.0])
def test_bad_scale_refused_before_anything_runs(request, no_launch, backend, scale):
    request.getfixturevalue(backend)
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=1, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_of_another_type_is_a_type_error(request, no_launch, backend):
    request.getfixturevalue(backend)
    q, k, v, _ = _qkv()
    for scale in ("x", True):
        with pytest.raises(TypeError, match="scale must be a float or None"):
            vidsparse.video_sparse_attn(q, k, v, GRID, topk=1, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flag", ["no", 1, None])
def test_tiled_must_be_a_bool(request, no_launch, backend, flag):
    request.getfixturevalue(backend)
    q, k, v, _ = _qkv()
    with pytest.raises(TypeError, match="tiled must be a bool"):
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=1, tiled=flag)


def test_triton_path_refuses_fp64_before_tiling(triton_backend, no_launch, monkeypatch):
    def tiled(*args, **kwargs):
        raise AssertionError("the inputs were tiled")

    monkeypatch.setattr(VideoGrid, "tile", tiled)
    q, k, v, _ = _qkv(dtype=torch.float64)
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_head_dim_names_head_dim(request, no_launch, backend):
    request.getfixturevalue(backend)
    q, k, v, _ = _qkv(D=0)
    with pytest.raises(ValueError, match=r"head_dim .* must be positive"):
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B, H", [(0, 2), (1, 0)])
@pytest.mark.parametrize("with_gate", [False, True])
def test_empty_batch_or_heads_give_the_empty_result(request, backend, B, H, with_gate):
    request.getfixturevalue(backend)
    q, k, v, gate = _qkv(B=B, H=H, requires_grad=True)
    gate = gate if with_gate else None
    o = vidsparse.video_sparse_attn(q, k, v, GRID, topk=1, gate=gate)
    assert o.shape == q.shape and o.dtype == q.dtype
    inputs = (q, k, v) if gate is None else (q, k, v, gate)
    for x, g in zip(inputs, torch.autograd.grad(o.sum(), inputs)):
        assert g.shape == x.shape
