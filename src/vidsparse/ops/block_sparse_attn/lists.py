"""Key-block lists reordered for the forward: full blocks first.

With ``kv_block_sizes``, a listed key block may end in padding keys, whose scores the forward
must mask: one compare and select per score, ~160 extra integer and select instructions per
128x128 step (benchmarks/NOTES.md). Most listed blocks are full (Wan 480p's 4x4x4 tiles: 455
of 624), so the forward walks each list in two loops, the full blocks without the mask and then
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

from vidsparse.masks.block_sparse import transpose_block_lists
from vidsparse.ops.block_sparse_attn.configs import LIST_REORDER
from vidsparse.ops.block_sparse_attn.kernels.lists import full_blocks_first_kernel
from vidsparse.utils.tensor_cache import TensorCache

# Lists derived from block lists, per source tensors (see TensorCache).
derived_lists = TensorCache()


def forget_derived(sources) -> None:
    """Drop what was derived from any of ``sources`` (``block_sparse_attn(validate=True)``:
    the lists may have changed behind their version counters)."""
    derived_lists.discard(sources)


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


def full_blocks_first(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor,
    block_kv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices, full_counts, counts)``: each row of ``kv_indices`` with its full key blocks
    (``kv_block_sizes[j] == block_kv``) first and its partial ones after, each group in list
    order; ``full_counts[b, h, i]`` full ones, ``counts[b, h, i]`` in all. int32, contiguous,
    shaped like the inputs; entries at or past ``counts`` are unspecified (no kernel reads
    them). Valid by construction whatever the inputs hold: counts clamp to ``K`` and entries out
    of ``[0, NK)`` are dropped (lists changed behind the validation's back stay memory-safe)."""
    bi, h, nq, k = kv_indices.shape
    indices = torch.empty((bi, h, nq, k), device=kv_indices.device, dtype=torch.int32)
    full_counts = torch.empty((bi, h, nq), device=kv_indices.device, dtype=torch.int32)
    counts = torch.empty((bi, h, nq), device=kv_indices.device, dtype=torch.int32)
    num_rows = bi * h * nq
    if num_rows == 0 or k == 0:
        full_counts.zero_()
        counts.zero_()
        return indices, full_counts, counts
    width = triton.next_power_of_2(k)
    rows = max(1, LIST_REORDER.row_elements // width)
    full_blocks_first_kernel[(triton.cdiv(num_rows, rows),)](
        kv_indices, kv_counts, kv_block_sizes, indices, full_counts, counts,
        *kv_indices.stride(), *kv_counts.stride(),
        h, nq, k, kv_block_sizes.shape[0], num_rows, block_kv,
        ROWS=rows, WIDTH=width,
        num_warps=LIST_REORDER.num_warps(rows * width),
    )  # fmt: skip
    return indices, full_counts, counts


def full_blocks_first_ref(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, kv_block_sizes: torch.Tensor, block_kv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Python reference of ``full_blocks_first`` (entries past the counts are 0 here)."""
    bi, h, nq, k = kv_indices.shape
    indices = torch.zeros((bi, h, nq, k), dtype=torch.int32)
    full_counts = torch.zeros((bi, h, nq), dtype=torch.int32)
    counts = torch.zeros((bi, h, nq), dtype=torch.int32)
    sizes = kv_block_sizes.cpu().tolist()
    for b in range(bi):
        for hh in range(h):
            for i in range(nq):
                row = kv_indices[b, hh, i, : max(0, int(kv_counts[b, hh, i]))].cpu().tolist()
                row = [j for j in row if 0 <= j < len(sizes)]
                full = [j for j in row if sizes[j] == block_kv]
                partial = [j for j in row if sizes[j] != block_kv]
                indices[b, hh, i, : len(row)] = torch.tensor(full + partial, dtype=torch.int32)
                full_counts[b, hh, i] = len(full)
                counts[b, hh, i] = len(row)
    return indices, full_counts, counts
