"""Forward launcher and kernel of block-sparse flash attention.

One program per (query block, batch*head). It keeps its query block in registers and walks the
key blocks listed for it (``kv_indices[b, h, i, :kv_counts[b, h, i]]``) with the online-softmax
recurrence of FlashAttention, in base 2 (``log2(e)`` folded into the scale). With key-block sizes
the lists are first reordered full blocks first (``lists.py``) and walked in two loops: the full
blocks unmasked, then the partial ones masked. On Hopper, where ``configs.py`` says so and the
inputs fit, the launcher hands the work to the Gluon kernel of ``fwd_gluon.py`` instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vidsparse.ops.block_sparse_attn.configs import KernelConfig, forward_config
from vidsparse.ops.block_sparse_attn.lists import cached_full_blocks_first, derived_lists
from vidsparse.utils.device import target_of

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, real, qk_scale,
                         MASK_KEYS: tl.constexpr, IEEE_DOT: tl.constexpr):
    """One key block of the FlashAttention recurrence (base 2); ``real`` [BN] masks padding."""
    if IEEE_DOT:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))  # [BM, BN] fp32
    if MASK_KEYS:
        # Mask the raw dots, then scale inside the exponent's FMA as below (-inf * scale stays
        # -inf): one select per score on top of the unmasked path, not a multiply, select and
        # subtract.
        qk = tl.where(real[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        # A block of pure padding leaves the max at -inf: subtract 0 instead to avoid NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])  # [BM, BN]
    else:
        # scale > 0, so max(qk) * scale == max(qk * scale); the scaling fuses into one FMA.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])  # [BM, BN]
    alpha = tl.math.exp2(m_i - m_sub)  # [BM]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE_DOT:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)  # [BM, D]
    return m_new, l_i, acc


@triton.jit
def _tma_key_block(desc_k, desc_v, KV_SIZES, b, h, kv_block, offs_n,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_KV_SIZES: tl.constexpr):
    """K, V tiles of one listed block by TMA, and the mask of its real keys [BN].

    TMA cannot mask rows, so padding keys are read: their scores are masked, and their values
    (finite, as the caller vouched with ``padding_finite``) meet probability 0."""
    k = desc_k.load([b, h, kv_block * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)  # [BN, D]
    v = desc_v.load([b, h, kv_block * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)
    if HAS_KV_SIZES:
        real = offs_n < tl.load(KV_SIZES + kv_block)  # [BN]
    else:
        real = offs_n < BLOCK_N
    return k, v, real


@triton.jit
def _num_full_blocks(KV_FULL, b, h, pid_m, stride_fb, stride_fh, stride_fq, count,
                     HAS_KV_SIZES: tl.constexpr):
    """How many leading entries of the list are full key blocks: all of them without
    key-block sizes, else ``KV_FULL`` (the lists were reordered by ``lists.full_blocks_first``)."""
    if HAS_KV_SIZES:
        return tl.load(KV_FULL + b * stride_fb + h * stride_fh + pid_m.to(tl.int64) * stride_fq)
    return count


@triton.jit
def _pointer_walk(q, k_base, v_base, KV_SIZES, idx_row, stride_ik, lo, hi,
                  m_i, l_i, acc, qk_scale, offs_n, offs_d,
                  stride_ks, stride_kd, stride_vs, stride_vd,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE_DOT: tl.constexpr):
    """List entries ``[lo, hi)`` by pointer loads; ``MASKED``: blocks may end in padding."""
    for j in range(lo, hi):
        kv_block = tl.load(idx_row + j * stride_ik).to(tl.int64)
        offs_kv = kv_block * BLOCK_N + offs_n  # [BN]
        k_ptrs = k_base + offs_kv[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_kv[:, None] * stride_vs + offs_d[None, :] * stride_vd
        if MASKED:
            # Padding keys are neither read nor weighted: whatever they hold cannot leak in.
            real = offs_n < tl.load(KV_SIZES + kv_block)  # [BN]
            k = tl.load(k_ptrs, mask=real[:, None], other=0.0)  # [BN, D]
            v = tl.load(v_ptrs, mask=real[:, None], other=0.0)
        else:
            real = offs_n < BLOCK_N
            k = tl.load(k_ptrs)  # [BN, D]
            v = tl.load(v_ptrs)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, real, qk_scale,
                                             MASKED, IEEE_DOT)
    return m_i, l_i, acc


@triton.jit
def _tma_walk(q, desc_k, desc_v, KV_SIZES, idx_row, stride_ik, lo, hi, b, h,
              m_i, l_i, acc, qk_scale, offs_n,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              WARP_SPECIALIZE: tl.constexpr):
    """List entries ``[lo, hi)`` by TMA; ``MASKED``: blocks may end in padding."""
    for j in tl.range(lo, hi, warp_specialize=WARP_SPECIALIZE):
        kv_block = tl.load(idx_row + j * stride_ik)
        k, v, real = _tma_key_block(desc_k, desc_v, KV_SIZES, b, h, kv_block, offs_n,
                                    BLOCK_N, HEAD_DIM, MASKED)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, real, qk_scale,
                                             MASKED, False)
    return m_i, l_i, acc


@triton.jit
def _combine_coarse(o, b, h, pid_m, offs_m, offs_d,
                    OC, stride_ocb, stride_och, stride_ocm,
                    GATE, stride_gb, stride_gh, stride_gs, Q_SIZES,
                    HAS_GATE: tl.constexpr, ZERO_PAD_ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """VSA's epilogue: ``o + gate * o_coarse`` (one coarse row per query block, broadcast over
    its rows; unit-stride head dim), in fp32, with the padding rows of the block set to zero."""
    oc = tl.load(OC + b * stride_ocb + h * stride_och + pid_m.to(tl.int64) * stride_ocm + offs_d)
    oc = oc.to(tl.float32)  # [D]
    if HAS_GATE:
        g_ptrs = GATE + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gs + offs_d[None, :]
        o = o + tl.load(g_ptrs).to(tl.float32) * oc[None, :]  # [BM, D]
    else:
        o = o + oc[None, :]
    if ZERO_PAD_ROWS:
        real_rows = tl.arange(0, BLOCK_M) < tl.load(Q_SIZES + pid_m)  # [BM]
        o = tl.where(real_rows[:, None], o, 0.0)
    return o


@triton.jit
def _finish_rows(acc, m_i, l_i):
    """Normalise; rows that saw no live key get o = 0 and lse = -inf (never NaN)."""
    live = l_i > 0.0
    l_safe = tl.where(live, l_i, 1.0)
    # One reciprocal per row and a multiply per element: ``acc / l`` is an IEEE division per
    # element (~6 instructions with its range fix-ups), for a difference of an ulp of fp32.
    acc = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(live, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return acc, lse


@triton.jit
def _block_sparse_attn_fwd_kernel(
    Q, K, V, O, LSE,  # q [B, H, Sq, D]; k, v [B, H, Skv, D]; o like q; lse fp32 [B, H, Sq]
    KV_IDX, KV_CNT, KV_SIZES,  # int32 [Bi, H, NQ, K], [Bi, H, NQ], [NK] (unused unless HAS_KV_SIZES)
    KV_FULL, stride_fb, stride_fh, stride_fq,  # HAS_KV_SIZES: int32 [Bi, H, NQ], full blocks first
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_ib, stride_ih, stride_iq, stride_ik,  # stride_ib == 0 when lists broadcast over batch
    stride_cb, stride_ch, stride_cq,
    OC, stride_ocb, stride_och, stride_ocm,  # COMBINE: o_coarse [B, H, NQ, D], fp32
    GATE, stride_gb, stride_gh, stride_gs,  # COMBINE with HAS_GATE: gate like q, unit-stride D
    Q_SIZES,  # COMBINE with ZERO_PAD_ROWS: real rows per query block [NQ]
    H, Sq,
    qk_scale,  # softmax scale * log2(e), fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, IEEE_DOT: tl.constexpr,
    COMBINE: tl.constexpr, HAS_GATE: tl.constexpr, ZERO_PAD_ROWS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = tl.arange(0, BLOCK_N)  # [BN]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs)  # [BM, D]

    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    idx_row = KV_IDX + b * stride_ib + h * stride_ih + pid_m.to(tl.int64) * stride_iq
    count = tl.load(KV_CNT + b * stride_cb + h * stride_ch + pid_m.to(tl.int64) * stride_cq)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BM, D]

    num_full = _num_full_blocks(KV_FULL, b, h, pid_m, stride_fb, stride_fh, stride_fq, count,
                                HAS_KV_SIZES)
    m_i, l_i, acc = _pointer_walk(q, k_base, v_base, KV_SIZES, idx_row, stride_ik, 0, num_full,
                                  m_i, l_i, acc, qk_scale, offs_n, offs_d,
                                  stride_ks, stride_kd, stride_vs, stride_vd,
                                  BLOCK_N, False, IEEE_DOT)  # fmt: skip
    if HAS_KV_SIZES:
        m_i, l_i, acc = _pointer_walk(q, k_base, v_base, KV_SIZES, idx_row, stride_ik, num_full,
                                      count, m_i, l_i, acc, qk_scale, offs_n, offs_d,
                                      stride_ks, stride_kd, stride_vs, stride_vd,
                                      BLOCK_N, True, IEEE_DOT)  # fmt: skip

    acc, lse = _finish_rows(acc, m_i, l_i)
    o_offs = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    if COMBINE:
        acc = _combine_coarse(acc, b, h, pid_m, offs_m, offs_d,
                              OC, stride_ocb, stride_och, stride_ocm,
                              GATE, stride_gb, stride_gh, stride_gs, Q_SIZES,
                              HAS_GATE, ZERO_PAD_ROWS, BLOCK_M)
    tl.store(O + o_offs, acc.to(O.dtype.element_ty))
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse)


@triton.jit
def _block_sparse_attn_fwd_tma_kernel(
    desc_q, desc_k, desc_v, desc_o, LSE,  # 4-D tensor descriptors over [B, H, S, D]
    KV_IDX, KV_CNT, KV_SIZES,
    KV_FULL, stride_fb, stride_fh, stride_fq,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    OC, stride_ocb, stride_och, stride_ocm,  # as in the pointer kernel
    GATE, stride_gb, stride_gh, stride_gs,
    Q_SIZES,
    H, Sq,
    qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    COMBINE: tl.constexpr, HAS_GATE: tl.constexpr, ZERO_PAD_ROWS: tl.constexpr,
):
    """Hopper variant: tiles move by the bulk-copy engine (TMA)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q = desc_q.load([b, h, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)  # [BM, D]
    idx_row = KV_IDX + b.to(tl.int64) * stride_ib + h.to(tl.int64) * stride_ih + pid_m.to(tl.int64) * stride_iq
    count = tl.load(KV_CNT + b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch + pid_m.to(tl.int64) * stride_cq)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BM, D]
    offs_n = tl.arange(0, BLOCK_N)
    num_full = _num_full_blocks(KV_FULL, b.to(tl.int64), h.to(tl.int64), pid_m,
                                stride_fb, stride_fh, stride_fq, count, HAS_KV_SIZES)
    m_i, l_i, acc = _tma_walk(q, desc_k, desc_v, KV_SIZES, idx_row, stride_ik, 0, num_full,
                              b, h, m_i, l_i, acc, qk_scale, offs_n,
                              BLOCK_N, HEAD_DIM, False, WARP_SPECIALIZE)  # fmt: skip
    if HAS_KV_SIZES:
        m_i, l_i, acc = _tma_walk(q, desc_k, desc_v, KV_SIZES, idx_row, stride_ik, num_full,
                                  count, b, h, m_i, l_i, acc, qk_scale, offs_n,
                                  BLOCK_N, HEAD_DIM, True, WARP_SPECIALIZE)  # fmt: skip

    acc, lse = _finish_rows(acc, m_i, l_i)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    if COMBINE:
        offs_d = tl.arange(0, HEAD_DIM)
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        acc = _combine_coarse(acc, b64, h64, pid_m, offs_m, offs_d,
                              OC, stride_ocb, stride_och, stride_ocm,
                              GATE, stride_gb, stride_gh, stride_gs, Q_SIZES,
                              HAS_GATE, ZERO_PAD_ROWS, BLOCK_M)
    desc_o.store([b, h, pid_m * BLOCK_M, 0], acc.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse)


