"""The VSA reference against brute-force dense computations built token by token."""

import math

import pytest
import torch
import torch.nn.functional as F

import vidsparse.ops.video_sparse_attn.reference as vsa_ref
from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.video_sparse_attn.reference import (
    coarse_attention,
    fine_attention,
    select_topk,
    tile_means,
    tile_means_bwd,
    tile_means_of_sizes,
    video_sparse_attn_ref,
)
from vidsparse.ops.video_sparse_attn.topk import resolve_topk
from vidsparse.testing import assert_no_nan, assert_rel_l2

FP64_BOUND = 1e-12  # relative L2, fp64 against fp64 brute force
FP32_BOUND = 1e-5  # relative L2, fp32 against fp64 brute force


def _qkv(grid, B=2, H=2, D=16, dtype=torch.float64, scale=1.0, requires_grad=False):
    shape = (B, H, grid.num_tokens, D)
    return [
        (torch.randn(shape, dtype=dtype) * scale).requires_grad_(requires_grad) for _ in range(3)
    ]


# ---- brute force, in natural order -------------------------------------------------------------


def _token_tile_ids(grid):
    """Tile index of each natural token, from the (t, h, w) coordinates."""
    T, H, W = grid.shape
    tT, tH, tW = grid.tile_shape
    _, Nh, Nw = grid.tiles
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    return (((t // tT) * Nh + h // tH) * Nw + w // tW).reshape(-1)  # [S]


def _pooling_matrix(grid, dtype=torch.float64):
    """``[Nt, S]`` with ``1 / tile_size`` where token s is in tile i: ``P @ x`` = tile means."""
    ids = _token_tile_ids(grid)
    member = (ids.view(1, -1) == torch.arange(grid.num_tiles).view(-1, 1)).to(dtype)
    return member / member.sum(dim=1, keepdim=True)


def _masked_dense_attention(q, k, v, mask, scale):
    """softmax(q k^T * scale, masked) v with an explicit ``[.., Sq, Sk]`` bool mask."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _brute_force_coarse(q, k, v, grid, scale):
    """Mean-pooled attention; returns per-tile output, scores, and per-token broadcast."""
    pool = _pooling_matrix(grid, q.dtype)  # [Nt, S]
    qc, kc, vc = pool @ q, pool @ k, pool @ v  # [B, H, Nt, D]
    scores = qc @ kc.transpose(-1, -2) * scale
    oc = torch.softmax(scores, dim=-1) @ vc
    return oc, scores, oc[:, :, _token_tile_ids(grid)]  # ..., [B, H, S, D]


def _token_mask_from_tiles(kv_indices, grid):
    """Token-level ``[B, H, S, S]`` mask: query token attends key token iff key's tile is listed
    for the query's tile."""
    B, H, Nt, _ = kv_indices.shape
    selected = torch.zeros(B, H, Nt, Nt, dtype=torch.bool)
    selected.scatter_(-1, kv_indices.long(), True)
    ids = _token_tile_ids(grid)
    return selected[:, :, ids][:, :, :, ids]


def _brute_force_vsa(q, k, v, gate, kv_indices, grid, scale):
    """VSA with a given (fixed) selection, all dense and token level; differentiable."""
    mask = _token_mask_from_tiles(kv_indices, grid)
    o_fine = _masked_dense_attention(q, k, v, mask, scale)
    _, _, o_coarse = _brute_force_coarse(q, k, v, grid, scale)
    return o_fine + (o_coarse if gate is None else gate * o_coarse)


# ---- topk / sparsity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_tiles, sparsity, expected",
    [
        (624, 0.875, 78),
        (624, 0.9, 63),
        (1440, 0.875, 180),
        (1440, 0.9, 144),
        (10, 0.7, 3),  # (1 - 0.7) * 10 = 3.0000000000000004 in floats: still 3
        (10, 0.3, 7),
        (10, 0.0, 10),
        (10, 1.0, 1),
        (10, 0.99, 1),
        (10, 0.05, 10),
        (8, 0.5, 4),
        (7, 0.5, 4),
    ],
)
def test_sparsity_to_topk(num_tiles, sparsity, expected):
    assert resolve_topk(num_tiles, sparsity=sparsity) == expected


def test_topk_is_clamped_and_validated():
    assert resolve_topk(8, topk=3) == 3
    assert resolve_topk(8, topk=100) == 8
    with pytest.raises(ValueError, match="exactly one"):
        resolve_topk(8)
    with pytest.raises(ValueError, match="exactly one"):
        resolve_topk(8, topk=2, sparsity=0.5)
    with pytest.raises(ValueError, match="topk"):
        resolve_topk(8, topk=0)
    with pytest.raises(TypeError, match="topk"):
        resolve_topk(8, topk=2.0)
    with pytest.raises(ValueError, match="sparsity"):
        resolve_topk(8, sparsity=1.5)
    with pytest.raises(TypeError, match="sparsity"):
        resolve_topk(8, sparsity="0.5")


def test_sparsity_and_topk_give_the_same_output():
    grid = VideoGrid((5, 6, 7), tile=(2, 4, 4))  # 3 x 2 x 2 = 12 tiles
    q, k, v = _qkv(grid)
    o_topk, parts = video_sparse_attn_ref(q, k, v, grid, topk=3, return_parts=True)
    o_sparsity = video_sparse_attn_ref(q, k, v, grid, sparsity=0.75)
    assert parts["topk"] == 3 and parts["kv_indices"].shape[-1] == 3
    assert torch.equal(o_topk, o_sparsity)


# ---- dense equivalence -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, tile, heads",
    [((5, 6, 7), (4, 4, 4), 2), ((9, 10, 13), (4, 4, 4), 1), ((3, 9, 20), (2, 8, 8), 1)],
)
@pytest.mark.parametrize("dtype, bound", [(torch.float64, FP64_BOUND), (torch.float32, FP32_BOUND)])
def test_all_tiles_without_gate_is_dense_attention(shape, tile, heads, dtype, bound):
    grid = VideoGrid(shape, tile=tile)
    q, k, v = _qkv(grid, B=heads, H=heads, dtype=dtype)
    gate = torch.zeros_like(q)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double())

    o = video_sparse_attn_ref(q, k, v, grid, topk=grid.num_tiles, gate=gate)
    assert o.dtype == dtype and o.shape == q.shape
    assert_rel_l2("natural", o, expected, bound)

    tiled = [grid.tile(x) for x in (q, k, v, gate)]
    o_tiled = video_sparse_attn_ref(
        *tiled[:3], grid, topk=grid.num_tiles, gate=tiled[3], tiled=True
    )
    assert o_tiled.shape == (q.shape[0], q.shape[1], grid.padded_len, q.shape[3])
    assert_rel_l2("tiled", o_tiled, grid.tile(expected).to(dtype), bound)
    assert (o_tiled[:, :, ~grid.real_token_mask()] == 0).all()


