"""Backward launchers and kernels of block-sparse flash attention.

Recomputes the attention probabilities from the forward's log-sum-exp, FlashAttention-2 style,
in three launches (or two, fused below) and without atomics (so gradients are bit-identical
across runs):

1. ``_block_sparse_attn_bwd_preprocess_kernel``: ``delta = rowsum(o * do)`` and the base-2 lse,
   with ``-inf`` (empty rows) turned into ``+inf`` so their probabilities recompute to 0; for
   VSA (``CoarseGrad``) also ``o_fine`` recomputed from ``o`` and the combine's gradients.
2. ``_block_sparse_attn_bwd_dkdv_kernel``: one program per key block (``_dkdv_program``),
   walking the *transposed* lists (the query blocks that attend to it) to accumulate dK and dV.
   The transposed lists, like the full-first reorder, are derived once per list tensors
   (``lists.derived_lists``).
3. ``_block_sparse_attn_bwd_dq_kernel``: one program per query (sub-)block (``_dq_program``),
   walking its own list to accumulate dQ (with key-block sizes, full blocks first and
   unmasked, as the forward).

2 and 3 can run as one launch, ``_block_sparse_attn_bwd_fused_kernel``: the dK/dV programs
first (lowest ids), then the dQ programs. Each kernel alone ends in a partial wave of whole-SM
programs (and dK/dV programs differ in work with their transposed lists' lengths); in one
launch the dQ programs fill the SMs that the last dK/dV programs leave idle. Each program
runs the same ``_dkdv_program`` / ``_dq_program`` as in its own kernel, so the gradients are
bit-identical either way. It is taken where both kernels' configs ask for it
(``KernelConfig.fused`` in configs.py) and launch alike (one launch has one num_warps,
num_stages, ...), or as the caller says (``fused=``); the two kernels stay for the rest
(other architectures, tuning each kernel's config).

The softmax scale stays an fp32 multiplier on fp32 scores: K is never pre-scaled in bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vidsparse.ops.block_sparse_attn.configs import KernelConfig, backward_config
from vidsparse.ops.block_sparse_attn.fwd import (
    LOG2E,
    CoarseCombine,
    _broadcast_strides,
    _epilogue_args,
    _lists_full_first,
    _num_full_blocks,
    _tensor_descriptor,
    _tma_compatible,
    _tma_reads_keys,
)
from vidsparse.ops.block_sparse_attn.lists import cached_transpose
from vidsparse.utils.device import target_of


@triton.jit
def _block_sparse_attn_bwd_preprocess_kernel(
    O, DO, LSE, DELTA, LSE2,  # o, do [B, H, Sq, D]; lse, delta, lse2 fp32 [B, H, Sq]
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    OC, stride_ocb, stride_och, stride_ocm,  # COMBINE: o_coarse [B, H, NQ, D], unit-stride D
    GATE, stride_gb, stride_gh, stride_gs,  # HAS_GATE: gate like q, unit-stride D
    Q_SIZES,  # ZERO_PAD_ROWS: real rows per query block [NQ]
    DOC, stride_dcb, stride_dch, stride_dcm,  # COMBINE: d o_coarse fp32 [B, H, NQ, D]
    DGATE, stride_dgb, stride_dgh, stride_dgs,  # HAS_GATE: d gate like gate
    H, Sq,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    COMBINE: tl.constexpr, HAS_GATE: tl.constexpr, ZERO_PAD_ROWS: tl.constexpr,
):  # fmt: skip
    """``delta = rowsum(o * do)`` and the base-2 lse. With COMBINE (VSA), ``O`` is the combined
    output ``o = o_fine + gate * o_coarse[block]``: ``o_fine`` is recomputed from it (no copy of
    it is kept by the forward), and the combine's gradients come from the same read of ``do``:
    ``d o_coarse[block] = sum_rows do * gate``, ``d gate = do * o_coarse[block]``. With
    ZERO_PAD_ROWS, padding rows (constant 0 in the forward's output) get lse2 = +inf and
    delta = 0, so no gradient flows through them for any finite ``do`` there (the gradient
    kernels still read those rows of ``do``)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od)
    o = o.to(tl.float32)  # [BM, D]
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod)
    do = do.to(tl.float32)  # [BM, D]
    if COMBINE:
        oc = tl.load(OC + b * stride_ocb + h * stride_och + pid_m.to(tl.int64) * stride_ocm + offs_d)
        oc = oc.to(tl.float32)  # [D]
        if HAS_GATE:
            g_offs = b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gs + offs_d[None, :]
            gate = tl.load(GATE + g_offs).to(tl.float32)  # [BM, D]
            o = o - gate * oc[None, :]  # o_fine
        else:
            o = o - oc[None, :]
    delta = tl.sum(o * do, axis=1)  # [BM]
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse = tl.load(LSE + row)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    if ZERO_PAD_ROWS:
        real = tl.arange(0, BLOCK_M) < tl.load(Q_SIZES + pid_m)  # [BM]
        do = tl.where(real[:, None], do, 0.0)
        delta = tl.where(real, delta, 0.0)
        lse2 = tl.where(real, lse2, float("inf"))
    tl.store(DELTA + row, delta)
    tl.store(LSE2 + row, lse2)
    if COMBINE:
        if HAS_GATE:
            d_coarse = tl.sum(do * gate, axis=0)  # [D]
            dg_offs = b * stride_dgb + h * stride_dgh + offs_m[:, None] * stride_dgs + offs_d[None, :]
            tl.store(DGATE + dg_offs, (do * oc[None, :]).to(DGATE.dtype.element_ty))
        else:
            d_coarse = tl.sum(do, axis=0)  # [D]
        tl.store(DOC + b * stride_dcb + h * stride_dch + pid_m.to(tl.int64) * stride_dcm + offs_d, d_coarse)


