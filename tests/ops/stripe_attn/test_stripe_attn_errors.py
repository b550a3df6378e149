"""Hostile input to PSA (issue 22): refused before anything runs, the same class and message on
every backend."""

from __future__ import annotations

import pytest
import torch

from helpers import BACKENDS, forbid_calls
from vidsparse.layout import VideoGrid
from vidsparse.masks.stripe import StripeSpec
from vidsparse.ops.stripe_attn import interface, stripe_attn
from vidsparse.ops.stripe_attn.interface import stripe_attn_from_lists, stripe_engine_lists

GRID = VideoGrid((2, 8, 8), tile=(2, 8, 8))  # one 128-token tile: the Triton path takes it
SPECS = [StripeSpec.dense()] * 2


@pytest.fixture
def no_launch(monkeypatch):
    forbid_calls(monkeypatch, interface, "block_sparse_attn_unchecked")


def _qkv(D=16):
    return [torch.randn(1, 2, GRID.num_tokens, D) for _ in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0, -1.0])
def test_bad_scale_refused_before_any_launch(request, no_launch, backend, scale):
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        stripe_attn(*_qkv(), GRID, SPECS, scale=scale)
    lists = stripe_engine_lists(SPECS, GRID)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        stripe_attn_from_lists(*_qkv(), GRID, *lists, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_head_dim_names_head_dim(request, no_launch, backend):
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match=r"head_dim .* must be positive"):
        stripe_attn(*_qkv(D=0), GRID, SPECS)
    lists = stripe_engine_lists(SPECS, GRID)
    with pytest.raises(ValueError, match=r"head_dim .* must be positive"):
        stripe_attn_from_lists(*_qkv(D=0), GRID, *lists)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["tiled", "return_lse"])
def test_flags_must_be_bools(request, no_launch, backend, name):
    request.getfixturevalue(backend)
    for flag in ("no", 1, None):
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            stripe_attn(*_qkv(), GRID, SPECS, **{name: flag})
