"""PSA search: candidate family, objective (against brute force), search, loss-table re-planning.

Runs on the PyTorch reference backend (``torch_backend``) with tiny grids.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import StripeSpec, stripe_block_mask, stripe_sparsity
from vidsparse.search import (
    AxisRange,
    CalibrationSample,
    Candidate,
    CandidateFamily,
    CandidateSet,
    LossTable,
    StripeObjective,
    build_loss_table,
    candidate_sparsity,
    dense_step_count,
    engine_block_size,
    load_calibration,
    plan_from_table,
    planted_stripe_heads,
    save_calibration_sample,
    search,
    select_candidates,
    stripe_losses,
)
from vidsparse.search import objective as objective_module

GRID = VideoGrid((4, 8, 8), tile=(1, 4, 4))  # block grid (4, 2, 2): 16 blocks of 16 tokens


def _block_masks(cands: CandidateSet) -> torch.Tensor:
    return stripe_block_mask(cands.block_specs(), cands.block_grid)  # [C, N, N]


# ---------------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------------


def test_default_family_has_about_100_candidates_with_dense():
    family = CandidateFamily()
    nominal = family.candidates()
    assert 90 <= len(nominal) <= 130
    assert nominal[0] == Candidate.dense()
    assert len(set(nominal)) == len(nominal)
    assert {c.spatial_unit for c in nominal} == {"block", "row"}


@pytest.mark.parametrize("block_grid", [(4, 2, 2), (3, 4, 5), (7, 4, 4)])
def test_on_grid_dedupes_masks_keeps_dense_and_sparsities_are_right(block_grid):
    family = CandidateFamily()
    cands = family.on_grid(block_grid)
    assert cands[0] == Candidate.dense() and float(cands.sparsity[0]) == 0.0
    masks = _block_masks(cands)
    flat = masks.flatten(1)
    # all distinct, none empty
    assert len({bytes(m.numpy().tobytes()) for m in flat}) == len(cands)
    assert bool(flat.any(dim=1).all())
    # every nominal candidate is represented (or attends to nothing on this grid)
    kept = {bytes(m.numpy().tobytes()) for m in flat}
    for c in family.candidates():
        m = stripe_block_mask([c.spec], block_grid, c.spatial_unit)[0]
        assert not m.any() or m.numpy().tobytes() in kept
    # sparsity from the factors == sparsity of the mask, all in [0, 1]
    torch.testing.assert_close(cands.sparsity, stripe_sparsity(masks).double(), atol=1e-6, rtol=0)
    assert bool(((cands.sparsity >= 0) & (cands.sparsity <= 1)).all())


def test_tiny_grid_merges_many_candidates():
    assert len(CandidateFamily().on_grid((4, 2, 2))) < len(CandidateFamily())


def test_row_candidates_run_as_block_specs():
    block_grid = (3, 4, 5)
    rows = [
        Candidate(StripeSpec(1, 0, None, w, o, s), "row")
        for w in (1, 2)
        for o in (0, 1, -1)
        for s in (1, 2, 3)
    ]
    cands = CandidateSet.build(rows, block_grid, dedupe=False)
    expected = stripe_block_mask([c.spec for c in rows], block_grid, "row")
    assert torch.equal(_block_masks(cands), expected)
    sp = candidate_sparsity(rows, block_grid)
    torch.testing.assert_close(sp, stripe_sparsity(expected).double(), atol=1e-6, rtol=0)


def test_family_is_configurable_and_validated():
    family = CandidateFamily(
        time=(AxisRange(widths=(1,), offsets=(0,), strides=(None, 1)),),
        space=(AxisRange(widths=(1, 2), offsets=(0,), strides=(None, 3), units=("row",)),),
    )
    assert len(family) == 1 + 2 * 4  # dense + 2 time options x 4 space options
    assert len(CandidateFamily.paper()) > len(CandidateFamily())
    with pytest.raises(ValueError, match="widths"):
        AxisRange(widths=(0,))
    with pytest.raises(ValueError, match="units"):
        AxisRange(units=("column",))
    with pytest.raises(TypeError, match="strides"):
        AxisRange(strides=(1.5,))


# ---------------------------------------------------------------------------------------------
# objective
# ---------------------------------------------------------------------------------------------


def _brute_force_stats(q, k, v, grid, cands, query_blocks=None):
    """Dense softmax over an explicit token mask, float64: err_sq, cand_sq [H, C], ref_sq [H]."""
    if q.ndim == 3:
        q, k, v = (x.unsqueeze(0) for x in (q, k, v))
    qt, kt, vt = (grid.tile(x.double(), dim=-2) for x in (q, k, v))  # [B, H, P, D]
    vol = grid.tile_volume
    masks = _block_masks(cands)  # [C, N, N]
    tok = masks.repeat_interleave(vol, 1).repeat_interleave(vol, 2)  # [C, P, P]
    real = grid.real_token_mask()
    tok = tok & real  # padding keys get no weight
    dense = real.expand_as(tok[0])
    scores = qt @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, P, P]

    def attend(mask):  # mask [..., P, P] broadcast against scores
        s = scores.unsqueeze(2).masked_fill(~mask, -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # empty rows -> 0
        return p @ vt.unsqueeze(2)

    ref = attend(dense)  # [B, H, 1, P, D]
    out = attend(tok)  # [B, H, C, P, D]
    rows = real.clone()
    if query_blocks is not None:
        chosen = torch.zeros(grid.num_tiles, dtype=torch.bool)
        chosen[torch.as_tensor(query_blocks)] = True
        rows &= chosen.repeat_interleave(vol)
    w = rows.view(-1, 1).double()

    def sq(x):
        return (x * w).square().sum(dim=(-2, -1)).sum(0)  # summed over batch

    return sq(out - ref), sq(out), sq(ref)[:, 0]


def _random_qkv(grid, heads=4, dim=16, batch=None, scale=2.0):
    shape = (heads, grid.num_tokens, dim) if batch is None else (batch, heads, grid.num_tokens, dim)
    return tuple(scale * torch.randn(shape) for _ in range(3))


@pytest.mark.slow
@pytest.mark.parametrize(
    "grid",
    [
        GRID,
        VideoGrid((3, 6, 7), tile=(1, 4, 4)),  # partial tiles (padding)
        VideoGrid((7, 4, 8), tile=(3, 4, 4)),  # 48-token blocks: 3 engine blocks of 16 each
    ],
    ids=["full", "padded", "refined"],
)
def test_objective_matches_brute_force(torch_backend, grid):
    cands = CandidateFamily().on_grid(grid.tiles)
    pick = [0, *range(1, len(cands), max(1, len(cands) // 12))]
    cands = CandidateSet.build([cands[i] for i in pick], grid.tiles, dedupe=False)
    q, k, v = _random_qkv(grid, batch=2)
    stats = stripe_losses(q, k, v, grid, cands)
    err, cand, ref = _brute_force_stats(q, k, v, grid, cands)
    torch.testing.assert_close(stats.ref_sq, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.cand_sq, cand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.err_sq, err, rtol=1e-4, atol=1e-5)
    rel = (err / ref.unsqueeze(-1)).sqrt()
    torch.testing.assert_close(stats.rel_l2, rel, rtol=1e-4, atol=1e-6)
    cos = 0.5 * (cand + ref.unsqueeze(-1) - err) / (cand * ref.unsqueeze(-1)).sqrt()
    torch.testing.assert_close(stats.cosine, cos, rtol=1e-5, atol=1e-5)
    assert stats.rel_l2.shape == (4, len(cands))
    assert float(stats.rel_l2[:, 0].abs().max()) == 0.0  # dense candidate == dense reference


def test_objective_on_a_tile_with_no_power_of_two_engine_block(torch_backend):
    """The engine's public entry takes powers of two only, on every backend (issue 22); the
    objective runs 18-token tiles on the torch reference through the internal entry, and the
    Triton path refuses them before any launch, naming block_size."""
    grid = VideoGrid((2, 6, 9), tile=(1, 3, 6))  # 18-token tiles, a partial one
    cands = CandidateFamily().on_grid(grid.tiles)
    cands = CandidateSet.build([cands[0], cands[len(cands) // 2]], grid.tiles, dedupe=False)
    q, k, v = _random_qkv(grid, batch=1)
    stats = stripe_losses(q, k, v, grid, cands)
    err, cand, ref = _brute_force_stats(q, k, v, grid, cands)
    torch.testing.assert_close(stats.err_sq, err, rtol=1e-4, atol=1e-5)
    assert float(stats.rel_l2[:, 0].abs().max()) == 0.0


def test_objective_on_such_a_tile_is_refused_on_the_triton_path(triton_backend):
    grid = VideoGrid((2, 6, 9), tile=(1, 3, 6))
    q, k, v = _random_qkv(grid, batch=1)
    cands = CandidateFamily().on_grid(grid.tiles)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        stripe_losses(q, k, v, grid, CandidateSet.build([cands[0]], grid.tiles))


def test_engine_block_size():
    assert engine_block_size(64) == 64
    assert engine_block_size(384) == 128  # 3x8x16 PSA blocks -> 3 engine blocks
    assert engine_block_size(48) == 16
    assert engine_block_size(18) == 18  # no power-of-two divisor: torch backend only


def _some_candidates(step=5):
    cands = CandidateFamily().on_grid(GRID.tiles)
    return CandidateSet.build(list(cands)[::step], GRID.tiles, dedupe=False)


def test_query_subsampling(torch_backend):
    cands = _some_candidates()
    q, k, v = _random_qkv(GRID)
    full = stripe_losses(q, k, v, GRID, cands)
    # every block, listed shuffled and repeated, is the full objective
    every = torch.randperm(GRID.num_tiles).tolist() * 2
    same = stripe_losses(q, k, v, GRID, cands, query_blocks=every)
    torch.testing.assert_close(same.err_sq, full.err_sq)
    torch.testing.assert_close(same.ref_sq, full.ref_sq)
    # a subset equals brute force restricted to its query rows
    sub_blocks = [0, 5, 6, 13]
    sub = stripe_losses(q, k, v, GRID, cands, query_blocks=sub_blocks)
    err, _, ref = _brute_force_stats(q, k, v, GRID, cands, query_blocks=sub_blocks)
    torch.testing.assert_close(sub.err_sq, err, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sub.ref_sq, ref, rtol=1e-5, atol=1e-6)
    # a fraction picks that many blocks, reproducibly
    obj = StripeObjective(GRID, cands, query_fraction=0.25, seed=3)
    assert obj.query_blocks.numel() == 4
    assert torch.equal(
        obj.query_blocks, StripeObjective(GRID, cands, query_fraction=0.25, seed=3).query_blocks
    )
    with pytest.raises(ValueError, match="query_fraction"):
        StripeObjective(GRID, cands, query_fraction=0.0)


@pytest.mark.slow
def test_candidate_chunking_is_consistent(torch_backend):
    cands = _some_candidates()  # 14 candidates
    q, k, v = _random_qkv(GRID)
    whole = StripeObjective(GRID, cands, candidate_chunk=len(cands))(q, k, v)
    for chunk in (1, 5):
        part = StripeObjective(GRID, cands, candidate_chunk=chunk)(q, k, v)
        torch.testing.assert_close(part.err_sq, whole.err_sq, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(part.cand_sq, whole.cand_sq, rtol=1e-5, atol=1e-6)
    # a byte budget of one candidate's output also chunks by one
    tiny = StripeObjective(GRID, cands, max_chunk_bytes=1)(q, k, v)
    torch.testing.assert_close(tiny.err_sq, whole.err_sq, rtol=1e-5, atol=1e-6)


def test_objective_accepts_tiled_input(torch_backend):
    cands = _some_candidates()
    q, k, v = _random_qkv(GRID)
    natural = stripe_losses(q, k, v, GRID, cands)
    tiled = stripe_losses(*(GRID.tile(x, dim=-2) for x in (q, k, v)), GRID, cands, tiled=True)
    torch.testing.assert_close(tiled.err_sq, natural.err_sq)
    with pytest.raises(ValueError, match="num_tokens"):
        stripe_losses(q[:, :-1], k[:, :-1], v[:, :-1], GRID, cands)


# ---------------------------------------------------------------------------------------------
# synthetic planted heads
# ---------------------------------------------------------------------------------------------


def _planted_choice(grid, count, lo=0.5, hi=0.95):
    """Family candidates with sparsity in [lo, hi] whose every query block attends somewhere."""
    cands = CandidateFamily().on_grid(grid.tiles)
    out = []
    for i, c in enumerate(cands):
        if not lo <= float(cands.sparsity[i]) <= hi:
            continue
        try:
            planted_stripe_heads(grid, [c])
        except ValueError:
            continue
        out.append(c)
    step = max(1, len(out) // count)
    return out[::step][:count]


def test_planted_heads_put_their_mass_on_the_planted_mask():
    planted = _planted_choice(GRID, 4)
    syn = planted_stripe_heads(GRID, planted, head_dim=16)
    assert syn.q.shape == (4, GRID.num_tokens, 16)
    qt, kt = (GRID.tile(x, dim=-2) for x in (syn.q, syn.k))
    p = torch.softmax(qt @ kt.transpose(-1, -2) / 4.0, dim=-1)  # [H, P, P], no padding here
    vol = GRID.tile_volume
    for h, c in enumerate(planted):
        mask = stripe_block_mask([c.spec], GRID.tiles, c.spatial_unit)[0]
        tok = mask.repeat_interleave(vol, 0).repeat_interleave(vol, 1)
        mass = (p[h] * tok).sum(-1)  # per query token
        assert float(mass.min()) > 0.999


def test_planted_heads_refuse_patterns_with_empty_rows():
    lag = Candidate(StripeSpec(1, 2, None, 1, 0, None))  # the last two frames see nothing
    with pytest.raises(ValueError, match="without any key block"):
        planted_stripe_heads(GRID, [lag])
    with pytest.raises(ValueError, match="head_dim"):
        planted_stripe_heads(GRID, [Candidate.dense()], head_dim=8)


# ---------------------------------------------------------------------------------------------
# search
# ---------------------------------------------------------------------------------------------


def _samples(planted, steps, layers, batch=None):
    out = []
    for step in steps:
        for layer in layers:
            seed = 1000 * step + layer
            syn = planted_stripe_heads(GRID, planted, head_dim=16, seed=seed, batch=batch)
            out.append(CalibrationSample(step, layer, syn.q, syn.k, syn.v))
    return out


@pytest.fixture(scope="module")
def planted_search():
    """One search over planted heads (2 searched steps x 2 layers), shared by the tests below."""
    planted = _planted_choice(GRID, 4)
    samples = _samples(planted, steps=[1, 3], layers=[0, 1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIDSPARSE_BACKEND", "torch")
        result = search(samples, GRID, alpha=0.05, num_steps=5, progress=False, model="toy")
    return planted, result


@pytest.mark.slow
def test_search_recovers_planted_stripes(planted_search):
    planted, result = planted_search
    plan = result.plan
    assert plan.dense_steps == 1 and plan.model == "toy"
    assert [(b.start, b.end) for b in plan.buckets] == [(1, 3), (3, 5)]
    assert plan.layers == [0, 1]
    for bucket in plan.buckets:
        for layer, heads in bucket.layers.items():
            for h, choice in enumerate(heads):
                want = planted[h]
                chosen_mask = stripe_block_mask([choice.spec], GRID.tiles, choice.spatial_unit)[0]
                planted_mask = stripe_block_mask([want.spec], GRID.tiles, want.spatial_unit)[0]
                assert bool((planted_mask <= chosen_mask).all()), (layer, h, str(choice.candidate))
                planted_sparsity = float(stripe_sparsity(planted_mask.unsqueeze(0)))
                assert abs(choice.sparsity - planted_sparsity) <= 0.03
                assert choice.rel_l2 <= 0.05 and choice.cosine > 0.99


def test_replan_from_table_matches_fresh_search_without_the_objective(
    planted_search, monkeypatch, tmp_path
):
    _, fresh = planted_search

    def refuse(*args, **kwargs):
        raise AssertionError("re-planning must not run the objective")

    monkeypatch.setattr(objective_module.StripeObjective, "__call__", refuse)
    start = time.perf_counter()
    replanned = plan_from_table(fresh.table, alpha=0.05)
    assert time.perf_counter() - start < 2.0
    assert replanned.to_dict() == fresh.plan.to_dict()
    # through a file too
    fresh.table.save(tmp_path / "losses.pt")
    loaded = LossTable.load(tmp_path / "losses.pt")
    assert plan_from_table(loaded, alpha=0.05).to_dict() == fresh.plan.to_dict()
    # a looser alpha never gives a denser choice, and a new alpha is really applied
    loose = plan_from_table(loaded, alpha=0.9)
    assert loose.selection["alpha"] == 0.9
    for b_tight, b_loose in zip(replanned.buckets, loose.buckets):
        for layer in b_tight.layers:
            for a, b in zip(b_tight.layers[layer], b_loose.layers[layer]):
                assert b.sparsity >= a.sparsity and b.rel_l2 <= 0.9


@pytest.mark.slow
def test_replan_equals_a_fresh_search_at_another_alpha(torch_backend):
    planted = _planted_choice(GRID, 2)
    samples = _samples(planted, steps=[2, 4], layers=[0])
    cands = CandidateFamily().on_grid(GRID.tiles)
    cands = CandidateSet.build([*planted, *list(cands)[::6]], GRID.tiles)
    common = dict(num_steps=5, progress=False, candidates=cands)
    table = build_loss_table(samples, GRID, **common)
    for alpha in (0.01, 0.5):
        fresh = search(samples, GRID, alpha=alpha, **common).plan
        assert plan_from_table(table, alpha=alpha).to_dict() == fresh.to_dict()


def test_target_sparsity_mode(planted_search):
    _, result = planted_search
    table = result.table
    target = 0.8
    plan = plan_from_table(table, target_sparsity=target)
    assert plan.selection == {
        "mode": "target",
        "alpha": None,
        "target_sparsity": target,
        "metric": "rel_l2",
    }
    sparsity = table.candidates.sparsity
    for bucket in plan.buckets:
        entries = [e for e, s in enumerate(table.steps) if bucket.start <= s < bucket.end]
        for layer, heads in bucket.layers.items():
            rel = table.pooled([e for e in entries if table.layers[e] == layer]).rel_l2
            for h, choice in enumerate(heads):
                assert choice.sparsity >= target - 1e-9
                allowed = sparsity >= target - 1e-9
                assert choice.rel_l2 == pytest.approx(float(rel[h][allowed].min()))
    with pytest.raises(ValueError, match="target_sparsity"):
        plan_from_table(table, target_sparsity=1.0)


def test_first_steps_are_dense(torch_backend):
    planted = _planted_choice(GRID, 2)
    samples = _samples(planted, steps=[0, 1, 2, 6], layers=[0])
    table = build_loss_table(samples, GRID, num_steps=10, progress=False)
    assert dense_step_count(10, 0.2) == 2 and dense_step_count(50, 0.2) == 10
    assert table.skipped_steps == {0, 1}  # never evaluated
    assert sorted(set(table.steps)) == [2, 6]
    plan = plan_from_table(table, alpha=0.05)
    assert plan.dense_steps == 2
    assert [(b.start, b.end) for b in plan.buckets] == [(2, 6), (6, 10)]
    for step in (0, 1):
        assert plan.specs_for(step, 0) == [StripeSpec.dense()] * 2
    assert plan.specs_for(2, 0) != [StripeSpec.dense()] * 2
    # the table cannot serve a plan whose dense prefix is shorter than the table's
    with pytest.raises(ValueError, match=r"steps \[1\]"):
        plan_from_table(table, alpha=0.05, dense_fraction=0.1)
    # explicit buckets
    merged = plan_from_table(table, alpha=0.05, bucket_starts=[0, 5])
    assert [(b.start, b.end) for b in merged.buckets] == [(2, 5), (5, 10)]


def test_select_candidates_rules():
    rel = torch.tensor([[0.0, 0.01, 0.04, 0.2], [0.0, 0.06, 0.03, 0.03]])
    sparsity = torch.tensor([0.0, 0.5, 0.7, 0.7])
    assert select_candidates(rel, sparsity, alpha=0.05).tolist() == [2, 2]  # tie -> lower error
    assert select_candidates(rel, sparsity, alpha=0.0).tolist() == [0, 0]
    assert select_candidates(rel, sparsity, target_sparsity=0.6).tolist() == [2, 2]
    assert select_candidates(rel, sparsity, target_sparsity=0.4).tolist() == [1, 2]
    with pytest.raises(ValueError, match="exactly one"):
        select_candidates(rel, sparsity)
    with pytest.raises(ValueError, match="exactly one"):
        select_candidates(rel, sparsity, alpha=0.1, target_sparsity=0.5)


def test_calibration_files_round_trip(torch_backend, tmp_path):
    planted = _planted_choice(GRID, 2)
    samples = _samples(planted, steps=[1, 2], layers=[0], batch=2)
    for i, s in enumerate(samples):
        save_calibration_sample(s, tmp_path / f"{i:03d}.pt", grid=GRID)
    files = load_calibration(tmp_path)
    assert len(files) == 2 and files[1].q.shape == (2, 2, GRID.num_tokens, 16)
    cands = CandidateSet.build(
        [Candidate.dense(), *planted, *CandidateFamily().candidates()[40:45]],
        GRID.tiles,
    )
    from_files = build_loss_table(tmp_path, GRID, candidates=cands, progress=False)
    in_memory = build_loss_table(samples, GRID, candidates=cands, progress=False)
    assert from_files.steps == in_memory.steps == [1, 2]
    torch.testing.assert_close(torch.stack(from_files.err_sq), torch.stack(in_memory.err_sq))
    # a file captured on another grid is refused
    other = CalibrationSample(1, 0, samples[0].q, samples[0].k, samples[0].v, grid_shape=(4, 8, 9))
    save_calibration_sample(other, tmp_path / "zzz.pt")
    with pytest.raises(ValueError, match="captured on grid"):
        build_loss_table(tmp_path, GRID, candidates=cands, progress=False)
    torch.save({"format": "something-else"}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="format"):
        load_calibration(tmp_path / "bad.pt")[0]


@pytest.mark.interpreter
def test_objective_on_the_triton_kernels_matches_the_reference(triton_backend, monkeypatch):
    """The expanded (stride-0) candidate layout through the Triton forward kernel."""
    grid = VideoGrid((2, 4, 7), tile=(1, 4, 4))  # 4 blocks, partial ones (padding keys)
    cands = CandidateFamily().on_grid(grid.tiles)
    cands = CandidateSet.build(list(cands)[:: max(1, len(cands) // 4)], grid.tiles, dedupe=False)
    q, k, v = _random_qkv(grid, heads=2)
    triton_stats = stripe_losses(q, k, v, grid, cands, candidate_chunk=3)
    monkeypatch.setenv("VIDSPARSE_BACKEND", "torch")
    ref_stats = stripe_losses(q, k, v, grid, cands)
    torch.testing.assert_close(triton_stats.err_sq, ref_stats.err_sq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(triton_stats.ref_sq, ref_stats.ref_sq, rtol=1e-5, atol=1e-6)
