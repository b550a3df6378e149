"""Pictures: the block-level attention map against brute force, and the PNG writers."""

import sys

import pytest
import torch

from vidsparse import StripeSpec, VideoGrid, plots
from vidsparse.plots import (
    PlotsUnavailable,
    block_attention_map,
    plot_attention_vs_mask,
    plot_plan_masks,
)
from vidsparse.search import HeadChoice, Plan, PlanBucket

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Partial edge tiles on every axis: padding must not leak into the map.
GRID = VideoGrid((3, 5, 6), tile=(2, 4, 4))
STRIPE = StripeSpec(1, 0, None, 1, 0, None)


def _brute_force_map(q, k, grid):
    """Mean probability per block pair from the full S x S softmax."""
    n, v = grid.num_tiles, grid.tile_volume
    probs = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    tiled = grid.tile(grid.tile(probs, dim=-1), dim=-2)  # padding rows / columns are zero
    sums = tiled.view(q.shape[0], n, v, n, v).sum((2, 4))
    counts = grid.tile_sizes.float()
    return sums / counts.view(1, n, 1) / counts.view(1, 1, n)


def test_block_attention_map_matches_brute_force():
    q, k = torch.randn(3, GRID.num_tokens, 8) * 2, torch.randn(3, GRID.num_tokens, 8) * 2
    got = block_attention_map(q, k, GRID, heads=[2, 0])
    want = _brute_force_map(q, k, GRID)[[2, 0]]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # each query block's probabilities, weighted by the key counts, sum to one
    rows = (got * GRID.tile_sizes.float()).sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows))


@pytest.mark.slow
def test_block_attention_map_chunked_and_tiled_agree(monkeypatch):
    q, k = torch.randn(2, GRID.num_tokens, 8), torch.randn(2, GRID.num_tokens, 8)
    want = block_attention_map(q, k, GRID, heads=[0, 1])
    monkeypatch.setattr(plots, "_CHUNK_ELEMENTS", 7 * GRID.padded_len)  # 7 query rows a chunk
    chunked = block_attention_map(q, k, GRID, heads=[0, 1])
    tiled = block_attention_map(GRID.tile(q), GRID.tile(k), GRID, heads=[0, 1], tiled=True)
    batched = block_attention_map(q[None], k[None], GRID, heads=[0, 1])
    for got in (chunked, tiled, batched):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_sampled_query_rows_exact_for_block_constant_queries():
    # With the same query on every token of a block, any subset of its rows gives the mean.
    q_blocks = torch.randn(1, GRID.num_tiles, 8) * 2
    q_tiled = q_blocks[:, :, None].expand(-1, -1, GRID.tile_volume, -1).reshape(1, -1, 8)
    q = GRID.untile(q_tiled)
    k = torch.randn(1, GRID.num_tokens, 8) * 2
    exact = block_attention_map(q, k, GRID, heads=[0])
    sampled = block_attention_map(q, k, GRID, heads=[0], max_query_rows=2 * GRID.num_tiles)
    torch.testing.assert_close(sampled, exact, atol=1e-6, rtol=1e-5)


def test_block_attention_map_rejects_bad_heads():
    q = torch.randn(2, GRID.num_tokens, 8)
    with pytest.raises(ValueError, match="heads"):
        block_attention_map(q, q, GRID, heads=[2])


def test_mass_kept_is_one_for_a_dense_mask():
    q, k = torch.randn(1, GRID.num_tokens, 8), torch.randn(1, GRID.num_tokens, 8)
    attn = block_attention_map(q, k, GRID, heads=[0])[0]
    full = torch.ones(GRID.num_tiles, GRID.num_tiles, dtype=torch.bool)
    assert plots._mass_kept(attn, full, GRID) == pytest.approx(1.0, abs=1e-5)
    assert plots._mass_kept(attn, ~full, GRID) == 0.0


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == PNG_MAGIC


def test_plot_attention_vs_mask_writes_png(tmp_path):
    q, k = torch.randn(2, GRID.num_tokens, 8), torch.randn(2, GRID.num_tokens, 8)
    out = tmp_path / "sub" / "attn.png"  # the folder is created
    path = plot_attention_vs_mask(q, k, GRID, [STRIPE, StripeSpec.dense()], out)
    assert path == str(out) and _is_png(out)  # heads beyond the head count are dropped


def test_plot_attention_vs_mask_needs_one_spec_per_head(tmp_path):
    q = torch.randn(2, GRID.num_tokens, 8)
    with pytest.raises(ValueError, match="one spec per head"):
        plot_attention_vs_mask(q, q, GRID, [STRIPE], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def _plan(num_layers=2, num_heads=3):
    choice = HeadChoice(STRIPE, "block", sparsity=0.9, rel_l2=0.01, cosine=0.99)
    layers = {layer: (choice,) * num_heads for layer in range(num_layers)}
    return Plan(
        model="test",
        grid=GRID,
        num_heads=num_heads,
        num_steps=5,
        dense_steps=1,
        buckets=(PlanBucket(1, 5, layers),),
        selection={"mode": "alpha", "alpha": 0.05, "target_sparsity": None, "metric": "rel_l2"},
    )


def test_plot_plan_masks_writes_png(tmp_path):
    out = tmp_path / "masks.png"
    assert plot_plan_masks(_plan(), out, heads=2) == str(out)
    assert _is_png(out)
    plot_plan_masks(_plan(), out, step=0, layers=[1])  # a dense step, one layer
    assert _is_png(out)


def test_missing_matplotlib_raises_plots_unavailable(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import fail as if matplotlib were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PlotsUnavailable, match="pip install matplotlib"):
        plot_plan_masks(_plan(), tmp_path / "masks.png")
    assert not (tmp_path / "masks.png").exists()


def _captured_figure(monkeypatch):
    """The Figure the next plot saves (``save_png`` captured)."""
    saved = []
    real = plots.save_png
    monkeypatch.setattr(plots, "save_png", lambda fig, out, dpi=100: saved.append(fig)
                        or real(fig, out, dpi))  # fmt: skip
    return saved


def test_block_axes_have_integer_ticks_and_the_spec_notation_is_explained(tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """`inspect --png` draws these: block indices as whole numbers, even on a small grid where
    matplotlib would put 0.5 steps, and the figure says how to read t(w,o,s) / s(w,o,s)."""
    pytest.importorskip("matplotlib")
    saved = _captured_figure(monkeypatch)
    plot_plan_masks(_plan(), tmp_path / "masks.png", heads=2)
    (fig,) = saved
    fig.canvas.draw()
    for ax in fig.axes:
        for tick in (*ax.get_xticks(), *ax.get_yticks()):
            assert float(tick).is_integer(), (ax.get_title(), tick)
    assert "t(w,o,s)" in fig._suptitle.get_text() and "period" in fig._suptitle.get_text()
