"""Tile-mean pooling of VSA's coarse stage: ``q, k, v`` ``[B, H, P, D]`` in tile order ->
``pooled`` ``[3, B, H, Nt, D]`` (the means of each tile's real tokens), and its gradient;
and for natural-order inputs the tiling and the pooling in one read (``tile_pool_fwd_kernel``).

Padding slots are masked, never read, so whatever they hold cannot leak in; the backward
writes every slot (``d mean_i / size_i`` on tile ``i``'s real tokens, 0 on padding). One
launch covers q, k and v: program axis 2 picks the tensor.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vidsparse.layout.permute import tile_slot_tokens

__all__ = ["tile_mean_pool_fwd_kernel", "tile_mean_pool_bwd_kernel", "tile_pool_fwd_kernel"]


@triton.jit
def _pool_tiles(
    X, stride_xs, stride_xd,  # x of one (batch, head): [P, D]
    OUT, stride_on, stride_od,  # its means: [Nt, D]
    SIZES, first_tile, num_tiles,
    TILE_VOLUME: tl.constexpr, TILE_SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    """The program's tiles are consecutive rows of x: one load of all of them (every byte in
    flight at once, as a memory-bound kernel wants), one reduction per tile."""
    offs_tile = tl.arange(0, TILES_PER_PROGRAM)  # [T]
    offs_slot = tl.arange(0, TILE_SLOTS)  # [V'] (V' = V rounded up to a power of two)
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    tiles = first_tile + offs_tile  # [T] int64
    tile_real = tiles < num_tiles
    sizes = tl.load(SIZES + tiles, mask=tile_real, other=0)  # [T]
    real = offs_slot[None, :] < sizes[:, None]  # [T, V']: padding slots are never read
    rows = tiles[:, None] * TILE_VOLUME + offs_slot[None, :]  # [T, V']
    x = tl.load(
        X + rows[:, :, None] * stride_xs + offs_d[None, None, :] * stride_xd,
        mask=real[:, :, None],
        other=0.0,
    )  # [T, V', D]
    mean = tl.sum(x.to(tl.float32), axis=1) / tl.maximum(sizes, 1).to(tl.float32)[:, None]
    tl.store(
        OUT + tiles[:, None] * stride_on + offs_d[None, :] * stride_od,
        mean.to(OUT.dtype.element_ty),  # [T, D]
        mask=tile_real[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


@triton.jit
def tile_mean_pool_fwd_kernel(
    Q, K, V, POOLED, SIZES,  # q, k, v [B, H, P, D]; pooled [3, B, H, Nt, D]; sizes int32 [Nt]
    K_SIZES,  # SEPARATE_KV: int32 [Nk], the key tiles' sizes
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_pt, stride_pb, stride_ph, stride_pn, stride_pd,
    H, num_tiles, num_k_tiles,
    TILE_VOLUME: tl.constexpr, TILE_SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr, SEPARATE_KV: tl.constexpr,
):  # fmt: skip
    """One launch for q, k and v: program axis 2 picks the tensor. ``SEPARATE_KV``: k and v
    have tiles of their own (``num_k_tiles``, ``K_SIZES``), and ``pooled`` is ``[B, H, Nt +
    2 Nk, D]``: the q means, then the k means, then the v means (``stride_pt`` unused)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    which = tl.program_id(2)  # 0: q, 1: k, 2: v
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    first_tile = pid_t.to(tl.int64) * TILES_PER_PROGRAM
    if SEPARATE_KV:
        first_row = tl.where(which == 0, 0, num_tiles + (which - 1) * num_k_tiles)
        out = POOLED + b * stride_pb + h * stride_ph + first_row.to(tl.int64) * stride_pn
        kv_sizes = K_SIZES
        kv_tiles = num_k_tiles
    else:
        out = POOLED + which.to(tl.int64) * stride_pt + b * stride_pb + h * stride_ph
        kv_sizes = SIZES
        kv_tiles = num_tiles
    # One call per branch (not a pointer picked by the branch): the strides may specialise to
    # different types (a unit stride becomes a constexpr).
    if which == 0:
        _pool_tiles(
            Q + b * stride_qb + h * stride_qh, stride_qs, stride_qd, out, stride_pn, stride_pd,
            SIZES, first_tile, num_tiles, TILE_VOLUME, TILE_SLOTS, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip
    elif which == 1:
        _pool_tiles(
            K + b * stride_kb + h * stride_kh, stride_ks, stride_kd, out, stride_pn, stride_pd,
            kv_sizes, first_tile, kv_tiles, TILE_VOLUME, TILE_SLOTS, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip
    else:
        _pool_tiles(
            V + b * stride_vb + h * stride_vh, stride_vs, stride_vd, out, stride_pn, stride_pd,
            kv_sizes, first_tile, kv_tiles, TILE_VOLUME, TILE_SLOTS, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip


@triton.jit
def _unpool_tiles(
    DMEAN, stride_gn, stride_gd,  # gradient of one (batch, head)'s means: [Nt, D]
    DX, stride_xs, stride_xd,  # gradient of its tokens: [P, D]
    SIZES, first_tile, num_tiles,
    TILE_VOLUME: tl.constexpr, TILE_SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    offs_slot = tl.arange(0, TILE_SLOTS)  # [V']
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    in_tile = offs_slot < TILE_VOLUME  # [V']
    for i in tl.static_range(TILES_PER_PROGRAM):
        tile = first_tile + i
        tile_real = tile < num_tiles
        size = tl.load(SIZES + tile, mask=tile_real, other=0)
        d_real = tl.where(tile_real, offs_d < HEAD_DIM, False)  # [D] (see the store below)
        dmean = tl.load(DMEAN + tile * stride_gn + offs_d * stride_gd, mask=d_real, other=0.0)
        share = dmean / tl.maximum(size, 1).to(dmean.dtype)  # [D]: d mean / d token
        real = offs_slot < size  # [V']
        dx = tl.where(real[:, None], share[None, :], 0.0)  # [V', D]: padding slots get 0
        rows = tile * TILE_VOLUME + offs_slot
        # `where`, not `in_tile & tile_real` (or the scalar as a mask): the interpreter
        # broadcasts a scalar bool as int32 data, a mask Triton >= 3.9's interpreter refuses
        # (compiled, both are one `and`).
        rows_real = tl.where(tile_real, in_tile, False)  # [V']
        tl.store(
            DX + rows[:, None] * stride_xs + offs_d[None, :] * stride_xd,
            dx.to(DX.dtype.element_ty),
            mask=rows_real[:, None] & (offs_d < HEAD_DIM)[None, :],
        )


@triton.jit
def tile_mean_pool_bwd_kernel(
    DPOOLED, DQ, DK, DV, SIZES,  # dpooled [3, B, H, Nt, D]; dq, dk, dv [B, H, P, D]
    stride_gt, stride_gb, stride_gh, stride_gn, stride_gd,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    H, num_tiles,
    TILE_VOLUME: tl.constexpr, TILE_SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    """One launch for dq, dk and dv; writes every slot (padding slots get 0)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    which = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    first_tile = pid_t.to(tl.int64) * TILES_PER_PROGRAM
    dmean = DPOOLED + which.to(tl.int64) * stride_gt + b * stride_gb + h * stride_gh
    if which == 0:
        _unpool_tiles(
            dmean, stride_gn, stride_gd, DQ + b * stride_qb + h * stride_qh, stride_qs, stride_qd,
            SIZES, first_tile, num_tiles, TILE_VOLUME, TILE_SLOTS, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip
    elif which == 1:
        _unpool_tiles(
            dmean, stride_gn, stride_gd, DK + b * stride_kb + h * stride_kh, stride_ks, stride_kd,
            SIZES, first_tile, num_tiles, TILE_VOLUME, TILE_SLOTS, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip
    else:
        _unpool_tiles(
            dmean, stride_gn, stride_gd, DV + b * stride_vb + h * stride_vh, stride_vs, stride_vd,
            SIZES, first_tile, num_tiles, TILE_VOLUME, TILE_SLOTS, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip


@triton.jit
def _tile_pool_tiles(
    X, stride_xs, stride_xd,  # x of one (batch, head), natural order: [S, D] (any strides)
    OUT,  # its tile-order copy: [P, D] contiguous
    MEAN, stride_mn, stride_md,  # its means: [Nt, D]
    first_tile, num_tiles, GRID_T, GRID_H, GRID_W, TILES_H, TILES_W,
    TILE_T: tl.constexpr, TILE_H: tl.constexpr, TILE_W: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    """The program's tiles: their real tokens gathered from natural order in one load, stored
    as tile-order rows (padding slots as zeros), and averaged while they are in registers."""
    VOLUME: tl.constexpr = TILE_T * TILE_H * TILE_W
    ROWS: tl.constexpr = TILES_PER_PROGRAM * VOLUME
    slot = first_tile * VOLUME + tl.arange(0, ROWS)  # [R] int32 tile-order slots
    token, real = tile_slot_tokens(slot, GRID_T, GRID_H, GRID_W, TILES_H, TILES_W,
                                   TILE_T, TILE_H, TILE_W)  # fmt: skip
    token = tl.where(real, token, 0)  # padding slots: any in-range row (their load is masked)
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    rows = tl.load(
        X + token.to(tl.int64)[:, None] * stride_xs + offs_d[None, :] * stride_xd,
        mask=real[:, None],
        other=0.0,
    )  # [R, D]
    in_grid = slot < num_tiles * VOLUME  # past the last tile: nothing to store
    tl.store(OUT + slot.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], rows,
             mask=in_grid[:, None])  # fmt: skip
    sums = tl.sum(tl.reshape(rows.to(tl.float32), (TILES_PER_PROGRAM, VOLUME, HEAD_DIM)), axis=1)
    sizes = tl.sum(tl.reshape(real.to(tl.int32), (TILES_PER_PROGRAM, VOLUME)), axis=1)  # [T]
    mean = sums / tl.maximum(sizes, 1).to(tl.float32)[:, None]  # [T, D]
    tiles = first_tile + tl.arange(0, TILES_PER_PROGRAM)
    tl.store(
        MEAN + tiles.to(tl.int64)[:, None] * stride_mn + offs_d[None, :] * stride_md,
        mean.to(MEAN.dtype.element_ty),
        mask=(tiles < num_tiles)[:, None],
    )


@triton.jit
def tile_pool_fwd_kernel(
    Q, K, V,  # natural order [B, H, S, D], any strides
    Q_T, K_T, V_T,  # their tile-order copies [B, H, P, D], contiguous
    POOLED,  # [3, B, H, Nt, D]
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_pt, stride_pb, stride_ph, stride_pn, stride_pd,
    H, num_tiles, padded_len,
    GRID_T, GRID_H, GRID_W, TILES_H, TILES_W,
    TILE_T: tl.constexpr, TILE_H: tl.constexpr, TILE_W: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    """``VideoGrid.tile`` of q, k and v and ``tile_mean_pool_fwd_kernel`` of the copies, with
    one read of each input: program axis 2 picks the tensor, as in the pooling kernel."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    which = tl.program_id(2)  # 0: q, 1: k, 2: v
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    first_tile = pid_t * TILES_PER_PROGRAM
    copy_at = pid_bh.to(tl.int64) * padded_len * HEAD_DIM
    mean = POOLED + which.to(tl.int64) * stride_pt + b * stride_pb + h * stride_ph
    # One call per branch (not a pointer picked by the branch): the strides may specialise to
    # different types (a unit stride becomes a constexpr).
    if which == 0:
        _tile_pool_tiles(
            Q + b * stride_qb + h * stride_qh, stride_qs, stride_qd, Q_T + copy_at,
            mean, stride_pn, stride_pd, first_tile, num_tiles, GRID_T, GRID_H, GRID_W,
            TILES_H, TILES_W, TILE_T, TILE_H, TILE_W, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip
    elif which == 1:
        _tile_pool_tiles(
            K + b * stride_kb + h * stride_kh, stride_ks, stride_kd, K_T + copy_at,
            mean, stride_pn, stride_pd, first_tile, num_tiles, GRID_T, GRID_H, GRID_W,
            TILES_H, TILES_W, TILE_T, TILE_H, TILE_W, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip
    else:
        _tile_pool_tiles(
            V + b * stride_vb + h * stride_vh, stride_vs, stride_vd, V_T + copy_at,
            mean, stride_pn, stride_pd, first_tile, num_tiles, GRID_T, GRID_H, GRID_W,
            TILES_H, TILES_W, TILE_T, TILE_H, TILE_W, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip
