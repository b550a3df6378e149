"""Public entry point of Video Sparse Attention (VSA).

Validates everything before any compute, then runs either the PyTorch reference (torch backend)
or the Triton path: the fused coarse-stage kernels (coarse.py) pick each query tile's top-k key
tiles, and the fine stage runs on the block-sparse engine with the tile sizes masking padding.
"""

from __future__ import annotations

import math

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.block_sparse_attn.interface import (
    TRITON_HEAD_DIMS,
    block_sparse_attn_prevalidated,
)
from vidsparse.ops.video_sparse_attn.reference import resolve_topk, video_sparse_attn_ref
from vidsparse.utils.backend import resolve_backend
from vidsparse.utils.checks import check_same_device, check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def video_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    *,
    topk: int | None = None,
    sparsity: float | None = None,
    gate: torch.Tensor | None = None,
    tiled: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Video Sparse Attention: coarse attention over tile means selects, per query tile, the
    ``topk`` key tiles that the fine stage then attends exactly.

    ::

        tokens --tile--> [tile 0 | tile 1 | ... ]     (4x4x4 cubes of the latent video)
        coarse:  Oc = softmax(mean(Q) mean(K)^T * scale) mean(V)     per tile
        select:  top-k key tiles per query tile, by coarse score
        fine:    exact attention over the real tokens of the selected tiles
        o = o_fine + gate * o_coarse        (o_fine + o_coarse without a gate)

    Args:
        q, k, v: ``[B, H, S, D]``; ``S == grid.num_tokens`` (natural raster order) or
            ``S == grid.padded_len`` with ``tiled=True`` (tile order, as ``grid.tile`` makes).
        grid: the latent :class:`VideoGrid` (any T x H x W; partial tiles are padded).
        topk / sparsity: exactly one. ``topk = clamp(ceil((1 - sparsity) * num_tiles), 1,
            num_tiles)``; a ``topk`` above ``num_tiles`` is clamped to ``num_tiles``.
        gate: optional tensor shaped like ``q`` weighting the coarse output.
        tiled: inputs and output in tile order (padding rows of the output are zero).
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns ``o`` in q's dtype and layout. Differentiable in q, k, v and gate.
    """
    device = _validate(q, k, v, grid, topk, sparsity, gate, tiled, scale)
    topk = resolve_topk(grid.num_tiles, topk, sparsity)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if resolve_backend(device) == "torch":
        return video_sparse_attn_ref(q, k, v, grid, topk=topk, gate=gate, tiled=tiled, scale=scale)
    _check_triton_supported(q, grid)
    return _video_sparse_attn_composed(q, k, v, grid, topk, gate, tiled, scale)


def _video_sparse_attn_composed(q, k, v, grid, topk, gate, tiled, scale):
    """Triton path: the fused coarse stage (pooling, coarse attention, top-k lists) and the
    fine stage on the engine, combined with the gate."""
    from vidsparse.ops.video_sparse_attn.coarse import vsa_coarse_stage  # imports Triton

    B, H, _, D = q.shape
    Nt, V = grid.num_tiles, grid.tile_volume
    to_tiles = (lambda x: x) if tiled else (lambda x: grid.tile(x, dim=-2))
    q_t, k_t, v_t = to_tiles(q), to_tiles(k), to_tiles(v)  # [B, H, P, D]
    o_coarse, kv_indices, kv_counts = vsa_coarse_stage(q_t, k_t, v_t, grid, topk, scale)
    sizes = grid.tile_sizes_on(q.device).to(torch.int32)
    # The lists come straight from the selection kernel: valid by construction, so the fine
    # stage skips the engine's argument checks (and their GPU sync).
    o_fine, _ = block_sparse_attn_prevalidated(
        q_t,
        k_t,
        v_t,
        kv_indices,
        kv_counts,
        block_q=V,
        block_kv=V,
        kv_block_sizes=sizes,
        scale=scale,
    )
    o_coarse = o_coarse.to(q.dtype).unsqueeze(-2)  # [B, H, Nt, 1, D], broadcast over the tile
    o5 = o_fine.view(B, H, Nt, V, D)
    o5 = o5 + (o_coarse if gate is None else to_tiles(gate).view(B, H, Nt, V, D) * o_coarse)
    real = grid.real_token_mask(q.device).view(Nt, V, 1)
    o = o5.masked_fill(~real, 0).view(B, H, Nt * V, D)
    return o if tiled else grid.untile(o, dim=-2)


def _validate(q, k, v, grid, topk, sparsity, gate, tiled, scale) -> torch.device:
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4, dtypes=_DTYPES)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must have the same shape [B, H, S, D], got {tuple(q.shape)},"
            f" {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not isinstance(tiled, bool):
        raise TypeError(f"tiled must be a bool, got {tiled!r}")
    S = q.shape[2]
    expected = grid.padded_len if tiled else grid.num_tokens
    if expected != S:
        hint = (
            " (it equals grid.padded_len: pass tiled=True)"
            if grid.padded_len == S
            else " (it equals grid.num_tokens: pass tiled=False)"
            if grid.num_tokens == S
            else ""
        )
        raise ValueError(
            f"q's sequence length {S} must equal "
            f"{'grid.padded_len' if tiled else 'grid.num_tokens'} = {expected} for {grid}{hint}"
        )
    is_number = isinstance(sparsity, (int, float)) and not isinstance(sparsity, bool)
    if is_number and not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    resolve_topk(grid.num_tiles, topk, sparsity)  # exactly one of them, right types and ranges
    if gate is not None:
        check_tensor("gate", gate, ndim=4, dtypes=_DTYPES)
        if gate.shape != q.shape:
            raise ValueError(
                f"gate must be shaped like q {tuple(q.shape)}, got {tuple(gate.shape)}"
            )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    return check_same_device(q=q, k=k, v=v, gate=gate)


def _check_triton_supported(q: torch.Tensor, grid: VideoGrid) -> None:
    if q.shape[-1] not in TRITON_HEAD_DIMS:
        raise ValueError(
            f"head_dim {q.shape[-1]} is not supported by the Triton kernels; supported:"
            f" {TRITON_HEAD_DIMS} (set VIDSPARSE_BACKEND=torch for the reference path)"
        )
    V = grid.tile_volume
    if V < 16 or V & (V - 1):
        raise ValueError(
            f"the Triton path needs a power-of-two tile volume >= 16, got {grid.tile_shape}"
            f" (volume {V}); use tile=(4, 4, 4) or VIDSPARSE_BACKEND=torch"
        )
