"""Ulysses' exchange: the equal-split all-to-all, the row-copy packing around it, and both
directions as one differentiable step each.

With ``P`` ranks the send buffer is ``[P, n, ...]``: chunk ``p`` is what rank ``p`` receives
(of each of the ``n`` tensors), and chunk ``r`` of the result came from rank ``r``.
Sequence shards -> head shards (:func:`to_head_shards`) and back (:func:`to_seq_shard`) are
inverse permutations of the elements, so the backward of either is the other applied to the
gradient: an ``autograd.Function`` per direction packs, exchanges and unpacks in its forward,
and runs the reverse exchange in its backward, so training moves the data with the same row
copies as inference (no ``torch.stack`` / ``.contiguous()`` strided copies, no saved tensors).
``comm="all_gather"`` runs the all-to-all as an ``all_gather`` instead, for a backend without
all-to-all (``P`` times the traffic and memory; correct, not fast).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from vidsparse.parallel.shards import (
    ShardContext,
    check_4d,
    local_dims,
    resolve_context,
    validate_shards,
)

COMM_METHODS = ("all_to_all", "all_gather")


# ---------------------------------------------------------------------------------------------
# the all-to-all
# ---------------------------------------------------------------------------------------------


def check_comm(method: str) -> str:
    if method not in COMM_METHODS:
        raise ValueError(f"comm must be one of {COMM_METHODS}, got {method!r}")
    return method


def _all_to_all_by_gather(buf: torch.Tensor, group) -> torch.Tensor:
    """``out[r] = chunk rank r addresses to me``, from an all_gather of everyone's buffers."""
    rank = dist.get_rank(group)
    gathered = [torch.empty_like(buf) for _ in range(buf.shape[0])]
    dist.all_gather(gathered, buf, group=group)
    return torch.stack([g[rank] for g in gathered])


def _all_to_all(buf: torch.Tensor, group, method: str) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (size P) of a contiguous buffer: chunk ``p`` goes to
    rank ``p``; chunk ``r`` of the result came from rank ``r``."""
    if method == "all_gather":
        return _all_to_all_by_gather(buf, group)
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf, group=group)
    return out


def post_all_to_all(buf: torch.Tensor, group, splits: list[int] | None = None):
    """Start an all-to-all of ``buf`` (dim 0 = ranks; with ``splits``, entries per rank, the
    same both ways); ``(out, work)``."""
    out = torch.empty_like(buf)
    work = dist.all_to_all_single(out, buf, output_split_sizes=splits, input_split_sizes=splits,
                                  group=group, async_op=True)  # fmt: skip
    return out, work


# ---------------------------------------------------------------------------------------------
# row copies
# ---------------------------------------------------------------------------------------------


# Every layout copy of the exchange goes through copy_rows_into. PyTorch's strided copy
# (torch.stack of permuted views, .contiguous(), slice assignment) moves these at about a third
# of the memory bandwidth (H200, Wan 14B 720p: 2.4 ms a call for the q, k, v, gate send
# buffers); the Triton row copy moves whole D-element rows at the bandwidth.


def _row_kernel_applies(dst: torch.Tensor) -> bool:
    """Where the Triton row copy runs: GPU tensors (the CPU keeps ``copy_``; a test may force
    the kernel in the interpreter by replacing this function)."""
    return dst.is_cuda


def copy_rows_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, by whole rows on the GPU where ``copy_rows`` takes the views."""
    if _row_kernel_applies(dst):
        from vidsparse.layout.permute import copy_rows, copy_rows_supports

        if copy_rows_supports(dst, src):
            copy_rows(dst, src)
            return
    dst.copy_(src)


