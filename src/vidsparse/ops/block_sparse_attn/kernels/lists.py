"""The by-size reorder of the key-block lists (launcher: ``../lists.py``).

Memory-safe whatever the lists hold, and its output is valid by construction: counts are
clamped to ``K``, and an entry out of ``[0, NK)`` is dropped (not looked up, not stored), so
the kernels that read the reordered lists need no checks of their own (``OUT_CNT``: the
entries kept)."""

import triton
import triton.language as tl

# dK/dV's walks of a key block's query blocks, each a column of the transposed lists' offsets:
# all rows, the first QTAIL1, the first QTAIL2 (``../lists.query_groups``).
QUERY_GROUPS = tl.constexpr(3)


@triton.jit
def _group_slots(member, start):
    """Slots of a group's entries, in list order from ``start`` [R], and its size [R]."""
    member = member.to(tl.int32)
    return start[:, None] + tl.cumsum(member, axis=1) - 1, tl.sum(member, axis=1)


@triton.jit
def blocks_by_size_kernel(
    KV_IDX, KV_CNT, KV_SIZES, OUT_IDX, OUT_ENDS, OUT_CNT,
    # kv_idx [Bi, H, NQ, K] (int32 or int64), kv_cnt [Bi, H, NQ], kv_sizes int32 [NK];
    # out_idx int32 [Bi, H, NQ, K], out_ends int32 [Bi, H, NQ, 3], out_cnt int32 [Bi, H, NQ],
    # all contiguous
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    H, NQ, K, NK, num_rows, full_size, tail1, tail2,  # tail1, tail2: 0 where there is no such walk
    ROWS: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R] flat (b, h, i) rows
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    i = rows64 % NQ
    h = (rows64 // NQ) % H
    b = rows64 // (NQ * H)
    count = tl.load(KV_CNT + b * stride_cb + h * stride_ch + i * stride_cq, mask=row_ok, other=0)
    count = tl.minimum(count, K)

    offs = tl.arange(0, WIDTH)  # [W]
    live = offs[None, :] < count[:, None]  # [R, W]; count is 0 on rows past num_rows
    in_row = b * stride_ib + h * stride_ih + i * stride_iq  # [R]
    blocks = tl.load(KV_IDX + in_row[:, None] + offs[None, :] * stride_ik, mask=live, other=0)
    live = live & (blocks >= 0) & (blocks < NK)  # entries out of range are dropped
    sizes = tl.load(KV_SIZES + blocks, mask=live, other=0)  # [R, W]
    full = live & (sizes == full_size)
    partial = live & (sizes != full_size)
    short2 = partial & (tail2 > 0) & (sizes <= tail2)
    short1 = partial & (tail1 > 0) & (sizes <= tail1) & ~short2
    long = partial & ~short1 & ~short2
    # Each row: full blocks, partial ones walked with all rows, with tail1, with tail2; each
    # group in list order.
    zero = tl.zeros([ROWS], dtype=tl.int32)
    slot_full, end0 = _group_slots(full, zero)
    slot_long, n_long = _group_slots(long, end0)
    end1 = end0 + n_long
    slot_short1, n_short1 = _group_slots(short1, end1)
    end2 = end1 + n_short1
    slot_short2, n_short2 = _group_slots(short2, end2)
    slot = tl.where(full, slot_full, tl.where(long, slot_long,
                                              tl.where(short1, slot_short1, slot_short2)))
    out_row = rows64 * K
    tl.store(OUT_IDX + out_row[:, None] + slot, blocks.to(tl.int32), mask=live)
    tl.store(OUT_ENDS + rows64 * 3, end0, mask=row_ok)
    tl.store(OUT_ENDS + rows64 * 3 + 1, end1, mask=row_ok)
    tl.store(OUT_ENDS + rows64 * 3 + 2, end2, mask=row_ok)
    tl.store(OUT_CNT + rows64, end2 + n_short2, mask=row_ok)


# The transposed lists (launcher: ``../lists.transpose_lists``), in three launches after one
# zeroed workspace: each (row, key block) pair marks one bit of the key block's row bitmap
# and, where it set the bit, counts one in its column; the columns' offsets; each column's
# rows read back from the bitmaps in ascending order. No sort, no host sync, the same result
# on every run (integer atomics); duplicates of a pair count once.


@triton.jit
def mark_pairs_kernel(
    KV_IDX, KV_CNT, Q_GROUPS, BITS, COUNTS,
    # kv_idx [Bi, H, NQ, K] (int32 or int64), kv_cnt [Bi, H, NQ], q_groups int32 [NQ] (read
    # only with GROUPS > 1); bits int32 [Bi*H, NK, WORDS], counts int32 [Bi*H, NK*GROUPS], zeroed
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    H, NQ, K, NK, WORDS, num_rows,
    GROUPS: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R] flat (b, h, i) rows
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    i = rows64 % NQ
    bh = rows64 // NQ
    b = bh // H
    h = bh % H
    count = tl.load(KV_CNT + b * stride_cb + h * stride_ch + i * stride_cq, mask=row_ok, other=0)
    count = tl.minimum(tl.maximum(count, 0), K)

    offs = tl.arange(0, WIDTH)  # [W]
    live = offs[None, :] < count[:, None]  # [R, W]
    in_row = b * stride_ib + h * stride_ih + i * stride_iq  # [R]
    blocks = tl.load(KV_IDX + in_row[:, None] + offs[None, :] * stride_ik, mask=live, other=0)
    live = live & (blocks >= 0) & (blocks < NK)
    blocks = tl.where(live, blocks, 0).to(tl.int64)
    shift = (i % 32).to(tl.int32)[:, None]  # [R, 1]
    bit = tl.full([ROWS, WIDTH], 1, tl.int32) << shift
    word = BITS + (bh[:, None] * NK + blocks) * WORDS + (i // 32)[:, None]
    old = tl.atomic_or(word, bit, mask=live, sem="relaxed")
    first = live & (((old >> shift) & 1) == 0)  # this pair set the bit: count it once
    group = 0
    if GROUPS > 1:
        group = tl.load(Q_GROUPS + i, mask=row_ok, other=0).to(tl.int64)[:, None]
    column = bh[:, None] * (NK * GROUPS) + blocks * GROUPS + group
    tl.atomic_add(COUNTS + column, tl.full([ROWS, WIDTH], 1, tl.int32), mask=first, sem="relaxed")


@triton.jit
def column_offsets_kernel(
    COUNTS, Q_OFF, Q_IDX,
    # counts int32 [Bi*H, C]; q_off int32 [Bi*H, C + 1]; q_idx int32 [Bi*H, NQK]
    C, NQK,
    STEP: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    out = Q_OFF + bh * (C + 1)
    tl.store(out, 0)
    total = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, C, STEP):
        c = c0 + tl.arange(0, STEP)
        n = tl.load(COUNTS + bh * C + c, mask=c < C, other=0)
        tl.store(out + 1 + c, total + tl.cumsum(n, axis=0), mask=c < C)
        total += tl.sum(n, axis=0)
    # the slots past the last column's end hold 0 (transpose_block_lists' contract)
    for s0 in range(total, NQK, STEP):
        s = s0 + tl.arange(0, STEP)
        tl.store(Q_IDX + bh * NQK + s, tl.zeros([STEP], dtype=tl.int32), mask=s < NQK)


@triton.jit
def column_rows_kernel(
    BITS, Q_GROUPS, Q_OFF, Q_IDX,
    # as in mark_pairs_kernel and column_offsets_kernel, all written before this launch
    NQ, NK, WORDS, NQK,
    GROUPS: tl.constexpr, KEYS: tl.constexpr, ROWS_STEP: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0) * KEYS + tl.arange(0, KEYS)  # [J] key blocks
    bh = tl.program_id(1).to(tl.int64)
    j_ok = j < NK
    bitmap = BITS + (bh * NK + j.to(tl.int64)) * WORDS  # [J]
    for g in tl.static_range(GROUPS):
        slot = tl.load(Q_OFF + bh * (NK * GROUPS + 1) + j * GROUPS + g, mask=j_ok, other=0)
        for q0 in range(0, NQ, ROWS_STEP):
            q = q0 + tl.arange(0, ROWS_STEP)  # [Q] query blocks, ascending
            q_ok = q < NQ
            word = tl.load(bitmap[:, None] + (q // 32)[None, :],
                           mask=j_ok[:, None] & q_ok[None, :], other=0)  # fmt: skip
            hit = ((word >> (q % 32)[None, :]) & 1) != 0  # [J, Q]
            if GROUPS > 1:
                group = tl.load(Q_GROUPS + q, mask=q_ok, other=-1)
                hit = hit & (group == g)[None, :]
            ones = hit.to(tl.int32)
            dest = slot[:, None] + tl.cumsum(ones, axis=1) - 1
            rows = tl.zeros([KEYS, ROWS_STEP], dtype=tl.int32) + q[None, :]
            tl.store(Q_IDX + bh * NQK + dest, rows, mask=hit)
            slot += tl.sum(ones, axis=1)