def test_sparsity_zero_is_dense_plus_coarse():
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    q, k, v = _qkv(grid)
    o = video_sparse_attn_ref(q, k, v, grid, sparsity=0.0)
    _, _, o_coarse = _brute_force_coarse(q, k, v, grid, q.shape[-1] ** -0.5)
    assert_rel_l2("o", o, F.scaled_dot_product_attention(q, k, v) + o_coarse, FP64_BOUND)


def test_tiled_input_ignores_padding_contents():
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    q, k, v = (grid.tile(x) for x in _qkv(grid))
    gate = grid.tile(torch.rand(2, 2, grid.num_tokens, 16, dtype=torch.float64))
    padding = ~grid.real_token_mask().view(1, 1, -1, 1)
    clean = video_sparse_attn_ref(q, k, v, grid, topk=3, gate=gate, tiled=True)
    junk = [x.masked_fill(padding, 5.0) for x in (q, k, v, gate)]
    dirty = video_sparse_attn_ref(*junk[:3], grid, topk=3, gate=junk[3], tiled=True)
    assert torch.equal(clean, dirty)
    assert (dirty.masked_select(padding) == 0).all()


# ---- the stages --------------------------------------------------------------------------------


def test_tile_means_divide_by_real_tokens():
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    x = torch.randn(2, 3, grid.num_tokens, 4, dtype=torch.float64)
    means = tile_means(grid.tile(x), grid)
    assert means.shape == (2, 3, grid.num_tiles, 4)
    assert_rel_l2("means", means, _pooling_matrix(grid) @ x, FP64_BOUND)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_coarse_stage_matches_mean_pooled_attention(scale):
    grid = VideoGrid((5, 6, 7), tile=(2, 4, 4))
    q, k, v = _qkv(grid)
    _, parts = video_sparse_attn_ref(q, k, v, grid, topk=4, scale=scale, return_parts=True)
    used_scale = q.shape[-1] ** -0.5 if scale is None else scale
    oc, scores, oc_tokens = _brute_force_coarse(q, k, v, grid, used_scale)
    assert_rel_l2("o_coarse_tiles", parts["o_coarse_tiles"], oc, FP64_BOUND)
    assert_rel_l2("coarse_scores", parts["coarse_scores"], scores, FP64_BOUND)
    assert_rel_l2("o_coarse", parts["o_coarse"], oc_tokens, FP64_BOUND)


