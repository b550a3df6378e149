"""Key-block lists reordered for the kernels: full blocks first, the partial ones by size.

With ``kv_block_sizes``, a listed key block may end in padding keys, whose scores the kernels
must mask: one compare and select per score, ~160 extra integer and select instructions per
128x128 step (benchmarks/NOTES.md). Most listed blocks are full (Wan 480p's 4x4x4 tiles: 455
of 624), so the kernels walk each list in loops: the full blocks without the mask, then the
partial ones with it, those that fit in a quarter or a half of a block with that many key rows
(``configs.key_tails``), so that an edge tile of 16 tokens costs a quarter of a full one::

    block_kv = 64: tail1 = 32, tail2 = 16
    kv_indices[b, h, i]   = [ 7, 12, 13, 20, 31, 40, ...]  (ascending, any order is legal)
    kv_block_sizes[block] =  64  40  64  64  16  32
    reordered             = [ 7, 13, 20, 12, 40, 31, ...]  ends[b, h, i] = [3, 4, 5]
                              |- full --| 64 | 32 | 16 |
                              64 rows, unmasked | masked, with 64, 32, 16 rows

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
from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn.configs import LIST_REORDER, LIST_TRANSPOSE
from vidsparse.ops.block_sparse_attn.kernels.lists import QUERY_GROUPS as _KERNEL_QUERY_GROUPS
from vidsparse.ops.block_sparse_attn.kernels.lists import (
    blocks_by_size_kernel,
    column_offsets_kernel,
    column_words_kernel,
    mark_pairs_kernel,
    place_pairs_kernel,
)
from vidsparse.utils.tensor_cache import TensorCache

# Lists derived from block lists, per source tensors (see TensorCache).
derived_lists = TensorCache()


def forget_derived(sources) -> None:
    """Drop what was derived from any of ``sources`` (``block_sparse_attn(validate=True)``:
    the lists may have changed behind their version counters)."""
    derived_lists.discard(sources)


def cached_blocks_by_size(kv_indices, kv_counts, kv_block_sizes, block_kv, tails):
    """``blocks_by_size``, computed once per source lists (``derived_lists``)."""
    return derived_lists.get(
        "by_size", (kv_indices, kv_counts, kv_block_sizes), (block_kv, tails),
        lambda: blocks_by_size(kv_indices, kv_counts, kv_block_sizes, block_kv, tails),
    )  # fmt: skip


def cached_transpose(kv_indices, kv_counts, num_kv_blocks, q_rows=None, block_q=0,
                     tails=(0, 0)):  # fmt: skip
    """``transpose_block_lists``, computed once per source lists (``derived_lists``). With
    ``q_rows`` (int32, its first NQ entries: the rows of each query block that carry gradient)
    and short walks ``tails``, each key block's query blocks come in three groups
    (``query_groups``): ``q_offsets`` is then ``[Bi, H, 3 * NK + 1]``."""
    transpose = transpose_lists if configs.active_overrides().transpose_kernels else \
        transpose_block_lists  # fmt: skip
    if q_rows is None:
        return derived_lists.get(
            "transpose", (kv_indices, kv_counts), (num_kv_blocks, transpose),
            lambda: transpose(kv_indices, kv_counts, num_kv_blocks),
        )  # fmt: skip
    return derived_lists.get(
        "transpose_by_rows", (kv_indices, kv_counts, q_rows),
        (num_kv_blocks, block_q, tails, transpose),
        lambda: transpose(
            kv_indices, kv_counts, num_kv_blocks,
            _cached_query_groups(q_rows, kv_indices.shape[2], block_q, tails), QUERY_GROUPS,
        ),
    )  # fmt: skip


def _cached_query_groups(q_rows, num_q_blocks, block_q, tails):
    """``query_groups`` of ``q_rows``' first ``num_q_blocks`` entries, once per rows tensor:
    a caller's rows (a video grid's tile sizes) may outlive its lists, which a caller that
    selects blocks per call makes anew every call."""
    return derived_lists.get(
        "query_groups", (q_rows,), (num_q_blocks, block_q, tails),
        lambda: query_groups(q_rows[:num_q_blocks], block_q, tails),
    )  # fmt: skip


def transpose_lists(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    num_kv_blocks: int,
    q_groups: torch.Tensor | None = None,
    num_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``masks.transpose_block_lists`` (its contract, its result to the bit) in Triton kernels:
    each listed pair sets its bit in a bitmap of its column (key block, query group); the
    columns' sizes and offsets follow from the bitmaps' set bits, and each pair goes to its
    column's offset plus the set bits below its own, so each column comes out ascending::

        kv_indices (NQ = 3, NK = 4):  row 0: [1, 3]  row 1: [3]  row 2: [0, 1]
        bitmaps (rows 0-2 of key block j):  j=0: 001  j=1: 101  j=2: 000  j=3: 110
        q_offsets = [0, 1, 3, 3, 5]      q_indices = [2 | 0, 2 | | 0, 1]

    Five launches (the zeroed bitmaps, ``Bi*H*NK*G*ceil(NQ/32)`` int32, and four kernels) where
    the sort takes about twenty; work in the pairs and the bitmaps' words, nothing read back to
    the host, so a CUDA graph can capture it. Lists that no check saw stay memory-safe: counts
    clamp into ``[0, K]``, entries out of ``[0, NK)`` are left out and a pair listed twice is
    one bit (both copies store to its one slot)."""
    bi, h, nq, k = kv_indices.shape
    device = kv_indices.device
    bh, columns, words = bi * h, num_kv_blocks * num_groups, triton.cdiv(nq, 32)
    q_offsets = torch.empty((bh, columns + 1), device=device, dtype=torch.int32)
    q_indices = torch.empty((bh, nq * k), device=device, dtype=torch.int32)
    if bh == 0 or nq * k == 0:
        return q_offsets.zero_().view(bi, h, -1), q_indices.view(bi, h, -1)
    bits = torch.zeros(bh * columns * words, device=device, dtype=torch.int32)
    below = torch.empty_like(bits)
    counts = torch.empty(bh * columns, device=device, dtype=torch.int32)
    groups = q_groups.to(device=device, dtype=torch.int32) if q_groups is not None else counts
    cfg = LIST_TRANSPOSE
    width = triton.next_power_of_2(k)
    rows = max(1, cfg.pair_elements // width)
    pairs = (kv_indices, kv_counts, groups, *kv_indices.stride(), *kv_counts.stride(),
             h, nq, k, num_kv_blocks, bh * nq)  # fmt: skip
    walk = dict(GROUPS=num_groups, ROWS=rows, WIDTH=width, num_warps=cfg.num_warps(rows * width))
    grid = (triton.cdiv(bh * nq, rows),)
    mark_pairs_kernel[grid](pairs, bits, words, **walk)
    words_p = triton.next_power_of_2(words)
    cols = max(1, cfg.word_elements // words_p)
    column_words_kernel[(triton.cdiv(columns, cols), bh)](
        bits, below, counts, columns, words, COLS=cols, WORDS_P=words_p,
        num_warps=cfg.num_warps(cols * words_p),
    )  # fmt: skip
    column_offsets_kernel[(bh,)](
        counts, q_offsets, q_indices, columns, nq * k, STEP=cfg.offsets_step,
        num_warps=cfg.num_warps(cfg.offsets_step),
    )  # fmt: skip
    place_pairs_kernel[grid](pairs, bits, below, q_offsets, q_indices, words, nq * k, **walk)
    return q_offsets.view(bi, h, -1), q_indices.view(bi, h, -1)


def cached_dkdv_walk(q_offsets: torch.Tensor, batch: int, programs: int,
                     banded: bool) -> torch.Tensor:  # fmt: skip
    """``walk_order`` of the key blocks of transposed lists ``q_offsets`` (``[Bi, H, NK +
    1]``, Bi 1 or ``batch``) over ``batch`` batch entries, computed once per lists
    (``derived_lists``): the persistent dK/dV kernel's walk."""
    return derived_lists.get(
        "dkdv_walk", (q_offsets,), (batch, programs, banded),
        lambda: walk_order(q_offsets.diff(dim=-1).expand(batch, -1, -1), programs, banded),
    )  # fmt: skip


def cached_dq_walk(kv_counts: torch.Tensor, width: int, batch: int, programs: int,
                   banded: bool) -> torch.Tensor:  # fmt: skip
    """``walk_order`` of the query blocks of lists with counts ``kv_counts`` (``[Bi, H,
    NQ]``, clamped into ``[0, width]`` as the kernels read them) over ``batch`` batch entries,
    computed once per counts (``derived_lists``): the persistent dQ kernel's walk."""
    return derived_lists.get(
        "dq_walk", (kv_counts,), (width, batch, programs, banded),
        lambda: walk_order(kv_counts.clamp(0, width).expand(batch, -1, -1), programs, banded),
    )  # fmt: skip


def walk_order(lengths: torch.Tensor, programs: int, banded: bool) -> torch.Tensor:
    """The persistent kernels' walk: ``banded_order`` or ``snake_order``."""
    return banded_order(lengths, programs) if banded else snake_order(lengths, programs)


def snake_order(lengths: torch.Tensor, programs: int) -> torch.Tensor:
    """An order (int32, a permutation of ``lengths``' flat indices) in which a persistent grid
    of ``programs`` programs, each taking entries ``pid, pid + programs, ...``, gets nearly
    equal totals: longest first, dealt in a snake (even waves to programs 0, 1, ...; odd ones
    back from the last program of the wave)::

        lengths sorted:  9 8 7 6 | 5 4 3 2 | 1          programs = 4
        programs:        0 1 2 3 | 3 2 1 0 | 0
        totals:          0: 9+2+1  1: 8+3  2: 7+4  3: 6+5
    """
    by_length = torch.argsort(lengths.flatten(), descending=True, stable=True)
    n = by_length.numel()
    t = torch.arange(n, device=by_length.device)
    wave, lane = t // programs, t % programs
    width = torch.clamp(n - wave * programs, max=programs)  # the programs of this wave
    backwards = wave % 2 == 1
    source = wave * programs + torch.where(backwards, width - 1 - lane, lane)
    return by_length[source].to(torch.int32)


def banded_order(lengths: torch.Tensor, programs: int) -> torch.Tensor:
    """``snake_order``'s contract, with each wave among neighbours: the flat indices in bands
    of ``2 * programs`` (one head's key blocks, where a head has that many), each band two
    waves. A band's entries, longest first, pair up as longest with shortest; the pairs with
    the largest sums go to the programs furthest behind so far (the longer of a pair in the
    first wave, the shorter in the second); a last band of fewer entries goes longest first to
    the programs furthest behind. Lanes are then named so the last wave's programs come first,
    as the kernels' ``pid, pid + programs, ...`` requires::

        band 0: 9 8 7 6 5 4 3 2   pairs 9+2 8+3 7+4 6+5       programs = 4
        band 1: 9 7 5 3 3 2 1 1   pairs 9+1 7+1 5+2 3+3  -> the largest sum to the lowest total

    Built where ``lengths`` live, without reading them back to the host: ``derived_lists`` is
    bypassed while a CUDA graph captures, so a captured backward builds its walk inside the
    graph. A few small launches a band, which eager callers pay once per lists."""
    if lengths.is_meta:  # a launch built only to compile: shapes, no values
        return torch.empty(lengths.numel(), device=lengths.device, dtype=torch.int32)
    device = lengths.device
    flat = lengths.flatten().to(torch.int64)
    n = flat.numel()
    order = torch.argsort(flat, descending=True, stable=True)
    order = order[torch.argsort(order // (2 * programs), stable=True)]  # bands, longest first
    totals = torch.zeros(programs, dtype=torch.int64, device=device)
    waves = []  # (abstract programs, their entries) per wave
    for start in range(0, n, 2 * programs):
        waves += _deal_band(order[start : start + 2 * programs], flat, totals, programs)
    last = waves[-1][0]
    # a scatter of a tensor: setting a Python 0 by index copies it from the host, which a
    # capture refuses
    not_last = torch.ones(programs, dtype=torch.int64, device=device)
    not_last = not_last.scatter(0, last, torch.zeros_like(last))
    lane = torch.empty(programs, dtype=torch.int64, device=device)
    lane[torch.argsort(not_last, stable=True)] = torch.arange(programs, device=device)
    walk = torch.empty(n, dtype=torch.int64, device=device)
    for w, (owners, entries) in enumerate(waves):
        walk[w * programs + lane[owners]] = entries
    return walk.to(torch.int32)


def _deal_band(band: torch.Tensor, flat: torch.Tensor, totals: torch.Tensor, programs: int):
    """``banded_order``'s deal of one band (its entries longest first): the band's waves as
    ``(programs, entries)``; ``totals`` (each program's sum so far) updated in place."""
    if band.numel() == 2 * programs:
        longer, shorter = band[:programs], band[programs:].flip(0)
        sums = flat[longer] + flat[shorter]
        behind = torch.argsort(totals, stable=True)
        largest = torch.argsort(sums, descending=True, stable=True)
        totals[behind] += sums[largest]
        return [(behind, longer[largest]), (behind, shorter[largest])]
    waves = []
    for wave in (band[:programs], band[programs:]):
        if wave.numel():
            behind = torch.argsort(totals, stable=True)[: wave.numel()]
            totals[behind] += flat[wave]
            waves.append((behind, wave))
    return waves


# dK/dV's walks of a key block's query blocks: all rows, tails[0], tails[1]
QUERY_GROUPS = _KERNEL_QUERY_GROUPS.value


def query_groups(q_rows: torch.Tensor, block_q: int, tails: tuple[int, int]) -> torch.Tensor:
    """Each query block's walk in dK/dV (int32 ``[NQ]``): 2 where its ``q_rows`` fit in
    ``tails[1]`` rows, 1 where they fit in ``tails[0]``, else 0 (all ``block_q`` rows). A tail
    of 0 has no group. The rows past ``q_rows`` carry no gradient (the caller's epilogue says
    so), so a block walked with fewer rows needs no mask. ``size_group``'s rule, without a
    group for partial blocks walked with all rows."""
    tail1, tail2 = tails
    groups = torch.zeros_like(q_rows, dtype=torch.int32)
    if tail1:
        groups = torch.where(q_rows <= tail1, 1, groups)
    if tail2:
        groups = torch.where(q_rows <= tail2, 2, groups)
    return torch.where(q_rows >= block_q, 0, groups).to(torch.int32)


def blocks_by_size(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor,
    block_kv: int,
    tails: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices, ends, counts)``: each row of ``kv_indices`` in four groups, each in list
    order: its full key blocks (``kv_block_sizes[j] == block_kv``), then its partial ones
    walked with ``block_kv`` rows, with ``tails[0]`` rows (size <= tails[0]) and with
    ``tails[1]`` rows (size <= tails[1]); a tail of 0 has no group. ``ends[b, h, i]`` holds
    where the first three groups end, ``counts[b, h, i]`` the entries in all. int32,
    contiguous, shaped like the inputs (``ends`` with a last dim of 3); entries at or past
    ``counts`` are unspecified (no kernel reads them). Valid by construction whatever the inputs
    hold: counts clamp to ``K`` and entries out of ``[0, NK)`` are dropped (lists changed behind
    the validation's back stay memory-safe)."""
    bi, h, nq, k = kv_indices.shape
    device = kv_indices.device
    indices = torch.empty((bi, h, nq, k), device=device, dtype=torch.int32)
    ends = torch.empty((bi, h, nq, 3), device=device, dtype=torch.int32)
    counts = torch.empty((bi, h, nq), device=device, dtype=torch.int32)
    num_rows = bi * h * nq
    if num_rows == 0 or k == 0:
        ends.zero_()
        counts.zero_()
        return indices, ends, counts
    width = triton.next_power_of_2(k)
    rows = max(1, LIST_REORDER.row_elements // width)
    blocks_by_size_kernel[(triton.cdiv(num_rows, rows),)](
        kv_indices, kv_counts, kv_block_sizes, indices, ends, counts,
        *kv_indices.stride(), *kv_counts.stride(),
        h, nq, k, kv_block_sizes.shape[0], num_rows, block_kv, *tails,
        ROWS=rows, WIDTH=width,
        num_warps=LIST_REORDER.num_warps(rows * width),
    )  # fmt: skip
    return indices, ends, counts


def size_group(size: int, block_kv: int, tails: tuple[int, int]) -> int:
    """``blocks_by_size``'s group of a block of ``size`` real keys: 0 full, 1 partial walked
    with ``block_kv`` rows, 2 with ``tails[0]``, 3 with ``tails[1]``."""
    tail1, tail2 = tails
    if size == block_kv:
        return 0
    if tail2 and size <= tail2:
        return 3
    if tail1 and size <= tail1:
        return 2
    return 1


def blocks_by_size_ref(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor,
    block_kv: int,
    tails: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Python reference of ``blocks_by_size`` (entries past the counts are 0 here)."""
    bi, h, nq, k = kv_indices.shape
    indices = torch.zeros((bi, h, nq, k), dtype=torch.int32)
    ends = torch.zeros((bi, h, nq, 3), dtype=torch.int32)
    counts = torch.zeros((bi, h, nq), dtype=torch.int32)
    sizes = kv_block_sizes.cpu().tolist()
    for b in range(bi):
        for hh in range(h):
            for i in range(nq):
                row = kv_indices[b, hh, i, : max(0, int(kv_counts[b, hh, i]))].cpu().tolist()
                row = [j for j in row if 0 <= j < len(sizes)]
                groups = [size_group(sizes[j], block_kv, tails) for j in row]
                ordered = [j for _, j in sorted(zip(groups, row), key=lambda gj: gj[0])]
                indices[b, hh, i, : len(ordered)] = torch.tensor(ordered, dtype=torch.int32)
                ends[b, hh, i] = torch.tensor([sum(g <= e for g in groups) for e in range(3)])
                counts[b, hh, i] = len(row)
    return indices, ends, counts
