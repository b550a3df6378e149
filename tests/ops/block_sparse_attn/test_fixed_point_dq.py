"""The one-pass backward's dQ in int32 fixed point (``configs.ONE_PASS_MODES["fixed"]``): the
pieces that run outside the Gluon kernel, in the interpreter on the CPU and compiled on a GPU.

- ``bwd.kv_bounds``: each head's largest |k| and largest row norm of v, padding rows left out,
  infinite where k or v is not finite.
- The preprocess's row multipliers (``DQ_FIXED``): powers of two under which every partial sum
  of a row's dQ (any subset of its listed key blocks, in any order) stays under 2**30, so int32
  holds the sum; checked against the partials computed in fp64, on random inputs at three
  scales and on inputs built so that the bound is reached. The emulated fixed-point sum is
  within 1e-4 of fp64's dq (the kernel's per-block rounding, not a test of the kernel).
- ``bwd_sm90.dq_from_fixed_point``: the sums divided by the multipliers, NaN rows kept.

The kernel itself (``bwd_sm90.dkdvdq_gluon(dq_fix=...)``) runs on Hopper only
(``test_gluon_bwd.py``: the same bits on three runs, dq against fp64).
"""

from __future__ import annotations

import pytest
import torch

from helpers import make_lists, make_qkv, masked_dense_attention, token_mask
from vidsparse.ops.block_sparse_attn import bwd, bwd_sm90
from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE

BS, D = 16, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _multipliers(q, k, v, do, idx, cnt, sizes, scale):
    """``(fix, delta, o, lse)``: the preprocess's fixed-point multipliers and delta, from the
    fp64 forward's o (in q's dtype) and lse."""
    o, lse = masked_dense_attention(q, k, v, idx, cnt, BS, BS, sizes, scale)
    o = o.to(q.dtype)
    lse = lse.float()
    delta, _, _, fix = bwd._preprocess(do, o, lse, BS, NO_EPILOGUE.fns(), (),
                                       dq_fixed_of=(k, v, scale, sizes, BS))  # fmt: skip
    return fix, delta, o, lse


def _block_partials(q, k, v, do, idx, cnt, sizes, scale, delta, lse):
    """fp64 ``[NK, B, H, Sq, D]``: each key block's share of dq, ``scale * dS[:, block] @
    K[block]``, with ``dS = P (dP - delta)`` as the kernel forms it."""
    q, k, v, do = (x.double() for x in (q, k, v, do))
    mask = token_mask(idx, cnt, BS, BS, k.shape[2], sizes)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    lse = lse.double()
    p = torch.where(mask, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None]), 0)
    ds = p * (torch.einsum("bhqd,bhkd->bhqk", do, v) - delta.double()[..., None])
    blocks = ds.unflatten(-1, (-1, BS))  # [B, H, Sq, NK, BS]
    keys = k.unflatten(2, (-1, BS))  # [B, H, NK, BS, D]
    return scale * torch.einsum("bhqnj,bhnjd->nbhqd", blocks, keys)


def _check_fixed_point(partials, fix):
    """Every row's sum of |partials| times its multiplier under 2**30 (no order of adds can
    leave int32), and the emulated fixed-point sum within half a unit a block of fp64's."""
    fix64 = fix.double()[None, ..., None]
    assert torch.isfinite(fix).all()
    assert ((fix.view(torch.int32) & 0x7FFFFF) == 0).all(), "powers of two"
    assert ((partials.abs().sum(0) * fix64[0]) < 2**30).all()
    fixed = torch.round(partials * fix64).to(torch.int64).sum(0)
    emulated = fixed.double() / fix64[0]
    exact = partials.sum(0)
    assert ((emulated - exact).abs() <= partials.shape[0] * 0.5 / fix64[0] * 1.0001).all()
    return emulated, exact


