"""PSA stripe masks against an independent brute-force evaluation of the stripe predicate
(the formula of ``vidsparse.masks.stripe``'s docstring)."""

from __future__ import annotations

import random

import pytest
import torch

from vidsparse.masks.block_sparse import dense_from_lists
from vidsparse.masks.stripe import (
    MAX_GRID_EXTENT,
    StripeSpec,
    clear_stripe_cache,
    stripe_block_lists,
    stripe_block_mask,
    stripe_predicate,
    stripe_sparsity,
)


def _brute_mask(spec: StripeSpec, grid, spatial_unit, sink_frames=0):
    """The stripe predicate with Python ints, looping over block coordinates (no torch)."""
    tb, hb, wb = grid
    n = tb * hb * wb
    out = [[False] * n for _ in range(n)]
    period = None
    if spec.s_stride is not None:
        period = spec.s_stride * (wb if spatial_unit == "row" else 1)
    for tq in range(tb):
        for sq in range(hb * wb):  # sq = hq*Wb + wq
            for tk in range(tb):
                for sk in range(hb * wb):
                    dist_t = abs((tk - tq) - spec.t_offset)
                    if spec.t_stride is not None:
                        dist_t %= spec.t_stride
                    dist_s = abs((sk - sq) - spec.s_offset)
                    if period is not None:
                        dist_s %= period
                    attend = dist_t <= spec.t_width - 1 and dist_s <= spec.s_width - 1
                    attend = attend or tk < sink_frames
                    q = tq * hb * wb + sq  # raster order (t, h, w)
                    k = tk * hb * wb + sk
                    out[q][k] = attend
    return torch.tensor(out, dtype=torch.bool)


def _random_spec(rng: random.Random) -> StripeSpec:
    return StripeSpec(
        t_width=rng.randint(1, 2),
        t_offset=rng.randint(-2, 2),
        t_stride=rng.choice([None, 1, 2, 3]),
        s_width=rng.randint(1, 3),
        s_offset=rng.randint(-3, 3),
        s_stride=rng.choice([None, 1, 2, 3, 5, 6]),
    )


@pytest.mark.parametrize("grid", [(3, 4, 5), (5, 2, 3), (1, 1, 7), (4, 1, 1)])
@pytest.mark.parametrize("spatial_unit", ["block", "row"])
@pytest.mark.parametrize("sink_frames", [0, 1])
def test_mask_matches_brute_force(grid, spatial_unit, sink_frames):
    rng = random.Random(f"{grid}{spatial_unit}{sink_frames}")  # str seeds are reproducible
    specs = [_random_spec(rng) for _ in range(5)]
    specs.append(StripeSpec(1, -1, None, 2, -1, 5))  # negative offsets, infinite t stride
    mask = stripe_block_mask(specs, grid, spatial_unit, sink_frames=sink_frames)
    n = grid[0] * grid[1] * grid[2]
    assert mask.shape == (len(specs), n, n) and mask.dtype == torch.bool
    for h, spec in enumerate(specs):
        expected = _brute_mask(spec, grid, spatial_unit, sink_frames)
        assert torch.equal(mask[h], expected), (h, str(spec))


def test_predicate_single_and_multi_head():
    spec = StripeSpec(1, 0, None, 2, 0, 3)
    ds = torch.arange(-6, 7)
    got = stripe_predicate(torch.zeros_like(ds), ds, spec, wb=1, spatial_unit="block")
    assert got.tolist() == [(abs(d) % 3) <= 1 for d in range(-6, 7)]
    both = stripe_predicate(
        torch.zeros_like(ds), ds, [spec, StripeSpec.dense()], wb=1, spatial_unit="block"
    )
    assert both.shape == (2, 13) and torch.equal(both[0], got) and both[1].all()
    with pytest.raises(TypeError, match="dt"):
        stripe_predicate(torch.zeros(3), ds[:3], spec, wb=1)


def test_unit_strides_are_dense():
    rng = random.Random(3)
    for _ in range(5):
        spec = StripeSpec(rng.randint(1, 3), rng.randint(-3, 3), 1, rng.randint(1, 3), 0, 1)
        assert stripe_block_mask([spec], (3, 4, 5), "block").all()
        assert spec.is_dense((3, 4, 5), "block")
        # "row": the period is Wb blocks, so it is dense only when the band fills a row
        wide = StripeSpec(1, 0, 1, 5, 0, 1)
        assert stripe_block_mask([wide], (3, 4, 5), "row").all()
    assert stripe_block_mask([StripeSpec.dense()], (2, 3, 4)).all()
    assert not StripeSpec(1, 0, None, 1, 0, None).is_dense((2, 3, 4))
    assert not StripeSpec(1, 0, 1, 1, 0, 1).is_dense((1, 2, 3), "row")


