"""The full-blocks-first reorder of the key-block lists (launcher: ``../lists.py``).

Memory-safe whatever the lists hold, and its output is valid by construction: counts are
clamped to ``K``, and an entry out of ``[0, NK)`` is dropped (not looked up, not stored), so
the kernels that read the reordered lists need no checks of their own (``OUT_CNT``: the
entries kept)."""

import triton
import triton.language as tl


@triton.jit
def full_blocks_first_kernel(
    KV_IDX, KV_CNT, KV_SIZES, OUT_IDX, OUT_FULL, OUT_CNT,
    # kv_idx [Bi, H, NQ, K] (int32 or int64), kv_cnt [Bi, H, NQ], kv_sizes int32 [NK];
    # out_idx int32 [Bi, H, NQ, K], out_full and out_cnt int32 [Bi, H, NQ], all contiguous
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    H, NQ, K, NK, num_rows, full_size,
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
    full = (live & (sizes == full_size)).to(tl.int32)
    partial = (live & (sizes != full_size)).to(tl.int32)
    num_full = tl.sum(full, axis=1)  # [R]
    slot = tl.where(
        full != 0, tl.cumsum(full, axis=1) - 1, num_full[:, None] + tl.cumsum(partial, axis=1) - 1
    )  # [R, W]: each row's full blocks, then its partial ones, both in list order
    out_row = rows64 * K
    tl.store(OUT_IDX + out_row[:, None] + slot, blocks.to(tl.int32), mask=live)
    tl.store(OUT_FULL + rows64, num_full, mask=row_ok)
    tl.store(OUT_CNT + rows64, num_full + tl.sum(partial, axis=1), mask=row_ok)
