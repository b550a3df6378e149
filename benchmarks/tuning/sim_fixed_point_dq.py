"""How precise is dQ summed in fixed point, as a function of the bits the rule gives a row?

The one-pass backward's fixed-point mode (``configs.override(one_pass="fixed")``) scales each
query row's dQ partial sums by ``2**e`` with ``2**BITS <= bound * 2**e < 2**(BITS + 1)``
(``kernels/bwd.py``: ``dq_row_bound``, ``dq_fixed_point_multiplier``; BITS is 28 there),
rounds every key block's partial to an integer and adds the integers. A rule with fewer bits
would let a kernel round without ``cvt.rni`` (an fp32 add of ``1.5 * 2**23`` rounds any value
under ``2**22`` to an integer in the mantissa), at the cost of resolution. This script models
that arithmetic in float64 on random inputs (no GPU, no kernels): dQ from the rounded
partials against the exact dQ, and both cast to the output dtype, at input scales 1, 4, 16.

    PYTHONPATH=src python benchmarks/tuning/sim_fixed_point_dq.py [--bits 28,21,20] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from vidsparse.masks.block_sparse import dense_from_lists, random_block_lists
from vidsparse.testing import rel_l2

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def random_case(seq: int, head_dim: int, block: int, density: float, scale_in: float, dtype,
                gen: torch.Generator):  # fmt: skip
    """q, k, v, do in ``dtype``'s values (held in float64) and a random block mask (the
    engine's random lists, as a token mask)."""
    q, k, v, do = (torch.randn(seq, head_dim, generator=gen, dtype=torch.float64)
                   for _ in range(4))  # fmt: skip
    q = q * scale_in
    q, k, v, do = (t.to(dtype).double() for t in (q, k, v, do))
    blocks = seq // block
    lists = random_block_lists(1, 1, blocks, blocks, density=density, generator=gen)
    keep = dense_from_lists(*lists, blocks)[0, 0]
    return q, k, v, do, keep.repeat_interleave(block, 0).repeat_interleave(block, 1)


def fixed_point_dq(q, k, v, do, mask, block: int, bits: int, dtype):
    """``(exact dq, fixed-point dq)``, float64: ``dq = scale * sum_j dS_ij k_j``, the second
    from each key block's partial (rounded to fp32, as a kernel holds it) scaled by the row's
    multiplier, rounded to an integer, summed, and divided back."""
    scale = q.shape[-1] ** -0.5
    s = (q @ k.T * scale).masked_fill(~mask, -math.inf)
    p = torch.softmax(s, dim=-1)
    o = (p @ v).to(dtype).double()  # the forward's stored output
    delta = (o * do).sum(-1, keepdim=True)
    ds = p * (do @ v.T - delta)
    exact = scale * ds @ k
    bound = scale * (do.norm(dim=1) * v.norm(dim=1).max() + delta.abs()[:, 0]) * k.abs().max()
    multiplier = torch.exp2(torch.floor(torch.log2(2.0**bits / bound)))
    total = torch.zeros_like(exact)
    for start in range(0, k.shape[0], block):
        keys = slice(start, start + block)
        partial = (scale * ds[:, keys] @ k[keys]).float().double()
        total += torch.round(partial * multiplier[:, None])
    return exact, total / multiplier[:, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="28,21,20", help="the rule's BITS, comma-separated")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--out", help="JSON rows")
    args = ap.parse_args()
    rows = []
    print(f"{'dtype':5s} {'scale':>5s} {'bits':>4s} {'fixed rel L2':>12s} "
          f"{'fixed, cast':>11s} {'cast only':>9s} {'ratio':>6s}")  # fmt: skip
    for name, dtype in DTYPES.items():
        for scale_in in (1, 4, 16):
            gen = torch.Generator().manual_seed(scale_in)
            case = random_case(args.seq, 128, 128, args.density, scale_in, dtype, gen)
            for bits in (int(b) for b in args.bits.split(",")):
                exact, fixed = fixed_point_dq(*case, block=128, bits=bits, dtype=dtype)
                cast = rel_l2(exact.to(dtype).double(), exact)
                row = dict(dtype=name, scale=scale_in, bits=bits, fixed=rel_l2(fixed, exact),
                           fixed_cast=rel_l2(fixed.to(dtype).double(), exact),
                           cast_only=cast)  # fmt: skip
                rows.append(row)
                print(f"{name:5s} {scale_in:5d} {bits:4d} {row['fixed']:12.2e} "
                      f"{row['fixed_cast']:11.2e} {cast:9.2e} "
                      f"{row['fixed_cast'] / cast:6.2f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seq": args.seq, "density": args.density, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
