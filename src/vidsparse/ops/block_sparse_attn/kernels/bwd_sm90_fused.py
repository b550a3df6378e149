"""The Hopper (sm_90) backward in one pass, in Gluon (launcher: ``../bwd_sm90.py``,
``dkdvdq_gluon``): dK and dV as the dK/dV kernel of ``bwd_sm90.py`` computes them, and dQ
from the same step's dS, added into an fp32 accumulator by atomics, as FlashAttention-3's
backward does. The dQ kernel's two GEMMs that recompute S and dP are saved: five GEMMs a
(query step, key block) pair instead of seven.

Per 64-row query step of a 128-row key block (consumer warpgroup c owns key rows 64c ..
64c + 63, as in ``bwd_sm90._consumer``): ``S^T``, ``dP^T``, ``P^T``, ``dV += P^T dO``, ``dS^T``,
``dK += dS^T Q``; then each consumer stores its dS^T half (bf16/fp16, [64 keys, 64 queries])
into a shared [128, 64] tile, both arrive on the step's ``ds_ready`` barrier and wait for it,
and consumer c forms columns ``64c .. 64c + 63`` of the step's dQ over all 128 keys::

    dQ[:, 64c:64c+64] = dS[64 q, 128 k] @ K[128 k, 64c:64c+64]    (dS^T from shared, transposed)

and adds them to the fp32 accumulator ``dq_acc`` (``red.global.add``, unordered: the sum's
order, so its last bits, differ from run to run; dK and dV are the dK/dV kernel's bits). The
dS tiles are double-buffered by step parity: a consumer writing buffer ``j % 2`` at step j has
waited on step j - 1's barrier, which the other consumer reaches only after its step j - 2
(the last reader of that buffer) has retired every wgmma.

The caller zeroes ``dq_acc`` before and turns it into dq after (``dq = dq_acc * scale``).
128x128 blocks, D = 128, 16-bit inputs, no dQ hook (the engine's identity epilogue).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from vidsparse.ops.block_sparse_attn.kernels.bwd_sm90 import (
    ROWS_PER_CONSUMER,
    STEP_M,
    init_ring,
    load_steps,
    step_ring,
    transposed_list_of,
)


@gluon.jit
def _add_dq(DQ_ACC, dq, q_row, COL0: gl.constexpr, HEAD_DIM: gl.constexpr,
            layout: gl.constexpr):  # fmt: skip
    """``dq_acc[q_row + i, COL0 + j] += dq[i, j]`` for the step's [64, 64] tile, unordered."""
    rows = q_row + gl.arange(0, STEP_M, layout=gl.SliceLayout(1, layout))
    cols = COL0 + gl.arange(0, HEAD_DIM // 2, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims(rows.to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
    gl.atomic_add(DQ_ACC + offsets, dq, sem="relaxed")


@gluon.jit
def _fused_consumer(
    desc_dk, desc_dv, DQ_ACC, k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, ds_smem,
    kv_bar, ready, empty, ds_ready, idx_row, start, num_steps, KV_SIZES, kv_block, kv_row,
    q_row0, Q_LAST, valid, qk_scale, scale, K_INDEX: gl.constexpr, BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_KV_SIZES: gl.constexpr,
):  # fmt: skip
    """dK, dV of key rows ``k_smem[K_INDEX]`` over ``num_steps`` ring steps, stored if
    ``valid``; each step's dQ columns ``64 K_INDEX ..`` added into ``DQ_ACC``."""
    M: gl.constexpr = ROWS_PER_CONSUMER
    NSUB: gl.constexpr = BLOCK_M // STEP_M
    HALF: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, STEP_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    k = k_smem.index(K_INDEX)
    v = v_smem.index(K_INDEX)
    # B operands of this consumer's dQ columns: K's two 64-row halves, columns 64c .. 64c + 63
    k_cols0 = k_smem.index(0).slice(K_INDEX * HALF, HALF, dim=1)
    k_cols1 = k_smem.index(1).slice(K_INDEX * HALF, HALF, dim=1)
    dk = gl.zeros([M, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([M, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([M, STEP_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([STEP_M, HALF], gl.float32, layout=dq_layout)
    if HAS_KV_SIZES:
        key_rows = K_INDEX * M + gl.arange(0, M, layout=gl.SliceLayout(1, s_layout))
        real = gl.expand_dims(key_rows < gl.load(KV_SIZES + kv_block), 1)

    mbarrier.wait(kv_bar, 0)
    for j in range(num_steps):
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        q = q_smem.index(slot)
        do = do_smem.index(slot)
        s_tok = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        lse2 = gl.expand_dims(lse_smem.index(slot).load(col_layout), 0)
        delta = gl.expand_dims(dl_smem.index(slot).load(col_layout), 0)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        p = gl.exp2(s * qk_scale - lse2)
        if HAS_KV_SIZES:
            p = gl.where(real, p, 0.0)
        p_op = gl.convert_layout(p.to(q.dtype), op_layout)
        dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok,))
        ds = p * (dp - delta)
        if HAS_KV_SIZES:
            ds = gl.where(real, ds, 0.0)
        ds16 = ds.to(q.dtype)
        ds_op = gl.convert_layout(ds16, op_layout)
        dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
        # This consumer's dS^T half into the step's shared tile, then both halves' barrier.
        buf = j % 2
        ds_smem.index(2 * buf + K_INDEX).store(ds16)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(buf))
        mbarrier.wait(ds_ready.index(buf), (j // 2) & 1)
        ds0 = ds_smem.index(2 * buf).permute((1, 0))  # [64 q, 64 k], keys 0-63
        ds1 = ds_smem.index(2 * buf + 1).permute((1, 0))  # keys 64-127
        dq_tok = warpgroup_mma(ds0, k_cols0, dq_zero, use_acc=False, is_async=True)
        dq_tok = warpgroup_mma(ds1, k_cols1, dq_tok, is_async=True)
        dv, dk, p_op, ds_op, dq = warpgroup_mma_wait(
            num_outstanding=0, deps=(dv_tok, dk_tok, p_op, ds_op, dq_tok)
        )
        mbarrier.arrive(empty.index(slot))
        q_block = gl.load(idx_row + start + j // NSUB)  # the loader's row, clamped alike
        q_block = gl.minimum(gl.maximum(q_block, 0), Q_LAST)
        q_row = q_row0 + q_block * BLOCK_M + (j % NSUB) * STEP_M
        _add_dq(DQ_ACC, dq, q_row, K_INDEX * HALF, HEAD_DIM, dq_layout)

    if valid:
        dk = dk * scale
        row = kv_row + K_INDEX * M
        k.store(dk.to(k.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_dk, [row, 0], k)
        v.store(dv.to(v.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_dv, [row, 0], v)
        tma.store_wait(pendings=0)


@gluon.jit
def block_sparse_attn_bwd_dkdvdq_gluon_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv,  # TMA over [B*H*S, D], blocks [64, D]
    desc_lse2, desc_delta,  # TMA over fp32 [B*H*Sq], blocks [64]
    DQ_ACC,  # fp32 [B*H*Sq, D], zeroed by the caller
    Q_OFF, Q_IDX, KV_SIZES,  # the transposed lists; [NK] (HAS_KV_SIZES)
    stride_offb, stride_offh, stride_qib, stride_qih,
    H, Sq, Skv, Q_LAST, NK, WIDTH,
    qk_scale, scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """Grid ``(NK, B * H)``: a 128-row key block per program, its halves on the two consumers,
    one list and one ring, as ``bwd_sm90.block_sparse_attn_bwd_dkdv_gluon_kernel``."""
    gl.static_assert(BLOCK_N == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_M % STEP_M == 0, "query blocks are whole steps")
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kv_row = pid_bh * Skv + pid_n * BLOCK_N
    valid = pid_n < NK
    idx_row, start, end = transposed_list_of(Q_OFF, Q_IDX, b, h, pid_n, valid, WIDTH,
                                             stride_offb, stride_offh, stride_qib,
                                             stride_qih)  # fmt: skip
    num_steps = (end - start) * (BLOCK_M // STEP_M)

    # K, V 2 x 32 KB; the ring STAGES x 32.5 KB; dS^T halves 2 buffers x 2 x 8 KB.
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_k.layout)  # fmt: skip
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_v.layout)  # fmt: skip
    q_smem, do_smem, lse_smem, dl_smem, ready, empty = step_ring(desc_q, desc_lse2, STAGES,
                                                                 HEAD_DIM)  # fmt: skip
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [ROWS_PER_CONSUMER, STEP_M], desc_q.dtype
    )
    ds_smem = gl.allocate_shared_memory(desc_q.dtype, [4, ROWS_PER_CONSUMER, STEP_M], ds_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(kv_bar, count=1)
    init_ring(ready, empty, STAGES, 2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # one arrival per consumer
    fence_async_shared()

    q_row0 = pid_bh * Sq
    gl.warp_specialize(
        [
            (_fused_consumer, (desc_dk, desc_dv, DQ_ACC, k_smem, v_smem, q_smem, do_smem,
                               lse_smem, dl_smem, ds_smem, kv_bar, ready, empty, ds_ready,
                               idx_row, start, num_steps, KV_SIZES, pid_n, kv_row, q_row0,
                               Q_LAST, valid, qk_scale, scale, gl.constexpr(0), BLOCK_M,
                               HEAD_DIM, STAGES, HAS_KV_SIZES)),
            (_fused_consumer, (desc_dk, desc_dv, DQ_ACC, k_smem, v_smem, q_smem, do_smem,
                               lse_smem, dl_smem, ds_smem, kv_bar, ready, empty, ds_ready,
                               idx_row, start, num_steps, KV_SIZES, pid_n, kv_row, q_row0,
                               Q_LAST, valid, qk_scale, scale, gl.constexpr(1), BLOCK_M,
                               HEAD_DIM, STAGES, HAS_KV_SIZES)),
            (load_steps, (desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, k_smem,
                          v_smem, q_smem, do_smem, lse_smem, dl_smem, kv_bar, ready, empty,
                          idx_row, start, end, Q_LAST, q_row0, kv_row, BLOCK_M, STAGES,
                          gl.constexpr(2))),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip
