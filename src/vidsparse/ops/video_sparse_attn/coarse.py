"""Coarse stage of Video Sparse Attention (VSA) as fused Triton kernels.

The coarse stage turns tile-ordered ``q, k, v`` ``[B, H, P, D]`` (``P = num_tiles * V``) into

- ``oc = softmax(qc kc^T * scale) vc`` ``[B, H, Nt, D]`` (fp32), where ``qc, kc, vc`` are the
  means of each tile's real tokens, and
- the fine stage's block lists: ``kv_indices`` int32 ``[B, H, Nt, topk]`` (the ``topk`` key
  tiles with the largest coarse score, ascending) and ``kv_counts`` int32 ``[B, H, Nt]``,

in two launches, without a dense ``Nt x Nt`` score, mask or index tensor anywhere::

    q, k, v --(1) _tile_mean_pool_fwd_kernel--> pooled fp32 [3, B, H, Nt, D] = (qc, kc, vc)
    pooled  --(2) _coarse_attn_topk_fwd_kernel--> oc, kv_indices, kv_counts

(1) reads each real token of q, k and v once (padding slots are masked, never read: whatever
they hold cannot leak in) and writes the means in fp32. fp32 rather than the input dtype: the
means rank tiles, and rounding them to bf16 (8 bits) would move scores by more than the gap
between neighbouring candidates; they are 1/V of the inputs' size (4 MB at Wan 480p), so the
precision is free.

(2) runs one program per (``block_m`` query tiles, batch * head). Scores are cheap to recompute
(``D`` multiply-adds per pair on the tensor cores, ``kc`` read from L2), so it streams over the
key tiles a few times instead of keeping a score row anywhere::

    pass 0       online softmax (base 2) -> oc; per row min / max / mean / std of the scores
    passes 1..P  bracket [lo, hi) of the topk-th largest score, per row: count the scores at or
                 above num_pivots thresholds, keep the tightest bracket with
                 count(>= lo) >= topk > count(>= hi); a row whose bracket holds at most
                 bracket_capacity scores has them copied to a scratch row instead, and its exact
                 k-th largest is found there (32 compare-and-count steps over <= capacity keys)
    last pass    write: every score >= hi, then the first topk - count(>= hi) scores of the
                 bracket in tile order, at positions from running prefix counts (tl.cumsum)

Scores are compared as *order keys*: the fp32 bits as an int32 whose order is the float order,
so brackets are exact integer intervals and ties are exact. Pivots: half evenly spaced in score
(first placed at ``mean + (z -+ 1) * std`` with ``z`` the normal quantile of ``1 - topk/Nt``),
half evenly spaced in key (the bracket shrinks ``num_pivots/2 + 1``-fold per pass whatever the
distribution). Each pass also snaps the bracket to the smallest and largest key inside it, so a
bracket holding one tied score closes at once. A row is done when ``count(>= lo) == topk``,
``hi - lo == 1`` (``lo`` is the k-th largest, ties at it go to the smaller tile index) or its
keys were collected; the loop runs while any row of the program is open. Every selection
pass and the write pass compute scores with one function, so they rank bit-identical values.

Cost, per (query tile, key tile) pair: ``2 + P`` score computations (pass 0, ``P`` selection
passes, the write pass), ``num_pivots`` compare-and-count per selection pass and two prefix
sums in the write pass. ``P`` is that of the slowest row of the program; with the defaults
(8 pivots, capacity 128) it is 2-4 on random and on locality-structured scores at Wan shapes
(measured in the interpreter), and it is bounded for any fp32 scores: the key-space pivots
alone shrink a 2**32-wide bracket to one key in ``ceil(32 / log2(num_pivots / 2 + 1))``
passes (14 for 8 pivots). The scratch is
``B*H*Nt*capacity`` int32 (O(Nt * topk)), never O(Nt^2). Selection ranks
``fl(fl(qc . kc) * scale)``, the reference's own expression, so with exact (``ieee``) dots it
matches ``select_topk`` up to ties; on GPUs the dots run in TF32 (configs), which perturbs
scores by ~1e-3 relative.

Backward (``coarse_attn_bwd``, then ``_tile_mean_pool_bwd_kernel``): the gradient of the coarse
attention in PyTorch (probabilities recomputed in fp32; the gradient matmuls in bf16 for bf16
inputs), chunked over query tiles so no ``[B, H, Nt, Nt]`` temporary exceeds
``_BWD_CHUNK_ELEMENTS``; then every real token of tile ``i`` gets ``dqc_i / size_i`` and every
padding slot 0, written once in the input dtype. Selection is not differentiated.

``vsa_coarse_stage`` is the entry point: a ``torch.library`` custom op with fake and autograd,
so ``torch.compile`` sees one opaque differentiable op.
"""

from __future__ import annotations

from statistics import NormalDist

import torch
import triton
import triton.language as tl

from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.video_sparse_attn.coarse_configs import (
    CoarseAttnConfig,
    PoolConfig,
    coarse_attn_config,
    pool_config,
    pow2_at_least,
)
from vidsparse.utils.backend import resolve_backend
from vidsparse.utils.checks import check_same_device, check_tensor
from vidsparse.utils.device import target_of

__all__ = [
    "vsa_coarse_stage",
    "tile_mean_pool_fwd",
    "tile_mean_pool_bwd",
    "coarse_attn_topk_fwd",
    "coarse_attn_bwd",
    "TRITON_HEAD_DIMS",
]

LOG2E = 1.4426950408889634
TRITON_HEAD_DIMS = (16, 32, 64, 128)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TORCH_DTYPES = (*TRITON_DTYPES, torch.float64)

# Budget, in elements, of one [B, H, chunk, Nt] fp32 temporary of the coarse backward: 2**24
# elements is 64 MiB (Wan 14B 720p, 40 heads x 1440 tiles: 5 chunks of 291 query tiles).
_BWD_CHUNK_ELEMENTS = 2**24


