"""The Hopper (sm_90) forward at 128x128 blocks as a persistent kernel (launcher:
``../fwd_sm90.py``, ``configs.GluonOptions.PERSISTENT``).

One program per SM walks the query blocks ``pid, pid + nprog, ...`` in head-major order (the
blocks that run at once read the same heads' keys, which stay in L2). Its partitions are those
of ``fwd_sm90.py``'s one-block kernel (a loader warp, two consumer warpgroups of 64 rows taking
turns on the tensor cores), each carrying its sequences from block to block: the K/V ring's
position and Q's phase. What one block a program leaves exposed is overlapped: the loader
brings the next block's Q as soon as both consumers have retired their last Q K^T
(``q_empty``), then its keys into ring slots as they free up, while the consumers finish the
epilogue, whose o leaves by a TMA store from a buffer of its own (waited for only when that
buffer is written again).

Where a sparse list is short the fixed cost of a block (Q's load, the pipeline's first K, the
epilogue) is a larger share of its time: at density 1/8 a 32k-token head's query block walks 32
key blocks, against 256 dense.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from vidsparse.ops.block_sparse_attn.kernels.fwd_sm90 import (
    ROWS_PER_CONSUMER,
    consume_rows,
    key_ring,
    list_of,
    load_list,
    load_q,
    turn_barriers,
)


@gluon.jit
def _block_of(tile, H, NQ, PER: gl.constexpr, SLOT: gl.constexpr):
    """(b, h, flat b*H+h, query block, valid) of block ``SLOT`` of the ``PER`` query blocks of
    ``tile`` (head-major; 128-row kernel: one; 64-row: two, one a consumer). A block past the
    last (NQ odd, 64 rows) is not valid: it lists nothing and stores nothing."""
    per_head = (NQ + PER - 1) // PER
    pid_bh = tile // per_head
    block = (tile % per_head) * PER + SLOT
    return pid_bh // H, pid_bh % H, pid_bh, block, block < NQ


@gluon.jit
def _tile_list(lists, b, h, block, valid, HAS_KV_SIZES: gl.constexpr, TAIL1: gl.constexpr):
    """``list_of`` for ``lists`` = (KV_IDX, KV_CNT, KV_ENDS, K, and their nine strides), with
    int32 offsets (the launcher checks that they fit): fewer registers in the loader warp."""
    KV_IDX, KV_CNT, KV_ENDS, K, sib, sih, siq, scb, sch, scq, seb, seh, seq = lists
    return list_of(KV_IDX, KV_CNT, KV_ENDS, b, h, block, valid, K, sib, sih, siq, scb, sch, scq,
                   seb, seh, seq, HAS_KV_SIZES, TAIL1, False)  # fmt: skip


@gluon.jit
def _persistent_loader(
    desc_q, desc_k, desc_v, tail_descs, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
    k_empty, v_empty, lists, stride_ik, H, Sq, Skv, NQ, num_tiles, nprog, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_KV_SIZES: gl.constexpr,
    TAIL1: gl.constexpr, TAIL2: gl.constexpr, Q_TILES: gl.constexpr, PER: gl.constexpr,
    SLOT: gl.constexpr,
):  # fmt: skip
    """Per tile, for its block ``SLOT``: wait until the consumers have released the last
    block's Q, load this one's (``Q_TILES`` 64-row pieces), then its keys at the ring positions
    that follow the last block's."""
    pid = gl.program_id(0)
    NK = Skv // BLOCK_N
    r0 = pid * 0  # ring position of the block's first key block (an int32 tensor)
    for tile in range(pid, num_tiles, nprog):
        b, h, pid_bh, block, valid = _block_of(tile, H, NQ, PER, SLOT)
        idx_row, count, ends = _tile_list(lists, b, h, block, valid, HAS_KV_SIZES, TAIL1)
        it = (tile - pid) // nprog
        # Phase it - 1 of q_empty: the consumers done with the last Q (the first passes).
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        # Past the last block (NQ odd) Q is still loaded (another head's rows, or zeros past
        # the tensor: TMA bounds), so the consumer's wait completes; nothing is stored there.
        load_q(desc_q, q_smem, q_bar, pid_bh * Sq + block * BLOCK_M, Q_TILES)
        load_list(desc_k, desc_v, tail_descs, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                  idx_row, stride_ik, count, ends, pid_bh * Skv, NK, r0, BLOCK_N, STAGES,
                  TAIL1, TAIL2)  # fmt: skip
        r0 += count


