"""The Hopper (sm_90) forward of block-sparse flash attention, in Gluon (launcher:
``../fwd_sm90.py``).

The Triton forward's semantics at square 128 or 64 blocks, D = 128, 16-bit inputs, the
declared epilogue included, written as FlashAttention-3's schedule: a loader warp fills a
K/V ring by TMA (mbarriers say a slot landed / was released); two consumer warpgroups of 64
query rows each issue ``Q K_j^T`` together with ``P_{j-1} V_{j-1}`` and, at 128x128, take
turns on the tensor cores (ping-pong) so one's softmax overlaps the other's GEMMs. The 64x64
kernel gives each consumer its own 64-row block, list, ring and loader. docs/architecture.md
explains the schedule and its knobs (``configs.GluonOptions``).

With key-block sizes the lists come ordered by ``lists.blocks_by_size``: full blocks, then
partial ones walked with all ``BLOCK_N`` keys and, with short walks (``TAIL1``, ``TAIL2``:
``GluonOptions.KEY_TAILS``), those with at most ``TAIL1`` and ``TAIL2`` real keys walked with
that many: TMA boxes of those rows into a tile at the start of a ring slot, and Q K^T / P V wgmmas
that narrow (N = 32 / 16 at 64-key blocks). Each short walk runs from its own prologue to its
last P V, since P's registers change shape between walks.

Memory safety whatever the lists hold: counts are clamped to the lists' width ``K`` (and the
walks' ends to the count and to each other, so the loader and the consumers agree), and the
loader clamps each entry into ``[0, NK)``. With key-block sizes the lists come reordered, valid by
construction (``kernels/lists.py``); without, an entry out of range reads the clamped block: a
wrong result, never a fault (the Triton kernels give it no weight instead).
"""

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

LN2 = gl.constexpr(0.6931471805599453)

# Rows each consumer warpgroup owns: a wgmma tile is 64 rows per warpgroup (4 warps x 16 rows).
ROWS_PER_CONSUMER = gl.constexpr(64)


