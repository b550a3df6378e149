"""Ulysses' exchange: the differentiable equal-split all-to-all and the packing around it.

With ``P`` ranks the send buffer is ``[P, ...]``: chunk ``p`` is what rank ``p`` receives, and
chunk ``r`` of the result came from rank ``r``. An equal-split all-to-all is a permutation of
chunks that is its own inverse, so its backward is the same exchange applied to the gradient.
``comm="all_gather"`` runs it as an ``all_gather`` instead, for a backend without all-to-all
(``P`` times the traffic and memory; correct, not fast).
"""

from __future__ import annotations

from collections.abc import Sequence

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


class _AllToAll(torch.autograd.Function):
    """Differentiable equal-split all-to-all. The exchange is a permutation of chunks that is its
    own inverse, so the backward is the same exchange applied to the incoming gradient."""

    @staticmethod
    def forward(ctx, buf: torch.Tensor, group, method: str) -> torch.Tensor:
        ctx.group, ctx.method = group, method
        return _all_to_all(buf, group, method)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.method), None, None


def _exchange(buf: torch.Tensor, ctx: ShardContext, method: str) -> torch.Tensor:
    if method not in COMM_METHODS:
        raise ValueError(f"comm must be one of {COMM_METHODS}, got {method!r}")
    return _AllToAll.apply(buf.contiguous(), ctx.group, method)


def post_all_to_all(buf: torch.Tensor, group, splits: list[int] | None = None):
    """Start an all-to-all of ``buf`` (dim 0 = ranks; with ``splits``, entries per rank, the
    same both ways); ``(out, work)``."""
    out = torch.empty_like(buf)
    work = dist.all_to_all_single(out, buf, output_split_sizes=splits, input_split_sizes=splits,
                                  group=group, async_op=True)  # fmt: skip
    return out, work


# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------


# The send buffer is [P, ...]: chunk p is what rank p receives. Views only; the one copy per
# tensor happens in torch.stack / .contiguous() when the buffer is built.


def seq_shard_chunks(x: torch.Tensor, layout: str, world: int) -> torch.Tensor:
    """Sequence shard -> ``[P, B, H/P, S/P, D]`` view: chunk p holds the heads of rank p."""
    B, S_local, H, D = local_dims(x, layout)
    if layout == "bshd":
        return x.reshape(B, S_local, world, H // world, D).permute(2, 0, 3, 1, 4)
    return x.reshape(B, world, H // world, S_local, D).permute(1, 0, 2, 3, 4)


def full_seq_from_chunks(recv: torch.Tensor) -> torch.Tensor:
    """``[P, B, H/P, S/P, D]`` (chunk r = sequence shard r) -> ``[B, H/P, S, D]`` contiguous."""
    P, B, H_local, S_local, D = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H_local, P * S_local, D)


def head_shard_chunks(y: torch.Tensor, world: int) -> torch.Tensor:
    """``[B, H/P, S, D]`` -> ``[P, B, H/P, S/P, D]`` view: chunk p holds sequence shard p."""
    B, H_local, S, D = y.shape
    return y.reshape(B, H_local, world, S // world, D).permute(2, 0, 1, 3, 4)


def _seq_shard_from_chunks(recv: torch.Tensor, layout: str) -> torch.Tensor:
    """``[P, B, H/P, S/P, D]`` (chunk r = heads of rank r) -> sequence shard in ``layout``."""
    P, B, H_local, S_local, D = recv.shape
    if layout == "bshd":
        return recv.permute(1, 3, 0, 2, 4).reshape(B, S_local, P * H_local, D)
    return recv.permute(1, 0, 2, 3, 4).reshape(B, P * H_local, S_local, D)


# ---------------------------------------------------------------------------------------------
# sequence shards <-> head shards
# ---------------------------------------------------------------------------------------------


def to_head_shards(
    tensors: Sequence[torch.Tensor], ctx: ShardContext, method: str
) -> list[torch.Tensor]:
    """Sequence shards -> head-sharded full sequences ``[B, H/P, S, D]``, in one collective
    when the tensors share a dtype (q, k, v and usually the gate), one per dtype otherwise."""
    P = ctx.world_size
    if P == 1:  # nothing to exchange; hand the op the contiguous [B, H, S, D] it would get
        return [x.transpose(1, 2).contiguous() if ctx.layout == "bshd" else x for x in tensors]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(x.dtype for x in tensors):
        idx = [i for i, x in enumerate(tensors) if x.dtype == dtype]
        # [P, n, B, H/P, S/P, D]: dim 0 still addresses ranks, so one exchange moves all n.
        buf = torch.stack([seq_shard_chunks(tensors[i], ctx.layout, P) for i in idx], dim=1)
        recv = _exchange(buf, ctx, method)
        for j, i in enumerate(idx):
            out[i] = full_seq_from_chunks(recv[:, j])
    return out


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
    return to_head_shards([x], ctx, comm)[0]


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
    return to_seq_shard(y, ctx, comm)


def to_seq_shard(y: torch.Tensor, ctx: ShardContext, method: str) -> torch.Tensor:
    if ctx.world_size == 1:
        return y.transpose(1, 2) if ctx.layout == "bshd" else y
    recv = _exchange(head_shard_chunks(y, ctx.world_size), ctx, method)
    return _seq_shard_from_chunks(recv, ctx.layout)


def lse_to_seq_shard(lse: torch.Tensor, ctx: ShardContext, method: str) -> torch.Tensor:
    """``[B, H/P, S]`` -> ``[B, S/P, H]`` (bshd) or ``[B, H, S/P]`` (bhsd): a ``D = 1`` tensor."""
    return to_seq_shard(lse.unsqueeze(-1), ctx, method).squeeze(-1)
