"""Ulysses sequence parallelism with vidsparse: VSA and the block-sparse engine on P processes.

Every rank builds the same seeded full-size q, k, v (``[B, S, H, D]``, natural token order, as
a video DiT holds them), keeps its ``S/P`` slice, runs the sharded op, and compares its output
and its q-gradient slice with the single-device result of the same op on the full tensors.
Rank 0 prints the largest error over all ranks.

    torchrun --nproc-per-node 2 examples/torchrun_ulysses.py
    torchrun --nproc-per-node 2 examples/torchrun_ulysses.py --grid 21,30,52 --heads 12   # GPUs

NCCL and one GPU per rank when CUDA is available, else gloo on the CPU (torch reference path).
Run from the repository root; the checkout's ``src`` is used when vidsparse is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

if importlib.util.find_spec("vidsparse") is None:  # the checkout, when not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401  (before init_process_group: see init_distributed)
import torch.distributed as dist  # noqa: E402

from vidsparse import VideoGrid, block_sparse_attn, video_sparse_attn  # noqa: E402
from vidsparse.masks.block_sparse import random_block_lists  # noqa: E402
from vidsparse.parallel import (  # noqa: E402
    shard_sequence,
    ulysses_block_sparse_attn,
    ulysses_video_sparse_attn,
)


def init_distributed() -> torch.device:
    """NCCL with one GPU per rank (LOCAL_RANK) when there are GPUs, gloo on the CPU otherwise.

    torch._dynamo is imported above, before the group exists: imported later (the engine does
    on its first call) it keeps references to the group past destroy_process_group, and gloo
    then aborts at interpreter exit about one run in four (torch 2.13, CPU).
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def seeded_inputs(shape, n: int, *, dtype, device, seed: int = 0) -> list[torch.Tensor]:
    """The same tensors on every rank: generated on the CPU from one seed, then moved."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(n)]


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def compare(name: str, sharded_fn, full_fn, inputs: list[torch.Tensor], device) -> None:
    """Forward + backward both ways; print (rank 0) the max error of o and dq over all ranks."""
    full = [x.clone().requires_grad_(True) for x in inputs]  # [B, S, H, D]
    local = [shard_sequence(x).detach().requires_grad_(True) for x in inputs]  # [B, S/P, H, D]
    ref, out = full_fn(*full), sharded_fn(*local)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(ref)
    ref.backward(grad)
    out.backward(shard_sequence(grad))
    err_o = (out.float() - shard_sequence(ref).float()).abs().max().item()
    err_dq = (local[0].grad.float() - shard_sequence(full[0].grad).float()).abs().max().item()
    err_o, err_dq = max_over_ranks(err_o, device), max_over_ranks(err_dq, device)
    if dist.get_rank() == 0:
        print(f"{name:>22}: max |o - o_1dev| = {err_o:.3e}   max |dq - dq_1dev| = {err_dq:.3e}")


def bhsd(fn):
    """Run a ``[B, H, S, D]`` op on ``[B, S, H, D]`` tensors (the single-device reference)."""

    def wrapped(*xs):
        return fn(*(x.transpose(1, 2) for x in xs)).transpose(1, 2)

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="5,12,16", help="latent T,H,W (default: a small one)")
    parser.add_argument("--heads", type=int, default=4, help="must be divisible by the ranks")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sparsity", type=float, default=0.75)
    args = parser.parse_args()

    device = init_distributed()
    world = dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grid = VideoGrid(tuple(int(n) for n in args.grid.split(",")), tile=(4, 4, 4))
    H, D = args.heads, args.head_dim
    if dist.get_rank() == 0:
        print(f"{world} ranks ({dist.get_backend()}, {device.type}, {dtype}); {grid}; H={H}, D={D}")

    # VSA in natural order: rank r holds tokens r*S/P .. (r+1)*S/P - 1 of the raster sequence.
    q, k, v, gate = seeded_inputs((1, grid.num_tokens, H, D), 4, dtype=dtype, device=device)
    vsa = {"sparsity": args.sparsity}
    compare(
        "VSA (natural order)",
        lambda q, k, v, g: ulysses_video_sparse_attn(q, k, v, grid, gate=g, **vsa),
        bhsd(lambda q, k, v, g: video_sparse_attn(q, k, v, grid, gate=g, **vsa)),
        [q, k, v, gate],
        device,
    )

    # Block-sparse on the padded tile-order sequence, one random list per head and query tile.
    q, k, v = (grid.tile(x, dim=1) for x in (q, k, v))  # [B, padded_len, H, D]
    nb = grid.num_tiles
    gen = torch.Generator().manual_seed(2)
    idx, cnt = random_block_lists(1, H, nb, nb, density=1 - args.sparsity, generator=gen)
    engine = {
        "block_size": grid.tile_volume,
        "kv_block_sizes": grid.tile_sizes_on(device),
    }
    idx, cnt = idx.to(device), cnt.to(device)
    compare(
        "block-sparse (tiled)",
        lambda q, k, v: ulysses_block_sparse_attn(q, k, v, idx, cnt, **engine),
        bhsd(lambda q, k, v: block_sparse_attn(q, k, v, idx, cnt, **engine)),
        [q, k, v],
        device,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
