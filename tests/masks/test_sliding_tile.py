"""Sliding-tile (STA) lists and masks against a brute force of NATTEN's clamp rule (Python ints)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from vidsparse.layout import VideoGrid
from vidsparse.masks import check_sliding_window, sliding_tile_block_mask, sliding_tile_lists
from vidsparse.masks.block_sparse import dense_from_lists, validate_block_lists
from vidsparse.masks.sliding_tile import clear_sliding_tile_cache


def brute_force_keys(tiles, window) -> list[list[int]]:
    """Per query tile (tile order), its key tiles: per axis, the centre clamped to
    ``[w // 2, n - 1 - w // 2]`` and every tile within ``w // 2`` of it. Plain Python."""
    nt, nh, nw = tiles
    rows = []
    for q in itertools.product(range(nt), range(nh), range(nw)):
        centres = [min(max(i, w // 2), n - 1 - w // 2) for i, n, w in zip(q, tiles, window)]
        keys = [
            (t * nh + h) * nw + x
            for t, h, x in itertools.product(range(nt), range(nh), range(nw))
            if all(abs(c - j) <= w // 2 for c, j, w in zip(centres, (t, h, x), window))
        ]
        rows.append(keys)
    return rows


# (grid shape, tile, window)
CASES = [
    ((21, 30, 52), (4, 4, 4), (3, 3, 3)),  # Wan 480p: tiles 6 x 8 x 13, partial in t, h, w
    ((21, 30, 52), (4, 4, 4), (1, 5, 7)),  # non-cubic window
    ((21, 30, 52), (4, 4, 4), (5, 3, 13)),  # the whole grid along w
    ((8, 8, 12), (4, 4, 4), (1, 1, 3)),  # tiles 2 x 2 x 3
    ((3, 8, 10), (1, 4, 4), (3, 1, 3)),  # tiles 3 x 2 x 3: window = grid along t and w
    ((7, 9, 11), (2, 2, 2), (1, 1, 1)),  # only the own tile
    ((12, 16, 16), (2, 4, 4), (5, 3, 1)),
]


@pytest.mark.parametrize("shape, tile, window", CASES, ids=str)
def test_lists_match_brute_force(shape, tile, window):
    grid = VideoGrid(shape, tile)
    kv_indices, kv_counts = sliding_tile_lists(grid, window)
    k = window[0] * window[1] * window[2]
    assert kv_indices.dtype == kv_counts.dtype == torch.int32
    assert tuple(kv_indices.shape) == (1, 1, grid.num_tiles, k)
    assert tuple(kv_counts.shape) == (1, 1, grid.num_tiles)
    assert (kv_counts == k).all(), "every query tile sees the same number of key tiles"
    assert kv_indices[0, 0].tolist() == brute_force_keys(grid.tiles, window)  # ascending rows
    validate_block_lists(
        kv_indices, kv_counts, batch=1, heads=1, num_q_blocks=grid.num_tiles,
        num_kv_blocks=grid.num_tiles, device="cpu",
    )  # fmt: skip


@pytest.mark.parametrize("shape, tile, window", CASES, ids=str)
def test_block_mask_matches_lists_and_brute_force(shape, tile, window):
    grid = VideoGrid(shape, tile)
    mask = sliding_tile_block_mask(grid, window)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (grid.num_tiles, grid.num_tiles)
    expected = torch.zeros_like(mask)
    for q, keys in enumerate(brute_force_keys(grid.tiles, window)):
        expected[q, keys] = True
    assert torch.equal(mask, expected)
    kv_indices, kv_counts = sliding_tile_lists(grid, window)
    assert torch.equal(dense_from_lists(kv_indices, kv_counts, grid.num_tiles)[0, 0], mask)


def test_window_equal_to_the_grid_is_dense():
    grid = VideoGrid((8, 8, 12), (4, 4, 4))  # tiles 2 x 2 x 3: the largest odd window 1 x 1 x 3
    assert sliding_tile_block_mask(grid, (1, 1, 3)).equal(
        torch.block_diag(*[torch.ones(3, 3, dtype=torch.bool)] * 4)
    )
    grid = VideoGrid((3, 3, 5), (1, 1, 1))
    assert sliding_tile_block_mask(grid, (3, 3, 5)).all()


def test_lists_are_cached_per_device_and_window():
    clear_sliding_tile_cache()
    grid = VideoGrid((21, 30, 52))
    a = sliding_tile_lists(grid, (3, 3, 3))
    assert sliding_tile_lists(VideoGrid((21, 30, 52)), [3, 3, 3])[0] is a[0]  # equal grid
    assert sliding_tile_lists(grid, (3, 3, 3), device="cpu")[0] is a[0]
    assert sliding_tile_lists(grid, (np.int64(3), 3, 3))[0] is a[0]  # numpy ints normalised
    assert sliding_tile_lists(grid, (1, 3, 3))[0] is not a[0]


@pytest.mark.parametrize(
    "window, exc, words",
    [
        ((0, 3, 3), ValueError, "window along t must be odd and > 0"),
        ((3, -1, 3), ValueError, "window along h must be odd and > 0"),
        ((3, 3, 4), ValueError, "window along w must be odd"),
        ((3, 3.0, 3), TypeError, "window along h must be an int"),
        ((True, 3, 3), TypeError, "window along t must be an int"),
        ((3, 3), TypeError, "window must be 3"),
        (3, TypeError, "window must be 3"),
        ("333", TypeError, "window must be 3"),
        ((7, 3, 3), ValueError, "window along t is 7 tiles but the grid has 6 tiles along t"),
        ((3, 9, 3), ValueError, "window along h is 9 tiles but the grid has 8"),
        ((3, 3, 15), ValueError, "window along w is 15 tiles but the grid has 13"),
    ],
)
def test_bad_windows(window, exc, words):
    grid = VideoGrid((21, 30, 52))  # tiles 6 x 8 x 13
    for build in (sliding_tile_lists, sliding_tile_block_mask):
        with pytest.raises(exc, match=words):
            build(grid, window)


def test_check_sliding_window_without_grid_and_bad_grid():
    assert check_sliding_window((5, 7, 9)) == (5, 7, 9)
    with pytest.raises(TypeError, match="grid must be a vidsparse.VideoGrid"):
        sliding_tile_lists((21, 30, 52), (3, 3, 3))
