"""PSA stripe attention: torch backend, Triton in the interpreter (CPU CI) and Triton on the GPU,
all against the brute-force token-level reference ``stripe_attn_ref``."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from helpers import BAD_TENSOR_CASES
from vidsparse.layout import VideoGrid
from vidsparse.masks.block_sparse import dense_from_lists
from vidsparse.masks.stripe import StripeSpec, stripe_block_mask, stripe_sparsity
from vidsparse.ops.stripe_attn import interface as stripe_interface
from vidsparse.ops.stripe_attn import (
    stripe_attn,
    stripe_attn_density,
    stripe_attn_ref,
    stripe_token_mask,
)
from vidsparse.testing import assert_error_relative, assert_rel_l2

# Tb is at most 5 in the CPU cases, so a temporal offset of 9 matches no key block: a head
# whose rows are all empty (o = 0, lse = -inf) unless sink frames or text tokens fill them.
EMPTY = StripeSpec(1, 9, None, 1, 0, None)
MIXED = [
    StripeSpec(1, 0, None, 2, -1, 3),  # same frame, negative spatial offset
    StripeSpec(2, -1, 2, 1, 0, None),  # negative temporal offset, finite stride
    StripeSpec(1, 1, 3, 3, 2, 5),
]


def _random_specs(seed: str, heads: int) -> list[StripeSpec]:
    rng = random.Random(seed)  # str seeds are reproducible
    return [
        StripeSpec(
            t_width=rng.randint(1, 2),
            t_offset=rng.randint(-2, 2),
            t_stride=rng.choice([None, 1, 2, 3]),
            s_width=rng.randint(1, 3),
            s_offset=rng.randint(-2, 2),
            s_stride=rng.choice([None, 1, 3, 5, 6]),
        )
        for _ in range(heads)
    ]


def _qkv(grid, heads, *, tiled, text_tokens, dtype, B=1, D=16, scale=1.0):
    """Fresh random q, k, v; in tile order their padding slots are zero, as grid.tile makes."""
    S = grid.num_tokens + text_tokens
    xs = [torch.randn(B, heads, S, D) * scale for _ in range(3)]
    if tiled:
        xs = [_to_layout(x, grid, tiled=True, text_tokens=text_tokens) for x in xs]
    return [x.to(dtype) for x in xs]


def _to_layout(x, grid, *, tiled, text_tokens):
    """Natural-order [B, H, num_tokens + N, D] -> the layout stripe_attn takes."""
    if not tiled:
        return x
    n = grid.num_tokens
    return torch.cat([grid.tile(x[:, :, :n]), x[:, :, n:]], dim=-2)


def _to_natural(x, grid, *, tiled):
    if not tiled:
        return x
    p = grid.padded_len
    return torch.cat([grid.untile(x[:, :, :p]), x[:, :, p:]], dim=-2)


def _lowprec_baseline(q, k, v, grid, specs, *, tiled, text_tokens, **mask_args):
    """PyTorch computing the same masked attention in q's own dtype: the yardstick of the
    error-relative checks (``vidsparse.testing.assert_error_relative``)."""
    qn, kn, vn = (_to_natural(x, grid, tiled=tiled) for x in (q, k, v))
    mask = stripe_token_mask(grid, specs, text_tokens=text_tokens, device=q.device, **mask_args)
    s = (qn @ kn.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, S, S] in q's dtype
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return _to_layout(p @ vn, grid, tiled=tiled, text_tokens=text_tokens)


def _check_lse(lse, ref_lse, atol):
    finite = torch.isfinite(ref_lse)
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isfinite(lse), finite), "empty rows must give lse = -inf exactly"
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite].double(), rtol=0, atol=atol)


# ----------------------------------------------------------------------------- torch backend

# shape, tile, tiled, spatial_unit, sink_frames, text_tokens
TORCH_CASES = [
    ((4, 8, 8), (1, 4, 4), False, "block", 0, 0),  # whole tiles
    ((3, 6, 10), (1, 4, 4), False, "row", 0, 0),  # partial tiles in h and w
    ((5, 6, 10), (2, 4, 4), True, "block", 1, 0),  # partial in t too, tile order, sink frame
    ((3, 6, 10), (1, 4, 4), False, "row", 0, 5),  # text: one partial text block
    ((3, 6, 10), (1, 4, 4), True, "block", 2, 16),  # text: exactly one whole block
    ((5, 6, 10), (2, 4, 4), True, "row", 0, 37),  # text: two blocks, the last partial
    ((3, 5, 7), (1, 3, 5), False, "block", 1, 3),  # volume 15: the torch path takes any tile
]


@pytest.mark.slow
@pytest.mark.parametrize("case", TORCH_CASES, ids=str)
def test_torch_backend_matches_reference(torch_backend, case):
    shape, tile, tiled, unit, sink, text = case
    grid = VideoGrid(shape, tile=tile)
    specs = [*MIXED, EMPTY, *_random_specs(str(case), 2)]
    q, k, v = _qkv(grid, len(specs), tiled=tiled, text_tokens=text, dtype=torch.float64, B=2)
    kw = dict(spatial_unit=unit, tiled=tiled, sink_frames=sink, text_tokens=text)
    o, lse = stripe_attn(q, k, v, grid, specs, return_lse=True, **kw)
    ref_o, ref_lse = stripe_attn_ref(q, k, v, grid, specs, return_lse=True, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-12)
    _check_lse(lse, ref_lse, atol=1e-5)  # the engine returns lse in fp32
    if not sink and not text:
        assert (o[:, 3] == 0).all(), "the EMPTY head attends to nothing"


@pytest.mark.parametrize("case", [TORCH_CASES[2], TORCH_CASES[5]], ids=str)
def test_torch_backend_gradients(torch_backend, case):
    shape, tile, tiled, unit, sink, text = case
    grid = VideoGrid(shape, tile=tile)
    specs = [*MIXED, EMPTY]
    q, k, v = _qkv(grid, len(specs), tiled=tiled, text_tokens=text, dtype=torch.float64)
    for x in (q, k, v):
        x.requires_grad_(True)
    kw = dict(spatial_unit=unit, tiled=tiled, sink_frames=sink, text_tokens=text)
    o = stripe_attn(q, k, v, grid, specs, **kw)
    ref = stripe_attn_ref(q, k, v, grid, specs, **kw)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not torch.isnan(g).any(), name
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=name)


def test_mixed_heads_equal_single_head_calls(torch_backend):
    grid = VideoGrid((3, 6, 10), tile=(1, 4, 4))
    specs = [*MIXED, EMPTY]
    q, k, v = _qkv(grid, len(specs), tiled=False, text_tokens=4, dtype=torch.float64)
    o = stripe_attn(q, k, v, grid, specs, text_tokens=4)
    for h, spec in enumerate(specs):
        one = slice(h, h + 1)
        o_h = stripe_attn(q[:, one], k[:, one], v[:, one], grid, [spec], text_tokens=4)
        torch.testing.assert_close(o[:, one], o_h, rtol=0, atol=1e-14)


@pytest.mark.parametrize("text", [0, 7])
def test_dense_specs_equal_sdpa(torch_backend, text):
    grid = VideoGrid((3, 6, 10), tile=(2, 4, 4))
    q, k, v = _qkv(grid, 2, tiled=False, text_tokens=text, dtype=torch.float64)
    o = stripe_attn(q, k, v, grid, [StripeSpec.dense()] * 2, text_tokens=text, scale=0.3)
    assert_rel_l2("o", o, F.scaled_dot_product_attention(q, k, v, scale=0.3), 1e-12)


def test_text_tokens_attend_and_are_attended_densely(torch_backend):
    """A video head that sees only its own block still sees all text; text sees everything."""
    grid = VideoGrid((2, 4, 8), tile=(1, 4, 4))
    diagonal = StripeSpec(1, 0, None, 1, 0, None)
    q, k, v = _qkv(grid, 1, tiled=False, text_tokens=3, dtype=torch.float64)
    o = stripe_attn(q, k, v, grid, [diagonal], text_tokens=3)
    dense = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(o[:, :, -3:], dense[:, :, -3:], rtol=1e-12, atol=1e-12)
    # The first 1x4x4 block holds rows 0-3, columns 0-3 of frame 0: it sees itself and text.
    first = [h * 8 + w for h in range(4) for w in range(4)]
    keys = first + list(range(grid.num_tokens, grid.num_tokens + 3))
    block = F.scaled_dot_product_attention(q[:, :, first], k[:, :, keys], v[:, :, keys])
    torch.testing.assert_close(o[:, :, first], block, rtol=1e-12, atol=1e-12)


def test_engine_lists_are_cached_and_stripe_wide(torch_backend, monkeypatch):
    grid = VideoGrid((3, 6, 10), tile=(1, 4, 4))  # 18 tiles; 37 text tokens -> 3 text blocks
    specs = [StripeSpec(1, 0, None, 1, 0, None), StripeSpec(1, 0, None, 2, 0, None)]
    stripe_interface.clear_stripe_attn_cache()
    launches = []
    engine = stripe_interface.block_sparse_attn_unchecked

    def counting_engine(q, k, v, kv_indices, kv_counts, **kw):
        launches.append((q.shape[2], tuple(kv_indices.shape)))
        return engine(q, k, v, kv_indices, kv_counts, **kw)

    import vidsparse.ops.block_sparse_attn.interface as engine_interface

    # the video launch calls the name stripe_attn imported; the text launch (shared with VSA,
    # ops/_video_inputs.py) looks it up in the engine's module
    monkeypatch.setattr(stripe_interface, "block_sparse_attn_unchecked", counting_engine)
    monkeypatch.setattr(engine_interface, "block_sparse_attn_unchecked", counting_engine)
    q, k, v = _qkv(grid, 2, tiled=False, text_tokens=37, dtype=torch.float32)
    stripe_attn(q, k, v, grid, specs, text_tokens=37)
    # Launch 1: 18 video query blocks, rows as wide as the busiest stripe row (3) + 3 text
    # blocks; launch 2: 3 text query blocks over all 21 key blocks.
    assert launches == [(18 * 16, (1, 2, 18, 3 + 3)), (3 * 16, (1, 2, 3, 21))]
    first = stripe_interface._engine_plan.cache_info().misses
    stripe_attn(q, k, v, grid, list(specs), text_tokens=37)
    assert stripe_interface._engine_plan.cache_info().misses == first  # a hit: no rebuild

    launches.clear()
    q, k, v = _qkv(grid, 2, tiled=False, text_tokens=0, dtype=torch.float32)
    stripe_attn(q, k, v, grid, specs)
    assert len(launches) == 1, "all heads run in one launch without text"


def test_from_lists_equals_stripe_attn_and_checks_the_lists(torch_backend):
    from vidsparse.ops.stripe_attn.interface import stripe_attn_from_lists, stripe_engine_lists

    grid = VideoGrid((3, 6, 10), tile=(1, 4, 4))
    specs = [*MIXED, EMPTY]
    q, k, v = _qkv(grid, len(specs), tiled=False, text_tokens=0, dtype=torch.float64, B=2)
    for cached in (True, False):
        indices, counts, sizes = stripe_engine_lists(specs, grid, cached=cached)
        o = stripe_attn_from_lists(q, k, v, grid, indices, counts, sizes)
        torch.testing.assert_close(o, stripe_attn(q, k, v, grid, specs), rtol=0, atol=0)
    # wider lists (padding entries past kv_counts are never read) give the same output
    padded = torch.cat([indices, torch.zeros_like(indices)], dim=-1)
    o = stripe_attn_from_lists(q, k, v, grid, padded, counts, sizes)
    torch.testing.assert_close(o, stripe_attn(q, k, v, grid, specs), rtol=0, atol=0)
    with pytest.raises(TypeError, match="int32"):
        stripe_attn_from_lists(q, k, v, grid, indices.long(), counts, sizes)
    with pytest.raises(ValueError, match="kv_indices must be"):
        stripe_attn_from_lists(q[:, :2], k[:, :2], v[:, :2], grid, indices, counts, sizes)
    with pytest.raises(ValueError, match="kv_block_sizes must be"):
        stripe_attn_from_lists(q, k, v, grid, indices, counts, sizes[:-1])


def test_engine_lists_match_block_map():
    grid = VideoGrid((3, 6, 10), tile=(1, 4, 4))
    specs = tuple(MIXED)
    plan = stripe_interface._engine_plan(specs, grid, "row", 1, 20, torch.device("cpu"))
    nt, ntb = grid.num_tiles, 2
    video_map = dense_from_lists(plan.video_indices, plan.video_counts, nt + ntb)[0]
    stripes = stripe_block_mask(specs, grid.tiles, "row", sink_frames=1)
    assert torch.equal(video_map[..., :nt], stripes)
    assert video_map[..., nt:].all()
    text_map = dense_from_lists(plan.text_indices, plan.text_counts, nt + ntb)[0]
    assert text_map.all() and text_map.shape == (3, ntb, nt + ntb)
    assert plan.kv_block_sizes.tolist() == grid.tile_sizes.tolist() + [16, 4]
    for h in range(3):  # rows stay ascending, text blocks after the video tiles
        for row, count in zip(plan.video_indices[0, h], plan.video_counts[0, h]):
            used = row[: int(count)]
            assert (used[1:] > used[:-1]).all()


def test_full_tiles_use_the_unmasked_engine():
    full = VideoGrid((2, 8, 8), tile=(1, 4, 4))
    plan = stripe_interface._engine_plan((EMPTY,), full, "block", 0, 32, torch.device("cpu"))
    assert plan.kv_block_sizes is None  # no padding slot anywhere: the faster kernel
    plan = stripe_interface._engine_plan((EMPTY,), full, "block", 0, 33, torch.device("cpu"))
    assert plan.kv_block_sizes is not None


def test_density():
    grid = VideoGrid((3, 6, 10), tile=(1, 4, 4))
    specs = [*MIXED, StripeSpec.dense()]
    density = stripe_attn_density(specs, grid, "row", sink_frames=1)
    expected = 1 - stripe_sparsity(stripe_block_mask(specs, grid.tiles, "row", sink_frames=1))
    torch.testing.assert_close(density, expected)
    with_text = stripe_attn_density(specs, grid, "row", sink_frames=1, text_tokens=20)
    plan = stripe_interface._engine_plan(tuple(specs), grid, "row", 1, 20, torch.device("cpu"))
    n = grid.num_tiles + 2
    counts = plan.video_counts[0].sum(-1) + plan.text_counts[0].sum(-1)  # [H]
    torch.testing.assert_close(with_text, counts.float() / n**2)
    # StripeSpec.dense() is dense in "block" units ("row" multiplies its period by Wb).
    assert stripe_attn_density([StripeSpec.dense()], grid, text_tokens=20).tolist() == [1.0]


def test_reference_token_mask_brute_force():
    """The reference mask against a loop over token pairs in plain Python."""
    grid = VideoGrid((3, 5, 6), tile=(2, 2, 4))
    spec = StripeSpec(1, -1, 2, 2, 1, 2)
    mask = stripe_token_mask(grid, [spec], spatial_unit="row", sink_frames=1, text_tokens=2)[0]
    T, H, W = grid.shape
    _, _, wb = grid.tiles
    coords = [(t, h, w) for t in range(T) for h in range(H) for w in range(W)]
    for i, (tq, hq, wq) in enumerate(coords):
        for j, (tk, hk, wk) in enumerate(coords):
            dt = tk // 2 - tq // 2
            ds = (hk // 2 * wb + wk // 4) - (hq // 2 * wb + wq // 4)
            attend = abs(dt + 1) % 2 <= 0 and abs(ds - 1) % (2 * wb) <= 1
            assert bool(mask[i, j]) == (attend or tk // 2 < 1), (i, j)
    assert mask[-2:].all() and mask[:, -2:].all()


# ----------------------------------------------------------------------------- bad input


def _good_call():
    grid = VideoGrid((3, 6, 10), tile=(1, 4, 4))
    q, k, v = _qkv(grid, 2, tiled=False, text_tokens=0, dtype=torch.float32)
    return dict(q=q, k=k, v=v, grid=grid, specs=MIXED[:2])


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (dict(specs=MIXED[:3]), ValueError, "specs"),
        (dict(specs=MIXED[0]), TypeError, "specs"),
        (dict(specs=[MIXED[0], (1, 0, None, 1, 0, None)]), TypeError, r"specs\[1\]"),
        (dict(specs=7), TypeError, "specs"),
        (dict(grid=(3, 6, 10)), TypeError, "grid"),
        (dict(spatial_unit="token"), ValueError, "spatial_unit"),
        (dict(sink_frames=-1), ValueError, "sink_frames"),
        (dict(sink_frames=1.0), TypeError, "sink_frames"),
        (dict(text_tokens=-2), ValueError, "text_tokens"),
        (dict(text_tokens=True), TypeError, "text_tokens"),
        (dict(text_tokens=4), ValueError, "text_tokens"),  # S does not hold the text
        (dict(tiled=True), ValueError, "padded_len"),
        (dict(tiled=1), TypeError, "tiled"),
        (dict(return_lse="yes"), TypeError, "return_lse"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(scale="x"), TypeError, "scale"),
    ],
)
def test_bad_arguments(torch_backend, change, exc, words):
    args = {**_good_call(), **change}
    with pytest.raises(exc, match=words):
        stripe_attn(**args)


@pytest.mark.parametrize(
    "name, bad, exc, words",
    [*BAD_TENSOR_CASES, ("k", lambda x: x.tolist(), TypeError, "k")],
)
def test_bad_tensors(torch_backend, name, bad, exc, words):
    args = _good_call()
    args[name] = bad(args[name])
    with pytest.raises(exc, match=words):
        stripe_attn(**args)


def test_sequence_length_hint_names_the_other_layout(torch_backend):
    args = _good_call()
    grid = args["grid"]
    padded = torch.zeros(1, 2, grid.padded_len, 16)
    with pytest.raises(ValueError, match="tiled=True"):
        stripe_attn(padded, padded, padded, grid, args["specs"])


def test_triton_path_rejects_unsupported_tiles(triton_backend):
    grid = VideoGrid((3, 5, 7), tile=(1, 3, 5))  # volume 15
    q, k, v = _qkv(grid, 1, tiled=False, text_tokens=0, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"power-of-two tile volume.*\(2, 8, 8\)"):
        stripe_attn(q, k, v, grid, [StripeSpec.dense()])
    grid = VideoGrid((2, 4, 4), tile=(1, 2, 4))  # volume 8 < 16
    q, k, v = _qkv(grid, 1, tiled=False, text_tokens=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="tile volume"):
        stripe_attn(q, k, v, grid, [StripeSpec.dense()])


# ----------------------------------------------------------------------------- interpreter


def _check_against_reference(
    device, dtype, grid, specs, *, tiled, unit, sink, text, B=1, D=16, scale=1.0, backward=True
):
    """Error-relative check of o, lse and (optionally) dq, dk, dv against the fp64 reference,
    with PyTorch's own low-precision computation of the same attention as the yardstick."""
    q, k, v = (
        x.to(device).requires_grad_(backward)
        for x in _qkv(
            grid, len(specs), tiled=tiled, text_tokens=text, dtype=dtype, B=B, D=D, scale=scale
        )
    )
    kw = dict(spatial_unit=unit, tiled=tiled, sink_frames=sink, text_tokens=text)
    o, lse = stripe_attn(q, k, v, grid, specs, return_lse=True, **kw)
    # fp64 leaves, so that the reference gradients are not rounded to q's dtype either.
    q64, k64, v64 = (x.detach().double().requires_grad_(backward) for x in (q, k, v))
    ref_o, ref_lse = stripe_attn_ref(q64, k64, v64, grid, specs, return_lse=True, **kw)
    mask_args = dict(spatial_unit=unit, sink_frames=sink)
    low_o = _lowprec_baseline(q, k, v, grid, specs, tiled=tiled, text_tokens=text, **mask_args)
    atol = 1e-4 if dtype == torch.float32 else 2e-3
    assert o.shape == q.shape and o.dtype == dtype
    assert_error_relative("o", o, ref_o, low_o, atol=atol)
    _check_lse(lse, ref_lse, atol=2e-2)
    if not backward:
        return
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref_o, (q64, k64, v64), do.double())
    low_grads = torch.autograd.grad(low_o, (q, k, v), do)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_error_relative(name, g, r, lo, atol=atol)