# ---------------------------------------------------------------------------------------------
# Loader partition: 1 warp, issues every TMA copy of the program.
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _key_rows(ring, slot, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Ring slot ``slot`` [BLOCK_N, D], or for a short walk the ``[ROWS, D]`` tile at its start.

    The short tile is a view of its own (the slot's bytes reinterpreted), not rows of the
    slot: at D = 128 a row spans two 128-byte swizzle atoms, which a slot lays out BLOCK_N
    rows apart and a [ROWS, D] tile ROWS apart. The TMA box that fills the tile and the
    wgmmas that read it then agree by construction."""
    if ROWS < BLOCK_N:
        # The ring [STAGES, BLOCK_N, D] seen as [STAGES * BLOCK_N / ROWS, ROWS, D] (same bytes:
        # Triton 3.8 refuses a reinterpretation that changes the size): the slot's first tile.
        per_slot: gl.constexpr = BLOCK_N // ROWS
        tiles = ring._reinterpret(ring.dtype, [ring.shape[0] * per_slot, ROWS, ring.shape[2]],
                                  ring.layout)  # fmt: skip
        buf = tiles.index(slot * per_slot)
    else:
        buf = ring.index(slot)
    return buf


@gluon.jit
def _loader(
    desc_q, desc_k, desc_v, tail_descs, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
    v_empty, idx_row, stride_ik, count, ends, q_row, kv_row0, NK, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, Q_TILES: gl.constexpr, TAIL1: gl.constexpr, TAIL2: gl.constexpr,
):  # fmt: skip
    """Q once (``load_q``), then the K and V of every listed block (``load_list``).

    q_smem [Q_TILES, 64, D] (two halves of a 128-row block, one per consumer; or one 64-row
    query tile); k_smem, v_smem [STAGES, BLOCK_N, D]. ``q_row``: first global row of the query
    rows in the [B*H*S, D] view; ``kv_row0``: first row of this (b, h)'s keys in that view."""
    load_q(desc_q, q_smem, q_bar, q_row, Q_TILES)
    load_list(desc_k, desc_v, tail_descs, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
               idx_row, stride_ik, count, ends, kv_row0, NK, 0, BLOCK_N, STAGES, TAIL1,
               TAIL2)  # fmt: skip


@gluon.jit
def load_q(desc_q, q_smem, q_bar, q_row, Q_TILES: gl.constexpr):
    """The query rows from ``q_row``, in ``Q_TILES`` 64-row pieces, all landing on ``q_bar``
    (the consumers wait for it once)."""
    mbarrier.expect(q_bar, Q_TILES * desc_q.block_type.nbytes)
    for i in gl.static_range(Q_TILES):
        tma.async_copy_global_to_shared(
            desc_q, [q_row + i * ROWS_PER_CONSUMER, 0], q_bar, q_smem.index(i)
        )


@gluon.jit
def load_list(
    desc_k, desc_v, tail_descs, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, idx_row,
    stride_ik, count, ends, kv_row0, NK, r0, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    TAIL1: gl.constexpr, TAIL2: gl.constexpr,
):  # fmt: skip
    """K_j and V_j of every listed block j into ring position ``r0 + j`` (``r0``: the blocks
    the ring carried before this list): whole blocks up to ``ends[1]`` (``list_of``), then,
    with short walks (``TAIL1``), the first ``TAIL1`` rows of blocks ``ends[1]..ends[2]-1`` and
    the first ``TAIL2`` of the rest, by the descriptors of those boxes (``tail_descs``: k1, v1,
    k2, v2)."""
    _, end1, end2 = ends
    _load_keys(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, idx_row,
               stride_ik, 0, end1, kv_row0, NK, r0, BLOCK_N, BLOCK_N, STAGES)  # fmt: skip
    if TAIL1 > 0:
        desc_k1, desc_v1, desc_k2, desc_v2 = tail_descs
        _load_keys(desc_k1, desc_v1, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                   idx_row, stride_ik, end1, end2, kv_row0, NK, r0, TAIL1, BLOCK_N,
                   STAGES)  # fmt: skip
        _load_keys(desc_k2, desc_v2, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                   idx_row, stride_ik, end2, count, kv_row0, NK, r0, TAIL2, BLOCK_N,
                   STAGES)  # fmt: skip


@gluon.jit
def _load_keys(
    desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, idx_row, stride_ik, lo,
    hi, kv_row0, NK, r0, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """K_j and V_j, the first ``ROWS`` rows of each listed block j in ``lo..hi-1`` (boxes of
    ``desc_k``, ``desc_v``), into ring slot ``(r0 + j) % STAGES`` (``_key_rows``)."""
    for j in range(lo, hi):
        r = r0 + j  # position in the ring's sequence of blocks
        slot = r % STAGES
        # Use u = r // STAGES of this slot must wait for its consumers to release use u - 1,
        # i.e. for the completion of empty-barrier phase u - 1 (parity (u - 1) & 1). For u = 0
        # parity 1 refers to the phase "before" the first one and passes at once.
        empty_parity = ((r // STAGES) & 1) ^ 1
        kv_block = gl.load(idx_row + j * stride_ik)  # scalar int32 key-block index
        kv_block = gl.minimum(gl.maximum(kv_block, 0), NK - 1)  # never another head's rows
        row = kv_row0 + kv_block * BLOCK_N  # first row of key block kv_block
        # K and V have separate barriers: the consumers release K as soon as Q K^T is done,
        # V only after P V, so the next K can stream in earlier.
        mbarrier.wait(k_empty.index(slot), empty_parity)
        mbarrier.expect(k_ready.index(slot), desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [row, 0], k_ready.index(slot),
                                        _key_rows(k_smem, slot, ROWS, BLOCK_N))  # fmt: skip
        mbarrier.wait(v_empty.index(slot), empty_parity)
        mbarrier.expect(v_ready.index(slot), desc_v.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_v, [row, 0], v_ready.index(slot),
                                        _key_rows(v_smem, slot, ROWS, BLOCK_N))  # fmt: skip


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
    q, k_smem, k_ready, turn_bars, r, s_zero, ME: gl.constexpr, STAGES: gl.constexpr,
    PINGPONG: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Wait for the K at ring position ``r``, take the GEMM turn, issue S = Q K^T [64, ROWS]
    asynchronously."""
    slot = r % STAGES
    mbarrier.wait(k_ready.index(slot), (r // STAGES) & 1)
    _turn_wait(turn_bars, ME, r, PINGPONG)
    k_rows = _key_rows(k_smem, slot, ROWS, BLOCK_N)
    return warpgroup_mma(q, k_rows.permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    """acc [64, D] *= alpha [64] (row factor, from the softmax's row layout)."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


@gluon.jit
def _walk(
    q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, lo, hi, r0, qk_scale, p_op,
    m_i, l_i, alpha, acc, s_zero, idx_row, stride_ik, KV_SIZES, cols, p_layout: gl.constexpr,
    o_layout: gl.constexpr, ME: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    MASKED: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Blocks ``lo..hi-1`` (ring positions from ``r0 + lo``), their first ``ROWS`` keys
    (``s_zero`` and ``cols`` that wide), P
    fed to the P V wgmma from registers; enters with P_{lo-1} in ``p_op`` and leaves P_{hi-1}
    there (its P V still to issue). ``MASKED``: the blocks may end in padding keys (their real
    count: ``KV_SIZES[block]``, at most ``ROWS``).

    Iteration j: issue S_j and P_{j-1} V_{j-1}; wait for S_j; softmax of S_j; wait for
    P_{j-1} V_{j-1}; only then convert P_j into the A-operand registers. ptxas does not keep
    the A-operand registers of an in-flight wgmma reserved (converting P_j before that wait let
    ptxas put the exp2 results straight into registers the P V wgmma was still reading: NaNs
    without ping-pong; ``vidsparse.bench.compile`` counts such writes).
    ptxas may also hoist the P V wait above the softmax, which loses the overlap inside the
    warpgroup; the ping-pong still overlaps one warpgroup's softmax with the other's GEMMs."""
    for j in range(lo, hi):
        r = r0 + j
        prev = (r - 1) % STAGES
        s_tok = _issue_qk(q, k_smem, k_ready, turn_bars, r, s_zero, ME, STAGES, PINGPONG, ROWS,
                          BLOCK_N)  # fmt: skip
        acc = _rescale(acc, alpha, o_layout)  # to the max of block j-1, while S_j runs
        mbarrier.wait(v_ready.index(prev), ((r - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, _key_rows(v_smem, prev, ROWS, BLOCK_N), acc,
                              is_async=True)  # acc += P V; fmt: skip
        _turn_pass(turn_bars, ME, PINGPONG)
        if MASKED:  # scalar loads, issued while the GEMMs run
            limit = gl.load(KV_SIZES + gl.load(idx_row + j * stride_ik))
        # wgmma groups retire in order: with one outstanding, S_j (issued first) is done.
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(r % STAGES))
        if MASKED:
            s = _padding_masked(s, limit, cols)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, MASKED)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(prev))
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)  # P_j
    return p_op, m_i, l_i, alpha, acc


@gluon.jit
def _last_pv(
    p_op, v_smem, v_ready, v_empty, acc, alpha, count, r0, o_layout: gl.constexpr,
    STAGES: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """The P V of block ``count - 1`` (ring position ``r0 + count - 1``; its first ``ROWS``
    keys), the last of a walk."""
    r = r0 + count - 1
    last = r % STAGES
    acc = _rescale(acc, alpha, o_layout)
    mbarrier.wait(v_ready.index(last), (r // STAGES) & 1)
    o_tok = warpgroup_mma(p_op, _key_rows(v_smem, last, ROWS, BLOCK_N), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
    mbarrier.arrive(v_empty.index(last))
    return acc


@gluon.jit
def _loop_p_in_smem(
    q, k_smem, v_smem, p_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, count, qk_scale, p,
    m_i, l_i, alpha, acc, s_zero, o_layout: gl.constexpr, ME: gl.constexpr, STAGES: gl.constexpr,
    PINGPONG: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
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
        s_tok = _issue_qk(q, k_smem, k_ready, turn_bars, j, s_zero, ME, STAGES, PINGPONG,
                          BLOCK_N, BLOCK_N)  # fmt: skip
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
def _short_walk(
    q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, lo, hi, r0, qk_scale, m_i,
    l_i, acc, idx_row, stride_ik, KV_SIZES, p_layout: gl.constexpr, o_layout: gl.constexpr,
    row_layout: gl.constexpr, ME: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Blocks ``lo..hi-1`` (partial, at most ``ROWS`` real keys each), their first ``ROWS``
    keys: S [64, ROWS] and P V with K = ROWS, the online softmax carried in ``m_i``, ``l_i``,
    ``acc`` (the walk before has issued and retired all its P V). A walk of its own, prologue
    to last P V, since P's registers have another shape than the walk before's."""
    if hi > lo:
        M: gl.constexpr = ROWS_PER_CONSUMER
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
        )
        cols = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))  # [ROWS] key slots
        s_zero = gl.zeros([M, ROWS], gl.float32, layout=s_layout)
        # The row statistics in this walk's score layout (the same rows a thread holds).
        m_i = gl.convert_layout(m_i, gl.SliceLayout(1, s_layout))
        l_i = gl.convert_layout(l_i, gl.SliceLayout(1, s_layout))
        s_tok = _issue_qk(q, k_smem, k_ready, turn_bars, r0 + lo, s_zero, ME, STAGES, PINGPONG,
                          ROWS, BLOCK_N)  # fmt: skip
        _turn_pass(turn_bars, ME, PINGPONG)
        limit = gl.load(KV_SIZES + gl.load(idx_row + lo * stride_ik))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index((r0 + lo) % STAGES))
        s = _padding_masked(s, limit, cols)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, True)
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)  # [64, ROWS], P_lo
        p_op, m_i, l_i, alpha, acc = _walk(
            q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, lo + 1, hi, r0,
            qk_scale, p_op, m_i, l_i, alpha, acc, s_zero, idx_row, stride_ik, KV_SIZES, cols,
            p_layout, o_layout, ME, STAGES, PINGPONG, True, ROWS, BLOCK_N,
        )  # fmt: skip
        acc = _last_pv(p_op, v_smem, v_ready, v_empty, acc, alpha, hi, r0, o_layout, STAGES,
                       ROWS, BLOCK_N)  # fmt: skip
        m_i = gl.convert_layout(m_i, row_layout)
        l_i = gl.convert_layout(l_i, row_layout)
    return acc, m_i, l_i


@gluon.jit
def _store_mapped(o, b, h, rows, dims, mapped_out):
    """o [64, D] (rows and dims in its slice layouts) stored by pointers, each row at the row
    ``O_ROWS`` gives (-1: nowhere): o in the caller's own row order (``OUT_MAPPED``)."""
    O, O_ROWS, stride_ob, stride_oh, stride_os, stride_od = mapped_out
    dest = gl.load(O_ROWS + rows)  # [64]
    row_offs = gl.expand_dims(dest.to(gl.int64) * stride_os, 1)  # [64, 1]
    ptrs = O + b * stride_ob + h * stride_oh + row_offs + gl.expand_dims(dims * stride_od, 0)
    gl.store(ptrs, o.to(O.dtype.element_ty), mask=gl.expand_dims(dest >= 0, 1))


@gluon.jit
def consume_rows(
    desc_o, q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn_bars,
    LSE, count, ends, idx_row, stride_ik, KV_SIZES, q_row, qk_scale, valid, b, h, q_block,
    block_row0, EPILOGUE: gl.constexpr, epilogue_args, ME: gl.constexpr, Q_INDEX: gl.constexpr,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    P_IN_SMEM: gl.constexpr, HAS_KV_SIZES: gl.constexpr, TAIL1: gl.constexpr,
    TAIL2: gl.constexpr, mapped_out, OUT_MAPPED: gl.constexpr, tile,
    PERSISTENT: gl.constexpr,
):  # fmt: skip
    """64 query rows, ``q_smem[Q_INDEX]`` (global rows from ``q_row + 64 * Q_INDEX``): the
    online softmax over every listed key block (with ``HAS_KV_SIZES`` the first ``ends[0]``
    unmasked, the rest masked; with short walks, ``TAIL1``, the blocks from ``ends[1]`` on with
    ``TAIL1`` and from ``ends[2]`` on with ``TAIL2`` keys: ``list_of``), then o (q's dtype,
    ``_store_o``) and lse (fp32), stored only if ``valid``, after the declared ``EPILOGUE``
    (query block ``q_block`` of (b, h), whose first row is ``block_row0``). ``ME`` names the
    consumer for the ping-pong turns. ``tile``: (ring position of the list's first block, Q's
    parity on ``q_bar``, ``q_empty``, ``o_smem``), used by the ``PERSISTENT`` kernel
    (``fwd_sm90_persistent.py``): Q is released on ``q_empty`` once its Q K^Ts have retired,
    and o is staged in ``o_smem``; one block a program stages o in Q's buffer."""
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

    q = q_smem.index(Q_INDEX)  # [64, D] shared (NVMMA-swizzled), A operand of Q K^T

    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_layout)  # running max (base 2)
    l_i = gl.zeros([M], gl.float32, layout=row_layout)  # running sum of exp2
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)  # [64, D] unnormalised o
    s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)  # ignored acc of Q K^T

    r0, q_phase, q_empty, o_smem = tile
    if not PERSISTENT:
        o_smem = q_smem  # Q is dead by the epilogue: its buffer stages o
    # Wait for Q even when the row is empty: the loader's TMA into the buffer must have landed
    # before the epilogue overwrites it (one block a program) or Q is released (persistent).
    mbarrier.wait(q_bar, q_phase)

    num_full, end1, end2 = ends
    if end1 > 0:  # the blocks walked with all BLOCK_N keys: 0..end1-1
        # ---- prologue: S_0 and its softmax (no P V yet) ----
        s_tok = _issue_qk(q, k_smem, k_ready, turn_bars, r0, s_zero, ME, STAGES, PINGPONG,
                          BLOCK_N, BLOCK_N)  # fmt: skip
        _turn_pass(turn_bars, ME, PINGPONG)
        if HAS_KV_SIZES:  # block 0 is partial when no listed block is full
            limit = gl.where(num_full > 0, BLOCK_N, gl.load(KV_SIZES + gl.load(idx_row)))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(r0 % STAGES))  # K_0 read: the loader may refill it
        if HAS_KV_SIZES:
            s = _padding_masked(s, limit, cols)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, HAS_KV_SIZES)  # P_0 fp32
        # ---- blocks 1..count-1 (Q K^T of block j issued with P V of block j-1) ----
        if P_IN_SMEM:
            gl.static_assert(not HAS_KV_SIZES, "P in shared memory: full blocks only")
            acc, m_i, l_i = _loop_p_in_smem(
                q, k_smem, v_smem, p_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, count,
                qk_scale, p, m_i, l_i, alpha, acc, s_zero, o_layout, ME, STAGES, PINGPONG,
                BLOCK_N,
            )  # fmt: skip
        else:
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)  # [64, BN], P_0
            # full blocks
            p_op, m_i, l_i, alpha, acc = _walk(
                q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, 1, num_full,
                r0, qk_scale, p_op, m_i, l_i, alpha, acc, s_zero, idx_row, stride_ik, KV_SIZES,
                cols, p_layout, o_layout, ME, STAGES, PINGPONG, False, BLOCK_N, BLOCK_N,
            )  # fmt: skip
            if HAS_KV_SIZES:
                # partial blocks
                p_op, m_i, l_i, alpha, acc = _walk(
                    q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_bars,
                    gl.maximum(num_full, 1), end1, r0, qk_scale, p_op, m_i, l_i, alpha, acc,
                    s_zero, idx_row, stride_ik, KV_SIZES, cols, p_layout, o_layout, ME, STAGES,
                    PINGPONG, True, BLOCK_N, BLOCK_N,
                )  # fmt: skip
            acc = _last_pv(p_op, v_smem, v_ready, v_empty, acc, alpha, end1, r0, o_layout,
                           STAGES, BLOCK_N, BLOCK_N)  # fmt: skip
    if TAIL1 > 0:  # partial blocks of at most TAIL1, then TAIL2 real keys
        acc, m_i, l_i = _short_walk(
            q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, end1, end2, r0,
            qk_scale, m_i, l_i, acc, idx_row, stride_ik, KV_SIZES, p_layout, o_layout,
            row_layout, ME, STAGES, PINGPONG, TAIL1, BLOCK_N,
        )  # fmt: skip
        acc, m_i, l_i = _short_walk(
            q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, end2, count, r0,
            qk_scale, m_i, l_i, acc, idx_row, stride_ik, KV_SIZES, p_layout, o_layout,
            row_layout, ME, STAGES, PINGPONG, TAIL2, BLOCK_N,
        )  # fmt: skip

    if PERSISTENT:  # every wgmma reading this Q has retired
        mbarrier.arrive(q_empty)
    # ---- epilogue: normalise; rows that saw no block get o = 0, lse = -inf ----
    live = l_i > 0.0
    l_safe = gl.where(live, l_i, 1.0)
    inv_l = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))  # [64]
    o = acc * gl.expand_dims(inv_l, 1)  # [64, D] fp32
    lse = gl.where(live, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))  # [64], natural log
    if valid:
        local_rows = Q_INDEX * M + gl.arange(0, M, layout=gl.SliceLayout(1, o_layout))  # [64]
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))  # [D]
        o = EPILOGUE(o, b.to(gl.int64), h.to(gl.int64), q_block, block_row0 + local_rows,
                     local_rows, dims, *epilogue_args)  # fmt: skip
        offs = q_row + Q_INDEX * M + gl.arange(0, M, layout=row_layout)  # [64] global rows
        gl.store(LSE + offs, lse)
        _store_o(o, desc_o, o_smem, q_row, b.to(gl.int64), h.to(gl.int64), block_row0 + local_rows,
                 dims, mapped_out, Q_INDEX, OUT_MAPPED, PERSISTENT)  # fmt: skip