def stack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(parts, dim=1)``, each part copied by :func:`copy_rows_into`."""
    first = parts[0]
    out = first.new_empty((first.shape[0], len(parts), *first.shape[1:]))
    for j, part in enumerate(parts):
        copy_rows_into(out[:, j], part)
    return out


def contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()`` by :func:`copy_rows_into`."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    copy_rows_into(out, x)
    return out


# ---------------------------------------------------------------------------------------------
# packing: views of the chunks, and the copies out of a receive buffer
# ---------------------------------------------------------------------------------------------


def seq_shard_chunks(x: torch.Tensor, layout: str, world: int) -> torch.Tensor:
    """Sequence shard -> ``[P, B, H/P, S/P, D]`` view: chunk p holds the heads of rank p."""
    B, S_local, H, D = local_dims(x, layout)
    if layout == "bshd":
        return x.reshape(B, S_local, world, H // world, D).permute(2, 0, 3, 1, 4)
    return x.reshape(B, world, H // world, S_local, D).permute(1, 0, 2, 3, 4)


def head_shard_chunks(y: torch.Tensor, world: int) -> torch.Tensor:
    """``[B, H/P, S, D]`` -> ``[P, B, H/P, S/P, D]`` view: chunk p holds sequence shard p."""
    B, H_local, S, D = y.shape
    return y.reshape(B, H_local, world, S // world, D).permute(2, 0, 1, 3, 4)


def full_seq_from_chunks(recv: torch.Tensor) -> torch.Tensor:
    """``[P, B, H/P, S/P, D]`` (chunk r = sequence shard r) -> ``[B, H/P, S, D]`` contiguous."""
    P, B, H_local, S_local, D = recv.shape
    out = recv.new_empty(B, H_local, P, S_local, D)
    copy_rows_into(out.permute(2, 0, 1, 3, 4), recv)
    return out.view(B, H_local, P * S_local, D)


def seq_shard_from_chunks(recv: torch.Tensor, layout: str) -> torch.Tensor:
    """``[P, B, H/P, S/P, D]`` (chunk r = heads of rank r) -> contiguous sequence shard."""
    P, B, H_local, S_local, D = recv.shape
    if layout == "bshd":
        out = recv.new_empty(B, S_local, P, H_local, D)
        copy_rows_into(out.permute(2, 0, 3, 1, 4), recv)
        return out.view(B, S_local, P * H_local, D)
    out = recv.new_empty(B, P, H_local, S_local, D)
    copy_rows_into(out.transpose(0, 1), recv)
    return out.view(B, P * H_local, S_local, D)


# ---------------------------------------------------------------------------------------------
# the two directions, each the other's backward
# ---------------------------------------------------------------------------------------------


def _seq_to_heads(xs: Sequence[torch.Tensor], ctx: ShardContext, method: str) -> list:
    """Sequence shards (one dtype) -> ``[B, H/P, S, D]`` each: one pack, one collective."""
    buf = stack_rows([seq_shard_chunks(x, ctx.layout, ctx.world_size) for x in xs])
    recv = _all_to_all(buf, ctx.group, method)  # [P, n, B, H/P, S/P, D]
    return [full_seq_from_chunks(recv[:, j]) for j in range(len(xs))]


def _heads_to_seq(ys: Sequence[torch.Tensor], ctx: ShardContext, method: str) -> list:
    """``[B, H/P, S, D]`` each (one dtype) -> sequence shards: one pack, one collective."""
    buf = stack_rows([head_shard_chunks(y, ctx.world_size) for y in ys])
    recv = _all_to_all(buf, ctx.group, method)
    return [seq_shard_from_chunks(recv[:, j], ctx.layout) for j in range(len(ys))]


def _reverse(exchange: Callable, grads, needed, ctx: ShardContext, method: str) -> list:
    """``exchange`` of the gradients autograd asks for, in one collective; ``None`` for the
    inputs that need none (a gate that is not trained does not travel back)."""
    wanted = [i for i, need in enumerate(needed) if need]
    out = [None] * len(grads)
    for i, g in zip(wanted, exchange([grads[i] for i in wanted], ctx, method)):
        out[i] = g
    return out


class _SeqToHeads(torch.autograd.Function):
    """Differentiable :func:`_seq_to_heads`; its backward is :func:`_heads_to_seq`."""

    @staticmethod
    def forward(fctx, ctx: ShardContext, method: str, *xs: torch.Tensor):
        fctx.shard, fctx.method = ctx, method
        return tuple(_seq_to_heads(xs, ctx, method))

    @staticmethod
    def backward(fctx, *grads):
        needed = fctx.needs_input_grad[2:]
        return None, None, *_reverse(_heads_to_seq, grads, needed, fctx.shard, fctx.method)


class _HeadsToSeq(torch.autograd.Function):
    """Differentiable :func:`_heads_to_seq`; its backward is :func:`_seq_to_heads`."""

    @staticmethod
    def forward(fctx, ctx: ShardContext, method: str, *ys: torch.Tensor):
        fctx.shard, fctx.method = ctx, method
        return tuple(_heads_to_seq(ys, ctx, method))

    @staticmethod
    def backward(fctx, *grads):
        needed = fctx.needs_input_grad[2:]
        return None, None, *_reverse(_seq_to_heads, grads, needed, fctx.shard, fctx.method)


def _by_dtype(exchange: type, xs: Sequence[torch.Tensor], ctx: ShardContext, method: str):
    """``exchange`` (one of the Functions above) per dtype group of ``xs``, in their order:
    one buffer, so one collective, per dtype (q, k, v and usually the gate share one)."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs):
        idx = [i for i, x in enumerate(xs) if x.dtype == dtype]
        for i, y in zip(idx, exchange.apply(ctx, method, *(xs[i] for i in idx))):
            out[i] = y
    return out