def test_coarse_attention_function():
    qc, kc, vc = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    oc, scores = coarse_attention(qc, kc, vc, 0.5)
    assert_rel_l2("scores", scores, qc @ kc.transpose(-1, -2) * 0.5, FP64_BOUND)
    assert_rel_l2("oc", oc, F.scaled_dot_product_attention(qc, kc, vc, scale=0.5), FP64_BOUND)


def test_selection_is_the_topk_of_the_coarse_scores():
    grid = VideoGrid((5, 6, 7), tile=(2, 4, 4))
    q, k, v = _qkv(grid)
    topk = 5
    _, parts = video_sparse_attn_ref(q, k, v, grid, topk=topk, return_parts=True)
    kv_indices, kv_counts = parts["kv_indices"], parts["kv_counts"]
    B, H, Nt = 2, 2, grid.num_tiles
    assert kv_indices.dtype == torch.int32 and kv_indices.shape == (B, H, Nt, topk)
    assert kv_counts.dtype == torch.int32 and (kv_counts == topk).all()
    assert (kv_indices.diff(dim=-1) > 0).all(), "ascending and distinct within a row"

    _, scores, _ = _brute_force_coarse(q, k, v, grid, q.shape[-1] ** -0.5)
    chosen = torch.zeros(B, H, Nt, Nt, dtype=torch.bool).scatter_(-1, kv_indices.long(), True)
    lowest_chosen = scores.masked_fill(~chosen, math.inf).amin(dim=-1)
    highest_other = scores.masked_fill(chosen, -math.inf).amax(dim=-1)
    assert (lowest_chosen >= highest_other).all()


def test_select_topk_function():
    scores = torch.tensor([[[[0.1, 0.9, 0.5, 0.7], [3.0, 2.0, 1.0, 0.0]]]])
    kv_indices, kv_counts = select_topk(scores, 2)
    assert kv_indices.tolist() == [[[[1, 3], [0, 1]]]]
    assert kv_counts.tolist() == [[[2, 2]]]
    with pytest.raises(ValueError, match="topk"):
        select_topk(scores, 5)


def test_select_topk_breaks_ties_towards_the_smaller_tile_index():
    """The kernels' rule, so their lists match the reference exactly, ties included."""
    scores = torch.tensor([[[[1.0, 2.0, 1.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]]]])
    kv_indices, _ = select_topk(scores, 3)
    assert kv_indices.tolist() == [[[[0, 1, 3], [0, 1, 2]]]]


def test_tile_means_of_sizes_and_its_backward_match_autograd():
    grid = VideoGrid((5, 6, 7), tile=(2, 4, 4))
    x_t = grid.tile(torch.randn(2, 3, grid.num_tokens, 4, dtype=torch.float64))
    x_t[:, :, ~grid.real_token_mask()] = float("nan")  # padding slots are never read
    x_t.requires_grad_()
    means = tile_means_of_sizes(x_t, grid.tile_sizes)
    assert_rel_l2("means", means, tile_means(x_t, grid), FP64_BOUND)
    dmeans = torch.randn(1, *means.shape, dtype=torch.float64)
    (expected,) = torch.autograd.grad(means, x_t, dmeans[0])
    (got,) = tile_means_bwd(dmeans, grid.tile_sizes, grid.padded_len, torch.float64)
    assert_rel_l2("d x_t", got, expected, FP64_BOUND)
    assert (got[:, :, ~grid.real_token_mask()] == 0).all()


