"""Forward kernels of block-sparse flash attention (launcher: ``../fwd.py``).

One program per (query block, batch*head): its query block stays in registers while it walks
the key blocks listed for it with FlashAttention's online softmax in base 2 (``log2(e)``
folded into the scale). With key-block sizes the list comes full blocks first and is walked in
up to four loops (``lists.blocks_by_size``): the full blocks unmasked, then the partial ones
masked, those that fit in ``TAIL1`` or ``TAIL2`` rows with that many rows (smaller dots).
Before the one store of ``o`` the kernels call the declared epilogue (``../epilogue.py``).
``OUT_MAPPED``: o is stored in the caller's row order, each row at the row ``O_ROWS`` gives
(-1: nowhere), by pointers (``GradTargets.output``); lse stays in the engine's order.

Memory safety whatever the lists hold (the public entry validates them, but a list written
behind its validation's back is not seen): on the caller's own lists (``CHECK_LISTS``: no
key-block sizes) counts are clamped to the lists' width ``K``, and an entry out of ``[0, NK)``
reads block 0 and contributes nothing (a compare per entry and a few per-row selects). The
lists reordered full blocks first (with key-block sizes) are valid by construction
(``kernels/lists.py`` drops such entries) and walked unchecked, as before.

The pointer kernel's loads carry the config's eviction hints (``EVICT_STREAMED`` on the
streamed K and V, ``EVICT_RESIDENT`` on Q; "" for none); the TMA kernel's take none, as
Triton's tensor-descriptor ``load`` has no eviction argument.
"""

import triton
import triton.language as tl

