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
def _list_rows(
    KV_IDX, KV_CNT,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    H, NQ, K, NK, num_rows,
    ROWS: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """This program's ``ROWS`` flat (b, h, i) rows of the lists: ``(rows64 [R], row_ok [R],
    bh [R], i [R], blocks [R, W], live [R, W])``. ``live``: the entries read (counts clamped
    into ``[0, K]``) that lie in ``[0, NK)``; ``blocks`` holds 0 elsewhere."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    i = rows64 % NQ
    bh = rows64 // NQ
    b = bh // H
    h = bh % H
    count = tl.load(KV_CNT + b * stride_cb + h * stride_ch + i * stride_cq, mask=row_ok, other=0)
    count = tl.minimum(count, K)  # count is 0 on rows past num_rows; negative: nothing read
    offs = tl.arange(0, WIDTH)  # [W]
    live = offs[None, :] < count[:, None]  # [R, W]
    in_row = b * stride_ib + h * stride_ih + i * stride_iq  # [R]
    blocks = tl.load(KV_IDX + in_row[:, None] + offs[None, :] * stride_ik, mask=live, other=0)
    live = live & (blocks >= 0) & (blocks < NK)  # entries out of range are dropped
    return rows64, row_ok, bh, i, tl.where(live, blocks, 0), live


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
    rows64, row_ok, _, _, blocks, live = _list_rows(
        KV_IDX, KV_CNT, stride_ib, stride_ih, stride_iq, stride_ik, stride_cb, stride_ch,
        stride_cq, H, NQ, K, NK, num_rows, ROWS, WIDTH,
    )  # fmt: skip
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


# The transposed lists (launcher: ``../lists.transpose_lists``), in four launches after one
# zeroed bitmap (a bit per query block in each (key block, query group) column): each listed
# pair sets its bit; each column's word counts and their prefix; the columns' offsets; each
# pair stored at its column's offset plus the set bits below its own. Work O(pairs + columns x
# words), no sort, no host sync, the same result every run; a pair listed twice is one bit, so
# both copies store to one slot.


@triton.jit
def _listed_pairs(LISTS, WORDS, GROUPS: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """This program's pairs: ``(bh [R, 1], i [R, 1], column [R, W], word [R, W], live [R, W])``
    for every entry of ``_list_rows``' rows: its column among all (batch, head)s' (``bh * NK *
    GROUPS + key block * GROUPS + query group``) and the index of the bitmap word holding its
    bit (bit ``i % 32`` of word ``column * WORDS + i // 32``). ``LISTS``: ``(kv_idx [Bi, H,
    NQ, K] (int32 or int64), kv_cnt [Bi, H, NQ], q_groups int32 [NQ] (read only with GROUPS >
    1), kv_idx's four strides, kv_cnt's three, H, NQ, K, NK, Bi*H*NQ)``."""
    KV_IDX, KV_CNT, Q_GROUPS, stride_ib, stride_ih, stride_iq, stride_ik, stride_cb, \
        stride_ch, stride_cq, H, NQ, K, NK, num_rows = LISTS  # fmt: skip
    _, row_ok, bh, i, blocks, live = _list_rows(
        KV_IDX, KV_CNT, stride_ib, stride_ih, stride_iq, stride_ik, stride_cb, stride_ch,
        stride_cq, H, NQ, K, NK, num_rows, ROWS, WIDTH,
    )  # fmt: skip
    bh, i = bh[:, None], i[:, None]
    column = bh * (NK * GROUPS) + blocks.to(tl.int64) * GROUPS
    if GROUPS > 1:
        column += tl.load(Q_GROUPS + i, mask=row_ok[:, None], other=0).to(tl.int64)
    return bh, i, column, column * WORDS + i // 32, live


@triton.jit
def _popcount(x):
    """Set bits of each uint32 (SWAR: pairs, nibbles, bytes, then a multiply sums the bytes)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def mark_pairs_kernel(
    LISTS, BITS,  # the lists (_listed_pairs); bits int32 [Bi*H, NK*GROUPS, WORDS], zeroed
    WORDS,
    GROUPS: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    _, i, _, word, live = _listed_pairs(LISTS, WORDS, GROUPS, ROWS, WIDTH)
    bit = tl.full([ROWS, WIDTH], 1, tl.int32) << (i % 32).to(tl.int32)
    tl.atomic_or(BITS + word, bit, mask=live, sem="relaxed")


@triton.jit
def column_words_kernel(
    BITS, BELOW, COUNTS,
    # bits int32 [Bi*H, C, WORDS]; below int32 [Bi*H, C, WORDS]: each word's set bits before
    # it in its column; counts int32 [Bi*H, C]: each column's
    C, WORDS,
    COLS: tl.constexpr, WORDS_P: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0) * COLS + tl.arange(0, COLS)  # [C'] columns
    bh = tl.program_id(1).to(tl.int64)
    w = tl.arange(0, WORDS_P)
    ok = (c < C)[:, None] & (w < WORDS)[None, :]
    at = (bh * C + c)[:, None] * WORDS + w[None, :]
    words = tl.load(BITS + at, mask=ok, other=0).to(tl.uint32, bitcast=True)
    n = _popcount(words).to(tl.int32)
    tl.store(BELOW + at, tl.cumsum(n, axis=1) - n, mask=ok)
    tl.store(COUNTS + bh * C + c, tl.sum(n, axis=1), mask=c < C)


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
def place_pairs_kernel(
    LISTS, BITS, BELOW, Q_OFF, Q_IDX,
    # as in mark_pairs_kernel, column_words_kernel and column_offsets_kernel, all written
    # before this launch; q_off int32 [Bi*H, NK*GROUPS + 1], q_idx int32 [Bi*H, NQK]
    WORDS, NQK,
    GROUPS: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    bh, i, column, word, live = _listed_pairs(LISTS, WORDS, GROUPS, ROWS, WIDTH)
    bits = tl.load(BITS + word, mask=live, other=0).to(tl.uint32, bitcast=True)
    bit = tl.full([ROWS, WIDTH], 1, tl.uint32) << (i % 32).to(tl.uint32)
    rank = _popcount(bits & (bit - 1)).to(tl.int32) + tl.load(BELOW + word, mask=live, other=0)
    # q_off's rows hold NK*GROUPS + 1 entries (the columns', then the total): bh more than
    # the column's index among all columns
    start = tl.load(Q_OFF + column + bh, mask=live, other=0)
    rows = tl.zeros([ROWS, WIDTH], dtype=tl.int32) + i.to(tl.int32)
    tl.store(Q_IDX + bh * NQK + start + rank, rows, mask=live)
