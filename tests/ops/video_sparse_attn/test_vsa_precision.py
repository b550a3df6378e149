"""VSA's gradient precision in fp16 and bf16 at large input scales, against PyTorch's own.

Full VSA (the public op, with a gate, partial tiles) at input scales 16 and 64: the errors of
dq, dk, dv and dgate against an fp64 reference must stay within 1.5x of the errors of the
same computation written with PyTorch ops in the low dtype (the *baseline*), errors as the
issue measured them: max absolute error over max |reference| (``assert_error_relative``).

The baseline (``_vsa_low_precision``): tile means, coarse attention over them, the fine
attention over VSA's own selection (so all three attend the same key tiles), the gate
combine; every tensor in the low dtype, autograd for the gradients. The fp64 reference is the
same formula in fp64 (itself checked against ``video_sparse_attn_ref``). Both attentions are
``F.scaled_dot_product_attention``, PyTorch's attention op: a softmax written out of fp16
matmuls would round scores of size ``scale**2`` (256 at scale 16, 4096 at 64) to fp16, and
its errors would be tens to hundreds of times any kernel's, a bar that means nothing.

What this guards (fine.py, kernels/combine.py): the backward recovers ``o_fine`` from the
16-bit ``o = o_fine + gate * o_coarse``; without the residual kept from the forward, o's
rounding reaches ``delta = rowsum(o_fine * do)``, and where the softmax is sharp (large
inputs) ``dP - delta`` cancels, so that rounding dominated dq and dk: 2-70x the baseline's
error in these cases before the residual.

In the interpreter bf16 needs the ``exact_bf16_interpreter`` fixture (tests/conftest.py):
Triton 3.6's interpreter keeps bf16 as raw uint16, multiplies those bits in ``tl.dot`` and
truncates fp32 -> bf16 casts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vidsparse
from vidsparse.ops.video_sparse_attn import video_sparse_attn_ref
from vidsparse.testing import add_tile_structure, assert_error_relative

ON_CPU = not torch.cuda.is_available()
FACTOR = 1.5  # the bar: within 1.5x of the baseline's error
GRADS = ("dq", "dk", "dv", "dgate")


# ----------------------------------------------------------------------------- bf16 shim


@pytest.mark.interpreter
@pytest.mark.skipif(not ON_CPU, reason="the interpreter's bf16")
def test_bf16_shim_makes_the_interpreter_exact(exact_bf16_interpreter):
    import triton
    import triton.language as tl

    @triton.jit
    def dot_and_cast(X, Y, Z, N: tl.constexpr):
        offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
        y = tl.dot(tl.load(X + offs), tl.load(X + offs))
        tl.store(Y + offs, y)
        tl.store(Z + offs, (y * 1.001).to(tl.bfloat16))

    x = torch.randn(16, 16).bfloat16()
    y, z = torch.empty(16, 16), torch.empty(16, 16, dtype=torch.bfloat16)
    dot_and_cast[(1,)](x, y, z, 16)
    # The products of bf16 values are exact in fp32; the sums round in the interpreter's order,
    # not necessarily in torch's (its BLAS path depends on the threads): fp32 accuracy, where
    # multiplied raw bits would be off by orders of magnitude.
    exact = x.double() @ x.double()
    assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert torch.equal(z, (y * 1.001).bfloat16())  # one fp32 multiply, then torch's rounding


# ----------------------------------------------------------------------------- baseline


def _to_tiles(x, grid, tiled: bool):
    """Natural -> tile order with plain indexing (padding slots 0), or x if already tiled."""
    if tiled:
        return x
    index = grid.index_tensors(x.device)
    real = index.valid.view(1, 1, -1, 1)
    return x.index_select(2, index.gather_index).masked_fill(~real, 0)


def _vsa_low_precision(q, k, v, gate, grid, kv_indices, scale, tiled):
    """VSA in PyTorch ops on inputs of the low dtype, every tensor in it (module docstring)."""
    q_t, k_t, v_t, g_t = (_to_tiles(x, grid, tiled) for x in (q, k, v, gate))
    B, H, P, D = q_t.shape
    Nt, V = grid.num_tiles, grid.tile_volume
    real = grid.real_token_mask(q.device).view(Nt, V)  # [Nt, V]
    sizes = real.sum(-1).view(Nt, 1).to(q.dtype)

    def means(x):
        return (x.view(B, H, Nt, V, D) * real.view(Nt, V, 1).to(x.dtype)).sum(-2) / sizes

    qc, kc, vc = means(q_t), means(k_t), means(v_t)
    o_coarse = F.scaled_dot_product_attention(qc, kc, vc, scale=scale)  # [B, H, Nt, D]
    selected = torch.zeros(B, H, Nt, Nt, dtype=torch.bool, device=q.device)
    selected.scatter_(-1, kv_indices.long(), True)
    keys = selected.repeat_interleave(V, 2).repeat_interleave(V, 3) & real.view(1, 1, 1, P)
    o_fine = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=keys, scale=scale)
    o = o_fine + g_t * o_coarse.repeat_interleave(V, 2)
    o = o.masked_fill(~real.view(1, 1, P, 1), 0)  # padding rows: 0, as VSA's
    if tiled:
        return o
    return o.index_select(2, grid.index_tensors(q.device).scatter_index)


# ----------------------------------------------------------------------------- the check


def _inputs(grid, B, H, D, dtype, scale, tiled, device):
    """q, k, v at ``scale`` with a per-tile component (real video has one), an O(1) gate and
    do, as fp64 tensors holding values of ``dtype``."""
    S = grid.num_tokens
    xs = [torch.randn(B, H, S, D, device=device, dtype=torch.float64) * scale for _ in range(3)]
    xs[:2] = [add_tile_structure(x, grid, scale, tiled=False) for x in xs[:2]]
    gate, do = (torch.randn(B, H, S, D, device=device, dtype=torch.float64) for _ in range(2))
    xs = [*xs, gate, do]
    if tiled:
        index = grid.index_tensors(device)
        real = index.valid.view(1, 1, -1, 1)
        xs = [x.index_select(2, index.gather_index).masked_fill(~real, 0) for x in xs]
    return [x.to(dtype).double() for x in xs]


def _gradients(grid, B, H, D, dtype, scale, tiled, device, topk):
    """``{"o" or gradient: (VSA's, the baseline's, the fp64 reference)}`` on one fresh random
    draw. The baseline and the reference attend VSA's own selection: where TF32 coarse scores
    (GPU) break a near-tie otherwise than fp64 does, a different selection would make the
    errors compare different attentions. The fp64 reference is the baseline's formula in fp64,
    checked against the library's reference first on the selection that one makes."""
    q, k, v, gate, do = _inputs(grid, B, H, D, dtype, scale, tiled, device)
    _check_formula_matches_reference(q, k, v, gate, grid, topk, tiled)
    ours = [x.to(dtype).requires_grad_() for x in (q, k, v, gate)]
    o = vidsparse.video_sparse_attn(*ours[:3], grid, topk=topk, gate=ours[3], tiled=tiled)
    got = torch.autograd.grad(o, ours, do.to(dtype))
    selected = _selection(ours[:3], grid, topk, tiled)

    exact = [x.clone().requires_grad_() for x in (q, k, v, gate)]
    o_ref = _vsa_low_precision(*exact, grid, selected, D**-0.5, tiled)
    ref = torch.autograd.grad(o_ref, exact, do)
    low = [x.to(dtype).requires_grad_() for x in (q, k, v, gate)]
    o_base = _vsa_low_precision(*low, grid, selected, D**-0.5, tiled)
    base = torch.autograd.grad(o_base, low, do.to(dtype))
    return {"o": (o, o_base, o_ref)} | dict(zip(GRADS, zip(got, base, ref)))


