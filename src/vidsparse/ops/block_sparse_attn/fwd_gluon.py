"""The Hopper (sm_90) forward of block-sparse flash attention, written in Gluon.

Same semantics as ``fwd.block_sparse_attn_fwd`` at 128x128 blocks, D = 128, bf16 or fp16,
contiguous q, k, v; with ``kv_block_sizes`` (padding keys, vouched finite: they are read by
TMA and their scores masked) the lists come full blocks first (``lists.full_blocks_first``)
and each consumer walks the full blocks unmasked, then the partial ones masked. ``fwd.py``
takes this kernel where ``configs.py`` says so and the inputs fit (``gluon_fits``).

Why Gluon: the plain Triton kernel (``fwd._block_sparse_attn_fwd_tma_kernel``) runs its two
warpgroups in lockstep, so the softmax (MUFU exp2 + FP32 ALU) of one never overlaps the
tensor-core work of the other. Gluon lets us write the FlashAttention-3 schedule by hand:

- one **loader warp** (a ``gl.warp_specialize`` worker) walks the key-block list and issues
  TMA copies of K and V into a ``STAGES``-deep shared-memory ring; ``k_ready`` / ``v_ready``
  mbarriers say a slot landed, ``k_empty`` / ``v_empty`` say both consumers are done with it;
- two **consumer warpgroups** (the default partition and a 4-warp worker), each owning 64 of the
  block's 128 query rows, with their own online-softmax state (m, l, acc in registers);
- inside a consumer, **intra-warpgroup overlap**: block j's ``S = Q K_j^T`` is issued
  asynchronously together with block j-1's ``O += P_{j-1} V_{j-1}``; the softmax of block j
  is meant to run while the P V GEMM is still on the tensor cores. Two ways to feed P:
  ``P_IN_SMEM=False`` keeps P in registers (A operand from registers, as FA3); ptxas then
  hoists the P V wait above the softmax, so this overlap is lost (it also does not reserve the
  A registers of an in-flight wgmma, which forces the P conversion after that wait, see
  ``_loop_p_in_registers``). ``P_IN_SMEM=True`` stages P in shared memory (double-buffered)
  and keeps the overlap, at the cost of the stores, a fence and a barrier per block;
- between the consumers, **ping-pong** (``PINGPONG``): a pair of "turn" mbarriers makes the two
  warpgroups take turns issuing their GEMMs, so that one warpgroup's softmax runs while the
  other's GEMMs occupy the tensor cores (FA3 does this with named barriers; Gluon exposes
  mbarriers, which serve the same purpose here since the turn order only shapes the schedule
  and never guards data).

Online softmax in base 2: ``qk_scale = scale * log2(e)`` is folded into one FMA per score.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)

# Rows each consumer warpgroup owns: a wgmma tile is 64 rows per warpgroup (4 warps x 16 rows).
ROWS_PER_CONSUMER = gl.constexpr(64)


# ---------------------------------------------------------------------------------------------
# Loader partition: 1 warp, issues every TMA copy of the program.
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _loader(
    desc_q,
    desc_k,
    desc_v,
    q_smem,
    k_smem,
    v_smem,
    q_bar,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    idx_row,
    stride_ik,
    count,
    q_row,
    kv_row0,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Q once, then K_j and V_j of every listed block j into ring slot ``j % STAGES``.

    q_smem [2, 64, D] (one half per consumer); k_smem, v_smem [STAGES, BLOCK_N, D].
    ``q_row``: first global row of this query block in the [B*H*S, D] view; ``kv_row0``: first
    row of this (b, h)'s keys in that view."""
    # Both halves of Q land on one barrier: the consumers wait for it once.
    mbarrier.expect(q_bar, 2 * desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [q_row, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(desc_q, [q_row + ROWS_PER_CONSUMER, 0], q_bar, q_smem.index(1))

    for j in range(count):
        slot = j % STAGES
        # Use u = j // STAGES of this slot must wait for both consumers to release use u - 1,
        # i.e. for the completion of empty-barrier phase u - 1 (parity (u - 1) & 1). For u = 0
        # parity 1 refers to the phase "before" the first one and passes at once.
        empty_parity = ((j // STAGES) & 1) ^ 1
        kv_block = gl.load(idx_row + j * stride_ik)  # scalar int32 key-block index
        row = kv_row0 + kv_block * BLOCK_N  # first row of key block kv_block
        # K and V have separate barriers: the consumers release K as soon as Q K^T is done,
        # V only after P V, so the next K can stream in earlier.
        mbarrier.wait(k_empty.index(slot), empty_parity)
        mbarrier.expect(k_ready.index(slot), desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [row, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), empty_parity)
        mbarrier.expect(v_ready.index(slot), desc_v.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_v, [row, 0], v_ready.index(slot), v_smem.index(slot))


# ---------------------------------------------------------------------------------------------
# Consumer partitions: one warpgroup each, 64 query rows each.
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _turn_wait(turn_bars, ME: gl.constexpr, t, PINGPONG: gl.constexpr):
    """Wait until it is this warpgroup's turn ``t`` to issue GEMMs (ping-pong)."""
    if PINGPONG:
        mbarrier.wait(turn_bars.index(ME), t & 1)


@gluon.jit
def _turn_pass(turn_bars, ME: gl.constexpr, PINGPONG: gl.constexpr):
    """Hand the turn to the other warpgroup once this one's GEMMs are issued."""
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - ME))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, MASKED: gl.constexpr):
    """Online-softmax update for one score tile s [64, BN] (raw dots, fp32; -inf where masked).

    Returns (p [64, BN] fp32 = exp2(s * scale - m_new), m_new, l_new, alpha = exp2(m_old -
    m_new)). scale > 0, so max(s) * scale == max(s * scale) and the scale fuses into one FMA.
    ``MASKED``: a row may have seen only padding so far (max -inf): subtract 0 there, not -inf,
    so its p and alpha are 0 and never NaN."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # [64]
    m_sub = m_new
    if MASKED:
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))  # [64, BN]
    alpha = gl.exp2(m_i - m_sub)  # [64]; exp2(-inf) = 0 on the first block
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _padding_masked(s, limit, cols):
    """Scores of the keys at or past ``limit`` (a block's real keys) set to -inf; s [64, BN]."""
    return gl.where(gl.expand_dims(cols, 0) < limit, s, float("-inf"))


@gluon.jit
def _issue_qk(
    q,
    k_smem,
    k_ready,
    turn_bars,
    j,
    s_zero,
    ME: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """Wait for K_j, take the GEMM turn, issue S_j = Q K_j^T [64, BN] asynchronously."""
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    _turn_wait(turn_bars, ME, j, PINGPONG)
    return warpgroup_mma(
        q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
    )


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    """acc [64, D] *= alpha [64] (row factor, from the softmax's row layout)."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


@gluon.jit
def _walk(
    q,
    k_smem,
    v_smem,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    turn_bars,
    lo,
    hi,
    qk_scale,
    p_op,
    m_i,
    l_i,
    alpha,
    acc,
    s_zero,
    idx_row,
    stride_ik,
    KV_SIZES,
    cols,
    p_layout: gl.constexpr,
    o_layout: gl.constexpr,
    ME: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    MASKED: gl.constexpr,
):
    """Blocks ``lo..hi-1``, P fed to the P V wgmma from registers; enters with P_{lo-1} in
    ``p_op`` and leaves P_{hi-1} there (its P V still to issue). ``MASKED``: the blocks may end
    in padding keys (their real count: ``KV_SIZES[block]``).

    Iteration j: issue S_j and P_{j-1} V_{j-1}; wait for S_j; softmax of S_j; wait for
    P_{j-1} V_{j-1}; only then convert P_j into the A-operand registers. ptxas does not keep
    the A-operand registers of an in-flight wgmma reserved (converting P_j before that wait let
    ptxas put the exp2 results straight into registers the P V wgmma was still reading: NaNs
    without ping-pong; ``benchmarks/try_gluon_fwd.py --compile-only`` counts such writes).
    ptxas may also hoist the P V wait above the softmax, which loses the overlap inside the
    warpgroup; the ping-pong still overlaps one warpgroup's softmax with the other's GEMMs."""
    for j in range(lo, hi):
        prev = (j - 1) % STAGES
        s_tok = _issue_qk(q, k_smem, k_ready, turn_bars, j, s_zero, ME, STAGES, PINGPONG)
        acc = _rescale(acc, alpha, o_layout)  # to the max of block j-1, while S_j runs
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)  # acc += P V
        _turn_pass(turn_bars, ME, PINGPONG)
        if MASKED:  # scalar loads, issued while the GEMMs run
            limit = gl.load(KV_SIZES + gl.load(idx_row + j * stride_ik))
        # wgmma groups retire in order: with one outstanding, S_j (issued first) is done.
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(j % STAGES))
        if MASKED:
            s = _padding_masked(s, limit, cols)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, MASKED)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(prev))
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)  # P_j
    return p_op, m_i, l_i, alpha, acc


@gluon.jit
def _last_pv(
    p_op, v_smem, v_ready, v_empty, acc, alpha, count, o_layout: gl.constexpr, STAGES: gl.constexpr
):
    """The last block's P V."""
    last = (count - 1) % STAGES
    acc = _rescale(acc, alpha, o_layout)
    mbarrier.wait(v_ready.index(last), ((count - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
    mbarrier.arrive(v_empty.index(last))
    return acc


@gluon.jit
def _loop_p_in_smem(
    q,
    k_smem,
    v_smem,
    p_smem,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    turn_bars,
    count,
    qk_scale,
    p,
    m_i,
    l_i,
    alpha,
    acc,
    s_zero,
    o_layout: gl.constexpr,
    ME: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """Blocks 1..count-1 and the last P V, with P staged in shared memory (p_smem [2, 64, BN],
    double-buffered: P_j goes to buffer j % 2) and read by the wgmma from there.

    No register hazard, so the P V wait can sit at the top of the next iteration, where
    ptxas cannot hoist it above this iteration's softmax: the softmax of S_j really overlaps
    P_{j-1} V_{j-1}. The price: 16 KB of stmatrix stores per iteration, a fence and a
    warpgroup barrier, and the wgmma reads A from shared memory."""
    p_smem.index(0).store(p.to(p_smem.dtype))  # P_0
    fence_async_shared()  # generic-proxy stores -> visible to the wgmma (async proxy)
    o_tok = warpgroup_mma_init(acc)
    for j in range(1, count):
        prev = (j - 1) % STAGES
        # P_{j-2} V_{j-2} done: its V slot and its P buffer (the one P_j goes to) are free.
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        mbarrier.arrive(v_empty.index((j + STAGES - 2) % STAGES), pred=j >= 2)
        s_tok = _issue_qk(q, k_smem, k_ready, turn_bars, j, s_zero, ME, STAGES, PINGPONG)
        acc = _rescale(acc, alpha, o_layout)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(
            p_smem.index((j - 1) % 2), v_smem.index(prev), acc, is_async=True
        )  # acc += P_{j-1} V_{j-1}
        _turn_pass(turn_bars, ME, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(j % STAGES))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, False)
        p_smem.index(j % 2).store(p.to(p_smem.dtype))  # P_j
        fence_async_shared()
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    mbarrier.arrive(v_empty.index((count + STAGES - 2) % STAGES), pred=count >= 2)
    last = (count - 1) % STAGES
    acc = _rescale(acc, alpha, o_layout)
    mbarrier.wait(v_ready.index(last), ((count - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p_smem.index((count - 1) % 2), v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    mbarrier.arrive(v_empty.index(last))
    return acc, m_i, l_i


@gluon.jit
def _consumer(
    desc_o,
    q_smem,
    k_smem,
    v_smem,
    p_smem,  # p_smem: this consumer's [2, 64, BN]
    q_bar,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    turn_bars,
    LSE,
    count,
    num_full,
    idx_row,
    stride_ik,
    KV_SIZES,
    q_row,
    qk_scale,
    ME: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    P_IN_SMEM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
):
    """Rows ``[64 * ME, 64 * ME + 64)`` of the query block: the online softmax over every
    listed key block (with ``HAS_KV_SIZES`` the first ``num_full`` unmasked, the rest masked),
    then o (q's dtype, by TMA through this half's Q buffer) and lse (fp32)."""
    M: gl.constexpr = ROWS_PER_CONSUMER
    # wgmma accumulator layouts for this 4-warp partition: 16 rows per warp, N = 128 per
    # instruction (the largest N that divides both BLOCK_N and HEAD_DIM).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    # P feeds the P V wgmma from registers: the A-operand layout of o_layout. Both layouts are
    # MMAv3 over the same warps, so the conversion from s_layout is a register-only repack.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BN] key slots

    q = q_smem.index(ME)  # [64, D] shared (NVMMA-swizzled), A operand of Q K^T

    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_layout)  # running max (base 2)
    l_i = gl.zeros([M], gl.float32, layout=row_layout)  # running sum of exp2
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)  # [64, D] unnormalised o
    s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)  # ignored acc of Q K^T

    # Wait for Q even when the row is empty: the epilogue reuses the Q buffer for o, and the
    # loader's TMA into it must have landed before we overwrite it.
    mbarrier.wait(q_bar, 0)

    if count > 0:
        # ---- prologue: S_0 and its softmax (no P V yet) ----
        s_tok = _issue_qk(q, k_smem, k_ready, turn_bars, 0, s_zero, ME, STAGES, PINGPONG)
        _turn_pass(turn_bars, ME, PINGPONG)
        if HAS_KV_SIZES:  # block 0 is partial when no listed block is full
            limit = gl.where(num_full > 0, BLOCK_N, gl.load(KV_SIZES + gl.load(idx_row)))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(0))  # K_0 read: the loader may refill the slot
        if HAS_KV_SIZES:
            s = _padding_masked(s, limit, cols)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, HAS_KV_SIZES)  # P_0 fp32
        # ---- blocks 1..count-1 (Q K^T of block j issued with P V of block j-1) ----
        if P_IN_SMEM:
            gl.static_assert(not HAS_KV_SIZES, "P in shared memory: full blocks only")
            acc, m_i, l_i = _loop_p_in_smem(
                q,
                k_smem,
                v_smem,
                p_smem,
                k_ready,
                v_ready,
                k_empty,
                v_empty,
                turn_bars,
                count,
                qk_scale,
                p,
                m_i,
                l_i,
                alpha,
                acc,
                s_zero,
                o_layout,
                ME,
                STAGES,
                PINGPONG,
            )
        else:
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)  # [64, BN], P_0
            p_op, m_i, l_i, alpha, acc = _walk(
                q,
                k_smem,
                v_smem,
                k_ready,
                v_ready,
                k_empty,
                v_empty,
                turn_bars,
                1,
                num_full,
                qk_scale,
                p_op,
                m_i,
                l_i,
                alpha,
                acc,
                s_zero,
                idx_row,
                stride_ik,
                KV_SIZES,
                cols,
                p_layout,
                o_layout,
                ME,
                STAGES,
                PINGPONG,
                False,
            )  # full blocks
            if HAS_KV_SIZES:
                p_op, m_i, l_i, alpha, acc = _walk(
                    q,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    turn_bars,
                    gl.maximum(num_full, 1),
                    count,
                    qk_scale,
                    p_op,
                    m_i,
                    l_i,
                    alpha,
                    acc,
                    s_zero,
                    idx_row,
                    stride_ik,
                    KV_SIZES,
                    cols,
                    p_layout,
                    o_layout,
                    ME,
                    STAGES,
                    PINGPONG,
                    True,
                )  # partial blocks
            acc = _last_pv(p_op, v_smem, v_ready, v_empty, acc, alpha, count, o_layout, STAGES)

    # ---- epilogue: normalise; rows that saw no block get o = 0, lse = -inf ----
    live = l_i > 0.0
    l_safe = gl.where(live, l_i, 1.0)
    inv_l = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))  # [64]
    o = acc * gl.expand_dims(inv_l, 1)  # [64, D] fp32
    lse = gl.where(live, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))  # [64], natural log
    offs = q_row + ME * M + gl.arange(0, M, layout=row_layout)  # [64] global rows
    gl.store(LSE + offs, lse)
    # Q is dead (every Q K^T has completed): its half of the buffer stages o for a TMA store.
    q.store(o.to(q.dtype))
    fence_async_shared()  # generic-proxy stores -> visible to the TMA (async proxy)
    tma.async_copy_shared_to_global(desc_o, [q_row + ME * M, 0], q)
    tma.store_wait(pendings=0)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _block_sparse_attn_fwd_gluon_kernel(
    desc_q,
    desc_k,
    desc_v,
    desc_o,  # TMA over [B*H*S, D]: q/o blocks [64, D], k/v [BN, D]
    LSE,  # fp32 [B, H, Sq]
    KV_IDX,
    KV_CNT,  # int32 [Bi, H, NQ, K], [Bi, H, NQ]
    KV_SIZES,
    KV_FULL,  # HAS_KV_SIZES: int32 [NK] real keys per block; [Bi, H, NQ] full blocks
    stride_ib,
    stride_ih,
    stride_iq,
    stride_ik,  # stride_ib == 0 when lists broadcast over batch
    stride_cb,
    stride_ch,
    stride_cq,
    stride_fb,
    stride_fh,
    stride_fq,
    H,
    Sq,
    Skv,
    qk_scale,  # softmax scale * log2(e), fp32
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    P_IN_SMEM: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    gl.static_assert(BLOCK_M == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_row = pid_bh * Sq + pid_m * BLOCK_M  # first row of this query block in [B*H*Sq, D]
    kv_row0 = pid_bh * Skv  # first key row of this (b, h) in [B*H*Skv, D]
    idx_row = (
        KV_IDX
        + b.to(gl.int64) * stride_ib
        + h.to(gl.int64) * stride_ih
        + pid_m.to(gl.int64) * stride_iq
    )  # this query block's list
    count = gl.load(
        KV_CNT
        + b.to(gl.int64) * stride_cb
        + h.to(gl.int64) * stride_ch
        + pid_m.to(gl.int64) * stride_cq
    )  # how many blocks it lists
    num_full = count  # leading full blocks (all, without key-block sizes)
    if HAS_KV_SIZES:
        num_full = gl.load(
            KV_FULL
            + b.to(gl.int64) * stride_fb
            + h.to(gl.int64) * stride_fh
            + pid_m.to(gl.int64) * stride_fq
        )

    # Shared memory: Q (also o's staging buffer) 32 KB, K and V rings 2 * STAGES * 32 KB.
    q_smem = gl.allocate_shared_memory(
        desc_q.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM], desc_q.layout
    )  # [2, 64, D]
    k_smem = gl.allocate_shared_memory(
        desc_k.dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_k.layout
    )  # [STAGES, BN, D]
    v_smem = gl.allocate_shared_memory(
        desc_v.dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_v.layout
    )  # [STAGES, BN, D]
    if P_IN_SMEM:  # P staging, per consumer: [buffer, 64, BN] bf16, 2 x 32 KB in all
        p_smem0 = gl.allocate_shared_memory(
            desc_k.dtype, [2, ROWS_PER_CONSUMER, BLOCK_N], desc_k.layout
        )
        p_smem1 = gl.allocate_shared_memory(
            desc_k.dtype, [2, ROWS_PER_CONSUMER, BLOCK_N], desc_k.layout
        )
    else:  # unused placeholders (the consumers never touch them)
        p_smem0 = gl.allocate_shared_memory(desc_k.dtype, [2, 8, 64], desc_k.layout)
        p_smem1 = gl.allocate_shared_memory(desc_k.dtype, [2, 8, 64], desc_k.layout)

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(q_bar, count=1)  # the loader's expect is the one arrival; TMA bytes complete it
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turn_bars.index(0), count=1)
    mbarrier.init(turn_bars.index(1), count=1)
    # Consumer 0 takes the first turn: complete phase 0 of its turn barrier up front.
    mbarrier.arrive(turn_bars.index(0))
    fence_async_shared()  # barrier inits visible to the async proxy before any TMA uses them

    # (Tuples are spelled out: concatenating them in a jit function unwraps the constexprs.)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    desc_o,
                    q_smem,
                    k_smem,
                    v_smem,
                    p_smem0,
                    q_bar,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    turn_bars,
                    LSE,
                    count,
                    num_full,
                    idx_row,
                    stride_ik,
                    KV_SIZES,
                    q_row,
                    qk_scale,
                    gl.constexpr(0),
                    BLOCK_N,
                    HEAD_DIM,
                    STAGES,
                    PINGPONG,
                    P_IN_SMEM,
                    HAS_KV_SIZES,
                ),
            ),  # default partition: rows 0-63
            (
                _consumer,
                (
                    desc_o,
                    q_smem,
                    k_smem,
                    v_smem,
                    p_smem1,
                    q_bar,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    turn_bars,
                    LSE,
                    count,
                    num_full,
                    idx_row,
                    stride_ik,
                    KV_SIZES,
                    q_row,
                    qk_scale,
                    gl.constexpr(1),
                    BLOCK_N,
                    HEAD_DIM,
                    STAGES,
                    PINGPONG,
                    P_IN_SMEM,
                    HAS_KV_SIZES,
                ),
            ),  # rows 64-127
            (
                _loader,
                (
                    desc_q,
                    desc_k,
                    desc_v,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_bar,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    idx_row,
                    stride_ik,
                    count,
                    q_row,
                    kv_row0,
                    BLOCK_N,
                    STAGES,
                ),
            ),
        ],
        [4, 1],  # warps: second consumer warpgroup, loader warp
        [CONSUMER_REGS, LOADER_REGS],  # setmaxnreg: the loader gives its registers away
    )


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