class CoarseCombine(NamedTuple):
    """Inputs of VSA's fused epilogue ``o = o_fine + gate * o_coarse`` (see ``_combine_coarse``)."""

    o_coarse: torch.Tensor  # [B, H, NQ, D], unit-stride D: one coarse row per query block
    gate: torch.Tensor | None  # [B, H, Sq, D], unit-stride D; None adds o_coarse as is
    q_block_sizes: torch.Tensor | None  # int32 [NQ]: rows past it in a block are set to 0


def block_sparse_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor | None,
    block_q: int,
    block_kv: int,
    scale: float,
    config: KernelConfig | None = None,
    *,
    padding_finite: bool = False,
    full_first: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs; returns ``(o, lse)``.

    ``config`` overrides the table in configs.py (for tuning). ``padding_finite``: the caller
    guarantees that padding keys (past ``kv_block_sizes``) hold finite values, which lets
    inputs with key-block sizes take the TMA kernel (it reads padding keys; their scores are
    masked); without it they take the pointer kernel, which never reads them. ``full_first``
    (tuning only): walk each list's full key blocks before the partial ones, unmasked
    (``lists.py``); False masks every block, as the kernel did before.
    """
    return _forward(q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale,
                    config, padding_finite, None, full_first)


def block_sparse_attn_fwd_combined(
    q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale,
    combine: CoarseCombine, config: KernelConfig | None = None, *, padding_finite: bool = False,
    full_first: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with VSA's epilogue fused; returns ``(o, lse)``. ``lse`` is o_fine's (the
    backward recomputes ``o_fine = o - gate * o_coarse``, see ``bwd.CoarseGrad``)."""
    return _forward(q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale,
                    config, padding_finite, combine, full_first)


