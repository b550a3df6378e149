"""Equivalents of FastVideo's public VSA kernel tests (``fastvideo-kernel/tests/test_vsa*.py``)
and of its block-mean / top-k tests (``test_fused_compress_topk.py``), issue 20.

Each test names the peer items it covers (IDs of ``.notes/issue20_fastvideo_test_map.md``).
The peer feeds tiled, padded tensors with explicit per-tile real sizes (e.g. kv sizes
``[256, 173, 79, 256]``); vidsparse derives the sizes from a grid's geometry, so each case
below picks grids whose partial tiles give comparable sizes (listed next to each case; a
partial tile can only come last along an axis, so a partial tile *between* full ones is
written with a partial axis of a 2-D tile raster, e.g. ``[256, 160, 256, 160]``). The peer's
BSHD twins are the same cases with ``[B, S, H, D]`` leaves, transposed once for the call.

Oracles: the brute-force VSA of ``test_vsa_multi.py`` (fp64, natural order, token-level mask)
for the VSA wrapper, ``helpers.masked_dense_attention`` (fp64) for the engine, with the
peer's packed-varlen reference design: one call per sequence, concatenated. Every case runs on
the torch backend in fp64, a subset in the Triton interpreter (fp32, small), and all at the
peer's geometry (bf16, D = 128) on a GPU against the torch backend in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch

# Shared VSA oracle and case helpers (same folder; tests/ is on pythonpath for helpers).
from test_vsa_multi import (
    _brute_force,
    _check,
    _structured,
    _tile_natural,
    _token_tiles,
    _untile,
    check_bf16_against_fp32,
)

import vidsparse
from helpers import masked_dense_attention
from vidsparse.layout.grid import VideoGrid, _canonical_device
from vidsparse.testing import add_tile_structure, assert_rel_l2

interpreter = pytest.mark.interpreter
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")

T128 = (2, 8, 8)  # FastVideo's 128-token tile
T128B = (4, 4, 8)  # the 128-token tile named in issue 20
T256 = (4, 8, 8)


def _g(shape, tile=(4, 4, 4)):
    return VideoGrid(shape, tile)


# ---- VSA wrapper cases (test_vsa128_backward, test_vsa256_*) -------------------------------
# name: (q grid, kv grid or None (= q's), topk, gated)
WRAPPER_CASES = {
    # F08-11: tile 2x8x8; q 3 full tiles; kv 4 tiles [128, 80, 80, 50] (peer [128,91,37,128]);
    # top-k 2, gate randn * 0.1.
    "F08-11-2x8x8": (_g((2, 8, 24), T128), _g((2, 13, 13), T128), 2, True),
    # the same at issue 20's 4x4x8: kv 4 tiles [96, 60, 72, 45].
    "F08-11-4x4x8": (_g((4, 4, 24), T128B), _g((3, 7, 13), T128B), 2, True),
    # F12-13: q 3 full tiles; kv 4 tiles [256, 256, 160, 160] (peer [256,173,79,256]); top-k 2.
    "F12-13": (_g((4, 8, 24), T256), _g((4, 13, 16), T256), 2, False),
    # F14-15: kv [256, 160, 256, 160] (peer [256,200,256,91]), gate.
    "F14-15": (_g((4, 8, 24), T256), _g((4, 16, 13), T256), 2, True),
    # F16-17: same tile count, different per-tile sizes: q [256, 256, 96] (peer [256,61,199]),
    # kv [192, 192, 168] (peer [256,128,256]).
    "F16-17": (_g((4, 8, 19), T256), _g((3, 8, 23), T256), 2, False),
    # F18-19: q 2 full tiles, kv 5 tiles [256, 256, 256, 256, 96] (peer [256,143,256,256,88]),
    # top-k 3.
    "F18-19": (_g((4, 8, 16), T256), _g((4, 8, 35), T256), 3, False),
    # F22: 8 q / 8 kv full tiles (one grid), top-k 2.
    "F22": (_g((8, 16, 16), T256), None, 2, False),
    # F23-24: 8 q / 12 kv full tiles.
    "F23-24": (_g((8, 16, 16), T256), _g((12, 16, 16), T256), 2, False),
    # F25-26: 8 q full / 12 kv tiles with partial sizes 75 .. 256 on every axis (peer
    # U[16, 256]): kv grid 7x13x21 -> tiles 2x2x3.
    "F25-26": (_g((8, 16, 16), T256), _g((7, 13, 21), T256), 2, False),
    # F50: the peer's (6, 8, 16) / 4x8x8 grid (tiles 2x1x2, sizes [256, 256, 128, 128]).
    "F50": (_g((6, 8, 16), T256), None, 2, True),
}


def _vsa_case(name, *, dtype, device="cpu", B=1, H=2, D=16, bshd=False, tiled=True):
    """Inputs in the peer's layout (tiled, padding zero; BSHD leaves if ``bshd``), vidsparse's
    output and the brute-force reference in the same layout: (o, ref, leaves, ref leaves)."""
    grid, kv_grid, topk, gated = WRAPPER_CASES[name]
    grids, kv = [grid], [kv_grid or grid]
    q64 = torch.randn(B, H, grid.num_tokens, D, dtype=torch.float64)
    k64, v64 = (torch.randn(B, H, kv[0].num_tokens, D, dtype=torch.float64) for _ in range(2))
    gate64 = torch.randn_like(q64) * 0.1
    if tiled:
        q64, gate64 = (_tile_natural(x, grids, 0) for x in (q64, gate64))
        k64, v64 = (_tile_natural(x, kv, 0) for x in (k64, v64))
    view = (lambda x: x.transpose(1, 2)) if bshd else (lambda x: x)
    raw = (q64, k64, v64, gate64) if gated else (q64, k64, v64)
    xs = [view(x).contiguous().to(device=device, dtype=dtype).requires_grad_(True) for x in raw]
    o = vidsparse.video_sparse_attn(
        *(view(x) for x in xs[:3]), grid, kv_grid=kv_grid, topk=topk,
        gate=view(xs[3]) if gated else None, tiled=tiled,
    )  # fmt: skip
    o = view(o)
    ref_in = [x.detach().double().cpu().requires_grad_(True) for x in xs]
    nat = [_untile(view(x), g, 0, tiled) for x, g in zip(ref_in, (grids, kv, kv, grids))]
    ref = _brute_force(
        *nat[:3], nat[3] if gated else None, grids, kv, N=0, compete=False, causal=False,
        topk=topk, sparsity=None, scale=D**-0.5,
    )  # fmt: skip
    ref = view(_tile_natural(ref, grids, 0) if tiled else ref)
    return o, ref, xs, ref_in


BSHD_CASES = ["F08-11-2x8x8", "F08-11-4x4x8", "F12-13", "F14-15", "F16-17", "F18-19"]


@pytest.mark.parametrize("name", sorted(WRAPPER_CASES))
def test_wrapper_torch_backend_matches_brute_force(torch_backend, name):
    """F08-19, F22-26, F50: VSA at 128/256-token tiles, q and kv on their own grids (partial
    kv tiles, partial q tiles, q_len != kv_len), with and without gate: o, dq, dk, dv, dgate."""
    o, ref, xs, ref_in = _vsa_case(name, dtype=torch.float64)
    _check(o, ref, xs, ref_in, 1e-10, 1e-9)


@pytest.mark.parametrize("name", BSHD_CASES)
def test_wrapper_bshd_leaves_torch_backend(torch_backend, name):
    """F09, F11, F13, F15, F17, F19 (the peer's bshd twins): the same cases with
    [B, S, H, D] leaves, transposed once for the call (vidsparse takes [B, H, S, D])."""
    o, ref, xs, ref_in = _vsa_case(name, dtype=torch.float64, bshd=True)
    assert xs[0].shape[1] != xs[0].shape[2]  # really [B, S, H, D]
    _check(o, ref, xs, ref_in, 1e-10, 1e-9)


def test_wrapper_natural_order_torch_backend(torch_backend):
    """F18-19 with natural-order inputs (vidsparse's default layout)."""
    o, ref, xs, ref_in = _vsa_case("F18-19", dtype=torch.float64, tiled=False)
    _check(o, ref, xs, ref_in, 1e-10, 1e-9)


INTERPRETER_WRAPPER = ["F08-11-2x8x8", "F08-11-4x4x8", "F12-13", "F14-15", "F16-17", "F18-19",
                       "F50"]  # fmt: skip


@interpreter
@cpu_only
@pytest.mark.parametrize("name", INTERPRETER_WRAPPER)
def test_wrapper_triton_interpreter_matches_brute_force(triton_backend, name):
    """F08, F10, F12, F14, F16, F18 (Triton route), F50: fp32 fwd + grads vs brute force."""
    o, ref, xs, ref_in = _vsa_case(name, dtype=torch.float32, H=1)
    _check(o, ref, xs, ref_in, 1e-5, 1e-4)


@interpreter
@cpu_only
def test_wrapper_bshd_leaves_triton_interpreter(triton_backend):
    """F09, F11 (bshd twin on the Triton route): [B, S, H, D] leaves, 2 heads."""
    o, ref, xs, ref_in = _vsa_case("F08-11-2x8x8", dtype=torch.float32, H=2, bshd=True)
    _check(o, ref, xs, ref_in, 1e-5, 1e-4)


@interpreter
@cpu_only
def test_wrapper_triton_interpreter_partial_kv_fwd_bwd(triton_backend):
    """F25-26: 8 full q tiles, 12 partial kv tiles on the Triton route, fwd + dq dk dv."""
    o, ref, xs, ref_in = _vsa_case("F25-26", dtype=torch.float32, H=1)
    _check(o, ref, xs, ref_in, 1e-5, 1e-4)


@interpreter
@cpu_only
@pytest.mark.parametrize("name", ["F22", "F23-24"])
def test_backend_parity_triton_interpreter_vs_torch(monkeypatch, name):
    """F22, F23, F24: 8 q / 8 or 12 kv full 256-tiles, top-k 2: the Triton route and the
    torch backend agree (same fp32 inputs), and both match the brute force."""
    grid, kv_grid, topk, _ = WRAPPER_CASES[name]
    kv = kv_grid or grid
    q = grid.tile(torch.randn(1, 1, grid.num_tokens, 16))
    k, v = (kv.tile(torch.randn(1, 1, kv.num_tokens, 16)) for _ in range(2))
    outs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
        outs[backend] = vidsparse.video_sparse_attn(
            q, k, v, grid, kv_grid=kv_grid, topk=topk, tiled=True
        )
    ref = _brute_force(
        *(g.untile(x.double(), dim=-2) for x, g in ((q, grid), (k, kv), (v, kv))), None,
        [grid], [kv], N=0, compete=False, causal=False, topk=topk, sparsity=None,
        scale=16**-0.5,
    )  # fmt: skip
    assert_rel_l2("triton vs torch", outs["triton"], outs["torch"], 1e-5)
    for backend, o in outs.items():
        assert_rel_l2(backend, o.double(), grid.tile(ref, dim=-2), 1e-5)


def _gpu_wrapper_vs_torch(monkeypatch, name, *, bshd, H=2, D=128, scale=1.0):
    """bf16 Triton route vs the torch backend in fp32, tile-structured q and k (no near-tie
    selections), the peer's layout (tiled, padding zero)."""
    grid, kv_grid, topk, gated = WRAPPER_CASES[name]
    kv = kv_grid or grid
    q = _structured(torch.randn(1, H, grid.num_tokens, D), [grid], 0) * scale
    k = _structured(torch.randn(1, H, kv.num_tokens, D), [kv], 0) * scale
    v = torch.randn_like(k) * scale
    gate = torch.randn_like(q) * 0.1
    raw = [grid.tile(q), kv.tile(k), kv.tile(v), grid.tile(gate)][: 4 if gated else 3]
    view = (lambda x: x.transpose(1, 2)) if bshd else (lambda x: x)
    xs = [view(x).contiguous().cuda().bfloat16().requires_grad_(True) for x in raw]
    ref_in = [x.detach().float().requires_grad_(True) for x in xs]

    def run(ins):
        gate_arg = view(ins[3]) if gated else None
        o = vidsparse.video_sparse_attn(
            *(view(x) for x in ins[:3]), grid, kv_grid=kv_grid, topk=topk, gate=gate_arg,
            tiled=True,
        )  # fmt: skip
        return view(o)

    monkeypatch.setenv("VIDSPARSE_BACKEND", "triton")
    o = run(xs)
    monkeypatch.setenv("VIDSPARSE_BACKEND", "torch")
    ref = run(ref_in)
    check_bf16_against_fp32(o, ref, xs, ref_in)


@pytest.mark.gpu
@pytest.mark.parametrize("bshd", [False, True], ids=["bhsd", "bshd"])
@pytest.mark.parametrize("name", sorted(WRAPPER_CASES))
def test_gpu_wrapper_bf16_matches_torch_backend(monkeypatch, name, bshd):
    """F08-19, F22-26, F50 at the peer's geometry (B1 H2 D128 bf16), both layouts."""
    _gpu_wrapper_vs_torch(monkeypatch, name, bshd=bshd)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["F22", "F23-24", "F25-26"])
def test_gpu_wrapper_bf16_many_heads(monkeypatch, name):
    """F22-26 with the peer's H = 8."""
    _gpu_wrapper_vs_torch(monkeypatch, name, bshd=False, H=8)


# ---- F20: forward without grad == forward with grad, bit for bit ---------------------------


def _no_grad_equals_grad(grid, kv_grid, topk, dtype, device, D):
    kv = kv_grid or grid
    q = grid.tile(torch.randn(1, 2, grid.num_tokens, D)).to(device=device, dtype=dtype)
    k, v = (kv.tile(torch.randn(1, 2, kv.num_tokens, D)).to(device=device, dtype=dtype)
            for _ in range(2))  # fmt: skip
    with torch.no_grad():
        o_inference = vidsparse.video_sparse_attn(
            q, k, v, grid, kv_grid=kv_grid, topk=topk, tiled=True
        )
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_train = vidsparse.video_sparse_attn(*xs, grid, kv_grid=kv_grid, topk=topk, tiled=True)
    assert o_train.requires_grad
    assert torch.equal(o_inference, o_train.detach())


F20_CASES = {
    "F20-256-kv-grid": (_g((4, 8, 24), T256), _g((4, 13, 16), T256), 2),  # kv [256,256,160,160]
    "F20-64-one-grid": (_g((5, 9, 13)), None, 3),
}


@pytest.mark.parametrize("name", sorted(F20_CASES))
def test_no_grad_forward_equals_grad_forward_torch_backend(torch_backend, name):
    """F20 on the torch backend (fp32)."""
    _no_grad_equals_grad(*F20_CASES[name], torch.float32, "cpu", 16)


@interpreter
@cpu_only
@pytest.mark.parametrize("name", sorted(F20_CASES))
def test_no_grad_forward_equals_grad_forward_triton_interpreter(triton_backend, name):
    """F20 on the Triton route (fp32, interpreter)."""
    _no_grad_equals_grad(*F20_CASES[name], torch.float32, "cpu", 16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(F20_CASES))
def test_gpu_no_grad_forward_equals_grad_forward(triton_backend, name):
    """F20 at the peer's geometry: bf16, D = 128."""
    _no_grad_equals_grad(*F20_CASES[name], torch.bfloat16, "cuda", 128)


# ---- F21: the engine at 256-token blocks returns lse [B, H, Sq] ----------------------------


def _engine_256_lse(dtype, device, H, D):
    """3 q blocks, 4 kv blocks of 256 with the peer's literal kv sizes, every q block on the
    first 2 kv blocks; o and lse [B, H, Sq] vs fp64 masked dense."""
    B, NQ, NK, blk = 1, 3, 4, 256
    q = torch.randn(B, H, NQ * blk, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, H, NK * blk, D, dtype=dtype, device=device) for _ in range(2))
    idx = torch.tensor([0, 1], dtype=torch.int32, device=device).expand(B, H, NQ, 2).contiguous()
    cnt = torch.full((B, H, NQ), 2, dtype=torch.int32, device=device)
    sizes = torch.tensor([256, 173, 79, 256], dtype=torch.int32, device=device)
    o, lse = vidsparse.block_sparse_attn(
        q, k, v, idx, cnt, block_size=blk, kv_block_sizes=sizes, return_lse=True
    )
    assert lse.shape == (B, H, NQ * blk) and lse.dtype == torch.float32
    ref_o, ref_lse = masked_dense_attention(
        q.cpu(), k.cpu(), v.cpu(), idx.cpu(), cnt.cpu(), blk, blk, sizes.cpu()
    )
    bound = 1e-10 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 3e-2)
    assert_rel_l2("o", o.double().cpu(), ref_o, bound)
    # lse is fp32 whatever the inputs; bf16 scores move it by about their rounding
    assert_rel_l2("lse", lse.double().cpu(), ref_lse, 1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_engine_256_blocks_lse_is_bhs_torch_backend(torch_backend):
    """F21 on the torch backend."""
    _engine_256_lse(torch.float64, "cpu", 2, 16)


@interpreter
@cpu_only
def test_engine_256_blocks_lse_is_bhs_triton_interpreter(triton_backend):
    """F21 on the Triton engine (interpreter)."""
    _engine_256_lse(torch.float32, "cpu", 1, 16)


@pytest.mark.gpu
def test_gpu_engine_256_blocks_lse_is_bhs(triton_backend):
    """F21 at the peer's geometry (H2 D128 bf16)."""
    _engine_256_lse(torch.bfloat16, "cuda", 2, 128)


# ---- F27, F28: device canonicalisation of the tiling-metadata cache ------------------------


def test_unindexed_device_resolves_to_the_current_index(monkeypatch):
    """F27: "cuda" without an index resolves to the current device's index (the cache key),
    so "cuda" and "cuda:<current>" share one entry; explicit indices and CPU stay as they are.
    Checked on CPU by standing in for torch.cuda.current_device."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _canonical_device("cuda") == torch.device("cuda", 3)
    assert _canonical_device(torch.device("cuda")) == _canonical_device("cuda:3")
    assert hash(_canonical_device("cuda")) == hash(torch.device("cuda:3"))
    assert _canonical_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _canonical_device("cuda") == torch.device("cuda", 1)
    assert _canonical_device(None) == torch.device("cpu")
    assert _canonical_device("cpu") == torch.device("cpu")


@pytest.mark.gpu
def test_gpu_unindexed_cuda_shares_the_cache_entry():
    """F27 on a GPU: index tensors for "cuda" are the cached ones of "cuda:<current>"."""
    grid = VideoGrid((5, 9, 13))
    current = torch.cuda.current_device()
    a = grid.index_tensors("cuda")
    b = grid.index_tensors(f"cuda:{current}")
    assert a.gather_index is b.gather_index
    assert a.gather_index.device == torch.device("cuda", current)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_metadata_cache_isolated_between_devices():
    """F28: metadata built for device 0 and device 1 lands on that device, also when the
    device is named without an index under ``torch.cuda.device(i)``."""
    grid = VideoGrid((7, 10, 9))
    per_device = []
    for i in (0, 1):
        with torch.cuda.device(i):
            meta = grid.index_tensors("cuda")
        assert meta.gather_index.device == torch.device("cuda", i)
        assert grid.tile_sizes_on(f"cuda:{i}").device == torch.device("cuda", i)
        per_device.append(meta)
    assert per_device[0].gather_index is not per_device[1].gather_index
    torch.testing.assert_close(per_device[0].gather_index.cpu(), per_device[1].gather_index.cpu())


# ---- F50, F51: 4x8x8 tiles; tile volumes the Triton path refuses ---------------------------


def test_grid_4x8x8_tiles_and_sizes(torch_backend):
    """F50 (and F49's 2x4x8): (6, 8, 16) in 4x8x8 tiles -> tiles (2, 1, 2), volume 256,
    sizes [256, 256, 128, 128]; in 2x4x8 tiles -> (3, 2, 2), volume 64. The VSA run on this
    grid is WRAPPER_CASES["F50"]."""
    grid = VideoGrid((6, 8, 16), T256)
    assert grid.tiles == (2, 1, 2) and grid.tile_volume == 256 and grid.padded_len == 1024
    assert grid.tile_sizes.tolist() == [256, 256, 128, 128]
    assert int(grid.tile_sizes.sum()) == grid.num_tokens
    small = VideoGrid((6, 8, 16), (2, 4, 8))
    assert small.tiles == (3, 2, 2) and small.tile_volume == 64


@pytest.mark.parametrize("kv", [False, True], ids=["one-grid", "kv-grid"])
def test_triton_refuses_a_tile_volume_it_cannot_tile(triton_backend, kv):
    """F51: a 3x3x3 tile (volume 27) is refused on the Triton path with a ValueError naming
    the volume, before any launch, on the one-grid path and the kv_grid path."""
    grid = VideoGrid((6, 6, 6), (3, 3, 3))
    kv_grid = VideoGrid((9, 6, 6), (3, 3, 3)) if kv else None
    q = torch.randn(1, 1, grid.num_tokens, 16)
    k = v = torch.randn(1, 1, (kv_grid or grid).num_tokens, 16)
    with pytest.raises(ValueError, match="volume 27"):
        vidsparse.video_sparse_attn(q, k, v, grid, kv_grid=kv_grid, topk=2)


def test_torch_backend_takes_any_tile_volume(torch_backend):
    """F51's other half: the torch backend runs a 3x3x3 tile (and matches the brute force)."""
    grid, kv_grid = VideoGrid((6, 7, 5), (3, 3, 3)), VideoGrid((8, 6, 6), (3, 3, 3))
    xs = [torch.randn(1, 2, g.num_tokens, 16, dtype=torch.float64, requires_grad=True)
          for g in (grid, kv_grid, kv_grid)]  # fmt: skip
    o = vidsparse.video_sparse_attn(*xs, grid, kv_grid=kv_grid, topk=3)
    ref_in = [x.detach().clone().requires_grad_(True) for x in xs]
    ref = _brute_force(*ref_in, None, [grid], [kv_grid], N=0, compete=False, causal=False,
                       topk=3, sparsity=None, scale=0.25)  # fmt: skip
    _check(o, ref, xs, ref_in, 1e-10, 1e-9)


# ---- F57-F71: packed variable-length sequences ---------------------------------------------
# name: (per-sequence (q blocks, kv blocks), top-k, H, D, q blocks full)
VARLEN = {
    "F57-F66-equal": ([(4, 4), (4, 4)], 2, 2, 16, False),
    "F58-F67-different": ([(2, 3), (5, 4), (3, 6)], 2, 2, 16, False),
    "F59-F68-single": ([(8, 8)], 2, 2, 16, False),
    "F60-F69-many-heads": ([(3, 4), (5, 3)], 2, 16, 128, False),
    "F61-many-sequences": ([(i + 2, i + 3) for i in range(8)], 2, 2, 16, False),
    "F62-topk-above-blocks": ([(3, 3), (4, 4)], 8, 2, 16, False),
    "F63-one-block-each": ([(1, 1)] * 3, 1, 2, 16, False),
    "F64-F70-asymmetric": ([(1, 8), (8, 1)], 1, 2, 16, False),
    "F65-full-q-blocks": ([(3, 4)], 2, 4, 16, True),
}
BLK = 64


def _varlen_inputs(name, *, dtype, device, H=None, D=None):
    """One packed sequence: the sequences' 64-slot blocks one after the other (q real sizes
    and kv real sizes drawn U[16, 64] independently, the rest padding holding noise), lists
    block-diagonal (each q block picks exactly min(topk, nkv) random kv blocks of its own
    sequence)."""
    seqs, topk, H0, D0, full_q = VARLEN[name]
    H, D = H or H0, D or D0
    NQ, NK = sum(s[0] for s in seqs), sum(s[1] for s in seqs)
    K = max(min(topk, nk) for _, nk in seqs)
    idx = torch.zeros(1, H, NQ, K, dtype=torch.int32)
    cnt = torch.zeros(1, H, NQ, dtype=torch.int32)
    qo = ko = 0
    for nq, nk in seqs:
        kk = min(topk, nk)
        pick = torch.rand(1, H, nq, nk).argsort(-1)[..., :kk].sort(-1).values + ko
        idx[:, :, qo : qo + nq, :kk] = pick.int()
        cnt[:, :, qo : qo + nq] = kk
        qo, ko = qo + nq, ko + nk
    q_sizes = torch.full((NQ,), BLK) if full_q else torch.randint(16, BLK + 1, (NQ,))
    kv_sizes = torch.randint(16, BLK + 1, (NK,), dtype=torch.int32)
    q, k, v = (torch.randn(1, H, n * BLK, D, dtype=torch.float64) for n in (NQ, NK, NK))
    q_real = torch.arange(NQ * BLK) % BLK < q_sizes.repeat_interleave(BLK)
    to = dict(device=device)
    xs = [x.to(dtype=dtype, **to).requires_grad_(True) for x in (q, k, v)]
    return seqs, xs, idx.to(**to), cnt.to(**to), kv_sizes.to(**to), q_real.to(**to)


def _per_sequence_reference(seqs, qkv, idx, cnt, kv_sizes):
    """The peer's reference design: one (fp64, masked-dense) call per sequence, concatenated."""
    q, k, v = qkv
    outs, qo, ko = [], 0, 0
    for nq, nk in seqs:
        qs, ks = slice(qo * BLK, (qo + nq) * BLK), slice(ko * BLK, (ko + nk) * BLK)
        kk = int(cnt[0, 0, qo])
        local = (idx[:, :, qo : qo + nq, :kk] - ko).contiguous()
        o, _ = masked_dense_attention(
            q[:, :, qs], k[:, :, ks], v[:, :, ks], local, cnt[:, :, qo : qo + nq],
            BLK, BLK, kv_sizes[ko : ko + nk],
        )  # fmt: skip
        outs.append(o)
        qo, ko = qo + nq, ko + nk
    return torch.cat(outs, dim=2)


def _check_varlen(name, *, dtype, device, bound_o, bound_g, H=None, D=None):
    seqs, xs, idx, cnt, kv_sizes, q_real = _varlen_inputs(
        name, dtype=dtype, device=device, H=H, D=D
    )
    o = vidsparse.block_sparse_attn(*xs, idx, cnt, block_size=BLK, kv_block_sizes=kv_sizes)
    ref_in = [x.detach().double().cpu().requires_grad_(True) for x in xs]
    ref = _per_sequence_reference(seqs, ref_in, idx.cpu(), cnt.cpu(), kv_sizes.cpu())
    real = q_real.cpu().view(1, 1, -1, 1)
    assert not torch.isnan(o).any()
    assert_rel_l2("o (real rows)", (o.double().cpu() * real), ref * real, bound_o)
    do = torch.randn_like(ref) * real  # padded q rows are dropped: no gradient from them
    grads = torch.autograd.grad(o, xs, do.to(device=device, dtype=dtype))
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not torch.isnan(g).any(), gname
        assert_rel_l2(gname, g.double().cpu(), r, bound_g)


@pytest.mark.parametrize("name", sorted(VARLEN))
def test_varlen_engine_torch_backend_matches_per_sequence(torch_backend, name):
    """F57-F70: packed sequences on the engine (block-diagonal lists, per-block kv sizes), fwd
    and dq dk dv vs one fp64 masked-dense call per sequence, concatenated."""
    _check_varlen(name, dtype=torch.float64, device="cpu", bound_o=1e-10, bound_g=1e-9)


INTERPRETER_VARLEN = ["F58-F67-different", "F62-topk-above-blocks", "F64-F70-asymmetric",
                      "F65-full-q-blocks"]  # fmt: skip


@interpreter
@cpu_only
@pytest.mark.parametrize("name", INTERPRETER_VARLEN)
def test_varlen_engine_triton_interpreter_matches_per_sequence(triton_backend, name):
    """F58, F62, F64, F65, F67, F70 on the Triton engine (fp32, H1 D16)."""
    _check_varlen(name, dtype=torch.float32, device="cpu", bound_o=1e-5, bound_g=1e-4, H=1)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(VARLEN))
def test_gpu_varlen_engine_bf16_matches_per_sequence(triton_backend, name):
    """F57-F70 at the peer's geometry (H8 D64; F60/F69 H16 D128), bf16."""
    H, D = (None, None) if "many-heads" in name else (8, 64)
    _check_varlen(name, dtype=torch.bfloat16, device="cuda", bound_o=3e-2, bound_g=6e-2,
                  H=H, D=D)  # fmt: skip


@pytest.mark.parametrize("backend", ["torch_backend", pytest.param(
    "triton_backend", marks=[interpreter, cpu_only])])  # fmt: skip
def test_varlen_engine_grads_of_packed_leaves_are_nonzero(request, backend):
    """F71: one sequence (3, 4), leaf tensors packed directly: every real q row and every
    real key of a listed kv block gets a non-zero gradient; padding keys get none."""
    request.getfixturevalue(backend)
    seqs, xs, idx, cnt, kv_sizes, q_real = _varlen_inputs("F65-full-q-blocks", dtype=torch.float32,
                                                          device="cpu", H=1)  # fmt: skip
    o = vidsparse.block_sparse_attn(*xs, idx, cnt, block_size=BLK, kv_block_sizes=kv_sizes)
    (o * q_real.view(1, 1, -1, 1)).square().sum().backward()
    q, k, v = xs
    assert all(x.grad is not None for x in xs)
    assert (q.grad[0, 0, q_real].abs().sum(-1) > 0).all()
    listed = torch.zeros(4, dtype=torch.bool)
    listed[idx[0, 0][torch.arange(idx.shape[-1]) < cnt[0, 0, :, None]].long()] = True
    real_k = torch.arange(4 * BLK) % BLK < kv_sizes.repeat_interleave(BLK)
    live = real_k & listed.repeat_interleave(BLK)
    assert (k.grad[0, 0, live].abs().sum(-1) > 0).all()
    assert (v.grad[0, 0, live].abs().sum(-1) > 0).all()
    assert (k.grad[0, 0, ~live] == 0).all() and (v.grad[0, 0, ~live] == 0).all()


# The same configurations as VSA packed batches: per sequence a q grid and a kv grid of their
# own (tile 4x4x4; q tiles [48, .., 36] and kv tiles [48, .., 24], so q and kv never share a
# tiling), the selection by VSA itself; reference: the brute force (per-video masking) and
# the per-video calls, concatenated.


def _varlen_grids(name):
    seqs, topk, *_ = VARLEN[name]
    grids = [VideoGrid((3, 4, 4 * nq - 1)) for nq, _ in seqs]
    kv_grids = [VideoGrid((4, 3, 4 * nk - 2)) for _, nk in seqs]
    return grids, kv_grids, topk


def _varlen_vsa(name, *, dtype, H, D):
    grids, kv_grids, topk = _varlen_grids(name)
    Sq, Sk = (sum(g.num_tokens for g in gs) for gs in (grids, kv_grids))
    raw = [torch.randn(1, H, s, D, dtype=torch.float64) for s in (Sq, Sk, Sk)]
    xs = [x.to(dtype).requires_grad_(True) for x in raw]
    o = vidsparse.video_sparse_attn(*xs, grids, kv_grid=kv_grids, topk=topk)
    ref_in = [x.detach().double().requires_grad_(True) for x in xs]
    ref = _brute_force(*ref_in, None, grids, kv_grids, N=0, compete=False, causal=False,
                       topk=topk, sparsity=None, scale=D**-0.5)  # fmt: skip
    return o, ref, xs, ref_in, grids, kv_grids, topk


@pytest.mark.parametrize("name", sorted(VARLEN))
def test_varlen_vsa_packed_torch_backend(torch_backend, name):
    """F57-F70 at the VSA level (packed grid lists, kv_grid lists): brute force, and equal to
    one call per video, concatenated (the peer's reference design)."""
    H, D = (4, 32) if "many-heads" in name else (2, 16)
    o, ref, xs, ref_in, grids, kv_grids, topk = _varlen_vsa(name, dtype=torch.float64, H=H, D=D)
    parts, qo, ko = [], 0, 0
    for g, kg in zip(grids, kv_grids):
        qs, ks = slice(qo, qo + g.num_tokens), slice(ko, ko + kg.num_tokens)
        q, k, v = (x.detach() for x in xs)
        parts.append(vidsparse.video_sparse_attn(q[:, :, qs], k[:, :, ks], v[:, :, ks], g,
                                                 kv_grid=kg, topk=topk))  # fmt: skip
        qo, ko = qo + g.num_tokens, ko + kg.num_tokens
    torch.testing.assert_close(o.detach(), torch.cat(parts, 2), rtol=1e-12, atol=1e-12)
    _check(o, ref, xs, ref_in, 1e-10, 1e-9)


@interpreter
@cpu_only
def test_varlen_vsa_packed_triton_interpreter(triton_backend):
    """F58, F67 at the VSA level on the Triton route (fp32)."""
    o, ref, xs, ref_in, *_ = _varlen_vsa("F58-F67-different", dtype=torch.float32, H=1, D=16)
    _check(o, ref, xs, ref_in, 1e-5, 1e-4)


# ---- Appendix A: test_fused_compress_topk.py (block mean, top-k) ---------------------------


def _python_topk(row, k):
    """The rule by definition: highest scores first, ties to the smaller index."""
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))
    return sorted(order[:k])