# Default schedule (measured best on the H200: benchmarks/results/tuning/try_gluon_fwd_h200.json);
# configs.py turns the kernel on, benchmarks/try_gluon_fwd.py sweeps these.
DEFAULT_OPTIONS = dict(STAGES=2, PINGPONG=True, P_IN_SMEM=False, CONSUMER_REGS=240, LOADER_REGS=24)
BLOCK = 128  # query and key block: two consumer warpgroups of 64 rows, 128-key wgmma tiles
HEAD_DIMS = (128,)  # the one head_dim measured; 64 compiles but is untimed
DTYPES = (torch.bfloat16, torch.float16)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _broadcast_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of a per-(batch, head) index tensor, with 0 for a batch dim of size 1."""
    strides = list(x.stride())
    if x.shape[0] == 1:
        strides[0] = 0
    return tuple(strides)


def gluon_fits(q, k, v, block_q: int, block_kv: int) -> bool:
    """Can this kernel take these inputs? 128x128 blocks, D = 128, bf16/fp16, and q, k, v
    contiguous with 16-byte aligned bases (the TMA descriptors view them as [B*H*S, D])."""
    return (
        block_q == block_kv == BLOCK
        and q.shape[-1] in HEAD_DIMS
        and q.dtype in DTYPES
        and all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (q, k, v))
    )


def _descriptors(q, k, v, o, block_kv):
    """TMA descriptors over the [B*H*S, D] views: q, o in 64-row halves, k, v in key blocks."""
    D = q.shape[-1]
    rows = ROWS_PER_CONSUMER.value
    dtype = _GL_DTYPES[q.dtype]
    half = gl.NVMMASharedLayout.get_default_for([rows, D], dtype)
    kv = gl.NVMMASharedLayout.get_default_for([block_kv, D], dtype)

    def desc(x, rows, layout):
        x2 = x.view(-1, D)  # [B*H*S, D]
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, D], layout)

    return (desc(q, rows, half), desc(k, block_kv, kv), desc(v, block_kv, kv), desc(o, rows, half))


def kernel_args(
    q,
    k,
    v,
    o,
    lse,
    kv_indices,
    kv_counts,
    block_q,
    block_kv,
    scale,
    kv_block_sizes=None,
    full_counts=None,
    **options,
):
    """``(grid, args, kwargs)`` of one launch (also used to compile for sm_90 without a GPU).
    With ``kv_block_sizes``, ``kv_indices`` must list each row's full blocks first and
    ``full_counts`` count them (``lists.full_blocks_first``)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    opts = {**DEFAULT_OPTIONS, **options}
    has_sizes = kv_block_sizes is not None
    sizes = kv_block_sizes if has_sizes else kv_counts  # dummy pointers when unused
    full = full_counts if has_sizes else kv_counts
    grid = (Sq // block_q, B * H)
    args = (
        *_descriptors(q, k, v, o, block_kv),
        lse,
        kv_indices,
        kv_counts,
        sizes,
        full,
        *_broadcast_strides(kv_indices),
        *_broadcast_strides(kv_counts),
        *_broadcast_strides(full),
        H,
        Sq,
        Skv,
        scale * LOG2E,
    )
    kwargs = dict(
        BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D, HAS_KV_SIZES=has_sizes, **opts, num_warps=4
    )
    return grid, args, kwargs


def block_sparse_attn_fwd_gluon(
    q,
    k,
    v,
    kv_indices,
    kv_counts,
    block_q=BLOCK,
    block_kv=BLOCK,
    scale=None,
    *,
    kv_block_sizes=None,
    full_counts=None,
    **options,
):
    """Block-sparse attention forward (Gluon, Hopper); returns ``(o, lse)``.

    q bf16/fp16 [B, H, Sq, D], k, v [B, H, Skv, D], contiguous, D = 128, Sq and Skv multiples
    of 128; kv_indices int32 [Bi, H, NQ, K] with unit stride on K, kv_counts int32
    [Bi, H, NQ] (Bi = B or 1). With ``kv_block_sizes`` (int32 [NK]; padding keys finite) the
    lists hold each row's full blocks first and ``full_counts`` [Bi, H, NQ] counts them.
    ``options`` override ``DEFAULT_OPTIONS``. Inputs are the launcher's (``fwd._forward``)
    to check: this raises only on what would make the kernel misread memory.
    """
    B, H, Sq, D = q.shape
    if not gluon_fits(q, k, v, block_q, block_kv):
        raise ValueError(
            "block_sparse_attn_fwd_gluon: needs 128x128 blocks, head_dim 128, "
            "bf16/fp16 and contiguous 16-byte aligned q, k, v"
        )
    if (
        kv_indices.dtype != torch.int32
        or kv_counts.dtype != torch.int32
        or kv_indices.stride(-1) != 1
    ):
        raise ValueError("block_sparse_attn_fwd_gluon: int32 lists with a unit stride on K")
    if (kv_block_sizes is None) != (full_counts is None):
        raise ValueError("kv_block_sizes and full_counts go together (lists.full_blocks_first)")
    if scale is None:
        scale = D**-0.5
    o = torch.empty_like(q)  # [B, H, Sq, D]
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)  # [B, H, Sq]
    grid, args, kwargs = kernel_args(
        q,
        k,
        v,
        o,
        lse,
        kv_indices,
        kv_counts,
        block_q,
        block_kv,
        scale,
        kv_block_sizes,
        full_counts,
        **options,
    )
    _block_sparse_attn_fwd_gluon_kernel[grid](*args, **kwargs)
    return o, lse


__all__ = ["block_sparse_attn_fwd_gluon", "gluon_fits", "kernel_args", "DEFAULT_OPTIONS"]
