"""VSA coarse stage (``ops/video_sparse_attn/coarse.py`` and ``kernels/``): tile-mean pooling,
coarse attention and top-k selection kernels against the PyTorch reference (``tile_means``,
``coarse_attention``, ``select_topk``), in the interpreter on CPU CI and compiled on a GPU; plus
a cross-target compile check (``cuda:90``, ``cuda:100``, ``hip:gfx942``) of the kernels,
spill-free.

Run as a script it prints the compile reports (one JSON line per kernel)::

    PYTHONPATH=src python tests/ops/video_sparse_attn/test_vsa_coarse.py \
        --targets cuda:90,hip:gfx942
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.video_sparse_attn.coarse import (
    coarse_attn_topk_fwd,
    tile_mean_pool_fwd,
    vsa_coarse_stage,
)
from vidsparse.ops.video_sparse_attn.configs import CoarseAttnConfig
from vidsparse.ops.video_sparse_attn.reference import coarse_attention, select_topk, tile_means
from vidsparse.testing import assert_error_relative, assert_rel_l2

ROOT = Path(__file__).resolve().parents[3]
ON_CPU = not torch.cuda.is_available()
interpreter = pytest.mark.skipif(not ON_CPU, reason="interpreter tests run on CPU CI")

# (shape, tile): 2x2x2 = 8 tiles; 3x3x4 = 36 tiles; 3x2x2 = 12 tiles of 32 slots. All partial.
GRIDS = {
    "8_tiles": VideoGrid((5, 6, 7), (4, 4, 4)),
    "36_tiles": VideoGrid((9, 10, 13), (4, 4, 4)),
    "12_tiles_of_32": VideoGrid((5, 6, 7), (2, 4, 4)),
}


def _config(block_m=16, block_n=32, num_pivots=8, bracket_capacity=32, precision="ieee"):
    return CoarseAttnConfig(block_m=block_m, block_n=block_n, num_pivots=num_pivots,
                            bracket_capacity=bracket_capacity, input_precision=precision,
                            num_warps=4, num_stages=1)  # fmt: skip


# Interpreter configs that exercise each selection path: narrowing with few pivots and a tiny
# scratch (many passes), the default, and a scratch larger than the row (settled at once).
SELECTION_CONFIGS = {
    "2_pivots_capacity_2": _config(num_pivots=2, bracket_capacity=2),
    "4_pivots_capacity_8": _config(num_pivots=4, bracket_capacity=8, block_n=16),
    "default": _config(),
    "capacity_64": _config(bracket_capacity=64),
}


def test_hopper_selection_config_follows_the_grid_size():
    # 4 pivots a pass up to SMALL_GRID_TILES tiles (measured faster at 480p), 8 above (720p).
    from vidsparse.ops.video_sparse_attn.configs import SMALL_GRID_TILES, coarse_attn_config
    from vidsparse.utils.device import Target

    hopper = Target("cuda", 90)
    small = coarse_attn_config(hopper, 128, 624)
    big = coarse_attn_config(hopper, 128, 1440)
    assert small.num_pivots == 4 and big.num_pivots == 8
    assert coarse_attn_config(hopper, 128, SMALL_GRID_TILES).num_pivots == 4
    assert coarse_attn_config(hopper, 128, SMALL_GRID_TILES + 1).num_pivots == 8
    # targets without a small-grid entry keep their one config at every size
    generic = Target("cuda", 80)
    assert coarse_attn_config(generic, 128, 624) == coarse_attn_config(generic, 128, 1440)


def _tiled_qkv(grid, B, H, D, dtype, device, scale=1.0, garbage=float("nan")):
    """q, k, v in tile order with ``garbage`` in every padding slot (it must be ignored)."""
    pad = ~grid.real_token_mask(device)  # [P]
    out = []
    for _ in range(3):
        x = torch.randn(B, H, grid.num_tokens, D, device=device) * scale
        x_t = grid.tile(x.to(dtype), dim=-2).clone()
        x_t[:, :, pad] = garbage
        out.append(x_t)
    return out


def _reference(q_t, k_t, v_t, grid, topk, scale, dtype=torch.float32):
    """The reference coarse stage on the same (upcast) inputs; padding is masked inside."""
    qc, kc, vc = (tile_means(x.to(dtype), grid) for x in (q_t, k_t, v_t))
    oc, scores = coarse_attention(qc, kc, vc, scale)
    kv_indices, kv_counts = select_topk(scores, topk)
    return (qc, kc, vc), oc, scores, kv_indices, kv_counts


# ----------------------------------------------------------------------------- interpreter


@pytest.mark.slow
@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize(
    "grid_name, D, dtype",
    [("8_tiles", 16, torch.float32), ("36_tiles", 32, torch.float16),
     ("12_tiles_of_32", 16, torch.float16), ("36_tiles", 16, torch.float32)],
)  # fmt: skip
def test_pooling_ignores_padding_and_matches_tile_means(grid_name, D, dtype):
    grid = GRIDS[grid_name]
    q_t, k_t, v_t = _tiled_qkv(grid, 2, 2, D, dtype, "cpu")  # NaN in every padding slot
    pooled = tile_mean_pool_fwd(q_t, k_t, v_t, grid.tile_sizes)
    assert pooled.dtype == torch.float32 and pooled.shape == (3, 2, 2, grid.num_tiles, D)
    for name, got, x_t in zip("qkv", pooled, (q_t, k_t, v_t)):
        ref = tile_means(x_t.double(), grid)
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6, msg=f"{name}c")


def _natural_qkv(grid, B, H, D, dtype, device):
    """q, k, v in natural order as diffusers' processors pass them: ``[B, S, H, D]`` storage
    seen as ``[B, H, S, D]``."""
    return [torch.randn(B, grid.num_tokens, H, D, device=device).to(dtype).transpose(1, 2)
            for _ in range(3)]  # fmt: skip


def _tiled_by_index(x, grid):
    """``grid.tile`` by the grid's gather index (the PyTorch path, not the kernels')."""
    index = grid.index_tensors(x.device)
    tiled = x.index_select(2, index.gather_index)
    return tiled.masked_fill(~index.valid.view(1, 1, -1, 1), 0)


@pytest.mark.slow
@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("tiles_per_program", [1, 2])
@pytest.mark.parametrize(
    "grid_name, D, dtype",
    [("8_tiles", 16, torch.float32), ("36_tiles", 32, torch.float16),
     ("12_tiles_of_32", 16, torch.bfloat16)],
)  # fmt: skip
def test_tile_pool_copies_are_the_tiling_and_means_the_tile_means(grid_name, D, dtype,
                                                                   tiles_per_program):  # fmt: skip
    from vidsparse.ops.video_sparse_attn.coarse import tile_pool_fwd
    from vidsparse.ops.video_sparse_attn.configs import PoolConfig

    grid = GRIDS[grid_name]
    xs = _natural_qkv(grid, 2, 3, D, dtype, "cpu")
    config = PoolConfig(tiles_per_program=tiles_per_program)
    *copies, pooled = tile_pool_fwd(*xs, grid.shape, grid.tile_shape, config)
    assert pooled.dtype == torch.float32 and pooled.shape == (3, 2, 3, grid.num_tiles, D)
    for name, copy, x, got in zip("qkv", copies, xs, pooled):
        assert copy.is_contiguous() and torch.equal(copy, _tiled_by_index(x, grid)), name
        ref = tile_means(_tiled_by_index(x, grid).double(), grid)
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6, msg=f"{name}c")


@pytest.mark.slow
@interpreter
@pytest.mark.interpreter
def test_coarse_stage_natural_equals_the_stage_on_tiled_copies(triton_backend):
    from vidsparse.ops.video_sparse_attn.coarse import vsa_coarse_stage_natural

    grid = GRIDS["36_tiles"]
    xs = _natural_qkv(grid, 1, 2, 16, torch.float32, "cpu")
    q_t, k_t, v_t, *stage = vsa_coarse_stage_natural(*xs, grid, 5, 0.25)
    copies = [_tiled_by_index(x, grid) for x in xs]
    for name, a, b in zip("qkv", (q_t, k_t, v_t), copies):
        assert torch.equal(a, b), name
    ref = vsa_coarse_stage(*copies, grid, 5, 0.25, return_pooled=True)
    for name, a, b in zip(("oc", "kv_indices", "kv_counts", "pooled"), stage, ref):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="needing no gradient"):
        vsa_coarse_stage_natural(xs[0].requires_grad_(), *xs[1:], grid, 5, 0.25)


@pytest.mark.slow
@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize(
    "grid_name, D, dtype, topks",
    [("8_tiles", 16, torch.float32, (1, 3, 8)), ("36_tiles", 32, torch.float16, (1, 5, 35, 36)),
     ("12_tiles_of_32", 32, torch.float32, (2, 11))],
)  # fmt: skip
def test_coarse_attention_and_selection_match_reference(grid_name, D, dtype, topks):
    grid = GRIDS[grid_name]
    batch = 1 if grid.num_tiles > 16 else 2  # interpreter time grows with programs
    q_t, k_t, v_t = _tiled_qkv(grid, batch, 2, D, dtype, "cpu", scale=2.0)
    scale = D**-0.5
    (qc, kc, vc), ref_oc, scores, _, _ = _reference(q_t, k_t, v_t, grid, 1, scale)
    pooled = tile_mean_pool_fwd(q_t, k_t, v_t, grid.tile_sizes)
    for topk in topks:
        oc, kv_indices, kv_counts = coarse_attn_topk_fwd(*pooled, topk, scale)
        torch.testing.assert_close(oc, ref_oc, rtol=1e-5, atol=1e-6)
        ref_indices, ref_counts = select_topk(scores, topk)  # random scores: no ties
        assert torch.equal(kv_indices, ref_indices), f"topk={topk}"
        assert torch.equal(kv_counts, ref_counts)


@pytest.mark.slow
@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("config_name", SELECTION_CONFIGS)
def test_every_selection_path_matches_select_topk(config_name):
    """Few pivots and a tiny scratch force many narrowing passes; a large scratch settles rows
    at once; the result is the same exact top-k."""
    cfg = SELECTION_CONFIGS[config_name]
    B, H, Nt, D = 1, 2, 40, 16  # 40 tiles: not a multiple of any block
    qc, kc, vc = (torch.randn(B, H, Nt, D) * s for s in (3.0, 1.0, 1.0))
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * D**-0.5
    for topk in (1, 6, 20, 39):
        _, kv_indices, kv_counts, passes = coarse_attn_topk_fwd(
            qc, kc, vc, topk, D**-0.5, config=cfg, record_passes=True
        )
        ref_indices, _ = select_topk(scores, topk)
        assert torch.equal(kv_indices, ref_indices), f"{config_name}, topk={topk}"
        assert (kv_counts == topk).all()
        assert (passes >= 1).all() and (passes <= 20).all(), passes
    if config_name == "2_pivots_capacity_2":
        assert passes.max() >= 3, "the narrowing path was not exercised"


@pytest.mark.slow
@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("outliers", [False, True], ids=["normal_scores", "outlier_keys"])
def test_speculative_window_settles_in_one_pass_or_falls_back(outliers):
    """The first pass also collects the window where the score statistics put the boundary:
    on normal scores every row is settled after that one pass (two without the window); a few
    outlying keys skew the statistics, the window misses, and narrowing takes over. The
    selection is the exact top-k either way."""
    from dataclasses import replace

    # Large blocks: a quarter of the interpreter's programs and key steps (the speculation is
    # per row, whatever the blocks).
    cfg = _config(block_m=64, block_n=64, num_pivots=4, bracket_capacity=64)
    B, H, Nt, D, topk = 1, 1, 256, 16, 32
    qc, kc, vc = (torch.randn(B, H, Nt, D) for _ in range(3))
    if outliers:
        kc[:, :, :8] *= 30
    ref_indices, _ = select_topk(torch.matmul(qc, kc.transpose(-1, -2)) * D**-0.5, topk)
    runs = {}
    for fill in (cfg.speculate_fill, 0.0):
        _, kv_indices, kv_counts, passes = coarse_attn_topk_fwd(
            qc, kc, vc, topk, D**-0.5, config=replace(cfg, speculate_fill=fill),
            record_passes=True,
        )  # fmt: skip
        assert torch.equal(kv_indices, ref_indices), f"speculate_fill={fill}"
        assert (kv_counts == topk).all()
        runs[fill] = passes
    if outliers:
        assert (runs[cfg.speculate_fill] >= 2).all(), "the window should have missed"
    else:
        assert (runs[cfg.speculate_fill] == 1).all() and (runs[0.0] == 2).all(), runs


def test_speculation_is_on_where_the_window_fits_the_scratch():
    """Hopper's configs: Wan 480p (624 tiles, 4 pivots) expects ~86 keys of normal scores in
    the window (capacity 128, fill 0.75: on); Wan 720p (1,440 tiles, 8 pivots) ~119 (off)."""
    from vidsparse.ops.video_sparse_attn.coarse import speculates
    from vidsparse.ops.video_sparse_attn.configs import coarse_attn_config
    from vidsparse.utils.device import Target

    hopper = Target("cuda", 90)
    assert speculates(coarse_attn_config(hopper, 128, 624), 78, 624)
    assert speculates(coarse_attn_config(hopper, 128, 624), 62, 624)
    assert not speculates(coarse_attn_config(hopper, 128, 1440), 180, 1440)
    assert not speculates(_config(num_pivots=2), 6, 40)  # an odd score half: no middle pair


@pytest.mark.slow
@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("config_name", ["4_pivots_capacity_8", "default", "capacity_64"])
def test_ties_go_to_the_smaller_tile_index(config_name):
    """Small-integer means make every score exact, whatever the summation order, so tiles
    copied from 3 prototypes tie exactly; zero query rows tie everywhere (and mix +0.0 with
    -0.0 products). The kernels pick the smaller indices, deterministically."""
    cfg = SELECTION_CONFIGS[config_name]
    B, H, Nt, D = 1, 2, 40, 16
    prototypes = torch.randint(-4, 5, (H, 3, D)).float()
    ids = torch.randint(0, 3, (H, Nt))
    kc = torch.stack([prototypes[h, ids[h]] for h in range(H)]).unsqueeze(0)  # [1, H, Nt, D]
    qc = torch.randint(-4, 5, (B, H, Nt, D)).float()
    qc[:, :, :5] = 0.0
    vc = torch.randn(B, H, Nt, D)
    scale = 0.25  # a power of two: the scaled scores stay exact
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # exact integers / 4
    for topk in (1, 7, 13, 27):
        _, kv_indices, kv_counts = coarse_attn_topk_fwd(qc, kc, vc, topk, scale, config=cfg)
        assert torch.equal(kv_indices, select_topk(scores, topk)[0]), f"topk={topk}"
        first = torch.arange(topk, dtype=torch.int32).expand(B, H, 5, topk)
        assert torch.equal(kv_indices[:, :, :5], first)
        assert (kv_counts == topk).all()


@pytest.mark.slow
@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize(
    "grid_name, D, dtype, input_scale",
    [("36_tiles", 32, torch.float32, 1.0), ("36_tiles", 16, torch.float16, 4.0),
     ("12_tiles_of_32", 16, torch.float16, 16.0), ("8_tiles", 32, torch.float32, 16.0)],
)  # fmt: skip
def test_gradients_match_reference_autograd(triton_backend, grid_name, D, dtype, input_scale):
    grid = GRIDS[grid_name]
    topk = max(1, grid.num_tiles // 4)
    batch = 1 if grid.num_tiles > 16 else 2  # interpreter time grows with programs
    q_t, k_t, v_t = _tiled_qkv(grid, batch, 2, D, dtype, "cpu", scale=input_scale)
    leaves = [x.requires_grad_() for x in (q_t, k_t, v_t)]
    oc, kv_indices, kv_counts = vsa_coarse_stage(*leaves, grid, topk)
    weight = torch.randn_like(oc)
    grads = torch.autograd.grad((oc * weight).sum(), leaves)

    def reference_grads(compute_dtype):
        xs = [x.detach().requires_grad_() for x in (q_t, k_t, v_t)]
        _, ref_oc, _, _, _ = _reference(*xs, grid, topk, D**-0.5, dtype=compute_dtype)
        return ref_oc, torch.autograd.grad((ref_oc * weight.to(compute_dtype)).sum(), xs)

    ref_oc, exact = reference_grads(torch.float64)
    _, baseline = reference_grads(torch.float32)  # the reference's own rounding, in x.dtype
    assert_rel_l2("oc", oc, ref_oc, 1e-5)
    pad = ~grid.real_token_mask("cpu")
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, exact, baseline):
        assert g.dtype == dtype and g.shape == q_t.shape
        assert (g[:, :, pad] == 0).all(), f"{name}: padding slots must get no gradient"
        assert_error_relative(name, g, r, b, atol=1e-6)


def _check_softmax_bwd(shape, out_dtype, scale, spread, device):
    """``coarse_softmax_bwd`` against its PyTorch form in fp64, within twice that form's own
    error in fp32 (rounded to ``out_dtype`` as the kernel's outputs are)."""
    from vidsparse.ops.video_sparse_attn.coarse import _softmax_grads_torch, coarse_softmax_bwd

    gen = torch.Generator(device=device).manual_seed(hash((shape, spread)) % 2**31)
    scores = torch.randn(shape, generator=gen, device=device) * spread
    dprobs = torch.randn(shape, generator=gen, device=device).to(out_dtype)
    got = coarse_softmax_bwd(scores, dprobs, scale, out_dtype)
    ref = _softmax_grads_torch(scores.double(), dprobs.double(), scale, torch.float64)
    baseline = _softmax_grads_torch(scores, dprobs, scale, out_dtype)
    for name, g, r, b in zip(("p", "ds"), got, ref, baseline):
        assert g.dtype == out_dtype and g.shape == scores.shape, name
        assert_error_relative(name, g.double(), r, b.double(), atol=1e-7)


# (rows' leading shape, columns): one column; fewer columns than a step; several steps with a
# partial last one; rows that do not fill the last program (the interpreter's table: 16 columns
# a step, 4 rows a program).
SOFTMAX_BWD_SHAPES = [((2, 3, 1), 1), ((1, 2, 5), 7), ((2, 1, 9), 40), ((1, 3, 7), 33)]


@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, cols", SOFTMAX_BWD_SHAPES, ids=str)
@pytest.mark.parametrize("spread", [1.0, 64.0])
def test_softmax_bwd_kernel_matches_fp64(exact_bf16_interpreter, rows, cols, out_dtype, spread):
    _check_softmax_bwd((*rows, cols), out_dtype, 0.125, spread, "cpu")


def test_softmax_bwd_refuses_other_scores():
    from vidsparse.ops.video_sparse_attn.coarse import coarse_softmax_bwd

    x = torch.zeros(2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp32 scores"):
        coarse_softmax_bwd(x, x, 1.0, torch.float64)
    with pytest.raises(ValueError, match="of their shape"):
        coarse_softmax_bwd(x.float(), x[:1].float(), 1.0, torch.float32)


@pytest.mark.parametrize("input_scale", [1.0, 16.0])
def test_bf16_gradients_within_bf16_error(torch_backend, input_scale):
    """bf16 inputs: the coarse backward's gradient matmuls run in bf16 (fp32 probabilities),
    which must stay at bf16's own error level (~4e-3) even where a large input scale makes the
    coarse softmax sharp (bf16 scores would be off by ~25% there)."""
    grid = GRIDS["36_tiles"]
    q_t, k_t, v_t = _tiled_qkv(grid, 1, 2, 64, torch.bfloat16, "cpu", scale=input_scale)
    leaves = [x.requires_grad_() for x in (q_t, k_t, v_t)]
    oc, _, _ = vsa_coarse_stage(*leaves, grid, 9)
    weight = torch.randn_like(oc)
    grads = torch.autograd.grad((oc * weight).sum(), leaves)
    xs = [x.detach().double().requires_grad_() for x in (q_t, k_t, v_t)]
    _, ref_oc, _, _, _ = _reference(*xs, grid, 9, 64**-0.5, dtype=torch.float64)
    exact = torch.autograd.grad((ref_oc * weight.double()).sum(), xs)
    for name, g, r in zip(("dq", "dk", "dv"), grads, exact):
        assert_rel_l2(name, g.double(), r, 1.5e-2)


def test_torch_backend_matches_reference(torch_backend):
    """The custom op's PyTorch path (CPU without the interpreter): same outputs and gradients."""
    grid = GRIDS["36_tiles"]
    q_t, k_t, v_t = _tiled_qkv(grid, 2, 3, 8, torch.float64, "cpu")
    leaves = [x.requires_grad_() for x in (q_t, k_t, v_t)]
    oc, kv_indices, kv_counts = vsa_coarse_stage(*leaves, grid, 9, scale=0.3)
    _, ref_oc, scores, ref_indices, ref_counts = _reference(q_t, k_t, v_t, grid, 9, 0.3,
                                                            dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(oc, ref_oc, rtol=1e-12, atol=1e-12)
    assert torch.equal(kv_indices, ref_indices) and torch.equal(kv_counts, ref_counts)
    weight = torch.randn_like(oc)
    grads = torch.autograd.grad((oc * weight).sum(), leaves)
    ref_grads = torch.autograd.grad((ref_oc * weight).sum(), leaves)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.dynamo
def test_torch_compile_sees_one_op(torch_backend):
    grid = GRIDS["8_tiles"]
    q_t, k_t, v_t = (x.requires_grad_() for x in _tiled_qkv(grid, 1, 2, 8, torch.float32, "cpu"))

    def f(q_t, k_t, v_t):
        oc, kv_indices, _ = vsa_coarse_stage(q_t, k_t, v_t, grid, 3)
        return oc.square().sum() + kv_indices.sum()

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q_t, k_t, v_t)
    torch.testing.assert_close(out, f(q_t, k_t, v_t))
    out.backward()
    assert q_t.grad is not None and not torch.isnan(q_t.grad).any()


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda a: a.__setitem__(0, a[0][:, :, :-1]), ValueError, "shape"),
        (lambda a: a.__setitem__(1, a[1].double()), TypeError, "dtype"),
        (lambda a: a.__setitem__("topk", 0), ValueError, "topk"),
        (lambda a: a.__setitem__("topk", True), ValueError, "topk"),
        (lambda a: a.__setitem__("grid", VideoGrid((9, 6, 7))), ValueError, "padded_len"),
        (lambda a: a.__setitem__("grid", "5x6x7"), TypeError, "VideoGrid"),
        (lambda a: a.__setitem__("scale", -1.0), ValueError, "scale"),
    ],
)
def test_bad_input_raises_before_compute(torch_backend, mutate, exc, words):
    grid = GRIDS["8_tiles"]
    args = dict(enumerate(_tiled_qkv(grid, 1, 2, 8, torch.float32, "cpu")))
    args.update(grid=grid, topk=2, scale=None)
    mutate(args)
    with pytest.raises(exc, match=words):
        vsa_coarse_stage(args[0], args[1], args[2], args["grid"], args["topk"], args["scale"])