# dtype, shape, tile, tiled, spatial_unit, sink_frames, text_tokens, backward
INTERPRETER_CASES = [
    (torch.float32, (3, 6, 10), (1, 4, 4), False, "block", 0, 0, True),  # partial h, w
    (torch.float16, (5, 6, 10), (2, 4, 4), True, "row", 1, 0, True),  # partial t, tiled, sink
    (torch.float32, (3, 6, 10), (1, 4, 4), False, "row", 0, 5, True),  # text, partial block
    (torch.float16, (4, 4, 8), (1, 4, 4), True, "block", 0, 21, False),  # text, whole tiles
]


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=str)
def test_triton_interpreter_matches_reference(triton_backend, case):
    dtype, shape, tile, tiled, unit, sink, text, backward = case
    specs = [*MIXED[:2], EMPTY]
    _check_against_reference(
        "cpu",
        dtype,
        VideoGrid(shape, tile=tile),
        specs,
        tiled=tiled,
        unit=unit,
        sink=sink,
        text=text,
        backward=backward,
    )


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_triton_interpreter_dense_specs_equal_sdpa(triton_backend):
    grid = VideoGrid((3, 6, 10), tile=(1, 4, 4))
    q, k, v = _qkv(grid, 2, tiled=False, text_tokens=3, dtype=torch.float32)
    o = stripe_attn(q, k, v, grid, [StripeSpec.dense()] * 2, text_tokens=3)
    dense = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert_rel_l2("o (fp32)", o, dense, 1e-5)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