def _forward(q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale, config,
             padding_finite, combine, full_first=True):
    B, H, Sq, D = q.shape
    num_q_blocks = Sq // block_q
    o = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    cfg = config or forward_config(
        target_of(q.device), block_q, block_kv, D, q.dtype, masked=kv_block_sizes is not None
    )
    grid = (num_q_blocks, B * H)
    sizes = kv_block_sizes if kv_block_sizes is not None else kv_counts  # dummy pointer when unused
    kv_indices, full = _lists_full_first(kv_indices, kv_counts, kv_block_sizes, block_kv,
                                         full_first)  # fmt: skip
    epilogue = _epilogue_args(combine, kv_counts)
    tma_possible = _tma_reads_keys(q.dtype, kv_block_sizes, padding_finite) and _tma_compatible(
        q, k, v, o
    )
    cfg, use_tma = cfg.for_inputs(tma_possible, block_q)
    if use_tma and cfg.gluon and _gluon_fits(q, k, v, block_q, block_kv):
        return _launch_gluon(q, k, v, kv_indices, kv_counts, kv_block_sizes, full, block_q,
                             block_kv, scale, combine)  # fmt: skip
    if use_tma:
        _launch_tma(q, k, v, o, lse, kv_indices, kv_counts, sizes, full,
                    kv_block_sizes is not None, block_q, block_kv, scale, cfg, grid, epilogue)
        return o, lse
    args, flags = epilogue
    _block_sparse_attn_fwd_kernel[grid](
        q, k, v, o, lse,
        kv_indices, kv_counts, sizes, full, *_broadcast_strides(full),
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        *_broadcast_strides(kv_indices), *_broadcast_strides(kv_counts),
        *args,
        H, Sq,
        scale * LOG2E,
        BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D,
        HAS_KV_SIZES=kv_block_sizes is not None, IEEE_DOT=q.dtype == torch.float32,
        **flags,
        **cfg.launch_kwargs(),
    )
    return o, lse