@gluon.jit
def _persistent_consumer(
    desc_o, q_smem, o_smem, k_smem, v_smem, p_unused, q_bar, q_empty, k_ready, v_ready, k_empty,
    v_empty, turn_bars, LSE, lists, stride_ik, KV_SIZES, qk_scale, H, Sq, NQ, num_tiles, nprog,
    EPILOGUE: gl.constexpr, epilogue_args, ME: gl.constexpr, Q_INDEX: gl.constexpr,
    PER: gl.constexpr, SLOT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr, TAIL1: gl.constexpr, TAIL2: gl.constexpr, mapped_out,
    OUT_MAPPED: gl.constexpr,
):  # fmt: skip
    """Rows ``q_smem[Q_INDEX]`` of block ``SLOT`` of each of the program's tiles
    (``fwd_sm90.consume_rows``; ``ME`` names the consumer for the turns); the last o's TMA
    store is waited for before the program ends."""
    pid = gl.program_id(0)
    r0 = pid * 0
    for tile in range(pid, num_tiles, nprog):
        b, h, pid_bh, block, valid = _block_of(tile, H, NQ, PER, SLOT)
        idx_row, count, ends = _tile_list(lists, b, h, block, valid, HAS_KV_SIZES, TAIL1)
        it = (tile - pid) // nprog
        consume_rows(desc_o, q_smem, k_smem, v_smem, p_unused, q_bar, k_ready, v_ready, k_empty,
                     v_empty, turn_bars, LSE, count, ends, idx_row, stride_ik, KV_SIZES,
                     pid_bh * Sq + block * BLOCK_M, qk_scale, valid, b, h, block,
                     block * BLOCK_M, EPILOGUE, epilogue_args, ME, Q_INDEX, BLOCK_N, HEAD_DIM,
                     STAGES, PINGPONG, False, HAS_KV_SIZES, TAIL1, TAIL2, mapped_out,
                     OUT_MAPPED, (r0, it & 1, q_empty, o_smem), True)  # fmt: skip
        r0 += count
    tma.store_wait(pendings=0)


