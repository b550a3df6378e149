"""VSA with text tokens (joint attention, HunyuanVideo): ``text_tokens = N`` tokens after the
video tokens, attended by every video query on top of its top-k tiles, and attending densely.

The torch backend is checked against a brute-force dense attention with a token-level mask
built here from (t, h, w) coordinates; the Triton path (interpreter on CPU) against the
reference, gradients included.
"""

from __future__ import annotations

import pytest
import torch

import vidsparse
from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.video_sparse_attn import video_sparse_attn_ref
from vidsparse.testing import add_tile_structure, assert_rel_l2

FP64_BOUND = 1e-10

# ---- brute force, natural order, token level ---------------------------------------------------


def _token_tile_ids(grid):
    T, H, W = grid.shape
    tT, tH, tW = grid.tile_shape
    _, Nh, Nw = grid.tiles
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    return (((t // tT) * Nh + h // tH) * Nw + w // tW).reshape(-1)  # [S]


def _brute_force(q, k, v, gate, grid, topk, N, scale):
    """VSA with N text tokens on natural-order ``[B, H, S + N, D]`` inputs, all dense."""
    B, H, L, D = q.shape
    S = L - N
    ids = _token_tile_ids(grid)
    member = (ids.view(1, -1) == torch.arange(grid.num_tiles).view(-1, 1)).to(q.dtype)
    pool = member / member.sum(dim=1, keepdim=True)  # [Nt, S]: tile means of video tokens
    qc, kc, vc = (pool @ x[:, :, :S] for x in (q, k, v))
    scores = qc @ kc.transpose(-1, -2) * scale  # [B, H, Nt, Nt]
    oc = torch.softmax(scores, dim=-1) @ vc
    chosen = torch.topk(scores.detach(), topk, dim=-1).indices
    selected = torch.zeros(B, H, grid.num_tiles, grid.num_tiles, dtype=torch.bool)
    selected.scatter_(-1, chosen, True)

    mask = torch.ones(B, H, L, L, dtype=torch.bool)  # text rows: every key
    mask[:, :, :S, :S] = selected[:, :, ids][:, :, :, ids]  # video rows: selected tiles + text
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    o = torch.softmax(logits, dim=-1) @ v
    coarse = oc[:, :, ids] * (1.0 if gate is None else gate[:, :, :S])  # video rows only
    return torch.cat([o[:, :, :S] + coarse, o[:, :, S:]], dim=2)


def _inputs(
    grid, N, *, B=2, H=2, D=16, dtype=torch.float64, device="cpu", scale=1.0, tile_structure=0.0
):
    S = grid.num_tokens + N
    xs = [torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(4)]
    if tile_structure:  # q and k: no near-tie top-k decisions (see add_tile_structure)
        xs[:2] = [add_tile_structure(x, grid, tile_structure, tiled=False) for x in xs[:2]]
    xs[:3] = [x * scale for x in xs[:3]]
    return [x.to(device=device, dtype=dtype) for x in xs]


def _to_tiled(x, grid, N):
    """Natural-order video + text -> tile-order video + text."""
    S = grid.num_tokens
    return torch.cat([grid.tile(x[:, :, :S], dim=-2), x[:, :, S:]], dim=2)


def _from_tiled(x, grid, N):
    P = grid.padded_len
    return torch.cat([grid.untile(x[:, :, :P], dim=-2), x[:, :, P:]], dim=2)


GRID = VideoGrid((5, 6, 7), tile=(4, 4, 4))  # 2x2x2 = 8 partial tiles, 210 tokens


# ---- torch backend against brute force ---------------------------------------------------------


@pytest.mark.parametrize("N", [5, 16, 70])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("with_gate", [False, True])
def test_torch_backend_matches_brute_force(torch_backend, N, tiled, with_gate):
    q, k, v, gate = _inputs(GRID, N)
    gate = gate if with_gate else None
    topk, scale = 3, 0.3
    expected = _brute_force(q, k, v, gate, GRID, topk, N, scale)
    args = [q, k, v, gate] if not tiled else [_to_tiled(x, GRID, N) for x in (q, k, v)]
    if tiled:
        args.append(None if gate is None else _to_tiled(gate, GRID, N))
    o = vidsparse.video_sparse_attn(
        *args[:3], GRID, topk=topk, gate=args[3], tiled=tiled, scale=scale, text_tokens=N
    )
    assert o.shape == args[0].shape and o.dtype == torch.float64
    if tiled:
        assert (o[:, :, : GRID.padded_len][:, :, ~GRID.real_token_mask("cpu")] == 0).all()
        o = _from_tiled(o, GRID, N)
    assert_rel_l2("o", o, expected, FP64_BOUND)


def test_torch_backend_gradients_match_brute_force(torch_backend):
    N, topk, scale = 16, 2, 0.25
    q, k, v, gate = (x.requires_grad_(True) for x in _inputs(GRID, N, B=1))
    expected = _brute_force(q, k, v, gate, GRID, topk, N, scale)
    o = vidsparse.video_sparse_attn(q, k, v, GRID, topk=topk, gate=gate, scale=scale, text_tokens=N)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, gate), do)
    ref_grads = torch.autograd.grad(expected, (q, k, v, gate), do)
    for name, g, r in zip(("dq", "dk", "dv", "dgate"), grads, ref_grads):
        assert_rel_l2(name, g, r, FP64_BOUND)
    assert (grads[3][:, :, GRID.num_tokens :] == 0).all()  # text rows of the gate unused


def test_gate_text_rows_ignored(torch_backend):
    q, k, v, gate = _inputs(GRID, 5)
    o1 = vidsparse.video_sparse_attn(q, k, v, GRID, topk=2, gate=gate, text_tokens=5)
    gate2 = gate.clone()
    gate2[:, :, GRID.num_tokens :] = 123.0
    o2 = vidsparse.video_sparse_attn(q, k, v, GRID, topk=2, gate=gate2, text_tokens=5)
    assert torch.equal(o1, o2)


def test_reference_parts_with_text():
    N = 5
    q, k, v, _ = _inputs(GRID, N)
    o, parts = video_sparse_attn_ref(q, k, v, GRID, topk=3, text_tokens=N, return_parts=True)
    assert parts["o_fine"].shape == o.shape == parts["o_coarse"].shape
    assert (parts["o_coarse"][:, :, GRID.num_tokens :] == 0).all()
    torch.testing.assert_close(o, parts["o_fine"] + parts["o_coarse"])
    assert parts["kv_indices"].shape == (2, 2, GRID.num_tiles, 3)


def test_reference_chunking_with_text(monkeypatch):
    """Tiny element budgets force chunked fine / dense stages; results and grads unchanged."""
    import vidsparse.ops.video_sparse_attn.reference as ref

    N = 70
    q, k, v, gate = (x.requires_grad_(True) for x in _inputs(GRID, N, B=1))
    o = video_sparse_attn_ref(q, k, v, GRID, topk=3, gate=gate, text_tokens=N)
    g = torch.autograd.grad(o.sum(), (q, k, v, gate))
    monkeypatch.setattr(ref, "_FINE_CHUNK_ELEMENTS", 1)
    o2 = video_sparse_attn_ref(q, k, v, GRID, topk=3, gate=gate, text_tokens=N)
    g2 = torch.autograd.grad(o2.sum(), (q, k, v, gate))
    assert_rel_l2("o", o2, o, 1e-12)
    for a, b in zip(g2, g):
        assert_rel_l2("grad", a, b, 1e-12)


def test_append_columns_full_rows_fast_path():
    from vidsparse.ops._video_inputs import append_columns

    idx = torch.randint(0, 8, (2, 3, 8, 4), dtype=torch.int32)
    cnt = torch.full((2, 3, 8), 4, dtype=torch.int32)
    cols = torch.tensor([8, 9], dtype=torch.int32)
    general = append_columns(idx, cnt, cols)
    fast = append_columns(idx, cnt, cols, full_rows=True)
    assert all(torch.equal(a, b) for a, b in zip(general, fast))
    assert fast[0].dtype == fast[1].dtype == torch.int32


# ---- text_tokens = 0 is the old behaviour ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_text_tokens_unchanged(monkeypatch, backend):
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    q, k, v, gate = _inputs(GRID, 0, B=1, dtype=torch.float32)
    o = vidsparse.video_sparse_attn(q, k, v, GRID, topk=3, gate=gate)
    o0 = vidsparse.video_sparse_attn(q, k, v, GRID, topk=3, gate=gate, text_tokens=0)
    assert torch.equal(o, o0)
    ref = video_sparse_attn_ref(q, k, v, GRID, topk=3, gate=gate)
    assert_rel_l2("o", o, ref, 1e-5)


# ---- Triton path (interpreter) against the reference -------------------------------------------


def _compare(
    grid, N, *, B, H, D, dtype, device, topk, tiled, scale=1.0, bound_o, bound_g, tile_structure=0.0
):
    q, k, v, gate = _inputs(
        grid, N, B=B, H=H, D=D, dtype=dtype, device=device, scale=scale,
        tile_structure=tile_structure,
    )  # fmt: skip
    if tiled:
        q, k, v, gate = (_to_tiled(x, grid, N) for x in (q, k, v, gate))
    q, k, v, gate = (x.requires_grad_(True) for x in (q, k, v, gate))
    o = vidsparse.video_sparse_attn(q, k, v, grid, topk=topk, gate=gate, tiled=tiled, text_tokens=N)
    ref = video_sparse_attn_ref(
        *(x.float() for x in (q, k, v)),
        grid,
        topk=topk,
        gate=gate.float(),
        tiled=tiled,
        text_tokens=N,
    )
    assert o.shape == q.shape and o.dtype == dtype
    assert_rel_l2("o", o.float(), ref, bound_o)
    video_len = grid.padded_len if tiled else grid.num_tokens
    assert_rel_l2("o text rows", o[:, :, video_len:].float(), ref[:, :, video_len:], bound_o)
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(o, (q, k, v, gate), do.to(dtype))
    ref_grads = torch.autograd.grad(ref, (q, k, v, gate), do)
    for name, g, r in zip(("dq", "dk", "dv", "dgate"), grads, ref_grads):
        assert_rel_l2(name, g.float(), r, bound_g)
    assert (grads[3][:, :, video_len:] == 0).all()
    if tiled:  # padding rows of the output are zero
        assert (o[:, :, :video_len][:, :, ~grid.real_token_mask(o.device)] == 0).all()


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize(
    "tiled, N",
    [(False, 70), (True, 5), (True, 64)],  # 64: whole text blocks, the key sequence is k itself
)
def test_vsa_text_triton_interpreter_matches_reference(triton_backend, tiled, N):
    _compare(
        GRID,
        N,
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


@pytest.mark.gpu
@pytest.mark.parametrize("tiled", [False, True])
def test_vsa_text_gpu_bf16_matches_reference(tiled):
    grid = VideoGrid((9, 14, 22))  # partial tiles along every axis: 3x4x6 = 72 tiles
    _compare(
        grid,
        77,  # CLIP-length prompt: two text blocks, the second partial
        B=2,
        H=4,
        D=128,
        dtype=torch.bfloat16,
        device="cuda",
        topk=9,
        tiled=tiled,
        tile_structure=1.0,
        bound_o=3e-2,
        bound_g=6e-2,
    )


# ---- argument errors ---------------------------------------------------------------------------


def test_text_tokens_errors():
    q, k, v, _ = _inputs(GRID, 5, B=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="text_tokens must be >= 0"):
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=2, text_tokens=-5)
    for bad in (5.0, True, "5"):
        with pytest.raises(TypeError, match="text_tokens must be an int"):
            vidsparse.video_sparse_attn(q, k, v, GRID, topk=2, text_tokens=bad)
    with pytest.raises(ValueError, match=r"text_tokens \(3\)"):
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=2, text_tokens=3)
    with pytest.raises(ValueError, match=r"grid.num_tokens \(210\) \+ text_tokens \(0\)"):
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=2)  # text present, not declared
    with pytest.raises(ValueError, match="tiled=True"):
        qt = torch.randn(1, 2, GRID.padded_len + 5, 16)
        vidsparse.video_sparse_attn(qt, qt, qt, GRID, topk=2, text_tokens=5)
    with pytest.raises(ValueError, match="text_tokens"):
        video_sparse_attn_ref(q, k, v, GRID, topk=2, text_tokens=4)
    with pytest.raises(ValueError, match="text_tokens must be >= 0"):
        video_sparse_attn_ref(q, k, v, GRID, topk=2, text_tokens=-1)
    with pytest.raises(ValueError, match="gate"):
        vidsparse.video_sparse_attn(q, k, v, GRID, topk=2, gate=q[:, :, :-5], text_tokens=5)