@gluon.jit
def _store_o(
    o, desc_o, o_smem, q_row, b, h, rows, dims, mapped_out, Q_INDEX: gl.constexpr,
    OUT_MAPPED: gl.constexpr, PERSISTENT: gl.constexpr,
):  # fmt: skip
    """o [64, D], rows ``q_row + 64 * Q_INDEX ..``: by pointers through the row map
    (``OUT_MAPPED``: ``_store_mapped``), else by TMA from ``o_smem[Q_INDEX]``, waited for
    here (one block a program) or left running into the next block (persistent: waited for
    before the buffer is written again)."""
    if OUT_MAPPED:
        _store_mapped(o, b, h, rows, dims, mapped_out)
    else:
        stage = o_smem.index(Q_INDEX)
        tma.store_wait(pendings=0)  # persistent: the last block's o has left the buffer
        stage.store(o.to(stage.dtype))
        fence_async_shared()  # generic-proxy stores -> visible to the TMA (async proxy)
        tma.async_copy_shared_to_global(desc_o, [q_row + Q_INDEX * ROWS_PER_CONSUMER, 0], stage)
        if not PERSISTENT:
            tma.store_wait(pendings=0)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


@gluon.jit
def list_of(KV_IDX, KV_CNT, KV_ENDS, b, h, block, valid, K,
             stride_ib, stride_ih, stride_iq, stride_cb, stride_ch, stride_cq,
             stride_eb, stride_eh, stride_eq, HAS_KV_SIZES: gl.constexpr,
             TAIL1: gl.constexpr, WIDE: gl.constexpr = True):  # fmt: skip
    """``(list pointer, count, ends)`` of query block ``block`` of (b, h); an invalid block
    (past the last one) lists nothing. The count is clamped to the list width ``K``.

    ``ends``: where the walks end (``lists.blocks_by_size``'s groups, ``KV_ENDS`` [..., 3]):
    the full blocks, those walked with all rows, those with ``TAIL1`` rows; those with
    ``TAIL2`` rows end at the count. Without short walks the masked walk takes every partial
    block (its ends: the count), without key-block sizes every block is full. Clamped so that
    ``end0 <= end1 <= end2 <= count``: the loader and the consumers, which read the same ends,
    then walk the same blocks whatever the tensor holds. ``WIDE``: offsets into the lists in
    int64 (False: int32, for lists of fewer than 2**31 entries)."""
    if WIDE:
        b = b.to(gl.int64)
        h = h.to(gl.int64)
        block = block.to(gl.int64)
    idx_row = KV_IDX + b * stride_ib + h * stride_ih + block * stride_iq
    count = gl.load(KV_CNT + b * stride_cb + h * stride_ch + block * stride_cq, mask=valid,
                    other=0)  # fmt: skip
    count = gl.minimum(count, K)
    end0 = count
    end1 = count
    end2 = count
    if HAS_KV_SIZES:
        row = KV_ENDS + b * stride_eb + h * stride_eh + block * stride_eq
        if TAIL1 > 0:
            end2 = gl.minimum(gl.load(row + 2, mask=valid, other=0), count)
            end1 = gl.minimum(gl.load(row + 1, mask=valid, other=0), end2)
        end0 = gl.minimum(gl.load(row, mask=valid, other=0), end1)
    return idx_row, count, (end0, end1, end2)


