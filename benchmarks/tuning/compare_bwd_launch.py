"""The backward's launch choices side by side on the current GPU: dK/dV and dQ in one launch
against two, and the derived-list cache against deriving the lists on every call.

    PYTHONPATH=src python benchmarks/tuning/compare_bwd_launch.py --out compare_bwd.json

B=1, H=12, S=32768, D=128, bf16, 128x128 blocks, random per-head lists at densities 1/8 and
1/16. Times (``do_bench`` medians, three alternating rounds so drift hits every variant):

- ``bwd fused`` / ``bwd two launches``: the engine's ``bwd.block_sparse_attn_bwd`` inside
  ``configs.override(fused=True)`` / ``override(fused=False)`` (transposed lists cached in both);
- ``fwd+bwd cached`` / ``fwd+bwd uncached``: the public function's forward and backward, with
  the derived lists kept or the cache cleared before every call.

Also checks that both launches give bit-identical gradients.
"""

from __future__ import annotations

import argparse

import torch
import triton

from vidsparse.bench import harness
from vidsparse.masks.block_sparse import random_block_lists


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(argv=None):
    import vidsparse
    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.configs import override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd
    from vidsparse.ops.block_sparse_attn.lists import derived_lists

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="compare_bwd.json")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    S, H, D, block = 32768, 12, 128, 128
    scale = D**-0.5
    q, k, v, do = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    rows = []
    for density in (0.125, 0.0625):
        idx, cnt = random_block_lists(1, H, S // block, S // block, density=density, device="cuda")
        o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, None, block, block, scale)

        def backward(fused, idx=idx, cnt=cnt, o=o, lse=lse):
            with override(fused=fused):
                return block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, None, block, block,
                                             scale)  # fmt: skip

        same = all(torch.equal(a, b) for a, b in zip(backward(True), backward(False)))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]

        def fwd_bwd(clear, idx=idx, cnt=cnt, leaves=leaves):
            if clear:
                derived_lists.clear()
            out = vidsparse.block_sparse_attn(*leaves, idx, cnt, block_size=block)
            return torch.autograd.grad(out, leaves, do)

        variants = {
            "bwd fused": lambda: backward(True),
            "bwd two launches": lambda: backward(False),
            "fwd+bwd cached": lambda: fwd_bwd(False),
            "fwd+bwd uncached": lambda: fwd_bwd(True),
        }
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(bench(fn))
        for name, ms in times.items():
            best = min(ms)
            rows.append(dict(density=density, variant=name, ms=best, rounds=ms,
                             bit_identical=same))  # fmt: skip
            print(f"d={density} {name}: {best:.3f} ms (rounds {', '.join(f'{t:.3f}' for t in ms)})"
                  f" bit-identical={same}", flush=True)  # fmt: skip
    meta = harness.collect_metadata(torch.device("cuda"), benchmark="compare_bwd_launch")
    harness.write_results(args.out, meta, rows)


if __name__ == "__main__":
    main()
