"""The video ops store their output as q is: q, k, v as diffusers' processors hold them
(``[B, S, H, D]`` seen as ``[B, H, S, D]``) give an o in ``[B, S, H, D]`` storage, as SDPA's
output is then, so transposing and flattening it back is a view. The values and gradients are
those of contiguous inputs, bit for bit."""

from __future__ import annotations

import pytest
import torch

import vidsparse

SPEC = vidsparse.StripeSpec(1, 0, None, 2, 0, 3)
METHODS = {
    "vsa": lambda q, k, v, g, grid: vidsparse.video_sparse_attn(q, k, v, grid, topk=3, gate=g),
    "vsa_gate0": lambda q, k, v, g, grid: vidsparse.video_sparse_attn(
        q, k, v, grid, topk=3, gate=0
    ),  # fmt: skip
    "psa": lambda q, k, v, g, grid: vidsparse.stripe_attn(q, k, v, grid, [SPEC] * q.shape[1]),
    "sta": lambda q, k, v, g, grid: vidsparse.sliding_tile_attn(q, k, v, grid, _window(grid)),
}


def _window(grid) -> tuple[int, ...]:
    """3 tiles along each axis that has them, else 1 (a window must fit the grid)."""
    return tuple(3 if n >= 3 else 1 for n in grid.tiles)


def _check_stored_as_q(method, grid, D, dtype, device):
    xs = [torch.randn(2, grid.num_tokens, 3, D, device=device).to(dtype) for _ in range(4)]
    bshd = [x.transpose(1, 2).requires_grad_(True) for x in xs]
    flat = [x.transpose(1, 2).contiguous().requires_grad_(True) for x in xs]
    fn = METHODS[method]
    o_bshd, o_flat = fn(*bshd, grid), fn(*flat, grid)
    assert o_bshd.transpose(1, 2).is_contiguous() and o_flat.is_contiguous()
    assert torch.equal(o_bshd, o_flat)
    do = torch.randn_like(o_flat)
    inputs = 4 if method == "vsa" else 3
    grads_bshd = torch.autograd.grad(o_bshd, bshd[:inputs], do)
    grads_flat = torch.autograd.grad(o_flat, flat[:inputs], do)
    for name, a, b in zip("qkvg", grads_bshd, grads_flat):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("method", sorted(METHODS))
def test_output_is_stored_as_q_is(triton_backend, method):
    _check_stored_as_q(method, vidsparse.VideoGrid((5, 6, 7)), 16, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", sorted(METHODS))
def test_gpu_output_is_stored_as_q_is(method):
    _check_stored_as_q(method, vidsparse.VideoGrid((9, 14, 22)), 128, torch.bfloat16, "cuda")