@gluon.jit
def key_ring(desc_k, desc_v, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_DIM: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """A K/V ring, ``(k, v [STAGES, BLOCK_N, D], k_ready, v_ready, k_empty, v_empty)``, its
    barriers initialised: ready by the loader's expect (TMA bytes complete it), empty by one
    arrival per consumer warpgroup."""
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_v.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    return k_smem, v_smem, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def turn_barriers():
    """The two consumers' GEMM turns (ping-pong); consumer 0 holds the first: phase 0 of its
    barrier completes up front."""
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn_bars.index(0), count=1)
    mbarrier.init(turn_bars.index(1), count=1)
    mbarrier.arrive(turn_bars.index(0))
    return turn_bars


@gluon.jit
def block_sparse_attn_fwd_gluon_kernel(
    desc_q, desc_k, desc_v, desc_o,  # TMA over [B*H*S, D]: q/o blocks [64, D], k/v [BN, D]
    desc_k1, desc_v1, desc_k2, desc_v2,  # TAIL1: k/v in boxes [TAIL1, D], [TAIL2, D]
    LSE,  # fp32 [B, H, Sq]
    mapped_out,  # OUT_MAPPED: (O, O_ROWS int32 [Sq], o's four strides), o stored by pointers
    KV_IDX, KV_CNT,  # int32 [Bi, H, NQ, K], [Bi, H, NQ]
    KV_SIZES, KV_ENDS,  # HAS_KV_SIZES: int32 [NK] real keys per block; [Bi, H, NQ, 3] ends
    stride_ib, stride_ih, stride_iq, stride_ik,  # stride_ib == 0 when lists broadcast over batch
    stride_cb, stride_ch, stride_cq,
    stride_eb, stride_eh, stride_eq,
    EPILOGUE: gl.constexpr, epilogue_args,  # o = EPILOGUE(o, ..., *epilogue_args) before the store
    H, Sq, Skv, NQ, K,  # K: the lists' width (bound of every count)
    qk_scale,  # softmax scale * log2(e), fp32
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr, TAIL1: gl.constexpr, TAIL2: gl.constexpr,
    STAGES: gl.constexpr, PINGPONG: gl.constexpr, P_IN_SMEM: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, OUT_MAPPED: gl.constexpr = False,
):  # fmt: skip
    """A 128-row query block per program: one list, one K/V ring, its two 64-row halves on
    the two consumer warpgroups (ping-pong). ``TAIL1``, ``TAIL2``: the rows of the short walks
    of partial key blocks (both 0: partial blocks are walked with all rows)."""
    gl.static_assert((TAIL1 == 0) == (TAIL2 == 0), "both short walks or none")
    gl.static_assert(TAIL1 == 0 or HAS_KV_SIZES, "short walks come with key-block sizes")
    gl.static_assert(BLOCK_M == 2 * ROWS_PER_CONSUMER, "two consumer warpgroups of 64 rows")
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_row = pid_bh * Sq + pid_m * BLOCK_M  # first row of this query block in [B*H*Sq, D]
    kv_row0 = pid_bh * Skv  # first key row of this (b, h) in [B*H*Skv, D]
    valid = pid_m < NQ  # always: the grid has NQ programs along dim 0
    NK = Skv // BLOCK_N  # key blocks: the loader clamps every entry below it
    idx_row, count, ends = list_of(KV_IDX, KV_CNT, KV_ENDS, b, h, pid_m, valid, K,
                                    stride_ib, stride_ih, stride_iq, stride_cb, stride_ch,
                                    stride_cq, stride_eb, stride_eh, stride_eq, HAS_KV_SIZES,
                                    TAIL1)  # fmt: skip
    tail_descs = (desc_k1, desc_v1, desc_k2, desc_v2)

    # Shared memory: Q (also o's staging buffer) 32 KB, K and V rings 2 * STAGES * 32 KB.
    q_smem = gl.allocate_shared_memory(
        desc_q.dtype, [2, ROWS_PER_CONSUMER, HEAD_DIM], desc_q.layout
    )  # [2, 64, D]; fmt: skip
    k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = key_ring(desc_k, desc_v, STAGES,
                                                                  BLOCK_N, HEAD_DIM, 2)
    if P_IN_SMEM:  # P staging, per consumer: [buffer, 64, BN], 2 x 32 KB in all
        p_smem0 = gl.allocate_shared_memory(desc_k.dtype, [2, ROWS_PER_CONSUMER, BLOCK_N],
                                            desc_k.layout)  # fmt: skip
        p_smem1 = gl.allocate_shared_memory(desc_k.dtype, [2, ROWS_PER_CONSUMER, BLOCK_N],
                                            desc_k.layout)  # fmt: skip
    else:  # unused placeholders (the consumers never touch them)
        p_smem0 = gl.allocate_shared_memory(desc_k.dtype, [2, 8, 64], desc_k.layout)
        p_smem1 = gl.allocate_shared_memory(desc_k.dtype, [2, 8, 64], desc_k.layout)

    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)  # the loader's expect is the one arrival; TMA bytes complete it
    turn_bars = turn_barriers()
    fence_async_shared()  # barrier inits visible to the async proxy before any TMA uses them

    # (Tuples are spelled out: concatenating them in a jit function unwraps the constexprs.)
    gl.warp_specialize(
        [
            (consume_rows, (desc_o, q_smem, k_smem, v_smem, p_smem0, q_bar, k_ready, v_ready,
                         k_empty, v_empty, turn_bars, LSE, count, ends, idx_row, stride_ik,
                         KV_SIZES, q_row, qk_scale, valid, b, h, pid_m, pid_m * BLOCK_M,
                         EPILOGUE, epilogue_args, gl.constexpr(0), gl.constexpr(0), BLOCK_N,
                         HEAD_DIM, STAGES, PINGPONG, P_IN_SMEM, HAS_KV_SIZES, TAIL1,
                         TAIL2, mapped_out, OUT_MAPPED, (0, 0, q_bar, q_smem),
                         gl.constexpr(False))),  # default partition: rows 0-63
            (consume_rows, (desc_o, q_smem, k_smem, v_smem, p_smem1, q_bar, k_ready, v_ready,
                         k_empty, v_empty, turn_bars, LSE, count, ends, idx_row, stride_ik,
                         KV_SIZES, q_row, qk_scale, valid, b, h, pid_m, pid_m * BLOCK_M,
                         EPILOGUE, epilogue_args, gl.constexpr(1), gl.constexpr(1), BLOCK_N,
                         HEAD_DIM, STAGES, PINGPONG, P_IN_SMEM, HAS_KV_SIZES, TAIL1,
                         TAIL2, mapped_out, OUT_MAPPED, (0, 0, q_bar, q_smem),
                         gl.constexpr(False))),  # rows 64-127
            (_loader, (desc_q, desc_k, desc_v, tail_descs, q_smem, k_smem, v_smem, q_bar,
                       k_ready, v_ready, k_empty, v_empty, idx_row, stride_ik, count, ends,
                       q_row, kv_row0, NK, BLOCK_N, STAGES, gl.constexpr(2), TAIL1, TAIL2)),
        ],
        [4, 1],  # warps: second consumer warpgroup, loader warp
        [CONSUMER_REGS, LOADER_REGS],  # setmaxnreg: the loader gives its registers away
    )  # fmt: skip