def test_triton_interpreter_ignores_poisoned_padding(triton_backend):
    """Padding slots of tiled inputs hold NaN: they must neither be read nor leak out."""
    grid = VideoGrid((3, 6, 10), tile=(1, 4, 4))
    q, k, v = _qkv(grid, 1, tiled=True, text_tokens=0, dtype=torch.float32)
    pad = ~grid.real_token_mask()
    for x in (q, k, v):
        x[:, :, pad] = float("nan")
    o = stripe_attn(q, k, v, grid, [MIXED[0]], tiled=True)
    assert not torch.isnan(o).any()
    assert (o[:, :, pad] == 0).all()


# ----------------------------------------------------------------------------- GPU

# shape, tile, tiled, spatial_unit, sink_frames, text_tokens
GPU_CASES = [
    ((6, 16, 32), (2, 8, 8), False, "block", 0, 0),  # 3x2x4 blocks of 128, whole tiles
    ((5, 13, 30), (1, 8, 16), True, "row", 1, 0),  # partial blocks in every axis, tiled
    ((6, 16, 32), (2, 8, 8), False, "row", 0, 77),  # text tokens, HunyuanVideo style
    ((6, 16, 32), (4, 4, 4), True, "block", 1, 130),  # 64-token blocks, text over 3 blocks
]


