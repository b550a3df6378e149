"""Ulysses sequence parallelism: sequence-sharded in, head-sharded full-sequence attention inside.

With ``P`` ranks, each rank holds a contiguous ``S/P`` slice of the sequence for all ``H`` heads.
Sparse attention needs the whole sequence of a head (VSA's coarse stage, PSA's stripes, any
block list may reach any key), so one all-to-all trades the sequence shard for a head shard::

    rank r:  [B, S/P, H, D]  --all-to-all-->  [B, H/P, S, D]   heads r*H/P .. (r+1)*H/P - 1
             run the single-device op on the rank's heads (per-head plans sliced to them)
             [B, H/P, S, D]  --all-to-all-->  [B, S/P, H, D]

Both all-to-alls are differentiable: an equal-split all-to-all is a permutation of chunks that
is its own inverse, so its backward is the same all-to-all applied to the gradient.

Communication is ``torch.distributed.all_to_all_single`` on one contiguous buffer (q, k, v and a
gate are packed together, so a layer costs one collective in and one out, or ``head_chunks``
of each when the exchange is pipelined; an lse output adds one more). NCCL and gloo (CPU)
both implement it; ``comm="all_gather"`` selects an ``all_gather`` exchange instead, for a
backend that lacks it (``P`` times the traffic and memory; correct, not fast).

Every check that can fail runs before the first collective, so a bad argument raises on every
rank instead of leaving the others waiting in a collective. Shapes that differ *between* ranks
cannot be seen locally; ``check_shards=True`` (or ``VIDSPARSE_ULYSSES_CHECK=1``) all-gathers the
local shapes first and raises the same error on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vidsparse.layout.grid import VideoGrid
from vidsparse.utils.tensor_cache import TensorCache

__all__ = [
    "LAYOUTS",
    "UlyssesAttention",
    "head_to_seq",
    "seq_to_head",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_block_sparse_attn",
    "ulysses_stripe_attn",
    "ulysses_video_sparse_attn",
]

LAYOUTS = ("bshd", "bhsd")
COMM_METHODS = ("all_to_all", "all_gather")
CHECK_ENV = "VIDSPARSE_ULYSSES_CHECK"


# ---------------------------------------------------------------------------------------------
# process group and shard geometry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardContext:
    """The process group of a Ulysses call, this rank's place in it, and the input layout."""

    group: object
    rank: int
    world_size: int
    layout: str

    def head_slice(self, num_heads: int) -> slice:
        """The heads this rank computes: ``rank * H/P .. (rank + 1) * H/P``."""
        local = num_heads // self.world_size
        return slice(self.rank * local, (self.rank + 1) * local)

    def seq_slice(self, seq_len: int) -> slice:
        """The tokens of the full sequence this rank holds: ``rank * S/P .. (rank + 1) * S/P``."""
        local = seq_len // self.world_size
        return slice(self.rank * local, (self.rank + 1) * local)