def _check_formula_matches_reference(q, k, v, gate, grid, topk, tiled):
    """The test's formula in fp64 over ``video_sparse_attn_ref``'s selection is that
    reference, output and gradients."""
    a = [x.clone().requires_grad_() for x in (q, k, v, gate)]
    o_ref, parts = video_sparse_attn_ref(*a[:3], grid, topk=topk, gate=a[3], tiled=tiled,
                                         return_parts=True)  # fmt: skip
    b = [x.clone().requires_grad_() for x in (q, k, v, gate)]
    o = _vsa_low_precision(*b, grid, parts["kv_indices"], q.shape[-1] ** -0.5, tiled)
    do = torch.randn_like(o)
    expected = (o_ref, *torch.autograd.grad(o_ref, a, do))
    for x, y in zip(expected, (o, *torch.autograd.grad(o, b, do))):
        x, y = x.detach(), y.detach()
        torch.testing.assert_close(y, x, rtol=1e-9, atol=1e-9 * float(x.abs().max()))


def _selection(qkv, grid, topk, tiled):
    """The key tiles VSA's coarse stage selects on these (low-precision) inputs."""
    from vidsparse.ops.video_sparse_attn.coarse import vsa_coarse_stage

    q_t, k_t, v_t = (_to_tiles(x.detach(), grid, tiled) for x in qkv)
    _, kv_indices, _ = vsa_coarse_stage(q_t, k_t, v_t, grid, topk)
    return kv_indices


