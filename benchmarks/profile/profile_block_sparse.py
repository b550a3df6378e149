"""Per-kernel GPU time of one block-sparse forward + backward (torch.profiler).

    PYTHONPATH=src python benchmarks/profile/profile_block_sparse.py --seq 8192 --density 0.25

Shows where backward time goes (preprocess, list transpose, dK/dV, dQ) next to the forward.
``--trace DIR`` also writes each density's Chrome trace (``DIR/block_sparse_<bq>x<bk>_<d>.json``:
both streams' kernels on one timeline, so idle GPU time between them shows). ``--nondet``:
``deterministic=False`` (at 128x128 on a Hopper GPU the one-pass backward, whose dQ
accumulator's zeroing and conversion to q's dtype show as their own kernels).
"""

from __future__ import annotations

import argparse

import torch

import vidsparse
from vidsparse.bench import harness
from vidsparse.masks.block_sparse import random_block_lists


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--density", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--block", default="128x64")
    ap.add_argument("--trace", default=None, help="folder for Chrome traces")
    ap.add_argument("--nondet", action="store_true", help="deterministic=False")
    args = ap.parse_args(argv)
    bq, bk = (int(x) for x in args.block.split("x"))
    S, H, D = args.seq, args.heads, 128
    q, k, v = (
        torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16)
    for d in args.density:
        idx, cnt = random_block_lists(1, H, S // bq, S // bk, density=d, device="cuda")

        def step():
            o = vidsparse.block_sparse_attn(
                q, k, v, idx, cnt, block_size=(bq, bk), deterministic=not args.nondet
            )
            torch.autograd.grad(o, (q, k, v), do)

        prof = harness.cuda_profile(step, 5)
        mode = ", deterministic=False" if args.nondet else ""
        print(f"\n=== S={S} H={H} block {bq}x{bk} density {d}{mode} (5 steps) ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        if args.trace:
            tag = "_nondet" if args.nondet else ""
            prof.export_chrome_trace(f"{args.trace}/block_sparse_{bq}x{bk}_{d}{tag}.json")


if __name__ == "__main__":
    main()