@gluon.jit
def block_sparse_attn_fwd_gluon_persistent_kernel(
    desc_q, desc_k, desc_v, desc_o,  # TMA over [B*H*S, D]: q/o blocks [64, D], k/v [BN, D]
    desc_k1, desc_v1, desc_k2, desc_v2,  # TAIL1: k/v in boxes [TAIL1, D], [TAIL2, D]
    LSE, mapped_out,
    KV_IDX, KV_CNT, KV_SIZES, KV_ENDS,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    stride_eb, stride_eh, stride_eq,
    EPILOGUE: gl.constexpr, epilogue_args,
    H, Sq, Skv, NQ, K,
    qk_scale,
    num_tiles,  # B * H * NQ query blocks, walked by the grid's programs in turn
    nprog,  # the grid's programs (an argument: no register holds it across the partitions)
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr, TAIL1: gl.constexpr, TAIL2: gl.constexpr,
    STAGES: gl.constexpr, PINGPONG: gl.constexpr, P_IN_SMEM: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, OUT_MAPPED: gl.constexpr = False,
):  # fmt: skip
    """``fwd_sm90.block_sparse_attn_fwd_gluon_kernel``'s arguments and results, its grid one
    program per SM (or per block, if fewer) over ``num_tiles`` 128-row query blocks."""
    gl.static_assert(BLOCK_M == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    gl.static_assert(not P_IN_SMEM, "persistent: P in registers")
    gl.static_assert((TAIL1 == 0) == (TAIL2 == 0), "both short walks or none")
    gl.static_assert(TAIL1 == 0 or HAS_KV_SIZES, "short walks come with key-block sizes")
    lists = (KV_IDX, KV_CNT, KV_ENDS, K, stride_ib, stride_ih, stride_iq, stride_cb, stride_ch,
             stride_cq, stride_eb, stride_eh, stride_eq)  # fmt: skip
    tail_descs = (desc_k1, desc_v1, desc_k2, desc_v2)

    # Shared memory: Q 32 KB, o's staging 32 KB, K and V rings 2 * STAGES * 32 KB.
    q_smem = gl.allocate_shared_memory(desc_q.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_q.layout)  # fmt: skip
    o_smem = gl.allocate_shared_memory(desc_o.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM],
                                       desc_o.layout)  # fmt: skip
    k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = key_ring(desc_k, desc_v, STAGES,
                                                                  BLOCK_N, HEAD_DIM, 2)
    p_unused = gl.allocate_shared_memory(desc_k.dtype, [2, 8, 64], desc_k.layout)

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)  # one arrival per consumer warpgroup
    turn_bars = turn_barriers()
    fence_async_shared()

    # (Tuples are spelled out: concatenating them in a jit function unwraps the constexprs.)
    gl.warp_specialize(
        [
            (_persistent_consumer, (
                desc_o, q_smem, o_smem, k_smem, v_smem, p_unused, q_bar, q_empty, k_ready,
                v_ready, k_empty, v_empty, turn_bars, LSE, lists, stride_ik, KV_SIZES, qk_scale, H,
                Sq, NQ, num_tiles, nprog, EPILOGUE, epilogue_args, gl.constexpr(0), gl.constexpr(0),
                gl.constexpr(1), gl.constexpr(0), BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PINGPONG,
                HAS_KV_SIZES, TAIL1, TAIL2, mapped_out, OUT_MAPPED)),  # default: rows 0-63
            (_persistent_consumer, (
                desc_o, q_smem, o_smem, k_smem, v_smem, p_unused, q_bar, q_empty, k_ready,
                v_ready, k_empty, v_empty, turn_bars, LSE, lists, stride_ik, KV_SIZES, qk_scale, H,
                Sq, NQ, num_tiles, nprog, EPILOGUE, epilogue_args, gl.constexpr(1), gl.constexpr(1),
                gl.constexpr(1), gl.constexpr(0), BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PINGPONG,
                HAS_KV_SIZES, TAIL1, TAIL2, mapped_out, OUT_MAPPED)),  # rows 64-127
            (_persistent_loader, (
                desc_q, desc_k, desc_v, tail_descs, q_smem, k_smem, v_smem, q_bar, q_empty,
                k_ready, v_ready, k_empty, v_empty, lists, stride_ik, H, Sq, Skv, NQ, num_tiles,
                nprog, BLOCK_M, BLOCK_N, STAGES, HAS_KV_SIZES, TAIL1, TAIL2, gl.constexpr(2),
                gl.constexpr(1), gl.constexpr(0))),
        ],
        [4, 1],  # warps: second consumer warpgroup, loader warp
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip


@gluon.jit
def block_sparse_attn_fwd_gluon_persistent_tiles_kernel(
    desc_q, desc_k, desc_v, desc_o,  # TMA over [B*H*S, D]: q/o and k/v blocks [64, D]
    desc_k1, desc_v1, desc_k2, desc_v2,
    LSE, mapped_out,
    KV_IDX, KV_CNT, KV_SIZES, KV_ENDS,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    stride_eb, stride_eh, stride_eq,
    EPILOGUE: gl.constexpr, epilogue_args,
    H, Sq, Skv, NQ, K,
    qk_scale,
    num_tiles,  # B * H * ceil(NQ / 2) pairs of 64-row query blocks
    nprog,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr, TAIL1: gl.constexpr, TAIL2: gl.constexpr,
    STAGES: gl.constexpr, PINGPONG: gl.constexpr, P_IN_SMEM: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, OUT_MAPPED: gl.constexpr = False,
):  # fmt: skip
    """``fwd_sm90.block_sparse_attn_fwd_gluon_tiles_kernel``'s arguments and results (video
    tiles: pairs of 64-row query blocks, each consumer with its own list, ring and loader), its
    grid one program per SM over ``num_tiles`` pairs; each consumer and its loader walk their
    own block of every pair, with their own ring positions and Q phases."""
    gl.static_assert(BLOCK_M == ROWS_PER_CONSUMER, "one consumer warpgroup per 64-row block")
    gl.static_assert(not P_IN_SMEM, "persistent: P in registers")
    gl.static_assert((TAIL1 == 0) == (TAIL2 == 0), "both short walks or none")
    gl.static_assert(TAIL1 == 0 or HAS_KV_SIZES, "short walks come with key-block sizes")
    lists = (KV_IDX, KV_CNT, KV_ENDS, K, stride_ib, stride_ih, stride_iq, stride_cb, stride_ch,
             stride_cq, stride_eb, stride_eh, stride_eq)  # fmt: skip
    tail_descs = (desc_k1, desc_v1, desc_k2, desc_v2)

    # Per consumer: Q 16 KB, o's staging 16 KB, K and V rings 2 * STAGES * 16 KB.
    q_smem0 = gl.allocate_shared_memory(desc_q.dtype, [1, BLOCK_M, HEAD_DIM], desc_q.layout)
    q_smem1 = gl.allocate_shared_memory(desc_q.dtype, [1, BLOCK_M, HEAD_DIM], desc_q.layout)
    o_smem0 = gl.allocate_shared_memory(desc_o.dtype, [1, BLOCK_M, HEAD_DIM], desc_o.layout)
    o_smem1 = gl.allocate_shared_memory(desc_o.dtype, [1, BLOCK_M, HEAD_DIM], desc_o.layout)
    k_smem0, v_smem0, k_ready0, v_ready0, k_empty0, v_empty0 = key_ring(desc_k, desc_v, STAGES,
                                                                        BLOCK_N, HEAD_DIM, 1)
    k_smem1, v_smem1, k_ready1, v_ready1, k_empty1, v_empty1 = key_ring(desc_k, desc_v, STAGES,
                                                                        BLOCK_N, HEAD_DIM, 1)
    p_unused = gl.allocate_shared_memory(desc_k.dtype, [2, 8, 64], desc_k.layout)

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar0 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_bar1 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_empty0 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_empty1 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    turn_unused = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(q_bar0, count=1)
    mbarrier.init(q_bar1, count=1)
    mbarrier.init(q_empty0, count=1)
    mbarrier.init(q_empty1, count=1)
    fence_async_shared()

    gl.warp_specialize(
        [
            (_persistent_consumer, (
                desc_o, q_smem0, o_smem0, k_smem0, v_smem0, p_unused, q_bar0, q_empty0, k_ready0,
                v_ready0, k_empty0, v_empty0, turn_unused, LSE, lists, stride_ik, KV_SIZES,
                qk_scale, H, Sq, NQ, num_tiles, nprog, EPILOGUE, epilogue_args, gl.constexpr(0),
                gl.constexpr(0), gl.constexpr(2), gl.constexpr(0), BLOCK_M, BLOCK_N, HEAD_DIM,
                STAGES, gl.constexpr(False), HAS_KV_SIZES, TAIL1, TAIL2, mapped_out,
                OUT_MAPPED)),
            (_persistent_consumer, (
                desc_o, q_smem1, o_smem1, k_smem1, v_smem1, p_unused, q_bar1, q_empty1, k_ready1,
                v_ready1, k_empty1, v_empty1, turn_unused, LSE, lists, stride_ik, KV_SIZES,
                qk_scale, H, Sq, NQ, num_tiles, nprog, EPILOGUE, epilogue_args, gl.constexpr(1),
                gl.constexpr(0), gl.constexpr(2), gl.constexpr(1), BLOCK_M, BLOCK_N, HEAD_DIM,
                STAGES, gl.constexpr(False), HAS_KV_SIZES, TAIL1, TAIL2, mapped_out,
                OUT_MAPPED)),
            (_persistent_loader, (
                desc_q, desc_k, desc_v, tail_descs, q_smem0, k_smem0, v_smem0, q_bar0, q_empty0,
                k_ready0, v_ready0, k_empty0, v_empty0, lists, stride_ik, H, Sq, Skv, NQ,
                num_tiles, nprog, BLOCK_M, BLOCK_N, STAGES, HAS_KV_SIZES, TAIL1, TAIL2,
                gl.constexpr(1), gl.constexpr(2), gl.constexpr(0))),
            (_persistent_loader, (
                desc_q, desc_k, desc_v, tail_descs, q_smem1, k_smem1, v_smem1, q_bar1, q_empty1,
                k_ready1, v_ready1, k_empty1, v_empty1, lists, stride_ik, H, Sq, Skv, NQ,
                num_tiles, nprog, BLOCK_M, BLOCK_N, STAGES, HAS_KV_SIZES, TAIL1, TAIL2,
                gl.constexpr(1), gl.constexpr(2), gl.constexpr(1))),
        ],
        [4, 1, 1],  # warps: second consumer warpgroup, two loader warps
        [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
    )  # fmt: skip