@gluon.jit
def block_sparse_attn_fwd_gluon_tiles_kernel(
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_KV_SIZES: gl.constexpr, TAIL1: gl.constexpr, TAIL2: gl.constexpr,
    STAGES: gl.constexpr, PINGPONG: gl.constexpr, P_IN_SMEM: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, OUT_MAPPED: gl.constexpr = False,
):  # fmt: skip
    """Two 64-row query blocks per program (video tiles: 2 * pid and 2 * pid + 1), each with
    its own list, K/V ring and loader warp, one per consumer warpgroup. The consumers do not
    take turns (their lists may differ in length); the scheduler interleaves them."""
    gl.static_assert(BLOCK_M == ROWS_PER_CONSUMER, "one consumer warpgroup per 64-row block")
    gl.static_assert(not P_IN_SMEM, "P in shared memory: 128-row blocks only")
    gl.static_assert((TAIL1 == 0) == (TAIL2 == 0), "both short walks or none")
    gl.static_assert(TAIL1 == 0 or HAS_KV_SIZES, "short walks come with key-block sizes")
    pid = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kv_row0 = pid_bh * Skv
    block0 = 2 * pid
    block1 = 2 * pid + 1
    valid0 = block0 < NQ
    valid1 = block1 < NQ  # false in the last program when NQ is odd
    NK = Skv // BLOCK_N
    idx_row0, count0, ends0 = list_of(KV_IDX, KV_CNT, KV_ENDS, b, h, block0, valid0, K,
                                       stride_ib, stride_ih, stride_iq, stride_cb, stride_ch,
                                       stride_cq, stride_eb, stride_eh, stride_eq, HAS_KV_SIZES,
                                       TAIL1)  # fmt: skip
    idx_row1, count1, ends1 = list_of(KV_IDX, KV_CNT, KV_ENDS, b, h, block1, valid1, K,
                                       stride_ib, stride_ih, stride_iq, stride_cb, stride_ch,
                                       stride_cq, stride_eb, stride_eh, stride_eq, HAS_KV_SIZES,
                                       TAIL1)  # fmt: skip
    tail_descs = (desc_k1, desc_v1, desc_k2, desc_v2)
    # Global rows of the two query blocks. Past the last block (NQ odd) the loader still reads
    # a Q tile (rows of the next head, or zeros past the tensor: TMA bounds) so the consumer's
    # wait completes; nothing is stored there.
    q_row0 = pid_bh * Sq + block0 * BLOCK_M
    q_row1 = pid_bh * Sq + block1 * BLOCK_M

    # Shared memory per consumer: Q 16 KB, K and V rings 2 * STAGES * 16 KB.
    q_smem0 = gl.allocate_shared_memory(desc_q.dtype, [1, BLOCK_M, HEAD_DIM], desc_q.layout)
    q_smem1 = gl.allocate_shared_memory(desc_q.dtype, [1, BLOCK_M, HEAD_DIM], desc_q.layout)
    k_smem0, v_smem0, k_ready0, v_ready0, k_empty0, v_empty0 = key_ring(desc_k, desc_v, STAGES,
                                                                        BLOCK_N, HEAD_DIM, 1)
    k_smem1, v_smem1, k_ready1, v_ready1, k_empty1, v_empty1 = key_ring(desc_k, desc_v, STAGES,
                                                                        BLOCK_N, HEAD_DIM, 1)
    p_unused = gl.allocate_shared_memory(desc_k.dtype, [2, 8, 64], desc_k.layout)

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar0 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_bar1 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    turn_unused = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(q_bar0, count=1)
    mbarrier.init(q_bar1, count=1)
    fence_async_shared()

    gl.warp_specialize(
        [
            (consume_rows, (desc_o, q_smem0, k_smem0, v_smem0, p_unused, q_bar0, k_ready0,
                         v_ready0, k_empty0, v_empty0, turn_unused, LSE, count0, ends0,
                         idx_row0, stride_ik, KV_SIZES, q_row0, qk_scale, valid0, b, h, block0,
                         block0 * BLOCK_M, EPILOGUE, epilogue_args, gl.constexpr(0),
                         gl.constexpr(0), BLOCK_N, HEAD_DIM, STAGES, gl.constexpr(False),
                         gl.constexpr(False), HAS_KV_SIZES, TAIL1, TAIL2, mapped_out,
                         OUT_MAPPED, (0, 0, q_bar0, q_smem0), gl.constexpr(False))),
            (consume_rows, (desc_o, q_smem1, k_smem1, v_smem1, p_unused, q_bar1, k_ready1,
                         v_ready1, k_empty1, v_empty1, turn_unused, LSE, count1, ends1,
                         idx_row1, stride_ik, KV_SIZES, q_row1, qk_scale, valid1, b, h, block1,
                         block1 * BLOCK_M, EPILOGUE, epilogue_args, gl.constexpr(1),
                         gl.constexpr(0), BLOCK_N, HEAD_DIM, STAGES, gl.constexpr(False),
                         gl.constexpr(False), HAS_KV_SIZES, TAIL1, TAIL2, mapped_out,
                         OUT_MAPPED, (0, 0, q_bar1, q_smem1), gl.constexpr(False))),
            (_loader, (desc_q, desc_k, desc_v, tail_descs, q_smem0, k_smem0, v_smem0,
                       q_bar0, k_ready0, v_ready0, k_empty0, v_empty0, idx_row0, stride_ik,
                       count0, ends0, q_row0, kv_row0, NK, BLOCK_N, STAGES, gl.constexpr(1),
                       TAIL1, TAIL2)),
            (_loader, (desc_q, desc_k, desc_v, tail_descs, q_smem1, k_smem1, v_smem1,
                       q_bar1, k_ready1, v_ready1, k_empty1, v_empty1, idx_row1, stride_ik,
                       count1, ends1, q_row1, kv_row0, NK, BLOCK_N, STAGES, gl.constexpr(1),
                       TAIL1, TAIL2)),
        ],
        [4, 1, 1],  # warps: second consumer warpgroup, two loader warps
        [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
    )  # fmt: skip


@gluon.jit
def forward_identity_sm90(o, b, h, q_block, rows, local_rows, dims):
    """The epilogue hook when none is declared (``no_epilogue.py``'s, in Gluon)."""
    return o
