"""Ulysses' process group, shard geometry and the local checks that run before any collective.

Every check that can fail runs before the first collective, so a bad argument raises on every
rank instead of leaving the others waiting in a collective. Shapes that differ *between* ranks
cannot be seen locally; ``validate_shards_across_ranks`` (``check_shards=True`` or
``VIDSPARSE_ULYSSES_CHECK=1``) all-gathers the local shapes first and raises the same error on
every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vidsparse.layout.grid import VideoGrid

LAYOUTS = ("bshd", "bhsd")
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

    def padded_heads(self, num_heads: int) -> int:
        """``num_heads`` rounded up to a multiple of the world size (``pad_heads=True``)."""
        return -(-num_heads // self.world_size) * self.world_size

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
    check_4d("x", x)
    seq_dim = 1 if layout == "bshd" else 2
    S = x.shape[seq_dim]
    if S % ctx.world_size:
        raise ValueError(f"sequence length {S} is not divisible by world size {ctx.world_size}")
    return x.narrow(seq_dim, ctx.seq_slice(S).start, S // ctx.world_size)


# ---------------------------------------------------------------------------------------------
# validation (local, before any communication)
# ---------------------------------------------------------------------------------------------


def check_4d(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")


def validate_shards(
    ctx: ShardContext, pad_heads: bool = False, **tensors: torch.Tensor | None
) -> tuple[int, int, int, int]:
    """Local checks of the sequence shards; returns ``(B, S_local, H, D)`` (the real ``H``).

    q, k, v (and a gate) must share one shape and dtype (they travel in one buffer), the heads
    must split evenly over the ranks unless ``pad_heads``, and NCCL needs CUDA tensors.
    """
    if not isinstance(pad_heads, bool):
        raise TypeError(f"pad_heads must be a bool, got {pad_heads!r}")
    present = {name: x for name, x in tensors.items() if x is not None}
    for name, x in present.items():
        check_4d(name, x)
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
    if H % ctx.world_size and not pad_heads:
        P, padded = ctx.world_size, ctx.padded_heads(H)
        raise ValueError(
            f"Ulysses splits heads over the ranks: {H} heads are not divisible by the world size "
            f"{P}. Pass pad_heads=True (to the ulysses_* function or UlyssesAttention) to pad "
            f"them with {padded - H} zero heads to {padded} ({padded // P} a rank; the padded "
            "heads' attention is computed and dropped), or use a group whose size divides "
            "the number of heads"
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


def want_global_check(check: bool) -> bool:
    return bool(check) or os.environ.get(CHECK_ENV, "0").strip().lower() in ("1", "true", "yes")


def _backend_name(group) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return "unknown"


def check_grid_length(grid, tiled: bool, S_local: int, world: int, text_tokens: int = 0) -> None:
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
