"""Sliding-tile attention (STA) on the block-sparse engine, and its brute-force reference.

A mask family in one module: the window's engine lists come from
``vidsparse.masks.sliding_tile``; this module validates, tiles, and calls the engine's internal
entry ``block_sparse_attn_unchecked`` once for all heads, with a query and key block per
``VideoGrid`` tile and the tile sizes masking the padding keys of partial tiles. The lists
are one row per tile shared by every batch and head (stride-0 views), built once per
(grid, window, heads, device) and cached; under ``torch.compile`` Dynamo takes them from that
cache on the host at trace time, as constants.

``sliding_tile_attn_ref`` is the oracle: dense attention under a token-level mask derived
from each token's tile coordinates, with no lists, no tile order and no engine.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import torch

from vidsparse.layout.grid import VideoGrid, check_video_qkv, grid_key
from vidsparse.masks.sliding_tile import check_sliding_window, sliding_tile_lists
from vidsparse.ops._video_inputs import check_sequence_length, check_triton_tile, untile_output
from vidsparse.ops.block_sparse_attn.configs import REFERENCE_DTYPES
from vidsparse.ops.block_sparse_attn.interface import (
    block_sparse_attn_unchecked,
    check_triton_supported,
)
from vidsparse.utils.backend import resolve_backend
from vidsparse.utils.checks import (
    check_bool,
    check_head_dim,
    check_same_device,
    check_scale,
    softmax_scale,
)
from vidsparse.utils.dynamo import host_constant

__all__ = [
    "sliding_tile_attn",
    "sliding_tile_attn_ref",
    "sliding_tile_token_mask",
    "clear_sliding_tile_attn_cache",
]

# One entry per (grid, window, heads, device): a model uses a handful.
_CACHE_SIZE = 32


def sliding_tile_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    window=(3, 3, 3),
    *,
    tiled: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Sliding-tile attention: every query tile attends to a ``window`` of key tiles around it.

    ::

        one frame of 4 x 5 tiles, window (1, 3, 3): the key tiles of two query tiles
        (Q: the query tile, x: its key tiles; near an edge the window slides inwards, it
        does not shrink, so every query tile sees 1 * 3 * 3 = 9 key tiles)

            query tile (1, 2)           query tile (0, 4) (corner)
            . x x x .                   . . x x Q
            . x Q x .                   . . x x x
            . x x x .                   . . x x x
            . . . . .                   . . . . .

        each token of a query tile attends to every real token of its key tiles

    Args:
        q, k, v: ``[B, H, S, D]``. ``S == grid.num_tokens`` (natural raster order), or
            ``grid.padded_len`` with ``tiled=True`` (tile order, as ``grid.tile`` makes it).
        grid: the latent :class:`VideoGrid`; its tiles are STA's tiles (partial edge tiles
            are padded, their padding keys get no weight).
        window: ``(wt, wh, ww)`` in tiles, each odd, > 0 and at most the grid's tiles along
            that axis. A window centre is clamped per axis to ``[w // 2, n - 1 - w // 2]``
            (NATTEN's rule), so every query tile sees ``wt * wh * ww`` key tiles.
        tiled: inputs and output in tile order; padding rows of the output are zero. Padding
            rows of k and v get no weight but must be finite (``grid.tile`` writes zeros).
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns ``o`` in q's dtype and layout. Differentiable in q, k, v (the engine's backward).
    The Triton path needs a power-of-two tile volume >= 16; the torch path takes any.
    """
    window, device = _validate(q, k, v, grid, window, tiled, scale)
    if resolve_backend(device) == "triton":
        _check_triton_supported(q, grid)
    scale = softmax_scale(scale, q.shape[-1])
    plan = _cached_plan(grid_key(grid), window, operator.index(q.shape[1]), device)
    q_t, k_t, v_t = (x if tiled else grid.tile(x, dim=-2) for x in (q, k, v))
    # The plan's lists are valid by construction (no checks, no GPU sync); padding keys are
    # finite (zeros from tiling, or a tiled input's documented-finite padding rows).
    o, _ = block_sparse_attn_unchecked(
        q_t, k_t, v_t, plan.kv_indices, plan.kv_counts,
        block_q=grid.tile_volume, block_kv=grid.tile_volume,
        kv_block_sizes=plan.kv_block_sizes, scale=scale, padding_finite=True,
    )  # fmt: skip
    if not tiled:
        return untile_output(o, grid, q)
    if plan.kv_block_sizes is None:
        return o
    # Padding query rows attended like real ones (their q is zero, not absent): blank them.
    return o.masked_fill(~grid.real_token_mask(o.device).view(-1, 1), 0)


