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

and adds them to the fp32 accumulator ``dq_acc`` (``atom.global.add``; dK and dV are the dK/dV
kernel's bits). Unordered, the sum's order, so dq's last bits, differ from run to run. With
``DQ_BY == DQ_TMA`` each consumer instead stores its [64, 64] fp32 tile in shared memory and
hands it to the TMA unit as one bulk reduction into ``dq_acc`` (``cp.reduce.async.bulk.tensor``,
FlashAttention-3's way): two bulk instructions (32-column boxes) a consumer where the atomics
took 16 a thread, and a wait, one step later, only for the unit to have read the tile. The dS
tiles are double-buffered by step parity: a consumer writing buffer ``j % 2`` at step j has
waited on step j - 1's barrier, which the other consumer reaches only after its step j - 2
(the last reader of that buffer) has retired every wgmma.

The ordered kernel makes dq the same bits on every run, FlashAttention-3's way: a semaphore per
(b, h, 64-row query step) counts the key blocks whose adds are in, and key block n adds only
when it equals n's rank among the step's listed key blocks (the forward-list entries below
n). Waiting is a loop, and a loop inside the consumers' step makes ptxas spill their dK/dV
accumulators, so the consumers hand their dQ halves to a writer warp through shared memory
(``dq_full`` / ``dq_empty``), which counts the rank, waits, adds and counts itself. No wait
closes a cycle: a block waits only for lower key blocks of its head, and a program takes its
(b, h, key block) from a ticket drawn when it starts, so every lower block's program has
started (is running or done), whatever order the hardware starts programs in. This needs the
transposed lists to be the forward lists' transpose (as the engine builds them): with lists
that disagree a count can fall short and the kernel wait forever, where the other kernels
would only compute a wrong result.

With ``DQ_BY_TMA`` the ordered kernel's writer warp adds each step's tile by two TMA reductions
and waits for them to land in global memory (``cp.async.bulk.wait_group 0``) before it counts
the step, so the order holds and the warp issues four instructions where it issued 64 atomics.

With ``DQ_FIXED`` (by TMA, unordered) the accumulator is int32 fixed point: each step's tile
is scaled by its rows' power-of-two multipliers (``DQ_FIX``, from the preprocess: a bound on
every partial sum of the row times ``2**e`` stays under ``2**29``), rounded to integers and
reduced by the TMA unit as integer adds. Integer addition is associative, so the sum, and dq,
is the same bits whatever order the programs' adds land in: determinism without an order, at
the unordered kernel's traffic (int32 tiles are the fp32 tiles' size).