def _lists_full_first(kv_indices, kv_counts, kv_block_sizes, block_kv, full_first: bool):
    """``(lists, full counts)`` for the kernels' two walks (``_num_full_blocks``): without
    key-block sizes the lists as given (every block full; ``kv_counts`` stands in as a dummy),
    else reordered full blocks first (``lists.full_blocks_first``); ``full_first=False`` keeps
    the given order and counts no full block, so every block takes the masked walk (the
    kernel before the split, kept for tuning comparisons)."""
    if kv_block_sizes is None:
        return kv_indices, kv_counts
    if not full_first:
        return kv_indices, torch.zeros_like(kv_counts, dtype=torch.int32)
    return cached_full_blocks_first(kv_indices, kv_counts, kv_block_sizes, block_kv)


def _gluon_fits(q, k, v, block_q, block_kv) -> bool:
    from vidsparse.ops.block_sparse_attn.fwd_gluon import gluon_fits

    return gluon_fits(q, k, v, block_q, block_kv)


def _launch_gluon(q, k, v, kv_indices, kv_counts, kv_block_sizes, full, block_q, block_kv,
                  scale, combine):  # fmt: skip
    """The Gluon kernel (fwd_gluon.py): int32 lists with a unit stride on K (the reordered
    lists already are); full-block counts only with key-block sizes."""
    from vidsparse.ops.block_sparse_attn.fwd_gluon import block_sparse_attn_fwd_gluon

    if kv_indices.dtype != torch.int32 or kv_indices.stride(-1) != 1:
        kv_indices = _int32_contiguous(kv_indices)
    if kv_counts.dtype != torch.int32:
        kv_counts = _int32_contiguous(kv_counts)
    has_sizes = kv_block_sizes is not None
    return block_sparse_attn_fwd_gluon(
        q, k, v, kv_indices, kv_counts, block_q, block_kv, scale,
        kv_block_sizes=kv_block_sizes if has_sizes else None, full_counts=full if has_sizes else None,
        combine=combine,
    )  # fmt: skip


