"""Host (CPU) cost of one block-sparse call next to its GPU time: where a timed call waits on
Python rather than on kernels.

    PYTHONPATH=src python benchmarks/profile/profile_host.py [--density 0.125] [--block 128x128]

For the forward and forward+backward of ``vidsparse.block_sparse_attn`` at B=1, H=12, S=32768,
D=128 (bf16, random per-head lists), prints

- ``do_bench``: the median as the block_sparse benchmark times it (L2 flushed between calls, so
  the host gets a head start of one flush);
- ``kernels``: the sum of the call's CUDA kernel times (torch.profiler), i.e. the GPU work;
- ``host``: wall time of enqueuing one call (no synchronisation), the median of 20;
- the top host functions by cumulative time (cProfile over 20 calls).

The difference between ``do_bench`` and ``kernels`` is what the host leaves exposed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from vidsparse.bench import harness
from vidsparse.masks.block_sparse import random_block_lists


def host_ms(fn, calls: int = 20) -> float:
    """Median wall time of enqueuing one call; the GPU drains between calls."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def top_host_functions(fn, calls: int = 20, lines: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


def main(argv=None):
    import vidsparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--block", default="128x128")
    ap.add_argument("--no-cprofile", action="store_true")
    args = ap.parse_args(argv)
    bq, bk = (int(x) for x in args.block.split("x"))
    S, H, D = args.seq, args.heads, 128
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    idx, cnt = random_block_lists(1, H, S // bq, S // bk, density=args.density, device="cuda")

    def forward(q, k, v):
        return vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(bq, bk))

    for mode in ("fwd", "fwd+bwd"):
        fn = harness.mode_callable(forward, (q, k, v), mode)
        bench = harness.time_ms(fn, device=q.device)  # as the block_sparse benchmark times it
        gpu = harness.summed_kernel_ms(fn, warmup=1)
        host = host_ms(fn)
        print(
            f"{mode}: do_bench {bench:.3f} ms, kernels {gpu:.3f} ms, exposed"
            f" {bench - gpu:+.3f} ms; host enqueue {host:.3f} ms per call",
            flush=True,
        )
        if not args.no_cprofile:
            print(top_host_functions(fn), flush=True)


if __name__ == "__main__":
    main()