@pytest.mark.parametrize("tiled", [False, True])
def test_fine_stage_matches_masked_dense_attention(tiled):
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))  # 8 tiles, all partial but one
    q, k, v = _qkv(grid)
    inputs = [grid.tile(x) for x in (q, k, v)] if tiled else [q, k, v]
    o, parts = video_sparse_attn_ref(*inputs, grid, topk=3, tiled=tiled, return_parts=True)

    mask = _token_mask_from_tiles(parts["kv_indices"], grid)
    expected_fine = _masked_dense_attention(q, k, v, mask, q.shape[-1] ** -0.5)
    _, _, expected_coarse = _brute_force_coarse(q, k, v, grid, q.shape[-1] ** -0.5)
    to_layout = grid.tile if tiled else (lambda x: x)
    assert_rel_l2("o_fine", parts["o_fine"], to_layout(expected_fine), FP64_BOUND)
    assert_rel_l2("o", o, to_layout(expected_fine + expected_coarse), FP64_BOUND)


def test_fine_attention_rows_with_no_tiles_are_zero():
    grid = VideoGrid((2, 5, 6), tile=(2, 4, 4))  # 4 tiles of 32, 16, 8 and 4 tokens
    q, k, v = (grid.tile(x).requires_grad_() for x in _qkv(grid, B=1, H=2, D=8))
    # Entries past a row's count are never read: -1 sentinels must be harmless.
    kv_indices = torch.tensor([[0, 1], [-1, -1], [1, -1], [0, 3]], dtype=torch.int32)
    kv_indices = kv_indices.expand(1, 2, 4, 2)
    kv_counts = torch.tensor([[[2, 0, 1, 2], [0, 0, 0, 0]]], dtype=torch.int32)
    o = fine_attention(q, k, v, kv_indices, kv_counts, grid, 0.5)
    assert_no_nan("o", o)
    V = grid.tile_volume
    assert (o[0, 0, V : 2 * V] == 0).all() and (o[0, 1] == 0).all()

    # Row (head 0, tile 2) lists two tiles but may only read the first.
    mask = torch.zeros(grid.padded_len, grid.padded_len, dtype=torch.bool)
    mask[2 * V : 3 * V, V : 2 * V] = True
    mask &= grid.real_token_mask().view(1, -1)
    rows = slice(2 * V, 3 * V)
    expected = _masked_dense_attention(q[0, 0, rows], k[0, 0], v[0, 0], mask[rows], 0.5)
    assert_rel_l2("one-tile row", o[0, 0, rows], expected, FP64_BOUND)

    o.sum().backward()
    for x in (q, k, v):
        assert_no_nan("grad", x.grad)

    no_tiles = fine_attention(q, k, v, kv_indices[..., :0], kv_counts * 0, grid, 0.5)
    assert no_tiles.shape == q.shape and (no_tiles == 0).all()


# ---- gate --------------------------------------------------------------------------------------


def test_no_gate_equals_gate_of_ones():
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    q, k, v = _qkv(grid)
    without = video_sparse_attn_ref(q, k, v, grid, topk=2)
    with_ones = video_sparse_attn_ref(q, k, v, grid, topk=2, gate=torch.ones_like(q))
    assert_rel_l2("gate=None vs ones", without, with_ones, FP64_BOUND)


def test_gate_weights_the_coarse_output():
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    q, k, v = _qkv(grid)
    gate = torch.rand_like(q)
    o, parts = video_sparse_attn_ref(q, k, v, grid, topk=2, gate=gate, return_parts=True)
    assert_rel_l2("o", o, parts["o_fine"] + gate * parts["o_coarse"], FP64_BOUND)


# ---- gradients ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("input_scale", [1.0, 4.0])
def test_gradients_match_brute_force(tiled, input_scale):
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    q, k, v = _qkv(grid, D=8, scale=input_scale, requires_grad=True)
    gate = torch.rand_like(q).requires_grad_()
    weights = torch.randn_like(q)

    to_layout = grid.tile if tiled else (lambda x: x)
    o, parts = video_sparse_attn_ref(
        *(to_layout(x) for x in (q, k, v)), grid, topk=3, gate=to_layout(gate), tiled=tiled,
        return_parts=True,
    )  # fmt: skip
    (o * to_layout(weights)).sum().backward()
    ours = [x.grad.clone() for x in (q, k, v, gate)]
    for x in (q, k, v, gate):
        x.grad = None

    expected = _brute_force_vsa(q, k, v, gate, parts["kv_indices"], grid, q.shape[-1] ** -0.5)
    (expected * weights).sum().backward()
    for name, got, x in zip(["q", "k", "v", "gate"], ours, (q, k, v, gate)):
        assert_rel_l2(f"d{name}", got, x.grad, 1e-10)