def test_topk_above_num_tiles_is_clamped(torch_backend):
    grid = GRIDS["8_tiles"]
    _, kv_indices, kv_counts = vsa_coarse_stage(*_tiled_qkv(grid, 1, 1, 8, torch.float32, "cpu"),
                                                grid, 100)  # fmt: skip
    assert kv_indices.shape[-1] == 8 and (kv_counts == 8).all()
    assert torch.equal(kv_indices[0, 0, 0], torch.arange(8, dtype=torch.int32))


# ----------------------------------------------------------------------------- compile check


COMPILE_TARGETS = ("cuda:90", "cuda:100", "hip:gfx942")


def compile_reports(targets, head_dims=(128,)):
    """Compile the kernels the launchers would launch at Wan 1.3B 480p shapes for ``targets``
    (``tests/compile_kernels.py`` names); one report dict per compile. Must run in a process
    without ``TRITON_INTERPRET`` (``@triton.jit`` decides at import)."""
    sys.path.insert(0, str(ROOT / "tests" / "compile"))
    import compile_kernels as ck
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from vidsparse.ops.video_sparse_attn import coarse
    from vidsparse.utils.device import Target

    jobs, reports = [], []
    for name in targets:
        reason = ck.unavailable_reason(name)
        if reason:
            reports.append({"target": name, "skipped": reason})
            continue
        target_args, gpu_args, shared_limit = ck.TARGETS[name]
        backend_cls = type(make_backend(GPUTarget(*gpu_args)))
        for head_dim in head_dims:
            for kernel, args, kwargs in _record_launches(coarse, Target(*target_args), head_dim):
                signature, constexprs, attrs, options = ck.specialise(kernel, args, kwargs,
                                                                      backend_cls)  # fmt: skip
                jobs.append({
                    "target": name, "gpu_target": gpu_args, "shared_limit": shared_limit,
                    "kernel": kernel.__name__, "module": kernel.fn.__module__,
                    "function": kernel.__name__, "block_q": constexprs.get("BLOCK_M"),
                    "block_kv": constexprs.get("BLOCK_N"), "head_dim": head_dim,
                    "dtype": "bf16", "has_kv_sizes": None, "config": options,
                    "signature": signature, "constexprs": constexprs, "attrs": attrs,
                    "options": options,
                })  # fmt: skip
    return reports + ck.run_jobs(jobs, 2)