def resolve_context(group=None, layout: str = "bshd") -> ShardContext:
    """Group (default WORLD), rank and world size, after checking that there is a process group."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not dist.is_available():
        raise RuntimeError("vidsparse.parallel needs torch.distributed, which this build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            "vidsparse.parallel needs an initialised process group: call "
            "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on CPU) first "
            "(torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for it)"
        )
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the process group passed as group")
    return ShardContext(group, rank, dist.get_world_size(group), layout)


def local_dims(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """``(B, S_local, H, D)`` of a sequence shard in either layout."""
    if layout == "bshd":
        B, S, H, D = x.shape
    else:
        B, H, S, D = x.shape
    return B, S, H, D


def shard_sequence(x: torch.Tensor, *, group=None, layout: str = "bshd") -> torch.Tensor:
    """This rank's contiguous ``S/P`` slice of a full-sequence tensor (no communication).

    The sharding every function here expects: rank ``r`` holds tokens ``r*S/P .. (r+1)*S/P-1``.
    """
    ctx = resolve_context(group, layout)
    _check_4d("x", x)
    seq_dim = 1 if layout == "bshd" else 2
    S = x.shape[seq_dim]
    if S % ctx.world_size:
        raise ValueError(f"sequence length {S} is not divisible by world size {ctx.world_size}")
    return x.narrow(seq_dim, ctx.seq_slice(S).start, S // ctx.world_size)


# ---------------------------------------------------------------------------------------------
# validation (local, before any communication)
# ---------------------------------------------------------------------------------------------


def _check_4d(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")


def validate_shards(ctx: ShardContext, **tensors: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Local checks of the sequence shards; returns ``(B, S_local, H, D)``.

    q, k, v (and a gate) must share one shape and dtype (they travel in one buffer), the heads
    must split evenly over the ranks, and NCCL needs CUDA tensors.
    """
    present = {name: x for name, x in tensors.items() if x is not None}
    for name, x in present.items():
        _check_4d(name, x)
    names = list(present)
    first = present[names[0]]
    for name in names[1:]:
        x = present[name]
        if x.shape != first.shape:
            raise ValueError(
                f"{name} must have the same local shape as {names[0]} {tuple(first.shape)} "
                f"(layout {ctx.layout!r}), got {tuple(x.shape)}"
            )
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device} but {names[0]} is on {first.device}")
    B, S_local, H, D = local_dims(first, ctx.layout)
    if H % ctx.world_size:
        raise ValueError(
            f"Ulysses splits heads over the ranks: {H} heads are not divisible by the world size "
            f"{ctx.world_size} (use a group whose size divides the number of heads)"
        )
    if _backend_name(ctx.group) == "nccl" and first.device.type != "cuda":
        raise ValueError(f"the NCCL process group moves CUDA tensors, got {first.device} tensors")
    return B, S_local, H, D


def validate_shards_across_ranks(ctx: ShardContext, **tensors: torch.Tensor | None) -> None:
    """All-gather every rank's local shapes and raise the same ``ValueError`` on every rank if
    they differ. One small collective and a host sync, so it is opt-in (debugging)."""
    if ctx.world_size == 1:
        return
    names = sorted(tensors)
    device = next(x.device for x in tensors.values() if x is not None)
    rows = [list(x.shape) if x is not None else [-1] * 4 for x in (tensors[n] for n in names)]
    local = torch.tensor(rows, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local, group=ctx.group)
    shapes = [g.tolist() for g in gathered]
    if all(s == shapes[0] for s in shapes):
        return
    lines = []
    for rank, rank_rows in enumerate(shapes):
        described = ", ".join(
            f"{n}={'None' if r[0] < 0 else tuple(r)}" for n, r in zip(names, rank_rows)
        )
        lines.append(f"rank {rank}: {described}")
    raise ValueError(
        "sequence shards differ across ranks (every rank must hold S/P tokens of the same "
        f"B, H, D in layout {ctx.layout!r}):\n  " + "\n  ".join(lines)
    )


def _want_global_check(check: bool) -> bool:
    return bool(check) or os.environ.get(CHECK_ENV, "0").strip().lower() in ("1", "true", "yes")


def _backend_name(group) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return "unknown"


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


# Packing. The send buffer is [P, ...]: chunk p is what rank p receives. Views only; the one
# copy per tensor happens in torch.stack / .contiguous() when the buffer is built.