# ---------------------------------------------------------------------------------------------
# sequence shards <-> head shards
# ---------------------------------------------------------------------------------------------


def to_head_shards(
    tensors: Sequence[torch.Tensor], ctx: ShardContext, method: str
) -> list[torch.Tensor]:
    """Sequence shards -> head-sharded full sequences ``[B, H/P, S, D]``, contiguous, in one
    collective when the tensors share a dtype (q, k, v and usually the gate), one per dtype
    otherwise. Differentiable."""
    if ctx.world_size == 1:  # nothing to exchange; the contiguous [B, H, S, D] the op would get
        return [x.transpose(1, 2).contiguous() if ctx.layout == "bshd" else x for x in tensors]
    return _by_dtype(_SeqToHeads, tensors, ctx, method)


def to_seq_shard(y: torch.Tensor, ctx: ShardContext, method: str) -> torch.Tensor:
    """``[B, H/P, S, D]`` -> this rank's sequence shard in ``ctx.layout``. Differentiable."""
    if ctx.world_size == 1:
        return y.transpose(1, 2) if ctx.layout == "bshd" else y
    return _by_dtype(_HeadsToSeq, [y], ctx, method)[0]


def lse_to_seq_shard(lse: torch.Tensor, ctx: ShardContext, method: str) -> torch.Tensor:
    """``[B, H/P, S]`` -> ``[B, S/P, H]`` (bshd) or ``[B, H, S/P]`` (bhsd): a ``D = 1`` tensor."""
    return to_seq_shard(lse.unsqueeze(-1), ctx, method).squeeze(-1)


def seq_to_head(
    x: torch.Tensor, *, group=None, layout: str = "bshd", comm: str = "all_to_all"
) -> torch.Tensor:
    """Sequence shard ``[B, S/P, H, D]`` (or ``[B, H, S/P, D]``) -> ``[B, H/P, S, D]``: the full
    sequence of this rank's heads. Differentiable (backward: :func:`head_to_seq`).

    ``comm``: ``"all_to_all"`` (``all_to_all_single``) or ``"all_gather"`` (for a backend
    without all-to-all; ``P`` times the traffic).
    """
    ctx = resolve_context(group, layout)
    validate_shards(ctx, x=x)
    return to_head_shards([x], ctx, check_comm(comm))[0]


def head_to_seq(
    y: torch.Tensor, *, group=None, layout: str = "bshd", comm: str = "all_to_all"
) -> torch.Tensor:
    """``[B, H/P, S, D]`` -> sequence shard ``[B, S/P, H, D]`` (or ``[B, H, S/P, D]``): the
    inverse of :func:`seq_to_head`. Differentiable. ``S`` must be divisible by the world size."""
    ctx = resolve_context(group, layout)
    check_4d("y", y)
    if y.shape[2] % ctx.world_size:
        raise ValueError(
            f"sequence length {y.shape[2]} is not divisible by world size {ctx.world_size}"
        )
    return to_seq_shard(y, ctx, check_comm(comm))