def clear_sliding_tile_attn_cache() -> None:
    """Drop the cached engine lists (``masks.sliding_tile.clear_sliding_tile_cache`` drops
    the masks module's)."""
    _plan.cache_clear()


# --------------------------------------------------------------------------- engine plan


class _Plan(NamedTuple):
    kv_indices: torch.Tensor  # int32 [1, H, Nt, K], stride 0 over heads
    kv_counts: torch.Tensor  # int32 [1, H, Nt], stride 0 over heads
    kv_block_sizes: torch.Tensor | None  # int32 [Nt]; None when every tile is full


@host_constant
def _cached_plan(grid_key, window, heads: int, device) -> _Plan:
    """``_plan`` keyed on plain values. Under ``torch.compile`` Dynamo runs this on the host
    at trace time (building lists is no traceable code) and the tensors enter the graph as
    constants: they depend only on the arguments' Python values, which Dynamo guards on."""
    return _plan(grid_key, window, heads, device)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _plan(grid_key, window, heads: int, device) -> _Plan:
    grid = VideoGrid(*grid_key)
    kv_indices, kv_counts = sliding_tile_lists(grid, window, device=device)
    # Expanded once here and kept: the engine caches what it derives from the lists per
    # tensor object, so one view per configuration is reused by every call.
    kv_indices = kv_indices.expand(1, heads, -1, -1)
    kv_counts = kv_counts.expand(1, heads, -1)
    full = all(n % t == 0 for n, t in zip(grid.shape, grid.tile_shape))
    # The engine's unmasked kernel is faster: use it when no tile has padding.
    sizes = None if full else grid.tile_sizes_on(device)
    return _Plan(kv_indices, kv_counts, sizes)


# --------------------------------------------------------------------------- validation


def _validate(q, k, v, grid, window, tiled, scale) -> tuple[tuple[int, int, int], torch.device]:
    check_video_qkv(grid, q, k, v, REFERENCE_DTYPES)
    check_head_dim(q)
    device = check_same_device(q=q, k=k, v=v)
    check_bool("tiled", tiled)
    check_scale(scale)
    window = check_sliding_window(window, grid)
    check_sequence_length(q.shape[2], grid, tiled, 0)
    # operator.index: Dynamo specializes (guards on) each int instead of tracing a SymInt,
    # which could not key the cached plan.
    return tuple(operator.index(w) for w in window), device


def _check_triton_supported(q: torch.Tensor, grid: VideoGrid) -> None:
    check_triton_tile(grid, "tile=(4, 4, 4) or (2, 8, 8)")
    check_triton_supported(q)


# --------------------------------------------------------------------------- reference


def sliding_tile_token_mask(grid: VideoGrid, window, device=None) -> torch.Tensor:
    """Token-level mask bool ``[S, S]``, ``S = grid.num_tokens``, natural order: ``mask[i, j]``
    says whether query token ``i`` attends to key token ``j``. Built from the tokens' tile
    coordinates: key tile within ``w // 2`` of the query tile's clamped centre, per axis."""
    window = check_sliding_window(window, grid)
    device = torch.device("cpu") if device is None else torch.device(device)
    T, H, W = grid.shape
    n = torch.arange(grid.num_tokens, device=device)
    coords = (n // (H * W), (n // W) % H, n % W)
    mask = torch.ones(grid.num_tokens, grid.num_tokens, dtype=torch.bool, device=device)
    for x, tile, tiles, w in zip(coords, grid.tile_shape, grid.tiles, window):
        t = x // tile  # tile coordinate of every token along this axis
        centre = t.clamp(w // 2, tiles - 1 - w // 2)
        mask &= (centre.view(-1, 1) - t.view(1, -1)).abs() <= w // 2
    return mask


def sliding_tile_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    window=(3, 3, 3),
    *,
    tiled: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`sliding_tile_attn` (same arguments and layouts): ``o`` in fp32
    (fp64 for fp64 inputs), padding rows zero in tile order. Differentiable by autograd.
    Memory is ``O(B * H * S^2)``: small sizes only."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    qn, kn, vn = (grid.untile(x, dim=-2) if tiled else x for x in (q, k, v))
    mask = sliding_tile_token_mask(grid, window, q.device)
    s = torch.einsum("bhqd,bhkd->bhqk", qn.to(dtype), kn.to(dtype)) * scale
    # Every query tile's window holds real keys (a tile has at least one), so no row is empty.
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    o = torch.einsum("bhqk,bhkd->bhqd", p, vn.to(dtype))
    return grid.tile(o, dim=-2) if tiled else o