# ============================================================================ pooling kernels


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
def _tile_mean_pool_fwd_kernel(
    Q, K, V, POOLED, SIZES,  # q, k, v [B, H, P, D]; pooled [3, B, H, Nt, D]; sizes int32 [Nt]
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_pt, stride_pb, stride_ph, stride_pn, stride_pd,
    H, num_tiles,
    TILE_VOLUME: tl.constexpr, TILE_SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    """One launch for q, k and v: program axis 2 picks the tensor."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    which = tl.program_id(2)  # 0: q, 1: k, 2: v
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    first_tile = pid_t.to(tl.int64) * TILES_PER_PROGRAM
    out = POOLED + which.to(tl.int64) * stride_pt + b * stride_pb + h * stride_ph
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
            SIZES, first_tile, num_tiles, TILE_VOLUME, TILE_SLOTS, HEAD_DIM, TILES_PER_PROGRAM,
        )  # fmt: skip
    else:
        _pool_tiles(
            V + b * stride_vb + h * stride_vh, stride_vs, stride_vd, out, stride_pn, stride_pd,
            SIZES, first_tile, num_tiles, TILE_VOLUME, TILE_SLOTS, HEAD_DIM, TILES_PER_PROGRAM,
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
        dmean = tl.load(DMEAN + tile * stride_gn + offs_d * stride_gd, mask=tile_real, other=0.0)
        share = dmean / tl.maximum(size, 1).to(dmean.dtype)  # [D]: d mean / d token
        real = offs_slot < size  # [V']
        dx = tl.where(real[:, None], share[None, :], 0.0)  # [V', D]: padding slots get 0
        rows = tile * TILE_VOLUME + offs_slot
        tl.store(
            DX + rows[:, None] * stride_xs + offs_d[None, :] * stride_xd,
            dx.to(DX.dtype.element_ty),
            mask=(in_tile & tile_real)[:, None] & (offs_d < HEAD_DIM)[None, :],
        )


@triton.jit
def _tile_mean_pool_bwd_kernel(
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


# ============================================================ coarse attention + top-k kernel


@triton.jit
def _order_key(score):
    """fp32 -> int32 whose signed order is the float order (-0.0 is taken as +0.0)."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_score(key):
    """Inverse of ``_order_key``: int32 key -> fp32 score (the map is an involution)."""
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_tile_rows(base, offs_n, real, offs_d, stride_n, stride_d):
    """Rows ``offs_n`` of a ``[Nt, D]`` matrix; rows past ``num_tiles`` read as 0."""
    ptrs = base + offs_n.to(tl.int64)[:, None] * stride_n + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=real[:, None], other=0.0)  # [BN, D]


@triton.jit
def _load_tile_cols(base, offs_n, real, offs_d, stride_n, stride_d):
    """Rows ``offs_n`` of a ``[Nt, D]`` matrix, loaded transposed as ``[D, BN]`` (a plain
    ``tl.dot`` operand: no in-register transpose); rows past ``num_tiles`` read as 0."""
    ptrs = base + offs_n.to(tl.int64)[None, :] * stride_n + offs_d[:, None] * stride_d
    return tl.load(ptrs, mask=real[None, :], other=0.0)  # [D, BN]


@triton.jit
def _score_keys(qc, kc_t, col_real, scale, INPUT_PRECISION: tl.constexpr):
    """Order keys of ``fl(fl(qc . kc) * scale)`` ``[BM, BN]``; columns past num_tiles get
    INT32_MIN, below every bracket. Every pass after the softmax calls this one function, so
    they all rank bit-identical scores."""
    dots = tl.dot(qc, kc_t, input_precision=INPUT_PRECISION)  # [BM, BN] fp32
    keys = _order_key(dots * scale)
    return tl.where(col_real[None, :], keys, -2147483648)


@triton.jit
def _in_bracket(keys, lo, hi):
    """``lo <= keys < hi`` in int32 (``hi <= 2**31``, so ``hi - 1`` fits)."""
    return (keys >= lo.to(tl.int32)[:, None]) & (keys <= (hi - 1).to(tl.int32)[:, None])


@triton.jit
def _coarse_softmax_pass(
    qc, k_base, v_base, num_tiles, qk_scale,
    stride_kn, stride_kd, stride_vn, stride_vd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax (base 2) over all key tiles. Returns ``oc`` [BM, D] and, per row, the
    min, max, sum and sum of squares of ``qc . kc`` (unscaled) to place the first pivots."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BM, D]
    dot_min = tl.full([BLOCK_M], float("inf"), dtype=tl.float32)
    dot_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    dot_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    dot_sq_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, num_tiles, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BN]
        col_real = offs_n < num_tiles
        kc_t = _load_tile_cols(k_base, offs_n, col_real, offs_d, stride_kn, stride_kd)  # [D, BN]
        vc = _load_tile_rows(v_base, offs_n, col_real, offs_d, stride_vn, stride_vd)  # [BN, D]
        dots = tl.dot(qc, kc_t, input_precision=INPUT_PRECISION)  # [BM, BN]
        dot_min = tl.minimum(dot_min, tl.min(tl.where(col_real[None, :], dots, float("inf")), 1))
        dot_max = tl.maximum(dot_max, tl.max(tl.where(col_real[None, :], dots, float("-inf")), 1))
        real_dots = tl.where(col_real[None, :], dots, 0.0)
        dot_sum += tl.sum(real_dots, 1)
        dot_sq_sum += tl.sum(real_dots * real_dots, 1)
        s2 = tl.where(col_real[None, :], dots * qk_scale, float("-inf"))  # [BM, BN] base 2
        # Every block holds at least one real key tile, so m_new is finite: no NaN below.
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        p = tl.math.exp2(s2 - m_new[:, None])  # [BM, BN]
        alpha = tl.math.exp2(m_i - m_new)  # [BM]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(vc.dtype), vc, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc / l_i[:, None], dot_min, dot_max, dot_sum, dot_sq_sum


@triton.jit
def _first_guess(dot_min, dot_max, dot_sum, dot_sq_sum, num_tiles, scale, quantile_z):
    """Key range where the first pivots go: ``mean + (z -+ 1) * std`` of the row's scores
    (``z`` the normal quantile of ``1 - topk / num_tiles``), clipped to the row's range."""
    mean = dot_sum / num_tiles
    std = tl.sqrt(tl.maximum(dot_sq_sum / num_tiles - mean * mean, 0.0))
    low = tl.maximum(dot_min, mean + (quantile_z - 1.0) * std) * scale
    high = tl.minimum(dot_max, mean + (quantile_z + 1.0) * std) * scale
    high = tl.maximum(high, low)
    return _order_key(low).to(tl.int64), _order_key(high).to(tl.int64) + 1


@triton.jit
def _pivots(lo, hi, guess_lo, guess_hi, NUM_PIVOTS: tl.constexpr):
    """``NUM_PIVOTS`` candidate thresholds per row, int32 [BM, C], inside ``(lo, hi)``: the
    first half evenly spaced in score between the guesses, the second half evenly spaced in
    key (which always makes progress, even where scores span many binades)."""
    HALF: tl.constexpr = NUM_PIVOTS // 2
    offs_c = tl.arange(0, NUM_PIVOTS)  # [C]
    in_score_half = offs_c < HALF
    step = tl.where(in_score_half, offs_c + 1, offs_c - HALF + 1).to(tl.int64)  # [C]
    parts = tl.where(in_score_half, HALF + 1, NUM_PIVOTS - HALF + 1).to(tl.int64)  # [C]
    width = guess_hi - guess_lo  # [BM] int64
    by_key = guess_lo[:, None] + width[:, None] * step[None, :] // parts[None, :]  # [BM, C]

    score_lo = _key_score(guess_lo.to(tl.int32))  # [BM] fp32
    score_hi = _key_score((guess_hi - 1).to(tl.int32))
    score_width = score_hi - score_lo
    usable = tl.abs(score_width) < float("inf")  # finite guesses (false for NaN)
    frac = step.to(tl.float32) / parts.to(tl.float32)  # [C]
    score_pivots = score_lo[:, None] + score_width[:, None] * frac[None, :]  # [BM, C]
    by_score = _order_key(score_pivots).to(tl.int64)

    pivots = tl.where(in_score_half[None, :] & usable[:, None], by_score, by_key)
    pivots = tl.minimum(tl.maximum(pivots, lo[:, None] + 1), hi[:, None] - 1)
    return pivots.to(tl.int32)  # within (INT32_MIN, 2**31): fits


