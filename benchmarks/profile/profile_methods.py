"""Per-kernel GPU time of VSA and PSA at the benchmark shapes (torch.profiler).

    PYTHONPATH=src python benchmarks/profile/profile_methods.py                 # both methods
    PYTHONPATH=src python benchmarks/profile/profile_methods.py --methods vsa

Shows where a method's time goes beyond the fine-stage kernel (tiling, selection, gate
combine, list building), which the benchmarks' totals hide.
"""

from __future__ import annotations

import argparse
import random

import torch

import vidsparse
from vidsparse.bench import harness, shapes
from vidsparse.bench.ops.psa import mixed_specs


def show(title: str, step, repeats: int = 5) -> None:
    prof = harness.cuda_profile(step, repeats)
    print(f"\n=== {title} ({repeats} steps; per-step = total / {repeats}) ===", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24), flush=True)


WAN_480P, WAN_720P = shapes.MODELS["wan1.3b-480p"], shapes.MODELS["wan14b-720p"]


def profile_vsa(grid_shape=WAN_480P.grid, heads=WAN_480P.heads, sparsity=0.875) -> None:
    grid = vidsparse.VideoGrid(grid_shape, tile=(4, 4, 4))
    shape = (1, heads, grid.num_tokens, 128)
    q, k, v, gate = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(4)
    )
    tiled = [grid.tile(x.detach(), dim=-2).contiguous().requires_grad_() for x in (q, k, v, gate)]
    do_t = torch.randn_like(tiled[0])
    do_n = torch.randn_like(q)

    def fwd_tiled():
        with torch.no_grad():
            vidsparse.video_sparse_attn(
                *tiled[:3], grid, sparsity=sparsity, gate=tiled[3], tiled=True
            )

    def fwd_natural():
        with torch.no_grad():
            vidsparse.video_sparse_attn(q, k, v, grid, sparsity=sparsity, gate=gate)

    def fwd_bwd_tiled():
        o = vidsparse.video_sparse_attn(
            *tiled[:3], grid, sparsity=sparsity, gate=tiled[3], tiled=True
        )
        torch.autograd.grad(o, tiled, do_t)

    def fwd_bwd_natural():  # what #19's VSA bars time: natural order with the gate
        o = vidsparse.video_sparse_attn(q, k, v, grid, sparsity=sparsity, gate=gate)
        torch.autograd.grad(o, (q, k, v, gate), do_n)

    name = f"VSA grid {grid_shape} H={heads} sparsity {sparsity}"
    show(f"{name} fwd tiled", fwd_tiled)
    show(f"{name} fwd natural", fwd_natural)
    show(f"{name} fwd+bwd tiled", fwd_bwd_tiled)
    show(f"{name} fwd+bwd natural", fwd_bwd_natural)


def profile_psa(grid_shape=WAN_720P.grid, heads=WAN_720P.heads, tiles=((2, 8, 8), (1, 8, 16))):
    S = grid_shape[0] * grid_shape[1] * grid_shape[2]
    q, k, v = (torch.randn(1, heads, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for tile in tiles:
        grid = vidsparse.VideoGrid(grid_shape, tile=tile)
        for target in (0.6, 0.9):
            specs, achieved = mixed_specs(grid.tiles, heads, target, random.Random(0))

            def fwd():
                vidsparse.stripe_attn(q, k, v, grid, specs)

            show(f"PSA grid {grid_shape} tile {tile} H={heads} sparsity {achieved:.3f}", fwd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="vsa,psa")
    ap.add_argument("--vsa-720p", action="store_true", help="VSA also at Wan 14B 720p, 40 heads")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    if "vsa" in methods:
        profile_vsa()
        if args.vsa_720p:
            profile_vsa(WAN_720P.grid, heads=WAN_720P.heads)
    if "psa" in methods:
        profile_psa()


if __name__ == "__main__":
    main()