def _seq_shard_chunks(x: torch.Tensor, layout: str, world: int) -> torch.Tensor:
    """Sequence shard -> ``[P, B, H/P, S/P, D]`` view: chunk p holds the heads of rank p."""
    B, S_local, H, D = local_dims(x, layout)
    if layout == "bshd":
        return x.reshape(B, S_local, world, H // world, D).permute(2, 0, 3, 1, 4)
    return x.reshape(B, world, H // world, S_local, D).permute(1, 0, 2, 3, 4)


def _full_seq_from_chunks(recv: torch.Tensor) -> torch.Tensor:
    """``[P, B, H/P, S/P, D]`` (chunk r = sequence shard r) -> ``[B, H/P, S, D]`` contiguous."""
    P, B, H_local, S_local, D = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H_local, P * S_local, D)


def _head_shard_chunks(y: torch.Tensor, world: int) -> torch.Tensor:
    """``[B, H/P, S, D]`` -> ``[P, B, H/P, S/P, D]`` view: chunk p holds sequence shard p."""
    B, H_local, S, D = y.shape
    return y.reshape(B, H_local, world, S // world, D).permute(2, 0, 1, 3, 4)


def _seq_shard_from_chunks(recv: torch.Tensor, layout: str) -> torch.Tensor:
    """``[P, B, H/P, S/P, D]`` (chunk r = heads of rank r) -> sequence shard in ``layout``."""
    P, B, H_local, S_local, D = recv.shape
    if layout == "bshd":
        return recv.permute(1, 3, 0, 2, 4).reshape(B, S_local, P * H_local, D)
    return recv.permute(1, 0, 2, 3, 4).reshape(B, P * H_local, S_local, D)


def _seq_to_head_many(
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
        buf = torch.stack([_seq_shard_chunks(tensors[i], ctx.layout, P) for i in idx], dim=1)
        recv = _exchange(buf, ctx, method)
        for j, i in enumerate(idx):
            out[i] = _full_seq_from_chunks(recv[:, j])
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
    return _seq_to_head_many([x], ctx, comm)[0]


def head_to_seq(
    y: torch.Tensor, *, group=None, layout: str = "bshd", comm: str = "all_to_all"
) -> torch.Tensor:
    """``[B, H/P, S, D]`` -> sequence shard ``[B, S/P, H, D]`` (or ``[B, H, S/P, D]``): the
    inverse of :func:`seq_to_head`. Differentiable. ``S`` must be divisible by the world size."""
    ctx = resolve_context(group, layout)
    _check_4d("y", y)
    if y.shape[2] % ctx.world_size:
        raise ValueError(
            f"sequence length {y.shape[2]} is not divisible by world size {ctx.world_size}"
        )
    return _head_to_seq(y, ctx, comm)


def _head_to_seq(y: torch.Tensor, ctx: ShardContext, method: str) -> torch.Tensor:
    if ctx.world_size == 1:
        return y.transpose(1, 2) if ctx.layout == "bshd" else y
    recv = _exchange(_head_shard_chunks(y, ctx.world_size), ctx, method)
    return _seq_shard_from_chunks(recv, ctx.layout)


def _lse_to_seq(lse: torch.Tensor, ctx: ShardContext, method: str) -> torch.Tensor:
    """``[B, H/P, S]`` -> ``[B, S/P, H]`` (bshd) or ``[B, H, S/P]`` (bhsd): a ``D = 1`` tensor."""
    return _head_to_seq(lse.unsqueeze(-1), ctx, method).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# the generic driver
# ---------------------------------------------------------------------------------------------

# attn_fn(heads, q, k, v, *extra) with full-sequence [B, H/P, S, D] tensors (None stays None).
AttnFn = Callable[..., "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def _run(
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
    """
    if _want_global_check(check):
        validate_shards_across_ranks(ctx, **tensors)
    if _inference_exchange_applies(ctx, tensors):
        tiled = tiled if tiled is not None and tiled.supports(tensors["q"], ctx.layout) else None
        if head_chunks > 1 or tiled is not None:
            return _run_overlapped(ctx, attn_fn, tensors, head_chunks, tiled)
    present = [x for x in tensors.values() if x is not None]
    full = iter(_seq_to_head_many(present, ctx, "all_to_all"))
    q_h, k_h, v_h, *extra_h = (None if x is None else next(full) for x in tensors.values())
    heads = ctx.head_slice(local_dims(tensors["q"], ctx.layout)[2])
    result = attn_fn(heads, q_h, k_h, v_h, *extra_h)
    if isinstance(result, tuple):  # (o, lse)
        o, lse = result
        return _head_to_seq(o, ctx, "all_to_all"), _lse_to_seq(lse, ctx, "all_to_all")
    return _head_to_seq(result, ctx, "all_to_all")


def _positive_head_chunks(head_chunks) -> int:
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
    return head_chunks


def check_head_chunks(head_chunks, num_heads: int, world_size: int) -> int:
    """``head_chunks`` must be a positive int dividing the rank's ``H/P`` heads."""
    _positive_head_chunks(head_chunks)
    local = num_heads // world_size
    if local % head_chunks:
        raise ValueError(
            f"head_chunks={head_chunks} must divide the heads of a rank (H/P = {num_heads}/"
            f"{world_size} = {local})"
        )
    return head_chunks


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


def _post_all_to_all(buf: torch.Tensor, group, splits: list[int] | None = None):
    """Start an all-to-all of ``buf`` (dim 0 = ranks; with ``splits``, entries per rank, the
    same both ways); ``(out, work)``."""
    out = torch.empty_like(buf)
    work = dist.all_to_all_single(out, buf, output_split_sizes=splits, input_split_sizes=splits,
                                  group=group, async_op=True)  # fmt: skip
    return out, work


def _run_overlapped(
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
    shards = [_seq_shard_chunks(x, layout, P) for x in present]
    # The tiled unpack reads the rank's own chunk from its input: only the others travel.
    own_in_place = tiled is not None
    splits = [0 if p == rank else 1 for p in range(P)] if own_in_place else None

    def send_buffer(c: int) -> torch.Tensor:
        # [P, n, B, h, S/P, D] (own_in_place: [P-1, ...], the other ranks in order): chunk p
        # holds group c of rank p's heads, for every tensor
        parts = [x[:, :, c * h : (c + 1) * h] for x in shards]
        if not own_in_place:
            return _stack_rows(parts)
        first = parts[0]
        buf = first.new_empty((P - 1, len(parts), *first.shape[1:]))
        for i, p in enumerate(p for p in range(P) if p != rank):
            for j, part in enumerate(parts):
                _copy_rows_into(buf[i, j], part[p])
        return buf

    def unpack(c: int, recv: torch.Tensor, j: int) -> torch.Tensor:
        if not own_in_place:
            return _full_seq_from_chunks(recv[:, j])
        return tiled.unpack(recv[:, j], shards[j][rank, :, c * h : (c + 1) * h], rank)

    inflight = _post_all_to_all(send_buffer(0), ctx.group, splits)
    returning, lse_parts = [], []
    for c in range(chunks):
        recv, work = inflight
        if c + 1 < chunks:
            inflight = _post_all_to_all(send_buffer(c + 1), ctx.group, splits)
        work.wait()
        full = iter(unpack(c, recv, j) for j in range(len(present)))
        args = [None if x is None else next(full) for x in tensors.values()]
        heads = slice(first_head + c * h, first_head + (c + 1) * h)
        result = attend(heads, *args)  # (o, lse) only without ``tiled`` (TiledExchange: o)
        o, lse = result if isinstance(result, tuple) else (result, None)
        send = _contiguous_rows(_head_shard_chunks(o, P)) if tiled is None else tiled.pack(o, P)
        returning.append(_post_all_to_all(send, ctx.group))
        if lse is not None:
            lse_parts.append(_post_all_to_all(_head_shard_chunks(lse.unsqueeze(-1), P).contiguous(),
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
            _copy_rows_into(view[:, :, :, c], recv.permute(1, 3, 0, 2, 4))  # [B, S/P, P, h, D]
        else:
            _copy_rows_into(view[:, :, c], recv.permute(1, 0, 2, 3, 4))  # [B, P, h, S/P, D]
    return out


# Layout copies of the inference exchange. PyTorch's strided copy (torch.stack of permuted
# views, .contiguous(), slice assignment) moves these at about a third of the memory bandwidth
# (H200, Wan 14B 720p: 2.4 ms a call for the q, k, v, gate send buffers); the Triton row copy
# moves whole D-element rows at the bandwidth. Not differentiable: autograd keeps torch.stack.


def _copy_rows_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, by whole rows on the GPU where ``copy_rows`` takes the views."""
    if dst.is_cuda:
        from vidsparse.layout.permute import copy_rows, copy_rows_supports

        if copy_rows_supports(dst, src):
            copy_rows(dst, src)
            return
    dst.copy_(src)


def _stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(parts, dim=1)``, each part copied by ``_copy_rows_into``."""
    first = parts[0]
    out = first.new_empty((first.shape[0], len(parts), *first.shape[1:]))
    for j, part in enumerate(parts):
        _copy_rows_into(out[:, j], part)
    return out


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()`` by ``_copy_rows_into``."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _copy_rows_into(out, x)
    return out


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

    Returns ``o`` in the input layout (and ``lse`` ``[B, S/P, H]`` / ``[B, H, S/P]``).
    """
    ctx = resolve_context(group, layout)
    tensors = {"q": q, "k": k, "v": v, **{f"extra{i}": x for i, x in enumerate(extra)}}
    _, _, H, _ = validate_shards(ctx, **tensors)
    check_head_chunks(head_chunks, H, ctx.world_size)
    return _run(ctx, attn_fn, tensors, check_shards, head_chunks)


# ---------------------------------------------------------------------------------------------
# block-sparse engine
# ---------------------------------------------------------------------------------------------


# The rank's slice of a block-list tensor, reused across calls: the engine validates list
# values once per tensor object (reading them back costs a GPU sync), which a fresh slice every
# call would defeat. Per source tensor and version (TensorCache): never stale.
_list_slices = TensorCache(capacity=64)


def _head_slice(src: torch.Tensor, heads: slice) -> torch.Tensor:
    return _list_slices.get(
        "heads", (src,), (heads.start, heads.stop), lambda: src[:, heads].contiguous()
    )


def _block_q(block_size) -> int | None:
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        return block_size
    if isinstance(block_size, (tuple, list)) and len(block_size) == 2:
        return block_size[0]
    return None  # malformed: the engine names the problem (after the exchange, on every rank)


def _check_block_lists(kv_indices, kv_counts, H: int, S: int, block_q: int | None) -> None:
    for name, x, ndim in (("kv_indices", kv_indices, 4), ("kv_counts", kv_counts, 3)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got {tuple(x.shape)}")
        if x.shape[1] != H:
            raise ValueError(
                f"{name} must hold the lists of all H={H} heads (dim 1; each rank slices its "
                f"own), got shape {tuple(x.shape)}"
            )
    if block_q is None:
        return
    if S % block_q:
        raise ValueError(
            f"the full sequence length S={S} (local shard x world size) is not a multiple of "
            f"block_q={block_q}"
        )
    if kv_indices.shape[2] != S // block_q or kv_counts.shape[2] != S // block_q:
        raise ValueError(
            f"block lists must have S // block_q = {S // block_q} query-block rows for the full "
            f"sequence S={S}, got kv_indices {tuple(kv_indices.shape)}, "
            f"kv_counts {tuple(kv_counts.shape)}"
        )


def ulysses_block_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    group=None,
    layout: str = "bshd",
    check_shards: bool = False,
    head_chunks: int = 1,
    **engine_kwargs,
):
    """:func:`vidsparse.block_sparse_attn` over a sequence-sharded input.

    Args:
        q, k, v: sequence shards ``[B, S/P, H, D]`` (or ``[B, H, S/P, D]`` with
            ``layout="bhsd"``); self-attention, so ``Sq == Skv == S``.
        kv_indices, kv_counts: the block lists of the *full* sequence and *all* heads,
            ``[B or 1, H, S // block_q, K]`` and ``[B or 1, H, S // block_q]``; each rank uses
            its ``H/P`` heads (the batch dim is kept).
        engine_kwargs: ``block_size``, ``kv_block_sizes`` (full sequence), ``scale``,
            ``return_lse`` as for the engine; ``lse`` comes back ``[B, S/P, H]`` (bshd) or
            ``[B, H, S/P]`` (bhsd).
        head_chunks: pipelined exchange for inference (see :func:`ulysses_attention`).
    """
    from vidsparse.ops.block_sparse_attn import block_sparse_attn

    ctx = resolve_context(group, layout)
    _, S_local, H, _ = validate_shards(ctx, q=q, k=k, v=v)
    check_head_chunks(head_chunks, H, ctx.world_size)
    block_q = _block_q(engine_kwargs.get("block_size", 64))
    _check_block_lists(kv_indices, kv_counts, H, S_local * ctx.world_size, block_q)

    def attn_fn(heads, q_h, k_h, v_h):
        idx, cnt = _head_slice(kv_indices, heads), _head_slice(kv_counts, heads)
        return block_sparse_attn(q_h, k_h, v_h, idx, cnt, **engine_kwargs)

    return _run(ctx, attn_fn, {"q": q, "k": k, "v": v}, check_shards, head_chunks)


# ---------------------------------------------------------------------------------------------
# VSA
# ---------------------------------------------------------------------------------------------


def _check_grid_length(grid, tiled: bool, S_local: int, world: int, text_tokens: int = 0) -> None:
    """Full length ``(padded_len if tiled else num_tokens) + text_tokens``, split evenly."""
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    expected = (grid.padded_len if tiled else grid.num_tokens) + text_tokens
    what = ("grid.padded_len" if tiled else "grid.num_tokens") + (
        " + text_tokens" if text_tokens else ""
    )
    if expected % world:
        hint = (
            " Pass tile-ordered inputs (grid.tile(x), tiled=True): padded_len is a multiple of "
            "the tile volume, so any world size dividing it works."
            if not tiled and not text_tokens
            else ""
        )
        raise ValueError(
            f"{what}={expected} of {grid} is not divisible by the world size {world}: the "
            f"sequence cannot be split into equal shards.{hint}"
        )
    if S_local * world != expected:
        raise ValueError(
            f"each rank must hold {what} / world size = {expected // world} tokens of {grid} "
            f"(tiled={tiled}, text_tokens={text_tokens}), got a local sequence of {S_local}"
        )


def ulysses_video_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    *,
    topk: int | None = None,
    sparsity: float | None = None,
    gate: torch.Tensor | None = None,
    tiled: bool = False,
    scale: float | None = None,
    group=None,
    layout: str = "bshd",
    check_shards: bool = False,
    head_chunks: int = 1,
) -> torch.Tensor:
    """:func:`vidsparse.video_sparse_attn` over a sequence-sharded input.

    ``grid`` describes the full sequence. Natural order: each rank holds ``num_tokens / P``
    consecutive raster tokens. ``tiled=True``: each rank holds a contiguous ``padded_len / P``
    chunk of the padded tile-order sequence (whole tiles when ``P`` divides ``num_tiles``,
    but any split works: the all-to-all reassembles the full sequence before the op). ``gate``
    is sharded like q and exchanged with it. Differentiable in q, k, v and gate.
    ``head_chunks``: pipelined exchange for inference (see :func:`ulysses_attention`).
    """
    from vidsparse.ops.video_sparse_attn import video_sparse_attn
    from vidsparse.ops.video_sparse_attn.reference import resolve_topk

    ctx = resolve_context(group, layout)
    _, S_local, H, _ = validate_shards(ctx, q=q, k=k, v=v, gate=gate)
    check_head_chunks(head_chunks, H, ctx.world_size)
    if not isinstance(tiled, bool):
        raise TypeError(f"tiled must be a bool, got {tiled!r}")
    _check_grid_length(grid, tiled, S_local, ctx.world_size)
    resolve_topk(grid.num_tiles, topk, sparsity)  # bad topk/sparsity: raise before exchanging

    def attn_fn(heads, q_h, k_h, v_h, gate_h, tiled=tiled):
        return video_sparse_attn(
            q_h,
            k_h,
            v_h,
            grid,
            topk=topk,
            sparsity=sparsity,
            gate=gate_h,
            tiled=tiled,
            scale=scale,
        )

    def tiled_attn_fn(heads, *xs):
        return attn_fn(heads, *xs, tiled=True)

    # Natural order: in inference the exchange tiles and untiles on the way (one pass each).
    exchange = None if tiled else TiledExchange(grid, tiled_attn_fn)
    tensors = {"q": q, "k": k, "v": v, "gate": gate}
    return _run(ctx, attn_fn, tensors, check_shards, head_chunks, exchange)


# ---------------------------------------------------------------------------------------------
# PSA (stripe attention)
# ---------------------------------------------------------------------------------------------


def _slice_specs(specs, H: int, heads: slice) -> tuple:
    try:
        specs = tuple(specs)
    except TypeError:
        raise TypeError(
            f"specs must be a sequence of StripeSpec (one per head), got {type(specs).__name__}"
        ) from None
    if len(specs) != H:
        raise ValueError(f"specs must hold one StripeSpec per head (H={H}), got {len(specs)}")
    return specs[heads]


def _check_stripe_length(grid, stripe_kwargs: dict, S_local: int, world: int) -> None:
    """``_check_grid_length`` with stripe_attn's ``tiled`` and ``text_tokens`` options."""
    tiled = stripe_kwargs.get("tiled", False)
    text = stripe_kwargs.get("text_tokens", 0)
    if isinstance(grid, VideoGrid) and (
        not isinstance(tiled, bool) or isinstance(text, bool) or not isinstance(text, int)
    ):
        return  # malformed: stripe_attn names the problem (same on every rank)
    _check_grid_length(grid, tiled, S_local, world, text_tokens=text)


def ulysses_stripe_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    specs,
    *,
    group=None,
    layout: str = "bshd",
    check_shards: bool = False,
    head_chunks: int = 1,
    **stripe_kwargs,
) -> torch.Tensor:
    """:func:`vidsparse.stripe_attn` (PSA) over a sequence-sharded input.

    ``specs``: one :class:`StripeSpec` per head of the full model (``H`` of them); each rank
    uses its ``H/P``. ``stripe_kwargs`` (``spatial_unit``, ``tiled``, ``sink_frames``,
    ``text_tokens``, ``scale``, ``return_lse``) pass through; they describe the full sequence,
    ``(grid.padded_len if tiled else grid.num_tokens) + text_tokens`` long, split evenly.
    ``head_chunks``: pipelined exchange for inference (see :func:`ulysses_attention`).
    """
    ctx = resolve_context(group, layout)
    _, S_local, H, _ = validate_shards(ctx, q=q, k=k, v=v)
    check_head_chunks(head_chunks, H, ctx.world_size)
    _check_stripe_length(grid, stripe_kwargs, S_local, ctx.world_size)
    _slice_specs(specs, H, ctx.head_slice(H))  # wrong count: raise before exchanging
    try:
        from vidsparse.ops.stripe_attn import stripe_attn
    except ImportError as exc:
        raise ImportError(f"vidsparse.ops.stripe_attn is not available: {exc}") from exc

    def attn_fn(heads, q_h, k_h, v_h):
        return stripe_attn(q_h, k_h, v_h, grid, _slice_specs(specs, H, heads), **stripe_kwargs)

    def tiled_attn_fn(heads, q_t, k_t, v_t):
        kwargs = {**stripe_kwargs, "tiled": True}
        return stripe_attn(q_t, k_t, v_t, grid, _slice_specs(specs, H, heads), **kwargs)

    # Natural order, video only, o only: in inference the exchange tiles and untiles on the way.
    plain = not any(stripe_kwargs.get(key) for key in ("tiled", "text_tokens", "return_lse"))
    exchange = TiledExchange(grid, tiled_attn_fn) if plain else None
    return _run(ctx, attn_fn, {"q": q, "k": k, "v": v}, check_shards, head_chunks, exchange)


# ---------------------------------------------------------------------------------------------
# a handle for integrations
# ---------------------------------------------------------------------------------------------


class UlyssesAttention:
    """Binds a process group and a layout, for an attention processor to call per layer.

    A diffusers processor receives ``[B, S_local, H, D]`` (``layout="bshd"``) and calls e.g.
    ``self.ulysses.video_sparse_attn(q, k, v, grid, sparsity=0.875, gate=g)``. The group is
    resolved at each call, so the handle can be built before ``init_process_group``.
    """

    def __init__(
        self,
        group=None,
        *,
        layout: str = "bshd",
        check_shards: bool = False,
        head_chunks: int = 1,
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.group = group
        self.layout = layout
        self.check_shards = check_shards
        self.head_chunks = _positive_head_chunks(head_chunks)

    def _kw(self) -> dict:
        return {
            "group": self.group,
            "layout": self.layout,
            "check_shards": self.check_shards,
            "head_chunks": self.head_chunks,
        }

    @property
    def world_size(self) -> int:
        return resolve_context(self.group, self.layout).world_size

    @property
    def rank(self) -> int:
        return resolve_context(self.group, self.layout).rank

    def __call__(self, attn_fn: AttnFn, q, k, v, *extra):
        """Generic: see :func:`ulysses_attention`."""
        return ulysses_attention(attn_fn, q, k, v, *extra, **self._kw())

    def block_sparse_attn(self, q, k, v, kv_indices, kv_counts, **engine_kwargs):
        return ulysses_block_sparse_attn(
            q, k, v, kv_indices, kv_counts, **self._kw(), **engine_kwargs
        )

    def video_sparse_attn(self, q, k, v, grid, **vsa_kwargs):
        return ulysses_video_sparse_attn(q, k, v, grid, **self._kw(), **vsa_kwargs)

    def stripe_attn(self, q, k, v, grid, specs, **stripe_kwargs):
        return ulysses_stripe_attn(q, k, v, grid, specs, **self._kw(), **stripe_kwargs)

    def __repr__(self) -> str:
        return f"UlyssesAttention(group={self.group!r}, layout={self.layout!r})"