from vidsparse.ops.block_sparse_attn.kernels.common import load_rows, store_mapped_rows, walk_ends


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, real, ok, qk_scale,
                         MASK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr, CHECK: tl.constexpr):
    """One key block of the FlashAttention recurrence (base 2); ``real`` [BN] masks padding.
    ``CHECK``: ``ok`` False (an entry out of range) leaves m, l and acc as they were (with
    ``MASK_KEYS`` through ``real``, all False then)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BM, BN] fp32
    if MASK_KEYS:
        # Mask the raw dots, then scale inside the exponent's FMA as below (-inf * scale stays
        # -inf): one select per score on top of the unmasked path, not a multiply, select and
        # subtract.
        qk = tl.where(real[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        # A block of pure padding leaves the max at -inf: subtract 0 instead to avoid NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])  # [BM, BN]
    elif CHECK:
        # An entry out of range keeps the max and subtracts +inf (p = 0): per-row selects only.
        m_new = tl.where(ok, tl.maximum(m_i, tl.max(qk, 1) * qk_scale), m_i)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - tl.where(ok, m_sub, float("inf"))[:, None])  # [BM, BN]
    else:
        # scale > 0, so max(qk) * scale == max(qk * scale); the scaling fuses into one FMA.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])  # [BM, BN]
    alpha = tl.math.exp2(m_i - m_sub)  # [BM]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # [BM, D]
    return m_new, l_i, acc


@triton.jit
def key_block_in_range(kv_block, NK):
    """``(block to read, whether the entry is in range)``: an entry out of ``[0, NK)`` reads
    block 0 (always there) and must contribute nothing."""
    ok = (kv_block >= 0) & (kv_block < NK)  # (NK may arrive as a constexpr 1: no casts on it)
    return tl.where(ok, kv_block, 0), ok


@triton.jit
def _block_size(KV_SIZES, kv_block, ok, CHECK: tl.constexpr):
    """Real keys of a listed block; 0 for an entry out of range (``CHECK``)."""
    size = tl.load(KV_SIZES + kv_block)
    if CHECK:
        size = tl.where(ok, size, 0)
    return size


@triton.jit
def _tma_key_block(desc_k, desc_v, KV_SIZES, b, h, kv_block, ok, offs_n,
                   BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HAS_KV_SIZES: tl.constexpr, CHECK: tl.constexpr):
    """The first ``ROWS`` K, V rows of one listed block by TMA (descriptors of ``ROWS``-row
    boxes), and the mask of its real keys [ROWS].

    TMA cannot mask rows, so padding keys are read: their scores are masked, and their values
    (finite, as the caller vouched with ``padding_finite``) meet probability 0. No eviction
    hint: a descriptor load takes none."""
    k = desc_k.load([b, h, kv_block * BLOCK_N, 0]).reshape(ROWS, HEAD_DIM)  # [ROWS, D]
    v = desc_v.load([b, h, kv_block * BLOCK_N, 0]).reshape(ROWS, HEAD_DIM)
    if HAS_KV_SIZES:
        real = offs_n < _block_size(KV_SIZES, kv_block, ok, CHECK)  # [ROWS]
    else:
        real = offs_n < ROWS
    return k, v, real


@triton.jit
def _pointer_walk(q, k_base, v_base, KV_SIZES, idx_row, stride_ik, lo, hi, NK,
                  m_i, l_i, acc, qk_scale, offs_d,
                  stride_ks, stride_kd, stride_vs, stride_vd,
                  BLOCK_N: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, CHECK: tl.constexpr, EVICT: tl.constexpr):
    """List entries ``[lo, hi)`` by pointer loads of each block's first ``ROWS`` keys (the
    walk's blocks hold no more real ones); ``MASKED``: blocks may end in padding; ``CHECK``:
    entries may be out of range; ``EVICT``: the K, V loads' eviction hint."""
    offs_n = tl.arange(0, ROWS)
    for j in range(lo, hi):
        kv_block = tl.load(idx_row + j * stride_ik)
        ok = True
        if CHECK:
            kv_block, ok = key_block_in_range(kv_block, NK)
        kv_block = kv_block.to(tl.int64)
        offs_kv = kv_block * BLOCK_N + offs_n  # [BN]
        k_ptrs = k_base + offs_kv[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_kv[:, None] * stride_vs + offs_d[None, :] * stride_vd
        if MASKED:
            # Padding keys are neither read nor weighted: whatever they hold cannot leak in.
            real = offs_n < _block_size(KV_SIZES, kv_block, ok, CHECK)  # [BN]
        else:
            real = offs_n < ROWS
        k = load_rows(k_ptrs, real, MASKED, EVICT)  # [ROWS, D]
        v = load_rows(v_ptrs, real, MASKED, EVICT)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, real, ok, qk_scale,
                                             MASKED, DOT_PRECISION, CHECK)
    return m_i, l_i, acc