def test_row_unit_period():
    # One frame of 2x3 blocks: stride 1 row = period 3 in flattened blocks.
    spec = StripeSpec(1, 0, None, 1, 0, 1)
    mask = stripe_block_mask([spec], (1, 2, 3), "row")[0]
    ids = torch.arange(6)
    assert torch.equal(mask, (ids.view(1, 6) - ids.view(6, 1)).abs() % 3 == 0)


def test_per_head_patterns():
    specs = [
        StripeSpec(1, 0, None, 1, 0, None),  # diagonal only
        StripeSpec.dense(),
        StripeSpec(1, 0, None, 6, 0, None),  # same frame
        StripeSpec(1, 1, None, 6, 0, None),  # next frame
    ]
    grid = (3, 2, 3)
    mask = stripe_block_mask(specs, grid)
    n = 18
    assert torch.equal(mask[0], torch.eye(n, dtype=torch.bool))
    assert mask[1].all()
    frame = torch.arange(n) // 6
    assert torch.equal(mask[2], frame.view(n, 1) == frame.view(1, n))
    assert torch.equal(mask[3], frame.view(1, n) - frame.view(n, 1) == 1)
    for h, spec in enumerate(specs):  # each head equals its own single-head mask
        assert torch.equal(mask[h], stripe_block_mask([spec], grid)[0])
    sp = stripe_sparsity(mask)
    assert sp.shape == (4,)
    assert sp.tolist() == pytest.approx([1 - 1 / n, 0.0, 2 / 3, 1 - 2 * 36 / n**2])


def test_sink_frames():
    spec = StripeSpec(1, 0, None, 1, 0, None)
    mask = stripe_block_mask([spec], (3, 1, 2), sink_frames=2)[0]
    assert mask[:, :4].all()  # key blocks of frames 0 and 1
    assert torch.equal(mask[:, 4:], torch.eye(6, dtype=torch.bool)[:, 4:])


def test_cache_returns_same_object():
    clear_stripe_cache()
    a = stripe_block_mask([StripeSpec(1, 0, 2, 1, 0, 3)], (2, 2, 2))
    b = stripe_block_mask((StripeSpec(1, 0, 2, 1, 0, 3),), [2, 2, 2], "block", device="cpu")
    assert a is b
    c = stripe_block_mask([StripeSpec(1, 0, 2, 1, 0, 3)], (2, 2, 2), "row")
    assert c is not a
    la = stripe_block_lists([StripeSpec(1, 0, 2, 1, 0, 3)], (2, 2, 2))
    lb = stripe_block_lists([StripeSpec(1, 0, 2, 1, 0, 3)], (2, 2, 2))
    assert la[0] is lb[0] and la[1] is lb[1]


def test_stripe_block_lists_match_mask():
    rng = random.Random(11)
    specs = [_random_spec(rng) for _ in range(4)]
    grid = (3, 4, 5)
    kv_indices, kv_counts = stripe_block_lists(specs, grid, "row", sink_frames=1)
    assert kv_indices.shape[:3] == (1, 4, 60) and kv_counts.shape == (1, 4, 60)
    mask = stripe_block_mask(specs, grid, "row", sink_frames=1)
    assert torch.equal(dense_from_lists(kv_indices, kv_counts, 60)[0], mask)


def test_spec_validation():
    with pytest.raises(ValueError, match="t_width"):
        StripeSpec(0, 0, None, 1, 0, None)
    with pytest.raises(ValueError, match="s_width"):
        StripeSpec(1, 0, None, -1, 0, None)
    with pytest.raises(ValueError, match="t_stride"):
        StripeSpec(1, 0, 0, 1, 0, None)
    with pytest.raises(ValueError, match="s_stride"):
        StripeSpec(1, 0, None, 1, 0, -2)
    with pytest.raises(TypeError, match="t_offset"):
        StripeSpec(1, 0.5, None, 1, 0, None)
    with pytest.raises(TypeError, match="s_offset"):
        StripeSpec(1, 0, None, 1, True, None)
    with pytest.raises(TypeError, match="s_stride"):
        StripeSpec(1, 0, None, 1, 0, "inf")
    StripeSpec(1, -5, None, 1, -7, None)  # negative offsets are fine


