"""Backward kernels of block-sparse flash attention (launcher: ``../bwd.py``).

FlashAttention-2's recomputation from the forward's log-sum-exp, without atomics (gradients
are bit-identical across runs): a preprocess pass (``delta``, base-2 lse), then dK/dV (one
program per key block over the *transposed* lists) and dQ (one program per query sub-block
over its own list), as two kernels or one fused launch whose dK/dV programs come first and
whose dQ programs fill the SMs the dK/dV programs' last partial wave leaves idle. Every
program runs the same ``_dkdv_program`` / ``_dq_program`` in either launch, so both give
the same bits. The softmax scale stays an fp32 multiplier on fp32 scores: K is never
pre-scaled in low precision. The declared epilogue's backward hooks run in the preprocess
(``PROLOGUE``) and on the finished gradients (``DQ_EPILOGUE``, ``DKDV_EPILOGUE``).

Memory safety as in the forward: on the caller's own lists (``CHECK_LISTS``) dQ clamps counts
to ``K`` and gives an entry out of ``[0, NK)`` no weight (it reads block 0); lists reordered
full blocks first are valid by construction; the transposed lists of dK/dV leave such entries
out (``masks.block_sparse.transpose_block_lists``).

Pointer loads carry each gradient kernel's eviction hints from its config: ``EVICT_STREAMED``
on the tiles its loop streams (dK/dV: Q and dO; dQ: K and V), ``EVICT_RESIDENT`` on those a
program keeps (dK/dV: its K and V; dQ: its Q and dO); "" for none. TMA loads take none, as
Triton's tensor-descriptor ``load`` has no eviction argument.
"""

import triton
import triton.language as tl

from vidsparse.ops.block_sparse_attn.kernels.common import load_rows, store_mapped_rows, walk_ends
from vidsparse.ops.block_sparse_attn.kernels.fwd import key_block_in_range
from vidsparse.ops.block_sparse_attn.kernels.lists import QUERY_GROUPS
from vidsparse.utils.device import triton_version

# From Triton 3.7, LLVM zeroes a pipelined TMA walk's accumulators on the path that skips the
# loop, after the loop; ptxas takes that for a write into the in-flight wgmmas' accumulators
# and serialises every wgmma of the kernel on sm_90 (C7515). There ``_dkdv_rows`` skips an
# empty main walk by a branch of its own, in TMA builds only (in pointer builds the branch
# adds spills and nothing is serialised) and not before the query walks (nor there). Triton
# 3.6 needs none: its builds stay as timed.
GUARD_EMPTY_WALK = tl.constexpr((triton_version() or (0, 0)) >= (3, 7))


@triton.jit
def block_sparse_attn_bwd_preprocess_kernel(
    O, DO, LSE, DELTA, LSE2,  # o, do [B, H, Sq, D]; lse, delta, lse2 fp32 [B, H, Sq]
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    PROLOGUE: tl.constexpr, prologue_args,  # the epilogue's backward, see below
    H, Sq,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    IN_ROWS=None, DO_T=None,  # IN_MAPPED: int32 [Sq] o's row per query row; do's tile copy
    IN_MAPPED: tl.constexpr = False,
    # DQ_FIXED: fp32 [B, H, Sq] out; fp32 [B*H, 2] (block_sparse_attn_bwd_kv_bounds_kernel's
    # max |k| and max row norm of v); the softmax scale
    DQ_FIX=None, KV_BOUNDS=None, scale=1.0,
    DQ_FIXED: tl.constexpr = False,
):  # fmt: skip
    """``delta = rowsum(o * do)`` and the base-2 lse, with ``-inf`` (rows that attended to
    nothing) turned into ``+inf`` so that their probabilities recompute to 0.

    ``PROLOGUE`` undoes the forward's epilogue: from the stored output it recovers the
    engine's own ``o`` (and may zero ``do`` or set ``lse2 = +inf`` on rows that carry no
    gradient), and it may form the epilogue's own gradients from this one read of ``do``.

    ``IN_MAPPED``: o and do are in the caller's row order (the forward stored o there,
    ``GradTargets.output``): query row r's are read at row ``IN_ROWS[r]`` (-1: zeros), and do
    is written in the engine's order to ``DO_T`` (contiguous ``[B, H, Sq, D]``, do's dtype)
    for the gradient kernels, which read it by TMA.

    ``DQ_FIXED``: each row's fixed-point multiplier for the one-pass backward's dQ
    (``dq_fixed_point_multiplier``) into ``DQ_FIX``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_d = tl.arange(0, HEAD_DIM)
    if IN_MAPPED:
        src = tl.load(IN_ROWS + offs_m)  # [BM]
        real = (src >= 0)[:, None]
        src = tl.maximum(src, 0).to(tl.int64)
        o = tl.load(O + b * stride_ob + h * stride_oh + src[:, None] * stride_os + offs_d[None, :] * stride_od,
                    mask=real, other=0.0)  # fmt: skip
        do = tl.load(DO + b * stride_dob + h * stride_doh + src[:, None] * stride_dos + offs_d[None, :] * stride_dod,
                     mask=real, other=0.0)  # fmt: skip
        tl.store(DO_T + (pid_bh.to(tl.int64) * Sq + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], do)
        o = o.to(tl.float32)  # [BM, D]
        do = do.to(tl.float32)  # [BM, D]
    else:
        o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od)
        o = o.to(tl.float32)  # [BM, D]
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod)
        do = do.to(tl.float32)  # [BM, D]
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse = tl.load(LSE + row)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    o, do, lse2 = PROLOGUE(o, do, lse2, b, h, pid_m, offs_m, tl.arange(0, BLOCK_M), offs_d,
                           *prologue_args)  # fmt: skip
    delta = tl.sum(o * do, axis=1)  # [BM]
    tl.store(DELTA + row, delta)
    tl.store(LSE2 + row, lse2)
    if DQ_FIXED:
        k_abs, v_norm = tl.load(KV_BOUNDS + 2 * pid_bh), tl.load(KV_BOUNDS + 2 * pid_bh + 1)
        bound = dq_row_bound(do, delta, k_abs, v_norm, scale)
        tl.store(DQ_FIX + row, dq_fixed_point_multiplier(bound))


@triton.jit
def block_sparse_attn_bwd_kv_bounds_kernel(
    K, V, KV_SIZES, BOUNDS,  # k, v [B, H, Skv, D]; int32 [NK] (HAS_KV_SIZES); fp32 [B*H, 2]
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    H,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_KV_SIZES: tl.constexpr,
):  # fmt: skip
    """Grid ``(NK, B * H)``: ``BOUNDS[b*H + h] = (max |k|, max_j |v_j|)`` over the key rows
    (the padding rows that ``KV_SIZES`` masks left out: their content is any finite value),
    by atomic maxima into a zeroed buffer (order-free: the same bits on every run). A NaN or
    infinity in a block makes its bounds infinite, so that the rows' multipliers are NaN and
    dq says so."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    real = tl.full([BLOCK_N], 1, tl.int1)
    if HAS_KV_SIZES:
        real = tl.arange(0, BLOCK_N) < tl.load(KV_SIZES + pid_n)
    k, v = _key_block(K, V, b, h, pid_n, real, tl.arange(0, HEAD_DIM),
                      stride_kb, stride_kh, stride_ks, stride_kd,
                      stride_vb, stride_vh, stride_vs, stride_vd,
                      BLOCK_N, BLOCK_N, HEAD_DIM, HAS_KV_SIZES, False, "")  # fmt: skip
    k, v = k.to(tl.float32), v.to(tl.float32)
    k_abs = tl.max(tl.max(tl.abs(k), axis=1), axis=0)
    v_norm = tl.max(tl.sqrt(tl.sum(v * v, axis=1)), axis=0)
    finite = tl.sum(tl.sum(k * 0.0, axis=1) + tl.sum(v * 0.0, axis=1), axis=0) == 0.0
    tl.atomic_max(BOUNDS + 2 * pid_bh, tl.where(finite, k_abs, float("inf")))
    tl.atomic_max(BOUNDS + 2 * pid_bh + 1, tl.where(finite, v_norm, float("inf")))


