"""Hostile input to the engine (issue 22): refused before any launch, the same class and message
on every backend, or a correct result where the input is legal."""

from __future__ import annotations

import pytest
import torch

import vidsparse
from helpers import BACKENDS, forbid_calls, make_qkv
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.ops.block_sparse_attn import fwd as fwd_module
from vidsparse.ops.block_sparse_attn import interface


@pytest.fixture
def no_launch(monkeypatch):
    """Any forward on either backend fails the test: the error must come first."""
    forbid_calls(monkeypatch, interface, "block_sparse_attn_ref")
    forbid_calls(monkeypatch, fwd_module, "block_sparse_attn_fwd")


def _args(S=64, D=16, bs=16, H=2):
    q, k, v = make_qkv(1, H, S, S, D, dtype=torch.float32, device="cpu")
    idx, cnt = random_block_lists(1, H, S // bs, S // bs, density=0.5)
    return q, k, v, idx, cnt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0, -1.0])
def test_bad_scale_refused_before_any_launch(request, no_launch, backend, scale):
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        vidsparse.block_sparse_attn(*_args(), block_size=16, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flag", ["no", 1, None])
def test_return_lse_must_be_a_bool(request, no_launch, backend, flag):
    request.getfixturevalue(backend)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        vidsparse.block_sparse_attn(*_args(), block_size=16, return_lse=flag)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_head_dim_names_head_dim(request, no_launch, backend):
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match=r"head_dim .* must be positive"):
        vidsparse.block_sparse_attn(*_args(D=0), block_size=16)


@pytest.mark.parametrize("block", [48, (48, 16), (16, 48)])
def test_triton_path_refuses_block_sizes_not_powers_of_two(triton_backend, no_launch, block):
    """``tl.arange`` takes powers of two only: refused before the launch, naming block_size
    (it was an ``InterpreterError`` from inside the kernel)."""
    block_q, block_kv = (block, block) if isinstance(block, int) else block
    q, k, v = make_qkv(1, 2, 96, 96, 16, dtype=torch.float32, device="cpu")
    idx, cnt = random_block_lists(1, 2, 96 // block_q, 96 // block_kv, density=0.5)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=block)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lists_of_width_zero_attend_to_nothing(request, backend):
    """Lists ``[.., NQ, 0]``: every row is empty, so o = 0, lse = -inf, zero gradients."""
    request.getfixturevalue(backend)
    q, k, v = make_qkv(1, 2, 64, 64, 16, dtype=torch.float32, device="cpu", requires_grad=True)
    idx = torch.zeros(1, 2, 4, 0, dtype=torch.int32)
    cnt = torch.zeros(1, 2, 4, dtype=torch.int32)
    o, lse = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, return_lse=True)
    assert o.shape == q.shape and (o == 0).all()
    assert lse.dtype == torch.float32 and torch.isneginf(lse).all()
    for name, g in zip("qkv", torch.autograd.grad(o.sum(), (q, k, v))):
        assert g.shape == q.shape and (g == 0).all(), name
