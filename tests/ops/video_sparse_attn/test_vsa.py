"""Public VSA on the Triton path (fused coarse stage + engine) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

import vidsparse
from vidsparse.ops.video_sparse_attn import video_sparse_attn_ref
from vidsparse.testing import add_tile_structure, assert_rel_l2


def _inputs(B, H, grid, D, *, dtype, device, scale=1.0, tiled=False, tile_structure=0.0):
    S = grid.padded_len if tiled else grid.num_tokens
    xs = [torch.randn(B, H, S, D, device=device) * scale for _ in range(4)]
    if tile_structure:  # q and k: no near-tie top-k decisions (see add_tile_structure)
        xs[:2] = [add_tile_structure(x, grid, tile_structure * scale, tiled=tiled) for x in xs[:2]]
    xs[3] = xs[3] / scale  # the gate stays O(1)
    return [x.to(dtype).requires_grad_(True) for x in xs]


def _compare(
    grid, *, B, H, D, dtype, device, topk, tiled, scale=1.0, bound_o, bound_g, tile_structure=0.0
):
    q, k, v, gate = _inputs(
        B, H, grid, D, dtype=dtype, device=device, scale=scale, tiled=tiled,
        tile_structure=tile_structure,
    )  # fmt: skip
    o = vidsparse.video_sparse_attn(q, k, v, grid, topk=topk, gate=gate, tiled=tiled)
    ref = video_sparse_attn_ref(
        *(x.float() for x in (q, k, v)), grid, topk=topk, gate=gate.float(), tiled=tiled
    )
    assert_rel_l2("o", o.float(), ref, bound_o)
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(o, (q, k, v, gate), do.to(dtype))
    ref_grads = torch.autograd.grad(ref, (q, k, v, gate), do)
    for name, g, r in zip(("dq", "dk", "dv", "dgate"), grads, ref_grads):
        assert_rel_l2(name, g.float(), r, bound_g)
    if tiled:  # padding rows of the output are zero
        assert (o[:, :, ~grid.real_token_mask(o.device)] == 0).all()


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("tiled", [False, True])
def test_vsa_triton_interpreter_matches_reference(triton_backend, tiled):
    grid = vidsparse.VideoGrid((5, 6, 7))  # 8 partial tiles
    _compare(
        grid,
        B=2,
        H=2,
        D=16,
        dtype=torch.float32,
        device="cpu",
        topk=3,
        tiled=tiled,
        bound_o=1e-5,
        bound_g=1e-4,
    )


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("tiled", [False, True])
def test_vsa_triton_interpreter_without_gate(triton_backend, tiled):
    """o = o_fine + o_coarse: the backward's fused preprocess sums do per tile itself; with
    tiled inputs, do on padding rows (random here) must carry no gradient."""
    grid = vidsparse.VideoGrid((5, 6, 7))
    S = grid.padded_len if tiled else grid.num_tokens
    q, k, v = (torch.randn(2, 2, S, 16, requires_grad=True) for _ in range(3))
    o = vidsparse.video_sparse_attn(q, k, v, grid, topk=3, tiled=tiled)
    ref = video_sparse_attn_ref(q, k, v, grid, topk=3, tiled=tiled)
    assert_rel_l2("o", o, ref, 1e-5)
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_rel_l2(name, g, r, 1e-4)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_vsa_backward_runs_the_coarse_attention_backward_once(triton_backend, monkeypatch):
    """The coarse branch's backward is fused into the fine stage's: the coarse stage's own
    backward must not run as well (it would redo the work and add zeros)."""
    import vidsparse.ops.video_sparse_attn.coarse as coarse
    import vidsparse.ops.video_sparse_attn.fine as fine

    calls, original = [], coarse.coarse_attn_bwd

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(coarse, "coarse_attn_bwd", counting)
    monkeypatch.setattr(fine, "coarse_attn_bwd", counting)
    grid = vidsparse.VideoGrid((5, 6, 7))
    x = [torch.randn(1, 2, grid.padded_len, 16, requires_grad=True) for _ in range(4)]
    o = vidsparse.video_sparse_attn(*x[:3], grid, topk=3, gate=x[3], tiled=True)
    torch.autograd.grad(o, x, torch.randn_like(o))
    assert len(calls) == 1


def _grads_by_query_walks(grid, x, do, tiled, monkeypatch):
    """VSA's gradients with dK/dV's short query walks (its config row with ``query_tails``)
    and without them, and the walks' rows (``bwd._query_walks``) of the first run: taken, so
    the comparison means something."""
    from dataclasses import replace

    import vidsparse.ops.block_sparse_attn.bwd as bwd
    from vidsparse.ops.block_sparse_attn import configs
    from vidsparse.utils.device import target_of

    walks, original = [], bwd._query_walks
    monkeypatch.setattr(bwd, "_query_walks", lambda *a: walks.append(original(*a)) or walks[-1])
    target, D = target_of(x[0].device), x[0].shape[-1]
    row = configs.lookup(target, "bwd_dkdv", grid.tile_volume, grid.tile_volume, D, masked=True)
    grads = []
    for cfg in (replace(row, query_tails=True), replace(row, query_tails=False)):
        with configs.override(bwd_dkdv=cfg):
            o = vidsparse.video_sparse_attn(*x[:3], grid, topk=3, gate=x[3], tiled=tiled)
            grads.append(torch.autograd.grad(o, x, do))
    return grads, walks[0][1]


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("tiled", [False, True])
def test_vsa_dkdv_short_query_walks_match_all_rows(triton_backend, tiled, monkeypatch):
    """dK/dV walks a query tile of at most 32 or 16 real rows with that many (VSA's epilogue
    quiets its padding rows): the gradients of the all-rows walk, on tiles of every size
    (64, 48, 32, 24, 16, 12, 8, 6 rows)."""
    grid = vidsparse.VideoGrid((5, 6, 7))
    S = grid.padded_len if tiled else grid.num_tokens
    x = [torch.randn(1, 2, S, 16, requires_grad=True) for _ in range(4)]
    do = torch.randn(1, 2, S, 16)
    (walked, all_rows), tails = _grads_by_query_walks(grid, x, do, tiled, monkeypatch)
    assert tails == (32, 16)
    for name, a, b in zip(("dq", "dk", "dv", "dgate"), walked, all_rows):
        assert_rel_l2(name, a, b, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("tiled", [False, True])
def test_vsa_gpu_dkdv_short_query_walks_match_all_rows(tiled, monkeypatch):
    """The same on the GPU at D=128 in bf16 with the device's dK/dV row (Hopper: 4 warps, where
    the walks compile with a few scalar spills and no serialised wgmma), and against the
    reference."""
    grid = vidsparse.VideoGrid((9, 14, 22))  # query tiles of 64, 48, 32, 24, 16, 12, 8 rows...
    x = _inputs(2, 4, grid, 128, dtype=torch.bfloat16, device="cuda", tiled=tiled,
                tile_structure=1.0)  # fmt: skip
    S = x[0].shape[2]
    do = torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16)
    (walked, all_rows), tails = _grads_by_query_walks(grid, x, do, tiled, monkeypatch)
    assert tails == (32, 16)
    ref = video_sparse_attn_ref(*(t.float() for t in x[:3]), grid, topk=3, gate=x[3].float(),
                                tiled=tiled)  # fmt: skip
    ref_grads = torch.autograd.grad(ref, x, do.float())
    for name, a, b, r in zip(("dq", "dk", "dv", "dgate"), walked, all_rows, ref_grads):
        assert_rel_l2(name, a.float(), b.float(), 5e-3)
        assert_rel_l2(name + " vs reference", a.float(), r, 6e-2)


@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_recomputed_o_fine_costs_delta_no_more_than_storing_it_in_bf16(scale):
    """The backward recomputes ``o_fine = o - gate * o_coarse`` from the bf16 output instead of
    storing o_fine in bf16: ``delta = rowsum(o_fine * do)`` must come out about as accurate."""
    gen = torch.Generator().manual_seed(0)
    n, D = 4096, 128
    o_fine = (torch.randn(n, D, generator=gen, dtype=torch.float64) * scale * 0.3
              + torch.randn(n, D, generator=gen, dtype=torch.float64) * scale / 8)  # fmt: skip
    oc = torch.randn(n, D, generator=gen, dtype=torch.float64) * scale / 8
    gate = torch.randn(n, D, generator=gen, dtype=torch.float64).bfloat16().double()
    do = torch.randn(n, D, generator=gen, dtype=torch.float64)
    o_bf16 = (o_fine + gate * oc).bfloat16().double()
    exact = (o_fine * do).sum(-1)
    stored = (o_fine.bfloat16().double() * do).sum(-1)
    recomputed = ((o_bf16 - gate * oc.float().double()) * do).sum(-1)
    err_stored = (stored - exact).abs().mean()
    err_recomputed = (recomputed - exact).abs().mean()
    assert err_recomputed <= 1.5 * err_stored


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("tiled", [False, True])
def test_vsa_gpu_bf16_matches_reference(scale, tiled):
    grid = vidsparse.VideoGrid((9, 14, 22))  # partial tiles along every axis: 3x4x6 = 72 tiles
    # bf16 inputs and outputs: a few 1e-3 of relative L2 from rounding. Tile-structured q, k
    # keep the top-k free of near-ties (test_vsa_coarse.py covers the selection itself).
    _compare(
        grid,
        B=2,
        H=4,
        D=128,
        dtype=torch.bfloat16,
        device="cuda",
        topk=9,
        tiled=tiled,
        scale=scale,
        bound_o=3e-2,
        bound_g=6e-2,
        tile_structure=1.0,
    )


def _natural_arms(switch, device, dtype, grid, D, topk, after_arm):
    """Public VSA on natural ``[B, S, H, D]`` inputs with a gate, under
    ``configs.override(switch=True)`` then ``switch=False``: ``(o, dq, dk, dv, dgate)`` of
    each, from the same inputs and output gradient; ``after_arm(value)`` runs after each arm
    (the callers check which arm took which path)."""
    from vidsparse.ops.block_sparse_attn import configs

    torch.manual_seed(0)
    B, H, S = 2, 2, grid.num_tokens
    xs = [torch.randn(B, S, H, D, device=device, dtype=dtype).transpose(1, 2) for _ in range(5)]
    do = xs.pop()
    arms = []
    for value in (True, False):
        leaves = [x.clone().requires_grad_() for x in xs]
        with configs.override(**{switch: value}):
            o = vidsparse.video_sparse_attn(*leaves[:3], grid, topk=topk, gate=leaves[3])
            arms.append((o, *torch.autograd.grad(o, leaves, do)))
        after_arm(value)
    return arms


def _out_rows_arms(device, dtype, grid, D, topk, monkeypatch):
    """``_natural_arms`` of ``out_rows``: o stored by the engine through the q map, and o
    untiled after it. Checks that only the second arm untiles."""
    import vidsparse.ops.video_sparse_attn.interface as vsa_interface

    untiled, original = [], vsa_interface.untile_output
    monkeypatch.setattr(vsa_interface, "untile_output",
                        lambda *a: untiled.append(1) or original(*a))  # fmt: skip

    def check(out_rows):
        assert len(untiled) == (0 if out_rows else 1)

    return _natural_arms("out_rows", device, dtype, grid, D, topk, check)


def _check_out_rows(arms, grads_rounded=False):
    """o (and the gradients, unless ``grads_rounded``) the same bits in both arms; rounded
    gradients: each element within 2 units of its dtype's eps of the other arm's, relative to
    the element or to the tensor's largest."""
    stored, untiled = arms
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), stored, untiled):
        if name == "o" or not grads_rounded:
            assert torch.equal(a, b), name
        else:
            eps = torch.finfo(a.dtype).eps
            torch.testing.assert_close(a, b, rtol=2 * eps, atol=2 * eps * b.abs().max().item(),
                                       msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
    assert stored[0].transpose(1, 2).is_contiguous()  # q's [B, S, H, D] storage


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_vsa_output_stored_in_natural_order_equals_untiling(triton_backend, monkeypatch):
    """Natural order: o stored by the forward through the token map and dO read through it
    by the preprocess give the bits of untiling o and tiling dO, on a grid with partial tiles
    along every axis (the PyTorch backend runs VSA's reference, which has no such switch; the
    engine's custom ops take it on both: ``test_output_rows.py``)."""
    grid = vidsparse.VideoGrid((5, 6, 7))
    _check_out_rows(_out_rows_arms("cpu", torch.float32, grid, 16, 3, monkeypatch))


def _check_regather(device, dtype, grid, D, topk):
    """``configs.override(regather=True)``: the backward keeps natural q, k, v and tiles them
    again; the same bits as keeping the tile copies, and the copies' padding rows no longer
    kept (three ``[B, H, padded_len - num_tokens, D]`` blocks of bytes less)."""
    from vidsparse.ops.block_sparse_attn import configs

    B, H, S = 2, 2, grid.num_tokens
    xs = [torch.randn(B, S, H, D, device=device, dtype=dtype).transpose(1, 2) for _ in range(5)]
    do = xs.pop()
    arms, kept = [], []
    for regather in (True, False):
        leaves = [x.clone().requires_grad_() for x in xs]
        storages = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with configs.override(regather=regather):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                o = vidsparse.video_sparse_attn(*leaves[:3], grid, topk=topk, gate=leaves[3])
            arms.append((o, *torch.autograd.grad(o, leaves, do)))
        kept.append(sum(storages.values()))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), *arms):
        assert torch.equal(a, b), name
    padding = 3 * B * H * (grid.padded_len - grid.num_tokens) * D * xs[0].element_size()
    assert kept[1] - kept[0] == padding


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_vsa_regathered_copies_equal_kept_copies(triton_backend):
    _check_regather("cpu", torch.float32, vidsparse.VideoGrid((5, 6, 7)), 16, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vsa_gpu_regathered_copies_equal_kept_copies(dtype):
    """The same on the GPU at D=128 (the Gluon and TMA kernels read the gathered copies)."""
    _check_regather("cuda", dtype, vidsparse.VideoGrid((9, 14, 22)), 128, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("preprocess_warps", ["plain", "library"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vsa_gpu_output_stored_in_natural_order_equals_untiling(dtype, preprocess_warps,
                                                                 monkeypatch):  # fmt: skip
    """The same on the GPU at D=128 (the Gluon forward's mapped store, the int8 residual).
    The preprocess reading o and dO through the map launches with
    ``configs.preprocess_mapped_warps`` (4 on Hopper, else 8) where the engine-order one takes
    4: with other warps its row sums of o * dO add in another order, so the gradients may
    differ in their last bits ("library"). Launched with 4 ("plain") the two arms give the
    same bits."""
    from vidsparse.ops.block_sparse_attn import configs

    if preprocess_warps == "plain":
        monkeypatch.setattr(configs, "PREPROCESS_MAPPED_WARPS", 4)
        monkeypatch.setattr(configs, "PREPROCESS_MAPPED_WARPS_HOPPER", 4)
    grid = vidsparse.VideoGrid((9, 14, 22))
    arms = _out_rows_arms("cuda", dtype, grid, 128, 9, monkeypatch)
    _check_out_rows(arms, grads_rounded=preprocess_warps == "library")


def _tile_pool_arms(device, dtype, grid, D, topk, monkeypatch):
    """``_natural_arms`` of ``tile_pool``: the tile copies made by the coarse stage's pooling
    read (the library's choice), and by a tiling pass before the pooling. Checks that only the
    first arm takes the fused read."""
    from vidsparse.ops.video_sparse_attn import coarse

    fused, original = [], coarse.tile_pool_fwd
    monkeypatch.setattr(coarse, "tile_pool_fwd", lambda *a: fused.append(1) or original(*a))

    def check(tile_pool):
        assert len(fused) == 1, "the fused read ran in the wrong arm"

    return _natural_arms("tile_pool", device, dtype, grid, D, topk, check)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_vsa_copies_from_the_pooling_read_equal_a_tiling_pass(triton_backend, monkeypatch):
    """Natural order: tiling q, k, v in the pooling's read gives the same bits as tiling them,
    then pooling the copies, on a grid with partial tiles along every axis."""
    arms = _tile_pool_arms("cpu", torch.float32, vidsparse.VideoGrid((5, 6, 7)), 16, 3,
                           monkeypatch)  # fmt: skip
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), *arms):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vsa_gpu_copies_from_the_pooling_read_equal_a_tiling_pass(dtype, monkeypatch):
    """The same at D=128 compiled. The two pooling kernels may add a tile's rows in another
    order (fp32 means a few units of the last place apart), so o and the gradients are
    compared within their dtype's rounding, not to the bit."""
    arms = _tile_pool_arms("cuda", dtype, vidsparse.VideoGrid((9, 14, 22)), 128, 9, monkeypatch)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), *arms):
        assert_rel_l2(name, a.float(), b.float(), 1e-3)