@pytest.mark.parametrize("scale_in", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_multipliers_bound_every_partial_sum(dtype, scale_in):
    """Random inputs, partial key blocks with large finite padding, an empty query row: the
    multipliers keep every partial sum in int32's range, and the fixed-point sum's error is
    far below 16-bit dq's own rounding (1e-4 relative, against ~4e-3)."""
    torch.manual_seed(int(scale_in) * 7 + (dtype == torch.float16))
    B, H, S = 1, 2, 4 * BS
    q, k, v = make_qkv(B, H, S, S, D, dtype=dtype, device=DEVICE, scale=scale_in)
    do = torch.randn_like(q)
    idx, cnt = make_lists(1, H, S // BS, S // BS, density=0.75, device=DEVICE, empty_rows=1)
    sizes = torch.tensor([BS, 9, BS, 3], dtype=torch.int32, device=DEVICE)
    padding = (torch.arange(S, device=DEVICE) % BS) >= sizes.long().repeat_interleave(BS)
    k[:, :, padding], v[:, :, padding] = 3e4, -3e4  # finite, far above the real rows
    scale = D**-0.5
    fix, delta, _, lse = _multipliers(q, k, v, do, idx, cnt, sizes, scale)
    partials = _block_partials(q, k, v, do, idx, cnt, sizes, scale, delta, lse)
    emulated, exact = _check_fixed_point(partials, fix)
    err = (emulated - exact).norm() / exact.norm()
    assert err < 1e-4, err


def test_the_bound_is_reached_and_held():
    """Inputs built so that one key block's share of dq equals the bound (uniform attention
    over one block, v and k rows of alternating sign, dO along v): the largest partial times
    its multiplier lands in [2**28, 2**29), as the multiplier's rule says, so a bound or a
    multiplier twice too large would show here."""
    B, H, S = 1, 1, 2 * BS
    u = torch.randn(D, dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0]).repeat(S // 2).double()
    q = torch.zeros(B, H, S, D, dtype=torch.float32, device=DEVICE)
    v = (signs[:, None] * u).float().expand(B, H, S, D).contiguous().to(DEVICE)
    k = (signs[:, None] * 0.75).expand(S, D).float().expand(B, H, S, D).contiguous().to(DEVICE)
    do = u.float().expand(B, H, S, D).contiguous().to(DEVICE)
    idx = torch.tensor([[[[1], [0]]]], dtype=torch.int32, device=DEVICE)  # one block a row
    cnt = torch.ones(1, 1, 2, dtype=torch.int32, device=DEVICE)
    fix, delta, _, lse = _multipliers(q, k, v, do, idx, cnt, None, D**-0.5)
    partials = _block_partials(q, k, v, do, idx, cnt, None, D**-0.5, delta, lse)
    _check_fixed_point(partials, fix)
    reached = (partials.abs() * fix.double()[None, ..., None]).amax()
    assert 2**28 * 0.999 <= reached < 2**29, reached


def test_kv_bounds_leave_out_padding_and_flag_non_finite_inputs():
    """Padding rows (any finite value) do not count; a NaN in one head's k or an infinity in
    its v makes that head's bounds infinite, so its rows' multipliers are NaN (dq NaN, not a
    silent 0), and only that head's."""
    B, H, S = 2, 3, 4 * BS
    k, v = make_qkv(B, H, S, S, D, dtype=torch.float32, device=DEVICE)[1:]
    sizes = torch.tensor([BS, 5, 1, BS], dtype=torch.int32, device=DEVICE)
    real = (torch.arange(S, device=DEVICE) % BS) < sizes.long().repeat_interleave(BS)
    k_pad, v_pad = k.clone(), v.clone()
    k_pad[:, :, ~real], v_pad[:, :, ~real] = -1e30, 1e30
    bounds = bwd.kv_bounds(k_pad, v_pad, sizes, BS).view(B, H, 2)
    assert torch.equal(bounds[..., 0], k[:, :, real].abs().amax(dim=(2, 3)))
    norms = v[:, :, real].double().norm(dim=-1).amax(dim=-1)
    torch.testing.assert_close(bounds[..., 1].double(), norms, rtol=1e-6, atol=0)
    k_pad[1, 2, 7, 3] = float("nan")
    v_pad[0, 1, 20, 0] = float("inf")
    flagged = bwd.kv_bounds(k_pad, v_pad, sizes, BS).view(B, H, 2)
    assert flagged[1, 2, 0] == float("inf") and flagged[0, 1, 1] == float("inf")
    unflagged = torch.ones(B, H, dtype=torch.bool)
    unflagged[1, 2] = unflagged[0, 1] = False
    assert torch.equal(flagged[unflagged], bounds[unflagged])
    q = torch.randn(B, H, S, D, device=DEVICE)
    idx, cnt = make_lists(1, H, S // BS, S // BS, density=0.5, device=DEVICE)
    fix = _multipliers(q, k_pad, v_pad, torch.randn_like(q), idx, cnt, sizes, D**-0.5)[0]
    assert torch.isnan(fix[1, 2]).all() and torch.isnan(fix[0, 1]).all()
    assert torch.isfinite(fix[unflagged]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dq_from_fixed_point_divides_each_row_exactly(dtype, exact_bf16_interpreter):
    """dq = sums / multiplier row by row, rounded once to dq's dtype as fp32 then dtype would
    round it (the division by a power of two is exact); a NaN multiplier gives a NaN row."""
    torch.manual_seed(3)
    B, H, S = 1, 2, 40  # rows not a multiple of the conversion's block
    acc = torch.randint(-(2**30), 2**30, (B, H, S, D), dtype=torch.int32, device=DEVICE)
    e = torch.randint(-99, 127, (B, H, S), device=DEVICE)
    fix = torch.ldexp(torch.ones(B, H, S, device=DEVICE), e.float())
    fix[0, 1, 5] = float("nan")
    dq = bwd_sm90.dq_from_fixed_point(acc, fix, dtype)
    expected = (acc.float() * torch.ldexp(torch.ones_like(fix), -e.float())[..., None]).to(dtype)
    finite = torch.ones(B, H, S, dtype=torch.bool, device=DEVICE)
    finite[0, 1, 5] = False
    assert torch.equal(dq[finite], expected[finite])
    assert torch.isnan(dq[0, 1, 5]).all()
