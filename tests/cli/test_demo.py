"""The demo workload: the shipped clip, the q/k/v made from it, Wan's RoPE, the run and its PNGs."""

import importlib.util
import math
import sys
import time

import numpy as np
import pytest
import torch

import vidsparse
from vidsparse import StripeSpec
from vidsparse.data import load_clip
from vidsparse.demo import (
    CPU_DIM,
    CPU_GRID,
    CPU_HEADS,
    apply_wan_rope,
    clip_frame_indices,
    clip_qkv,
    rope_band_pairs,
    run_demo,
)
from vidsparse.ops.stripe_attn import stripe_attn_density

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_clip_asset_loads():
    frames = load_clip()
    assert frames.shape == (81, 104, 180, 3) and frames.dtype == np.uint8
    # Real footage: a full range of values, and consecutive frames differ but only a little.
    assert frames.min() < 30 and frames.max() > 225
    step = np.abs(np.diff(frames[:20].astype(np.int16), axis=0)).mean()
    assert 0.2 < step < 20


def test_frame_indices_follow_wans_vae():
    assert clip_frame_indices(81, 21) == list(range(81))  # 1 + 4 * 20 frames
    assert clip_frame_indices(81, 8) == list(range(0, 57, 2))  # 29 frames, strided
    with pytest.raises(ValueError, match="clip frames"):
        clip_frame_indices(81, 22)


def _clip_keys(grid=CPU_GRID, heads=CPU_HEADS, head_dim=CPU_DIM):
    gen = torch.Generator().manual_seed(0)
    return clip_qkv(
        load_clip(), grid, heads, head_dim, device="cpu", dtype=torch.float32, generator=gen
    )


def test_keys_from_the_clip_are_not_iid():
    _, k, _ = _clip_keys()
    k = torch.nn.functional.normalize(k[0], dim=-1)  # [heads, S, D]
    W = CPU_GRID[2]
    neighbours = (k[:, :-1] * k[:, 1:]).sum(-1)  # w-neighbours (and a few row wraps)
    below = (k[:, :-W] * k[:, W:]).sum(-1)  # h-neighbours
    perm = torch.randperm(k.shape[1], generator=torch.Generator().manual_seed(1))
    random_pairs = (k * k[:, perm]).sum(-1)
    assert neighbours.mean() > random_pairs.mean() + 0.3
    assert below.mean() > random_pairs.mean() + 0.3


def test_rope_band_split_is_wans():
    assert rope_band_pairs(128) == (22, 21, 21)  # 44 / 42 / 42 dims for t / h / w
    assert rope_band_pairs(64) == (12, 10, 10)


def _at(grid, t, h, w):
    return (t * grid[1] + h) * grid[2] + w


def test_rope_scores_depend_only_on_relative_position():
    grid, D = (6, 5, 7), 64
    gen = torch.Generator().manual_seed(0)
    content_q, content_k = torch.randn(2, D, generator=gen)
    S = grid[0] * grid[1] * grid[2]
    q = apply_wan_rope(content_q.expand(S, D).clone(), grid)
    k = apply_wan_rope(content_k.expand(S, D).clone(), grid)
    scores = q @ k.T
    for offset in [(1, 2, -3), (2, 0, 1), (-1, -1, 2)]:
        pairs = [
            ((t, h, w), (t + offset[0], h + offset[1], w + offset[2]))
            for t, h, w in [(1, 1, 3), (2, 2, 4), (3, 1, 3)]
        ]
        values = [scores[_at(grid, *m), _at(grid, *n)] for m, n in pairs]
        torch.testing.assert_close(torch.stack(values), values[0].expand(3), rtol=0, atol=1e-4)
    # ... and a different offset gives a different score (position is really encoded).
    assert abs(scores[_at(grid, 1, 1, 1), _at(grid, 1, 1, 2)] - scores[0, 0]) > 1e-3
    # RoPE is a rotation: norms unchanged.
    torch.testing.assert_close(q.norm(dim=-1), content_q.norm().expand(S))


