"""Ulysses' generic driver: exchange in, run an attention function on the rank's heads, out.

Training and dtype-mixed inputs take the one-shot exchange (one collective in, one out, each
packed by row copies; differentiable). In inference the exchange can be pipelined against the
attention (``head_chunks``) and, for ops with a tile-order variant (``TiledExchange``), tile and
untile on the way. Heads that the world size does not divide are padded here (``pad_heads``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vidsparse.layout.grid import VideoGrid
from vidsparse.parallel.exchange import (
    contiguous_rows,
    copy_rows_into,
    full_seq_from_chunks,
    head_shard_chunks,
    lse_to_seq_shard,
    post_all_to_all,
    seq_shard_chunks,
    stack_rows,
    to_head_shards,
    to_seq_shard,
)
from vidsparse.parallel.shards import (
    ShardContext,
    local_dims,
    resolve_context,
    validate_shards,
    validate_shards_across_ranks,
    want_global_check,
)

# attn_fn(heads, q, k, v, *extra) with full-sequence [B, H/P, S, D] tensors (None stays None).
AttnFn = Callable[..., "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def run(
    ctx: ShardContext,
    attn_fn: AttnFn,
    tensors: dict[str, torch.Tensor | None],
    check: bool,
    head_chunks: int = 1,
    tiled: TiledExchange | None = None,
):
    """Exchange in, run ``attn_fn`` on the rank's heads, exchange out.

    ``tensors``: q, k, v first, then extras sharded like q (``None`` passes through), already
    checked by :func:`validate_shards` (and ``head_chunks`` by :func:`check_head_chunks`).
    ``tiled``: for ops with a tile-order variant, fused unpack+tile / untile+pack (inference).
    Heads not divisible by the world size (``pad_heads=True``, checked by the caller) run
    padded with zero heads to ``ctx.padded_heads(H)``: ``attn_fn`` sees global head indices of
    the padded range, and the padded heads' outputs are dropped.
    """
    if want_global_check(check):
        validate_shards_across_ranks(ctx, **tensors)
    H = local_dims(tensors["q"], ctx.layout)[2]
    padded = ctx.padded_heads(H)
    if padded == H:
        return _run(ctx, attn_fn, tensors, head_chunks, tiled)
    tensors = {n: x if x is None else _pad_heads(x, padded, ctx.layout) for n, x in tensors.items()}
    result = _run(ctx, attn_fn, tensors, head_chunks, tiled)
    if isinstance(result, tuple):  # (o, lse)
        return tuple(_drop_padded_heads(x, H, ctx.layout) for x in result)
    return _drop_padded_heads(result, H, ctx.layout)


def _pad_heads(x: torch.Tensor, heads: int, layout: str) -> torch.Tensor:
    """``x`` with zero heads appended up to ``heads`` (one copy; differentiable: the padded
    heads' gradients are dropped by the backward of the pad)."""
    extra = heads - local_dims(x, layout)[2]
    # F.pad's (before, after) pairs run from the last dim: D, H (bshd); D, S, H (bhsd).
    return F.pad(x, (0, 0, 0, extra) if layout == "bshd" else (0, 0, 0, 0, 0, extra))


def _drop_padded_heads(x: torch.Tensor, heads: int, layout: str) -> torch.Tensor:
    """The first ``heads`` heads of an output (``o`` 4-D or ``lse`` 3-D), contiguous."""
    return x.narrow(2 if layout == "bshd" else 1, 0, heads).contiguous()


def _run(ctx: ShardContext, attn_fn: AttnFn, tensors: dict, head_chunks: int, tiled):
    """:func:`run` on heads that split evenly."""
    if _inference_exchange_applies(ctx, tensors):
        tiled = tiled if tiled is not None and tiled.supports(tensors["q"], ctx.layout) else None
        if head_chunks > 1 or tiled is not None:
            return run_overlapped(ctx, attn_fn, tensors, head_chunks, tiled)
    present = [x for x in tensors.values() if x is not None]
    full = iter(to_head_shards(present, ctx, "all_to_all"))
    q_h, k_h, v_h, *extra_h = (None if x is None else next(full) for x in tensors.values())
    heads = ctx.head_slice(local_dims(tensors["q"], ctx.layout)[2])
    result = attn_fn(heads, q_h, k_h, v_h, *extra_h)
    if isinstance(result, tuple):  # (o, lse)
        o, lse = result
        return to_seq_shard(o, ctx, "all_to_all"), lse_to_seq_shard(lse, ctx, "all_to_all")
    return to_seq_shard(result, ctx, "all_to_all")


def positive_head_chunks(head_chunks) -> int:
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
    return head_chunks


def check_head_chunks(head_chunks, num_heads: int, world_size: int) -> int:
    """``head_chunks`` must be a positive int dividing the rank's ``H/P`` heads."""
    positive_head_chunks(head_chunks)
    local = num_heads // world_size
    if local % head_chunks:
        raise ValueError(
            f"head_chunks={head_chunks} must divide the heads of a rank (H/P = {num_heads}/"
            f"{world_size} = {local})"
        )
    return head_chunks


def ulysses_attention(
    attn_fn: AttnFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *extra: torch.Tensor | None,
    group=None,
    layout: str = "bshd",
    check_shards: bool = False,
    head_chunks: int = 1,
    pad_heads: bool = False,
):
    """Run any attention function under Ulysses sequence parallelism.

    Args:
        attn_fn: ``attn_fn(heads, q, k, v, *extra)`` where ``heads`` is the slice of global
            heads this rank computes and the tensors are full-sequence ``[B, H/P, S, D]``;
            returns ``o`` ``[B, H/P, S, D]`` or ``(o, lse)`` with ``lse`` ``[B, H/P, S]``.
        q, k, v: this rank's sequence shard, ``[B, S/P, H, D]`` (``layout="bshd"``) or
            ``[B, H, S/P, D]`` (``"bhsd"``); rank r holds tokens ``r*S/P .. (r+1)*S/P - 1``.
        extra: more tensors sharded like q (a gate), exchanged the same way; ``None`` passes.
        group: the process group (default WORLD); its size must divide H.
        check_shards: all-gather local shapes first and raise on every rank if they differ.
        head_chunks: run the rank's heads in this many groups with the exchanges of the next
            and previous group in flight during each group's attention (must divide ``H/P``).
            Inference only: with autograd recording, the one-shot exchange runs.
        pad_heads: when the world size does not divide ``H``, pad the heads with zero heads
            up to the next multiple (their attention is computed, then dropped); ``heads``
            then indexes the padded range, so it may reach past ``H``.

    Returns ``o`` in the input layout (and ``lse`` ``[B, S/P, H]`` / ``[B, H, S/P]``).
    """
    ctx = resolve_context(group, layout)
    tensors = {"q": q, "k": k, "v": v, **{f"extra{i}": x for i, x in enumerate(extra)}}
    _, _, H, _ = validate_shards(ctx, pad_heads, **tensors)
    check_head_chunks(head_chunks, ctx.padded_heads(H), ctx.world_size)
    return run(ctx, attn_fn, tensors, check_shards, head_chunks)


# ---------------------------------------------------------------------------------------------
# the inference exchange: pipelined, and tiled on the way
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TiledExchange:
    """An op's tile-order variant, so the exchange can tile and untile on the way (inference).

    The receive buffer ``[P, B, h, S/P, D]`` (the natural sequence in rank chunks) goes straight
    to tile order ``[B, h, padded_len, D]``, and the op's tile-order output straight into the
    send buffer, one pass each (``vidsparse.layout.permute``): the reassembly copy and the op's
    own tiling (and untiling) copies are gone (PSA in tile order still blanks its output's
    padding rows in a copy of its own, which the untiling then skips).
    ``attn_fn(heads, q_t, k_t, v_t, *extra_t)`` takes and returns tile order.
    """

    grid: VideoGrid
    attn_fn: AttnFn

    def supports(self, q: torch.Tensor, layout: str) -> bool:
        from vidsparse.layout.permute_ops import kernel_supports

        q_bhsd = q.transpose(1, 2) if layout == "bshd" else q
        return kernel_supports(q_bhsd, 2, self.grid.padded_len)

    def unpack(self, recv: torch.Tensor, own: torch.Tensor, own_chunk: int) -> torch.Tensor:
        """``recv [P-1, B, h, S/P, D]`` (the other ranks' chunks) and the rank's own chunk
        ``own [B, h, S/P, D]`` (a view of its input: it never went through the exchange)."""
        from vidsparse.layout.permute import tile_rows_from_chunks

        return tile_rows_from_chunks(recv, self.grid.shape, self.grid.tile_shape, own, own_chunk)

    def pack(self, o_t: torch.Tensor, world: int) -> torch.Tensor:
        from vidsparse.layout.permute import untile_rows_to_chunks

        return untile_rows_to_chunks(o_t, self.grid.shape, self.grid.tile_shape, world)


def _inference_exchange_applies(ctx: ShardContext, tensors: dict) -> bool:
    """The asynchronous (pipelined or fused) exchange serves inference: with autograd
    recording, or one dtype-mixed set of tensors (they would need several buffers), the one-shot
    exchange runs instead."""
    if ctx.world_size == 1:
        return False
    present = [x for x in tensors.values() if x is not None]
    if len({x.dtype for x in present}) > 1:
        return False
    return not (torch.is_grad_enabled() and any(x.requires_grad for x in present))


def run_overlapped(
    ctx: ShardContext,
    attn_fn: AttnFn,
    tensors: dict,
    chunks: int,
    tiled: TiledExchange | None = None,
):
    """Ulysses with the exchanges pipelined against the attention (inference).

    The rank's ``H/P`` heads run in ``chunks`` groups of ``h = H/(P*chunks)``. While group
    ``c`` is attended, the inputs of group ``c+1`` are in flight and the output of group
    ``c-1`` travels back, so only the first exchange in and the last one out are exposed::

        comm   [in 0][in 1][out 0][in 2][out 1] ...        [out n-1]
        attn         [attn 0]    [attn 1]    [attn 2] ...
    """
    P, layout, rank = ctx.world_size, ctx.layout, ctx.rank
    B, S_local, H, D = local_dims(tensors["q"], layout)
    h = H // P // chunks
    first_head = ctx.head_slice(H).start
    present = [x for x in tensors.values() if x is not None]
    attend = attn_fn if tiled is None else tiled.attn_fn  # tile order in and out
    # [P, B, H/P, S/P, D] views: chunk p holds rank p's heads of this rank's shard
    shards = [seq_shard_chunks(x, layout, P) for x in present]
    # The tiled unpack reads the rank's own chunk from its input: only the others travel.
    own_in_place = tiled is not None
    splits = [0 if p == rank else 1 for p in range(P)] if own_in_place else None

    def send_buffer(c: int) -> torch.Tensor:
        # [P, n, B, h, S/P, D] (own_in_place: [P-1, ...], the other ranks in order): chunk p
        # holds group c of rank p's heads, for every tensor
        parts = [x[:, :, c * h : (c + 1) * h] for x in shards]
        if not own_in_place:
            return stack_rows(parts)
        first = parts[0]
        buf = first.new_empty((P - 1, len(parts), *first.shape[1:]))
        for i, p in enumerate(p for p in range(P) if p != rank):
            for j, part in enumerate(parts):
                copy_rows_into(buf[i, j], part[p])
        return buf

    def unpack(c: int, recv: torch.Tensor, j: int) -> torch.Tensor:
        if not own_in_place:
            return full_seq_from_chunks(recv[:, j])
        return tiled.unpack(recv[:, j], shards[j][rank, :, c * h : (c + 1) * h], rank)

    inflight = post_all_to_all(send_buffer(0), ctx.group, splits)
    returning, lse_parts = [], []
    for c in range(chunks):
        recv, work = inflight
        if c + 1 < chunks:
            inflight = post_all_to_all(send_buffer(c + 1), ctx.group, splits)
        work.wait()
        full = iter(unpack(c, recv, j) for j in range(len(present)))
        args = [None if x is None else next(full) for x in tensors.values()]
        heads = slice(first_head + c * h, first_head + (c + 1) * h)
        result = attend(heads, *args)  # (o, lse) only without ``tiled`` (TiledExchange: o)
        o, lse = result if isinstance(result, tuple) else (result, None)
        send = contiguous_rows(head_shard_chunks(o, P)) if tiled is None else tiled.pack(o, P)
        returning.append(post_all_to_all(send, ctx.group))
        if lse is not None:
            lse_parts.append(post_all_to_all(head_shard_chunks(lse.unsqueeze(-1), P).contiguous(),
                                              ctx.group))  # fmt: skip
    o = _assemble_head_groups(returning, layout, chunks)
    if not lse_parts:
        return o
    return o, _assemble_head_groups(lse_parts, layout, chunks).squeeze(-1)


def _assemble_head_groups(parts, layout: str, chunks: int) -> torch.Tensor:
    """Received groups ``[P, B, h, S/P, D]`` (chunk r = rank r's heads of group c) -> the
    sequence shard with global head ``r*H/P + c*h + j`` in place (either layout)."""
    P, B, h, S_local, D = parts[0][0].shape
    if layout == "bshd":
        out = parts[0][0].new_empty(B, S_local, P * chunks * h, D)
        view = out.view(B, S_local, P, chunks, h, D)
    else:
        out = parts[0][0].new_empty(B, P * chunks * h, S_local, D)
        view = out.view(B, P, chunks, h, S_local, D)
    for c, (recv, work) in enumerate(parts):
        work.wait()
        if layout == "bshd":
            copy_rows_into(view[:, :, :, c], recv.permute(1, 3, 0, 2, 4))  # [B, S/P, P, h, D]
        else:
            copy_rows_into(view[:, :, c], recv.permute(1, 0, 2, 3, 4))  # [B, P, h, S/P, D]
    return out
