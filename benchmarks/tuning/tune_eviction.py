"""Eviction hints on the current GPU: each engine kernel's table config against the same config
with the AMD anchors' hints, in one run (feeds the NVIDIA rows of configs.py).

    PYTHONPATH=src python benchmarks/tuning/tune_eviction.py --out eviction.json

Hints reach pointer loads only (Triton's tensor-descriptor loads take none), so each case runs
the pointer kernels, with the config the library falls back to where inputs do not allow TMA
(``KernelConfig.for_inputs(False, ...)``: unaligned strides, padding not vouched finite).
Cases: B=1, H=12, S=32768, D=128, bf16, random per-head lists of density 1/8 at 128x128 and
128x64, and VSA's padded 64-token tiles at Wan 2.1 1.3B 480p (key-block sizes). Per case and
kernel (forward; backward as a whole, the variant in both gradient kernels): the table's hints
(none on NVIDIA), ``evict_first`` on the streamed tiles, ``evict_last`` on the resident ones,
and both; each timed twice, alternating with the table's config, and the outputs checked
bit-identical to it (a hint changes no arithmetic).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
import triton

from vidsparse.bench import harness
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd
from vidsparse.utils.device import target_of

VARIANTS = {
    "table": {},
    "streamed evict_first": {"evict_streamed": "evict_first"},
    "resident evict_last": {"evict_resident": "evict_last"},
    "both": {"evict_streamed": "evict_first", "evict_resident": "evict_last"},
}
ROUNDS = 2
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
H, D, S = 12, 128, 32768


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def cases():
    from vidsparse.layout import VideoGrid

    gen = torch.Generator("cuda").manual_seed(0)
    for bq, bk in ((128, 128), (128, 64)):
        idx, cnt = random_block_lists(
            1, H, S // bq, S // bk, density=0.125, generator=gen, device="cuda"
        )
        yield f"S{S} {bq}x{bk}", S, idx, cnt, None, (bq, bk)
    grid = VideoGrid((21, 30, 52))
    n = grid.num_tiles
    idx, cnt = random_block_lists(1, H, n, n, count=78, generator=gen, device="cuda")
    yield "VSA 480p 64x64 masked", grid.padded_len, idx, cnt, grid.tile_sizes_on("cuda"), (64, 64)


def pointer_configs(target, block, masked):
    """The table's configs as the pointer kernels run them (no TMA, no Gluon)."""
    bq, bk = block
    with configs.tuning_file.suspended():
        table = {k: configs.lookup(target, k, bq, bk, D, masked) for k in KERNELS}
    return {k: cfg.for_inputs(False, bq)[0] for k, cfg in table.items()}


def run_case(name, length, idx, cnt, sizes, block) -> list[dict]:
    bq, bk = block
    q, k, v, do = (
        torch.randn(1, H, length, D, device="cuda", dtype=torch.bfloat16) for _ in "qkvo"
    )
    args = (idx, cnt, sizes, bq, bk, D**-0.5)
    base = pointer_configs(target_of(q.device), block, sizes is not None)

    def forward(cfg):
        with configs.override(fwd=cfg):
            return block_sparse_attn_fwd(q, k, v, *args)

    o, lse = forward(base["fwd"])

    def backward(dkdv, dq):
        with configs.override(bwd_dkdv=dkdv, bwd_dq=dq):
            return block_sparse_attn_bwd(do, q, k, v, o, lse, *args)

    rows = []
    for variant, hints in VARIANTS.items():
        fwd_cfg = replace(base["fwd"], **hints)
        bwd_cfgs = (replace(base["bwd_dkdv"], **hints), replace(base["bwd_dq"], **hints))
        for kernel, fn, ref in (
            ("fwd", lambda c=fwd_cfg: forward(c), lambda: forward(base["fwd"])),
            ("bwd", lambda c=bwd_cfgs: backward(*c),
             lambda: backward(base["bwd_dkdv"], base["bwd_dq"])),
        ):  # fmt: skip
            same = all(torch.equal(a, b) for a, b in zip(fn(), ref()))
            times = {"ms": [], "table_ms": []}
            for _ in range(ROUNDS):
                times["table_ms"].append(bench(ref))
                times["ms"].append(bench(fn))
            row = {"case": name, "kernel": kernel, "variant": variant, "bit_identical": same,
                   **{k: sum(v) / len(v) for k, v in times.items()}, "rounds": times}  # fmt: skip
            row["speedup"] = row["table_ms"] / row["ms"]
            ratio = f"{row['ms']:.3f} ms vs table {row['table_ms']:.3f} ({row['speedup']:.3f}x)"
            print(f"{name} {kernel} {variant}: {ratio} identical={same}", flush=True)
            rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="eviction.json")
    args = ap.parse_args(argv)
    rows = []
    for case in cases():
        rows += run_case(*case)
        torch.cuda.empty_cache()
    meta = harness.collect_metadata(
        torch.device("cuda"), benchmark="tune_eviction", heads=H, head_dim=D, rounds=ROUNDS,
        inputs="bf16, contiguous; the pointer kernels' configs (for_inputs without TMA)",
        speedup="table ms / variant ms, alternating in one run",
    )  # fmt: skip
    harness.write_results(args.out, meta, rows)
    print(json.dumps({"wrote": args.out}))


if __name__ == "__main__":
    main()
