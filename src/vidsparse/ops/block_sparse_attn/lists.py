"""Key-block lists reordered for the forward: full blocks first.

With ``kv_block_sizes``, a listed key block may end in padding keys, whose scores the forward
must mask: one compare and select per score, ~160 extra integer and select instructions per
128x128 step (benchmarks/NOTES.md). Most listed blocks are full (VSA at Wan 480p: 455 of 624
tiles), so the forward walks each list in two loops, the full blocks without the mask and then
the partial ones with it. That needs the full blocks at the front of each list::

    kv_indices[b, h, i]   = [ 7, 12, 13, 20, 31, ...]      (ascending, any order is legal)
    kv_block_sizes[block] =  64  40  64  64  17            (block_kv = 64)
    reordered             = [ 7, 13, 20, 12, 31, ...]      full_counts[b, h, i] = 3
                              |- full --|  |partial|

A stable partition per row, in one small kernel (the lists are O(B*H*NQ*K) int32; the
attention that reads them is O(B*H*NQ*K*block_q*block_kv*D)).

Lists derived from the caller's (this reorder, the backward's transposed lists) are cached per
source tensor (``derived_lists``, a ``utils.tensor_cache.TensorCache``, the mechanism the
validation cache and Ulysses' head slices use too): block lists are usually built once and used
by many calls (every layer of a step, every step of a plan, a forward and its backward), as
FlexAttention's ``BlockMask`` keeps its transposed lists from creation on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vidsparse.masks.block_sparse import transpose_block_lists
from vidsparse.utils.tensor_cache import TensorCache

# Lists derived from block lists, per source tensors (see TensorCache).
derived_lists = TensorCache()


def cached_full_blocks_first(kv_indices, kv_counts, kv_block_sizes, block_kv):
    """``full_blocks_first``, computed once per source lists (``derived_lists``)."""
    return derived_lists.get(
        "full_first", (kv_indices, kv_counts, kv_block_sizes), (block_kv,),
        lambda: full_blocks_first(kv_indices, kv_counts, kv_block_sizes, block_kv),
    )  # fmt: skip


def cached_transpose(kv_indices, kv_counts, num_kv_blocks):
    """``transpose_block_lists``, computed once per source lists (``derived_lists``)."""
    return derived_lists.get(
        "transpose", (kv_indices, kv_counts), (num_kv_blocks,),
        lambda: transpose_block_lists(kv_indices, kv_counts, num_kv_blocks),
    )  # fmt: skip


_ROW_ELEMENTS = 1024  # list entries per program (rows * next_power_of_2(K)): 8 a thread, spill-free


@triton.jit
def _full_blocks_first_kernel(
    KV_IDX, KV_CNT, KV_SIZES, OUT_IDX, OUT_FULL,
    # kv_idx [Bi, H, NQ, K] (int32 or int64), kv_cnt [Bi, H, NQ], kv_sizes int32 [NK];
    # out_idx int32 [Bi, H, NQ, K] contiguous, out_full int32 [Bi, H, NQ] contiguous
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    H, NQ, K, num_rows, full_size,
    ROWS: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R] flat (b, h, i) rows
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    i = rows64 % NQ
    h = (rows64 // NQ) % H
    b = rows64 // (NQ * H)
    count = tl.load(KV_CNT + b * stride_cb + h * stride_ch + i * stride_cq, mask=row_ok, other=0)

    offs = tl.arange(0, WIDTH)  # [W]
    live = offs[None, :] < count[:, None]  # [R, W]; count is 0 on rows past num_rows
    in_row = b * stride_ib + h * stride_ih + i * stride_iq  # [R]
    blocks = tl.load(KV_IDX + in_row[:, None] + offs[None, :] * stride_ik, mask=live, other=0)
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


def full_blocks_first(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor,
    block_kv: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, full_counts)``: each row of ``kv_indices`` with its full key blocks
    (``kv_block_sizes[j] == block_kv``) first and its partial ones after, each group in list
    order; ``full_counts[b, h, i]`` full ones. int32, contiguous, shaped like the inputs;
    entries at or past ``kv_counts`` are unspecified (no kernel reads them)."""
    bi, h, nq, k = kv_indices.shape
    indices = torch.empty((bi, h, nq, k), device=kv_indices.device, dtype=torch.int32)
    full_counts = torch.empty((bi, h, nq), device=kv_indices.device, dtype=torch.int32)
    num_rows = bi * h * nq
    if num_rows == 0 or k == 0:
        full_counts.zero_()
        return indices, full_counts
    width = triton.next_power_of_2(k)
    rows = max(1, _ROW_ELEMENTS // width)
    _full_blocks_first_kernel[(triton.cdiv(num_rows, rows),)](
        kv_indices, kv_counts, kv_block_sizes, indices, full_counts,
        *kv_indices.stride(), *kv_counts.stride(),
        h, nq, k, num_rows, block_kv,
        ROWS=rows, WIDTH=width,
        num_warps=min(16, max(4, rows * width // 256)),  # 8 entries a thread past 1,024 too
    )  # fmt: skip
    return indices, full_counts


def full_blocks_first_ref(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, kv_block_sizes: torch.Tensor, block_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Python reference of ``full_blocks_first`` (entries past the counts are 0 here)."""
    bi, h, nq, k = kv_indices.shape
    indices = torch.zeros((bi, h, nq, k), dtype=torch.int32)
    full_counts = torch.zeros((bi, h, nq), dtype=torch.int32)
    sizes = kv_block_sizes.cpu().tolist()
    for b in range(bi):
        for hh in range(h):
            for i in range(nq):
                row = kv_indices[b, hh, i, : int(kv_counts[b, hh, i])].cpu().tolist()
                full = [j for j in row if sizes[j] == block_kv]
                partial = [j for j in row if sizes[j] != block_kv]
                indices[b, hh, i, : len(row)] = torch.tensor(full + partial, dtype=torch.int32)
                full_counts[b, hh, i] = len(full)
    return indices, full_counts
