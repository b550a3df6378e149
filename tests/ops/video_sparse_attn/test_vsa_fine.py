"""VSA's fine stage: its gate combine declared as the engine's epilogue (fine.CoarseCombine)."""

import pytest
import torch

from helpers import make_lists, make_qkv, masked_dense_attention


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("gate", [True, False])
def test_combined_backward_fused_equals_two_launches(gate):
    """The combine's gradients (formed in the prologue) and the tile means' shares (added on
    dq, dk, dv in both halves): the fused backward launch against two, bit for bit."""
    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.configs import override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd
    from vidsparse.ops.video_sparse_attn.fine import CoarseCombine

    B, H, S, D, bs = 2, 2, 64, 16, 16
    nq = S // bs
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float16, device="cpu")
    do = torch.randn_like(q)
    idx, cnt = make_lists(1, H, nq, nq, density=0.5, device="cpu", empty_rows=1)
    sizes = torch.tensor([16, 9, 16, 5], dtype=torch.int32)
    o_coarse = torch.randn(B, H, nq, D)
    gate_t = torch.randn_like(q) if gate else None
    pooled = torch.randn(3, B, H, nq, D)
    epilogue = CoarseCombine(o_coarse, gate_t, sizes, pooled)
    o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, D**-0.5,
                                   padding_finite=True, epilogue=epilogue)  # fmt: skip
    results = []
    for fused in (False, True):
        ep = CoarseCombine(o_coarse, gate_t, sizes, pooled)
        with override(fused=fused):
            grads = block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, sizes, bs, bs,
                                          D**-0.5, padding_finite=True, epilogue=ep)  # fmt: skip
        results.append((*grads, ep._d_coarse, ep._d_gate))
    for name, a, b in zip(("dq", "dk", "dv", "d_coarse", "d_gate"), *results):
        if a is None:
            assert b is None and not gate, name
            continue
        assert torch.equal(a, b), name


def test_combine_is_registered_with_the_engine():
    from vidsparse.ops.block_sparse_attn.epilogue import epilogue_from
    from vidsparse.ops.video_sparse_attn.fine import CoarseCombine

    oc = torch.zeros(1, 1, 2, 8)
    assert isinstance(epilogue_from("vsa_combine", (oc, None, None, None)), CoarseCombine)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forward is Hopper's")
@pytest.mark.parametrize("key_tails", [False, True])
@pytest.mark.parametrize("gate", [True, False])
def test_gpu_gluon_vsa_epilogue_matches_reference(gate, key_tails):
    """VSA's fine stage on 64-token tiles: ``o = o_fine + gate * o_coarse[tile]`` with the
    padding rows of each query tile zeroed, and lse o_fine's; odd tile count, partial tiles
    (with ``key_tails`` those of at most 32 and 16 tokens walked with that many rows)."""
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import fwd
    from vidsparse.ops.block_sparse_attn.configs import GLUON, override
    from vidsparse.ops.video_sparse_attn.fine import CoarseCombine

    B, H, bs, nt, D = 1, 3, 64, 9, 128
    S = nt * bs
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.bfloat16, device="cuda")
    sizes = torch.tensor([64, 64, 16, 64, 40, 64, 32, 1, 64], dtype=torch.int32, device="cuda")
    pad = (torch.arange(S, device="cuda") % bs) >= sizes.long().repeat_interleave(bs)
    k[:, :, pad] = 0.0  # VSA's tiling pads with zeros
    v[:, :, pad] = 0.0
    idx, cnt = make_lists(1, H, nt, nt, density=0.5, device="cuda", empty_rows=1)
    oc = torch.randn(B, H, nt, D, device="cuda")
    g = torch.rand(B, H, S, D, device="cuda").to(torch.bfloat16) if gate else None
    with override(gluon=replace(GLUON, KEY_TAILS=key_tails)):
        o, lse = fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, D**-0.5,
                                           padding_finite=True,
                                           epilogue=CoarseCombine(oc, g, sizes))  # fmt: skip
    ref_fine, ref_lse = masked_dense_attention(q, k, v, idx, cnt, bs, bs, sizes)
    oc_rows = oc.double().repeat_interleave(bs, dim=2)  # [B, H, S, D]
    ref = ref_fine + (g.double() if gate else 1.0) * oc_rows
    ref[:, :, pad] = 0.0
    err = ((o.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err  # bf16 output of an O(1) sum
    assert (o[:, :, pad] == 0).all()
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=0, atol=2e-2)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("pooled", [True, False])
def test_combine_same_on_both_backends(monkeypatch, gate, pooled):
    """The epilogue's PyTorch side (the engine's reference path) and its kernels (the Triton
    interpreter) compute the same o and the same gradients of q, k, v, o_coarse and gate,
    with the tile means' backward fused in or not; fp32 inputs, partial tiles."""
    from vidsparse.ops.video_sparse_attn.fine import vsa_fine_combined

    B, H, S, D, bs = 1, 2, 64, 16, 16
    nq = S // bs
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float32, device="cpu")
    idx, cnt = make_lists(1, H, nq, nq, density=0.5, device="cpu", empty_rows=1)
    sizes = torch.tensor([16, 9, 16, 5], dtype=torch.int32)
    pad = (torch.arange(S) % bs) >= sizes.long().repeat_interleave(bs)
    k[:, :, pad], v[:, :, pad] = 0.0, 0.0  # VSA's tiling pads with zeros
    o_coarse = torch.randn(B, H, nq, D)
    gate_t = torch.randn_like(q) if gate else None
    means = torch.randn(3, B, H, nq, D) if pooled else None
    do = torch.randn_like(q)

    def run(backend):
        monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, o_coarse)]
        g = gate_t.clone().requires_grad_() if gate else None
        o = vsa_fine_combined(*leaves[:3], idx, cnt, sizes, leaves[3], g, sizes, bs, D**-0.5,
                              pooled=means)  # fmt: skip
        o.backward(do)
        grads = [x.grad for x in leaves] + ([g.grad] if gate else [])
        return o.detach(), grads

    o_ref, grads_ref = run("torch")
    o_tri, grads_tri = run("triton")
    torch.testing.assert_close(o_tri, o_ref, rtol=1e-4, atol=1e-4)
    for i, (a, b) in enumerate(zip(grads_tri, grads_ref)):
        if b is None:  # o_coarse with pooled: its gradient went through the tile means
            assert a is None and pooled, i
            continue
        real = ~pad if i in (1, 2) else torch.ones(S, dtype=torch.bool)  # padding keys: undefined
        if i < 3:
            a, b = a[:, :, real], b[:, :, real]
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_unknown_epilogue_is_a_clear_error():
    from vidsparse.ops.block_sparse_attn.epilogue import epilogue_from

    with pytest.raises(ValueError, match="no epilogue named 'nope'"):
        epilogue_from("nope", (None,) * 4)


def _mapped_gate_arms(device, dtype):
    """The fine stage with a natural-order gate read through ``gate_rows`` and with its tiled
    copy: ``(o, dq, dk, dv, d gate)`` of each, from the same inputs and output gradient."""
    import vidsparse
    from vidsparse.ops.video_sparse_attn.fine import vsa_fine_combined

    torch.manual_seed(0)
    grid = vidsparse.VideoGrid((5, 6, 7))  # 8 tiles, partial along every axis
    B, H, D, V = 2, 2, 16, grid.tile_volume
    Nt, S = grid.num_tiles, grid.num_tokens
    q, k, v, gate, do = (
        torch.randn(B, S, H, D, device=device, dtype=dtype).transpose(1, 2) for _ in range(5)
    )  # [B, S, H, D] storage, as diffusers passes it
    idx, cnt = make_lists(1, H, Nt, Nt, density=0.5, device=device)
    sizes = grid.tile_sizes_on(device)
    o_coarse = torch.randn(B, H, Nt, D, device=device)
    rows = grid.index_tensors(device).token_rows
    arms = []
    for mapped in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gate)]
        q_t, k_t, v_t, gate_t = (grid.tile(x, dim=-2) for x in leaves)
        o = vsa_fine_combined(q_t, k_t, v_t, idx, cnt, sizes, o_coarse,
                              leaves[3] if mapped else gate_t, None, V, D**-0.5,
                              rows_dropped=True, gate_rows=rows if mapped else None)  # fmt: skip
        o = grid.untile(o, dim=-2)
        arms.append((o, *torch.autograd.grad(o, leaves, do)))
    return arms


_INTERPRETER = [
    pytest.mark.slow,
    pytest.mark.interpreter,
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI"),
]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=_INTERPRETER)])
def test_gate_read_through_its_row_map_equals_its_tiled_copy(backend, monkeypatch):
    """A natural-order gate read (forward) and its gradient stored (prologue) through
    ``gate_rows``: the same bits as the tiled copy and its backward, on both backends (the
    gate a ``[B, S, H, D]`` view)."""
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    mapped, copied = _mapped_gate_arms("cpu", torch.float32)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), mapped, copied):
        assert torch.equal(a, b), name
    assert mapped[-1].stride() == mapped[-1].transpose(1, 2).contiguous().transpose(1, 2).stride()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gate_read_through_its_row_map_equals_its_tiled_copy(dtype):
    """As above on the GPU (the Hopper Gluon forward's combine reads the gate too)."""
    mapped, copied = _mapped_gate_arms("cuda", dtype)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), mapped, copied):
        assert torch.equal(a, b), name