def _assert_lists_follow_the_rule(scores, topk):
    idx, cnt = vidsparse.topk_lists(scores, topk)
    k = min(topk, scores.shape[-1])
    assert (cnt == k).all()  # exactly k per row
    flat_s, flat_i = scores.reshape(-1, scores.shape[-1]), idx.reshape(-1, idx.shape[-1])
    for row, got in zip(flat_s.tolist(), flat_i.tolist()):
        assert got[:k] == _python_topk(row, k)


@pytest.mark.parametrize("topk", [1, 3, 5, 8])
def test_topk_all_equal_row(torch_backend, topk):
    """A: TestFusedTopkMaskTies all-equal row: exactly k, the k smallest indices."""
    _assert_lists_follow_the_rule(torch.zeros(1, 1, 1, 8), topk)


def test_topk_two_tied_maxima(torch_backend):
    """A: two tied maxima with k = 1 -> exactly one, the smaller index."""
    scores = torch.tensor([0.1, 0.9, 0.3, 0.9, 0.2, 0.0, -1.0, 0.5]).view(1, 1, 1, 8)
    idx, cnt = vidsparse.topk_lists(scores, 1)
    assert cnt.item() == 1 and idx[0, 0, 0, 0].item() == 1


@pytest.mark.parametrize("topk", [1, 2, 3, 4, 7, 8])
def test_topk_tie_cluster_at_the_boundary(torch_backend, topk):
    """A: a tied cluster straddling the k-th place."""
    scores = torch.tensor([5.0, 2.0, 2.0, 9.0, 2.0, 1.0, 2.0, 0.0]).view(1, 1, 1, 8)
    _assert_lists_follow_the_rule(scores, topk)


