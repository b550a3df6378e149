"""The Hopper (sm_90) dK/dV and dQ kernels at 128x128 blocks as persistent kernels (launchers:
``../bwd_sm90.py``, ``configs.Overrides.persistent_dkdv`` / ``persistent_dq``; off until timed
on a GPU).

One program per SM walks blocks in the order ``ORDER`` gives (a permutation of the ``B * H *
NK`` key blocks, or of the ``B * H * NQ`` query blocks for dQ; program ``pid`` takes entries
``pid, pid + nprog, ...``). Its partitions are those of ``bwd_sm90.py``'s one-block kernels (a
loader warp, two consumer warpgroups of 64 rows sharing one ring), each carrying the ring's
position from block to block. What one block a program leaves exposed is overlapped: as soon
as both consumers have retired their last wgmma on the block's resident operands (K and V
for dK/dV, Q and dO for dQ: ``kv_empty`` / ``q_empty``) the loader brings the next block's,
then its steps into ring slots as they free up, while the consumers finish the epilogue,
whose results leave by TMA stores from buffers of their own (waited for only when those
buffers are written again).

Transposed lists are ragged (at density 1/8 a key block's length has a ~17% deviation), so a
static walk in launch order would leave some programs far behind the mean. The launchers
hand the kernels an order table (``lists.walk_order``): by default bands of neighbouring
blocks, each dealt in pairs to the programs furthest behind (``lists.banded_order``: the
programs resident at a time read one or two heads' Q and dO, which L2 holds), or all blocks
longest first in a snake (``lists.snake_order``: every program within one block's length of
the others); ``configs.persistent_walk_is_banded`` picks.

The arithmetic is the one-block kernels', step for step (``bwd_sm90.dkdv_step``,
``dq_step``): the same bits, whatever the order (each block is one program's, no atomics).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from vidsparse.ops.block_sparse_attn.kernels.bwd_sm90 import (
    ROWS_PER_CONSUMER,
    STEP_M,
    dkdv_step,
    dq_list_of,
    dq_load_q,
    dq_load_step,
    dq_step,
    init_ring,
    load_kv,
    load_step,
    real_keys,
    step_ring,
)


@gluon.jit
def _span(Q_OFF, stride_offb, stride_offh, WIDTH, pid_bh, H, kv_block):
    """``(start, end)`` of key block ``kv_block`` of head ``pid_bh`` (b * H + h) in the
    transposed lists, clamped into ``[0, WIDTH]``; int32 offsets (``Q_OFF`` is
    ``[Bi, H, NK + 1]``: small), which keeps the consumers' registers for the accumulators."""
    row = Q_OFF + (pid_bh // H) * stride_offb + (pid_bh % H) * stride_offh + kv_block
    start = gl.minimum(gl.maximum(gl.load(row), 0), WIDTH)
    end = gl.minimum(gl.maximum(gl.load(row + 1), start), WIDTH)
    return start, end


@gluon.jit
def _persistent_loader(
    desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, k_smem, v_smem, q_smem, do_smem,
    lse_smem, dl_smem, kv_bar, kv_empty, ready, empty, ORDER, Q_OFF, Q_IDX, stride_offb,
    stride_offh, stride_qib, stride_qih, WIDTH, H, Sq, Skv, NK, Q_LAST, num_items, nprog,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Per key block: wait until the consumers have retired their last wgmma on the previous
    block's K and V, load this one's, then its steps at the ring positions that follow the
    previous block's."""
    pid = gl.program_id(0)
    r0 = pid * 0  # ring position of the block's first step (an int32 tensor)
    for t in range(pid, num_items, nprog):
        it = (t - pid) // nprog
        item = gl.load(ORDER + t)  # (b * H + h) * NK + n
        pid_bh = item // NK
        kv_block = item % NK
        start, end = _span(Q_OFF, stride_offb, stride_offh, WIDTH, pid_bh, H, kv_block)
        num_steps = (end - start) * (BLOCK_M // STEP_M)
        kv_row = pid_bh * Skv + kv_block * BLOCK_N
        # Phase it - 1 of kv_empty: the consumers done with the last K and V (the first passes).
        mbarrier.wait(kv_empty, (it & 1) ^ 1)
        load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, kv_row, 2)
        entries = (Q_IDX + (pid_bh // H).to(gl.int64) * stride_qib
                   + (pid_bh % H).to(gl.int64) * stride_qih + start)  # fmt: skip
        for j in range(num_steps):
            load_step(desc_q, desc_do, desc_lse2, desc_delta, q_smem, do_smem, lse_smem,
                      dl_smem, ready, empty, entries, j, r0 + j, Q_LAST, pid_bh * Sq, BLOCK_M,
                      STAGES)  # fmt: skip
        r0 += num_steps


@gluon.jit
def _persistent_consumer(
    desc_dk, desc_dv, k_smem, v_smem, out_smem, q_smem, do_smem, lse_smem, dl_smem, kv_bar,
    kv_empty, ready, empty, ORDER, Q_OFF, stride_offb, stride_offh, WIDTH, KV_SIZES, H, Skv, NK,
    num_items, nprog, qk_scale, scale, EPILOGUE: gl.constexpr, epilogue_args, K_INDEX: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, HAS_KV_SIZES: gl.constexpr,
):  # fmt: skip
    """dK, dV of key rows ``64 K_INDEX ..`` of each of the program's key blocks, stored
    through ``out_smem[2 K_INDEX]`` (dK) and ``[2 K_INDEX + 1]`` (dV); the last stores are
    waited for before the program ends."""
    M: gl.constexpr = ROWS_PER_CONSUMER
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, STEP_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    k = k_smem.index(K_INDEX)
    v = v_smem.index(K_INDEX)
    dk_out = out_smem.index(2 * K_INDEX)
    dv_out = out_smem.index(2 * K_INDEX + 1)
    s_zero = gl.zeros([M, STEP_M], gl.float32, layout=s_layout)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    pid = gl.program_id(0)
    r0 = pid * 0
    for t in range(pid, num_items, nprog):
        it = (t - pid) // nprog
        item = gl.load(ORDER + t)  # (b * H + h) * NK + n
        pid_bh = item // NK
        kv_block = item % NK
        start, end = _span(Q_OFF, stride_offb, stride_offh, WIDTH, pid_bh, H, kv_block)
        num_steps = (end - start) * (BLOCK_M // STEP_M)
        kv_row = pid_bh * Skv + kv_block * BLOCK_N
        real = real_keys(KV_SIZES, kv_block, s_layout, K_INDEX, HAS_KV_SIZES)
        dk = gl.zeros([M, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([M, HEAD_DIM], gl.float32, layout=acc_layout)
        mbarrier.wait(kv_bar, it & 1)  # even for an empty list: the loader's phases stay paired
        for j in range(num_steps):
            dk, dv = dkdv_step(k, v, q_smem, do_smem, lse_smem, dl_smem, ready, empty, r0 + j,
                               dk, dv, real, s_zero, qk_scale, op_layout, col_layout, STAGES,
                               HAS_KV_SIZES)  # fmt: skip
        # Every wgmma that read K and V has retired (dkdv_step waits for all): the loader may
        # bring the next block's.
        mbarrier.arrive(kv_empty)
        dk = dk * scale
        b = (pid_bh // H).to(gl.int64)
        h = (pid_bh % H).to(gl.int64)
        dk, dv = EPILOGUE(dk, dv, b, h, kv_block, dims, *epilogue_args)
        row = kv_row + K_INDEX * M
        tma.store_wait(pendings=0)  # the previous block's stores have read the buffers
        dk_out.store(dk.to(dk_out.dtype))
        fence_async_shared()  # generic-proxy stores -> visible to the TMA (async proxy)
        tma.async_copy_shared_to_global(desc_dk, [row, 0], dk_out)
        dv_out.store(dv.to(dv_out.dtype))  # while dK's TMA store runs
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_dv, [row, 0], dv_out)
        r0 += num_steps
    tma.store_wait(pendings=0)


@gluon.jit
def block_sparse_attn_bwd_dkdv_gluon_persistent_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv,
    desc_lse2, desc_delta,
    Q_OFF, Q_IDX, KV_SIZES,
    stride_offb, stride_offh, stride_qib, stride_qih,
    EPILOGUE: gl.constexpr, epilogue_args,
    H, Sq, Skv, Q_LAST, NK, WIDTH,
    qk_scale, scale,
    ORDER,  # int32 [num_items]: the key blocks (flat (b * H + h) * NK + n) in walking order
    num_items,  # B * H * NK
    nprog,  # the grid's programs (an argument: no register holds it across the partitions)
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """``bwd_sm90.block_sparse_attn_bwd_dkdv_gluon_kernel``'s arguments and results, its grid
    one program per SM (or per key block, if fewer) over ``ORDER``."""
    gl.static_assert(BLOCK_N == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_M % STEP_M == 0, "query blocks are whole steps")
    # K, V 2 x 32 KB; dK, dV's staging buffers 4 x 16 KB; the ring STAGES x 32.5 KB.
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_k.layout)  # fmt: skip
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_v.layout)  # fmt: skip
    out_smem = gl.allocate_shared_memory(desc_dk.dtype, [4, ROWS_PER_CONSUMER, HEAD_DIM],
                                         desc_dk.layout)  # fmt: skip
    q_smem, do_smem, lse_smem, dl_smem, ready, empty = step_ring(desc_q, desc_lse2, STAGES, HEAD_DIM)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_empty, count=2)  # one arrival per consumer warpgroup
    init_ring(ready, empty, STAGES, 2)
    fence_async_shared()

    # (Tuples are spelled out: concatenating them in a jit function unwraps the constexprs.)
    gl.warp_specialize(
        [
            (_persistent_consumer, (desc_dk, desc_dv, k_smem, v_smem, out_smem, q_smem, do_smem,
                                    lse_smem, dl_smem, kv_bar, kv_empty, ready, empty, ORDER,
                                    Q_OFF, stride_offb, stride_offh, WIDTH, KV_SIZES, H, Skv,
                                    NK, num_items, nprog, qk_scale,
                                    scale, EPILOGUE, epilogue_args, gl.constexpr(0), BLOCK_M,
                                    BLOCK_N, HEAD_DIM, STAGES, HAS_KV_SIZES)),
            (_persistent_consumer, (desc_dk, desc_dv, k_smem, v_smem, out_smem, q_smem, do_smem,
                                    lse_smem, dl_smem, kv_bar, kv_empty, ready, empty, ORDER,
                                    Q_OFF, stride_offb, stride_offh, WIDTH, KV_SIZES, H, Skv,
                                    NK, num_items, nprog, qk_scale,
                                    scale, EPILOGUE, epilogue_args, gl.constexpr(1), BLOCK_M,
                                    BLOCK_N, HEAD_DIM, STAGES, HAS_KV_SIZES)),
            (_persistent_loader, (desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, k_smem,
                                  v_smem, q_smem, do_smem, lse_smem, dl_smem, kv_bar, kv_empty,
                                  ready, empty, ORDER, Q_OFF, Q_IDX, stride_offb, stride_offh,
                                  stride_qib, stride_qih, WIDTH, H, Sq, Skv, NK, Q_LAST,
                                  num_items, nprog, BLOCK_M, BLOCK_N, STAGES)),
        ],
        [4, 1],  # warps: second consumer warpgroup, loader warp
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# dQ: the same walk over query blocks (the forward's lists)
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _dq_persistent_loader(
    desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, q_bar, q_empty, ready,
    empty, ORDER, lists, H, Sq, Skv, NQ, num_items, nprog, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Per query block: wait until the consumers have retired their last wgmma on the
    previous block's Q and dO, load this one's, then its key steps at the ring positions that
    follow the previous block's."""
    (KV_IDX, KV_CNT, K, stride_ib, stride_ih, stride_iq, stride_ik, stride_cb, stride_ch,
     stride_cq) = lists  # fmt: skip
    NK = Skv // BLOCK_N
    pid = gl.program_id(0)
    r0 = pid * 0
    for t in range(pid, num_items, nprog):
        it = (t - pid) // nprog
        item = gl.load(ORDER + t)  # (b * H + h) * NQ + query block
        pid_bh = item // NQ
        q_block = item % NQ
        idx_row, count = dq_list_of(KV_IDX, KV_CNT, pid_bh // H, pid_bh % H, q_block,
                                    q_block < NQ, K, stride_ib, stride_ih, stride_iq, stride_cb,
                                    stride_ch, stride_cq)  # fmt: skip
        mbarrier.wait(q_empty, (it & 1) ^ 1)  # the consumers done with the last Q, dO
        dq_load_q(desc_q, desc_do, q_smem, do_smem, q_bar, pid_bh * Sq + q_block * BLOCK_M, 2)
        num_steps = count * (BLOCK_N // STEP_M)
        for j in range(num_steps):
            dq_load_step(desc_k, desc_v, k_smem, v_smem, ready, empty, idx_row, stride_ik, j,
                         r0 + j, pid_bh * Skv, NK, BLOCK_N, STAGES)  # fmt: skip
        r0 += num_steps


@gluon.jit
def _dq_persistent_consumer(
    desc_dq, q_smem, do_smem, out_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, LSE2,
    DELTA, ORDER, lists, KV_SIZES, H, Sq, Skv, NQ, num_items, nprog, qk_scale, scale,
    EPILOGUE: gl.constexpr, epilogue_args, Q_INDEX: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
):  # fmt: skip
    """dQ of query rows ``64 Q_INDEX ..`` of each of the program's query blocks
    (``bwd_sm90.dq_step``), stored through ``out_smem[Q_INDEX]``."""
    (KV_IDX, KV_CNT, K, stride_ib, stride_ih, stride_iq, stride_ik, stride_cb, stride_ch,
     stride_cq) = lists  # fmt: skip
    M: gl.constexpr = ROWS_PER_CONSUMER
    NSUB: gl.constexpr = BLOCK_N // STEP_M
    NK = Skv // BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, STEP_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q = q_smem.index(Q_INDEX)
    do = do_smem.index(Q_INDEX)
    dq_out = out_smem.index(Q_INDEX)
    cols = gl.arange(0, STEP_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([M, STEP_M], gl.float32, layout=s_layout)
    local_rows = Q_INDEX * M + gl.arange(0, M, layout=gl.SliceLayout(1, acc_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    pid = gl.program_id(0)
    r0 = pid * 0
    for t in range(pid, num_items, nprog):
        it = (t - pid) // nprog
        item = gl.load(ORDER + t)
        pid_bh = item // NQ
        q_block = item % NQ
        b = pid_bh // H
        h = pid_bh % H
        idx_row, count = dq_list_of(KV_IDX, KV_CNT, b, h, q_block, q_block < NQ, K, stride_ib,
                                    stride_ih, stride_iq, stride_cb, stride_ch,
                                    stride_cq)  # fmt: skip
        q_row = pid_bh * Sq + q_block * BLOCK_M
        rows = q_row + Q_INDEX * M + gl.arange(0, M, layout=row_layout)
        lse2 = gl.expand_dims(gl.load(LSE2 + rows), 1)  # +inf on rows that attend to nothing
        delta = gl.expand_dims(gl.load(DELTA + rows), 1)
        dq = gl.zeros([M, HEAD_DIM], gl.float32, layout=acc_layout)
        mbarrier.wait(q_bar, it & 1)  # even for an empty list: the loader's phases stay paired
        for j in range(count * NSUB):
            dq = dq_step(q, do, k_smem, v_smem, ready, empty, j, r0 + j, dq, lse2, delta, cols,
                         s_zero, qk_scale, idx_row, stride_ik, KV_SIZES, NK, op_layout, NSUB,
                         STAGES, HAS_KV_SIZES)  # fmt: skip
        mbarrier.arrive(q_empty)  # every wgmma that read Q and dO has retired
        dq = dq * scale
        dq = EPILOGUE(dq, b.to(gl.int64), h.to(gl.int64), q_block, local_rows, dims,
                      *epilogue_args)  # fmt: skip
        tma.store_wait(pendings=0)  # the previous block's store has read the buffer
        dq_out.store(dq.to(dq_out.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_dq, [q_row + Q_INDEX * M, 0], dq_out)
        r0 += count * NSUB
    tma.store_wait(pendings=0)


@gluon.jit
def block_sparse_attn_bwd_dq_gluon_persistent_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dq,
    LSE2, DELTA,
    KV_IDX, KV_CNT, KV_SIZES,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    EPILOGUE: gl.constexpr, epilogue_args,
    H, Sq, Skv, NQ, K,
    qk_scale, scale,
    ORDER,  # int32 [num_items]: the query blocks (flat (b * H + h) * NQ + m) in walking order
    num_items,  # B * H * NQ
    nprog,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """``bwd_sm90.block_sparse_attn_bwd_dq_gluon_kernel``'s arguments and results, its grid one
    program per SM (or per query block, if fewer) over ``ORDER``."""
    gl.static_assert(BLOCK_M == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_N % STEP_M == 0, "key blocks are whole steps")
    lists = (KV_IDX, KV_CNT, K, stride_ib, stride_ih, stride_iq, stride_ik, stride_cb,
             stride_ch, stride_cq)  # fmt: skip
    # Q, dO 2 x 32 KB; dQ's staging buffers 2 x 16 KB; the ring STAGES x 32 KB.
    q_smem = gl.allocate_shared_memory(desc_q.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_q.layout)  # fmt: skip
    do_smem = gl.allocate_shared_memory(desc_q.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                        desc_q.layout)  # fmt: skip
    out_smem = gl.allocate_shared_memory(desc_dq.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                         desc_dq.layout)  # fmt: skip
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES, STEP_M, HEAD_DIM], desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES, STEP_M, HEAD_DIM], desc_v.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)  # one arrival per consumer warpgroup
    init_ring(ready, empty, STAGES, 2)
    fence_async_shared()

    gl.warp_specialize(
        [
            (_dq_persistent_consumer, (desc_dq, q_smem, do_smem, out_smem, k_smem, v_smem, q_bar,
                                       q_empty, ready, empty, LSE2, DELTA, ORDER, lists,
                                       KV_SIZES, H, Sq, Skv, NQ, num_items, nprog, qk_scale,
                                       scale, EPILOGUE, epilogue_args, gl.constexpr(0), BLOCK_M,
                                       BLOCK_N, HEAD_DIM, STAGES, HAS_KV_SIZES)),
            (_dq_persistent_consumer, (desc_dq, q_smem, do_smem, out_smem, k_smem, v_smem, q_bar,
                                       q_empty, ready, empty, LSE2, DELTA, ORDER, lists,
                                       KV_SIZES, H, Sq, Skv, NQ, num_items, nprog, qk_scale,
                                       scale, EPILOGUE, epilogue_args, gl.constexpr(1), BLOCK_M,
                                       BLOCK_N, HEAD_DIM, STAGES, HAS_KV_SIZES)),
            (_dq_persistent_loader, (desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem,
                                     v_smem, q_bar, q_empty, ready, empty, ORDER, lists, H, Sq,
                                     Skv, NQ, num_items, nprog, BLOCK_M, BLOCK_N, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip

