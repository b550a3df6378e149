"""VSA beyond one grid: packed batches, key grids of their own (KV caches), block-causal slabs,
competing text tokens, and tiles of 128 and 256 tokens.

Every case is checked against a brute-force VSA written here (fp64, natural order, a dense
token-level mask built from (t, h, w) coordinates, torch.topk for the selection), independent
of the library's tiling, segment plan and reference: the torch backend and the Triton path (in
the interpreter on CPU) both, forward and the gradients of q, k, v and gate.
"""

from __future__ import annotations

import math

import pytest
import torch

import vidsparse
from vidsparse.layout.grid import VideoGrid
from vidsparse.testing import add_tile_structure, assert_rel_l2

# ---- brute force ---------------------------------------------------------------------------


def _token_tiles(grid, frame_offset=0):
    """Per token (raster order): its tile id in the grid and its absolute time tile."""
    T, H, W = grid.shape
    tT, tH, tW = grid.tile_shape
    _, nh, nw = grid.tiles
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    tile = ((t // tT) * nh + h // tH) * nw + w // tW
    return tile.reshape(-1), ((t + frame_offset) // tT).reshape(-1)


class _Side:
    """Token -> unit (tile, or prefix text block) maps of one side of the attention."""

    def __init__(self, grids, frame_offsets, text_units=0, text_tokens=0, volume=64):
        units, times, seqs, first = [], [], [], text_units
        unit_seq, unit_time = [0] * text_units, [-1] * text_units  # prefix: seq 0, always
        for s, (g, off) in enumerate(zip(grids, frame_offsets)):
            tile, time = _token_tiles(g, off)
            units.append(tile + first)
            times.append(time)
            seqs.append(torch.full_like(tile, s))
            per_tile_time = torch.full((g.num_tiles,), -1, dtype=torch.long)
            per_tile_time[tile] = time
            unit_seq += [s] * g.num_tiles
            unit_time += per_tile_time.tolist()
            first += g.num_tiles
        self.video_units = torch.cat(units)  # [S_video]
        self.video_times = torch.cat(times)
        self.video_seqs = torch.cat(seqs)
        text = torch.arange(text_tokens) // volume if text_units else torch.full((text_tokens,), -1)
        self.units = torch.cat([self.video_units, text])  # text: block id or -1 (exempt)
        self.num_units = first
        self.unit_seq = torch.tensor(unit_seq)
        self.unit_time = torch.tensor(unit_time)


def _brute_force(q, k, v, gate, grids, kv_grids, *, N, compete, causal, topk, sparsity, scale):
    volume = grids[0].tile_volume
    offsets = [kg.shape[0] - g.shape[0] if causal else 0 for g, kg in zip(grids, kv_grids)]
    text_units = math.ceil(N / volume) if compete and N else 0
    qs = _Side(grids, offsets)
    ks = _Side(kv_grids, [0] * len(kv_grids), text_units, N, volume)
    Sq = qs.video_units.numel()

    def means(x, unit_of_token, num_units):
        member = (unit_of_token.view(1, -1) == torch.arange(num_units).view(-1, 1)).to(x.dtype)
        return (member / member.sum(1, keepdim=True)) @ x

    qc = means(q[:, :, :Sq], qs.video_units, qs.num_units)
    kc, vc = (means(x, ks.units, ks.num_units) for x in (k, v))
    q_unit_seq = torch.cat([torch.full((g.num_tiles,), s) for s, g in enumerate(grids)])
    q_unit_time = torch.full((qs.num_units,), -1, dtype=torch.long)
    q_unit_time[qs.video_units] = qs.video_times
    allowed = (q_unit_seq.view(-1, 1) == ks.unit_seq.view(1, -1)) | (ks.unit_time.view(1, -1) < 0)
    if causal:
        allowed &= ks.unit_time.view(1, -1) <= q_unit_time.view(-1, 1)
    scores = (qc @ kc.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    oc = torch.softmax(scores, -1) @ vc  # [B, H, Nq, D]
    n_allowed = allowed.sum(-1)
    if sparsity is not None:
        keep = torch.ceil((1 - sparsity) * n_allowed.double() - 1e-9).long()
    else:
        keep = torch.full_like(n_allowed, topk)
    keep = torch.minimum(keep.clamp(min=1), n_allowed)
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    selected = rank < keep.view(-1, 1)  # [B, H, Nq, Nk]

    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    mask = torch.ones(B, H, Lq, Lk, dtype=torch.bool)  # text queries: every key
    key_units = ks.units.clamp(min=0)
    video_rows = selected[:, :, qs.video_units][:, :, :, key_units]  # [B, H, Sq, Lk]
    exempt = ks.units < 0  # exempt text keys: every video query attends them
    mask[:, :, :Sq] = video_rows | exempt.view(1, 1, 1, -1)
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    o = torch.softmax(logits, -1) @ v
    coarse = oc[:, :, qs.video_units] * (1.0 if gate is None else gate[:, :, :Sq])
    return torch.cat([o[:, :, :Sq] + coarse, o[:, :, Sq:]], dim=2)


# ---- cases ---------------------------------------------------------------------------------

T4 = (4, 4, 4)
CASES = {
    # name: (grids, kv_grids or None, causal, N, text_mode)
    "packed": ([VideoGrid((5, 6, 7)), VideoGrid((4, 8, 8)), VideoGrid((3, 5, 9))], None, False, 0,
               "exempt"),
    "kv-cache": ([VideoGrid((4, 6, 7))], [VideoGrid((9, 6, 7))], False, 0, "exempt"),
    "kv-other-size": ([VideoGrid((5, 6, 7))], [VideoGrid((3, 9, 5))], False, 0, "exempt"),
    "causal-cache": ([VideoGrid((5, 6, 7))], [VideoGrid((13, 6, 7))], True, 0, "exempt"),
    "causal-self": ([VideoGrid((10, 5, 6))], None, True, 0, "exempt"),
    "causal-packed": ([VideoGrid((9, 4, 8)), VideoGrid((6, 6, 5))], None, True, 0, "exempt"),
    "compete": ([VideoGrid((5, 6, 7))], None, False, 70, "compete"),
    "compete-causal": ([VideoGrid((7, 6, 7))], None, True, 70, "compete"),
    "exempt-kv-cache": ([VideoGrid((4, 6, 7))], [VideoGrid((8, 6, 7))], False, 21, "exempt"),
    "tile128-packed": ([VideoGrid((5, 6, 11), (4, 4, 8)), VideoGrid((4, 9, 8), (4, 4, 8))],
                       None, False, 0, "exempt"),
    "tile256-cache": ([VideoGrid((4, 9, 17), (4, 8, 8))], [VideoGrid((12, 9, 17), (4, 8, 8))],
                      True, 0, "exempt"),
    "tile256-compete": ([VideoGrid((5, 8, 17), (4, 8, 8))], None, False, 300, "compete"),
    "tile256-text": ([VideoGrid((5, 8, 17), (4, 8, 8))], None, False, 77, "exempt"),
    "tile256-plain": ([VideoGrid((6, 11, 17), (4, 8, 8))], None, False, 0, "exempt"),
}  # fmt: skip


def _run_case(name, *, dtype, device, B=2, H=2, D=16, sparsity=0.5, topk=None, tiled=False):
    grids, kv_grids, causal, N, mode = CASES[name]
    kv = kv_grids or grids
    q_len, kv_len = (sum(g.num_tokens for g in gs) + N for gs in (grids, kv))
    q64 = torch.randn(B, H, q_len, D, dtype=torch.float64)
    k64, v64 = (torch.randn(B, H, kv_len, D, dtype=torch.float64) for _ in range(2))
    gate64 = torch.rand_like(q64)
    if tiled:  # tile-order inputs: padding rows zero, as grid.tile writes them
        q64, gate64 = (_tile_natural(x, grids, N) for x in (q64, gate64))
        k64, v64 = (_tile_natural(x, kv, N) for x in (k64, v64))
    xs = [x.to(device=device, dtype=dtype).requires_grad_(True) for x in (q64, k64, v64, gate64)]
    o = vidsparse.video_sparse_attn(
        *xs[:3], grids if len(grids) > 1 else grids[0], kv_grid=kv_grids, causal=causal,
        sparsity=sparsity, topk=topk, gate=xs[3], tiled=tiled, text_tokens=N, text_mode=mode,
    )  # fmt: skip
    ref_in = [x.detach().double().cpu().requires_grad_(True) for x in xs]
    natural = [_untile(x, g, N, tiled) for x, g in zip(ref_in, (grids, kv, kv, grids))]
    ref = _brute_force(
        *natural[:3], natural[3], grids, kv, N=N, compete=mode == "compete", causal=causal,
        topk=topk, sparsity=sparsity, scale=D**-0.5,
    )  # fmt: skip
    ref = _tile_natural(ref, grids, N) if tiled else ref
    return o, ref, xs, ref_in


def _tile_natural(x, grids, N):
    parts, start = [], 0
    for g in grids:
        parts.append(g.tile(x[:, :, start : start + g.num_tokens], dim=-2))
        start += g.num_tokens
    return torch.cat([*parts, x[:, :, start:]], dim=2)


def _untile(x, grids, N, tiled):
    if not tiled:
        return x
    parts, start = [], 0
    for g in grids:
        parts.append(g.untile(x[:, :, start : start + g.padded_len], dim=-2))
        start += g.padded_len
    return torch.cat([*parts, x[:, :, start:]], dim=2)


def _check(o, ref, xs, ref_in, bound_o, bound_g):
    assert o.shape == xs[0].shape and not torch.isnan(o).any()
    assert_rel_l2("o", o.double().cpu(), ref, bound_o)
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(o, xs, do.to(device=o.device, dtype=o.dtype))
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    for name, g, r in zip(("dq", "dk", "dv", "dgate"), grads, ref_grads):
        assert not torch.isnan(g).any(), name
        assert_rel_l2(name, g.double().cpu(), r, bound_g)


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_backend_matches_brute_force(torch_backend, name):
    o, ref, xs, ref_in = _run_case(name, dtype=torch.float64, device="cpu")
    _check(o, ref, xs, ref_in, 1e-10, 1e-9)


@pytest.mark.parametrize("name", ["packed", "causal-cache", "compete"])
def test_torch_backend_tiled_and_topk(torch_backend, name):
    o, ref, xs, ref_in = _run_case(name, dtype=torch.float64, device="cpu", tiled=True,
                                   sparsity=None, topk=3)  # fmt: skip
    _check(o, ref, xs, ref_in, 1e-10, 1e-9)


# The interpreter takes each feature once (the torch backend above and the GPU below take
# every case): the kernels' paths, not every combination.
INTERPRETER_CASES = ["packed", "kv-cache", "causal-cache", "compete", "exempt-kv-cache",
                     "tile128-packed", "tile256-text", "tile256-compete"]  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("name", INTERPRETER_CASES)
def test_triton_interpreter_matches_brute_force(triton_backend, name):
    o, ref, xs, ref_in = _run_case(name, dtype=torch.float32, device="cpu", B=1, H=1)
    _check(o, ref, xs, ref_in, 1e-5, 1e-4)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_triton_interpreter_tiled_topk(triton_backend):
    o, ref, xs, ref_in = _run_case("causal-packed", dtype=torch.float32, device="cpu", B=1,
                                   H=1, tiled=True, sparsity=None, topk=2)  # fmt: skip
    _check(o, ref, xs, ref_in, 1e-5, 1e-4)


def test_packed_equals_each_video_alone(torch_backend):
    """A packed batch is its videos run one by one, concatenated."""
    grids = CASES["packed"][0]
    S = sum(g.num_tokens for g in grids)
    q, k, v = (torch.randn(1, 2, S, 16, dtype=torch.float64) for _ in range(3))
    o = vidsparse.video_sparse_attn(q, k, v, grids, sparsity=0.6)
    parts, start = [], 0
    for g in grids:
        sl = slice(start, start + g.num_tokens)
        parts.append(vidsparse.video_sparse_attn(q[:, :, sl], k[:, :, sl], v[:, :, sl], g,
                                                 sparsity=0.6))  # fmt: skip
        start += g.num_tokens
    torch.testing.assert_close(o, torch.cat(parts, 2), rtol=1e-12, atol=1e-12)


def test_kv_grid_equal_to_grid_is_self_attention(torch_backend):
    g = VideoGrid((5, 6, 7))
    q, k, v = (torch.randn(1, 2, g.num_tokens, 16, dtype=torch.float64) for _ in range(3))
    a = vidsparse.video_sparse_attn(q, k, v, g, topk=3)
    b = vidsparse.video_sparse_attn(q, k, v, [g], kv_grid=[g], topk=3)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- bad input -----------------------------------------------------------------------------


def _qkv(Sq, Sk, D=16):
    return torch.randn(1, 2, Sq, D), torch.randn(1, 2, Sk, D), torch.randn(1, 2, Sk, D)


@pytest.mark.parametrize(
    "kwargs, grids, Sq, Sk, match",
    [
        ({}, [VideoGrid((4, 8, 8)), VideoGrid((4, 4, 4))], 300, 320, "q's sequence length"),
        ({"kv_grid": VideoGrid((8, 8, 8))}, VideoGrid((4, 8, 8)), 256, 500, "k's sequence"),
        ({"kv_grid": [VideoGrid((8, 8, 8))] * 2}, VideoGrid((4, 8, 8)), 256, 512, "one grid per"),
        ({"kv_grid": VideoGrid((8, 8, 4)), "causal": True}, VideoGrid((4, 8, 8)), 256, 256,
         "spatial size"),
        ({"kv_grid": VideoGrid((6, 8, 8)), "causal": True}, VideoGrid((4, 8, 8)), 256, 384,
         "whole number of time"),
        ({"kv_grid": VideoGrid((4, 8, 8), (4, 4, 8))}, VideoGrid((4, 8, 8)), 256, 256,
         "one tile shape"),
        ({"text_tokens": 8}, [VideoGrid((4, 8, 8))] * 2, 520, 520, "packed batch"),
        ({"text_mode": "always"}, VideoGrid((4, 8, 8)), 256, 256, "text_mode"),
        ({"causal": 1}, VideoGrid((4, 8, 8)), 256, 256, "causal"),
        ({"text_tokens": 300, "text_mode": "compete"}, VideoGrid((4, 8, 8)), 256, 556,
         "q's sequence length"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input_named_before_launch(monkeypatch, backend, kwargs, grids, Sq, Sk, match):
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    q, k, v = _qkv(Sq, Sk)
    with pytest.raises((ValueError, TypeError), match=match):
        vidsparse.video_sparse_attn(q, k, v, grids, topk=2, **kwargs)


def test_grid_list_must_hold_grids():
    q, k, v = _qkv(256, 256)
    with pytest.raises(TypeError, match="grid must be"):
        vidsparse.video_sparse_attn(q, k, v, [VideoGrid((4, 8, 8)), (4, 8, 8)], topk=2)


# ---- torch.compile -------------------------------------------------------------------------


def _compiled_matches_eager(name, device, backend):
    grids, kv_grids, causal, N, mode = CASES[name]
    kv = kv_grids or grids
    q = torch.randn(1, 2, sum(g.num_tokens for g in grids) + N, 16, device=device)
    k, v = (torch.randn(1, 2, sum(g.num_tokens for g in kv) + N, 16, device=device)
            for _ in range(2))  # fmt: skip
    q.requires_grad_(True)

    def f(q, k, v):
        return vidsparse.video_sparse_attn(
            q, k, v, grids if len(grids) > 1 else grids[0], kv_grid=kv_grids, causal=causal,
            sparsity=0.5, text_tokens=N, text_mode=mode,
        )  # fmt: skip

    compiled = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    eager = f(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    (g_c,) = torch.autograd.grad(compiled.square().sum(), q)
    (g_e,) = torch.autograd.grad(eager.square().sum(), q)
    torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-4)


@pytest.mark.dynamo
@pytest.mark.parametrize("name", ["causal-cache", "compete"])
def test_torch_compile_fullgraph_torch_backend(torch_backend, name):
    _compiled_matches_eager(name, "cpu", "eager")


@pytest.mark.dynamo
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_torch_compile_fullgraph_triton_path(triton_backend):
    """The Triton path's host code traces without a graph break (kernels in the interpreter)."""
    _compiled_matches_eager("exempt-kv-cache", "cpu", "eager")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["packed", "causal-cache", "compete", "exempt-kv-cache"])
def test_gpu_torch_compile_fullgraph(name):
    _compiled_matches_eager(name, "cuda", "inductor")


# ---- GPU, real sizes, against the torch backend (checked above against brute force) ---------

GPU_CASES = {
    # name: (grids, kv_grids or None, causal, N, text_mode)
    "kv-cache-480p": ([VideoGrid((4, 30, 52))], [VideoGrid((21, 30, 52))], False, 0, "exempt"),
    "causal-cache-480p": ([VideoGrid((5, 30, 52))], [VideoGrid((21, 30, 52))], True, 0,
                          "exempt"),
    "packed-480p": ([VideoGrid((21, 30, 52)), VideoGrid((9, 30, 52))], None, False, 0, "exempt"),
    "compete-text": ([VideoGrid((9, 30, 52))], None, False, 300, "compete"),
    "tile128-packed": ([VideoGrid((9, 30, 52), (4, 4, 8)), VideoGrid((5, 18, 32), (4, 4, 8))],
                       None, False, 0, "exempt"),
    "tile256-480p": ([VideoGrid((21, 30, 52), (4, 8, 8))], None, False, 0, "exempt"),
    "tile256-text": ([VideoGrid((9, 30, 52), (4, 8, 8))], None, False, 77, "exempt"),
}  # fmt: skip


def _structured(x, grids, N):
    """Tile-structured video parts and text blocks (competing text blocks are selected like
    tiles): no near-tie top-k decisions between TF32 and fp32."""
    parts, start = [], 0
    for g in grids:
        parts.append(add_tile_structure(x[:, :, start : start + g.num_tokens], g, 1.0,
                                        tiled=False))  # fmt: skip
        start += g.num_tokens
    volume = grids[0].tile_volume
    text = x[:, :, start:]
    per_block = torch.randn(*x.shape[:2], math.ceil(N / volume), 1, x.shape[-1])
    blocks = per_block.expand(-1, -1, -1, volume, -1).reshape(*x.shape[:2], -1, x.shape[-1])
    return torch.cat([*parts, text + blocks[:, :, :N]], dim=2)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_bf16_matches_torch_backend(monkeypatch, name, scale):
    grids, kv_grids, causal, N, mode = GPU_CASES[name]
    kv = kv_grids or grids
    H, D = 2, 128
    q = _structured(torch.randn(1, H, sum(g.num_tokens for g in grids) + N, D), grids, N)
    k = _structured(torch.randn(1, H, sum(g.num_tokens for g in kv) + N, D), kv, N)
    v = torch.randn_like(k)
    gate = torch.rand_like(q)
    xs = [(x * s).cuda().bfloat16().requires_grad_(True)
          for x, s in zip((q, k, v, gate), (scale, scale, scale, 1.0))]  # fmt: skip
    kwargs = dict(kv_grid=kv_grids, causal=causal, sparsity=0.875, text_tokens=N, text_mode=mode)
    grid = grids if len(grids) > 1 else grids[0]
    monkeypatch.setenv("VIDSPARSE_BACKEND", "triton")
    o = vidsparse.video_sparse_attn(*xs[:3], grid, gate=xs[3], **kwargs)
    monkeypatch.setenv("VIDSPARSE_BACKEND", "torch")
    ref_in = [x.detach().float().requires_grad_(True) for x in xs]
    ref = vidsparse.video_sparse_attn(*ref_in[:3], grid, gate=ref_in[3], **kwargs)
    check_bf16_against_fp32(o, ref, xs, ref_in)


def check_bf16_against_fp32(o, ref, xs, ref_in, bound_o=3e-2, bound_g=6e-2):
    """bf16 output and gradients of (q, k, v, gate) ``xs`` against an fp32 run on ``ref_in``:
    no NaN, error-relative bounds of bf16 rounding."""
    assert not torch.isnan(o).any()
    assert_rel_l2("o", o.float(), ref, bound_o)
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(o, xs, do.bfloat16())
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    for gname, g, r in zip(("dq", "dk", "dv", "dgate"), grads, ref_grads):
        assert not torch.isnan(g).any(), gname
        assert_rel_l2(gname, g.float(), r, bound_g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv_shape", [(12, 8, 8), (4, 4, 4)], ids=["longer", "shorter"])
def test_empty_batch_with_a_key_grid_of_its_own(monkeypatch, backend, kv_shape):
    """B = 0 with k, v on a grid of another length: an empty output shaped like q, and empty
    gradients, on both backends."""
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    grid, kv_grid = VideoGrid((4, 8, 8)), VideoGrid(kv_shape)
    q = torch.randn(0, 2, grid.num_tokens, 16, requires_grad=True)
    k, v = (torch.randn(0, 2, kv_grid.num_tokens, 16, requires_grad=True) for _ in range(2))
    o = vidsparse.video_sparse_attn(q, k, v, grid, kv_grid=kv_grid, sparsity=0.5)
    assert o.shape == q.shape
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize(
    "grids, kv_grids, causal",
    [
        ([(8, 8, 8), (4, 12, 8), (4, 4, 4)], None, False),  # packed: three segments
        ([(8, 8, 8)], [(16, 8, 8)], True),  # a causal cache: one segment per query time tile
    ],
)
@pytest.mark.parametrize("kernel", [False, True], ids=["ops", "kernel"])
def test_coarse_backward_per_segment_is_autograd_of_the_masked_attention(
    grids, kv_grids, causal, kernel
):
    """The combine's coarse gradient per segment on its own tiles is autograd's gradient of
    the coarse attention masked to each query tile's key range (fp64, random tile means): the
    packed backward no longer pays the square of the packed tiles. ``kernel``: the Triton
    path's softmax gradient (fp32 tile means, so within fp32's error of fp64's)."""
    from vidsparse.ops.video_sparse_attn.fine import _coarse_bwd_per_segment
    from vidsparse.ops.video_sparse_attn.segments import plan_tensors, plan_tiles

    grids = tuple(VideoGrid(g) for g in grids)
    kv = grids if kv_grids is None else tuple(VideoGrid(g) for g in kv_grids)
    plan = plan_tiles(grids, kv, topk=None, sparsity=0.5, causal=causal)
    q_info = plan_tensors(plan, "cpu").q_info
    nq, nk, D = plan.num_q_tiles, plan.num_k_tiles, 8
    qc, kc, vc = (
        torch.randn(2, 3, n, D, dtype=torch.float64, requires_grad=True) for n in (nq, nk, nk)
    )
    d_coarse = torch.randn(2, 3, nq, D, dtype=torch.float64)
    tiles = (d_coarse, qc, kc, vc)
    if kernel:  # fp32 tile means whose values are the fp64 ones
        qc, kc, vc = (x.detach().float().double().requires_grad_() for x in (qc, kc, vc))
        d_coarse = d_coarse.float().double()
        tiles = tuple(x.detach().float() for x in (d_coarse, qc, kc, vc))
    keys = torch.arange(nk)
    allowed = (keys >= q_info[1].long()[:, None]) & (keys < q_info[2].long()[:, None])
    scores = (qc @ kc.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    grads = torch.autograd.grad(torch.softmax(scores, -1) @ vc, (qc, kc, vc), d_coarse)
    with torch.no_grad():
        per_segment = _coarse_bwd_per_segment(*tiles, plan.segments, 0.3, None, kernel)
    assert len(plan.segments) > 1
    tol = 1e-5 if kernel else 1e-12
    for i, (name, g) in enumerate(zip(("dqc", "dkc", "dvc"), grads)):
        n = g.shape[2]
        got = per_segment[i, :, :, :n].double()
        torch.testing.assert_close(got, g, rtol=tol, atol=tol, msg=name)