@triton.jit
def _column(x, j: tl.constexpr, C: tl.constexpr):
    """Column ``j`` of a ``[BM, C]`` tensor, ``[BM]``."""
    return tl.sum(tl.where(tl.arange(0, C)[None, :] == j, x, 0), axis=1)


@triton.jit
def _rank_among_sorted(keys, sorted_pivots, NUM_PIVOTS: tl.constexpr):
    """Per key, how many of its row's pivots it reaches (``#{j: pivot_j <= key}``, 0..C), by a
    branch-free binary search over the row's ascending pivots: log2(C) + 1 compares a key
    where counting each pivot takes C. ``keys`` [BM, BN] int32, pivots [BM, C]; C is 4 or 8."""
    C: tl.constexpr = NUM_PIVOTS
    tl.static_assert(C == 4 or C == 8, "packed pivot counts take 4 or 8 pivots")
    if C == 8:
        p0 = _column(sorted_pivots, 0, C)[:, None]  # [BM, 1]
        p1 = _column(sorted_pivots, 1, C)[:, None]
        p2 = _column(sorted_pivots, 2, C)[:, None]
        p3 = _column(sorted_pivots, 3, C)[:, None]
        p4 = _column(sorted_pivots, 4, C)[:, None]
        p5 = _column(sorted_pivots, 5, C)[:, None]
        p6 = _column(sorted_pivots, 6, C)[:, None]
        p7 = _column(sorted_pivots, 7, C)[:, None]
        b2 = keys >= p3  # in the upper half of p0..p6
        b1 = keys >= tl.where(b2, p5, p1)
        b0 = keys >= tl.where(b2, tl.where(b1, p6, p4), tl.where(b1, p2, p0))
        rank = b2.to(tl.int32) * 4 + b1.to(tl.int32) * 2 + b0.to(tl.int32)  # among p0..p6
        rank += (keys >= p7).to(tl.int32)  # key >= p7 implies rank 7 (sorted)
    else:
        p0 = _column(sorted_pivots, 0, C)[:, None]
        p1 = _column(sorted_pivots, 1, C)[:, None]
        p2 = _column(sorted_pivots, 2, C)[:, None]
        p3 = _column(sorted_pivots, 3, C)[:, None]
        b1 = keys >= p1
        b0 = keys >= tl.where(b1, p2, p0)
        rank = b1.to(tl.int32) * 2 + b0.to(tl.int32)  # among p0..p2
        rank += (keys >= p3).to(tl.int32)
    return rank


@triton.jit
def _rank_histogram(rank, first: tl.constexpr):
    """Row sums of a byte per rank: ranks ``first..first+3`` counted in bytes 0..3 of an int32
    (at most BN < 256 keys a byte). ``[BM]`` int32."""
    in_word = (rank >= first) & (rank < first + 4)
    one_hot = tl.where(in_word, 1 << (8 * (rank - first)), 0)  # [BM, BN] int32
    return tl.sum(one_hot, axis=1)


@triton.jit
def _count_at_or_above_sorted(keys, sorted_pivots, NUM_PIVOTS: tl.constexpr):
    """``[BM, C]``: per row, the keys >= each of its ascending pivots, with one or two row
    reductions for all pivots instead of one per pivot: each key adds 1 to the byte of its rank
    (ranks 1-4 in one int32, 5-8 in another), the row sums are a histogram of ranks, and the
    count at pivot j is the number of keys of rank > j."""
    C: tl.constexpr = NUM_PIVOTS
    tl.static_assert(keys.shape[1] < 256, "a byte per rank holds at most 255 keys")
    rank = _rank_among_sorted(keys, sorted_pivots, NUM_PIVOTS)  # [BM, BN] in 0..C
    offs_c = tl.arange(0, C)  # [C]: pivot j <-> rank j + 1
    low = _rank_histogram(rank, 1)  # [BM]: ranks 1..4
    if C == 8:
        high = _rank_histogram(rank, 5)  # ranks 5..8
        words = tl.where(offs_c[None, :] < 4, low[:, None], high[:, None])  # [BM, C]
    else:
        words = low[:, None] + offs_c[None, :] * 0
    per_rank = (words >> (8 * (offs_c[None, :] % 4))) & 0xFF  # [BM, C] keys of rank j + 1
    # at or above pivot j = keys of rank j+1..C = total - (inclusive prefix through j) + own
    total = tl.sum(per_rank, axis=1)  # [BM]
    return total[:, None] - tl.cumsum(per_rank, axis=1) + per_rank


@triton.jit
def _middle_score_pivots(pivots, NUM_PIVOTS: tl.constexpr):
    """The two middle pivots of the score-spaced half (columns ``HALF/2 - 1`` and ``HALF/2``
    of ``_pivots``' unsorted output): the window around the row's guessed boundary. An odd
    half has no middle pair (the launcher never speculates then): an empty window."""
    HALF: tl.constexpr = NUM_PIVOTS // 2
    LOW: tl.constexpr = HALF // 2 - 1 if HALF % 2 == 0 else 0
    HIGH: tl.constexpr = HALF // 2 if HALF % 2 == 0 else 0
    return _column(pivots, LOW, NUM_PIVOTS), _column(pivots, HIGH, NUM_PIVOTS)


@triton.jit
def _count_at_pivot(pivots, counts, value):
    """Per row, the count of keys >= ``value``, which is one of the row's pivots ([BM])."""
    return tl.max(tl.where(pivots == value[:, None], counts, -1), axis=1)


