"""Fuzz the video layer: grids (tile order), VSA against its fp64 reference (torch backend and
the Triton interpreter), and stripe specs against the Python-int predicate, bounds included."""

from __future__ import annotations

import pytest
import torch
from fuzzing import backend, count_case, examples, generator
from hypothesis import assume, given
from hypothesis import strategies as st

import vidsparse
from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import MAX_GRID_EXTENT, StripeSpec, stripe_block_mask
from vidsparse.ops.video_sparse_attn.reference import video_sparse_attn_ref

M = MAX_GRID_EXTENT


@st.composite
def grids(draw, *, max_side=7, tiles=None):
    shape = tuple(draw(st.integers(1, max_side)) for _ in range(3))
    tile = draw(tiles) if tiles is not None else tuple(draw(st.integers(1, 4)) for _ in range(3))
    return VideoGrid(shape, tile=tile)


@examples(40)
@given(grids(), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_tile_untile_round_trip(grid, d, seed):
    count_case()
    x = torch.randn(2, grid.num_tokens, d, generator=generator(seed))
    t = grid.tile(x, dim=1)
    assert t.shape == (2, grid.padded_len, d)
    assert torch.equal(grid.untile(t, dim=1), x)
    assert int(grid.tile_sizes.sum()) == grid.num_tokens
    pad = ~grid.real_token_mask(x.device)
    assert (t[:, pad] == 0).all()


@st.composite
def vsa_problems(draw, *, triton: bool):
    if triton:  # one engine block per tile: a power-of-two volume >= 16
        tiles = st.sampled_from([(1, 4, 4), (2, 2, 4), (4, 4, 1), (2, 4, 2)])
        grid = draw(grids(max_side=6, tiles=tiles))
        d, dtype = draw(st.sampled_from([16, 32])), torch.float32
    else:
        grid = draw(grids(max_side=6))
        d = draw(st.integers(1, 12))
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    topk = draw(st.integers(1, grid.num_tiles + 2))  # above num_tiles: clamped
    g = generator(draw(st.integers(0, 2**31 - 1)))
    q, k, v = (torch.randn(b, h, grid.num_tokens, d, generator=g).to(dtype) for _ in range(3))
    gate = (
        torch.rand(b, h, grid.num_tokens, d, generator=g).to(dtype) if draw(st.booleans()) else None
    )
    scale = draw(st.sampled_from([None, 0.2, 1.5]))
    return grid, q, k, v, topk, gate, scale


# Coarse scores this close (relative to the row's largest) at the top-k boundary may be
# ranked apart by fp32 rounding: such a draw tests rounding, not VSA, and is discarded.
NEAR_TIE = 1e-4


def _near_tie_at_boundary(scores: torch.Tensor, topk: int) -> bool:
    """Whether any row of ``scores [..., Nt]`` has its ``topk``-th and next score within
    ``NEAR_TIE`` of each other (relative to the row's largest magnitude)."""
    if topk >= scores.shape[-1]:
        return False
    ranked = scores.sort(dim=-1, descending=True).values
    gap = ranked[..., topk - 1] - ranked[..., topk]
    return bool((gap <= NEAR_TIE * (1 + scores.abs().amax(dim=-1))).any())


def _vsa_case(problem, name, tol):
    grid, q, k, v, topk, gate, scale = problem
    d = q.shape[-1]
    ref, parts = video_sparse_attn_ref(q.double(), k.double(), v.double(), grid,
                                       topk=min(topk, grid.num_tiles),
                                       gate=None if gate is None else gate.double(),
                                       scale=d**-0.5 if scale is None else scale,
                                       return_parts=True)  # fmt: skip
    if q.dtype != torch.float64:
        assume(not _near_tie_at_boundary(parts["coarse_scores"], parts["topk"]))
    with backend(name):
        out = vidsparse.video_sparse_attn(q, k, v, grid, topk=topk, gate=gate, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err <= tol, float(err)


@examples(40)
@given(vsa_problems(triton=False))
def test_vsa_torch_backend_matches_fp64_reference(problem):
    count_case()
    _vsa_case(problem, "torch", 1e-5 if problem[1].dtype == torch.float32 else 1e-12)


@pytest.mark.interpreter
@examples(6)
@given(vsa_problems(triton=True))
def test_vsa_interpreter_matches_fp64_reference(problem):
    """Draws whose coarse scores nearly tie at the top-k boundary are discarded
    (``_near_tie_at_boundary``): fp32 may rank those tiles apart from fp64."""
    count_case()
    _vsa_case(problem, "triton", 2e-4)


# ---- stripe specs ---------------------------------------------------------------------------


@st.composite
def specs(draw):
    width = st.one_of(st.integers(1, 6), st.sampled_from([M - 1, M]))
    offset = st.one_of(st.integers(-6, 6), st.sampled_from([-M, -M + 1, M - 1, M]))
    stride = st.one_of(st.none(), st.integers(1, 7), st.sampled_from([M - 1, M]))
    return StripeSpec(draw(width), draw(offset), draw(stride), draw(width), draw(offset),
                      draw(stride))  # fmt: skip


def _brute(spec: StripeSpec, grid, unit):
    tb, hb, wb = grid
    ns = hb * wb
    period = None if spec.s_stride is None else spec.s_stride * (wb if unit == "row" else 1)
    out = torch.zeros(tb * ns, tb * ns, dtype=torch.bool)
    for tq in range(tb):
        for sq in range(ns):
            for tk in range(tb):
                for sk in range(ns):
                    dt = abs(tk - tq - spec.t_offset)
                    ds = abs(sk - sq - spec.s_offset)
                    if spec.t_stride is not None:
                        dt %= spec.t_stride
                    if period is not None:
                        ds %= period
                    out[tq * ns + sq, tk * ns + sk] = dt < spec.t_width and ds < spec.s_width
    return out


@examples(60)
@given(st.lists(specs(), min_size=1, max_size=3),
       st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4)),
       st.sampled_from(["block", "row"]))  # fmt: skip