def _check(grid, B, H, D, dtype, scale, tiled, device, topk):
    results = _gradients(grid, B, H, D, dtype, scale, tiled, device, topk)
    for name, (got, base, ref) in results.items():
        assert got.dtype == dtype, name
        # ~2% of one fp16 rounding: for gradients that are all but zero
        floor = 1e-5 * float(ref.detach().abs().max())
        assert_error_relative(name, got, ref, base, factor=FACTOR, atol=floor)


# 2 x 3 x 3 = 18 tiles, partial along every axis (6 of 8 frames, 9 of 12 rows, 11 of 12 cols).
GRID = vidsparse.VideoGrid((6, 9, 11))
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
SCALES = pytest.mark.parametrize("scale", [16.0, 64.0], ids=["scale16", "scale64"])
LAYOUTS = pytest.mark.parametrize("tiled", [False, True], ids=["natural", "tiled"])


@pytest.mark.interpreter
@pytest.mark.skipif(not ON_CPU, reason="interpreter tests run on CPU CI")
@DTYPES
@SCALES
@LAYOUTS
def test_gradients_within_low_precision_pytorch_error(
    triton_backend, exact_bf16_interpreter, dtype, scale, tiled
):
    _check(GRID, 1, 2, 32, dtype, scale, tiled, "cpu", topk=5)


@pytest.mark.gpu
@DTYPES
@SCALES
@LAYOUTS
def test_gpu_gradients_within_low_precision_pytorch_error(dtype, scale, tiled):
    grid = vidsparse.VideoGrid((9, 14, 22))  # 3 x 4 x 6 = 72 tiles, partial along every axis
    _check(grid, 2, 4, 128, dtype, scale, tiled, "cuda", topk=9)


# ----------------------------------------------------------------------------- the residual


def _combine_case(dtype, scale, device="cpu"):
    """The fine stage with the combine at ``scale`` on 4 partial 16-token tiles (sharp rows)."""
    from helpers import make_lists, make_qkv

    B, H, S, D, bs = 1, 2, 64, 16, 16
    nq = S // bs
    q, k, v = make_qkv(B, H, S, S, D, dtype=dtype, device=device, scale=scale)
    idx, cnt = make_lists(1, H, nq, nq, density=0.5, device=device, empty_rows=1)
    sizes = torch.tensor([16, 9, 16, 5], dtype=torch.int32, device=device)
    pad = (torch.arange(S, device=device) % bs) >= sizes.long().repeat_interleave(bs)
    k[:, :, pad], v[:, :, pad] = 0.0, 0.0  # VSA's tiling pads with zeros
    o_coarse = torch.randn(B, H, nq, D, device=device) * scale / 4
    gate = torch.randn_like(q)
    do = torch.randn_like(q)
    return (q, k, v, idx, cnt, sizes, o_coarse, gate, do, bs, D**-0.5), pad


def _combined(case, backend, monkeypatch, grad=True):
    from vidsparse.ops.video_sparse_attn.fine import vsa_fine_combined

    q, k, v, idx, cnt, sizes, o_coarse, gate, do, bs, scale = case
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    leaves = [x.clone().requires_grad_(grad) for x in (q, k, v, o_coarse, gate)]
    with torch.set_grad_enabled(grad):
        o = vsa_fine_combined(*leaves[:3], idx, cnt, sizes, leaves[3], leaves[4], sizes, bs,
                              scale)  # fmt: skip
    if not grad:
        return o, None
    return o, torch.autograd.grad(o, leaves, do)


