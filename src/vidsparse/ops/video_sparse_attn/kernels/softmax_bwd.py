"""The row-wise middle of the coarse attention's backward (launched by ``../coarse.py``'s
``coarse_attn_bwd``). Per row of raw scores ``s = qc kc^T`` and ``dp = do_c vc^T``::

    p  = softmax(scale * s)                  fp32
    ds = p * (dp - sum_j p_j dp_j) * scale   fp32
    stored: p and ds, in the gradient matmuls' dtype

One launch in place of PyTorch's chain of a softmax and seven elementwise passes over the
``[B, H, Nt, Nt]`` scores (each a read and a write of the whole tensor). Each program walks its
rows in column steps three times (max and sum, then the row's dot, then the stores); after the
first step a row is in L2, so the scores come from memory about once.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["coarse_softmax_bwd_kernel"]


@triton.jit
def coarse_softmax_bwd_kernel(
    S, DP, P_OUT, DS_OUT,  # [rows, num_cols] each, rows contiguous (row strides below)
    stride_s, stride_dp, stride_p, stride_ds,
    num_rows, num_cols, scale, scale_log2,
    ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    # Rows past the end read the last row (no -inf - -inf in their maxima); never stored.
    rows = tl.minimum(rows, num_rows - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    s_rows, dp_rows = S + rows[:, None] * stride_s, DP + rows[:, None] * stride_dp

    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    for start in range(0, num_cols, BLOCK_COLS):
        in_row = (start + cols < num_cols)[None, :]
        s = tl.load(s_rows + start + cols[None, :], mask=in_row, other=float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        p = tl.exp2((s - new_max[:, None]) * scale_log2)
        row_sum = row_sum * tl.exp2((row_max - new_max) * scale_log2) + tl.sum(p, axis=1)
        row_max = new_max

    inv_sum = 1.0 / row_sum
    delta = tl.zeros([ROWS], tl.float32)
    for start in range(0, num_cols, BLOCK_COLS):
        in_row = (start + cols < num_cols)[None, :]
        s = tl.load(s_rows + start + cols[None, :], mask=in_row, other=float("-inf"))
        dp = tl.load(dp_rows + start + cols[None, :], mask=in_row, other=0.0).to(tl.float32)
        p = tl.exp2((s - row_max[:, None]) * scale_log2) * inv_sum[:, None]
        delta += tl.sum(p * dp, axis=1)

    store_ok = row_ok[:, None]
    p_rows, ds_rows = P_OUT + rows[:, None] * stride_p, DS_OUT + rows[:, None] * stride_ds
    for start in range(0, num_cols, BLOCK_COLS):
        in_row = (start + cols < num_cols)[None, :]
        s = tl.load(s_rows + start + cols[None, :], mask=in_row, other=float("-inf"))
        dp = tl.load(dp_rows + start + cols[None, :], mask=in_row, other=0.0).to(tl.float32)
        p = tl.exp2((s - row_max[:, None]) * scale_log2) * inv_sum[:, None]
        ds = p * (dp - delta[:, None]) * scale
        ok = store_ok & in_row
        tl.store(p_rows + start + cols[None, :], p.to(P_OUT.dtype.element_ty), mask=ok)
        tl.store(ds_rows + start + cols[None, :], ds.to(DS_OUT.dtype.element_ty), mask=ok)
