"""Coarse attention and top-k selection of VSA's coarse stage, fused in one kernel.

One program per (``BLOCK_M`` query tiles, batch * head) turns the tile means into
``oc = softmax(qc kc^T * scale) vc`` and each query tile's ``topk`` key tiles, with no
``Nt x Nt`` tensor anywhere: scores are cheap to recompute, so it streams over the key tiles::

    pass 0       online softmax (base 2) -> oc; per row min / max / mean / std of the scores
    passes 1..P  narrow a bracket [lo, hi) of the topk-th largest score by counting the scores
                 at or above NUM_PIVOTS thresholds; a bracket of <= BRACKET_CAPACITY scores
                 is copied to a scratch row and its exact k-th largest found there
    last pass    write every score >= hi, then the first topk - count(>= hi) of the bracket

Scores are compared as *order keys* (fp32 bits as an int32 ordered like the floats), so
brackets and ties are exact (ties go to the smaller tile index), and every pass after the
softmax ranks ``fl(fl(qc . kc) * scale)`` from one function: bit-identical in all passes.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["coarse_attn_topk_fwd_kernel"]


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
        # `where`, not `narrowing & (passes == 0)`: Triton's interpreter broadcasts a scalar
        # bool as int32 data, which the store mask in _selection_pass then carries and Triton
        # >= 3.9 refuses ("mask has unsupported dtype"). Compiled, both are one `and`.
        speculate = tl.where(passes == 0, narrowing, False) & SPECULATE
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
    stride_kn, stride_kd, stride_ik, first_index,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Write pass: keys >= hi, then the first ``topk - count(hi)`` keys of ``[lo, hi)`` in
    tile order; positions come from running prefix counts, so each row is ascending. Key tile
    ``n`` is written as ``first_index + n``. Returns the number of entries written per row
    (``topk`` unless scores hold NaN)."""
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
        tl.store(ptrs, (first_index + offs_n)[None, :].to(tl.int32) + tl.zeros_like(slot),
                 mask=keep)  # fmt: skip
        written += tl.sum(take.to(tl.int32), axis=1)
        bracket_seen += tl.sum(inside.to(tl.int32), axis=1)
    return tl.minimum(written, topk)


@triton.jit
def coarse_attn_topk_fwd_kernel(
    QC, KC, VC, OC, KV_IDX, KV_CNT, SCRATCH, PASSES, SEGMENTS, SEGMENT_Z,
    # qc, oc [B, H, Nt, D]; kc, vc [B, H, Nk, D] (Nk = Nt unless SEGMENTED);
    # kv_idx int32 [B, H, Nt, topk]; kv_cnt int32 [B, H, Nt];
    # scratch int32 [B * H * Nt, BRACKET_CAPACITY]; passes int32 [B * H, num_q_blocks];
    # SEGMENTED: segments int32 [num_q_blocks, 5], segment_z fp32 [num_q_blocks] (segments.py)
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
    SEGMENTED: tl.constexpr,
):  # fmt: skip
    """``oc``, the top-k lists and their counts for ``BLOCK_M`` query tiles of one (batch,
    head). ``SEGMENTED``: the program's row of ``SEGMENTS`` names its query tiles, the range
    of key tiles they choose from, and how many they keep (packed batches, key grids of their
    own, block-causal slabs, competing prefix tiles); ``num_tiles`` then counts query tiles. Per (query tile, key tile) pair it computes ``2 + P`` scores, ``P`` the selection
    passes of the program's slowest row; ``P`` is bounded for any fp32 scores, as the key-space
    pivots alone shrink the 2**32-wide bracket to one key in ``ceil(32 / log2(NUM_PIVOTS / 2 +
    1))`` passes (14 for 8 pivots). The scratch is ``B*H*Nt*BRACKET_CAPACITY`` int32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)

    if SEGMENTED:
        segment = SEGMENTS + pid_m * 5
        first_q = tl.load(segment).to(tl.int64)
        q_stop = tl.load(segment + 1)
        first_key = tl.load(segment + 2)
        num_keys = tl.load(segment + 3)
        keep = tl.load(segment + 4)
        z = tl.load(SEGMENT_Z + pid_m)
        key_offset = first_key.to(tl.int64)
    else:
        first_q = pid_m.to(tl.int64) * BLOCK_M
        q_stop = num_tiles
        first_key = 0
        num_keys = num_tiles
        keep = topk
        z = quantile_z
        key_offset = 0
    offs_m = first_q + tl.arange(0, BLOCK_M)  # [BM] query tiles
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    row_real = offs_m < q_stop
    qc_base = QC + b * stride_qb + h * stride_qh
    qc = _load_tile_rows(qc_base, offs_m, row_real, offs_d, stride_qn, stride_qd)  # [BM, D]
    k_base = KC + b * stride_kb + h * stride_kh + key_offset * stride_kn
    v_base = VC + b * stride_vb + h * stride_vh + key_offset * stride_vn

    # Pass 0: oc = softmax(qc kc^T * scale) vc, and each row's score statistics.
    oc, dot_min, dot_max, dot_sum, dot_sq_sum = _coarse_softmax_pass(
        qc, k_base, v_base, num_keys, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
        BLOCK_M, BLOCK_N, HEAD_DIM, INPUT_PRECISION,
    )  # fmt: skip
    oc_ptrs = OC + b * stride_ob + h * stride_oh
    oc_ptrs += offs_m[:, None] * stride_on + offs_d[None, :] * stride_od  # [BM, D]
    tl.store(oc_ptrs, oc.to(OC.dtype.element_ty), mask=row_real[:, None])

    # Selection passes: bracket the topk-th largest score of each row.
    scratch_rows = SCRATCH + (pid_bh.to(tl.int64) * num_tiles + offs_m) * BRACKET_CAPACITY
    lo, hi, count_hi, passes = _bracket_topk(
        qc, k_base, scratch_rows, row_real, dot_min, dot_max, dot_sum, dot_sq_sum,
        num_keys, keep, scale, z, stride_kn, stride_kd,
        BLOCK_M, BLOCK_N, HEAD_DIM, NUM_PIVOTS, BRACKET_CAPACITY, INPUT_PRECISION,
        PACKED_COUNTS, SPECULATE,
    )  # fmt: skip

    # Write pass: the top-k lists, ascending.
    idx_rows = KV_IDX + b * stride_ib + h * stride_ih + offs_m * stride_in  # [BM] pointers
    counts = _write_selection(
        qc, k_base, idx_rows, lo, hi, count_hi, row_real, num_keys, keep, scale,
        stride_kn, stride_kd, stride_ik, first_key, BLOCK_M, BLOCK_N, HEAD_DIM, INPUT_PRECISION,
    )  # fmt: skip
    cnt_ptrs = KV_CNT + b * stride_cb + h * stride_ch + offs_m * stride_cn
    tl.store(cnt_ptrs, counts, mask=row_real)
    if RECORD_PASSES:
        tl.store(PASSES + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m, passes)