def _gpu_specs(heads: int) -> list[StripeSpec]:
    # Patterns of the PSA paper's candidate ranges with a dense head mixed in.
    pool = [
        StripeSpec(1, 0, None, 2, 0, 3),
        StripeSpec(1, -1, 2, 1, 1, 5),
        StripeSpec(2, 0, 3, 2, -1, None),
        StripeSpec.dense(),
    ]
    return [pool[h % len(pool)] for h in range(heads)]


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_bf16_matches_reference(case, scale):
    shape, tile, tiled, unit, sink, text = case
    _check_against_reference(
        "cuda",
        torch.bfloat16,
        VideoGrid(shape, tile=tile),
        _gpu_specs(4),
        tiled=tiled,
        unit=unit,
        sink=sink,
        text=text,
        D=128,
        scale=scale,
    )


@pytest.mark.gpu
def test_gpu_fp16_batch_two():
    _check_against_reference(
        "cuda",
        torch.float16,
        VideoGrid((6, 16, 32), tile=(2, 8, 8)),
        _gpu_specs(4),
        tiled=False,
        unit="block",
        sink=0,
        text=0,
        B=2,
        D=64,
    )


@pytest.mark.gpu
def test_gpu_dense_specs_equal_sdpa():
    grid = VideoGrid((5, 13, 30), tile=(2, 8, 8))
    q, k, v = (
        x.cuda() for x in _qkv(grid, 4, tiled=False, text_tokens=0, dtype=torch.bfloat16, D=128)
    )
    o = stripe_attn(q, k, v, grid, [StripeSpec.dense()] * 4)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    low = F.scaled_dot_product_attention(q, k, v)
    assert_error_relative("o", o, ref, low, atol=2e-3)


@pytest.mark.gpu
def test_gpu_padding_gets_no_weight_and_lists_are_reused():
    grid = VideoGrid((5, 13, 30), tile=(2, 8, 8))
    specs = _gpu_specs(4)
    q, k, v = (
        x.cuda() for x in _qkv(grid, 4, tiled=True, text_tokens=0, dtype=torch.bfloat16, D=128)
    )
    pad = ~grid.real_token_mask("cuda")
    for x in (k, v):
        x[:, :, pad] = 0
    o_zero = stripe_attn(q, k, v, grid, specs, tiled=True)
    # Padding of a tiled input may hold any finite value (documented): no weight, no effect.
    for x in (k, v):
        x[:, :, pad] = 3e4
    o1 = stripe_attn(q, k, v, grid, specs, tiled=True)
    o2 = stripe_attn(q, k, v, grid, specs, tiled=True)
    assert not torch.isnan(o1).any()
    assert torch.equal(o1, o_zero), "finite padding values leaked into the output"
    assert torch.equal(o1, o2), "not bit-identical across calls"
    assert (o1[:, :, pad] == 0).all(), "padding rows of the tiled output are zero"