@triton.jit
def dq_row_bound(do, delta, k_abs, v_norm, scale):
    """A bound on ``|scale * sum_j dS[i, j] K[j, d]|`` over any subset of the keys, each d,
    for the rows of ``do`` (fp32 [BM, D]): ``dS = P (dP - delta)`` with ``sum_j P <= 1``,
    ``|dP| <= |do| * max_j |v_j|`` and ``|K| <= k_abs``."""
    do_norm = tl.sqrt(tl.sum(do * do, axis=1))
    return scale * (do_norm * v_norm + tl.abs(delta)) * k_abs


@triton.jit
def dq_fixed_point_multiplier(bound):
    """``2**e`` with ``2**28 <= bound * 2**e < 2**29`` (``e <= 126``; NaN where the bound is
    not finite): a row's partial sums of dQ times it stay under ``2**30`` with the rounding of
    every term and the bound's own, so int32 holds their sum with room to spare. From the
    float's exponent bits: exact, and the same on every backend."""
    biased = (bound.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(155 - biased, 126)
    multiplier = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(biased == 255, float("nan"), multiplier)


@triton.jit
def block_sparse_attn_bwd_dq_from_fixed_kernel(
    ACC, FIX, DQ,  # int32 [R, D] sums, fp32 [R] multipliers, dq [R, D] out (R = B*H*Sq)
    ROWS,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """``dq = acc / multiplier`` row by row in dq's dtype: a power-of-two division (exact; NaN
    rows stay NaN), the one-pass backward's fixed-point dQ made a gradient."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    inside = rows < ROWS
    offsets = rows[:, None] * HEAD_DIM + cols[None, :]
    acc = tl.load(ACC + offsets, mask=inside[:, None], other=0)
    fix = tl.load(FIX + rows, mask=inside, other=1.0)
    # 1 / 2**e by the exponent bits (2**-e is normal for e <= 126)
    inverse = ((254 << 23) - fix.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    inverse = tl.where(fix == fix, inverse, float("nan"))
    dq = acc.to(tl.float32) * inverse[:, None]
    tl.store(DQ + offsets, dq.to(DQ.dtype.element_ty), mask=inside[:, None])


@triton.jit
def _key_block(K, V, b, h, block, real, offs_d,
               stride_kb, stride_kh, stride_ks, stride_kd,
               stride_vb, stride_vh, stride_vs, stride_vd,
               BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               HAS_KV_SIZES: tl.constexpr, USE_TMA: tl.constexpr,
               EVICT: tl.constexpr):  # fmt: skip
    """The first ``ROWS`` K and V rows of key block ``block``, ``[ROWS, D]`` each: by TMA when
    K and V are descriptors (of ``ROWS``-row boxes; padding rows read too: the caller vouched
    them finite; no eviction hint, a descriptor load takes none), else by pointers with
    eviction hint ``EVICT`` and padding rows (``real`` False) never read."""
    if USE_TMA:
        row0 = (block * BLOCK_N).to(tl.int32)
        k = K.load([b.to(tl.int32), h.to(tl.int32), row0, 0]).reshape(ROWS, HEAD_DIM)
        v = V.load([b.to(tl.int32), h.to(tl.int32), row0, 0]).reshape(ROWS, HEAD_DIM)
    else:
        rows = block.to(tl.int64) * BLOCK_N + tl.arange(0, ROWS)  # [ROWS]
        k_ptrs = K + b * stride_kb + h * stride_kh + rows[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_ptrs = V + b * stride_vb + h * stride_vh + rows[:, None] * stride_vs + offs_d[None, :] * stride_vd
        k = load_rows(k_ptrs, real, HAS_KV_SIZES, EVICT)
        v = load_rows(v_ptrs, real, HAS_KV_SIZES, EVICT)
    return k, v


@triton.jit
def _dkdv_walk(
    k, v, dk, dv, real, Q, DO, LSE2, DELTA, idx_row, lo, hi, pid_bh, b, h, row_base, offs_d,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    H, qk_scale,
    BLOCK_M: tl.constexpr, STEP: tl.constexpr, NSUB: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    EVICT_STREAMED: tl.constexpr, PIPELINED: tl.constexpr,
):  # fmt: skip
    """``dk, dv`` plus the terms of the transposed list's entries ``[lo, hi)``: the first
    ``NSUB * STEP`` rows of each listed query block, ``STEP`` rows a step (one flat loop over
    (query block, step) pairs pipelines better than two). With USE_TMA, Q and DO are
    descriptors of ``STEP``-row boxes. ``PIPELINED`` False: the loop's loads are not
    software-pipelined (one stage), for a walk that follows a pipelined one: two pipelined
    wgmma loops in a row make ptxas serialise every wgmma of the kernel on sm_90 (C7515)."""
    offs_sub = tl.arange(0, STEP)
    if not USE_TMA:
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
    for t in tl.range(lo * NSUB, hi * NSUB, num_stages=None if PIPELINED else 1):
        q_block = tl.load(idx_row + t // NSUB)
        row0 = q_block * BLOCK_M + (t % NSUB) * STEP
        offs_m = row0.to(tl.int64) + offs_sub  # [STEP]
        if USE_TMA:  # (a descriptor load takes no eviction hint)
            q = Q.load([pid_bh // H, pid_bh % H, row0, 0]).reshape(STEP, HEAD_DIM)  # [STEP, D]
            do = DO.load([pid_bh // H, pid_bh % H, row0, 0]).reshape(STEP, HEAD_DIM)
        else:
            q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                        eviction_policy=EVICT_STREAMED)  # fmt: skip
            do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod,
                         eviction_policy=EVICT_STREAMED)  # fmt: skip
        lse2 = tl.load(LSE2 + row_base + offs_m)  # [STEP]
        delta = tl.load(DELTA + row_base + offs_m)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [ROWS, STEP]
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if HAS_KV_SIZES:
            p_t = tl.where(real[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # [ROWS, D]
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [ROWS, STEP]
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # [ROWS, D]
    return dk, dv


@triton.jit
def _dkdv_rows(
    pid_n, pid_bh, Q, K, V, DO, DK, DV, LSE2, DELTA, Q1, DO1, Q2, DO2, Q_OFF, Q_IDX, KV_SIZES,
    KV_ROWS,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_offb, stride_offh, stride_qib, stride_qih,
    DKDV_EPILOGUE: tl.constexpr, epilogue_args,
    H, Sq, qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SUB_M: tl.constexpr,
    QTAIL1: tl.constexpr, QTAIL2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_KV_SIZES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, EVICT_STREAMED: tl.constexpr, EVICT_RESIDENT: tl.constexpr,
    GRAD_ROWS: tl.constexpr,
):  # fmt: skip
    """dK and dV of the first ``ROWS`` rows of key block ``pid_n`` (its real keys among them),
    zeros for the rest of the block (padding rows get no gradient); with ``GRAD_ROWS`` the real
    keys' rows only, each at the row ``KV_ROWS`` gives it. With short query walks
    (``QTAIL1`` > 0) the transposed list holds each key block's query blocks in three groups
    (``lists.query_groups``); a full-row program (``ROWS == BLOCK_N``) walks them with all
    rows (pipelined), the first ``QTAIL1`` and the first ``QTAIL2`` (unpipelined), a short key
    program all three with all rows: its own short walks would add two more loops, whose
    registers spill on sm_90."""
    NSUB: tl.constexpr = BLOCK_M // SUB_M
    WALK_QUERY_TAILS: tl.constexpr = QTAIL1 > 0 and ROWS == BLOCK_N
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)

    offs_r = tl.arange(0, ROWS)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + offs_r  # [ROWS]
    offs_d = tl.arange(0, HEAD_DIM)
    real = offs_r < ROWS  # [ROWS]
    if HAS_KV_SIZES:
        real = offs_r < tl.load(KV_SIZES + pid_n)
    # [ROWS, D] each
    k, v = _key_block(K, V, b, h, pid_n, real, offs_d,
                      stride_kb, stride_kh, stride_ks, stride_kd,
                      stride_vb, stride_vh, stride_vs, stride_vd,
                      BLOCK_N, ROWS, HEAD_DIM, HAS_KV_SIZES, USE_TMA, EVICT_RESIDENT)  # fmt: skip

    row_base = pid_bh.to(tl.int64) * Sq
    off_row = Q_OFF + b * stride_offb + h * stride_offh
    idx_row = Q_IDX + b * stride_qib + h * stride_qih
    if QTAIL1 > 0:  # QUERY_GROUPS a key block: all rows, QTAIL1 rows, QTAIL2 rows
        column = off_row + pid_n * QUERY_GROUPS
        start, end = tl.load(column), tl.load(column + QUERY_GROUPS)
    else:
        start, end = tl.load(off_row + pid_n), tl.load(off_row + pid_n + 1)
    end0, end1 = end, end
    if WALK_QUERY_TAILS:
        end0, end1 = tl.load(column + 1), tl.load(column + 2)

    dk = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    q_strides = (stride_qb, stride_qh, stride_qs, stride_qd,
                 stride_dob, stride_doh, stride_dos, stride_dod)  # fmt: skip
    walk = start < end0 if GUARD_EMPTY_WALK and USE_TMA and not WALK_QUERY_TAILS else True
    if walk:
        dk, dv = _dkdv_walk(k, v, dk, dv, real, Q, DO, LSE2, DELTA, idx_row, start, end0,
                            pid_bh, b, h, row_base, offs_d, *q_strides, H, qk_scale,
                            BLOCK_M, SUB_M, NSUB, HEAD_DIM, HAS_KV_SIZES, DOT_PRECISION, USE_TMA,
                            EVICT_STREAMED, True)  # fmt: skip
    if WALK_QUERY_TAILS:
        dk, dv = _dkdv_walk(k, v, dk, dv, real, Q1, DO1, LSE2, DELTA, idx_row, end0, end1,
                            pid_bh, b, h, row_base, offs_d, *q_strides, H, qk_scale,
                            BLOCK_M, QTAIL1, 1, HEAD_DIM, HAS_KV_SIZES, DOT_PRECISION, USE_TMA,
                            EVICT_STREAMED, False)  # fmt: skip
        if QTAIL2 > 0:  # (without it the last group is empty: lists.query_groups)
            dk, dv = _dkdv_walk(k, v, dk, dv, real, Q2, DO2, LSE2, DELTA, idx_row, end1, end,
                                pid_bh, b, h, row_base, offs_d, *q_strides, H, qk_scale,
                                BLOCK_M, QTAIL2, 1, HEAD_DIM, HAS_KV_SIZES, DOT_PRECISION,
                                USE_TMA, EVICT_STREAMED, False)  # fmt: skip
    dk = dk * scale
    dk, dv = DKDV_EPILOGUE(dk, dv, b, h, pid_n, offs_d, *epilogue_args)

    if GRAD_ROWS:  # the real keys' rows only, where the map sends them
        store_mapped_rows(DK, b, h, offs_n, offs_d, stride_dkb, stride_dkh, stride_dks,
                          stride_dkd, dk, real, KV_ROWS)  # fmt: skip
        store_mapped_rows(DV, b, h, offs_n, offs_d, stride_dvb, stride_dvh, stride_dvs,
                          stride_dvd, dv, real, KV_ROWS)  # fmt: skip
    else:
        dk_ptrs = DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd
        dv_ptrs = DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty))
        for part in tl.static_range(1, BLOCK_N // ROWS):  # the block's rows past ROWS: padding
            tl.store(dk_ptrs + part * ROWS * stride_dks, tl.zeros_like(dk).to(DK.dtype.element_ty))
            tl.store(dv_ptrs + part * ROWS * stride_dvs, tl.zeros_like(dv).to(DV.dtype.element_ty))


@triton.jit
def _dkdv_program(
    pid_n, pid_bh,  # key block, batch * H + head
    Q, K, V, DO, DK, DV, LSE2, DELTA,
    K1, V1, K2, V2,  # K, V for the TAIL1- and TAIL2-row programs (TMA: their own boxes)
    Q1, DO1, Q2, DO2,  # Q, DO for the QTAIL1- and QTAIL2-row query walks (TMA: their own boxes)
    Q_OFF, Q_IDX, KV_SIZES,  # int32 [Bi, H, NK * (3 if QTAIL1 else 1) + 1], [Bi, H, NQ * K], [NK]
    KV_ROWS,  # GRAD_ROWS: int32 [Skv], the row of dK, dV each key row's gradient goes to (-1: none)
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_offb, stride_offh, stride_qib, stride_qih,
    DQ_EPILOGUE: tl.constexpr, DKDV_EPILOGUE: tl.constexpr, epilogue_args,  # on the gradients
    H, Sq, NQ,
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL1: tl.constexpr, TAIL2: tl.constexpr,  # rows of the short programs (0: none)
    QTAIL1: tl.constexpr, QTAIL2: tl.constexpr,  # rows of the short query walks (0: none)
    HAS_KV_SIZES: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    EVICT_STREAMED: tl.constexpr, EVICT_RESIDENT: tl.constexpr,  # Q, dO and K, V loads' hints
    GRAD_ROWS: tl.constexpr,  # dK, dV stored at the rows KV_ROWS gives (the caller's order)
):  # fmt: skip
    """dK and dV of key block ``pid_n`` of ``(batch, head) = divmod(pid_bh, H)``: the body of
    ``block_sparse_attn_bwd_dkdv_kernel``, a function so that the fused kernel runs the same
    arithmetic. A partial block that fits in ``TAIL2`` or ``TAIL1`` rows runs with that many
    (``lists.size_group``'s rule). With USE_TMA, Q and DO (blocks [1, 1, SUB_M, D]) and K and V
    (blocks of the program's rows) are tensor descriptors read by TMA; padding keys are then
    read too, so the caller vouches that they are finite (their probabilities are zeroed, and
    0 x finite keeps dS finite). ``DKDV_EPILOGUE`` sees the finished (scaled) dK, dV of the
    program's rows before their store."""
    query_walks = (Q1, DO1, Q2, DO2)
    group = 0  # 0: all BLOCK_N rows; 1: TAIL1 rows; 2: TAIL2 rows
    if HAS_KV_SIZES:
        size = tl.load(KV_SIZES + pid_n)
        if TAIL1 > 0:
            group = tl.where((size < BLOCK_N) & (size <= TAIL1), 1, group)
        if TAIL2 > 0:
            group = tl.where((size < BLOCK_N) & (size <= TAIL2), 2, group)
    strides = (stride_qb, stride_qh, stride_qs, stride_qd,
               stride_kb, stride_kh, stride_ks, stride_kd,
               stride_vb, stride_vh, stride_vs, stride_vd,
               stride_dob, stride_doh, stride_dos, stride_dod,
               stride_dkb, stride_dkh, stride_dks, stride_dkd,
               stride_dvb, stride_dvh, stride_dvs, stride_dvd,
               stride_offb, stride_offh, stride_qib, stride_qih)  # fmt: skip
    # One if/elif chain (three separate ifs spilled on sm_90), each short walk behind its
    # constexpr test, so a walk of 0 rows is never compiled.
    if group == 0:
        _dkdv_rows(pid_n, pid_bh, Q, K, V, DO, DK, DV, LSE2, DELTA, *query_walks,
                   Q_OFF, Q_IDX, KV_SIZES, KV_ROWS, *strides, DKDV_EPILOGUE, epilogue_args,
                   H, Sq, qk_scale, scale, BLOCK_M, BLOCK_N, BLOCK_N, SUB_M, QTAIL1, QTAIL2,
                   HEAD_DIM, HAS_KV_SIZES, DOT_PRECISION, USE_TMA,
                   EVICT_STREAMED, EVICT_RESIDENT, GRAD_ROWS)  # fmt: skip
    elif TAIL2 > 0:
        if group == 2:
            _dkdv_rows(pid_n, pid_bh, Q, K2, V2, DO, DK, DV, LSE2, DELTA, *query_walks,
                       Q_OFF, Q_IDX, KV_SIZES, KV_ROWS, *strides, DKDV_EPILOGUE, epilogue_args,
                       H, Sq, qk_scale, scale, BLOCK_M, BLOCK_N, TAIL2, SUB_M, QTAIL1, QTAIL2,
                       HEAD_DIM, HAS_KV_SIZES, DOT_PRECISION, USE_TMA,
                       EVICT_STREAMED, EVICT_RESIDENT, GRAD_ROWS)  # fmt: skip
        else:
            _dkdv_rows(pid_n, pid_bh, Q, K1, V1, DO, DK, DV, LSE2, DELTA, *query_walks,
                       Q_OFF, Q_IDX, KV_SIZES, KV_ROWS, *strides, DKDV_EPILOGUE, epilogue_args,
                       H, Sq, qk_scale, scale, BLOCK_M, BLOCK_N, TAIL1, SUB_M, QTAIL1, QTAIL2,
                       HEAD_DIM, HAS_KV_SIZES, DOT_PRECISION, USE_TMA,
                       EVICT_STREAMED, EVICT_RESIDENT, GRAD_ROWS)  # fmt: skip
    elif TAIL1 > 0:
        _dkdv_rows(pid_n, pid_bh, Q, K1, V1, DO, DK, DV, LSE2, DELTA, *query_walks,
                   Q_OFF, Q_IDX, KV_SIZES, KV_ROWS, *strides, DKDV_EPILOGUE, epilogue_args,
                   H, Sq, qk_scale, scale, BLOCK_M, BLOCK_N, TAIL1, SUB_M, QTAIL1, QTAIL2,
                   HEAD_DIM, HAS_KV_SIZES, DOT_PRECISION, USE_TMA,
                   EVICT_STREAMED, EVICT_RESIDENT, GRAD_ROWS)  # fmt: skip


@triton.jit
def block_sparse_attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE2, DELTA,
    K1, V1, K2, V2, Q1, DO1, Q2, DO2,  # as in _dkdv_program
    Q_OFF, Q_IDX, KV_SIZES, KV_ROWS,  # as in _dkdv_program
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_offb, stride_offh, stride_qib, stride_qih,
    DQ_EPILOGUE: tl.constexpr, DKDV_EPILOGUE: tl.constexpr, epilogue_args,  # on the gradients
    H, Sq, NQ,
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL1: tl.constexpr, TAIL2: tl.constexpr, QTAIL1: tl.constexpr, QTAIL2: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    EVICT_STREAMED: tl.constexpr, EVICT_RESIDENT: tl.constexpr,  # Q, dO and K, V loads' hints
    GRAD_ROWS: tl.constexpr,
):  # fmt: skip
    """Grid ``(NK, B * H)``: one ``_dkdv_program`` per key block."""
    _dkdv_program(
        tl.program_id(0), tl.program_id(1),
        Q, K, V, DO, DK, DV, LSE2, DELTA, K1, V1, K2, V2, Q1, DO1, Q2, DO2, Q_OFF, Q_IDX, KV_SIZES,
        KV_ROWS,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_dob, stride_doh, stride_dos, stride_dod,
        stride_dkb, stride_dkh, stride_dks, stride_dkd,
        stride_dvb, stride_dvh, stride_dvs, stride_dvd,
        stride_offb, stride_offh, stride_qib, stride_qih,
        DQ_EPILOGUE, DKDV_EPILOGUE, epilogue_args,
        H, Sq, NQ, qk_scale, scale,
        BLOCK_M, BLOCK_N, SUB_M, HEAD_DIM, TAIL1, TAIL2, QTAIL1, QTAIL2, HAS_KV_SIZES,
        DOT_PRECISION, USE_TMA, EVICT_STREAMED, EVICT_RESIDENT, GRAD_ROWS,
    )  # fmt: skip


@triton.jit
def _dq_walk(q, do, lse2, delta, dq, K, V, KV_SIZES, idx_row, stride_ik, lo, hi, NK, b, h,
             offs_d, stride_kb, stride_kh, stride_ks, stride_kd,
             stride_vb, stride_vh, stride_vs, stride_vd, qk_scale,
             BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
             MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
             CHECK: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """dQ over list entries ``[lo, hi)``, each block's first ``ROWS`` keys (the walk's blocks
    hold no more real ones; TMA: ``K``, ``V`` have ``ROWS``-row boxes); ``MASKED``: the blocks
    may end in padding keys; ``CHECK``: entries may be out of range; ``EVICT``: the K, V
    loads' eviction hint."""
    offs_n = tl.arange(0, ROWS)
    for j in range(lo, hi):
        kv_block = tl.load(idx_row + j * stride_ik)
        ok = True
        if CHECK:
            kv_block, ok = key_block_in_range(kv_block, NK)
        real = offs_n < ROWS  # [ROWS]
        if MASKED:
            if CHECK:
                real = offs_n < tl.where(ok, tl.load(KV_SIZES + kv_block), 0)
            else:
                real = offs_n < tl.load(KV_SIZES + kv_block)
        # [ROWS, D] each
        k, v = _key_block(K, V, b, h, kv_block, real, offs_d,
                          stride_kb, stride_kh, stride_ks, stride_kd,
                          stride_vb, stride_vh, stride_vs, stride_vd,
                          BLOCK_N, ROWS, HEAD_DIM, MASKED, USE_TMA, EVICT)  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [SUB_M, ROWS]
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [SUB_M, ROWS]
        if CHECK and not MASKED:  # an entry out of range: subtract +inf, p = 0 (per row)
            p = tl.math.exp2(qk * qk_scale - tl.where(ok, lse2, float("inf"))[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(real[None, :], p, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # [SUB_M, D]
    return dq


@triton.jit
def _dq_program(
    pid, pid_bh,  # query sub-block (of SUB_M rows), batch * H + head
    Q, K, V, DO, DQ, LSE2, DELTA,
    K1, V1, K2, V2,  # K, V for the TAIL1- and TAIL2-row walks (TMA: their own boxes)
    KV_IDX, KV_CNT, KV_SIZES,
    KV_ENDS, stride_eb, stride_eh, stride_eq,  # HAS_KV_SIZES: int32 [Bi, H, NQ, 3], the walks' ends
    Q_ROWS,  # GRAD_ROWS: int32 [Sq], the row of dQ each query row's gradient goes to (-1: none)
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    DQ_EPILOGUE: tl.constexpr, DKDV_EPILOGUE: tl.constexpr, epilogue_args,  # on the gradients
    H, Sq, NK, K_WIDTH,  # key blocks and list width: bounds of every entry and count
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL1: tl.constexpr, TAIL2: tl.constexpr,  # rows of the short walks (0: none)
    HAS_KV_SIZES: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    CHECK_LISTS: tl.constexpr,  # the caller's own lists: clamp counts, check every entry
    EVICT_STREAMED: tl.constexpr, EVICT_RESIDENT: tl.constexpr,  # K, V and Q, dO loads' hints
    GRAD_ROWS: tl.constexpr,  # dQ stored at the rows Q_ROWS gives (the caller's order)
):  # fmt: skip
    """dQ of query rows ``[pid * SUB_M, (pid + 1) * SUB_M)`` of ``(batch, head) =
    divmod(pid_bh, H)``: the body of ``block_sparse_attn_bwd_dq_kernel``, a function so that
    the fused kernel runs the same arithmetic. With USE_TMA, K and V are tensor descriptors
    (blocks [1, 1, BLOCK_N, D]) read by TMA; padding keys are then read too, so the caller
    vouches that they are finite: their probabilities are zeroed, and 0 x finite keeps dS
    finite. ``DQ_EPILOGUE`` sees the finished (scaled) dQ before its store."""
    NSUB: tl.constexpr = BLOCK_M // SUB_M
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    q_block = (pid // NSUB).to(tl.int64)

    offs_m = pid.to(tl.int64) * SUB_M + tl.arange(0, SUB_M)  # [SUB_M]; sub-blocks tile the rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                eviction_policy=EVICT_RESIDENT)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod,
                 eviction_policy=EVICT_RESIDENT)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse2 = tl.load(LSE2 + row)  # [SUB_M]
    delta = tl.load(DELTA + row)

    idx_row = KV_IDX + b * stride_ib + h * stride_ih + q_block * stride_iq
    count = tl.load(KV_CNT + b * stride_cb + h * stride_ch + q_block * stride_cq)
    if CHECK_LISTS:
        count = tl.minimum(count, K_WIDTH)

    dq = tl.zeros([SUB_M, HEAD_DIM], dtype=tl.float32)
    # With key-block sizes the lists come by size (lists.blocks_by_size): the full blocks are
    # walked without the padding mask, the partial ones after them with it, with fewer rows
    # where they fit.
    end0, end1, end2 = walk_ends(KV_ENDS, b, h, q_block, stride_eb, stride_eh, stride_eq, count,
                                 HAS_KV_SIZES, TAIL1, TAIL2)  # fmt: skip
    rows = (q, do, lse2, delta)
    walk = (KV_SIZES, idx_row, stride_ik)
    strides = (stride_kb, stride_kh, stride_ks, stride_kd, stride_vb, stride_vh, stride_vs,
               stride_vd, qk_scale)  # fmt: skip
    dq = _dq_walk(*rows, dq, K, V, *walk, 0, end0, NK, b, h, offs_d, *strides,
                  BLOCK_N, BLOCK_N, HEAD_DIM, False, DOT_PRECISION, USE_TMA, CHECK_LISTS,
                  EVICT_STREAMED)  # fmt: skip
    if HAS_KV_SIZES:
        dq = _dq_walk(*rows, dq, K, V, *walk, end0, end1, NK, b, h, offs_d, *strides,
                      BLOCK_N, BLOCK_N, HEAD_DIM, True, DOT_PRECISION, USE_TMA, CHECK_LISTS,
                      EVICT_STREAMED)  # fmt: skip
        if TAIL1 > 0:
            dq = _dq_walk(*rows, dq, K1, V1, *walk, end1, end2, NK, b, h, offs_d, *strides,
                          BLOCK_N, TAIL1, HEAD_DIM, True, DOT_PRECISION, USE_TMA, CHECK_LISTS,
                          EVICT_STREAMED)  # fmt: skip
        if TAIL2 > 0:
            dq = _dq_walk(*rows, dq, K2, V2, *walk, end2, count, NK, b, h, offs_d, *strides,
                          BLOCK_N, TAIL2, HEAD_DIM, True, DOT_PRECISION, USE_TMA, CHECK_LISTS,
                          EVICT_STREAMED)  # fmt: skip
    dq = dq * scale
    dq = DQ_EPILOGUE(dq, b, h, q_block, (pid % NSUB) * SUB_M + tl.arange(0, SUB_M), offs_d,
                     *epilogue_args)  # fmt: skip
    if GRAD_ROWS:
        store_mapped_rows(DQ, b, h, offs_m, offs_d, stride_dqb, stride_dqh, stride_dqs,
                          stride_dqd, dq, offs_m >= 0, Q_ROWS)  # fmt: skip
    else:
        dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))


@triton.jit
def block_sparse_attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE2, DELTA,
    K1, V1, K2, V2,  # as in _dq_program
    KV_IDX, KV_CNT, KV_SIZES,
    KV_ENDS, stride_eb, stride_eh, stride_eq, Q_ROWS,  # as in _dq_program
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    DQ_EPILOGUE: tl.constexpr, DKDV_EPILOGUE: tl.constexpr, epilogue_args,  # on the gradients
    H, Sq, NK, K_WIDTH,  # as in _dq_program
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL1: tl.constexpr, TAIL2: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    CHECK_LISTS: tl.constexpr,
    EVICT_STREAMED: tl.constexpr, EVICT_RESIDENT: tl.constexpr,  # as in _dq_program
    GRAD_ROWS: tl.constexpr,
):  # fmt: skip
    """Grid ``(Sq // SUB_M, B * H)``: one ``_dq_program`` per query sub-block."""
    _dq_program(
        tl.program_id(0), tl.program_id(1),
        Q, K, V, DO, DQ, LSE2, DELTA, K1, V1, K2, V2, KV_IDX, KV_CNT, KV_SIZES,
        KV_ENDS, stride_eb, stride_eh, stride_eq, Q_ROWS,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_dob, stride_doh, stride_dos, stride_dod,
        stride_dqb, stride_dqh, stride_dqs, stride_dqd,
        stride_ib, stride_ih, stride_iq, stride_ik,
        stride_cb, stride_ch, stride_cq,
        DQ_EPILOGUE, DKDV_EPILOGUE, epilogue_args,
        H, Sq, NK, K_WIDTH, qk_scale, scale,
        BLOCK_M, BLOCK_N, SUB_M, HEAD_DIM, TAIL1, TAIL2, HAS_KV_SIZES, DOT_PRECISION, USE_TMA,
        CHECK_LISTS,
        EVICT_STREAMED, EVICT_RESIDENT, GRAD_ROWS,
    )  # fmt: skip


@triton.jit
def block_sparse_attn_bwd_fused_kernel(
    Q_DKDV, K_DKDV, V_DKDV, DO_DKDV,  # the dK/dV half's: descriptors with USE_TMA_DKDV
    Q_DQ, K_DQ, V_DQ, DO_DQ,  # the dQ half's: Q, DO tensors; K, V descriptors with USE_TMA_DQ
    K1_DKDV, V1_DKDV, K2_DKDV, V2_DKDV,  # each half's K, V for its short walks
    K1_DQ, V1_DQ, K2_DQ, V2_DQ,
    Q1, DO1, Q2, DO2,  # the dK/dV half's Q, DO for its short query walks
    DQ, DK, DV, LSE2, DELTA,
    Q_OFF, Q_IDX,  # int32: the transposed lists (as in _dkdv_program)
    KV_IDX, KV_CNT, KV_SIZES,  # [Bi, H, NQ, K], [Bi, H, NQ], int32 [NK]
    KV_ENDS, stride_eb, stride_eh, stride_eq,  # HAS_KV_SIZES: int32 [Bi, H, NQ, 3], the walks' ends
    Q_ROWS, KV_ROWS,  # GRAD_ROWS: as in _dq_program, _dkdv_program
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_offb, stride_offh, stride_qib, stride_qih,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    DQ_EPILOGUE: tl.constexpr, DKDV_EPILOGUE: tl.constexpr, epilogue_args,  # on the gradients
    H, Sq, NQ, NK, BH, K_WIDTH,  # K_WIDTH: the lists' width (bound of every count)
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL1: tl.constexpr, TAIL2: tl.constexpr, QTAIL1: tl.constexpr, QTAIL2: tl.constexpr,
    SUB_M_DKDV: tl.constexpr, SUB_M_DQ: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA_DKDV: tl.constexpr, USE_TMA_DQ: tl.constexpr,
    CHECK_LISTS: tl.constexpr,  # the dQ half reads the caller's own lists (see _dq_program)
    EVICT_STREAMED_DKDV: tl.constexpr, EVICT_RESIDENT_DKDV: tl.constexpr,  # each half's hints
    EVICT_STREAMED_DQ: tl.constexpr, EVICT_RESIDENT_DQ: tl.constexpr,
    GRAD_ROWS: tl.constexpr,
):  # fmt: skip
    """Both gradient kernels in one launch, grid ``(NK * B * H + Sq // SUB_M_DQ * B * H,)``.

    Each kernel alone runs many waves of whole-SM programs, and its last partial wave leaves
    most SMs idle (the dK/dV programs' transposed lists also differ in length). Here the dK/dV
    programs take the low ids, so they start first, and the dQ programs fill the SMs while the
    longest of them finish. Every program runs what it runs in its own kernel
    (``_dkdv_program`` / ``_dq_program``, with each half's step and loads), so the gradients
    are bit-identical to the two launches'. The halves read their inputs as their own kernels
    do: the dK/dV half Q, K, V, DO by TMA or pointers (USE_TMA_DKDV), the dQ half Q and DO by
    pointers and K, V by TMA or pointers (USE_TMA_DQ); hence two sets of input arguments."""
    pid = tl.program_id(0)
    num_dkdv = NK * BH
    if pid < num_dkdv:
        _dkdv_program(
            pid % NK, pid // NK,
            Q_DKDV, K_DKDV, V_DKDV, DO_DKDV, DK, DV, LSE2, DELTA,
            K1_DKDV, V1_DKDV, K2_DKDV, V2_DKDV, Q1, DO1, Q2, DO2, Q_OFF, Q_IDX, KV_SIZES, KV_ROWS,
            stride_qb, stride_qh, stride_qs, stride_qd,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_vb, stride_vh, stride_vs, stride_vd,
            stride_dob, stride_doh, stride_dos, stride_dod,
            stride_dkb, stride_dkh, stride_dks, stride_dkd,
            stride_dvb, stride_dvh, stride_dvs, stride_dvd,
            stride_offb, stride_offh, stride_qib, stride_qih,
            DQ_EPILOGUE, DKDV_EPILOGUE, epilogue_args,
            H, Sq, NQ, qk_scale, scale,
            BLOCK_M, BLOCK_N, SUB_M_DKDV, HEAD_DIM, TAIL1, TAIL2, QTAIL1, QTAIL2, HAS_KV_SIZES,
            DOT_PRECISION, USE_TMA_DKDV,
            EVICT_STREAMED_DKDV, EVICT_RESIDENT_DKDV, GRAD_ROWS,
        )  # fmt: skip
    else:
        num_sub = Sq // SUB_M_DQ  # dQ programs per (batch, head)
        pid_q = pid - num_dkdv
        _dq_program(
            pid_q % num_sub, pid_q // num_sub,
            Q_DQ, K_DQ, V_DQ, DO_DQ, DQ, LSE2, DELTA, K1_DQ, V1_DQ, K2_DQ, V2_DQ,
            KV_IDX, KV_CNT, KV_SIZES, KV_ENDS, stride_eb, stride_eh, stride_eq, Q_ROWS,
            stride_qb, stride_qh, stride_qs, stride_qd,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_vb, stride_vh, stride_vs, stride_vd,
            stride_dob, stride_doh, stride_dos, stride_dod,
            stride_dqb, stride_dqh, stride_dqs, stride_dqd,
            stride_ib, stride_ih, stride_iq, stride_ik,
            stride_cb, stride_ch, stride_cq,
            DQ_EPILOGUE, DKDV_EPILOGUE, epilogue_args,
            H, Sq, NK, K_WIDTH, qk_scale, scale,
            BLOCK_M, BLOCK_N, SUB_M_DQ, HEAD_DIM, TAIL1, TAIL2, HAS_KV_SIZES, DOT_PRECISION,
            USE_TMA_DQ, CHECK_LISTS,
            EVICT_STREAMED_DQ, EVICT_RESIDENT_DQ, GRAD_ROWS,
        )  # fmt: skip