def _record_launches(coarse, target, head_dim):
    """``[(kernel, args, kwargs)]`` of the forward and backward launchers on meta tensors."""
    import compile_kernels as ck
    from triton.runtime.jit import JITFunction

    from vidsparse.ops.video_sparse_attn import configs

    sink, saved = [], {"target_of": coarse.target_of}
    for attr in dir(coarse):
        if attr.endswith("_kernel") and isinstance(getattr(coarse, attr), JITFunction):
            saved[attr] = getattr(coarse, attr)
    try:
        coarse.target_of = lambda device: target
        for attr in saved:
            if attr != "target_of":
                setattr(coarse, attr, ck._Recorder(saved[attr], sink))
        meta = torch.device("meta")
        B, H, num_tiles, volume, topk = 1, 12, 624, 64, 78  # Wan 2.1 1.3B, 480p
        x = torch.empty(B, H, num_tiles * volume, head_dim, dtype=torch.bfloat16, device=meta)
        sizes = torch.empty(num_tiles, dtype=torch.int32, device=meta)
        pooled = coarse.tile_mean_pool_fwd(x, x, x, sizes)
        coarse.coarse_attn_topk_fwd(pooled[0], pooled[1], pooled[2], topk, head_dim**-0.5)
        # a grid above SMALL_GRID_TILES, whose config may differ (Wan 14B 720p: 1,440 tiles)
        big = torch.empty(B, H, 1440, head_dim, dtype=torch.float32, device=meta)
        coarse.coarse_attn_topk_fwd(big, big, big, 180, head_dim**-0.5)
        # few query tiles (a KV cache: 104 over 624 keys) on an H200's 132 SMs: block_m 16
        few = configs.fill_sms(configs.coarse_attn_config(target, head_dim, 624), 104, H, 132)
        coarse.coarse_attn_topk_fwd(pooled[0], pooled[1], pooled[2], topk, head_dim**-0.5,
                                    config=few)  # fmt: skip
        coarse.tile_mean_pool_bwd(pooled, sizes, num_tiles * volume, torch.bfloat16)
        # the backward's softmax gradient at 480p (one step a row) and 720p (two)
        for cols in (num_tiles, 1440):
            scores = torch.empty(B, H, num_tiles, cols, dtype=torch.float32, device=meta)
            coarse.coarse_softmax_bwd(scores, scores.bfloat16(), head_dim**-0.5, torch.bfloat16)
        # natural order, q as diffusers' processors pass it ([B, S, H, D] seen as [B, H, S, D])
        natural = torch.empty(B, 32760, H, head_dim, dtype=torch.bfloat16,
                              device=meta).transpose(1, 2)  # fmt: skip
        coarse.tile_pool_fwd(natural, natural, natural, (21, 30, 52), (4, 4, 4))
    finally:
        for attr, value in saved.items():
            setattr(coarse, attr, value)
    return sink


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--targets", ",".join(COMPILE_TARGETS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"compile check exited with {proc.returncode}:\n{proc.stderr[-6000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


# Spills accepted because the spilling config was measured faster on the GPU (bytes allowed):
# Hopper attn_topk with 4 warps spills 40 B yet beats 8 spill-free warps, with identical
# selections (benchmarks/NOTES.md, VSA coarse stage).
MEASURED_SPILLS = {("cuda:90", "coarse_attn_topk_fwd_kernel", 128): 64}


@pytest.mark.slow
@pytest.mark.timeout(1000)  # the first one builds the fixture (a subprocess, up to 900 s)
@pytest.mark.parametrize("target", COMPILE_TARGETS)
def test_kernels_compile_spill_free(compiled, target):
    reports = [r for r in compiled if r["target"] == target]
    skipped = [r["skipped"] for r in reports if "skipped" in r]
    if skipped:
        pytest.skip(f"{target}: {skipped[0]}")
    kernels = {r["kernel"] for r in reports}
    assert kernels == {"tile_mean_pool_fwd_kernel", "coarse_attn_topk_fwd_kernel",
                       "tile_mean_pool_bwd_kernel", "tile_pool_fwd_kernel",
                       "coarse_softmax_bwd_kernel"}, kernels  # fmt: skip
    failed = [f"{r['kernel']}: {r['error']}" for r in reports if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    sys.path.insert(0, str(ROOT / "tests" / "compile"))
    from spill_policy import spills_unchecked

    unchecked = spills_unchecked([f"{r['kernel']} D={r['head_dim']}: {r['spills']}"
                                  for r in reports if r["spills"]])  # fmt: skip
    if unchecked:
        pytest.skip(unchecked)
    for r in reports:
        label = f"{r['kernel']} D={r['head_dim']} {r['config']}"
        allowed = MEASURED_SPILLS.get((target, r["kernel"], r["head_dim"]), 0)
        assert r["spills"] <= allowed, (
            f"{label}: {r['spills']} spilled (allowed {allowed}), {r['registers']} registers"
        )
        assert r["shared"] <= r["shared_limit"], f"{label}: {r['shared']} bytes shared memory"


# ----------------------------------------------------------------------------- GPU

WAN_480P = VideoGrid((21, 30, 52))  # 624 tiles, 39,936 padded tokens
WAN_720P = VideoGrid((21, 45, 80))  # 1440 tiles


def _check_selection_is_a_topk(kv_indices, kv_counts, scores, qc, kc, scale, topk):
    """Rows are ``topk`` distinct ascending tiles, and no unselected tile beats a selected one
    by more than the TF32 error bound of the two scores."""
    Nt = scores.shape[-1]
    assert (kv_counts == topk).all()
    assert (kv_indices >= 0).all() and (kv_indices < Nt).all()
    assert (kv_indices.diff(dim=-1) > 0).all(), "rows must be strictly ascending"
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, kv_indices.long(), True)
    worst_in = scores.masked_fill(~selected, float("inf")).amin(-1)  # [B, H, Nt]
    best_out = scores.masked_fill(selected, float("-inf")).amax(-1)
    # TF32 keeps 10 mantissa bits: |s_tf32 - s| <= 2^-10 |qc| |kc| scale (+ fp32 sums); 4x slack.
    bound = 2.0**-8 * qc.norm(dim=-1) * kc.norm(dim=-1).amax(-1, keepdim=True) * scale
    assert (worst_in >= best_out - 2 * bound).all(), float((best_out - worst_in - 2 * bound).max())
    ref_indices, _ = select_topk(scores, topk)
    ref_selected = torch.zeros_like(selected).scatter_(-1, ref_indices.long(), True)
    agree = (selected & ref_selected).sum() / ref_selected.sum()
    assert agree >= 0.99, f"only {float(agree):.4f} of the reference selection"


@pytest.mark.gpu
@pytest.mark.parametrize("input_scale", [1.0, 4.0, 16.0])
def test_gpu_wan480p_bf16_matches_reference(input_scale):
    grid, topk, D = WAN_480P, 78, 128
    q_t, k_t, v_t = _tiled_qkv(grid, 1, 12, D, torch.bfloat16, "cuda", scale=input_scale,
                               garbage=float("nan"))  # fmt: skip
    leaves = [x.requires_grad_() for x in (q_t, k_t, v_t)]
    oc, kv_indices, kv_counts = vsa_coarse_stage(*leaves, grid, topk)
    scale = D**-0.5
    xs = [x.detach().float().requires_grad_() for x in (q_t, k_t, v_t)]
    means, ref_oc, scores, _, _ = _reference(*xs, grid, topk, scale)
    qc, kc = means[0].detach(), means[1].detach()

    pooled = tile_mean_pool_fwd(*(x.detach() for x in leaves), grid.tile_sizes_on("cuda"))
    for name, got, ref in zip("qkv", pooled, means):
        assert_rel_l2(f"{name}c (fp32 sums)", got, ref.detach(), 1e-5)
    assert_rel_l2("oc (TF32 dots)", oc, ref_oc, 2e-2)
    _check_selection_is_a_topk(kv_indices, kv_counts, scores.detach(), qc, kc, scale, topk)

    weight = torch.randn_like(oc)
    grads = torch.autograd.grad((oc * weight).sum(), leaves)
    ref_grads = torch.autograd.grad((ref_oc * weight).sum(), xs)
    pad = ~grid.real_token_mask("cuda")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == torch.bfloat16 and not torch.isnan(g).any()
        assert (g[:, :, pad] == 0).all()
        assert_rel_l2(f"{name} (bf16 output)", g, r, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [624, 1440, 5000])  # Wan 480p, 720p, rows of several steps
@pytest.mark.parametrize("spread", [1.0, 64.0])
def test_gpu_softmax_bwd_kernel_matches_fp64(cols, out_dtype, spread):
    _check_softmax_bwd((1, 12, 301, cols), out_dtype, 128**-0.5, spread, "cuda")


@pytest.mark.gpu
def test_gpu_wan480p_tile_pool_copies_and_means():
    """The fused tiling and pooling read at Wan 480p, bf16, from ``[B, S, H, D]`` storage: the
    copies are ``grid.tile``'s bits, the means the fp64 tile means within fp32 sums."""
    from vidsparse.ops.video_sparse_attn.coarse import tile_pool_fwd

    grid = WAN_480P
    xs = _natural_qkv(grid, 1, 12, 128, torch.bfloat16, "cuda")
    *copies, pooled = tile_pool_fwd(*xs, grid.shape, grid.tile_shape)
    for name, copy, x, got in zip("qkv", copies, xs, pooled):
        tiled = grid.tile(x, dim=-2)
        assert torch.equal(copy, tiled), name
        assert_rel_l2(f"{name}c", got, tile_means(tiled.double(), grid), 1e-6)


@pytest.mark.gpu
def test_gpu_wan720p_forward_selection_and_determinism():
    grid, topk, D = WAN_720P, 180, 128
    q_t, k_t, v_t = _tiled_qkv(grid, 1, 40, D, torch.bfloat16, "cuda", scale=4.0)
    runs = [vsa_coarse_stage(q_t, k_t, v_t, grid, topk) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b), "not bit-identical across runs"
    oc, kv_indices, kv_counts = runs[0]
    (qc, kc, _), ref_oc, scores, _, _ = _reference(q_t, k_t, v_t, grid, topk, D**-0.5)
    assert_rel_l2("oc (TF32 dots)", oc, ref_oc, 2e-2)
    _check_selection_is_a_topk(kv_indices, kv_counts, scores, qc, kc, D**-0.5, topk)


@pytest.mark.gpu
def test_gpu_fp32_inputs_and_head_dim_64():
    grid, topk, D = VideoGrid((9, 30, 26)), 20, 64
    q_t, k_t, v_t = _tiled_qkv(grid, 2, 3, D, torch.float32, "cuda", scale=4.0)
    oc, kv_indices, kv_counts = vsa_coarse_stage(q_t, k_t, v_t, grid, topk)
    (qc, kc, _), ref_oc, scores, _, _ = _reference(q_t, k_t, v_t, grid, topk, D**-0.5)
    assert_rel_l2("oc (TF32 dots)", oc, ref_oc, 2e-2)
    _check_selection_is_a_topk(kv_indices, kv_counts, scores, qc, kc, D**-0.5, topk)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    grid = VideoGrid((9, 30, 26))
    q_t, k_t, v_t = (x.requires_grad_()
                     for x in _tiled_qkv(grid, 1, 2, 128, torch.bfloat16, "cuda"))  # fmt: skip

    def f(q_t, k_t, v_t):
        oc, _, _ = vsa_coarse_stage(q_t, k_t, v_t, grid, 16)
        return oc.square().sum()

    out = torch.compile(f, fullgraph=True)(q_t, k_t, v_t)
    out.backward()
    torch.testing.assert_close(out, f(q_t, k_t, v_t), rtol=1e-4, atol=1e-4)
    assert not torch.isnan(q_t.grad).any()


if __name__ == "__main__":  # the compile check runs here, in a process without the interpreter
    import argparse

    parser = argparse.ArgumentParser(description="compile the VSA coarse kernels for GPU targets")
    parser.add_argument("--targets", default=",".join(COMPILE_TARGETS))
    parser.add_argument("--head-dims", default="128")
    cli = parser.parse_args()
    for report in compile_reports(
        [t for t in cli.targets.split(",") if t], [int(d) for d in cli.head_dims.split(",")]
    ):
        report.pop("traceback", None)
        print(json.dumps(report), flush=True)


def test_few_query_tiles_take_smaller_blocks_to_fill_the_sms():
    """A KV cache's 104 query tiles in blocks of 32 are 48 programs for 132 SMs: block_m 16
    (84); a grid that already fills the GPU keeps its blocks, and 16 is the floor."""
    from vidsparse.ops.video_sparse_attn.configs import CoarseAttnConfig, fill_sms

    cfg = CoarseAttnConfig(block_m=32)
    assert fill_sms(cfg, 104, 12, 132).block_m == 16
    assert fill_sms(cfg, 624, 12, 132) is cfg  # Wan 480p self-attention: 240 programs
    assert fill_sms(cfg, 8, 1, 132).block_m == 16
    assert fill_sms(CoarseAttnConfig(block_m=16), 8, 1, 132).block_m == 16
