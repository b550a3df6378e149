"""Forward launcher and kernel of block-sparse flash attention.

One program per (query block, batch*head). It keeps its query block in registers and walks the
key blocks listed for it (``kv_indices[b, h, i, :kv_counts[b, h, i]]``) with the online-softmax
recurrence of FlashAttention, in base 2 (``log2(e)`` folded into the scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vidsparse.ops.block_sparse_attn.configs import forward_config
from vidsparse.utils.device import target_of

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _block_sparse_attn_fwd_kernel(
    Q, K, V, O, LSE,  # q [B, H, Sq, D]; k, v [B, H, Skv, D]; o like q; lse fp32 [B, H, Sq]
    KV_IDX, KV_CNT, KV_SIZES,  # int32 [Bi, H, NQ, K], [Bi, H, NQ], [NK] (unused unless HAS_KV_SIZES)
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_ib, stride_ih, stride_iq, stride_ik,  # stride_ib == 0 when lists broadcast over batch
    stride_cb, stride_ch, stride_cq,
    H, Sq,
    qk_scale,  # softmax scale * log2(e), fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, IEEE_DOT: tl.constexpr,
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

    for j in range(0, count):
        kv_block = tl.load(idx_row + j * stride_ik).to(tl.int64)
        offs_kv = kv_block * BLOCK_N + offs_n  # [BN]
        k_ptrs = k_base + offs_kv[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_kv[:, None] * stride_vs + offs_d[None, :] * stride_vd
        if HAS_KV_SIZES:
            # Padding keys are neither read nor weighted: whatever they hold cannot leak in.
            real = offs_n < tl.load(KV_SIZES + kv_block)  # [BN]
            k = tl.load(k_ptrs, mask=real[:, None], other=0.0)  # [BN, D]
        else:
            k = tl.load(k_ptrs)  # [BN, D]
        if IEEE_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))  # [BM, BN] fp32
        qk = qk * qk_scale
        if HAS_KV_SIZES:
            qk = tl.where(real[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A block of pure padding leaves the max at -inf: subtract 0 instead to avoid NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = m_new
        p = tl.math.exp2(qk - m_sub[:, None])  # [BM, BN]
        alpha = tl.math.exp2(m_i - m_sub)  # [BM]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_KV_SIZES:
            v = tl.load(v_ptrs, mask=real[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)  # [BN, D]
        if IEEE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    # Rows that saw no live key: o = 0, lse = -inf (never NaN).
    live = l_i > 0.0
    l_safe = tl.where(live, l_i, 1.0)
    acc = acc / l_safe[:, None]
    lse = tl.where(live, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(O.dtype.element_ty))
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs; returns ``(o, lse)``."""
    B, H, Sq, D = q.shape
    num_q_blocks = Sq // block_q
    o = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    cfg = forward_config(target_of(q.device), block_q, block_kv, D, q.dtype)
    sizes = kv_block_sizes if kv_block_sizes is not None else kv_counts  # dummy pointer when unused
    grid = (num_q_blocks, B * H)
    _block_sparse_attn_fwd_kernel[grid](
        q, k, v, o, lse,
        kv_indices, kv_counts, sizes,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        *_broadcast_strides(kv_indices), *_broadcast_strides(kv_counts),
        H, Sq,
        scale * LOG2E,
        BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D,
        HAS_KV_SIZES=kv_block_sizes is not None, IEEE_DOT=q.dtype == torch.float32,
        **cfg.launch_kwargs(),
    )
    return o, lse


def _broadcast_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of a per-(batch, head) index tensor, with 0 for a batch dim of size 1."""
    strides = list(x.stride())
    if x.shape[0] == 1:
        strides[0] = 0
    return tuple(strides)
