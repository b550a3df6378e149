"""Sweep configs of VSA's coarse attention + top-k kernel on the current GPU (feeds
``coarse_configs.py``).

    PYTHONPATH=src python benchmarks/tuning/tune_vsa_coarse.py --out tune_coarse.json

Times ``coarse_attn_topk_fwd`` on pooled tile means at Wan 1.3B 480p (624 tiles, 12 heads,
top-78) and Wan 14B 720p (1,440 tiles, 40 heads, top-180); every config's lists must equal
those of the library's default config (same selection, only the launch differs).
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch
import triton

from vidsparse.bench import harness
from vidsparse.ops.video_sparse_attn.coarse import coarse_attn_topk_fwd
from vidsparse.ops.video_sparse_attn.configs import coarse_attn_config
from vidsparse.utils.device import target_of

SHAPES = {"wan1.3b-480p": (624, 12, 78), "wan14b-720p": (1440, 40, 180)}


def sweep_pool(rows):
    """The pooling kernel (q, k, v tile means in one launch) on real tile-order inputs: tiles
    per program and warps; every config's means must match the library config's to fp32
    rounding (the reduction order differs)."""
    from vidsparse import VideoGrid
    from vidsparse.ops.video_sparse_attn.coarse import tile_mean_pool_fwd
    from vidsparse.ops.video_sparse_attn.configs import PoolConfig, pool_config

    for name, (shape, heads) in POOL_SHAPES.items():
        grid = VideoGrid(shape)
        x = [torch.randn(1, heads, grid.padded_len, 128, device="cuda", dtype=torch.bfloat16)
             for _ in range(3)]  # fmt: skip
        sizes = grid.tile_sizes_on("cuda")
        base = pool_config(target_of(x[0].device), 128)
        ref = tile_mean_pool_fwd(*x, sizes, base)
        configs = [base] + [
            PoolConfig(tiles_per_program=t, num_warps=w, num_stages=s)
            for t, w, s in itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2))
        ]
        for cfg in configs:
            # another reduction order rounds differently: compare to fp32 precision
            diff = (tile_mean_pool_fwd(*x, sizes, cfg) - ref).abs().max().item()
            same = diff <= 1e-6 * ref.abs().max().item()
            ms = triton.testing.do_bench(
                lambda: tile_mean_pool_fwd(*x, sizes, cfg), warmup=10, rep=50,
                return_mode="median",
            )  # fmt: skip
            rows.append(dict(shape=name, kernel="pool", cfg=repr(cfg), ms=ms, same_means=same))
            print(
                f"pool {name} t={cfg.tiles_per_program} w={cfg.num_warps} s={cfg.num_stages}"
                f"{' (library)' if cfg is base else ''}: {ms * 1e3:.1f} us same={same}",
                flush=True,
            )


POOL_SHAPES = {"wan1.3b-480p": ((21, 30, 52), 12), "wan14b-720p": ((21, 45, 80), 40)}


def pooled_random_tokens(name: str):
    """``(qc, kc, vc)`` fp32 ``[1, H, Nt, 128]``: the pooling kernel's tile means of random
    bf16 tokens on shape ``name``'s grid, seeded as ``bench_vsa.make_inputs``."""
    from vidsparse import VideoGrid
    from vidsparse.ops.video_sparse_attn.coarse import tile_mean_pool_fwd

    shape, heads = POOL_SHAPES[name]
    grid = VideoGrid(shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tiled = [
        grid.tile(
            torch.randn(1, heads, grid.num_tokens, 128, device="cuda", dtype=torch.bfloat16,
                        generator=gen),
            dim=-2,
        ).contiguous()
        for _ in range(3)
    ]  # fmt: skip
    pooled = tile_mean_pool_fwd(*tiled, grid.tile_sizes_on("cuda"))
    return pooled[0], pooled[1], pooled[2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tune_coarse.json")
    ap.add_argument("--pool", action="store_true", help="only the pooling kernel")
    ap.add_argument(
        "--pooled",
        action="store_true",
        help="tile means of random tokens on the real grid, as bench_vsa's inputs give (partial"
        " tiles average fewer tokens, so their means spread wider), instead of i.i.d. means",
    )
    ap.add_argument(
        "--selection",
        action="store_true",
        help="selection knobs at the library's block shape: pivots per pass, bracket capacity,"
        " packed or per-pivot counts (records the passes each config runs)",
    )
    ap.add_argument(
        "--launch",
        action="store_true",
        help="launch knobs at the library's selection settings: block_m, block_n, warps, stages",
    )
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES)
    )
    args = ap.parse_args(argv)
    rows = []
    if args.pool:
        sweep_pool(rows)
        return _write(args.out, rows)
    for name in args.shapes.split(","):
        tiles, heads, topk = SHAPES[name]
        if args.pooled:
            qc, kc, vc = pooled_random_tokens(name)
        else:
            gen = torch.Generator(device="cuda").manual_seed(0)
            # means of 64 random unit-variance tokens: std 1/8
            qc, kc, vc = (
                torch.randn(1, heads, tiles, 128, device="cuda", generator=gen) / 8
                for _ in range(3)
            )
        base = coarse_attn_config(target_of(qc.device), 128, tiles)
        _, ref_idx, _ = coarse_attn_topk_fwd(qc, kc, vc, topk, 128**-0.5, base)
        ref_sets = ref_idx.sort(-1).values
        if args.selection:
            # packed: all pivots of a pass counted with one or two row reductions (4 or 8
            # pivots), against one reduction per pivot
            configs = [base] + [
                replace(base, num_pivots=p, bracket_capacity=c, packed_counts=packed)
                for p, c, packed in ((8, 128, True), (8, 128, False), (4, 128, True),
                                     (4, 128, False), (2, 128, False), (16, 128, False),
                                     (4, 256, True), (8, 256, True))
            ]  # fmt: skip
        elif args.launch:
            configs = [base] + [
                replace(base, block_m=m, block_n=n, num_warps=w, num_stages=s)
                for m, n, w, s in itertools.product((32,), (32, 64, 128), (4, 8), (2, 3, 4))
            ]
        else:
            configs = [base] + [
                replace(base, block_m=m, block_n=n, num_warps=w, num_pivots=p)
                for m, n, w, p in itertools.product((16, 32), (64, 128), (4, 8), (8,))
            ]
        for cfg in configs:
            try:
                _, idx, _, passes = coarse_attn_topk_fwd(
                    qc, kc, vc, topk, 128**-0.5, cfg, record_passes=True
                )
                same = bool(torch.equal(idx.sort(-1).values, ref_sets))
                passes = passes.float()
                ms = triton.testing.do_bench(
                    lambda: coarse_attn_topk_fwd(qc, kc, vc, topk, 128**-0.5, cfg),
                    warmup=10,
                    rep=50,
                    return_mode="median",
                )
            except Exception as e:  # noqa: BLE001 - a config that fails is reported and skipped
                print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            passes_mean, passes_max = passes.mean().item(), passes.max().item()
            rows.append(
                dict(
                    shape=name,
                    cfg=repr(cfg),
                    ms=ms,
                    same_selection=same,
                    passes_mean=passes_mean,
                    passes_max=passes_max,
                )
            )
            print(
                f"{name} m={cfg.block_m} n={cfg.block_n} w={cfg.num_warps} p={cfg.num_pivots}"
                f" cap={cfg.bracket_capacity} s={cfg.num_stages} packed={cfg.packed_counts}"
                f"{' (library)' if cfg is base else ''}: {ms * 1e3:.1f} us same={same}"
                f" passes {passes_mean:.2f} (max {passes_max:.0f})",
                flush=True,
            )
    _write(args.out, rows)


def _write(out, rows):
    """The sweep's rows with the run's metadata (GPU, versions, commit, command)."""
    meta = harness.collect_metadata(torch.device("cuda"), benchmark="tune_vsa_coarse")
    harness.write_results(out, meta, rows)


if __name__ == "__main__":
    main()