@pytest.mark.dynamo
@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_vsa_natural_order_under_torch_compile(triton_backend):
    """The fused tiling and coarse stage is one opaque op to Dynamo (its fake gives the
    shapes): a fullgraph compile of natural-order VSA with a gate, forward and backward,
    gives eager's bits."""
    torch.manual_seed(0)
    grid = vidsparse.VideoGrid((5, 6, 7))
    xs = [torch.randn(1, grid.num_tokens, 2, 16).transpose(1, 2) for _ in range(5)]
    do = xs.pop()

    def f(q, k, v, gate):
        return vidsparse.video_sparse_attn(q, k, v, grid, topk=3, gate=gate)

    torch._dynamo.reset()
    arms = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        leaves = [x.clone().requires_grad_() for x in xs]
        o = fn(*leaves)
        arms.append((o, *torch.autograd.grad(o, leaves, do)))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), *arms):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_the_mapped_preprocess_launches_with_the_overridden_warps(triton_backend, monkeypatch):
    """``configs.override(preprocess_warps=N)`` (tuning) reaches the launch of the preprocess
    that reads o and dO through the token map; without it the launch takes
    ``PREPROCESS_MAPPED_WARPS``."""
    from vidsparse.ops.block_sparse_attn import bwd, configs

    launches, real = [], bwd.block_sparse_attn_bwd_preprocess_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs.get("num_warps"))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(bwd, "block_sparse_attn_bwd_preprocess_kernel", Recorder())
    grid = vidsparse.VideoGrid((5, 6, 7))
    xs = [torch.randn(1, grid.num_tokens, 2, 16).transpose(1, 2) for _ in range(4)]
    for warps in (None, 2):
        leaves = [x.clone().requires_grad_() for x in xs]
        with configs.override(preprocess_warps=warps):
            o = vidsparse.video_sparse_attn(*leaves[:3], grid, topk=3, gate=leaves[3])
            o.sum().backward()
    assert launches == [configs.PREPROCESS_MAPPED_WARPS, 2]
