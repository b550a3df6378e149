"""``gate=0``: VSA's fine stage alone, equal to a zero gate tensor in the output and in the
gradients of q, k and v, on every path (reference, Triton one-grid, packed grids, text tokens),
without a gate tensor, o's rounding residual or the coarse branch's backward; other numbers
are refused before anything runs."""

from __future__ import annotations

import pytest
import torch

import vidsparse
import vidsparse.ops.video_sparse_attn.fine as fine
from vidsparse.ops.video_sparse_attn import video_sparse_attn_ref
from vidsparse.testing import add_tile_structure, assert_rel_l2

GRID = vidsparse.VideoGrid((5, 6, 7))  # 8 tiles, every one partial


def _qkv(S, *, B=2, H=2, D=16, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, H, S, D, generator=gen).to(device, dtype) for _ in range(3)]
    return [x.requires_grad_(True) for x in xs]


def _zero_gate_vs_fine_only(fn, q, k, v, bound):
    """``fn(q, k, v, gate)`` with a zero gate tensor and with ``gate=0``: o, dq, dk, dv."""
    zero = fn(q, k, v, torch.zeros_like(q))
    fine_only = fn(q, k, v, 0)
    assert_rel_l2("o", fine_only.float(), zero.float(), bound)
    do = torch.randn_like(zero)
    for name, a, b in zip(
        ("dq", "dk", "dv"),
        torch.autograd.grad(fine_only, (q, k, v), do),
        torch.autograd.grad(zero, (q, k, v), do),
    ):
        assert_rel_l2(name, a.float(), b.float(), bound)


@pytest.mark.parametrize("tiled", [False, True])
def test_reference_gate_zero_is_the_fine_stage(tiled):
    q, k, v = (x.double() for x in _qkv(GRID.padded_len if tiled else GRID.num_tokens))
    o, parts = video_sparse_attn_ref(q, k, v, GRID, topk=3, gate=0, tiled=tiled,
                                     return_parts=True)  # fmt: skip
    assert torch.equal(o, parts["o_fine"])

    def ref(q, k, v, gate):
        return video_sparse_attn_ref(q, k, v, GRID, topk=3, gate=gate, tiled=tiled)

    _zero_gate_vs_fine_only(ref, q, k, v, 1e-12)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("tiled", [False, True])
def test_triton_gate_zero_equals_a_zero_gate(triton_backend, tiled):
    q, k, v = _qkv(GRID.padded_len if tiled else GRID.num_tokens)

    def vsa(q, k, v, gate):
        return vidsparse.video_sparse_attn(q, k, v, GRID, topk=3, gate=gate, tiled=tiled)

    _zero_gate_vs_fine_only(vsa, q, k, v, 1e-5)
    o = vsa(q, k, v, 0)
    assert_rel_l2("o vs reference", o, video_sparse_attn_ref(q, k, v, GRID, topk=3, gate=0,
                                                             tiled=tiled), 1e-5)  # fmt: skip
    if tiled:  # padding rows of the output are zero
        assert (o[:, :, ~GRID.real_token_mask(o.device)] == 0).all()


@pytest.mark.parametrize("case", ["text", "packed"])
def test_torch_gate_zero_on_text_tokens_and_packed_grids(torch_backend, case):
    _text_or_packed(case, 1e-6)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("case", ["text", "packed"])
def test_triton_gate_zero_on_text_tokens_and_packed_grids(triton_backend, case):
    _text_or_packed(case, 1e-5)


def _text_or_packed(case, bound):
    if case == "text":
        grids, kwargs, S = GRID, {"text_tokens": 5}, GRID.num_tokens + 5
    else:
        grids = [GRID, vidsparse.VideoGrid((4, 4, 6))]
        kwargs, S = {}, sum(g.num_tokens for g in grids)
    q, k, v = _qkv(S, B=1)

    def vsa(q, k, v, gate):
        return vidsparse.video_sparse_attn(q, k, v, grids, topk=2, gate=gate, **kwargs)

    _zero_gate_vs_fine_only(vsa, q, k, v, bound)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_gate_zero_reads_no_gate_keeps_no_residual_and_skips_the_coarse_backward(
    triton_backend, monkeypatch
):
    seen = []
    original = fine.CoarseCombine.__init__

    def spy(self, o_coarse, gate=None, q_block_sizes=None, pooled=None, *rest, spec=""):
        seen.append((gate, pooled, spec))
        original(self, o_coarse, gate, q_block_sizes, pooled, *rest, spec=spec)

    monkeypatch.setattr(fine.CoarseCombine, "__init__", spy)
    q, k, v = _qkv(GRID.num_tokens)
    o = vidsparse.video_sparse_attn(q, k, v, GRID, topk=3, gate=0)
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    # The engine rebuilds the epilogue from what it saved for the backward: every build.
    assert seen and all(gate is None and pooled is None for gate, pooled, _ in seen)
    assert not any(spec.startswith("r:") for *_, spec in seen)  # no int8 residual of o
    seen.clear()
    vidsparse.video_sparse_attn(q, k, v, GRID, topk=3, gate=torch.zeros_like(q))
    assert all(gate is not None and pooled is not None for gate, pooled, _ in seen)
    assert all(spec.startswith("r:") for *_, spec in seen)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("gate", [0.5, 1, 2.0, True, False])
def test_other_numbers_are_refused_before_anything_runs(monkeypatch, backend, gate):
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    q = torch.randn(1, 2, GRID.num_tokens, 16)
    with pytest.raises(ValueError, match=r"a number as gate must be 0 \(the fine stage alone\)"):
        vidsparse.video_sparse_attn(q, q, q, GRID, topk=3, gate=gate)
    with pytest.raises(ValueError, match="a number as gate must be 0"):
        video_sparse_attn_ref(q, q, q, GRID, topk=3, gate=gate)


def test_gate_zero_as_a_float_is_the_fine_stage_too(torch_backend):
    q, k, v = _qkv(GRID.num_tokens)
    assert torch.equal(
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=3, gate=0.0),
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=3, gate=0),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tiled", [False, True])
def test_gpu_gate_zero_equals_a_zero_gate(tiled):
    """bf16 at a 64-token tile grid with partial tiles: the fast kernels, both ways."""
    grid = vidsparse.VideoGrid((9, 14, 22))
    q, k, v = _qkv(grid.padded_len if tiled else grid.num_tokens, B=1, H=4, D=128,
                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    with torch.no_grad():  # no near-tie top-k choices between bf16 and the fp32 reference
        for x in (q, k):
            x.copy_(add_tile_structure(x.float(), grid, 1.0, tiled=tiled))

    def vsa(q, k, v, gate):
        return vidsparse.video_sparse_attn(q, k, v, grid, sparsity=0.75, gate=gate, tiled=tiled)

    _zero_gate_vs_fine_only(vsa, q, k, v, 2e-2)
    ref = video_sparse_attn_ref(*(x.float() for x in (q, k, v)), grid, sparsity=0.75, gate=0,
                                tiled=tiled)  # fmt: skip
    # test_vsa.py's bf16 bound against the fp32 reference on this grid
    assert_rel_l2("o vs fp32 reference", vsa(q, k, v, 0).float(), ref, 3e-2)