The caller zeroes ``dq_acc`` before and casts it to dq after (the adds are scaled already;
fixed point: divided by the rows' multipliers).
128x128 blocks, D = 128, 16-bit inputs, no dQ hook (the engine's identity epilogue).
"""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
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
    key_block,
    load_kv,
    load_step,
    load_steps,
    step_query_row,
    step_ring,
)

# A barrier over this partition's warps (Triton 3.8 renamed Gluon's ``thread_barrier``).
partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# How the consumers' dQ tiles reach ``dq_acc``: their own atomics, a writer warp that orders
# them (the ordered kernel), or TMA bulk reductions from shared memory.
DQ_ATOMICS = gl.constexpr(0)
DQ_WRITER = gl.constexpr(1)
DQ_TMA = gl.constexpr(2)


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """``dst[coord ...] += src`` by the TMA unit, from shared memory: Triton 3.6 builds the op
    (``create_async_tma_reduce``) but its Gluon names it only from 3.8 on
    (``tma.async_atomic_add``, the same op)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36


@gluon.jit
def _add_dq(DQ_ACC, dq, q_row, COL0: gl.constexpr, HEAD_DIM: gl.constexpr,
            layout: gl.constexpr):  # fmt: skip
    """``dq_acc[q_row + i, COL0 + j] += dq[i, j]`` for the step's [64, 64] tile, unordered."""
    rows = q_row + gl.arange(0, STEP_M, layout=gl.SliceLayout(1, layout))
    cols = COL0 + gl.arange(0, HEAD_DIM // 2, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims(rows.to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
    gl.atomic_add(DQ_ACC + offsets, dq, sem="relaxed")


@gluon.jit
def _to_fixed_point(x):
    """``x`` rounded to the nearest int32 (ties to even; the caller keeps it in range)."""
    return gl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)  # fmt: skip


@gluon.jit
def _fused_consumer(
    desc_dk, desc_dv, DQ_ACC, k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, ds_smem,
    kv_bar, ready, empty, ds_ready, dq_smem, dq_full, dq_empty, idx_row, start, num_steps,
    KV_SIZES, kv_block, kv_row, q_row0, Q_LAST, valid, qk_scale, scale, fix_smem, fix_ready,
    K_INDEX: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr, DQ_BY: gl.constexpr, DQ_FIXED: gl.constexpr,
):  # fmt: skip
    """dK, dV of key rows ``k_smem[K_INDEX]`` over ``num_steps`` ring steps, stored if
    ``valid``; each step's dQ columns ``64 K_INDEX ..`` added into ``DQ_ACC`` (a pointer) by
    ``DQ_ATOMICS``, put in ``dq_smem[K_INDEX]`` for the writer warp by ``DQ_WRITER``
    (``dq_full``: both halves are there; ``dq_empty``: it has read them), or reduced into
    ``DQ_ACC`` (a TMA descriptor of [64, 64] fp32 tiles) from ``dq_smem[K_INDEX]`` by
    ``DQ_TMA``; ``DQ_FIXED`` (with ``DQ_TMA``): as int32 fixed point, each row times its
    multiplier, which the loader puts in ``fix_smem`` beside the step (``fix_ready``)."""
    M: gl.constexpr = ROWS_PER_CONSUMER
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
        if DQ_FIXED:  # loaded with the step: waited for here, where few registers are live
            mbarrier.wait(fix_ready.index(slot), (j // STAGES) & 1)
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
        if DQ_FIXED:  # the step's multipliers, from the ring before the slot is released
            fix = gl.expand_dims(fix_smem.index(slot).load(gl.SliceLayout(1, dq_layout)), 1)
        mbarrier.arrive(empty.index(slot))
        dq = dq * scale  # here, in registers: the caller's only pass over dq_acc is the cast
        if DQ_BY == DQ_WRITER:  # to the writer warp, through shared memory
            mbarrier.wait(dq_empty, (j & 1) ^ 1)  # it has read the last step's (j = 0: passes)
            dq_smem.index(K_INDEX).store(dq)
            fence_async_shared()  # the writer may hand the tile to the TMA unit (async proxy)
            mbarrier.arrive(dq_full)
        else:
            q_row = step_query_row(idx_row + start, j, Q_LAST, q_row0, BLOCK_M)  # the loader's
            if DQ_BY == DQ_TMA:
                tile = dq_smem.index(K_INDEX)
                tma.store_wait(pendings=0)  # the last step's reduction has read the tile
                if DQ_FIXED:
                    tile.store(_to_fixed_point(dq * fix))
                else:
                    tile.store(dq)
                fence_async_shared()  # generic-proxy stores -> visible to the TMA (async proxy)
                tma_reduce_add(DQ_ACC, [q_row, K_INDEX * HALF], tile)
            else:
                _add_dq(DQ_ACC, dq, q_row, K_INDEX * HALF, HEAD_DIM, dq_layout)
    if DQ_BY == DQ_TMA:
        tma.store_wait(pendings=0)  # the tile is read before the program's shared memory goes
    # Both consumers' last dQ wgmmas read both K halves: neither half becomes dK's staging
    # before both have retired them (``ds_ready``'s third barrier, one arrival each, once).
    mbarrier.arrive(ds_ready.index(2))
    mbarrier.wait(ds_ready.index(2), 0)

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
def _load_steps_and_multipliers(
    desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, desc_fix, k_smem, v_smem, q_smem,
    do_smem, lse_smem, dl_smem, fix_smem, kv_bar, ready, fix_ready, empty, idx_row, start, end,
    Q_LAST, q_row0, kv_row, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    DQ_FIXED: gl.constexpr,
):  # fmt: skip
    """``bwd_sm90.load_steps``, and with ``DQ_FIXED`` each step's fixed-point multipliers (64
    fp32, by TMA) into ``fix_smem[slot]`` on a barrier of their own (``fix_ready``), the slot's
    release shared."""
    load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, kv_row, 2)
    entries = idx_row + start
    for j in range((end - start) * (BLOCK_M // STEP_M)):
        row = load_step(desc_q, desc_do, desc_lse2, desc_delta, q_smem, do_smem, lse_smem,
                        dl_smem, ready, empty, entries, j, j, Q_LAST, q_row0, BLOCK_M,
                        STAGES)  # fmt: skip
        if DQ_FIXED:
            bar = fix_ready.index(j % STAGES)
            mbarrier.expect(bar, desc_fix.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_fix, [row], bar, fix_smem.index(j % STAGES))


@gluon.jit
def _rank_in_list(idx_base, cnt_base, stride_iq, stride_cq, K, q_block, kv_block):
    """How many entries of query block ``q_block``'s forward list are below ``kv_block``: the
    key blocks whose dQ adds come before this one's (one warp; the count clamped to K)."""
    q_block = q_block.to(gl.int64)
    count = gl.load(cnt_base + q_block * stride_cq)
    count = gl.minimum(gl.maximum(count, 0), K)
    row = idx_base + q_block * stride_iq
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    rank = 0
    for c in range(0, count, 32):
        e = c + gl.arange(0, 32, layout=layout)
        entries = gl.load(row + e, mask=e < count, other=2**30)
        rank += gl.sum((entries < kv_block).to(gl.int32), axis=0)
    return rank


@gluon.jit
def _bulk_reductions_done():
    """Wait until this thread's TMA reductions have been made in global memory, not only read
    from shared memory (``tma.store_wait``'s ``.read``): the ordered writer counts a step only
    after its adds are in. One warp."""
    lane: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r,r",
        [gl.zeros([32], gl.int32, layout=lane)], dtype=gl.int32, is_pure=False, pack=1,
    )


@gluon.jit
def _dq_writer(DQ_ACC, dq_smem, dq_full, dq_empty, idx_row, start, num_steps, Q_LAST, q_row0,
               kv_block, idx_base, cnt_base, stride_iq, stride_cq, K, sem_row,
               BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
               BY_TMA: gl.constexpr):  # fmt: skip
    """One warp: each step's dQ tile (``dq_smem``, the consumers' column halves) added into
    ``DQ_ACC`` after every lower listed key block's (the step's semaphore in ``sem_row``
    counts them), then counted. ``BY_TMA``: ``DQ_ACC`` is a TMA descriptor in [64, 64] tiles
    and the adds are two bulk reductions, waited for before the count; else its atomics."""
    NSUB: gl.constexpr = BLOCK_M // STEP_M
    HALF: gl.constexpr = HEAD_DIM // 2
    ROWS: gl.constexpr = 2  # rows of a tile added at once: 4 values a thread, few registers
    layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), 1)
    c = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(0, layout)), 0)
    for j in range(num_steps):
        q_block = gl.load(idx_row + start + j // NSUB)  # the loader's row, clamped alike
        q_block = gl.minimum(gl.maximum(q_block, 0), Q_LAST)
        sem = sem_row + q_block * NSUB + j % NSUB
        rank = _rank_in_list(idx_base, cnt_base, stride_iq, stride_cq, K, q_block, kv_block)
        done = gl.atomic_add(sem, 0, sem="acquire")
        while done < rank:
            done = gl.atomic_add(sem, 0, sem="acquire")
        mbarrier.wait(dq_full, j & 1)
        q_row = q_row0 + q_block * BLOCK_M + (j % NSUB) * STEP_M
        if BY_TMA:
            for half in gl.static_range(2):
                tma_reduce_add(DQ_ACC, [q_row, half * HALF], dq_smem.index(half))
            _bulk_reductions_done()
        else:
            rows = DQ_ACC + q_row.to(gl.int64) * HEAD_DIM
            for i in gl.static_range(0, STEP_M, ROWS):
                for half in gl.static_range(2):
                    part = dq_smem.index(half).slice(i, ROWS, dim=0).load(layout)
                    gl.atomic_add(rows + (i + r) * HEAD_DIM + half * HALF + c, part,
                                  sem="relaxed")  # fmt: skip
        mbarrier.arrive(dq_empty)  # the consumers may write the next step's halves
        partition_barrier()  # every lane's adds issued before the count
        gl.atomic_add(sem, 1, sem="release")


@gluon.jit
def _buffers(desc_q, desc_k, desc_v, desc_lse2, STAGES: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Shared memory and barriers (initialised) of both one-pass kernels: K, V 2 x 32 KB (dK,
    dV's staging after the walk); the ring STAGES x 32.5 KB; dS^T halves 2 buffers x 2 x 8 KB."""
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
    ds_ready = gl.allocate_shared_memory(gl.int64, [3, 1], bar_layout)  # 2: the walk's end
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(kv_bar, count=1)
    init_ring(ready, empty, STAGES, 2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # one arrival per consumer
    mbarrier.init(ds_ready.index(2), count=2)
    fence_async_shared()  # barrier inits visible to the async proxy before any TMA uses them
    return k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, ready, empty, ds_smem, ds_ready, kv_bar


@gluon.jit
def block_sparse_attn_bwd_dkdvdq_gluon_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv,  # TMA over [B*H*S, D], blocks [64, D]
    desc_lse2, desc_delta,  # TMA over fp32 [B*H*Sq], blocks [64]
    DQ_ACC,  # fp32 [B*H*Sq, D], zeroed by the caller: a pointer, or (DQ_BY_TMA) a TMA
    # descriptor of it in [64, D / 2] tiles; int32 with DQ_FIXED
    DESC_FIX,  # DQ_FIXED: TMA over fp32 [B*H*Sq] in 64-row steps, each row's multiplier
    Q_OFF, Q_IDX, KV_SIZES,  # the transposed lists; [NK] (HAS_KV_SIZES)
    stride_offb, stride_offh, stride_qib, stride_qih,
    H, Sq, Skv, Q_LAST, NK, WIDTH,
    qk_scale, scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr, DQ_BY_TMA: gl.constexpr, DQ_FIXED: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """Grid ``(NK, B * H)``: a 128-row key block per program, its halves on the two consumers,
    one list and one ring, as ``bwd_sm90.block_sparse_attn_bwd_dkdv_gluon_kernel``. dQ's adds
    by the consumers' atomics, or with ``DQ_BY_TMA`` by TMA reductions from a 16 KB tile of
    each consumer's, fp32 or (``DQ_FIXED``) int32 fixed point."""
    gl.static_assert(BLOCK_N == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_M % STEP_M == 0, "query blocks are whole steps")
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b, h, kv_row, valid, idx_row, start, end, num_steps = key_block(
        pid_n, pid_bh, H, Skv, NK, (Q_OFF, Q_IDX, stride_offb, stride_offh, stride_qib, stride_qih, WIDTH), BLOCK_M, BLOCK_N
    )

    (k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, ready, empty, ds_smem, ds_ready,
     kv_bar) = _buffers(desc_q, desc_k, desc_v, desc_lse2, STAGES, HEAD_DIM)
    gl.static_assert(DQ_BY_TMA or not DQ_FIXED, "fixed point is added by TMA reductions")
    if DQ_BY_TMA:
        dq_by: gl.constexpr = DQ_TMA
        dq_smem = gl.allocate_shared_memory(DQ_ACC.dtype, [2, STEP_M, HEAD_DIM // 2],
                                            DQ_ACC.layout)  # fmt: skip
    else:
        dq_by: gl.constexpr = DQ_ATOMICS
        dq_smem = ds_smem  # unread
    fix_smem, fix_ready = lse_smem, ready  # unread unless DQ_FIXED
    if DQ_FIXED:  # the multipliers' ring: STAGES x 256 bytes, a barrier a slot
        fix_smem = gl.allocate_shared_memory(gl.float32, [STAGES, STEP_M], DESC_FIX.layout)
        fix_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(fix_ready.index(i), count=1)
        fence_async_shared()

    q_row0 = pid_bh * Sq
    gl.warp_specialize(
        [
            (_fused_consumer, (desc_dk, desc_dv, DQ_ACC, k_smem, v_smem, q_smem, do_smem,
                               lse_smem, dl_smem, ds_smem, kv_bar, ready, empty, ds_ready,
                               dq_smem, kv_bar, kv_bar, idx_row, start, num_steps, KV_SIZES,
                               pid_n, kv_row, q_row0, Q_LAST, valid, qk_scale, scale,
                               fix_smem, fix_ready, gl.constexpr(0), BLOCK_M, HEAD_DIM,
                               STAGES, HAS_KV_SIZES, dq_by, DQ_FIXED)),
            (_fused_consumer, (desc_dk, desc_dv, DQ_ACC, k_smem, v_smem, q_smem, do_smem,
                               lse_smem, dl_smem, ds_smem, kv_bar, ready, empty, ds_ready,
                               dq_smem, kv_bar, kv_bar, idx_row, start, num_steps, KV_SIZES,
                               pid_n, kv_row, q_row0, Q_LAST, valid, qk_scale, scale,
                               fix_smem, fix_ready, gl.constexpr(1), BLOCK_M, HEAD_DIM,
                               STAGES, HAS_KV_SIZES, dq_by, DQ_FIXED)),
            (_load_steps_and_multipliers, (desc_q, desc_do, desc_k, desc_v, desc_lse2,
                                           desc_delta, DESC_FIX, k_smem, v_smem, q_smem,
                                           do_smem, lse_smem, dl_smem, fix_smem, kv_bar, ready,
                                           fix_ready, empty, idx_row, start, end, Q_LAST,
                                           q_row0, kv_row, BLOCK_M, STAGES, DQ_FIXED)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip


@gluon.jit
def block_sparse_attn_bwd_dkdvdq_ordered_gluon_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, desc_lse2, desc_delta, DQ_ACC,
    Q_OFF, Q_IDX, KV_SIZES, stride_offb, stride_offh, stride_qib, stride_qih,
    # the forward lists [Bi, H, NQ, K], [Bi, H, NQ] (their strides); int32 semaphores
    # [B*H*NQ*2] (one a 64-row query step) and a ticket [1], zeroed by the caller
    KV_IDX, KV_CNT, K, stride_ib, stride_ih, stride_iq, stride_cb, stride_ch, stride_cq,
    SEM, TICKET,
    H, Sq, Skv, Q_LAST, NK, WIDTH,
    qk_scale, scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr, DQ_BY_TMA: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """``block_sparse_attn_bwd_dkdvdq_gluon_kernel`` with each query step's dQ adds in key-block
    order (module docstring): the consumers hand their dQ halves to a writer warp through
    shared memory (32 KB), which waits for the lower key blocks, adds and counts. A program
    takes its (b, h, key block) from a ticket drawn when it starts."""
    gl.static_assert(BLOCK_N == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_M % STEP_M == 0, "query blocks are whole steps")
    ticket = gl.atomic_add(TICKET, 1)
    pid_n = ticket % NK
    pid_bh = ticket // NK
    b, h, kv_row, valid, idx_row, start, end, num_steps = key_block(
        pid_n, pid_bh, H, Skv, NK, (Q_OFF, Q_IDX, stride_offb, stride_offh, stride_qib, stride_qih, WIDTH), BLOCK_M, BLOCK_N
    )
    (k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, ready, empty, ds_smem, ds_ready,
     kv_bar) = _buffers(desc_q, desc_k, desc_v, desc_lse2, STAGES, HEAD_DIM)
    if DQ_BY_TMA:  # the tiles as the descriptor reads them
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, STEP_M, HEAD_DIM // 2],
                                            DQ_ACC.layout)  # fmt: skip
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, STEP_M, HEAD_DIM // 2],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    dq_full = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    dq_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(dq_full, count=2)  # one arrival per consumer
    mbarrier.init(dq_empty, count=1)  # the writer's
    fence_async_shared()
    idx_base = KV_IDX + b.to(gl.int64) * stride_ib + h.to(gl.int64) * stride_ih
    cnt_base = KV_CNT + b.to(gl.int64) * stride_cb + h.to(gl.int64) * stride_ch
    sem_row = SEM + pid_bh * (Q_LAST + 1) * (BLOCK_M // STEP_M)

    q_row0 = pid_bh * Sq
    gl.warp_specialize(
        [
            (_fused_consumer, (desc_dk, desc_dv, DQ_ACC, k_smem, v_smem, q_smem, do_smem,
                               lse_smem, dl_smem, ds_smem, kv_bar, ready, empty, ds_ready,
                               dq_smem, dq_full, dq_empty, idx_row, start, num_steps, KV_SIZES,
                               pid_n, kv_row, q_row0, Q_LAST, valid, qk_scale, scale,
                               lse_smem, ready, gl.constexpr(0), BLOCK_M, HEAD_DIM, STAGES,
                               HAS_KV_SIZES, DQ_WRITER, False)),
            (_fused_consumer, (desc_dk, desc_dv, DQ_ACC, k_smem, v_smem, q_smem, do_smem,
                               lse_smem, dl_smem, ds_smem, kv_bar, ready, empty, ds_ready,
                               dq_smem, dq_full, dq_empty, idx_row, start, num_steps, KV_SIZES,
                               pid_n, kv_row, q_row0, Q_LAST, valid, qk_scale, scale,
                               lse_smem, ready, gl.constexpr(1), BLOCK_M, HEAD_DIM, STAGES,
                               HAS_KV_SIZES, DQ_WRITER, False)),
            (load_steps, (desc_q, desc_do, desc_k, desc_v, desc_lse2, desc_delta, k_smem,
                          v_smem, q_smem, do_smem, lse_smem, dl_smem, kv_bar, ready, empty,
                          idx_row, start, end, Q_LAST, q_row0, kv_row, BLOCK_M, STAGES,
                          gl.constexpr(2))),
            (_dq_writer, (DQ_ACC, dq_smem, dq_full, dq_empty, idx_row, start, num_steps, Q_LAST,
                          q_row0, pid_n, idx_base, cnt_base, stride_iq, stride_cq, K, sem_row,
                          BLOCK_M, HEAD_DIM, DQ_BY_TMA)),
        ],
        [4, 1, 1],
        [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
    )  # fmt: skip