def test_spec_serialisation_and_str():
    spec = StripeSpec(1, 0, None, 2, -1, 5)
    assert str(spec) == "t(w=1,o=0,s=inf) s(w=2,o=-1,s=5)"
    d = spec.to_dict()
    assert d == dict(t_width=1, t_offset=0, t_stride=None, s_width=2, s_offset=-1, s_stride=5)
    assert StripeSpec.from_dict(d) == spec
    assert StripeSpec.from_dict({**d, "t_stride": "inf"}) == spec
    with pytest.raises(ValueError, match="missing"):
        StripeSpec.from_dict({k: v for k, v in d.items() if k != "s_width"})
    with pytest.raises(ValueError, match="unknown"):
        StripeSpec.from_dict({**d, "extra": 1})
    assert hash(spec) == hash(StripeSpec.from_dict(d))


def test_mask_argument_errors():
    spec = StripeSpec.dense()
    with pytest.raises(ValueError, match="spatial_unit"):
        stripe_block_mask([spec], (2, 2, 2), "token")
    with pytest.raises(TypeError, match="specs"):
        stripe_block_mask(spec, (2, 2, 2))
    with pytest.raises(TypeError, match=r"specs\[1\]"):
        stripe_block_mask([spec, (1, 0, None, 1, 0, None)], (2, 2, 2))
    with pytest.raises(ValueError, match="specs"):
        stripe_block_mask([], (2, 2, 2))
    with pytest.raises(ValueError, match="block_grid"):
        stripe_block_mask([spec], (2, 2))
    with pytest.raises(ValueError, match="sink_frames"):
        stripe_block_mask([spec], (2, 2, 2), sink_frames=-1)


# --------------------------------------------------------------------------- bounds (issue 22)

M = MAX_GRID_EXTENT


@pytest.mark.parametrize(
    "field, value",
    [("t_width", 10**30), ("t_width", M + 1), ("s_width", 2**63), ("t_stride", M + 1),
     ("s_stride", 10**30), ("t_offset", 2**63 - 1), ("t_offset", -(2**63 - 1)),
     ("s_offset", M + 1), ("s_offset", -M - 1)],
)  # fmt: skip
def test_spec_fields_are_range_checked_naming_the_field(field, value):
    """Values past MAX_GRID_EXTENT were accepted: t_width=10**30 ended in torch's "Overflow
    when unpacking long long" naming no field, offsets of +-(2**63 - 1) wrapped in int64 and
    gave silently wrong masks."""
    fields = dict(t_width=1, t_offset=0, t_stride=None, s_width=1, s_offset=0, s_stride=None)
    fields[field] = value
    with pytest.raises(ValueError, match=rf"{field} must lie in \[-?[0-9]+, {M}\]"):
        StripeSpec(**fields)
    with pytest.raises(ValueError, match=field):
        StripeSpec.from_dict(fields)


def test_extreme_legal_specs_give_exact_masks():
    """At the bounds the int64 maths cannot overflow: the masks equal the Python-int
    predicate (a farther offset, with no stride, attends to nothing on any grid)."""
    grid = (2, 2, 3)
    specs = [StripeSpec(M, -M, M, M, M, M), StripeSpec(1, M, None, 1, -M, None),
             StripeSpec(2, -M, 3, 1, M, 5), StripeSpec(1, 0, M, 1, 0, M)]  # fmt: skip
    for unit in ("block", "row"):
        for spec in specs:
            got = stripe_block_mask([spec], grid, unit)[0]
            assert torch.equal(got, _brute_mask(spec, grid, unit)), (spec, unit)
    assert not stripe_block_mask([specs[1]], grid)[0].any()


def test_block_grid_and_distances_are_bounded():
    with pytest.raises(ValueError, match="block_grid must hold at most MAX_GRID_EXTENT"):
        stripe_block_mask([StripeSpec.dense()], (2**11, 2**11, 2**10))
    spec = StripeSpec(1, 0, None, 1, 0, None)
    with pytest.raises(ValueError, match=r"dt must lie in \[-2147483647, 2147483647\]"):
        stripe_predicate(torch.tensor([2**62]), torch.tensor([0]), spec, wb=1)
    with pytest.raises(ValueError, match="wb must be <= MAX_GRID_EXTENT"):
        stripe_predicate(torch.tensor([0]), torch.tensor([0]), spec, wb=M + 1)


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "bogus", 3.5])
def test_mask_device_this_process_cannot_use_is_a_value_error(device):
    """stripe_block_mask(device="cuda") on a CPU build raised torch's AssertionError."""
    if torch.cuda.is_available() and device == "cuda":
        pytest.skip("CUDA is usable here")
    with pytest.raises(ValueError, match="device"):
        stripe_block_mask([StripeSpec.dense()], (1, 2, 2), device=device)
    with pytest.raises(ValueError, match="device"):
        stripe_block_lists([StripeSpec.dense()], (1, 2, 2), device=device)