def test_stripe_masks_match_the_python_int_predicate(spec_list, grid, unit):
    count_case()
    mask = stripe_block_mask(spec_list, grid, unit)
    for h, spec in enumerate(spec_list):
        assert torch.equal(mask[h], _brute(spec, grid, unit)), (spec, grid, unit)


FIELDS = ("t_width", "t_offset", "t_stride", "s_width", "s_offset", "s_stride")


@examples(40)
@given(st.sampled_from(FIELDS),
       st.one_of(st.integers(M + 1, 2**70), st.integers(-(2**70), -M - 1)))  # fmt: skip
def test_out_of_bound_spec_fields_are_refused_naming_them(field, value):
    count_case()
    values = dict(t_width=1, t_offset=0, t_stride=None, s_width=1, s_offset=0, s_stride=None)
    values[field] = value
    with pytest.raises(ValueError, match=field):
        StripeSpec(**values)


@examples(40)
@given(st.sampled_from(["scale", "topk", "sparsity", "tiled", "gate", "text_tokens"]),
       st.one_of(st.none(), st.booleans(), st.integers(-3, 100), st.text(max_size=3),
                 st.floats(allow_nan=True, allow_infinity=True)))  # fmt: skip
def test_vsa_arguments_same_outcome_on_every_backend(name, value):
    """Any value of one argument: a result on both backends, or the same ValueError or
    TypeError on both, raised before any compute."""
    count_case()
    grid = VideoGrid((2, 4, 4), tile=(1, 4, 4))
    q, k, v = (torch.randn(1, 1, grid.num_tokens, 16, generator=generator(i)) for i in range(3))
    kwargs = {"topk": 1}
    if name == "sparsity":
        kwargs = {"sparsity": value}
    elif name == "gate":  # a float: a gate tensor of that value (inf, nan, past fp32 too)
        is_float = isinstance(value, float)
        kwargs["gate"] = (
            torch.full(q.shape, value, dtype=torch.float64).float() if is_float else value
        )
    else:
        kwargs[name] = value
    outcomes = []
    for backend_name in ("torch", "triton"):
        with backend(backend_name):
            try:
                out = vidsparse.video_sparse_attn(q, k, v, grid, **kwargs)
                outcomes.append(("ok", tuple(out.shape)))
            except (ValueError, TypeError) as exc:
                outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1], outcomes