@triton.jit
def _tma_walk(q, desc_k, desc_v, KV_SIZES, idx_row, stride_ik, lo, hi, NK, b, h,
              m_i, l_i, acc, qk_scale,
              BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASKED: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, CHECK: tl.constexpr):
    """List entries ``[lo, hi)`` by TMA of each block's first ``ROWS`` keys (``desc_k``,
    ``desc_v`` have ``ROWS``-row boxes); ``MASKED``: blocks may end in padding; ``CHECK``:
    entries may be out of range."""
    offs_n = tl.arange(0, ROWS)
    for j in tl.range(lo, hi, warp_specialize=WARP_SPECIALIZE):
        kv_block = tl.load(idx_row + j * stride_ik)
        ok = True
        if CHECK:
            kv_block, ok = key_block_in_range(kv_block, NK)
        k, v, real = _tma_key_block(desc_k, desc_v, KV_SIZES, b, h, kv_block, ok, offs_n,
                                    BLOCK_N, ROWS, HEAD_DIM, MASKED, CHECK)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, real, ok, qk_scale,
                                             MASKED, None, CHECK)
    return m_i, l_i, acc


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
def block_sparse_attn_fwd_kernel(
    Q, K, V, O, LSE,  # q [B, H, Sq, D]; k, v [B, H, Skv, D]; o like q; lse fp32 [B, H, Sq]
    O_ROWS,  # OUT_MAPPED: int32 [Sq], o's row for each query row (-1: none)
    KV_IDX, KV_CNT, KV_SIZES,  # int32 [Bi, H, NQ, K], [Bi, H, NQ], [NK] (unused unless HAS_KV_SIZES)
    KV_ENDS, stride_eb, stride_eh, stride_eq,  # HAS_KV_SIZES: int32 [Bi, H, NQ, 3], the walks' ends
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_ib, stride_ih, stride_iq, stride_ik,  # stride_ib == 0 when lists broadcast over batch
    stride_cb, stride_ch, stride_cq,
    EPILOGUE: tl.constexpr, epilogue_args,  # o = EPILOGUE(o, ..., *epilogue_args) before the store
    H, Sq,
    NK, K_WIDTH,  # key blocks and list width: the bounds of every entry and count (memory safety)
    qk_scale,  # softmax scale * log2(e), fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL1: tl.constexpr, TAIL2: tl.constexpr,  # rows of the short walks (0: none)
    HAS_KV_SIZES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CHECK_LISTS: tl.constexpr,  # the caller's own lists: clamp counts, check every entry
    EVICT_STREAMED: tl.constexpr, EVICT_RESIDENT: tl.constexpr,  # K, V and Q loads' hints
    OUT_MAPPED: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, eviction_policy=EVICT_RESIDENT)  # [BM, D]

    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    idx_row = KV_IDX + b * stride_ib + h * stride_ih + pid_m.to(tl.int64) * stride_iq
    count = tl.load(KV_CNT + b * stride_cb + h * stride_ch + pid_m.to(tl.int64) * stride_cq)
    if CHECK_LISTS:
        count = tl.minimum(count, K_WIDTH)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BM, D]

    end0, end1, end2 = walk_ends(KV_ENDS, b, h, pid_m, stride_eb, stride_eh, stride_eq, count,
                                 HAS_KV_SIZES, TAIL1, TAIL2)  # fmt: skip
    walk = (k_base, v_base, KV_SIZES, idx_row, stride_ik)
    strides = (stride_ks, stride_kd, stride_vs, stride_vd)
    m_i, l_i, acc = _pointer_walk(q, *walk, 0, end0, NK, m_i, l_i, acc, qk_scale, offs_d,
                                  *strides, BLOCK_N, BLOCK_N, False, DOT_PRECISION, CHECK_LISTS,
                                  EVICT_STREAMED)  # fmt: skip
    if HAS_KV_SIZES:
        m_i, l_i, acc = _pointer_walk(q, *walk, end0, end1, NK, m_i, l_i, acc, qk_scale, offs_d,
                                      *strides, BLOCK_N, BLOCK_N, True, DOT_PRECISION,
                                      CHECK_LISTS, EVICT_STREAMED)  # fmt: skip
        if TAIL1 > 0:
            m_i, l_i, acc = _pointer_walk(q, *walk, end1, end2, NK, m_i, l_i, acc, qk_scale,
                                          offs_d, *strides, BLOCK_N, TAIL1, True, DOT_PRECISION,
                                          CHECK_LISTS, EVICT_STREAMED)  # fmt: skip
        if TAIL2 > 0:
            m_i, l_i, acc = _pointer_walk(q, *walk, end2, count, NK, m_i, l_i, acc, qk_scale,
                                          offs_d, *strides, BLOCK_N, TAIL2, True, DOT_PRECISION,
                                          CHECK_LISTS, EVICT_STREAMED)  # fmt: skip

    acc, lse = _finish_rows(acc, m_i, l_i)
    o_offs = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    acc = EPILOGUE(acc, b, h, pid_m, offs_m, tl.arange(0, BLOCK_M), offs_d, *epilogue_args)
    if OUT_MAPPED:
        store_mapped_rows(O, b, h, offs_m, offs_d, stride_ob, stride_oh, stride_os, stride_od,
                          acc, offs_m >= 0, O_ROWS)  # fmt: skip
    else:
        tl.store(O + o_offs, acc.to(O.dtype.element_ty))
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse)