def test_chunked_fine_stage_matches_one_chunk(monkeypatch):
    # One query tile per chunk, with recomputation in backward, against a single chunk.
    grid = VideoGrid((5, 6, 7), tile=(2, 4, 4))
    q, k, v = _qkv(grid, D=8, requires_grad=True)
    weights = torch.randn_like(q)

    def run():
        o = video_sparse_attn_ref(q, k, v, grid, topk=4)
        grads = torch.autograd.grad((o * weights).sum(), (q, k, v))
        return o.detach(), grads

    o_one, grads_one = run()
    monkeypatch.setattr(vsa_ref, "_FINE_CHUNK_ELEMENTS", 1)
    o_many, grads_many = run()
    assert_rel_l2("o", o_many, o_one, FP64_BOUND)
    for got, ref in zip(grads_many, grads_one):
        assert_rel_l2("grad", got, ref, FP64_BOUND)


# ---- dtypes and real grids ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_are_computed_in_fp32(dtype):
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    q, k, v = _qkv(grid, dtype=dtype)
    o = video_sparse_attn_ref(q, k, v, grid, topk=3)
    assert o.dtype == dtype
    expected = video_sparse_attn_ref(q.float(), k.float(), v.float(), grid, topk=3)
    assert torch.equal(o, expected.to(dtype))


def test_wan_480p_grid_checked_on_some_tiles():
    # The real Wan 2.1 480p grid (624 tiles, partial along H and T) with tiny heads, checked
    # against a dense computation restricted to a few query tiles.
    grid = VideoGrid((21, 30, 52), tile=(4, 4, 4))
    q, k, v = _qkv(grid, B=1, H=1, D=4, dtype=torch.float32)
    o, parts = video_sparse_attn_ref(q, k, v, grid, topk=6, tiled=False, return_parts=True)
    assert o.shape == q.shape
    assert_no_nan("o", o)

    q_t, k_t, v_t, o_t = (grid.tile(x)[0, 0].double() for x in (q, k, v, o))
    oc_tiles = parts["o_coarse_tiles"][0, 0].double()
    valid = grid.real_token_mask()
    V = grid.tile_volume
    for i in (0, 12, 311, grid.num_tiles - 1):  # first, edge-of-row, middle, last (partial)
        keys = torch.cat([torch.arange(j * V, (j + 1) * V) for j in parts["kv_indices"][0, 0, i]])
        keys = keys[valid[keys]]
        rows = torch.arange(i * V, (i + 1) * V)[valid[i * V : (i + 1) * V]]
        fine = F.scaled_dot_product_attention(q_t[rows], k_t[keys], v_t[keys], scale=0.5)
        assert_rel_l2(f"tile {i}", o_t[rows], fine + oc_tiles[i], FP32_BOUND)


# ---- argument errors ---------------------------------------------------------------------------


def test_shape_errors():
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    q, k, v = _qkv(grid, B=1, H=1, D=8)
    with pytest.raises(ValueError, match="num_tokens"):
        video_sparse_attn_ref(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], grid, topk=2)
    with pytest.raises(ValueError, match="padded_len"):
        video_sparse_attn_ref(q, k, v, grid, topk=2, tiled=True)
    with pytest.raises(ValueError, match="q must be a 4-D"):
        video_sparse_attn_ref(q[0], k[0], v[0], grid, topk=2)
    with pytest.raises(ValueError, match="k must"):
        video_sparse_attn_ref(q, k[..., :4], v, grid, topk=2)
    with pytest.raises(ValueError, match="gate"):
        video_sparse_attn_ref(q, k, v, grid, topk=2, gate=q[..., :1])
    with pytest.raises(ValueError, match="exactly one"):
        video_sparse_attn_ref(q, k, v, grid)