@triton.jit
def _selection_pass(
    qc, k_base, pivots, lo, hi, collect, collect_lo, collect_hi, scratch_rows, count_pivots,
    num_tiles, scale, stride_kn, stride_kd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_PIVOTS: tl.constexpr, BRACKET_CAPACITY: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PACKED_COUNTS: tl.constexpr,
):  # fmt: skip
    """One pass over the key tiles. Per row: the number of keys >= each pivot (when
    ``count_pivots``; with ``PACKED_COUNTS`` the pivots must be sorted ascending per row), and
    the smallest and largest key inside ``[lo, hi)``; rows that ``collect`` also write their
    keys inside ``[collect_lo, collect_hi)`` (the bracket, or a window guessed to hold the
    boundary), in tile order, to their scratch row (the first ``BRACKET_CAPACITY`` of them)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, NUM_PIVOTS)
    counts = tl.zeros([BLOCK_M, NUM_PIVOTS], dtype=tl.int32)  # [BM, C]
    inside_min = tl.full([BLOCK_M], 2147483647, dtype=tl.int32)
    inside_max = tl.full([BLOCK_M], -2147483648, dtype=tl.int32)
    collected = tl.zeros([BLOCK_M], dtype=tl.int32)
    any_collect = tl.sum(collect.to(tl.int32), axis=0) > 0
    for start in range(0, num_tiles, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_real = offs_n < num_tiles
        kc_t = _load_tile_cols(k_base, offs_n, col_real, offs_d, stride_kn, stride_kd)  # [D, BN]
        keys = _score_keys(qc, kc_t, col_real, scale, INPUT_PRECISION)  # [BM, BN]
        inside = _in_bracket(keys, lo, hi)  # [BM, BN]
        inside_min = tl.minimum(inside_min, tl.min(tl.where(inside, keys, 2147483647), 1))
        inside_max = tl.maximum(inside_max, tl.max(tl.where(inside, keys, -2147483648), 1))
        if count_pivots:
            if PACKED_COUNTS:
                counts += _count_at_or_above_sorted(keys, pivots, NUM_PIVOTS)
            else:
                for j in tl.static_range(NUM_PIVOTS):
                    pivot = _column(pivots, j, NUM_PIVOTS)  # [BM]
                    at_or_above = tl.sum((keys >= pivot[:, None]).to(tl.int32), axis=1)  # [BM]
                    counts += tl.where(offs_c[None, :] == j, at_or_above[:, None], 0)
        if any_collect:
            gathered = _in_bracket(keys, collect_lo, collect_hi) & collect[:, None]  # [BM, BN]
            slot = collected[:, None] + tl.cumsum(gathered.to(tl.int32), axis=1) - 1
            keep = gathered & (slot < BRACKET_CAPACITY)
            tl.store(scratch_rows[:, None] + slot.to(tl.int64), keys, mask=keep)
            collected += tl.sum(gathered.to(tl.int32), axis=1)
    return counts, inside_min, inside_max


@triton.jit
def _narrow_bracket(lo, hi, count_lo, count_hi, pivots, counts, topk, rows):
    """Tightest bracket with ``count(lo) >= topk > count(hi)`` among the old one and the
    pivots (counts fall as the threshold rises, so the largest valid ``lo`` has the smallest
    count; pivots may lie outside a snapped bracket). Only ``rows`` move."""
    pivots = pivots.to(tl.int64)  # [BM, C]
    enough = counts >= topk  # [BM, C]: pivot can be lo
    new_lo = tl.maximum(lo, tl.max(tl.where(enough, pivots, lo[:, None]), axis=1))
    new_count_lo = tl.minimum(count_lo, tl.min(tl.where(enough, counts, count_lo[:, None]), 1))
    new_hi = tl.minimum(hi, tl.min(tl.where(enough, hi[:, None], pivots), axis=1))
    new_count_hi = tl.maximum(count_hi, tl.max(tl.where(enough, count_hi[:, None], counts), 1))
    lo = tl.where(rows, new_lo, lo)
    hi = tl.where(rows, new_hi, hi)
    count_lo = tl.where(rows, new_count_lo, count_lo)
    count_hi = tl.where(rows, new_count_hi, count_hi)
    return lo, hi, count_lo, count_hi


@triton.jit
def _kth_largest(keys, k):
    """Per row, the ``k``-th largest of int32 ``keys`` [BM, M] (``1 <= k <= M``): the largest
    ``t`` with ``count(keys >= t) >= k``, built bit by bit on ``keys + 2**31`` (32 compare-and-
    count steps over M keys; cheaper to compile than a bitonic sort)."""
    unsigned = keys.to(tl.int64) + 2147483648  # [BM, M] in [0, 2**32)
    kth = tl.zeros([keys.shape[0]], dtype=tl.int64)
    for bit in tl.static_range(31, -1, -1):
        trial = kth + (1 << bit)  # [BM]
        enough = tl.sum((unsigned >= trial[:, None]).to(tl.int32), axis=1) >= k
        kth = tl.where(enough, trial, kth)
    return (kth - 2147483648).to(tl.int32)


@triton.jit
def _settle_collected(
    scratch_rows, lo, hi, count_lo, count_hi, collected, topk, BRACKET_CAPACITY: tl.constexpr
):
    """For rows whose bracket keys were collected: the exact ``(topk - count(hi))``-th largest
    of them, ``kth``, becomes the bracket ``[kth, kth + 1)`` (only its ties left to pick)."""
    offs_j = tl.arange(0, BRACKET_CAPACITY)  # [M]
    held = offs_j[None, :] < (count_lo - count_hi)[:, None]  # [BM, M]
    # Written by other threads of this program: the barrier orders, volatile skips stale L1.
    bracket = tl.load(
        scratch_rows[:, None] + offs_j[None, :],
        mask=held & collected[:, None],
        other=-2147483648,
        volatile=True,
    )  # [BM, M]; INT32_MIN below any key
    kth = _kth_largest(bracket, topk - count_hi)  # [BM] int32
    above_kth = tl.sum((bracket > kth[:, None]).to(tl.int32), axis=1)
    lo = tl.where(collected, kth.to(tl.int64), lo)
    hi = tl.where(collected, kth.to(tl.int64) + 1, hi)
    count_hi = tl.where(collected, count_hi + above_kth, count_hi)
    return lo, hi, count_hi


@triton.jit
def _bracket_topk(
    qc, k_base, scratch_rows, row_real, dot_min, dot_max, dot_sum, dot_sq_sum,
    num_tiles, topk, scale, quantile_z, stride_kn, stride_kd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_PIVOTS: tl.constexpr, BRACKET_CAPACITY: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PACKED_COUNTS: tl.constexpr, SPECULATE: tl.constexpr,
):  # fmt: skip
    """Selection passes until each row's bracket ``[lo, hi)`` pins its top-k: returns ``lo,
    hi`` (int64 keys), ``count(hi)`` and the number of passes run. Every key in ``[lo, hi)``
    ties when a row ends with ``hi - lo == 1``; none is left over when ``count(lo) == topk``.

    With ``SPECULATE``, the first pass also collects the keys between the two middle score
    pivots (the window where the statistics put the boundary, sized by the launcher to hold
    well under ``BRACKET_CAPACITY`` keys of normal scores). Where the counts then show that
    the window holds the boundary and fits the scratch row, that window is the row's bracket,
    already collected: one pass instead of two. Elsewhere the pass narrows as usual."""
    # Every real key is > INT32_MIN + 1 (the key of -inf is -2139095041), none is >= 2**31.
    lo = tl.full([BLOCK_M], -2147483647, dtype=tl.int64)
    hi = tl.full([BLOCK_M], 2147483648, dtype=tl.int64)
    count_lo = tl.zeros([BLOCK_M], dtype=tl.int32) + num_tiles
    count_hi = tl.zeros([BLOCK_M], dtype=tl.int32)
    # The first pivots go where the softmax pass's statistics put the boundary. Pivots are
    # only placed with the guesses; the bracket moves on this kernel's own counts, so the
    # guesses (from dots that may round differently) need not be exact. After the first pass
    # the bracket is snapped to real keys and serves as the next guess.
    guess_lo, guess_hi = _first_guess(dot_min, dot_max, dot_sum, dot_sq_sum, num_tiles, scale,
                                      quantile_z)  # fmt: skip
    collected = row_real & (count_lo < 0)  # all False
    open_rows = row_real & (count_lo != topk)
    num_open = tl.sum(open_rows.to(tl.int32), axis=0)
    passes = num_open * 0
    while num_open > 0:
        # A row whose bracket holds few keys has them written out this pass and is settled
        # exactly afterwards: no more passes for the last, possibly tiny, gap.
        collect = open_rows & (count_lo - count_hi <= BRACKET_CAPACITY)
        narrowing = open_rows & ~collect
        pivots = _pivots(lo, hi, guess_lo, guess_hi, NUM_PIVOTS)  # [BM, C]
        speculate = narrowing & (passes == 0) & SPECULATE
        window_lo, window_hi = _middle_score_pivots(pivots, NUM_PIVOTS)  # [BM] int32 each
        gather = collect | speculate
        gather_lo = tl.where(speculate, window_lo, lo.to(tl.int32))
        gather_hi = tl.where(speculate, window_hi.to(tl.int64), hi)
        if PACKED_COUNTS:
            pivots = tl.sort(pivots, dim=1)  # the bracket update below takes them in any order
        counts, inside_min, inside_max = _selection_pass(
            qc, k_base, pivots, lo, hi, gather, gather_lo, gather_hi, scratch_rows,
            tl.sum(narrowing.to(tl.int32), axis=0) > 0, num_tiles, scale, stride_kn, stride_kd,
            BLOCK_M, BLOCK_N, HEAD_DIM, NUM_PIVOTS, BRACKET_CAPACITY, INPUT_PRECISION,
            PACKED_COUNTS,
        )  # fmt: skip
        # Snap the bracket to the keys actually inside it (no key lies between, so the counts
        # stand): a bracket holding one tied score closes at once, and the next pivots are
        # placed over real data only.
        lo = tl.where(narrowing, tl.maximum(lo, inside_min.to(tl.int64)), lo)
        hi = tl.where(narrowing, tl.minimum(hi, inside_max.to(tl.int64) + 1), hi)
        lo, hi, count_lo, count_hi = _narrow_bracket(
            lo, hi, count_lo, count_hi, pivots, counts, topk, narrowing
        )
        # A window that holds the boundary (count(window_lo) >= topk > count(window_hi)) and
        # whose keys all fit in the scratch row becomes the bracket, collected this pass.
        window_count_lo = _count_at_pivot(pivots, counts, window_lo)  # [BM]
        window_count_hi = _count_at_pivot(pivots, counts, window_hi)
        caught = speculate & (window_count_lo >= topk) & (window_count_hi < topk)
        caught = caught & (window_count_lo - window_count_hi <= BRACKET_CAPACITY)
        lo = tl.where(caught, window_lo.to(tl.int64), lo)
        hi = tl.where(caught, window_hi.to(tl.int64), hi)
        count_lo = tl.where(caught, window_count_lo, count_lo)
        count_hi = tl.where(caught, window_count_hi, count_hi)
        collected = collected | collect | caught
        guess_lo, guess_hi = lo, hi
        open_rows = narrowing & ~caught & (count_lo != topk) & (hi - lo > 1)
        num_open = tl.sum(open_rows.to(tl.int32), axis=0)
        passes += 1
    if tl.sum(collected.to(tl.int32), axis=0) > 0:
        tl.debug_barrier()
        lo, hi, count_hi = _settle_collected(
            scratch_rows, lo, hi, count_lo, count_hi, collected, topk, BRACKET_CAPACITY
        )
    return lo, hi, count_hi, passes


@triton.jit
def _write_selection(
    qc, k_base, idx_rows, lo, hi, count_hi, row_real, num_tiles, topk, scale,
    stride_kn, stride_kd, stride_ik,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Write pass: keys >= hi, then the first ``topk - count(hi)`` keys of ``[lo, hi)`` in
    tile order; positions come from running prefix counts, so each row is ascending.
    Returns the number of entries written per row (``topk`` unless scores hold NaN)."""
    offs_d = tl.arange(0, HEAD_DIM)
    from_bracket = topk - count_hi  # [BM]
    hi_minus_1 = (hi - 1).to(tl.int32)  # [BM]; keys >= hi  <=>  keys > hi - 1
    written = tl.zeros([BLOCK_M], dtype=tl.int32)
    bracket_seen = tl.zeros([BLOCK_M], dtype=tl.int32)
    for start in range(0, num_tiles, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BN]
        col_real = offs_n < num_tiles
        kc_t = _load_tile_cols(k_base, offs_n, col_real, offs_d, stride_kn, stride_kd)  # [D, BN]
        keys = _score_keys(qc, kc_t, col_real, scale, INPUT_PRECISION)  # [BM, BN]
        above = keys > hi_minus_1[:, None]
        inside = _in_bracket(keys, lo, hi)  # INT32_MIN padding: never
        bracket_rank = bracket_seen[:, None] + tl.cumsum(inside.to(tl.int32), axis=1)
        take = above | (inside & (bracket_rank <= from_bracket[:, None]))  # [BM, BN]
        slot = written[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1  # [BM, BN]
        keep = take & (slot < topk) & row_real[:, None]
        ptrs = idx_rows[:, None] + slot.to(tl.int64) * stride_ik
        tl.store(ptrs, offs_n[None, :].to(tl.int32) + tl.zeros_like(slot), mask=keep)
        written += tl.sum(take.to(tl.int32), axis=1)
        bracket_seen += tl.sum(inside.to(tl.int32), axis=1)
    return tl.minimum(written, topk)


@triton.jit
def _coarse_attn_topk_fwd_kernel(
    QC, KC, VC, OC, KV_IDX, KV_CNT, SCRATCH, PASSES,
    # qc, kc, vc, oc [B, H, Nt, D]; kv_idx int32 [B, H, Nt, topk]; kv_cnt int32 [B, H, Nt];
    # scratch int32 [B * H * Nt, BRACKET_CAPACITY]; passes int32 [B * H, num_q_blocks]
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_ib, stride_ih, stride_in, stride_ik,
    stride_cb, stride_ch, stride_cn,
    H, num_tiles, topk,
    scale,  # softmax scale, fp32: the score that is ranked is fl(fl(qc . kc) * scale)
    qk_scale,  # scale * log2(e), fp32, for the softmax in base 2
    quantile_z,  # normal quantile of 1 - topk / num_tiles, fp32: where the first pivots go
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_PIVOTS: tl.constexpr, BRACKET_CAPACITY: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PACKED_COUNTS: tl.constexpr, SPECULATE: tl.constexpr, RECORD_PASSES: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query tiles
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    row_real = offs_m < num_tiles
    qc_base = QC + b * stride_qb + h * stride_qh
    qc = _load_tile_rows(qc_base, offs_m, row_real, offs_d, stride_qn, stride_qd)  # [BM, D]
    k_base = KC + b * stride_kb + h * stride_kh
    v_base = VC + b * stride_vb + h * stride_vh

    # Pass 0: oc = softmax(qc kc^T * scale) vc, and each row's score statistics.
    oc, dot_min, dot_max, dot_sum, dot_sq_sum = _coarse_softmax_pass(
        qc, k_base, v_base, num_tiles, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
        BLOCK_M, BLOCK_N, HEAD_DIM, INPUT_PRECISION,
    )  # fmt: skip
    oc_ptrs = OC + b * stride_ob + h * stride_oh
    oc_ptrs += offs_m[:, None] * stride_on + offs_d[None, :] * stride_od  # [BM, D]
    tl.store(oc_ptrs, oc.to(OC.dtype.element_ty), mask=row_real[:, None])

    # Selection passes: bracket the topk-th largest score of each row.
    scratch_rows = SCRATCH + (pid_bh.to(tl.int64) * num_tiles + offs_m) * BRACKET_CAPACITY
    lo, hi, count_hi, passes = _bracket_topk(
        qc, k_base, scratch_rows, row_real, dot_min, dot_max, dot_sum, dot_sq_sum,
        num_tiles, topk, scale, quantile_z, stride_kn, stride_kd,
        BLOCK_M, BLOCK_N, HEAD_DIM, NUM_PIVOTS, BRACKET_CAPACITY, INPUT_PRECISION,
        PACKED_COUNTS, SPECULATE,
    )  # fmt: skip

    # Write pass: the top-k lists, ascending.
    idx_rows = KV_IDX + b * stride_ib + h * stride_ih + offs_m * stride_in  # [BM] pointers
    counts = _write_selection(
        qc, k_base, idx_rows, lo, hi, count_hi, row_real, num_tiles, topk, scale,
        stride_kn, stride_kd, stride_ik, BLOCK_M, BLOCK_N, HEAD_DIM, INPUT_PRECISION,
    )  # fmt: skip
    cnt_ptrs = KV_CNT + b * stride_cb + h * stride_ch + offs_m * stride_cn
    tl.store(cnt_ptrs, counts, mask=row_real)
    if RECORD_PASSES:
        tl.store(PASSES + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m, passes)


# ============================================================================ launchers


def _pooled_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _selected_quantile_z(topk: int, num_tiles: int) -> float:
    """Where the top-k boundary would sit, in standard deviations above the mean, if a row's
    scores were normal: only steers the first pivots."""
    kept = min(max(topk / num_tiles, 1e-4), 1.0 - 1e-4)
    return NormalDist().inv_cdf(1.0 - kept)


def _speculate(cfg: CoarseAttnConfig, topk: int, num_tiles: int) -> bool:
    """Whether the first selection pass collects the middle score-pivot window (see
    ``_bracket_topk``): where normal scores would put at most ``speculate_fill`` of the scratch
    capacity in it, so that it fits for most rows. Wider windows (many tiles, few pivots) would
    mostly overflow and only add the collecting cost to the first pass."""
    half = cfg.num_pivots // 2
    if cfg.speculate_fill <= 0 or half % 2:
        return False
    z = _selected_quantile_z(topk, num_tiles)
    width = 1.0 / (half + 1)  # the window spans z -+ width standard deviations
    expected = num_tiles * (NormalDist().cdf(z + width) - NormalDist().cdf(z - width))
    return expected <= cfg.speculate_fill * cfg.bracket_capacity


def tile_mean_pool_fwd(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    tile_sizes: torch.Tensor,
    config: PoolConfig | None = None,
) -> torch.Tensor:
    """Means of each tile's real tokens of q, k and v, in one launch.

    ``q_t, k_t, v_t`` ``[B, H, P, D]`` in tile order, ``tile_sizes`` int32 ``[Nt]``; returns
    ``pooled`` fp32 ``[3, B, H, Nt, D]`` = ``(qc, kc, vc)``. Padding slots are not read.
    """
    B, H, P, D = q_t.shape
    num_tiles = tile_sizes.shape[0]
    tile_volume = P // num_tiles
    pooled = torch.empty((3, B, H, num_tiles, D), device=q_t.device, dtype=torch.float32)
    cfg = config or pool_config(target_of(q_t.device), D)
    grid = (triton.cdiv(num_tiles, cfg.tiles_per_program), B * H, 3)
    _tile_mean_pool_fwd_kernel[grid](
        q_t, k_t, v_t, pooled, tile_sizes,
        *q_t.stride(), *k_t.stride(), *v_t.stride(), *pooled.stride(),
        H, num_tiles,
        TILE_VOLUME=tile_volume, TILE_SLOTS=pow2_at_least(tile_volume), HEAD_DIM=D,
        TILES_PER_PROGRAM=cfg.tiles_per_program,
        **cfg.launch_kwargs(),
    )  # fmt: skip
    return pooled


def tile_mean_pool_bwd(
    dpooled: torch.Tensor,
    tile_sizes: torch.Tensor,
    padded_len: int,
    dtype: torch.dtype,
    config: PoolConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient of :func:`tile_mean_pool_fwd`: ``dpooled`` ``[3, B, H, Nt, D]`` ->
    ``(dq, dk, dv)`` ``[B, H, padded_len, D]`` in ``dtype``; each real token of tile ``i`` gets
    ``d mean_i / size_i``, each padding slot 0."""
    _, B, H, num_tiles, D = dpooled.shape
    tile_volume = padded_len // num_tiles
    grads = [
        torch.empty((B, H, padded_len, D), device=dpooled.device, dtype=dtype) for _ in range(3)
    ]
    cfg = config or pool_config(target_of(dpooled.device), D)
    grid = (triton.cdiv(num_tiles, cfg.tiles_per_program), B * H, 3)
    _tile_mean_pool_bwd_kernel[grid](
        dpooled, *grads, tile_sizes,
        *dpooled.stride(), *grads[0].stride(), *grads[1].stride(), *grads[2].stride(),
        H, num_tiles,
        TILE_VOLUME=tile_volume, TILE_SLOTS=pow2_at_least(tile_volume), HEAD_DIM=D,
        TILES_PER_PROGRAM=cfg.tiles_per_program,
        **cfg.launch_kwargs(),
    )  # fmt: skip
    return grads[0], grads[1], grads[2]


def coarse_attn_topk_fwd(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    topk: int,
    scale: float,
    config: CoarseAttnConfig | None = None,
    record_passes: bool = False,
):
    """Coarse attention and top-k selection in one launch.

    ``qc, kc, vc`` ``[B, H, Nt, D]`` (fp32 from the pooling kernel); ``1 <= topk <= Nt``.
    Returns ``oc`` ``[B, H, Nt, D]`` (qc's dtype), ``kv_indices`` int32 ``[B, H, Nt, topk]``
    (ascending per row) and ``kv_counts`` int32 ``[B, H, Nt]``; with ``record_passes`` also
    int32 ``[B * H, num_q_blocks]``, the selection passes each program ran.
    """
    B, H, num_tiles, D = qc.shape
    cfg = config or coarse_attn_config(target_of(qc.device), D, num_tiles)
    oc = torch.empty((B, H, num_tiles, D), device=qc.device, dtype=qc.dtype)
    kv_indices = torch.empty((B, H, num_tiles, topk), device=qc.device, dtype=torch.int32)
    kv_counts = torch.empty((B, H, num_tiles), device=qc.device, dtype=torch.int32)
    # Keys of the few brackets that get collected: O(Nt * capacity), never O(Nt^2).
    scratch = torch.empty(
        (B * H * num_tiles, cfg.bracket_capacity), device=qc.device, dtype=torch.int32
    )
    grid = (triton.cdiv(num_tiles, cfg.block_m), B * H)
    passes = torch.empty((B * H, grid[0]), device=qc.device, dtype=torch.int32)
    _coarse_attn_topk_fwd_kernel[grid](
        qc, kc, vc, oc, kv_indices, kv_counts, scratch, passes,
        *qc.stride(), *kc.stride(), *vc.stride(), *oc.stride(),
        *kv_indices.stride(), *kv_counts.stride(),
        H, num_tiles, topk,
        float(scale), float(scale) * LOG2E, _selected_quantile_z(topk, num_tiles),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D, NUM_PIVOTS=cfg.num_pivots,
        BRACKET_CAPACITY=cfg.bracket_capacity, INPUT_PRECISION=cfg.input_precision,
        PACKED_COUNTS=cfg.packed_counts and cfg.num_pivots in (4, 8) and cfg.block_n < 256,
        SPECULATE=_speculate(cfg, topk, num_tiles),
        RECORD_PASSES=record_passes,
        **cfg.launch_kwargs(),
    )  # fmt: skip
    if record_passes:
        return oc, kv_indices, kv_counts, passes
    return oc, kv_indices, kv_counts


def coarse_grad_dtype(input_dtype: torch.dtype) -> torch.dtype | None:
    """``grad_dtype`` of :func:`coarse_attn_bwd` for inputs of ``input_dtype``: bf16 for bf16,
    as the fine stage's kernels form their gradients; fp16 inputs keep fp32 there (d o_coarse
    sums a tile's rows of do and can leave fp16's range under loss scaling); fp32 / fp64 keep
    their precision (None)."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else None


@torch.no_grad()
def coarse_attn_bwd(
    doc: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scale: float,
    grad_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gradient of ``oc = softmax(qc kc^T * scale) vc``, chunked over query tiles (each
    ``[B, H, chunk, Nt]`` temporary within ``_BWD_CHUNK_ELEMENTS``).

    The probabilities are recomputed in qc's precision (fp32): at large input scales the
    softmax is sharp and bf16 scores would be off by ~25%. The four gradient matmuls run in
    ``grad_dtype`` (default qc's), with the products accumulated in fp32: bf16 there costs
    ~4e-3 relative error, like any bf16 gradient, and runs on the tensor cores.

    Returns ``dpooled`` ``[3, B, H, Nt, D]`` = ``(dqc, dkc, dvc)`` in qc's dtype.
    """
    B, H, num_tiles, D = qc.shape
    low = grad_dtype or qc.dtype
    doc_low, qc_low, kc_low, vc_t_low = (
        x.to(low) for x in (doc, qc, kc, vc.transpose(-1, -2))
    )  # fmt: skip
    dpooled = torch.zeros((3, B, H, num_tiles, D), device=qc.device, dtype=qc.dtype)
    dqc, dkc, dvc = dpooled.unbind(0)
    kc_t = kc.transpose(-1, -2)  # [B, H, D, Nt]
    chunk = max(1, _BWD_CHUNK_ELEMENTS // max(1, B * H * num_tiles))
    for start in range(0, num_tiles, chunk):
        rows = slice(start, min(start + chunk, num_tiles))
        do_rows = doc_low[:, :, rows]  # [B, H, c, D]
        probs = torch.softmax(torch.matmul(qc[:, :, rows], kc_t) * scale, dim=-1)  # [B, H, c, Nt]
        dvc += torch.matmul(probs.to(low).transpose(-1, -2), do_rows)  # [B, H, Nt, D]
        dprobs = torch.matmul(do_rows, vc_t_low).to(qc.dtype)  # [B, H, c, Nt]
        delta = (probs * dprobs).sum(dim=-1, keepdim=True)  # [B, H, c, 1]
        dscores = probs.mul_(dprobs.sub_(delta)).mul_(scale).to(low)  # [B, H, c, Nt]
        dqc[:, :, rows] = torch.matmul(dscores, kc_low)  # [B, H, c, D]
        dkc += torch.matmul(dscores.transpose(-1, -2), qc_low[:, :, rows])  # [B, H, Nt, D]
    return dpooled


# ============================================================================ torch path


def _tile_means_torch(x_t: torch.Tensor, tile_sizes: torch.Tensor) -> torch.Tensor:
    B, H, P, D = x_t.shape
    num_tiles = tile_sizes.shape[0]
    x = x_t.reshape(B, H, num_tiles, P // num_tiles, D).to(_pooled_dtype(x_t.dtype))
    real = torch.arange(P // num_tiles, device=x.device) < tile_sizes.view(-1, 1)  # [Nt, V]
    sums = x.masked_fill(~real[..., None], 0).sum(dim=-2)  # [B, H, Nt, D]
    return sums / tile_sizes.clamp(min=1).to(sums.dtype).view(-1, 1)


def _select_topk_torch(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The kernels' rule: largest scores, ties to the smaller tile index, ascending output."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    return order.sort(dim=-1).values.to(torch.int32)  # [B, H, Nt, topk]


def _coarse_stage_torch(q_t, k_t, v_t, tile_sizes, topk: int, scale: float):
    pooled = torch.stack([_tile_means_torch(x, tile_sizes) for x in (q_t, k_t, v_t)])
    qc, kc, vc = pooled.unbind(0)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # [B, H, Nt, Nt]
    oc = torch.matmul(torch.softmax(scores, dim=-1), vc)
    kv_indices = _select_topk_torch(scores, topk)
    kv_counts = torch.full(kv_indices.shape[:-1], topk, dtype=torch.int32, device=qc.device)
    return oc, kv_indices, kv_counts, pooled


def tile_mean_pool_bwd_torch(dpooled, tile_sizes, padded_len: int, dtype: torch.dtype):
    """:func:`tile_mean_pool_bwd` in PyTorch: ``[3, B, H, Nt, D]`` -> three ``[B, H, P, D]``."""
    _, B, H, num_tiles, D = dpooled.shape
    tile_volume = padded_len // num_tiles
    real = torch.arange(tile_volume, device=dpooled.device) < tile_sizes.view(-1, 1)  # [Nt, V]
    sizes = tile_sizes.clamp(min=1).to(dpooled.dtype).view(-1, 1, 1)  # [Nt, 1, 1]
    weights = real[..., None].to(dpooled.dtype) / sizes  # [Nt, V, 1]: 1/size on real slots
    grads = []  # three separate tensors: custom-op outputs must not alias each other
    for dmean in dpooled.unbind(0):
        dx = dmean.unsqueeze(-2) * weights  # [B, H, Nt, V, D]
        grads.append(dx.reshape(B, H, padded_len, D).to(dtype))
    return grads[0], grads[1], grads[2]


# ============================================================================ custom ops


@torch.library.custom_op("vidsparse::vsa_coarse_stage_fwd", mutates_args=())
def _vsa_coarse_stage_fwd_op(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    tile_sizes: torch.Tensor,
    topk: int,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        pooled = tile_mean_pool_fwd(q_t, k_t, v_t, tile_sizes)
        oc, kv_indices, kv_counts = coarse_attn_topk_fwd(
            pooled[0], pooled[1], pooled[2], topk, scale
        )
        return oc, kv_indices, kv_counts, pooled
    return _coarse_stage_torch(q_t, k_t, v_t, tile_sizes, topk, scale)


@_vsa_coarse_stage_fwd_op.register_fake
def _(q_t, k_t, v_t, tile_sizes, topk, scale, backend):
    B, H, _, D = q_t.shape
    num_tiles = tile_sizes.shape[0]
    dtype = _pooled_dtype(q_t.dtype)
    return (
        q_t.new_empty((B, H, num_tiles, D), dtype=dtype),
        q_t.new_empty((B, H, num_tiles, topk), dtype=torch.int32),
        q_t.new_empty((B, H, num_tiles), dtype=torch.int32),
        q_t.new_empty((3, B, H, num_tiles, D), dtype=dtype),
    )


@torch.library.custom_op("vidsparse::vsa_coarse_stage_bwd", mutates_args=())
def _vsa_coarse_stage_bwd_op(
    doc: torch.Tensor,
    pooled: torch.Tensor,
    tile_sizes: torch.Tensor,
    padded_len: int,
    dtype: torch.dtype,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dpooled = coarse_attn_bwd(doc, pooled[0], pooled[1], pooled[2], scale, coarse_grad_dtype(dtype))
    if backend == "triton":
        return tile_mean_pool_bwd(dpooled, tile_sizes, padded_len, dtype)
    return tile_mean_pool_bwd_torch(dpooled, tile_sizes, padded_len, dtype)


@_vsa_coarse_stage_bwd_op.register_fake
def _(doc, pooled, tile_sizes, padded_len, dtype, scale, backend):
    _, B, H, _, D = pooled.shape
    return tuple(pooled.new_empty((B, H, padded_len, D), dtype=dtype) for _ in range(3))


def _setup_context(ctx, inputs, output):
    q_t, k_t, v_t, tile_sizes, topk, scale, backend = inputs
    oc, kv_indices, kv_counts, pooled = output
    ctx.save_for_backward(pooled, tile_sizes)
    ctx.meta = (q_t.shape[2], q_t.dtype, scale, backend)
    ctx.mark_non_differentiable(kv_indices, kv_counts, pooled)


def _backward(ctx, doc, _dindices, _dcounts, _dpooled):
    pooled, tile_sizes = ctx.saved_tensors
    padded_len, dtype, scale, backend = ctx.meta
    dq, dk, dv = torch.ops.vidsparse.vsa_coarse_stage_bwd(
        doc, pooled, tile_sizes, padded_len, dtype, scale, backend
    )
    return dq, dk, dv, None, None, None, None


_vsa_coarse_stage_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ============================================================================ entry point


def vsa_coarse_stage(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    grid: VideoGrid,
    topk: int,
    scale: float | None = None,
    *,
    return_pooled: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The coarse stage of VSA: tile means, coarse attention and top-k selection.

    ::

        q_t, k_t, v_t [B, H, P, D] (tile order; padding slots ignored, whatever they hold)
          -> qc, kc, vc = means of each tile's real tokens            [B, H, Nt, D] fp32
          -> oc = softmax(qc kc^T * scale) vc                         [B, H, Nt, D] fp32
          -> per query tile, the topk key tiles of largest score      kv_indices, kv_counts

    Args:
        q_t, k_t, v_t: ``[B, H, grid.padded_len, D]`` in tile order (``grid.tile``), one dtype.
        grid: the :class:`VideoGrid`; its ``tile_sizes`` mask the padding slots.
        topk: key tiles kept per query tile, ``>= 1``; values above ``num_tiles`` are clamped.
        scale: softmax scale, ``1 / sqrt(D)`` by default.

    Returns ``(oc, kv_indices, kv_counts)``: ``oc`` fp32 (fp64 for fp64 inputs), differentiable
    in q_t, k_t, v_t (each real token of tile i gets ``d qc_i / size_i``, padding gets 0);
    ``kv_indices`` int32 ``[B, H, Nt, topk]``, ascending in each row, ties broken towards the
    smaller tile index; ``kv_counts`` int32 ``[B, H, Nt]``, ``topk`` (fewer only in rows whose
    scores hold NaN). Both feed
    ``block_sparse_attn(..., block_size=grid.tile_volume, kv_block_sizes=grid.tile_sizes_on(...))``
    directly. ``return_pooled`` adds the tile means ``[3, B, H, Nt, D]`` (qc, kc, vc; not
    differentiable), which VSA's fine stage takes to fuse this stage's backward into its own.
    """
    _validate(q_t, k_t, v_t, grid, topk, scale)
    device = check_same_device(q_t=q_t, k_t=k_t, v_t=v_t)
    D = q_t.shape[-1]
    topk = min(int(topk), grid.num_tiles)
    scale = D**-0.5 if scale is None else float(scale)
    backend = resolve_backend(device)
    if backend == "triton":
        if D not in TRITON_HEAD_DIMS:
            raise ValueError(
                f"head_dim {D} is not supported by the Triton kernels; supported:"
                f" {TRITON_HEAD_DIMS} (set VIDSPARSE_BACKEND=torch for the reference path)"
            )
        if q_t.dtype not in TRITON_DTYPES:
            raise TypeError(f"the Triton kernels take fp16, bf16 or fp32 inputs, got {q_t.dtype}")
    tile_sizes = grid.tile_sizes_on(device)
    oc, kv_indices, kv_counts, pooled = torch.ops.vidsparse.vsa_coarse_stage_fwd(
        q_t, k_t, v_t, tile_sizes, topk, scale, backend
    )
    if return_pooled:
        return oc, kv_indices, kv_counts, pooled
    return oc, kv_indices, kv_counts


def _validate(q_t, k_t, v_t, grid, topk, scale) -> None:
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        check_tensor(name, x, ndim=4, dtypes=TORCH_DTYPES)
    if not (q_t.dtype == k_t.dtype == v_t.dtype):
        raise TypeError(
            f"q_t, k_t, v_t must share a dtype, got {q_t.dtype}, {k_t.dtype}, {v_t.dtype}"
        )
    if not (q_t.shape == k_t.shape == v_t.shape):
        raise ValueError(
            f"q_t, k_t, v_t must have the same shape [B, H, P, D], got {tuple(q_t.shape)},"
            f" {tuple(k_t.shape)}, {tuple(v_t.shape)}"
        )
    if q_t.shape[2] != grid.padded_len:
        raise ValueError(
            f"q_t must be in tile order with grid.padded_len = {grid.padded_len} rows for {grid},"
            f" got {tuple(q_t.shape)} (tile it with grid.tile(x, dim=-2))"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0
    ):
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