def check_psa_row(row, heads: int, target: float = 0.75) -> None:
    """The PSA row of a demo report: a searched pattern per head, timed and measured."""
    assert row["method"] == f"PSA target {target}"
    assert row["ms"] > 0 and math.isfinite(row["ms"]) and row["speedup"] > 0
    assert math.isfinite(row["rel_l2"]) and 0 < row["rel_l2"] < 0.5
    assert 0 < row["sparsity"] < 1
    psa = row["psa"]
    assert psa["search"]["target_sparsity"] == target and psa["search"]["seconds"] > 0
    assert 0 < psa["search"]["query_fraction"] < 1 and psa["search"]["num_candidates"] > 1
    assert len(psa["heads"]) == heads
    grid = vidsparse.VideoGrid(CPU_GRID, tile=tuple(psa["tile"]))
    assert list(grid.tiles) == psa["block_grid"]
    specs = [StripeSpec.from_dict(h["spec"]) for h in psa["heads"]]
    # The sparsity reported is that of the specs stripe_attn ran, and meets the target.
    ran = 1 - stripe_attn_density(specs, grid).double()
    reported = torch.tensor([h["sparsity"] for h in psa["heads"]], dtype=torch.float64)
    torch.testing.assert_close(ran, reported, rtol=0, atol=1e-6)
    assert bool((reported >= target - 1e-9).all()) and bool((reported < 1).all())
    assert math.isclose(row["sparsity"], float(reported.mean()), abs_tol=1e-9)
    assert all(math.isfinite(h["search_rel_l2"]) for h in psa["heads"])


@pytest.mark.slow
def test_cpu_demo_runs_fast_and_writes_pngs(tmp_path, torch_backend):
    start = time.perf_counter()
    report = run_demo(device="cpu", log=None, out_dir=tmp_path)
    assert time.perf_counter() - start < 90  # CI runs two suites side by side on 2 cores
    assert "Big Buck Bunny" in report["workload"]["inputs"]
    methods = [r["method"] for r in report["results"]]
    assert [m.split()[0] for m in methods] == ["dense", "VSA", "PSA"]
    assert 0 < report["results"][1]["rel_l2"] < 0.5
    assert report["results"][1]["sparsity"] == 0.875  # 4 of 32 tiles kept
    check_psa_row(report["results"][2], heads=CPU_HEADS)
    names = ["attention_dense.png", "vsa_selection.png", "clip_frame.png", "psa_masks.png"]
    if HAS_MATPLOTLIB:
        assert {p.name for p in tmp_path.glob("*.png")} == set(names)
        assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
        assert report["figures"] == names  # relative to the output folder
    else:
        assert report["figures"] == []


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the pictures need matplotlib")
def test_cpu_demo_pictures_a_representative_tile_and_says_cpu_times_mean_nothing(
    tmp_path, torch_backend
):
    """The VSA picture's query tile keeps about the mean dense mass over all query tiles (not
    the least), and the log gives that mean; the CPU run says its times are not meaningful;
    PSA's spec notation is explained."""
    from vidsparse import demo

    lines = []
    run_demo(device="cpu", log=lines.append, out_dir=tmp_path)
    text = "\n".join(lines)
    assert "CPU times are not meaningful" in text
    assert "notation: t(w,o,s)" in text
    (picture,) = [line for line in lines if line.startswith("VSA picture:")]
    assert "mean over all query tiles" in picture
    # The same choice, recomputed (the demo's seed-0 q and k): nearest the mean, not the worst.
    frames = load_clip()
    grid = vidsparse.VideoGrid(CPU_GRID)
    q, k, _ = _clip_keys()
    kept = demo.vsa_kept_mass(q, k, grid, [0, 1], 0.875)
    assert kept.shape == (2, grid.num_tiles) and bool(((kept > 0) & (kept <= 1 + 1e-5)).all())
    tile, coords = demo._query_tile(grid, frames, kept)
    mass = kept.mean(0)
    assert abs(float(mass[tile] - mass.mean())) <= max(float((mass - mass.mean()).abs().min()),
                                                       0.02) + 1e-6  # fmt: skip
    assert float(mass[tile]) > float(mass.min())
    assert str(tuple(coords)) in picture


@pytest.mark.slow
def test_demo_without_out_dir_writes_nothing(tmp_path, monkeypatch, torch_backend):
    monkeypatch.chdir(tmp_path)
    report = run_demo(device="cpu", log=None)
    assert "figures" not in report and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_demo_without_matplotlib_skips_pngs_with_a_note(tmp_path, monkeypatch, torch_backend):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    lines = []
    report = run_demo(device="cpu", log=lines.append, out_dir=tmp_path)
    assert report["figures"] == [] and not list(tmp_path.glob("*.png"))
    assert any("matplotlib is not installed" in line for line in lines)
