"""Ulysses over VSA: :func:`ulysses_video_sparse_attn`."""

from __future__ import annotations

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.parallel.driver import TiledExchange, check_head_chunks, run
from vidsparse.parallel.shards import check_grid_length, resolve_context, validate_shards


def ulysses_video_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    *,
    topk: int | None = None,
    sparsity: float | None = None,
    gate: torch.Tensor | float | None = None,
    tiled: bool = False,
    scale: float | None = None,
    group=None,
    layout: str = "bshd",
    check_shards: bool = False,
    head_chunks: int = 1,
    pad_heads: bool = False,
) -> torch.Tensor:
    """:func:`vidsparse.video_sparse_attn` over a sequence-sharded input.

    ``grid`` describes the full sequence. Natural order: each rank holds ``num_tokens / P``
    consecutive raster tokens. ``tiled=True``: each rank holds a contiguous ``padded_len / P``
    chunk of the padded tile-order sequence (whole tiles when ``P`` divides ``num_tiles``,
    but any split works: the all-to-all reassembles the full sequence before the op). ``gate``
    is sharded like q and exchanged with it (``0``, the fine stage alone, is not exchanged).
    Differentiable in q, k, v and gate.
    ``head_chunks``: pipelined exchange for inference (see :func:`ulysses_attention`).
    ``pad_heads``: pad ``H`` with zero heads (and zero gates) to a multiple of the world size
    (see :func:`ulysses_attention`).
    """
    from vidsparse.ops.video_sparse_attn import video_sparse_attn
    from vidsparse.ops.video_sparse_attn.reference import check_number_gate, is_fine_only
    from vidsparse.ops.video_sparse_attn.topk import resolve_topk

    check_number_gate(gate)
    fine_only = is_fine_only(gate)
    if fine_only:
        gate = None  # nothing to exchange; each rank's call gets 0 back
    ctx = resolve_context(group, layout)
    _, S_local, H, _ = validate_shards(ctx, pad_heads, q=q, k=k, v=v, gate=gate)
    check_head_chunks(head_chunks, ctx.padded_heads(H), ctx.world_size)
    if not isinstance(tiled, bool):
        raise TypeError(f"tiled must be a bool, got {tiled!r}")
    check_grid_length(grid, tiled, S_local, ctx.world_size)
    resolve_topk(grid.num_tiles, topk, sparsity)  # bad topk/sparsity: raise before exchanging

    def attn_fn(heads, q_h, k_h, v_h, gate_h, tiled=tiled):
        return video_sparse_attn(
            q_h,
            k_h,
            v_h,
            grid,
            topk=topk,
            sparsity=sparsity,
            gate=0 if fine_only else gate_h,
            tiled=tiled,
            scale=scale,
        )

    def tiled_attn_fn(heads, *xs):
        return attn_fn(heads, *xs, tiled=True)

    # Natural order: in inference the exchange tiles and untiles on the way (one pass each).
    exchange = None if tiled else TiledExchange(grid, tiled_attn_fn)
    tensors = {"q": q, "k": k, "v": v, "gate": gate}
    return run(ctx, attn_fn, tensors, check_shards, head_chunks, exchange)