@triton.jit
def _key_block(K, V, b, h, block, real, offs_d,
               stride_kb, stride_kh, stride_ks, stride_kd,
               stride_vb, stride_vh, stride_vs, stride_vd,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               HAS_KV_SIZES: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    """K and V rows of one key block, ``[BN, D]`` each: by TMA when K and V are descriptors
    (padding rows read too: the caller vouched them finite), else by pointers with padding
    rows (``real`` False) never read."""
    if USE_TMA:
        row0 = (block * BLOCK_N).to(tl.int32)
        k = K.load([b.to(tl.int32), h.to(tl.int32), row0, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = V.load([b.to(tl.int32), h.to(tl.int32), row0, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
        rows = block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        k_ptrs = K + b * stride_kb + h * stride_kh + rows[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_ptrs = V + b * stride_vb + h * stride_vh + rows[:, None] * stride_vs + offs_d[None, :] * stride_vd
        if HAS_KV_SIZES:
            k = tl.load(k_ptrs, mask=real[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=real[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _pooled_share(DPOOL, which, b, h, block, offs_d, size,
                  stride_pt, stride_pb, stride_ph, stride_pn):  # fmt: skip
    """Each real row's share of a block mean's gradient, ``dpooled[which, b, h, block] / size``
    ([D] fp32): the backward of VSA's tile-mean pooling, added in the kernels' epilogues."""
    g = tl.load(DPOOL + which * stride_pt + b * stride_pb + h * stride_ph
                + block.to(tl.int64) * stride_pn + offs_d)  # fmt: skip
    return g.to(tl.float32) / tl.maximum(size, 1).to(tl.float32)


@triton.jit
def _dkdv_program(
    pid_n, pid_bh,  # key block, batch * H + head
    Q, K, V, DO, DK, DV, LSE2, DELTA,
    Q_OFF, Q_IDX, KV_SIZES,  # int32 [Bi, H, NK + 1], [Bi, H, NQ * K], [NK]
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_offb, stride_offh, stride_qib, stride_qih,
    DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,  # ADD_POOLED: fp32 [3, B, H, NQ, D]
    H, Sq, NQ,
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, IEEE_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    ADD_POOLED: tl.constexpr,
):  # fmt: skip
    """dK and dV of key block ``pid_n`` of ``(batch, head) = divmod(pid_bh, H)``: the body of
    ``_block_sparse_attn_bwd_dkdv_kernel``, a function so that the fused kernel runs the same
    arithmetic. With USE_TMA, Q and DO (blocks [1, 1, SUB_M, D]) and K and V (blocks
    [1, 1, BLOCK_N, D]) are tensor descriptors read by TMA; padding keys are then read too, so
    the caller vouches that they are finite (their probabilities are zeroed, and 0 x finite
    keeps dS finite). With ADD_POOLED (VSA; key block j < NQ is query block j's tile), the
    real rows of key block j also get ``dpooled[1 or 2, j] / size_j``: the tile-mean
    pooling's backward."""
    NSUB: tl.constexpr = BLOCK_M // SUB_M
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)

    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_d = tl.arange(0, HEAD_DIM)
    offs_sub = tl.arange(0, SUB_M)
    real = tl.arange(0, BLOCK_N) < BLOCK_N  # [BN]
    if HAS_KV_SIZES:
        real = tl.arange(0, BLOCK_N) < tl.load(KV_SIZES + pid_n)
    k, v = _key_block(K, V, b, h, pid_n, real, offs_d,
                      stride_kb, stride_kh, stride_ks, stride_kd,
                      stride_vb, stride_vh, stride_vs, stride_vd,
                      BLOCK_N, HEAD_DIM, HAS_KV_SIZES, USE_TMA)  # [BN, D] each; fmt: skip

    if not USE_TMA:
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
    row_base = pid_bh.to(tl.int64) * Sq
    off_row = Q_OFF + b * stride_offb + h * stride_offh
    idx_row = Q_IDX + b * stride_qib + h * stride_qih
    start = tl.load(off_row + pid_n)
    end = tl.load(off_row + pid_n + 1)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # One flat loop over (listed query block, sub-block) pairs pipelines better than two.
    for t in range(start * NSUB, end * NSUB):
        q_block = tl.load(idx_row + t // NSUB)
        row0 = q_block * BLOCK_M + (t % NSUB) * SUB_M
        offs_m = row0.to(tl.int64) + offs_sub  # [SUB_M]
        if USE_TMA:
            q = Q.load([pid_bh // H, pid_bh % H, row0, 0]).reshape(SUB_M, HEAD_DIM)  # [SUB_M, D]
            do = DO.load([pid_bh // H, pid_bh % H, row0, 0]).reshape(SUB_M, HEAD_DIM)
        else:
            q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd)
            do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod)
        lse2 = tl.load(LSE2 + row_base + offs_m)  # [SUB_M]
        delta = tl.load(DELTA + row_base + offs_m)
        if IEEE_DOT:
            qk_t = tl.dot(k, tl.trans(q), input_precision="ieee")
        else:
            qk_t = tl.dot(k, tl.trans(q))  # [BN, SUB_M]
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if HAS_KV_SIZES:
            p_t = tl.where(real[:, None], p_t, 0.0)
        if IEEE_DOT:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
            dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv)  # [BN, D]
            dp_t = tl.dot(v, tl.trans(do))  # [BN, SUB_M]
        ds_t = p_t * (dp_t - delta[None, :])
        if IEEE_DOT:
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")
        else:
            dk = tl.dot(ds_t.to(q.dtype), q, dk)  # [BN, D]
    dk = dk * scale
    if ADD_POOLED:  # noqa: SIM102 - a constexpr test, then a runtime one (Triton)
        if pid_n < NQ:  # a video tile (HAS_KV_SIZES: ``real`` holds its real rows)
            size = tl.load(KV_SIZES + pid_n)
            rows_real = real[:, None]  # [BN, 1]
            share_k = _pooled_share(DPOOL, 1, b, h, pid_n, offs_d, size,
                                    stride_pt, stride_pb, stride_ph, stride_pn)  # fmt: skip
            share_v = _pooled_share(DPOOL, 2, b, h, pid_n, offs_d, size,
                                    stride_pt, stride_pb, stride_ph, stride_pn)  # fmt: skip
            dk = dk + tl.where(rows_real, share_k[None, :], 0.0)
            dv = dv + tl.where(rows_real, share_v[None, :], 0.0)

    dk_ptrs = DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty))


@triton.jit
def _block_sparse_attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE2, DELTA,
    Q_OFF, Q_IDX, KV_SIZES,  # int32 [Bi, H, NK + 1], [Bi, H, NQ * K], [NK]
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_offb, stride_offh, stride_qib, stride_qih,
    DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,  # ADD_POOLED: fp32 [3, B, H, NQ, D]
    H, Sq, NQ,
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, IEEE_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    ADD_POOLED: tl.constexpr,
):  # fmt: skip
    """Grid ``(NK, B * H)``: one ``_dkdv_program`` per key block."""
    _dkdv_program(
        tl.program_id(0), tl.program_id(1),
        Q, K, V, DO, DK, DV, LSE2, DELTA, Q_OFF, Q_IDX, KV_SIZES,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_dob, stride_doh, stride_dos, stride_dod,
        stride_dkb, stride_dkh, stride_dks, stride_dkd,
        stride_dvb, stride_dvh, stride_dvs, stride_dvd,
        stride_offb, stride_offh, stride_qib, stride_qih,
        DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,
        H, Sq, NQ, qk_scale, scale,
        BLOCK_M, BLOCK_N, SUB_M, HEAD_DIM, HAS_KV_SIZES, IEEE_DOT, USE_TMA, ADD_POOLED,
    )  # fmt: skip


@triton.jit
def _dq_walk(q, do, lse2, delta, dq, K, V, KV_SIZES, idx_row, stride_ik, lo, hi, b, h,
             offs_n, offs_d, stride_kb, stride_kh, stride_ks, stride_kd,
             stride_vb, stride_vh, stride_vs, stride_vd, qk_scale,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
             IEEE_DOT: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    """dQ over list entries ``[lo, hi)``; ``MASKED``: the blocks may end in padding keys."""
    for j in range(lo, hi):
        kv_block = tl.load(idx_row + j * stride_ik)
        real = offs_n < BLOCK_N  # [BN]
        if MASKED:
            real = offs_n < tl.load(KV_SIZES + kv_block)
        k, v = _key_block(K, V, b, h, kv_block, real, offs_d,
                          stride_kb, stride_kh, stride_ks, stride_kd,
                          stride_vb, stride_vh, stride_vs, stride_vd,
                          BLOCK_N, HEAD_DIM, MASKED, USE_TMA)  # [BN, D] each; fmt: skip
        if IEEE_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))  # [SUB_M, BN]
            dp = tl.dot(do, tl.trans(v))  # [SUB_M, BN]
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(real[None, :], p, 0.0)
        ds = p * (dp - delta[:, None])
        if IEEE_DOT:
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq)  # [SUB_M, D]
    return dq


@triton.jit
def _dq_program(
    pid, pid_bh,  # query sub-block (of SUB_M rows), batch * H + head
    Q, K, V, DO, DQ, LSE2, DELTA,
    KV_IDX, KV_CNT, KV_SIZES,
    KV_FULL, stride_fb, stride_fh, stride_fq,  # HAS_KV_SIZES: int32 [Bi, H, NQ], full blocks first
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,  # ADD_POOLED: fp32 [3, B, H, NQ, D]
    H, Sq,
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, IEEE_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    ADD_POOLED: tl.constexpr,
):  # fmt: skip
    """dQ of query rows ``[pid * SUB_M, (pid + 1) * SUB_M)`` of ``(batch, head) =
    divmod(pid_bh, H)``: the body of ``_block_sparse_attn_bwd_dq_kernel``, a function so that
    the fused kernel runs the same arithmetic. With USE_TMA, K and V are tensor descriptors
    (blocks [1, 1, BLOCK_N, D]) read by TMA; padding keys are then read too, so the caller
    vouches that they are finite: their probabilities are zeroed, and 0 x finite keeps dS
    finite. With ADD_POOLED (VSA), the real rows of query block i also get
    ``dpooled[0, i] / size_i`` (sizes: KV_SIZES[i], the same tile as key block i)."""
    NSUB: tl.constexpr = BLOCK_M // SUB_M
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    q_block = (pid // NSUB).to(tl.int64)

    offs_m = pid.to(tl.int64) * SUB_M + tl.arange(0, SUB_M)  # [SUB_M]; sub-blocks tile the rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse2 = tl.load(LSE2 + row)  # [SUB_M]
    delta = tl.load(DELTA + row)

    idx_row = KV_IDX + b * stride_ib + h * stride_ih + q_block * stride_iq
    count = tl.load(KV_CNT + b * stride_cb + h * stride_ch + q_block * stride_cq)

    dq = tl.zeros([SUB_M, HEAD_DIM], dtype=tl.float32)
    # With key-block sizes the lists come full blocks first (lists.full_blocks_first): those
    # are walked without the padding mask, the partial ones after them with it.
    num_full = _num_full_blocks(KV_FULL, b, h, q_block, stride_fb, stride_fh, stride_fq, count,
                                HAS_KV_SIZES)  # fmt: skip
    dq = _dq_walk(q, do, lse2, delta, dq, K, V, KV_SIZES, idx_row, stride_ik, 0, num_full, b, h,
                  offs_n, offs_d, stride_kb, stride_kh, stride_ks, stride_kd,
                  stride_vb, stride_vh, stride_vs, stride_vd, qk_scale,
                  BLOCK_N, HEAD_DIM, False, IEEE_DOT, USE_TMA)  # fmt: skip
    if HAS_KV_SIZES:
        dq = _dq_walk(q, do, lse2, delta, dq, K, V, KV_SIZES, idx_row, stride_ik, num_full,
                      count, b, h, offs_n, offs_d, stride_kb, stride_kh, stride_ks, stride_kd,
                      stride_vb, stride_vh, stride_vs, stride_vd, qk_scale,
                      BLOCK_N, HEAD_DIM, True, IEEE_DOT, USE_TMA)  # fmt: skip
    dq = dq * scale
    if ADD_POOLED:
        size = tl.load(KV_SIZES + q_block)
        rows_real = ((pid % NSUB) * SUB_M + tl.arange(0, SUB_M) < size)[:, None]  # [SUB_M, 1]
        share = _pooled_share(DPOOL, 0, b, h, q_block, offs_d, size,
                              stride_pt, stride_pb, stride_ph, stride_pn)  # fmt: skip
        dq = dq + tl.where(rows_real, share[None, :], 0.0)
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))


@triton.jit
def _block_sparse_attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE2, DELTA,
    KV_IDX, KV_CNT, KV_SIZES,
    KV_FULL, stride_fb, stride_fh, stride_fq,  # HAS_KV_SIZES: int32 [Bi, H, NQ], full blocks first
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,  # ADD_POOLED: fp32 [3, B, H, NQ, D]
    H, Sq,
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, IEEE_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    ADD_POOLED: tl.constexpr,
):  # fmt: skip
    """Grid ``(Sq // SUB_M, B * H)``: one ``_dq_program`` per query sub-block."""
    _dq_program(
        tl.program_id(0), tl.program_id(1),
        Q, K, V, DO, DQ, LSE2, DELTA, KV_IDX, KV_CNT, KV_SIZES,
        KV_FULL, stride_fb, stride_fh, stride_fq,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_dob, stride_doh, stride_dos, stride_dod,
        stride_dqb, stride_dqh, stride_dqs, stride_dqd,
        stride_ib, stride_ih, stride_iq, stride_ik,
        stride_cb, stride_ch, stride_cq,
        DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,
        H, Sq, qk_scale, scale,
        BLOCK_M, BLOCK_N, SUB_M, HEAD_DIM, HAS_KV_SIZES, IEEE_DOT, USE_TMA, ADD_POOLED,
    )  # fmt: skip


@triton.jit
def _block_sparse_attn_bwd_fused_kernel(
    Q_DKDV, K_DKDV, V_DKDV, DO_DKDV,  # the dK/dV half's: descriptors with USE_TMA_DKDV
    Q_DQ, K_DQ, V_DQ, DO_DQ,  # the dQ half's: Q, DO tensors; K, V descriptors with USE_TMA_DQ
    DQ, DK, DV, LSE2, DELTA,
    Q_OFF, Q_IDX,  # int32 [Bi, H, NK + 1], [Bi, H, NQ * K]: the transposed lists
    KV_IDX, KV_CNT, KV_SIZES,  # [Bi, H, NQ, K], [Bi, H, NQ], int32 [NK]
    KV_FULL, stride_fb, stride_fh, stride_fq,  # HAS_KV_SIZES: int32 [Bi, H, NQ], full blocks first
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
    DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,  # ADD_POOLED: fp32 [3, B, H, NQ, D]
    H, Sq, NQ, NK, BH,
    qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SUB_M_DKDV: tl.constexpr, SUB_M_DQ: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, IEEE_DOT: tl.constexpr,
    USE_TMA_DKDV: tl.constexpr, USE_TMA_DQ: tl.constexpr, ADD_POOLED: tl.constexpr,
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
            Q_DKDV, K_DKDV, V_DKDV, DO_DKDV, DK, DV, LSE2, DELTA, Q_OFF, Q_IDX, KV_SIZES,
            stride_qb, stride_qh, stride_qs, stride_qd,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_vb, stride_vh, stride_vs, stride_vd,
            stride_dob, stride_doh, stride_dos, stride_dod,
            stride_dkb, stride_dkh, stride_dks, stride_dkd,
            stride_dvb, stride_dvh, stride_dvs, stride_dvd,
            stride_offb, stride_offh, stride_qib, stride_qih,
            DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,
            H, Sq, NQ, qk_scale, scale,
            BLOCK_M, BLOCK_N, SUB_M_DKDV, HEAD_DIM, HAS_KV_SIZES, IEEE_DOT, USE_TMA_DKDV,
            ADD_POOLED,
        )  # fmt: skip
    else:
        num_sub = Sq // SUB_M_DQ  # dQ programs per (batch, head)
        pid_q = pid - num_dkdv
        _dq_program(
            pid_q % num_sub, pid_q // num_sub,
            Q_DQ, K_DQ, V_DQ, DO_DQ, DQ, LSE2, DELTA, KV_IDX, KV_CNT, KV_SIZES,
            KV_FULL, stride_fb, stride_fh, stride_fq,
            stride_qb, stride_qh, stride_qs, stride_qd,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_vb, stride_vh, stride_vs, stride_vd,
            stride_dob, stride_doh, stride_dos, stride_dod,
            stride_dqb, stride_dqh, stride_dqs, stride_dqd,
            stride_ib, stride_ih, stride_iq, stride_ik,
            stride_cb, stride_ch, stride_cq,
            DPOOL, stride_pt, stride_pb, stride_ph, stride_pn,
            H, Sq, qk_scale, scale,
            BLOCK_M, BLOCK_N, SUB_M_DQ, HEAD_DIM, HAS_KV_SIZES, IEEE_DOT, USE_TMA_DQ,
            ADD_POOLED,
        )  # fmt: skip


class CoarseGrad(NamedTuple):
    """Inputs of VSA's fused backward: the forward's ``CoarseCombine``. The backward takes the
    combined output ``o`` and recomputes ``o_fine = o - gate * o_coarse`` where it needs it."""

    o_coarse: torch.Tensor  # [B, H, NQ, D], unit-stride D
    gate: torch.Tensor | None  # [B, H, Sq, D], unit-stride D; None: o = o_fine + o_coarse
    q_block_sizes: torch.Tensor | None  # int32 [NQ]: rows past it in a block carry no gradient
    # VSA's coarse branch, when its backward is fused here: d o_coarse -> dpooled fp32
    # [3, B, H, NQ, D] (the gradients of the q, k, v block means that o_coarse came from).
    # The kernels then add each block's share to the real rows of dq, dk, dv, and the
    # returned d o_coarse is only informative. Needs key block i == query block i (i < NQ).
    coarse_attn_grad: Callable[[torch.Tensor], torch.Tensor] | None = None


def block_sparse_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor | None,
    block_q: int,
    block_kv: int,
    scale: float,
    dkdv_config: KernelConfig | None = None,
    dq_config: KernelConfig | None = None,
    *,
    padding_finite: bool = False,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels on validated inputs; returns ``(dq, dk, dv)``.

    The two configs override the table in configs.py (for tuning); their ``sub_m`` must divide
    ``block_q``. ``padding_finite`` as in the forward: padding keys hold finite values, so the
    kernels may read them by TMA (their probabilities are zeroed either way). ``fused``: the
    dK/dV and dQ programs in one launch (True; the configs must launch alike) or two (False);
    None lets the configs decide (``fused_launch``). Both give bit-identical gradients.
    """
    dq, dk, dv, _, _ = _backward(do, q, k, v, o, lse, kv_indices, kv_counts, kv_block_sizes,
                                 block_q, block_kv, scale, dkdv_config, dq_config, padding_finite,
                                 None, fused)  # fmt: skip
    return dq, dk, dv


def block_sparse_attn_bwd_combined(
    do, q, k, v, o, lse, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale,
    coarse: CoarseGrad, *, padding_finite: bool = False, fused: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """The backward of ``o = o_fine + gate * o_coarse`` (``block_sparse_attn_fwd_combined``),
    given that forward's ``o`` and ``lse``: returns ``(dq, dk, dv, d_o_coarse fp32, d_gate or
    None)``. ``o_fine`` is recomputed in the preprocess kernel; the combine's gradients come
    out of the preprocess kernel's one read of ``do``; with ``coarse.coarse_attn_grad``, the
    coarse branch's gradient through the block means lands in dq, dk, dv as well. ``fused``
    as in ``block_sparse_attn_bwd``."""
    if coarse.coarse_attn_grad is not None and kv_block_sizes is None:
        raise ValueError("coarse_attn_grad needs kv_block_sizes (the tiles' real rows)")
    return _backward(do, q, k, v, o, lse, kv_indices, kv_counts, kv_block_sizes, block_q,
                     block_kv, scale, None, None, padding_finite, coarse, fused)  # fmt: skip


def fused_launch(dkdv: KernelConfig, dq: KernelConfig, fused: bool | None = None) -> bool:
    """Do the dK/dV and dQ programs of configs ``dkdv`` and ``dq`` (as resolved for the inputs,
    ``KernelConfig.for_inputs``) run in one launch? ``fused`` None: where both configs ask for
    it (``KernelConfig.fused``) and launch alike; True: one launch, which needs the same
    launch options (one launch has one num_warps, num_stages, ...); False: two launches."""
    alike = dkdv.launch_kwargs() == dq.launch_kwargs()
    if fused is None:
        return dkdv.fused and dq.fused and alike
    if fused and not alike:
        raise ValueError(
            "a fused backward launch needs the dK/dV and dQ configs to launch alike, got "
            f"{dkdv.launch_kwargs()} and {dq.launch_kwargs()}"
        )
    return bool(fused)


def _preprocess_epilogue_args(coarse: CoarseGrad | None, do, num_q_blocks, dummy):
    """``(args, flags, d_coarse, d_gate)`` of the preprocess kernel's VSA epilogue: the
    forward's combine arguments (``fwd._epilogue_args``), then the two gradients' outputs."""
    combine = None if coarse is None else CoarseCombine(*coarse[:3])
    args, flags = _epilogue_args(combine, dummy)
    if coarse is None:
        return (*args, dummy, 0, 0, 0, dummy, 0, 0, 0), flags, None, None
    B, H, _, D = do.shape
    d_coarse = torch.empty((B, H, num_q_blocks, D), device=do.device, dtype=torch.float32)
    d_gate = None if coarse.gate is None else torch.empty_like(coarse.gate)
    dgate_args = (dummy, 0, 0, 0) if d_gate is None else (d_gate, *d_gate.stride()[:3])
    return (*args, d_coarse, *d_coarse.stride()[:3], *dgate_args), flags, d_coarse, d_gate


def _backward(do, q, k, v, o, lse, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv,
              scale, dkdv_config, dq_config, padding_finite, coarse, fused=None):  # fmt: skip
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    num_q_blocks, num_kv_blocks = Sq // block_q, Skv // block_kv
    target = target_of(q.device)
    ieee = q.dtype == torch.float32
    has_sizes = kv_block_sizes is not None
    sizes = kv_block_sizes if has_sizes else kv_counts  # dummy pointer when unused

    delta = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    args, flags, d_coarse, d_gate = _preprocess_epilogue_args(coarse, do, num_q_blocks, lse)
    _block_sparse_attn_bwd_preprocess_kernel[(num_q_blocks, B * H)](
        o, do, lse, delta, lse2, *o.stride(), *do.stride(), *args, H, Sq,
        BLOCK_M=block_q, HEAD_DIM=D, **flags,
    )

    dpool = None
    if coarse is not None and coarse.coarse_attn_grad is not None:
        dpool = coarse.coarse_attn_grad(d_coarse).float()  # [3, B, H, NQ, D]
    pool_args = (dpool, *dpool.stride()[:4]) if dpool is not None else (lse, 0, 0, 0, 0)

    # Each kernel's config as the inputs allow: the dK/dV kernel reads q, do (its loop's tiles)
    # and k, v by TMA or all by pointers; the dQ kernel reads k, v (its loop's) by TMA or not.
    keys_by_tma = _tma_reads_keys(q.dtype, kv_block_sizes, padding_finite) and _tma_compatible(
        k, v
    )
    kv_cfg = dkdv_config or backward_config(target, "bwd_dkdv", block_q, block_kv, D, has_sizes)
    kv_cfg, kv_tma = kv_cfg.for_inputs(keys_by_tma and _tma_compatible(q, do), block_q)
    q_cfg = dq_config or backward_config(target, "bwd_dq", block_q, block_kv, D, has_sizes)
    q_cfg, q_tma = q_cfg.for_inputs(keys_by_tma, block_q)
    desc = _tensor_descriptor
    kv_in = (q, k, v, do)  # the dK/dV kernel's q, k, v, do
    if kv_tma:
        kv_in = (desc(q, kv_cfg.sub_m), desc(k, block_kv), desc(v, block_kv), desc(do, kv_cfg.sub_m))
    q_keys = (desc(k, block_kv), desc(v, block_kv)) if q_tma else (k, v)  # the dQ kernel's k, v

    q_offsets, q_indices = cached_transpose(kv_indices, kv_counts, num_kv_blocks)
    dq_lists, full = _lists_full_first(kv_indices, kv_counts, kv_block_sizes, block_kv, True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    transposed_strides = (*_broadcast_strides(q_offsets)[:2], *_broadcast_strides(q_indices)[:2])
    list_strides = (*_broadcast_strides(dq_lists), *_broadcast_strides(kv_counts))
    common = dict(BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D, HAS_KV_SIZES=has_sizes,
                  IEEE_DOT=ieee, ADD_POOLED=dpool is not None)  # fmt: skip

    if fused_launch(kv_cfg, q_cfg, fused):
        num_dq_programs = Sq // q_cfg.sub_m * B * H
        _block_sparse_attn_bwd_fused_kernel[(num_kv_blocks * B * H + num_dq_programs,)](
            *kv_in, q, *q_keys, do, dq, dk, dv, lse2, delta,
            q_offsets, q_indices, dq_lists, kv_counts, sizes, full, *_broadcast_strides(full),
            *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *dq.stride(), *dk.stride(), *dv.stride(),
            *transposed_strides, *list_strides, *pool_args,
            H, Sq, num_q_blocks, num_kv_blocks, B * H, scale * LOG2E, scale,
            SUB_M_DKDV=kv_cfg.sub_m, SUB_M_DQ=q_cfg.sub_m,
            USE_TMA_DKDV=kv_tma, USE_TMA_DQ=q_tma, **common,
            **kv_cfg.launch_kwargs(),
        )  # fmt: skip
        return dq, dk, dv, d_coarse, d_gate

    _block_sparse_attn_bwd_dkdv_kernel[(num_kv_blocks, B * H)](
        *kv_in, dk, dv, lse2, delta,
        q_offsets, q_indices, sizes,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        *transposed_strides, *pool_args,
        H, Sq, num_q_blocks, scale * LOG2E, scale,
        SUB_M=kv_cfg.sub_m, USE_TMA=kv_tma, **common,
        **kv_cfg.launch_kwargs(),
    )  # fmt: skip
    _block_sparse_attn_bwd_dq_kernel[(Sq // q_cfg.sub_m, B * H)](
        q, *q_keys, do, dq, lse2, delta,
        dq_lists, kv_counts, sizes, full, *_broadcast_strides(full),
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        *list_strides, *pool_args,
        H, Sq, scale * LOG2E, scale,
        SUB_M=q_cfg.sub_m, USE_TMA=q_tma, **common,
        **q_cfg.launch_kwargs(),
    )  # fmt: skip
    return dq, dk, dv, d_coarse, d_gate
