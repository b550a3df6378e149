"""The Hopper (sm_90) backward kernels of block-sparse flash attention, in Gluon (launcher:
``../bwd_sm90.py``): dK/dV over the transposed lists, and dQ over the lists. The engine's
backward (``bwd.py``) takes them where their configs say ``gluon`` and the inputs fit.

The arithmetic of the Triton ``_dkdv_program`` (``kernels/bwd.py``) at square 128 or 64
blocks, D = 128, 16-bit inputs, written as FlashAttention-3's backward schedule:

- a loader warp reads the program's K and V once, then walks the key block's *transposed*
  list (the query blocks that list it, ``q_offsets`` / ``q_indices``) and issues TMA copies of
  each 64-row query step's Q, dO, lse2 and delta into a ``STAGES``-deep ring; ``ready[s]``
  says slot s landed, ``empty[s]`` that its consumers released it;
- each consumer warpgroup owns 64 key rows and keeps their dK and dV in registers (fp32,
  [64, D] each) across the whole list. Per step: ``S^T = K Q^T`` and ``dP^T = V dO^T`` from
  shared memory (issued together), ``P^T = exp2(S^T * scale - lse2)``, ``dV += P^T dO`` issued
  as soon as P^T is in registers (it runs while dS^T is formed), ``dS^T = P^T (dP^T -
  delta)``, ``dK += dS^T Q``; both register-A wgmmas are retired before the slot is released
  and before the next step writes any register (ptxas does not keep the A operand of an
  in-flight wgmma reserved: see ``kernels/fwd_sm90.py``);
- after the list: ``dK *= scale``, the declared epilogue's dK/dV hook, and a TMA store of
  each 64-row half through the K / V buffers (dead by then).

At 128x128 one program owns one key block, split over the two consumers (rows 0-63, 64-127),
which share one ring (``empty`` counts two arrivals). At 64x64 (video tiles) a program owns
two key blocks (2 pid, 2 pid + 1), each with its own list, ring and loader warp, one per
consumer, as the Gluon forward's tiles kernel does. No atomics: each program writes only its
own key rows, so the result is bit-identical across runs.

The dQ kernel is the same step seen from the query side: a loader warp reads the program's Q
and dO once and walks the query block's list in 64-key steps (K and V of one step per ring
slot); each consumer warpgroup owns 64 query rows and keeps their dQ in registers. Per step
``S = Q K^T`` and ``dP = dO V^T`` are issued together, then ``P`` (0 on padding keys: the
step's ``KV_SIZES``), ``dS = P (dP - delta)`` and ``dQ += dS K``; after the list ``dQ *=
scale``, the dQ hook and a TMA store through Q's buffer. At 128x128 one query block a program,
split over the consumers; at 64x64 two, each with its own list, ring and loader.

Memory safety whatever the lists hold: the list bounds (counts) are clamped into ``[0, width]``
(width: the lists' last dim) and each entry into ``[0, NQ)`` (dK/dV) or ``[0, NK)`` (dQ) in the
loader, so a spoiled list reads rows of this (b, h) only: a wrong result, never a fault.
Padding keys (``KV_SIZES``, dK/dV): their probabilities and dS are selected to 0, so what TMA
reads there never reaches dK, dV.
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

# Key rows each consumer warpgroup owns: a wgmma tile is 64 rows per warpgroup.
ROWS_PER_CONSUMER = gl.constexpr(64)
# Query rows per step (one ring slot): S^T and dP^T are [64, 64] fp32 (32 registers each), so
# two of them, P^T's and dS^T's A operands and the dK, dV accumulators fit in 240 registers.
STEP_M = gl.constexpr(64)


# ---------------------------------------------------------------------------------------------
# Loader partition: 1 warp, issues every TMA copy of its consumers.
# ---------------------------------------------------------------------------------------------


@gluon.jit
def load_steps(
    desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, k_smem, v_smem, q_smem, do_smem,
    lse_smem, dl_smem, kv_bar, ready, empty, idx_row, start, end, Q_LAST, q_row0, kv_row,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, KV_TILES: gl.constexpr,
):  # fmt: skip
    """K and V (``KV_TILES`` 64-row tiles from global row ``kv_row``) once, then Q, dO, lse2 and
    delta of every step of list entries ``[start, end)`` into ring slot ``step % STAGES``.
    ``q_row0``: first row of this (b, h)'s queries in the [B*H*Sq, D] view; ``Q_LAST``: the
    last query block (a kernel argument, NQ - 1: computed in the kernel, ptxas kept it across
    the loader's register handover in local memory)."""
    load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, kv_row, KV_TILES)
    entries = idx_row + start  # this key block's list (few live scalars: 24 registers)
    for j in range((end - start) * (BLOCK_M // STEP_M)):
        load_step(desc_q, desc_do, desc_lse2, desc_delta, q_smem, do_smem, lse_smem, dl_smem,
                  ready, empty, entries, j, j, Q_LAST, q_row0, BLOCK_M, STAGES)  # fmt: skip


@gluon.jit
def load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, kv_row, KV_TILES: gl.constexpr):
    """K and V of a key block (``KV_TILES`` 64-row tiles from global row ``kv_row``)."""
    mbarrier.expect(kv_bar, KV_TILES * (desc_k.block_type.nbytes + desc_v.block_type.nbytes))
    for i in gl.static_range(KV_TILES):
        tma.async_copy_global_to_shared(
            desc_k, [kv_row + i * ROWS_PER_CONSUMER, 0], kv_bar, k_smem.index(i)
        )
        tma.async_copy_global_to_shared(
            desc_v, [kv_row + i * ROWS_PER_CONSUMER, 0], kv_bar, v_smem.index(i)
        )


@gluon.jit
def step_query_row(entries, j, Q_LAST, q_row0, BLOCK_M: gl.constexpr):
    """Step ``j``'s first query row in the ``[B*H*Sq]`` rows: its query block from the list
    at ``entries`` (clamped to ``[0, Q_LAST]``: never another head's rows) and its 64-row step
    in the block. The loader and any partition that needs the step's row compute it alike."""
    NSUB: gl.constexpr = BLOCK_M // STEP_M
    q_block = gl.load(entries + j // NSUB)  # scalar int32 query-block index
    q_block = gl.minimum(gl.maximum(q_block, 0), Q_LAST)
    return q_row0 + q_block * BLOCK_M + (j % NSUB) * STEP_M


@gluon.jit
def load_step(
    desc_q, desc_do, desc_lse2, desc_delta, q_smem, do_smem, lse_smem, dl_smem, ready, empty,
    entries, j, r, Q_LAST, q_row0, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Q, dO, lse2 and delta of step ``j`` of the list at ``entries`` into the ring's position
    ``r`` (slot ``r % STAGES``; one block a program: r = j). Returns the step's first query
    row in the ``[B*H*Sq]`` rows, for a caller that loads more of it."""
    STEP_BYTES: gl.constexpr = (desc_q.block_type.nbytes + desc_do.block_type.nbytes
                                 + desc_lse2.block_type.nbytes
                                 + desc_delta.block_type.nbytes)  # fmt: skip
    slot = r % STAGES
    # Use u = r // STAGES of a slot waits for the release of use u - 1 (parity (u - 1) & 1);
    # for u = 0, parity 1 names the phase before the first and passes at once.
    empty_parity = ((r // STAGES) & 1) ^ 1
    row = step_query_row(entries, j, Q_LAST, q_row0, BLOCK_M)
    mbarrier.wait(empty.index(slot), empty_parity)
    # One barrier for all four: every GEMM of the step needs Q or dO, and the softmax rows are
    # tiny (256 bytes each).
    bar = ready.index(slot)
    mbarrier.expect(bar, STEP_BYTES)
    tma.async_copy_global_to_shared(desc_q, [row, 0], bar, q_smem.index(slot))
    tma.async_copy_global_to_shared(desc_do, [row, 0], bar, do_smem.index(slot))
    tma.async_copy_global_to_shared(desc_lse2, [row], bar, lse_smem.index(slot))
    tma.async_copy_global_to_shared(desc_delta, [row], bar, dl_smem.index(slot))
    return row


# ---------------------------------------------------------------------------------------------
# Consumer partitions: one warpgroup each, 64 key rows each.
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _consumer(
    desc_dk, desc_dv, k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, kv_bar, ready, empty,
    num_steps, KV_SIZES, kv_block, kv_row, valid, b, h, qk_scale, scale,
    EPILOGUE: gl.constexpr, epilogue_args, K_INDEX: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, HAS_KV_SIZES: gl.constexpr,
):  # fmt: skip
    """dK, dV of key rows ``k_smem[K_INDEX]`` (rows ``64 K_INDEX ..`` of key block
    ``kv_block``, global row ``kv_row + 64 K_INDEX``) over ``num_steps`` ring steps, stored only
    if ``valid`` after the declared ``EPILOGUE``."""
    M: gl.constexpr = ROWS_PER_CONSUMER
    # wgmma accumulator layouts of this 4-warp partition: [64, STEP_M] for S^T and dP^T,
    # [64, D] for dK and dV. P^T and dS^T feed the dV / dK wgmmas from registers (A operand
    # of the [64, D] layout: a register-only repack from the S^T layout).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, STEP_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query row

    k = k_smem.index(K_INDEX)  # [64, D], A operand of S^T = K Q^T
    v = v_smem.index(K_INDEX)  # [64, D], A operand of dP^T = V dO^T
    dk = gl.zeros([M, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([M, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([M, STEP_M], gl.float32, layout=s_layout)  # ignored acc (use_acc=False)
    real = real_keys(KV_SIZES, kv_block, s_layout, K_INDEX, HAS_KV_SIZES)

    # Wait for K and V even when the list is empty: the store reuses their buffers, and the
    # loader's TMA into them must have landed before we overwrite them.
    mbarrier.wait(kv_bar, 0)
    for j in range(num_steps):
        dk, dv = dkdv_step(k, v, q_smem, do_smem, lse_smem, dl_smem, ready, empty, j, dk, dv,
                           real, s_zero, qk_scale, op_layout, col_layout, STAGES,
                           HAS_KV_SIZES)  # fmt: skip

    if valid:
        dk = dk * scale
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))  # [D]
        dk, dv = EPILOGUE(dk, dv, b.to(gl.int64), h.to(gl.int64), kv_block, dims,
                          *epilogue_args)  # fmt: skip
        # K and V are dead (every wgmma that read them has retired): they stage the stores.
        row = kv_row + K_INDEX * M
        k.store(dk.to(k.dtype))
        fence_async_shared()  # generic-proxy stores -> visible to the TMA (async proxy)
        tma.async_copy_shared_to_global(desc_dk, [row, 0], k)
        v.store(dv.to(v.dtype))  # while dK's TMA store runs
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_dv, [row, 0], v)
        tma.store_wait(pendings=0)


@gluon.jit
def real_keys(KV_SIZES, kv_block, s_layout: gl.constexpr, K_INDEX: gl.constexpr,
              HAS_KV_SIZES: gl.constexpr):  # fmt: skip
    """[64, 1]: which of this consumer's key rows are real (below the block's size), or 0
    when there are no key-block sizes (every row is)."""
    if HAS_KV_SIZES:
        M: gl.constexpr = ROWS_PER_CONSUMER
        key_rows = K_INDEX * M + gl.arange(0, M, layout=gl.SliceLayout(1, s_layout))
        return gl.expand_dims(key_rows < gl.load(KV_SIZES + kv_block), 1)
    else:
        return 0


@gluon.jit
def dkdv_step(
    k, v, q_smem, do_smem, lse_smem, dl_smem, ready, empty, r, dk, dv, real, s_zero, qk_scale,
    op_layout: gl.constexpr, col_layout: gl.constexpr, STAGES: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
):  # fmt: skip
    """One 64-query step at the ring's position ``r``: ``(dk, dv)`` with its share added; the
    slot released once both register-A wgmmas have retired."""
    slot = r % STAGES
    mbarrier.wait(ready.index(slot), (r // STAGES) & 1)
    q = q_smem.index(slot)  # [STEP_M, D]
    do = do_smem.index(slot)
    s_tok = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    lse2 = gl.expand_dims(lse_smem.index(slot).load(col_layout), 0)  # [1, STEP_M]
    delta = gl.expand_dims(dl_smem.index(slot).load(col_layout), 0)
    # wgmma groups retire in order: with one outstanding, S^T (issued first) is done.
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
    p = gl.exp2(s * qk_scale - lse2)  # [64, STEP_M]; lse2 = +inf on empty rows: p = 0
    if HAS_KV_SIZES:
        p = gl.where(real, p, 0.0)
    p_op = gl.convert_layout(p.to(q.dtype), op_layout)
    dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)  # dV += P^T dO, while dS^T forms
    dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok,))  # dP^T done, dV in flight
    ds = p * (dp - delta)
    if HAS_KV_SIZES:  # whatever the padding rows of V hold, their dS is 0
        ds = gl.where(real, ds, 0.0)
    ds_op = gl.convert_layout(ds.to(q.dtype), op_layout)
    dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)  # dK += dS^T Q
    # Both register-A wgmmas retired: their operands may be overwritten, the slot reused.
    dv, dk, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, p_op, ds_op))
    mbarrier.arrive(empty.index(slot))
    return dk, dv


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@gluon.jit
def transposed_list_of(Q_OFF, Q_IDX, b, h, kv_block, valid, WIDTH, stride_offb, stride_offh,
             stride_qib, stride_qih):  # fmt: skip
    """``(list pointer, start, end)`` of key block ``kv_block`` in the transposed lists; an
    invalid block (past the last one) lists nothing. Bounds clamped into ``[0, WIDTH]``."""
    b = b.to(gl.int64)
    h = h.to(gl.int64)
    off_row = Q_OFF + b * stride_offb + h * stride_offh + kv_block
    start = gl.load(off_row, mask=valid, other=0)
    end = gl.load(off_row + 1, mask=valid, other=0)
    start = gl.minimum(gl.maximum(start, 0), WIDTH)
    end = gl.minimum(gl.maximum(end, start), WIDTH)
    return Q_IDX + b * stride_qib + h * stride_qih, start, end


@gluon.jit
def key_block(pid_n, pid_bh, H, Skv, NK, lists, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr):  # fmt: skip
    """``(b, h, first row, valid, list pointer, start, end, steps)`` of key block ``pid_n`` of
    head ``pid_bh`` (its first row in the [B*H*Skv, D] view; valid: a block of the grid, always
    for a grid of NK programs along dim 0); ``lists``: the transposed lists, their strides and
    width."""
    Q_OFF, Q_IDX, stride_offb, stride_offh, stride_qib, stride_qih, WIDTH = lists
    b = pid_bh // H
    h = pid_bh % H
    kv_row = pid_bh * Skv + pid_n * BLOCK_N
    valid = pid_n < NK
    idx_row, start, end = transposed_list_of(Q_OFF, Q_IDX, b, h, pid_n, valid, WIDTH,
                                             stride_offb, stride_offh, stride_qib,
                                             stride_qih)  # fmt: skip
    return b, h, kv_row, valid, idx_row, start, end, (end - start) * (BLOCK_M // STEP_M)


@gluon.jit
def init_ring(ready, empty, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the loader's expect; TMA bytes complete it
        mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup


@gluon.jit
def step_ring(desc_q, desc_lse2, STAGES: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Shared memory of one ring: Q, dO [STAGES, 64, D], lse2, delta [STAGES, 64]; barriers."""
    q_smem = gl.allocate_shared_memory(desc_q.dtype, [STAGES, STEP_M, HEAD_DIM], desc_q.layout)
    do_smem = gl.allocate_shared_memory(desc_q.dtype, [STAGES, STEP_M, HEAD_DIM], desc_q.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, STEP_M], desc_lse2.layout)
    dl_smem = gl.allocate_shared_memory(gl.float32, [STAGES, STEP_M], desc_lse2.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    return q_smem, do_smem, lse_smem, dl_smem, ready, empty


@gluon.jit
def block_sparse_attn_bwd_dkdv_gluon_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv,  # TMA over [B*H*S, D], blocks [64, D]
    desc_lse2, desc_delta,  # TMA over fp32 [B*H*Sq], blocks [64]
    Q_OFF, Q_IDX, KV_SIZES,  # int32 [Bi, H, NK + 1], [Bi, H, WIDTH]; [NK] (HAS_KV_SIZES)
    stride_offb, stride_offh, stride_qib, stride_qih,  # stride_*b == 0: lists broadcast
    EPILOGUE: gl.constexpr, epilogue_args,  # dk, dv = EPILOGUE(dk, dv, ..., *epilogue_args)
    H, Sq, Skv, Q_LAST, NK, WIDTH,  # Q_LAST: NQ - 1, the last query block
    qk_scale, scale,  # softmax scale * log2(e) and the scale, fp32
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """Grid ``(NK, B * H)``: a 128-row key block per program, its two 64-row halves on the two
    consumer warpgroups, one list and one ring."""
    gl.static_assert(BLOCK_N == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_M % STEP_M == 0, "query blocks are whole steps")
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    lists = (Q_OFF, Q_IDX, stride_offb, stride_offh, stride_qib, stride_qih, WIDTH)
    b, h, kv_row, valid, idx_row, start, end, num_steps = key_block(pid_n, pid_bh, H, Skv, NK,
                                                                    lists, BLOCK_M, BLOCK_N)

    # K, V (also dK, dV's staging buffers) 2 x 32 KB; the ring STAGES x 32.5 KB.
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_k.layout)  # fmt: skip
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_v.layout)  # fmt: skip
    q_smem, do_smem, lse_smem, dl_smem, ready, empty = step_ring(desc_q, desc_lse2, STAGES, HEAD_DIM)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    init_ring(ready, empty, STAGES, 2)
    fence_async_shared()  # barrier inits visible to the async proxy before any TMA uses them

    # (Tuples are spelled out: concatenating them in a jit function unwraps the constexprs.)
    gl.warp_specialize(
        [
            (_consumer, (desc_dk, desc_dv, k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem,
                         kv_bar, ready, empty, num_steps, KV_SIZES, pid_n, kv_row, valid, b, h,
                         qk_scale, scale, EPILOGUE, epilogue_args, gl.constexpr(0), HEAD_DIM,
                         STAGES, HAS_KV_SIZES)),  # default partition: key rows 0-63
            (_consumer, (desc_dk, desc_dv, k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem,
                         kv_bar, ready, empty, num_steps, KV_SIZES, pid_n, kv_row, valid, b, h,
                         qk_scale, scale, EPILOGUE, epilogue_args, gl.constexpr(1), HEAD_DIM,
                         STAGES, HAS_KV_SIZES)),  # key rows 64-127
            (load_steps, (desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, k_smem, v_smem,
                         q_smem, do_smem, lse_smem, dl_smem, kv_bar, ready, empty, idx_row, start,
                         end, Q_LAST, pid_bh * Sq, kv_row, BLOCK_M, STAGES, gl.constexpr(2))),
        ],
        [4, 1],  # warps: second consumer warpgroup, loader warp
        [CONSUMER_REGS, LOADER_REGS],  # setmaxnreg: the loader gives its registers away
    )  # fmt: skip


