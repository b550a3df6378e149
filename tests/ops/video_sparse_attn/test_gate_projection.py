"""VSA's gate handed over as a ``GateProjection``: the same values and gradients as the gate
tensor it stands for, on every path, and on the natural-order Triton path no gate kept for the
backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vidsparse
from vidsparse import GateProjection


def _leaves(device, dtype, grid, B=2, H=2, D=16, dim=24, tiled=False):
    """q, k, v ``[B, H, S, D]`` (views of ``[B, S, H, D]`` storage, as diffusers has them),
    the projection's hidden states, weight and bias, and an output gradient."""
    S = grid.padded_len if tiled else grid.num_tokens
    qkv = [torch.randn(B, S, H, D, device=device).transpose(1, 2) for _ in range(3)]
    x = torch.randn(B, S, dim, device=device)
    weight = torch.randn(H * D, dim, device=device) / dim**0.5
    bias = torch.randn(H * D, device=device) * 0.1
    do = torch.randn(B, S, H, D, device=device).transpose(1, 2).to(dtype)
    return [t.to(dtype) for t in (*qkv, x, weight, bias)], do


def _both_arms(leaves, do, grid, topk, tiled=False):
    """``(o, dq, dk, dv, dx, dweight, dbias)`` with the gate as a projection, then as the
    tensor ``F.linear`` forms from the same leaves."""
    H, D = leaves[0].shape[1], leaves[0].shape[3]
    arms = []
    for as_projection in (True, False):
        q, k, v, x, weight, bias = (t.clone().requires_grad_() for t in leaves)
        if as_projection:
            gate = GateProjection(x, weight, bias)
        else:
            B, S, _ = x.shape
            gate = F.linear(x, weight, bias).view(B, S, H, D).transpose(1, 2)
        o = vidsparse.video_sparse_attn(q, k, v, grid, topk=topk, gate=gate, tiled=tiled)
        arms.append((o, *torch.autograd.grad(o, (q, k, v, x, weight, bias), do)))
    return arms


def _assert_same(arms, rounded=()):
    names = ("o", "dq", "dk", "dv", "dx", "dweight", "dbias")
    for name, a, b in zip(names, *arms):
        if name in rounded:  # summed in another order: within a few units of eps
            eps = torch.finfo(a.dtype).eps
            torch.testing.assert_close(a, b, rtol=4 * eps, atol=4 * eps * b.abs().max().item())
        else:
            assert torch.equal(a, b), name


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("tiled", [False, True])
def test_projection_equals_its_gate_tensor_triton(triton_backend, tiled):
    """Natural order: formed in the fine stage's hooks and again in its backward; tiled: formed
    up front and tiled like a gate tensor. Either way the bits of the tensor path, on a grid
    with partial tiles along every axis."""
    grid = vidsparse.VideoGrid((5, 6, 7))
    leaves, do = _leaves("cpu", torch.float32, grid, tiled=tiled)
    _assert_same(_both_arms(leaves, do, grid, topk=3, tiled=tiled))


def test_projection_equals_its_gate_tensor_torch(torch_backend):
    """The PyTorch backend forms the gate up front: the reference's values and gradients."""
    grid = vidsparse.VideoGrid((5, 6, 7))
    leaves, do = _leaves("cpu", torch.float32, grid)
    _assert_same(_both_arms(leaves, do, grid, topk=3))


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of ``fn()``."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_projection_keeps_no_gate_for_the_backward(triton_backend):
    """With the tensor the fine stage keeps the gate (and ``linear`` its input and weight);
    with the projection it keeps the projection's inputs only: a gate's bytes less."""
    grid = vidsparse.VideoGrid((5, 6, 7))
    leaves, _ = _leaves("cpu", torch.float32, grid)
    q, k, v, x, weight, bias = (t.requires_grad_() for t in leaves)
    B, S, dim = x.shape
    H, D = q.shape[1], q.shape[3]

    def run(as_projection):
        gate = GateProjection(x, weight, bias) if as_projection else (
            F.linear(x, weight, bias).view(B, S, H, D).transpose(1, 2))  # fmt: skip
        return vidsparse.video_sparse_attn(q, k, v, grid, topk=3, gate=gate)

    kept_tensor, kept_projection = _saved_bytes(lambda: run(False)), _saved_bytes(lambda: run(True))
    gate_bytes = B * S * H * D * q.element_size()
    assert kept_tensor - kept_projection == gate_bytes - bias.nbytes


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x_dtype": torch.float64}, "hidden_states must have q's dtype"),
        ({"x_len": 5}, r"hidden_states must be \[B, S, dim\]"),
        ({"weight_rows": 7}, r"weight must be \[H \* D, dim\]"),
        ({"bias_len": 3}, r"bias must be \[H \* D\]"),
    ],
)
def test_projection_checked_before_any_compute(change, match):
    grid = vidsparse.VideoGrid((4, 4, 4))
    B, H, S, D, dim = 1, 2, grid.num_tokens, 16, 8
    q = k = v = torch.randn(B, H, S, D)
    x = torch.randn(B, change.get("x_len", S), dim, dtype=change.get("x_dtype", torch.float32))
    weight = torch.randn(change.get("weight_rows", H * D), dim)
    bias = torch.randn(change.get("bias_len", H * D))
    with pytest.raises(ValueError, match=match):
        vidsparse.video_sparse_attn(q, k, v, grid, topk=1, gate=GateProjection(x, weight, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_projection_equals_its_gate_tensor_gpu(dtype):
    """The same on the GPU at D=128 (the Gluon forward reads the formed gate through the
    row map; the backward forms it again with the same matmul)."""
    grid = vidsparse.VideoGrid((9, 14, 22))
    leaves, do = _leaves("cuda", dtype, grid, H=3, D=128, dim=256)
    _assert_same(_both_arms(leaves, do, grid, topk=9))
