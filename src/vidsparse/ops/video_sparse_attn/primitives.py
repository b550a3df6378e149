"""VSA's coarse-stage primitives as public functions, for users who compose their own method:
tile means over real tokens (``block_mean``) and coarse scores -> engine lists (``topk_lists``).

``video_sparse_attn`` fuses both into its coarse-stage kernels; these are the same operations
in PyTorch (a reduction and a sort: memory-bound, so a kernel would gain little), with autograd
where it applies, and the same rules, so a composition reproduces VSA's selection exactly::

    qc = vidsparse.block_mean(q, grid)                  # [B, H, Nt, D] fp32
    kc = vidsparse.block_mean(k, grid)
    idx, cnt = vidsparse.topk_lists(qc @ kc.transpose(-1, -2), topk)
    o_t = vidsparse.block_sparse_attn(grid.tile(q), grid.tile(k), grid.tile(v), idx, cnt,
                                      block_size=grid.tile_volume,
                                      kv_block_sizes=grid.tile_sizes_on(q.device))
"""

from __future__ import annotations

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.video_sparse_attn.reference import tile_means
from vidsparse.utils.checks import check_bool, check_tensor

__all__ = ["block_mean", "topk_lists"]


def block_mean(x: torch.Tensor, grid: VideoGrid, *, tiled: bool = False) -> torch.Tensor:
    """Mean of the real tokens of each tile of ``grid``: ``[..., S, D] -> [..., num_tiles, D]``.

    A grid of 5 x 6 tokens (one frame) in tiles of 1 x 4 x 4: the last tile column holds
    2 of 4 columns and the last tile row 1 of 4 rows, so tiles hold 16, 8, 4 and 2 tokens, and
    each mean divides by its own count (padding slots, whatever they hold, are not read)::

        tokens (h x w)          tiles (real tokens)
        a a a a b b             +----+----+
        a a a a b b             | 16 |  8 |      mean_0 = sum(a) / 16
        a a a a b b     ->      +----+----+      mean_1 = sum(b) / 8
        a a a a b b             |  4 |  2 |      ...
        c c c c d d             +----+----+

    Args:
        x: ``[..., S, D]``: natural token order with ``S = grid.num_tokens``, or tile order
            with ``S = grid.padded_len`` when ``tiled`` (what ``grid.tile`` gives).
        grid: the ``VideoGrid`` whose tiles are averaged.
        tiled: ``x`` is already in tile order.

    Returns fp32 means (fp64 for fp64 input: 16-bit sums of hundreds of tokens would lose the
    digits the scores rank by), differentiable in ``x`` (each real token gets ``1 / count`` of
    its tile's gradient, padding slots none).
    """
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    check_bool("tiled", tiled)
    check_tensor("x", x)
    if x.ndim < 2 or not x.is_floating_point():
        raise TypeError(
            f"x must be a floating-point [..., S, D] tensor, got {x.dtype} of shape "
            f"{tuple(x.shape)}"
        )
    length = grid.padded_len if tiled else grid.num_tokens
    if x.shape[-2] != length:
        what = "padded_len (tile order)" if tiled else "num_tokens (natural order)"
        raise ValueError(
            f"x must be [..., S, D] with S = the grid's {what} = {length}, got "
            f"{tuple(x.shape)}" + ("" if tiled else "; pass tiled=True for tile-order input")
        )
    x_tiled = x if tiled else grid.tile(x)  # a permutation: in x's dtype, half the bytes of fp32
    return tile_means(x_tiled.to(torch.promote_types(x.dtype, torch.float32)), grid)


def topk_lists(scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` highest-scoring key blocks of each query block, as engine lists.

    ``scores[b, h, i, j]``: how much query block ``i`` wants key block ``j`` (e.g. tile means'
    dot products). Ties go to the smaller index, and a score of ``-inf`` is never selected, so
    masking is a ``masked_fill`` away (a row whose finite scores are fewer than ``topk`` keeps
    only those; a causal mask over frames, a cache's empty slots)::

        scores (one row)     [ 0.1  0.9  -inf  0.9  0.3 ]     topk = 3
        kv_indices           [ 1  3  4 ]                       ascending: memory order
        kv_counts            3

    Args:
        scores: float ``[B, H, NQ, NK]``; NaN is refused.
        topk: blocks to keep per row, ``>= 1``; above ``NK`` it is clamped to ``NK``.

    Returns ``(kv_indices, kv_counts)``: int32 ``[B, H, NQ, min(topk, NK)]`` (each row's
    selected blocks first, ascending; entries past the count are 0) and int32 ``[B, H, NQ]``,
    the format ``block_sparse_attn`` takes. Not differentiable (a selection).
    """
    check_tensor("scores", scores, ndim=4)
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating-point tensor, got {scores.dtype}")
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {topk!r}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    num_kv_blocks = scores.shape[-1]
    if num_kv_blocks == 0:
        raise ValueError(f"scores must have at least one key block, got {tuple(scores.shape)}")
    scores = scores.detach()
    checkable = not torch.compiler.is_compiling() and scores.device.type != "meta"
    if checkable and bool(torch.isnan(scores).any()):  # one host read
        raise ValueError("scores contain NaN: the selection would be arbitrary")
    topk = min(topk, num_kv_blocks)
    # A stable sort keeps equal scores in index order: ties go to the smaller index.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    chosen = scores.gather(-1, order) > float("-inf")
    # Unchosen slots sort after every block index, so a row starts with its selection.
    ranked = torch.where(chosen, order, num_kv_blocks).sort(dim=-1).values
    kv_indices = torch.where(ranked < num_kv_blocks, ranked, 0).to(torch.int32)
    return kv_indices.contiguous(), chosen.sum(-1, dtype=torch.int32)