def _combined_exact(case):
    """fp64 autograd of ``o_fine + gate * o_coarse`` (padding rows 0)."""
    from helpers import masked_dense_attention

    q, k, v, idx, cnt, sizes, o_coarse, gate, do, bs, scale = case
    leaves = [x.double().requires_grad_() for x in (q, k, v, o_coarse, gate)]
    o_fine, _ = masked_dense_attention(*leaves[:3], idx, cnt, bs, bs, sizes, scale)
    o = o_fine + leaves[4] * leaves[3].repeat_interleave(bs, 2)
    real = (torch.arange(q.shape[2]) % bs) < sizes.long().repeat_interleave(bs)
    o = o * real.view(1, 1, -1, 1)
    return torch.autograd.grad(o, leaves, do.double())


@pytest.mark.interpreter
@pytest.mark.skipif(not ON_CPU, reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_residual_on_both_backends(monkeypatch, exact_bf16_interpreter, dtype):
    """At scale 64 every row's softmax is one-hot, so the exact dq and dk are ~0 and what the
    backward returns is error: the epilogue's PyTorch side (the engine's reference path) and
    its kernels both keep the residual, which cuts that error by more than 20x; dv and the
    combine's own gradients stay within a few roundings of the output dtype."""
    from vidsparse.ops.video_sparse_attn import fine

    case, pad = _combine_case(dtype, 64.0)
    exact = _combined_exact(case)
    unit = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    names = ("dq", "dk", "dv", "d_coarse", "dgate")
    spec = fine.combine_spec

    def without_residual(segments, residual, *rest):
        return spec(segments, False, *rest)

    for backend in ("torch", "triton"):
        _, grads = _combined(case, backend, monkeypatch)
        with monkeypatch.context() as m:  # the same call without the residual
            m.setattr(fine, "combine_spec", without_residual)
            _, unkept = _combined(case, backend, monkeypatch)
        for name, g, g0, r in zip(names, grads, unkept, exact):
            if name in ("dk", "dv"):  # padding keys: undefined
                g, g0, r = g[:, :, ~pad], g0[:, :, ~pad], r[:, :, ~pad]
            err = float((g.double() - r).abs().max())
            if name in ("dq", "dk"):
                err0 = float((g0.double() - r).abs().max())
                assert err * 20 < err0, f"{backend} {name}: {err:.2e}, {err0:.2e} without"
            else:
                rel = err / float(r.abs().max())
                assert rel < 4 * unit, f"{backend} {name}: {rel:.2e} (unit roundoff {unit:.1e})"


@pytest.mark.interpreter
@pytest.mark.skipif(not ON_CPU, reason="interpreter tests run on CPU CI")
def test_residual_leaves_the_output_as_it_was(monkeypatch):
    """Keeping the residual (under autograd) changes no bit of o: no-grad forward, same o."""
    case, _ = _combine_case(torch.float16, 16.0)
    with_grad, _ = _combined(case, "triton", monkeypatch)
    without, _ = _combined(case, "triton", monkeypatch, grad=False)
    assert torch.equal(with_grad.detach(), without)


@pytest.mark.dynamo
def test_residual_travels_through_torch_compile(monkeypatch):
    """The engine's custom ops carry the residual as a third forward output: their fake
    implementations agree with the eager ones (aot_eager on the engine's PyTorch path)."""
    case, _ = _combine_case(torch.float16, 16.0)
    eager_o, eager_grads = _combined(case, "torch", monkeypatch)
    from vidsparse.ops.video_sparse_attn.fine import vsa_fine_combined

    q, k, v, idx, cnt, sizes, o_coarse, gate, do, bs, scale = case

    def f(q, k, v, o_coarse, gate):
        return vsa_fine_combined(q, k, v, idx, cnt, sizes, o_coarse, gate, sizes, bs, scale)

    leaves = [x.clone().requires_grad_() for x in (q, k, v, o_coarse, gate)]
    o = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    grads = torch.autograd.grad(o, leaves, do)
    assert torch.equal(o, eager_o)
    for g, e in zip(grads, eager_grads):
        assert torch.equal(g, e)