@triton.jit
def block_sparse_attn_fwd_tma_kernel(
    desc_q, desc_k, desc_v, desc_o, LSE,  # 4-D tensor descriptors over [B, H, S, D]
    mapped_out,  # OUT_MAPPED: (O, O_ROWS, o's four strides): o stored by pointers, not desc_o
    desc_k1, desc_v1, desc_k2, desc_v2,  # K, V in TAIL1- and TAIL2-row boxes (unused where 0)
    KV_IDX, KV_CNT, KV_SIZES,
    KV_ENDS, stride_eb, stride_eh, stride_eq,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    EPILOGUE: tl.constexpr, epilogue_args,  # as in the pointer kernel
    H, Sq,
    NK, K_WIDTH,  # as in the pointer kernel
    qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL1: tl.constexpr, TAIL2: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    CHECK_LISTS: tl.constexpr, OUT_MAPPED: tl.constexpr = False,
):
    """Hopper variant: tiles move by the bulk-copy engine (TMA)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q = desc_q.load([b, h, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)  # [BM, D]
    idx_row = KV_IDX + b.to(tl.int64) * stride_ib + h.to(tl.int64) * stride_ih + pid_m.to(tl.int64) * stride_iq
    count = tl.load(KV_CNT + b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch + pid_m.to(tl.int64) * stride_cq)
    if CHECK_LISTS:
        count = tl.minimum(count, K_WIDTH)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BM, D]
    end0, end1, end2 = walk_ends(KV_ENDS, b.to(tl.int64), h.to(tl.int64), pid_m,
                                 stride_eb, stride_eh, stride_eq, count, HAS_KV_SIZES, TAIL1, TAIL2)
    walk = (KV_SIZES, idx_row, stride_ik)
    m_i, l_i, acc = _tma_walk(q, desc_k, desc_v, *walk, 0, end0, NK, b, h, m_i, l_i, acc,
                              qk_scale, BLOCK_N, BLOCK_N, HEAD_DIM, False, WARP_SPECIALIZE,
                              CHECK_LISTS)  # fmt: skip
    if HAS_KV_SIZES:
        m_i, l_i, acc = _tma_walk(q, desc_k, desc_v, *walk, end0, end1, NK, b, h, m_i, l_i, acc,
                                  qk_scale, BLOCK_N, BLOCK_N, HEAD_DIM, True, WARP_SPECIALIZE,
                                  CHECK_LISTS)  # fmt: skip
        if TAIL1 > 0:
            m_i, l_i, acc = _tma_walk(q, desc_k1, desc_v1, *walk, end1, end2, NK, b, h, m_i, l_i,
                                      acc, qk_scale, BLOCK_N, TAIL1, HEAD_DIM, True,
                                      WARP_SPECIALIZE, CHECK_LISTS)  # fmt: skip
        if TAIL2 > 0:
            m_i, l_i, acc = _tma_walk(q, desc_k2, desc_v2, *walk, end2, count, NK, b, h, m_i,
                                      l_i, acc, qk_scale, BLOCK_N, TAIL2, HEAD_DIM, True,
                                      WARP_SPECIALIZE, CHECK_LISTS)  # fmt: skip

    acc, lse = _finish_rows(acc, m_i, l_i)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = EPILOGUE(acc, b.to(tl.int64), h.to(tl.int64), pid_m, offs_m, tl.arange(0, BLOCK_M),
                   tl.arange(0, HEAD_DIM), *epilogue_args)
    if OUT_MAPPED:
        O, O_ROWS, stride_ob, stride_oh, stride_os, stride_od = mapped_out
        store_mapped_rows(O, b.to(tl.int64), h.to(tl.int64), offs_m, tl.arange(0, HEAD_DIM),
                          stride_ob, stride_oh, stride_os, stride_od, acc, offs_m >= 0, O_ROWS)
    else:
        desc_o.store([b, h, pid_m * BLOCK_M, 0], acc.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse)