def test_topk_tie_heavy_batch_and_heads(torch_backend):
    """A: batch x heads of tie-heavy rows (few distinct values)."""
    scores = torch.randint(0, 3, (2, 4, 16, 16)).float()
    for topk in (1, 4, 9):
        _assert_lists_follow_the_rule(scores, topk)


def test_topk_random_bf16_scores_exact_count_and_torch_topk_set(torch_backend):
    """A: TestFusedTopkMaskEquivalence: exactly k per row on random bf16 scores; on distinct
    scores the set equals torch.topk's."""
    scores = torch.randn(2, 4, 32, 32).bfloat16()
    idx, cnt = vidsparse.topk_lists(scores, 5)
    assert (cnt == 5).all()
    distinct = torch.randperm(2 * 4 * 32 * 32).view(2, 4, 32, 32).double()
    idx, cnt = vidsparse.topk_lists(distinct, 5)
    expected = torch.topk(distinct, 5, dim=-1).indices.sort(-1).values
    assert torch.equal(idx.long(), expected)


def _means_by_sizes(x_tiled, grid):
    """The peer's formula: the sum of all V slots of a tile / its real count (padding zero)."""
    B, H, _, D = x_tiled.shape
    slots = x_tiled.double().view(B, H, grid.num_tiles, grid.tile_volume, D)
    return slots.sum(-2) / grid.tile_sizes.double().view(-1, 1)


