"""Sliding-tile attention (STA): torch backend, Triton in the interpreter (CPU CI) and Triton on
the GPU, all against the brute-force token-level reference ``sliding_tile_attn_ref``."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import vidsparse
from helpers import BACKENDS, BAD_TENSOR_CASES, forbid_calls
from vidsparse.layout import VideoGrid
from vidsparse.ops import sliding_tile_attn as sta_module
from vidsparse.ops.sliding_tile_attn import (
    sliding_tile_attn,
    sliding_tile_attn_ref,
    sliding_tile_token_mask,
)
from vidsparse.testing import assert_error_relative, assert_rel_l2


def _qkv(grid, heads, *, tiled, dtype, B=1, D=16, scale=1.0, device="cpu"):
    """Fresh random q, k, v; in tile order their padding slots are zero, as grid.tile makes."""
    xs = [torch.randn(B, heads, grid.num_tokens, D, device=device) * scale for _ in range(3)]
    if tiled:
        xs = [grid.tile(x, dim=-2) for x in xs]
    return [x.to(dtype) for x in xs]


def _lowprec_baseline(q, k, v, grid, window, *, tiled):
    """PyTorch computing the same masked attention in q's own dtype: the yardstick of the
    error-relative checks."""
    qn, kn, vn = (grid.untile(x, dim=-2) if tiled else x for x in (q, k, v))
    mask = sliding_tile_token_mask(grid, window, q.device)
    s = (qn @ kn.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, S, S] in q's dtype
    p = torch.softmax(s.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q.dtype)
    o = p @ vn
    return grid.tile(o, dim=-2) if tiled else o


def _check_against_reference(grid, window, *, tiled, dtype, B=1, H=2, D=16, atol):
    """Error-relative check of o, dq, dk, dv against the fp64 reference, PyTorch's own
    low-precision computation of the same attention as the yardstick."""
    q, k, v = (x.requires_grad_(True) for x in _qkv(grid, H, tiled=tiled, dtype=dtype, B=B, D=D))
    o = sliding_tile_attn(q, k, v, grid, window, tiled=tiled)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = sliding_tile_attn_ref(q64, k64, v64, grid, window, tiled=tiled)
    low = _lowprec_baseline(q, k, v, grid, window, tiled=tiled)
    assert o.shape == q.shape and o.dtype == dtype
    assert_error_relative("o", o, ref, low, atol=atol)
    if tiled:
        assert (o[:, :, ~grid.real_token_mask(o.device)] == 0).all(), "padding rows are zero"
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    low_grads = torch.autograd.grad(low, (q, k, v), do)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_error_relative(name, g, r, lo, atol=atol)


# ----------------------------------------------------------------------------- reference


def test_reference_token_mask_brute_force():
    """The reference's token mask against a loop over token pairs in plain Python."""
    grid = VideoGrid((5, 6, 9), tile=(2, 2, 4))  # tiles 3 x 3 x 3, partial in t and w
    window = (1, 3, 1)
    mask = sliding_tile_token_mask(grid, window)
    coords = list(itertools.product(*(range(n) for n in grid.shape)))
    for i, q in enumerate(coords):
        q_tiles = [x // t for x, t in zip(q, grid.tile_shape)]
        starts = [min(max(c - w // 2, 0), n - w) for c, n, w in zip(q_tiles, grid.tiles, window)]
        for j, key in enumerate(coords):
            k_tiles = [x // t for x, t in zip(key, grid.tile_shape)]
            inside = all(s <= c < s + w for s, c, w in zip(starts, k_tiles, window))
            assert bool(mask[i, j]) == inside, (q, key)


# ----------------------------------------------------------------------------- torch backend

# shape, tile, window, tiled
TORCH_CASES = [
    ((8, 8, 12), (4, 4, 4), (1, 1, 3), False),  # whole tiles, window = grid: dense
    ((8, 8, 12), (4, 4, 4), (1, 1, 1), True),  # whole tiles, own tile only
    ((5, 13, 18), (2, 4, 4), (3, 1, 3), False),  # partial tiles everywhere, non-cubic window
    ((5, 13, 18), (2, 4, 4), (1, 3, 3), True),  # the same grid in tile order
    ((7, 9, 11), (1, 3, 5), (5, 1, 3), False),  # volume 15: the torch path takes any tile
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=str)
def test_torch_backend_matches_reference(torch_backend, case):
    shape, tile, window, tiled = case
    grid = VideoGrid(shape, tile)
    q, k, v = _qkv(grid, 3, tiled=tiled, dtype=torch.float64, B=2)
    o = sliding_tile_attn(q, k, v, grid, window, tiled=tiled, scale=0.3)
    ref = sliding_tile_attn_ref(q, k, v, grid, window, tiled=tiled, scale=0.3)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", TORCH_CASES[2:4], ids=str)
def test_torch_backend_gradients(torch_backend, case):
    shape, tile, window, tiled = case
    grid = VideoGrid(shape, tile)
    q, k, v = (x.requires_grad_(True) for x in _qkv(grid, 2, tiled=tiled, dtype=torch.float64))
    o = sliding_tile_attn(q, k, v, grid, window, tiled=tiled)
    ref = sliding_tile_attn_ref(q, k, v, grid, window, tiled=tiled)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("tile, window", [((5, 13, 18), (1, 1, 1)), ((5, 13, 6), (1, 1, 3))])
def test_window_covering_the_grid_equals_sdpa(torch_backend, tile, window):
    grid = VideoGrid((5, 13, 18), tile)  # one tile, or 1 x 1 x 3 tiles: the window is dense
    q, k, v = _qkv(grid, 2, tiled=False, dtype=torch.float64)
    o = sliding_tile_attn(q, k, v, grid, window)
    assert_rel_l2("o", o, F.scaled_dot_product_attention(q, k, v), 1e-12)


def test_public_export_and_default_window(torch_backend):
    assert vidsparse.sliding_tile_attn is sliding_tile_attn
    grid = VideoGrid((12, 12, 12), (4, 4, 4))  # tiles 3 x 3 x 3: the default 3x3x3 is dense
    q, k, v = _qkv(grid, 1, tiled=False, dtype=torch.float64)
    dense = F.scaled_dot_product_attention(q, k, v)
    assert_rel_l2("o", sliding_tile_attn(q, k, v, grid), dense, 1e-12)


def test_lists_are_cached_and_broadcast_over_batch_and_heads(torch_backend, monkeypatch):
    grid = VideoGrid((5, 13, 18), (2, 4, 4))
    seen = []
    engine = sta_module.block_sparse_attn_unchecked

    def spy(q, k, v, kv_indices, kv_counts, **kw):
        seen.append((kv_indices, kv_counts, kw))
        return engine(q, k, v, kv_indices, kv_counts, **kw)

    monkeypatch.setattr(sta_module, "block_sparse_attn_unchecked", spy)
    sta_module.clear_sliding_tile_attn_cache()
    for _ in range(2):
        q, k, v = _qkv(grid, 4, tiled=False, dtype=torch.float32, B=2)
        sliding_tile_attn(q, k, v, grid, (3, 1, 3))
    (i1, c1, kw), (i2, c2, _) = seen
    assert i1 is i2 and c1 is c2, "the second call reuses the cached lists"
    assert tuple(i1.shape) == (1, 4, grid.num_tiles, 9) and i1.stride(1) == 0
    assert tuple(c1.shape) == (1, 4, grid.num_tiles) and c1.stride(1) == 0
    assert kw["block_q"] == kw["block_kv"] == grid.tile_volume and kw["padding_finite"]
    assert kw["kv_block_sizes"].tolist() == grid.tile_sizes.tolist()
    assert sta_module._plan.cache_info().hits == 1
    seen.clear()
    full = VideoGrid((8, 8, 12), (4, 4, 4))
    q, k, v = _qkv(full, 1, tiled=False, dtype=torch.float32)
    sliding_tile_attn(q, k, v, full, (1, 1, 1))
    assert seen[0][2]["kv_block_sizes"] is None, "whole tiles: the unmasked engine kernel"


# ----------------------------------------------------------------------------- bad input


def _good_call():
    grid = VideoGrid((5, 13, 18), (2, 4, 4))  # tiles 3 x 4 x 5
    q, k, v = _qkv(grid, 2, tiled=False, dtype=torch.float32)
    return dict(q=q, k=k, v=v, grid=grid, window=(3, 3, 3))


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (dict(window=(0, 3, 3)), ValueError, "window along t must be odd and > 0"),
        (dict(window=(3, -3, 3)), ValueError, "window along h must be odd and > 0"),
        (dict(window=(3, 2, 3)), ValueError, "window along h must be odd"),
        (dict(window=(3, 3, 2.0)), TypeError, "window along w must be an int"),
        (dict(window=(3, 3)), TypeError, "window must be 3"),
        (dict(window=3), TypeError, "window must be 3"),
        (dict(window=(5, 3, 3)), ValueError, "window along t is 5 tiles but the grid has 3"),
        (dict(window=(3, 3, 7)), ValueError, "window along w is 7 tiles but the grid has 5"),
        (dict(grid=(5, 13, 18)), TypeError, "grid"),
        (dict(tiled=1), TypeError, "tiled"),
        (dict(tiled=True), ValueError, "padded_len"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(scale="x"), TypeError, "scale"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_fail_before_any_launch(request, monkeypatch, backend, change, exc, words):
    request.getfixturevalue(backend)
    forbid_calls(monkeypatch, sta_module, "block_sparse_attn_unchecked")
    with pytest.raises(exc, match=words):
        sliding_tile_attn(**{**_good_call(), **change})


@pytest.mark.parametrize("name, bad, exc, words", BAD_TENSOR_CASES)
def test_bad_tensors(torch_backend, name, bad, exc, words):
    args = _good_call()
    args[name] = bad(args[name])
    with pytest.raises(exc, match=words):
        sliding_tile_attn(**args)


def test_triton_path_rejects_unsupported_tiles_and_head_dims(triton_backend):
    grid = VideoGrid((7, 9, 11), tile=(1, 3, 5))  # volume 15
    q, k, v = _qkv(grid, 1, tiled=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="power-of-two tile volume"):
        sliding_tile_attn(q, k, v, grid, (1, 1, 1))
    grid = VideoGrid((8, 8, 12), (4, 4, 4))
    q, k, v = _qkv(grid, 1, tiled=False, dtype=torch.float32, D=24)
    with pytest.raises(ValueError, match="head_dim 24"):
        sliding_tile_attn(q, k, v, grid, (1, 1, 1))


# ----------------------------------------------------------------------------- interpreter

# dtype, shape, tile, window, tiled (S <= ~1000 tokens: the interpreter is slow)
INTERPRETER_CASES = [
    (torch.float32, (8, 8, 12), (4, 4, 4), (1, 1, 1), False),  # whole tiles: unmasked kernel
    (torch.float16, (8, 8, 12), (4, 4, 4), (1, 1, 3), True),
    (torch.float32, (5, 13, 10), (2, 4, 4), (3, 3, 1), True),  # partial tiles, clamped windows
    (torch.float16, (5, 13, 14), (2, 4, 4), (1, 3, 3), False),
]


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=str)
def test_triton_interpreter_matches_reference(triton_backend, case):
    dtype, shape, tile, window, tiled = case
    atol = 1e-4 if dtype == torch.float32 else 2e-3
    _check_against_reference(VideoGrid(shape, tile), window, tiled=tiled, dtype=dtype, atol=atol)


# ----------------------------------------------------------------------------- GPU

WAN_480P = (21, 30, 52)  # tiles 6 x 8 x 13 at 4x4x4, partial along every axis


def _masked_sdpa_with_grads(q, k, v, mask, do):
    """SDPA's output and (dq, dk, dv) under a [S, S] bool mask, one head at a time.

    Each head's graph is freed before the next is built: SDPA turns the bool mask into a bias
    of its own per call (4 GiB in fp32 at S = 32760), and twelve heads' graphs held at once
    did not fit beside the GPU suite's other processes on an 80 GB card.
    """
    outs, grads = [], []
    for h in range(q.shape[1]):
        qh, kh, vh = (x[:, h : h + 1].detach().requires_grad_(True) for x in (q, k, v))
        oh = F.scaled_dot_product_attention(qh, kh, vh, mask)
        grads.append(torch.autograd.grad(oh, (qh, kh, vh), do[:, h : h + 1]))
        outs.append(oh.detach())
    return torch.cat(outs, dim=1), [torch.cat(g, dim=1) for g in zip(*grads)]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(3, 3, 3), (1, 5, 7)], ids=str)
@pytest.mark.parametrize("tiled", [False, True])
def test_gpu_wan_480p_bf16_matches_fp32_reference(window, tiled):
    grid = VideoGrid(WAN_480P, (4, 4, 4))
    q, k, v = (
        x.requires_grad_(True)
        for x in _qkv(grid, 12, tiled=tiled, dtype=torch.bfloat16, D=128, device="cuda")
    )
    o = sliding_tile_attn(q, k, v, grid, window, tiled=tiled)
    mask = sliding_tile_token_mask(grid, window, "cuda")

    def natural(x):
        return grid.untile(x, dim=-2) if tiled else x

    o_nat = natural(o)
    do = torch.randn_like(o_nat)
    ref, ref_grads = _masked_sdpa_with_grads(  # fp32, natural order
        *(natural(x.detach()).float() for x in (q, k, v)), mask, do.float()
    )
    low, low_grads = _masked_sdpa_with_grads(  # bf16: the yardstick
        *(natural(x.detach()) for x in (q, k, v)), mask, do
    )
    assert_error_relative("o", o_nat, ref, low, atol=2e-3)
    if tiled:
        assert (o[:, :, ~grid.real_token_mask("cuda")] == 0).all(), "padding rows are zero"
    grads = [natural(g) for g in torch.autograd.grad(o_nat, (q, k, v), do)]
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_error_relative(name, g, r, lo, atol=2e-3)


@pytest.mark.gpu
def test_gpu_padding_gets_no_weight_and_calls_are_bit_identical():
    grid = VideoGrid(WAN_480P, (4, 4, 4))
    q, k, v = _qkv(grid, 12, tiled=True, dtype=torch.bfloat16, D=128, device="cuda")
    o_zero = sliding_tile_attn(q, k, v, grid, (3, 3, 3), tiled=True)
    pad = ~grid.real_token_mask("cuda")
    for x in (k, v):
        x[:, :, pad] = 3e4  # a tiled input's padding may hold any finite value (documented)
    o1 = sliding_tile_attn(q, k, v, grid, (3, 3, 3), tiled=True)
    o2 = sliding_tile_attn(q, k, v, grid, (3, 3, 3), tiled=True)
    assert torch.equal(o1, o_zero), "finite padding values leaked into the output"
    assert torch.equal(o1, o2), "not bit-identical across calls"