def _int32_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous int32, converted once per list tensor (``lists.derived_lists``)."""
    return derived_lists.get("int32", (x,), (), lambda: x.to(torch.int32).contiguous())


def _epilogue_args(combine: CoarseCombine | None, dummy) -> tuple[tuple, dict]:
    """Kernel arguments of the combine epilogue, the same for both kernels: pointers and
    strides (dummies when off), ``OC, 3 strides, GATE, 3 strides, Q_SIZES``, and the
    constexpr flags."""
    if combine is None:
        flags = dict(COMBINE=False, HAS_GATE=False, ZERO_PAD_ROWS=False)
        return (dummy, 0, 0, 0, dummy, 0, 0, 0, dummy), flags
    oc, gate = combine.o_coarse, combine.gate
    gate_args = (dummy, 0, 0, 0) if gate is None else (gate, *gate.stride()[:3])
    sizes = dummy if combine.q_block_sizes is None else combine.q_block_sizes
    args = (oc, *oc.stride()[:3], *gate_args, sizes)
    flags = dict(COMBINE=True, HAS_GATE=gate is not None, ZERO_PAD_ROWS=sizes is not dummy)
    return args, flags


def _tma_reads_keys(dtype: torch.dtype, kv_block_sizes, padding_finite: bool) -> bool:
    """May the kernels read K and V by TMA (forward and backward)? Not for fp32, which only
    the pointer kernels run with IEEE-exact dots; and TMA reads whole key blocks, so padding
    keys only where the caller vouches them finite (``padding_finite``): pointer loads never
    read them, where TMA would have to zero their values in registers (slower)."""
    return dtype != torch.float32 and (kv_block_sizes is None or padding_finite)


def _broadcast_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of a per-(batch, head) index tensor, with 0 for a batch dim of size 1."""
    strides = list(x.stride())
    if x.shape[0] == 1:
        strides[0] = 0
    return tuple(strides)


def _tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit stride on the head dim and 16-byte aligned base and strides."""
    for x in tensors:
        if x.stride(-1) != 1 or x.data_ptr() % 16:
            return False
        if any((s * x.element_size()) % 16 for s in x.stride()[:-1]):
            return False
    return True


def _tensor_descriptor(x: torch.Tensor, rows: int):
    """TMA descriptor over a [B, H, S, D] tensor whose blocks are ``rows`` whole token rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, x.shape[-1]])


def _launch_tma(q, k, v, o, lse, kv_indices, kv_counts, sizes, full, has_sizes, block_q,
                block_kv, scale, cfg, grid, epilogue):
    D = q.shape[-1]
    desc = _tensor_descriptor
    args, flags = epilogue
    _block_sparse_attn_fwd_tma_kernel[grid](
        desc(q, block_q), desc(k, block_kv), desc(v, block_kv), desc(o, block_q), lse,
        kv_indices, kv_counts, sizes, full, *_broadcast_strides(full),
        *_broadcast_strides(kv_indices), *_broadcast_strides(kv_counts),
        *args,
        q.shape[1], q.shape[2],
        scale * LOG2E,
        BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D,
        HAS_KV_SIZES=has_sizes,
        WARP_SPECIALIZE=cfg.warp_specialize,
        **flags,
        **cfg.launch_kwargs(),
    )
