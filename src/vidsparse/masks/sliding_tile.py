"""Sliding-tile windows (STA, FastVideo's Sliding Tile Attention) over a ``VideoGrid``'s tiles.

Each query tile attends to the key tiles of a ``(wt, wh, ww)`` box of tiles around it. Near the
edges the box does not shrink: its centre is clamped per axis to ``[w // 2, n - 1 - w // 2]``
(``n`` tiles along the axis), as NATTEN does, so every query tile sees exactly
``wt * wh * ww`` key tiles. Along one axis of ``n = 5`` tiles with ``w = 3``::

    query tile   0  1  2  3  4        key tiles (1 = attended)
    centre       1  1  2  3  3           q0 [ 1 1 1 . . ]
                                         q1 [ 1 1 1 . . ]
                                         q2 [ . 1 1 1 . ]
                                         q3 [ . . 1 1 1 ]
                                         q4 [ . . 1 1 1 ]

The 3-D window is the product of the three axes' windows. Tiles are numbered in the grid's
tile order, ``(t' * Nh + h') * Nw + w'``, so a row's key tiles come out ascending.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence

import torch

from vidsparse.layout.grid import VideoGrid

__all__ = [
    "check_sliding_window",
    "sliding_tile_lists",
    "sliding_tile_block_mask",
    "clear_sliding_tile_cache",
]

_AXES = ("t", "h", "w")
_CACHE_SIZE = 32


def check_sliding_window(window, grid: VideoGrid | None = None) -> tuple[int, int, int]:
    """``window`` as three plain ints: each odd and > 0 and, given ``grid``, at most the
    grid's tiles along its axis. Raises ``TypeError`` / ``ValueError`` naming ``window`` and
    the axis."""
    if isinstance(window, (str, bytes)) or not isinstance(window, Sequence) or len(window) != 3:
        raise TypeError(f"window must be 3 odd ints (wt, wh, ww) in tiles, got {window!r}")
    out = []
    for axis, w in zip(_AXES, window):
        # numpy integers pass (search code makes them); bools are no window size.
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window along {axis} must be an int, got {w!r} in {window!r}")
        w = int(w)
        if w <= 0 or w % 2 == 0:
            raise ValueError(f"window along {axis} must be odd and > 0, got {w} in {window!r}")
        out.append(w)
    if grid is not None:
        _check_fits(tuple(out), _tiles_of(grid))
    return tuple(out)


def sliding_tile_lists(
    grid: VideoGrid, window, *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine lists of the sliding-tile window over ``grid``'s tiles, in tile order:
    ``kv_indices`` int32 ``[1, 1, num_tiles, K]`` and ``kv_counts`` int32 ``[1, 1, num_tiles]``
    (every count ``K = wt * wh * ww``). Batch and heads are broadcast dims: ``expand`` them
    (stride 0) for ``block_sparse_attn``.

    Cached per (tiles, window, device); the cached tensors are returned, so do not modify
    them in place.
    """
    window = check_sliding_window(window, grid)
    return _lists_cached(_tiles_of(grid), window, _normalise_device(device))


def sliding_tile_block_mask(
    grid: VideoGrid, window, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Block mask of the window: bool ``[num_tiles, num_tiles]``, ``mask[q, k]`` True where
    query tile ``q`` attends to key tile ``k`` (tile order). Cached like the lists."""
    window = check_sliding_window(window, grid)
    return _mask_cached(_tiles_of(grid), window, _normalise_device(device))


# ---------------------------------------------------------------------------------------------
# building (cached)
# ---------------------------------------------------------------------------------------------


def _tiles_of(grid) -> tuple[int, int, int]:
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    return grid.tiles


def _check_fits(window: tuple[int, int, int], tiles: tuple[int, int, int]) -> None:
    for axis, w, n in zip(_AXES, window, tiles):
        if w > n:
            raise ValueError(
                f"window along {axis} is {w} tiles but the grid has {n} tiles along {axis} "
                f"(window {window}, tiles {tiles}): a window must fit the grid"
            )


def _normalise_device(device) -> torch.device:
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        # "cuda" and "cuda:0" must hit the same cache entry.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _window_starts(n: int, w: int, device) -> torch.Tensor:
    """First key tile of each query tile's window along one axis, int64 ``[n]``: the centre
    clamped to ``[w // 2, n - 1 - w // 2]``, minus ``w // 2``."""
    return torch.arange(n, device=device).clamp(w // 2, n - 1 - w // 2) - w // 2


def _axis_keys(n: int, w: int, device) -> torch.Tensor:
    """Key tiles of each query tile along one axis: int64 ``[n, w]``, ascending per row."""
    return _window_starts(n, w, device).view(n, 1) + torch.arange(w, device=device)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _lists_cached(tiles, window, device):
    (nt, nh, nw), (wt, wh, ww) = tiles, window
    kt, kh, kw = (_axis_keys(n, w, device) for n, w in zip(tiles, window))
    # index[it, ih, iw, a, b, c] = (kt[it, a] * Nh + kh[ih, b]) * Nw + kw[iw, c]: tile order,
    # ascending along (a, b, c) because tile order is raster order of (t', h', w').
    index = (
        kt.view(nt, 1, 1, wt, 1, 1) * (nh * nw)
        + kh.view(1, nh, 1, 1, wh, 1) * nw
        + kw.view(1, 1, nw, 1, 1, ww)
    )
    num_tiles, k = nt * nh * nw, wt * wh * ww
    kv_indices = index.reshape(1, 1, num_tiles, k).to(torch.int32).contiguous()
    kv_counts = torch.full((1, 1, num_tiles), k, dtype=torch.int32, device=device)
    return kv_indices, kv_counts


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _mask_cached(tiles, window, device):
    # The window is separable: mask[(tq, hq, wq), (tk, hk, wk)] = mt[tq, tk] & mh[hq, hk] & ...
    axes = []
    for n, w in zip(tiles, window):
        starts = _window_starts(n, w, device).view(n, 1)
        keys = torch.arange(n, device=device).view(1, n)
        axes.append((keys >= starts) & (keys < starts + w))  # [n(q), n(k)]
    mt, mh, mw = axes
    nt, nh, nw = tiles
    mask = mt.view(nt, 1, 1, nt, 1, 1) & mh.view(1, nh, 1, 1, nh, 1) & mw.view(1, 1, nw, 1, 1, nw)
    num_tiles = nt * nh * nw
    return mask.reshape(num_tiles, num_tiles).contiguous()


def clear_sliding_tile_cache() -> None:
    """Drop the cached lists and masks."""
    _lists_cached.cache_clear()
    _mask_cached.cache_clear()