@gluon.jit
def block_sparse_attn_bwd_dkdv_gluon_tiles_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv,
    desc_lse2, desc_delta,
    Q_OFF, Q_IDX, KV_SIZES,
    stride_offb, stride_offh, stride_qib, stride_qih,
    EPILOGUE: gl.constexpr, epilogue_args,
    H, Sq, Skv, Q_LAST, NK, WIDTH,
    qk_scale, scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """Grid ``(ceil(NK / 2), B * H)``: two 64-row key blocks per program (video tiles: 2 pid
    and 2 pid + 1), each with its own list, ring and loader warp, one per consumer warpgroup.
    The consumers do not take turns (their lists differ in length)."""
    gl.static_assert(BLOCK_N == ROWS_PER_CONSUMER, "one consumer warpgroup per 64-row block")
    gl.static_assert(BLOCK_M % STEP_M == 0, "query blocks are whole steps")
    NSUB: gl.constexpr = BLOCK_M // STEP_M
    pid = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    block0 = 2 * pid
    block1 = 2 * pid + 1
    valid0 = block0 < NK
    valid1 = block1 < NK  # false in the last program when NK is odd
    idx0, start0, end0 = transposed_list_of(Q_OFF, Q_IDX, b, h, block0, valid0, WIDTH,
                                                stride_offb, stride_offh, stride_qib,
                                                stride_qih)  # fmt: skip
    idx1, start1, end1 = transposed_list_of(Q_OFF, Q_IDX, b, h, block1, valid1, WIDTH,
                                                stride_offb, stride_offh, stride_qib,
                                                stride_qih)  # fmt: skip
    # Past the last block (NK odd) the loader still reads a K/V tile (rows of the next head,
    # or zeros past the tensor: TMA bounds) so the consumer's wait completes; its list is
    # empty and nothing is stored.
    kv_row0 = pid_bh * Skv + block0 * BLOCK_N
    kv_row1 = pid_bh * Skv + block1 * BLOCK_N

    # Per consumer: K, V 2 x 16 KB; its ring STAGES x 32.5 KB.
    k_smem0 = gl.allocate_shared_memory(desc_k.dtype, [1, BLOCK_N, HEAD_DIM], desc_k.layout)
    v_smem0 = gl.allocate_shared_memory(desc_v.dtype, [1, BLOCK_N, HEAD_DIM], desc_v.layout)
    k_smem1 = gl.allocate_shared_memory(desc_k.dtype, [1, BLOCK_N, HEAD_DIM], desc_k.layout)
    v_smem1 = gl.allocate_shared_memory(desc_v.dtype, [1, BLOCK_N, HEAD_DIM], desc_v.layout)
    q_smem0, do_smem0, lse_smem0, dl_smem0, ready0, empty0 = step_ring(desc_q, desc_lse2, STAGES,
                                                                       HEAD_DIM)  # fmt: skip
    q_smem1, do_smem1, lse_smem1, dl_smem1, ready1, empty1 = step_ring(desc_q, desc_lse2, STAGES,
                                                                       HEAD_DIM)  # fmt: skip
    kv_bar0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar0, count=1)
    mbarrier.init(kv_bar1, count=1)
    init_ring(ready0, empty0, STAGES, 1)
    init_ring(ready1, empty1, STAGES, 1)
    fence_async_shared()

    gl.warp_specialize(
        [
            (_consumer, (desc_dk, desc_dv, k_smem0, v_smem0, q_smem0, do_smem0, lse_smem0,
                         dl_smem0, kv_bar0, ready0, empty0, (end0 - start0) * NSUB, KV_SIZES,
                         block0, kv_row0, valid0, b, h, qk_scale, scale, EPILOGUE,
                         epilogue_args, gl.constexpr(0), HEAD_DIM, STAGES, HAS_KV_SIZES)),
            (_consumer, (desc_dk, desc_dv, k_smem1, v_smem1, q_smem1, do_smem1, lse_smem1,
                         dl_smem1, kv_bar1, ready1, empty1, (end1 - start1) * NSUB, KV_SIZES,
                         block1, kv_row1, valid1, b, h, qk_scale, scale, EPILOGUE,
                         epilogue_args, gl.constexpr(0), HEAD_DIM, STAGES, HAS_KV_SIZES)),
            (load_steps, (desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, k_smem0,
                         v_smem0, q_smem0, do_smem0, lse_smem0, dl_smem0, kv_bar0, ready0, empty0,
                         idx0, start0, end0, Q_LAST, pid_bh * Sq, kv_row0, BLOCK_M, STAGES,
                         gl.constexpr(1))),
            (load_steps, (desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, k_smem1,
                         v_smem1, q_smem1, do_smem1, lse_smem1, dl_smem1, kv_bar1, ready1, empty1,
                         idx1, start1, end1, Q_LAST, pid_bh * Sq, kv_row1, BLOCK_M, STAGES,
                         gl.constexpr(1))),
        ],
        [4, 1, 1],  # warps: second consumer warpgroup, two loader warps
        [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# dQ: a query block a program (128 rows) or two (64-row tiles), its key blocks in 64-row steps
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _dq_loader(
    desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty,
    idx_row, stride_ik, count, q_row, kv_row0, NK, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    Q_TILES: gl.constexpr,
):  # fmt: skip
    """Q and dO (``Q_TILES`` 64-row tiles each) once, then K and V of every step: listed key
    block ``j // NSUB``, its rows ``64 (j % NSUB) ..``, into ring slot ``j % STAGES``."""
    dq_load_q(desc_q, desc_do, q_smem, do_smem, q_bar, q_row, Q_TILES)
    for j in range(count * (BLOCK_N // STEP_M)):
        dq_load_step(desc_k, desc_v, k_smem, v_smem, ready, empty, idx_row, stride_ik, j, j,
                     kv_row0, NK, BLOCK_N, STAGES)  # fmt: skip


@gluon.jit
def dq_load_q(desc_q, desc_do, q_smem, do_smem, q_bar, q_row, Q_TILES: gl.constexpr):
    """Q and dO of a query block (``Q_TILES`` 64-row tiles each from global row ``q_row``)."""
    mbarrier.expect(q_bar, Q_TILES * (desc_q.block_type.nbytes + desc_do.block_type.nbytes))
    for i in gl.static_range(Q_TILES):
        row = q_row + i * ROWS_PER_CONSUMER
        tma.async_copy_global_to_shared(desc_q, [row, 0], q_bar, q_smem.index(i))
        tma.async_copy_global_to_shared(desc_do, [row, 0], q_bar, do_smem.index(i))


@gluon.jit
def dq_load_step(
    desc_k, desc_v, k_smem, v_smem, ready, empty, idx_row, stride_ik, j, r, kv_row0, NK,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """K and V of step ``j`` (listed key block ``j // NSUB``, its rows ``64 (j % NSUB) ..``)
    into the ring's position ``r`` (slot ``r % STAGES``; one block a program: r = j)."""
    NSUB: gl.constexpr = BLOCK_N // STEP_M
    STEP_BYTES: gl.constexpr = desc_k.block_type.nbytes + desc_v.block_type.nbytes
    slot = r % STAGES
    empty_parity = ((r // STAGES) & 1) ^ 1  # as in load_step
    kv_block = _listed_block(idx_row, stride_ik, j // NSUB, NK)
    row = kv_row0 + kv_block * BLOCK_N + (j % NSUB) * STEP_M
    mbarrier.wait(empty.index(slot), empty_parity)
    bar = ready.index(slot)
    mbarrier.expect(bar, STEP_BYTES)  # S and dP need K and V together: one barrier
    tma.async_copy_global_to_shared(desc_k, [row, 0], bar, k_smem.index(slot))
    tma.async_copy_global_to_shared(desc_v, [row, 0], bar, v_smem.index(slot))


@gluon.jit
def _listed_block(idx_row, stride_ik, entry, NK):
    """Key block of list entry ``entry``, clamped into ``[0, NK)`` (never another head's
    rows), as the loader and the consumers both read it."""
    kv_block = gl.load(idx_row + entry * stride_ik)  # scalar int32
    return gl.minimum(gl.maximum(kv_block, 0), NK - 1)


@gluon.jit
def _dq_consumer(
    desc_dq, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, LSE2, DELTA, num_steps,
    q_row, valid, b, h, q_block, idx_row, stride_ik, KV_SIZES, NK, qk_scale, scale,
    EPILOGUE: gl.constexpr, epilogue_args, Q_INDEX: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_KV_SIZES: gl.constexpr,
    PAST_LAST_BLOCK: gl.constexpr,
):  # fmt: skip
    """dQ of query rows ``q_smem[Q_INDEX]`` (global rows from ``q_row + 64 Q_INDEX``, rows
    ``64 Q_INDEX ..`` of query block ``q_block``) over ``num_steps`` ring steps of 64 keys,
    stored only if ``valid`` after the declared ``EPILOGUE``. Per step: ``S = Q K^T`` and
    ``dP = dO V^T`` issued together, ``P = exp2(S scale - lse2)`` (with ``HAS_KV_SIZES`` 0
    on the step's padding keys: ``KV_SIZES`` of its listed block), ``dS = P (dP - delta)``,
    ``dQ += dS K`` (dS from registers), retired before the slot is released and before the
    next step writes any register (the A-operand hazard of ``kernels/fwd_sm90.py``).
    ``PAST_LAST_BLOCK``: the program may hold a block past the last one (``valid`` false)."""
    M: gl.constexpr = ROWS_PER_CONSUMER
    NSUB: gl.constexpr = BLOCK_N // STEP_M
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, STEP_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # one value per query row

    q = q_smem.index(Q_INDEX)  # [64, D], A operand of S = Q K^T
    do = do_smem.index(Q_INDEX)  # [64, D], A operand of dP = dO V^T
    rows = q_row + Q_INDEX * M + gl.arange(0, M, layout=row_layout)  # [64] global rows
    # lse2 = +inf on rows that attend to nothing (the preprocess): their P, dS are 0.
    if PAST_LAST_BLOCK:  # ``valid`` false: the rows may lie past the tensor, read nothing
        lse2 = gl.load(LSE2 + rows, mask=valid, other=0.0)
        delta = gl.load(DELTA + rows, mask=valid, other=0.0)
    else:
        lse2 = gl.load(LSE2 + rows)
        delta = gl.load(DELTA + rows)
    lse2 = gl.expand_dims(lse2, 1)  # [64, 1]
    delta = gl.expand_dims(delta, 1)
    cols = gl.arange(0, STEP_M, layout=gl.SliceLayout(0, s_layout))  # [64] key slots of a step
    dq = gl.zeros([M, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([M, STEP_M], gl.float32, layout=s_layout)  # ignored acc (use_acc=False)

    # Wait for Q and dO even when the list is empty: the store reuses Q's buffer.
    mbarrier.wait(q_bar, 0)
    for j in range(num_steps):
        dq = dq_step(q, do, k_smem, v_smem, ready, empty, j, j, dq, lse2, delta, cols, s_zero,
                     qk_scale, idx_row, stride_ik, KV_SIZES, NK, op_layout, NSUB, STAGES,
                     HAS_KV_SIZES)  # fmt: skip

    if valid:
        dq = dq * scale
        local_rows = Q_INDEX * M + gl.arange(0, M, layout=gl.SliceLayout(1, acc_layout))
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))  # [D]
        dq = EPILOGUE(dq, b.to(gl.int64), h.to(gl.int64), q_block, local_rows, dims,
                      *epilogue_args)  # fmt: skip
        # Q is dead (every S wgmma has retired): it stages the store.
        q.store(dq.to(q.dtype))
        fence_async_shared()  # generic-proxy stores -> visible to the TMA (async proxy)
        tma.async_copy_shared_to_global(desc_dq, [q_row + Q_INDEX * M, 0], q)
        tma.store_wait(pendings=0)


@gluon.jit
def dq_step(
    q, do, k_smem, v_smem, ready, empty, j, r, dq, lse2, delta, cols, s_zero, qk_scale, idx_row,
    stride_ik, KV_SIZES, NK, op_layout: gl.constexpr, NSUB: gl.constexpr, STAGES: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
):  # fmt: skip
    """Step ``j`` of the list (64 keys) at the ring's position ``r``: ``dq`` with its share
    added; the slot released once the register-A wgmma has retired."""
    slot = r % STAGES
    if HAS_KV_SIZES:  # the step's real keys, read while the slot may still be landing
        size = gl.load(KV_SIZES + _listed_block(idx_row, stride_ik, j // NSUB, NK))
        limit = size - (j % NSUB) * STEP_M
    mbarrier.wait(ready.index(slot), (r // STAGES) & 1)
    k = k_smem.index(slot)  # [64 keys, D]
    v = v_smem.index(slot)
    s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # S (issued first) is done
    p = gl.exp2(s * qk_scale - lse2)  # [64, 64]
    if HAS_KV_SIZES:  # whatever TMA read for the padding keys, their P and dS are 0
        p = gl.where(gl.expand_dims(cols < limit, 0), p, 0.0)
    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
    ds_op = gl.convert_layout((p * (dp - delta)).to(q.dtype), op_layout)
    dq_tok = warpgroup_mma(ds_op, k, dq, is_async=True)  # dQ += dS K
    dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ds_op))
    mbarrier.arrive(empty.index(slot))
    return dq


@gluon.jit
def dq_list_of(KV_IDX, KV_CNT, b, h, q_block, valid, K, stride_ib, stride_ih, stride_iq,
                stride_cb, stride_ch, stride_cq):  # fmt: skip
    """``(list pointer, count)`` of query block ``q_block``; an invalid block lists nothing.
    The count is clamped into ``[0, K]``."""
    b = b.to(gl.int64)
    h = h.to(gl.int64)
    q_block = q_block.to(gl.int64)
    idx_row = KV_IDX + b * stride_ib + h * stride_ih + q_block * stride_iq
    count = gl.load(KV_CNT + b * stride_cb + h * stride_ch + q_block * stride_cq, mask=valid,
                    other=0)  # fmt: skip
    return idx_row, gl.minimum(gl.maximum(count, 0), K)


@gluon.jit
def block_sparse_attn_bwd_dq_gluon_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dq,  # TMA over [B*H*S, D], blocks [64, D]
    LSE2, DELTA,  # fp32 [B*H*Sq]
    KV_IDX, KV_CNT, KV_SIZES,  # int32 [Bi, H, NQ, K], [Bi, H, NQ]; [NK] (HAS_KV_SIZES)
    stride_ib, stride_ih, stride_iq, stride_ik,  # stride_ib == 0 when lists broadcast over batch
    stride_cb, stride_ch, stride_cq,
    EPILOGUE: gl.constexpr, epilogue_args,  # dq = EPILOGUE(dq, b, h, q_block, local_rows, dims, ...)
    H, Sq, Skv, NQ, K,  # K: the lists' width (bound of every count)
    qk_scale, scale,  # softmax scale * log2(e) and the scale, fp32
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """Grid ``(NQ, B * H)``: a 128-row query block per program, its two 64-row halves on the
    two consumer warpgroups, one list and one ring of 64-key steps."""
    gl.static_assert(BLOCK_M == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_N % STEP_M == 0, "key blocks are whole steps")
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_row = pid_bh * Sq + pid_m * BLOCK_M
    valid = pid_m < NQ  # always: the grid has NQ programs along dim 0
    NK = Skv // BLOCK_N
    idx_row, count = dq_list_of(KV_IDX, KV_CNT, b, h, pid_m, valid, K, stride_ib, stride_ih,
                                 stride_iq, stride_cb, stride_ch, stride_cq)  # fmt: skip
    num_steps = count * (BLOCK_N // STEP_M)

    # Q, dO 2 x 32 KB (Q also dQ's staging buffer); the ring STAGES x 32 KB.
    q_smem = gl.allocate_shared_memory(desc_q.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_q.layout)  # fmt: skip
    do_smem = gl.allocate_shared_memory(desc_q.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                        desc_q.layout)  # fmt: skip
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES, STEP_M, HEAD_DIM], desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES, STEP_M, HEAD_DIM], desc_v.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    init_ring(ready, empty, STAGES, 2)
    fence_async_shared()  # barrier inits visible to the async proxy before any TMA uses them

    gl.warp_specialize(
        [
            (_dq_consumer, (desc_dq, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, LSE2,
                            DELTA, num_steps, q_row, valid, b, h, pid_m, idx_row, stride_ik,
                            KV_SIZES, NK, qk_scale, scale, EPILOGUE, epilogue_args,
                            gl.constexpr(0), BLOCK_N, HEAD_DIM, STAGES, HAS_KV_SIZES,
                            gl.constexpr(False))),  # default partition: query rows 0-63
            (_dq_consumer, (desc_dq, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, LSE2,
                            DELTA, num_steps, q_row, valid, b, h, pid_m, idx_row, stride_ik,
                            KV_SIZES, NK, qk_scale, scale, EPILOGUE, epilogue_args,
                            gl.constexpr(1), BLOCK_N, HEAD_DIM, STAGES, HAS_KV_SIZES,
                            gl.constexpr(False))),  # query rows 64-127
            (_dq_loader, (desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem,
                          q_bar, ready, empty, idx_row, stride_ik, count, q_row, pid_bh * Skv,
                          NK, BLOCK_N, STAGES, gl.constexpr(2))),
        ],
        [4, 1],  # warps: second consumer warpgroup, loader warp
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip


@gluon.jit
def block_sparse_attn_bwd_dq_gluon_tiles_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dq,
    LSE2, DELTA,
    KV_IDX, KV_CNT, KV_SIZES,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    EPILOGUE: gl.constexpr, epilogue_args,
    H, Sq, Skv, NQ, K,
    qk_scale, scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """Grid ``(ceil(NQ / 2), B * H)``: two 64-row query blocks per program (video tiles:
    2 pid and 2 pid + 1), each with its own list, ring and loader warp, one per consumer
    warpgroup, as the Gluon forward's tiles kernel."""
    gl.static_assert(BLOCK_M == ROWS_PER_CONSUMER, "one consumer warpgroup per 64-row block")
    gl.static_assert(BLOCK_N == STEP_M, "64-key blocks: one step a listed block")
    pid = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    block0 = 2 * pid
    block1 = 2 * pid + 1
    valid0 = block0 < NQ
    valid1 = block1 < NQ  # false in the last program when NQ is odd
    NK = Skv // BLOCK_N
    idx0, count0 = dq_list_of(KV_IDX, KV_CNT, b, h, block0, valid0, K, stride_ib, stride_ih,
                               stride_iq, stride_cb, stride_ch, stride_cq)  # fmt: skip
    idx1, count1 = dq_list_of(KV_IDX, KV_CNT, b, h, block1, valid1, K, stride_ib, stride_ih,
                               stride_iq, stride_cb, stride_ch, stride_cq)  # fmt: skip
    # Past the last block (NQ odd) the loader still reads a Q tile (rows of the next head, or
    # zeros past the tensor: TMA bounds) so the consumer's wait completes; nothing is stored.
    q_row0 = pid_bh * Sq + block0 * BLOCK_M
    q_row1 = pid_bh * Sq + block1 * BLOCK_M
    kv_row0 = pid_bh * Skv

    # Per consumer: Q, dO 2 x 16 KB; its ring STAGES x 32 KB.
    q_smem0 = gl.allocate_shared_memory(desc_q.dtype, [1, BLOCK_M, HEAD_DIM], desc_q.layout)
    do_smem0 = gl.allocate_shared_memory(desc_q.dtype, [1, BLOCK_M, HEAD_DIM], desc_q.layout)
    q_smem1 = gl.allocate_shared_memory(desc_q.dtype, [1, BLOCK_M, HEAD_DIM], desc_q.layout)
    do_smem1 = gl.allocate_shared_memory(desc_q.dtype, [1, BLOCK_M, HEAD_DIM], desc_q.layout)
    k_smem0 = gl.allocate_shared_memory(desc_k.dtype, [STAGES, STEP_M, HEAD_DIM], desc_k.layout)
    v_smem0 = gl.allocate_shared_memory(desc_v.dtype, [STAGES, STEP_M, HEAD_DIM], desc_v.layout)
    k_smem1 = gl.allocate_shared_memory(desc_k.dtype, [STAGES, STEP_M, HEAD_DIM], desc_k.layout)
    v_smem1 = gl.allocate_shared_memory(desc_v.dtype, [STAGES, STEP_M, HEAD_DIM], desc_v.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar0 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_bar1 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    ready1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_bar0, count=1)
    mbarrier.init(q_bar1, count=1)
    init_ring(ready0, empty0, STAGES, 1)
    init_ring(ready1, empty1, STAGES, 1)
    fence_async_shared()

    gl.warp_specialize(
        [
            (_dq_consumer, (desc_dq, q_smem0, do_smem0, k_smem0, v_smem0, q_bar0, ready0,
                            empty0, LSE2, DELTA, count0, q_row0, valid0, b, h, block0, idx0,
                            stride_ik, KV_SIZES, NK, qk_scale, scale, EPILOGUE, epilogue_args,
                            gl.constexpr(0), BLOCK_N, HEAD_DIM, STAGES, HAS_KV_SIZES,
                            gl.constexpr(True))),
            (_dq_consumer, (desc_dq, q_smem1, do_smem1, k_smem1, v_smem1, q_bar1, ready1,
                            empty1, LSE2, DELTA, count1, q_row1, valid1, b, h, block1, idx1,
                            stride_ik, KV_SIZES, NK, qk_scale, scale, EPILOGUE, epilogue_args,
                            gl.constexpr(0), BLOCK_N, HEAD_DIM, STAGES, HAS_KV_SIZES,
                            gl.constexpr(True))),
            (_dq_loader, (desc_q, desc_do, desc_k, desc_v, q_smem0, do_smem0, k_smem0, v_smem0,
                          q_bar0, ready0, empty0, idx0, stride_ik, count0, q_row0, kv_row0, NK,
                          BLOCK_N, STAGES, gl.constexpr(1))),
            (_dq_loader, (desc_q, desc_do, desc_k, desc_v, q_smem1, do_smem1, k_smem1, v_smem1,
                          q_bar1, ready1, empty1, idx1, stride_ik, count1, q_row1, kv_row0, NK,
                          BLOCK_N, STAGES, gl.constexpr(1))),
        ],
        [4, 1, 1],  # warps: second consumer warpgroup, two loader warps
        [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
    )  # fmt: skip


@gluon.jit
def dq_identity_sm90(dq, b, h, q_block, local_rows, dims):
    """The dQ hook when none is declared (``no_epilogue.py``'s, in Gluon)."""
    return dq


@gluon.jit
def dkdv_identity_sm90(dk, dv, b, h, kv_block, dims):
    """The dK/dV hook when none is declared (``no_epilogue.py``'s, in Gluon)."""
    return dk, dv