def test_block_mean_matches_the_sum_over_real_count(torch_backend):
    """A: TestFusedBlockMeanEquivalence (B2 H4, tiles of 64 with partial sizes 18 .. 64):
    with zero padding the peer's sum-of-all-slots / real-count; padding contents ignored."""
    grid = VideoGrid((5, 9, 14))  # partial tiles on every axis
    x = torch.randn(2, 4, grid.num_tokens, 32)
    x_t = grid.tile(x)
    expected = _means_by_sizes(x_t, grid)
    assert_rel_l2("natural", vidsparse.block_mean(x, grid).double(), expected, 1e-6)
    assert_rel_l2("tiled", vidsparse.block_mean(x_t, grid, tiled=True).double(), expected, 1e-6)
    noisy = torch.where(grid.real_token_mask().view(1, 1, -1, 1), x_t, torch.randn_like(x_t))
    assert_rel_l2("noisy padding", vidsparse.block_mean(noisy, grid, tiled=True).double(),
                  expected, 1e-6)  # fmt: skip
    bf = vidsparse.block_mean(x.bfloat16(), grid)
    assert_rel_l2("bf16", bf.double(), _means_by_sizes(grid.tile(x.bfloat16()), grid), 1e-6)


@pytest.mark.parametrize("shape", [(5, 9, 14), (5, 5, 5)], ids=["sizes-18-64", "sizes-1-64"])
def test_block_mean_backward_and_through_coarse_softmax(torch_backend, shape):
    """A: TestFusedBlockMeanBackward: gradient parity with autograd of the formula (sizes
    down to 1 token), alone and through block_mean -> coarse softmax -> output."""
    grid = VideoGrid(shape)
    q, k, v = (grid.tile(torch.randn(1, 2, grid.num_tokens, 16, dtype=torch.float64))
               .requires_grad_(True) for _ in range(3))  # fmt: skip
    real = grid.real_token_mask().view(1, 1, -1, 1)

    def chain(mean):
        qc, kc, vc = (mean(x) for x in (q, k, v))
        return torch.softmax(qc @ kc.transpose(-1, -2) * 0.25, -1) @ vc

    do = torch.randn(1, 2, grid.num_tiles, 16, dtype=torch.float64)
    got = torch.autograd.grad(chain(lambda x: vidsparse.block_mean(x, grid, tiled=True)),
                              (q, k, v), do)  # fmt: skip
    want = torch.autograd.grad(chain(lambda x: _means_by_sizes(x * real, grid)), (q, k, v), do)
    for name, g, w in zip("qkv", got, want):
        assert_rel_l2(f"d{name}", g, w, 1e-12)
        assert (g * ~real == 0).all()  # padding slots get no gradient (vidsparse's rule)


def test_primitive_selection_agrees_with_fp64_at_h16_32_tiles(torch_backend):
    """A: TestVideoSparseAttnEquivalence: coarse scores from block_mean match the brute-force
    tile means; exactly k per row; bf16 inputs select the fp64 rows' tiles >= 99%."""
    grid = VideoGrid((8, 16, 16))  # 32 tiles of 64
    q, k = (add_tile_structure(torch.randn(1, 16, grid.num_tokens, 32, dtype=torch.float64),
                               grid, 1.0, tiled=False) for _ in range(2))  # fmt: skip
    tiles, _ = _token_tiles(grid)  # tile of every token, from its coordinates
    member = (tiles.view(1, -1) == torch.arange(grid.num_tiles).view(-1, 1)).double()
    ref_scores = (member / member.sum(1, keepdim=True) @ q) @ (
        member / member.sum(1, keepdim=True) @ k
    ).transpose(-1, -2)
    scores = vidsparse.block_mean(q, grid) @ vidsparse.block_mean(k, grid).transpose(-1, -2)
    assert_rel_l2("scores", scores, ref_scores, 1e-12)
    ref_idx, _ = vidsparse.topk_lists(ref_scores, 4)
    qb, kb = (vidsparse.block_mean(x.bfloat16(), grid) for x in (q, k))
    idx, cnt = vidsparse.topk_lists(qb @ kb.transpose(-1, -2), 4)
    assert (cnt == 4).all()
    agree = (idx.sort(-1).values == ref_idx.sort(-1).values).all(-1).double().mean()
    assert agree >= 0.99, f"row agreement {agree:.4f}"
    assert math.isfinite(float(scores.sum()))
