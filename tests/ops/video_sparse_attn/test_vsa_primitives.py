"""VSA's public primitives (issue 20): ``block_mean`` and ``topk_lists`` against references
written from their definitions (token coordinates, Python sorting), their bad input, and a
composition of both with the engine that reproduces ``video_sparse_attn``."""

from __future__ import annotations

import pytest
import torch

import vidsparse
from vidsparse.masks.block_sparse import validate_block_lists

# Grids with partial tiles on every axis (edge tiles of 1 .. tile_volume tokens).
GRIDS = [((3, 6, 7), (2, 4, 4)), ((5, 9, 13), (4, 4, 4)), ((1, 5, 6), (1, 4, 4))]


def _token_tiles(grid: vidsparse.VideoGrid) -> torch.Tensor:
    """Tile index of every token in natural (raster t, h, w) order, from its coordinates."""
    (T, Hh, W), (tt, th, tw) = grid.shape, grid.tile_shape
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(Hh), torch.arange(W), indexing="ij")
    tiles_h, tiles_w = -(-Hh // th), -(-W // tw)
    return ((t // tt * tiles_h + h // th) * tiles_w + w // tw).flatten()


def _block_mean_by_coordinates(x: torch.Tensor, grid) -> torch.Tensor:
    tiles = _token_tiles(grid)
    out = torch.zeros(*x.shape[:-2], grid.num_tiles, x.shape[-1], dtype=torch.float64)
    for tile in range(grid.num_tiles):
        out[..., tile, :] = x[..., tiles == tile, :].double().mean(-2)
    return out


@pytest.mark.parametrize("shape, tile", GRIDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_block_mean_averages_each_tiles_real_tokens(shape, tile, dtype):
    grid = vidsparse.VideoGrid(shape, tile)
    x = torch.randn(2, 3, grid.num_tokens, 8).to(dtype)
    means = vidsparse.block_mean(x, grid)
    assert means.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert means.shape == (2, 3, grid.num_tiles, 8)
    torch.testing.assert_close(means.double(), _block_mean_by_coordinates(x, grid), rtol=1e-6,
                               atol=1e-6)  # fmt: skip


def test_block_mean_of_tile_order_ignores_what_padding_holds():
    grid = vidsparse.VideoGrid((3, 6, 7), (2, 4, 4))
    x = torch.randn(1, 2, grid.num_tokens, 4)
    tiled = grid.tile(x)
    tiled[..., ~grid.real_token_mask(x.device), :] = float("nan")
    torch.testing.assert_close(vidsparse.block_mean(tiled, grid, tiled=True),
                               vidsparse.block_mean(x, grid))  # fmt: skip


def test_block_mean_gradient_is_one_over_the_tiles_count():
    grid = vidsparse.VideoGrid((3, 6, 7), (2, 4, 4))
    x = torch.randn(1, 2, grid.num_tokens, 4, dtype=torch.float64, requires_grad=True)
    dmeans = torch.randn(1, 2, grid.num_tiles, 4, dtype=torch.float64)
    (grad,) = torch.autograd.grad(vidsparse.block_mean(x, grid), x, dmeans)
    tiles = _token_tiles(grid)
    counts = torch.bincount(tiles, minlength=grid.num_tiles).double()
    torch.testing.assert_close(grad, dmeans[..., tiles, :] / counts[tiles, None])


def _topk_by_sorting(row: list[float], topk: int) -> list[int]:
    """Largest first, ties to the smaller index, -inf never; returned ascending."""
    ranked = sorted(range(len(row)), key=lambda j: (-row[j], j))
    return sorted(j for j in ranked[:topk] if row[j] != float("-inf"))


@pytest.mark.parametrize("topk", [1, 3, 5, 8, 20])
def test_topk_lists_ties_infinities_and_clamping(topk):
    g = torch.Generator().manual_seed(topk)
    # Few distinct values: ties everywhere; some -inf (masked blocks); one all-equal row.
    scores = torch.randint(0, 4, (2, 3, 5, 8), generator=g).double()
    scores[torch.rand(scores.shape, generator=g) < 0.25] = float("-inf")
    scores[0, 0, 0] = 1.0
    scores[1, 2, 4] = float("-inf")
    idx, cnt = vidsparse.topk_lists(scores, topk)
    width = min(topk, 8)
    assert idx.dtype == cnt.dtype == torch.int32 and idx.shape == (2, 3, 5, width)
    validate_block_lists(idx, cnt, batch=2, heads=3, num_q_blocks=5, num_kv_blocks=8, device="cpu")
    for b, h, i in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(5)):
        want = _topk_by_sorting(scores[b, h, i].tolist(), topk)
        n = int(cnt[b, h, i])
        assert idx[b, h, i, :n].tolist() == want
        assert (idx[b, h, i, n:] == 0).all()
    assert cnt[1, 2, 4] == 0 and idx[0, 0, 0].tolist() == list(range(width))


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda s: vidsparse.topk_lists(s, 0), ValueError, "topk must be >= 1"),
        (lambda s: vidsparse.topk_lists(s, 2.0), TypeError, "topk must be an int"),
        (lambda s: vidsparse.topk_lists(s[0], 2), ValueError, "scores"),
        (lambda s: vidsparse.topk_lists(s.long(), 2), TypeError, "floating-point"),
        (lambda s: vidsparse.topk_lists(s[..., :0], 2), ValueError, "at least one key block"),
        (lambda s: vidsparse.topk_lists(s.index_fill(-1, torch.tensor([1]), float("nan")), 2),
         ValueError, "NaN"),
        (lambda s: vidsparse.block_mean(s, (2, 2, 2)), TypeError, "VideoGrid"),
        (lambda s: vidsparse.block_mean(s, vidsparse.VideoGrid((2, 2, 2))), ValueError,
         "num_tokens"),
        (lambda s: vidsparse.block_mean(s.long(), vidsparse.VideoGrid((1, 1, 4))), TypeError,
         "floating-point"),
        (lambda s: vidsparse.block_mean(s, vidsparse.VideoGrid((1, 1, 4)), tiled=1), TypeError,
         "tiled"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(call, exc, words):
    with pytest.raises(exc, match=words):
        call(torch.randn(1, 2, 4, 4))


@pytest.mark.parametrize("backend", ["torch_backend", "triton_backend"])
def test_primitives_and_the_engine_compose_to_vsa(request, backend):
    """block_mean -> coarse scores -> topk_lists -> block_sparse_attn, plus the coarse term,
    is ``video_sparse_attn`` (no gate): the same tiles, the same output."""
    request.getfixturevalue(backend)
    grid = vidsparse.VideoGrid((4, 6, 10), (2, 4, 4))  # 32-token tiles, partial ones at the edges
    q, k, v = (torch.randn(1, 2, grid.num_tokens, 16) for _ in range(3))
    topk, scale = 4, 16**-0.5
    qc, kc, vc = (vidsparse.block_mean(x, grid) for x in (q, k, v))
    scores = qc @ kc.transpose(-1, -2) * scale
    idx, cnt = vidsparse.topk_lists(scores, topk)
    fine = vidsparse.block_sparse_attn(
        grid.tile(q), grid.tile(k), grid.tile(v), idx, cnt, block_size=grid.tile_volume,
        kv_block_sizes=grid.tile_sizes_on(q.device), scale=scale,
    )  # fmt: skip
    coarse = (scores.softmax(-1) @ vc).repeat_interleave(grid.tile_volume, dim=-2)
    composed = grid.untile(fine + coarse.to(fine.dtype))
    want = vidsparse.video_sparse_attn(q, k, v, grid, topk=topk)
    torch.testing.assert_close(composed, want, rtol=2e-5, atol=2e-5)


@pytest.mark.dynamo
def test_primitives_trace_without_graph_breaks():
    grid = vidsparse.VideoGrid((3, 6, 7), (2, 4, 4))

    def coarse_lists(q, k):
        qc, kc = vidsparse.block_mean(q, grid), vidsparse.block_mean(k, grid)
        return vidsparse.topk_lists(qc @ kc.transpose(-1, -2), 3)

    q, k = torch.randn(1, 2, grid.num_tokens, 8), torch.randn(1, 2, grid.num_tokens, 8)
    torch._dynamo.reset()
    compiled = torch.compile(coarse_lists, fullgraph=True, backend="eager")
    for got, want in zip(compiled(q, k), coarse_lists(q, k)):
        assert torch.equal(got, want)
