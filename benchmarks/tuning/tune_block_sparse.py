"""Sweep launch configs of the block-sparse kernels on the current GPU (feeds configs.py).

    PYTHONPATH=src python benchmarks/tuning/tune_block_sparse.py --out tune.json

Times forward and backward of ``vidsparse`` at B=1, H=12, S=32768, D=128 (bf16) over random
per-head block lists, for each block size and each candidate config, next to cuDNN dense SDPA
measured in the same run. Prints the best config per (kernel, block size) and writes all rows.

Each candidate reaches the engine's launchers (``fwd.block_sparse_attn_fwd``,
``bwd.block_sparse_attn_bwd``) through ``configs.override(fwd=...)`` /
``override(bwd_dkdv=..., bwd_dq=...)``; ``--full-first`` toggles ``override(full_first=...)``;
VSA's gate combine runs as the engine's epilogue (``video_sparse_attn.fine.CoarseCombine``).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from vidsparse.bench import harness
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
from vidsparse.ops.block_sparse_attn.configs import KernelConfig, lookup, override
from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE
from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def fwd_with(cfg, *args, **kwargs):
    """``block_sparse_attn_fwd(*args, **kwargs)`` with ``cfg`` in place of the table's."""
    with override(fwd=cfg):
        return block_sparse_attn_fwd(*args, **kwargs)


def bwd_with(dkdv, dq, *args, **kwargs):
    """``block_sparse_attn_bwd(*args, **kwargs)`` with these dK/dV and dQ configs."""
    with override(bwd_dkdv=dkdv, bwd_dq=dq):
        return block_sparse_attn_bwd(*args, **kwargs)


def tflops(ms, B, H, S, D, density, factor=1.0):
    return 4 * B * H * S * S * D * density * factor / (ms * 1e-3) / 1e12


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--out", default="tune.json")
    ap.add_argument(
        "--masked",
        action="store_true",
        help="only the forward variants on padded tiles (VSA and PSA shapes)",
    )
    ap.add_argument(
        "--bwd-tma",
        action="store_true",
        help="only the backward kernels with and without TMA loads (engine and VSA shapes)",
    )
    ap.add_argument(
        "--full-first",
        action="store_true",
        help="only the masked forward with and without the full-blocks-first walk (VSA, PSA)",
    )
    args = ap.parse_args(argv)
    if args.full_first:
        return compare_full_first(args.out)
    if args.bwd_tma:
        return sweep_backward_tma(args.out)
    if args.masked:
        return sweep_masked_forward(args.out)
    B, H, S, D = 1, args.heads, args.seq, 128
    dev = "cuda"
    q, k, v, do = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    scale = D**-0.5
    rows = []

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    rows.append(dict(kernel="cudnn_fwd", ms=ms, tflops=tflops(ms, B, H, S, D, 1.0)))
    print(f"cudnn dense fwd {ms:.2f} ms {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg)
        ms = bench(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
    rows.append(dict(kernel="cudnn_bwd", ms=ms, tflops=tflops(ms, B, H, S, D, 1.0, 2.5)))
    print(f"cudnn dense bwd {ms:.2f} ms {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)

    blocks = [(128, 128), (128, 64), (64, 64)]
    fwd_cfgs = [
        KernelConfig(w, s, use_tma=t)
        for w, s, t in itertools.product((4, 8), (2, 3, 4), (False, True))
    ]
    for bq, bk in blocks:
        NQ, NK = S // bq, S // bk
        lists = {
            d: random_block_lists(1, H, NQ, NK, density=d, device=dev) for d in (1.0, 0.125, 0.0625)
        }
        best = None
        for cfg in fwd_cfgs:
            if bq * bk < 128 * 128 and cfg.num_warps == 8 and bq == 64:
                continue
            idx, cnt = lists[0.125]
            try:
                ms = bench(lambda: fwd_with(cfg, q, k, v, idx, cnt, None, bq, bk, scale))
            except Exception as e:  # out of shared memory, etc.
                print(f"fwd {bq}x{bk} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            tf = tflops(ms, B, H, S, D, 0.125)
            rows.append(
                dict(kernel="fwd", block=[bq, bk], density=0.125, cfg=repr(cfg), ms=ms, tflops=tf)
            )
            print(
                f"fwd {bq}x{bk} d=1/8 w={cfg.num_warps} s={cfg.num_stages} tma={cfg.use_tma}:"
                f" {ms:.3f} ms {tf:.0f}",
                flush=True,
            )
            if best is None or ms < best[0]:
                best = (ms, cfg)
        cfg = best[1]
        for d in (1.0, 0.0625):
            idx, cnt = lists[d]
            ms = bench(lambda: fwd_with(cfg, q, k, v, idx, cnt, None, bq, bk, scale))
            tf = tflops(ms, B, H, S, D, d)
            rows.append(
                dict(kernel="fwd_best", block=[bq, bk], density=d, cfg=repr(cfg), ms=ms, tflops=tf)
            )
            print(f"BEST fwd {bq}x{bk} d={d} {cfg}: {ms:.3f} ms {tf:.0f}", flush=True)

        # backward: sweep one kernel's config with the other at a middle default
        idx, cnt = lists[0.125]
        o, lse = fwd_with(cfg, q, k, v, idx, cnt, None, bq, bk, scale)
        subs = [s for s in (32, 64, 128) if s <= bq]
        bwd_cands = [
            KernelConfig(w, s, sub_m=m) for w, s, m in itertools.product((4, 8), (1, 2), subs)
        ]
        default = KernelConfig(4, 2, sub_m=64)
        for which in ("dkdv", "dq"):
            best = None
            for c in bwd_cands:
                dkdv, dq = (c, default) if which == "dkdv" else (default, c)
                try:
                    ms = bench(
                        lambda: bwd_with(
                            dkdv, dq, do, q, k, v, o, lse, idx, cnt, None, bq, bk, scale
                        )
                    )
                except Exception as e:
                    print(
                        f"bwd {which} {bq}x{bk} {c}: {type(e).__name__}: {str(e)[:120]}", flush=True
                    )
                    continue
                rows.append(
                    dict(
                        kernel=f"bwd_{which}_sweep",
                        block=[bq, bk],
                        density=0.125,
                        cfg=repr(c),
                        ms=ms,
                    )
                )
                print(
                    f"bwd sweep {which} {bq}x{bk} w={c.num_warps} s={c.num_stages} sub={c.sub_m}:"
                    f" {ms:.3f} ms",
                    flush=True,
                )
                if best is None or ms < best[0]:
                    best = (ms, c)
            rows.append(
                dict(kernel=f"bwd_{which}_best", block=[bq, bk], cfg=repr(best[1]), ms=best[0])
            )
            print(f"BEST bwd {which} {bq}x{bk}: {best[1]} {best[0]:.3f} ms", flush=True)
    _write(args.out, rows)


def sweep_backward_tma(out):
    """The library's backward configs with and without TMA loads, then each kernel's TMA
    config swept (warps, step) with the other held at the library's; times of the whole backward.
    Cases: S=32768, 12 heads, density 1/8 at 128x128 and 64x64; VSA's padded 64-token tiles at
    Wan 1.3B 480p (top-78, padding vouched finite)."""
    from dataclasses import replace

    from vidsparse.layout import VideoGrid
    from vidsparse.utils.device import target_of

    D, H = 128, 12
    rows = []
    cases = []
    S = 32768
    for block in (128, 64):
        n = S // block
        idx, cnt = random_block_lists(1, H, n, n, density=0.125, device="cuda")
        cases.append((f"S32k_{block}_d0.125", S, block, idx, cnt, None))
    grid = VideoGrid((21, 30, 52))
    sizes = grid.tile_sizes_on("cuda").to(torch.int32)
    idx, cnt = random_block_lists(1, H, grid.num_tiles, grid.num_tiles, count=78, device="cuda")
    cases.append(("vsa480p_64", grid.padded_len, 64, idx, cnt, sizes))
    for label, S_, block, idx, cnt, sizes in cases:
        q, k, v, do = (
            torch.randn(1, H, S_, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, block, block, D**-0.5,
                                       padding_finite=True)  # fmt: skip
        masked = sizes is not None
        library = {
            which: lookup(target_of(q.device), f"bwd_{which}", block, block, D, masked)
            for which in ("dkdv", "dq")
        }

        def run(cfgs):
            return bwd_with(
                cfgs["dkdv"], cfgs["dq"], do, q, k, v, o, lse, idx, cnt, sizes, block, block,
                D**-0.5, padding_finite=True,
            )  # fmt: skip

        ref = run(library)
        pointer = {which: cfg.for_inputs(False, block)[0] for which, cfg in library.items()}
        for name, cfgs in (("library", library), ("library_pointer_loads", pointer)):
            ms = bench(lambda: run(cfgs))
            rows.append(dict(case=label, kernel=name, cfg=repr(cfgs), ms=ms))
            print(f"{label} {name} {cfgs}: {ms:.3f} ms", flush=True)
        for which in ("dkdv", "dq"):
            base = library[which]
            for w, st, m in itertools.product((4, 8), (2,), (32, 64, 128)):
                if m > block:
                    continue
                cfg = replace(base, num_warps=w, num_stages=st, sub_m=m, use_tma=True)
                cfgs = dict(library)
                cfgs[which] = cfg
                try:
                    got = run(cfgs)
                    err = max(((g.float() - r.float()).norm() / r.float().norm()).item()
                              for g, r in zip(got, ref))  # fmt: skip
                    ms = bench(lambda: run(cfgs))
                except Exception as e:  # noqa: BLE001 - a config that fails is reported
                    print(f"{label} {which} {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                rows.append(dict(case=label, kernel=which, cfg=repr(cfg), ms=ms, rel_err=err))
                print(f"{label} {which} tma w={w} s={st} sub={m}: {ms:.3f} ms err {err:.1e}",
                      flush=True)  # fmt: skip
    _write(out, rows)


def sweep_masked_forward(out):
    """Forward variants on padded tiles (keys masked by kv_block_sizes) at the methods' shapes.

    - VSA's fine stage: Wan 1.3B 480p tiled (624 tiles of 4x4x4 = 64 tokens), 12 heads,
      top-78 random lists (sparsity 0.875); also with VSA's gate combine as the engine's
      epilogue (``fine.CoarseCombine``).
    - PSA: the same grid in tiles of 1x8x16 = 128 tokens, 12 heads, density 1/4.

    Variants: pointer loads vs TMA loads (which read padding keys, so only with
    ``padding_finite``), warps and stages. (TMA with the padding values zeroed in registers,
    and a loop taking two listed key blocks per step, were measured here before and lost;
    both are gone from the kernels: see NOTES.md.)
    """
    from vidsparse.layout import VideoGrid
    from vidsparse.ops.video_sparse_attn.fine import CoarseCombine

    rows = []
    D = 128

    def sweep(label, q, k, v, idx, cnt, sizes, block, configs, work, epilogue=NO_EPILOGUE):
        def run(cfg, finite):
            return fwd_with(cfg, q, k, v, idx, cnt, sizes, block, block, D**-0.5,
                            padding_finite=finite, epilogue=epilogue)[0]  # fmt: skip

        ref = run(KernelConfig(4, 2), False).float()
        for cfg, finite in configs:
            try:
                err = ((run(cfg, finite).float() - ref).norm() / ref.norm()).item()
                ms = bench(lambda: run(cfg, finite))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
                print(f"{label} {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            tf = work / (ms * 1e-3) / 1e12
            rows.append(
                dict(
                    kernel=label,
                    cfg=repr(cfg),
                    padding_finite=finite,
                    ms=ms,
                    tflops=tf,
                    rel_err=err,
                )
            )
            print(
                f"{label} w={cfg.num_warps} s={cfg.num_stages} tma={cfg.use_tma}"
                f" finite={finite}: {ms:.3f} ms {tf:.0f} TFLOP/s"
                f" err {err:.1e}",
                flush=True,
            )

    def variants(warps, stages):
        out = [(KernelConfig(w, s), False) for w in warps for s in stages]
        out += [(KernelConfig(w, s, use_tma=True), True) for w in warps for s in stages]
        return out

    # VSA fine stage, nominal work over padded blocks
    grid = VideoGrid((21, 30, 52))
    H, S, n = 12, grid.padded_len, grid.num_tiles
    q, k, v, g = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    sizes = grid.tile_sizes_on("cuda").to(torch.int32)
    idx, cnt = random_block_lists(1, H, n, n, count=78, device="cuda")
    work = 4 * H * S * 78 * 64 * D
    sweep("vsa480p_64", q, k, v, idx, cnt, sizes, 64, variants((4,), (2, 3)), work)
    oc = torch.randn(1, H, n, D, device="cuda", dtype=torch.float32)
    sweep(
        "vsa480p_64_combined",
        q,
        k,
        v,
        idx,
        cnt,
        sizes,
        64,
        variants((4,), (2,)),
        work,
        CoarseCombine(oc, g, sizes),
    )
    # PSA, 1x8x16 tiles
    grid = VideoGrid((21, 30, 52), tile=(1, 8, 16))
    S, n = grid.padded_len, grid.num_tiles
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sizes = grid.tile_sizes_on("cuda").to(torch.int32)
    count = n // 4
    idx, cnt = random_block_lists(1, H, n, n, count=count, device="cuda")
    sweep(
        "psa480p_128",
        q,
        k,
        v,
        idx,
        cnt,
        sizes,
        128,
        variants((8,), (2, 3)),
        4 * H * S * count * 128 * D,
    )
    _write(out, rows)


def compare_full_first(out):
    """The masked forward (library configs, TMA, padding vouched finite) walking each list's
    full key blocks first and unmasked (``override(full_first=True)``, the library's way,
    lists.py) against masking every block (``override(full_first=False)``), and the same lists
    without key-block sizes (nothing masked: the bound).
    Three alternating ``do_bench`` medians each. Cases: VSA's fine stage with the gate epilogue
    (``fine.CoarseCombine``) at Wan 1.3B 480p (top-78 of 624 tiles, 12 heads) and Wan 14B
    720p (top-180 of 1,440, 40 heads); PSA-like 1x16x8 blocks at density 0.4 (480p, 12 heads)
    and 0.35 (720p, 40 heads)."""
    from vidsparse.layout import VideoGrid
    from vidsparse.ops.video_sparse_attn.fine import CoarseCombine

    D = 128
    rows = []
    cases = [  # label, grid, tile, heads, listed blocks per row, VSA epilogue
        ("vsa480p_64_combined", (21, 30, 52), (4, 4, 4), 12, 78, True),
        ("vsa720p_64_combined", (21, 45, 80), (4, 4, 4), 40, 180, True),
        ("psa480p_1x16x8_d0.4", (21, 30, 52), (1, 16, 8), 12, None, False),
        ("psa720p_1x16x8_d0.35", (21, 45, 80), (1, 16, 8), 40, None, False),
    ]
    for label, shape, tile, H, count, vsa in cases:
        grid = VideoGrid(shape, tile=tile)
        S, n, block = grid.padded_len, grid.num_tiles, grid.tile_volume
        count = count or round((0.4 if "480p" in label else 0.35) * n)
        q, k, v, g = (
            torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        sizes = grid.tile_sizes_on("cuda").to(torch.int32)
        idx, cnt = random_block_lists(1, H, n, n, count=count, device="cuda")
        oc = torch.randn(1, H, n, D, device="cuda") if vsa else None
        epilogue = CoarseCombine(oc, g, sizes) if vsa else NO_EPILOGUE

        def run(full_first, block_sizes):
            with override(full_first=full_first):
                return block_sparse_attn_fwd(q, k, v, idx, cnt, block_sizes, block, block,
                                             D**-0.5, padding_finite=True,
                                             epilogue=epilogue)  # fmt: skip

        ref = run(False, sizes)[0].float()
        err = ((run(True, sizes)[0].float() - ref).norm() / ref.norm()).item()
        variants = {"mask_every_block": (False, sizes), "full_first": (True, sizes),
                    "no_sizes_bound": (True, None)}  # fmt: skip
        times = {name: [] for name in variants}
        for _ in range(3):
            for name, (ff, bs) in variants.items():
                times[name].append(bench(lambda ff=ff, bs=bs: run(ff, bs)))
        full = int((sizes == block).sum())
        for name, ms_all in times.items():
            ms = sorted(ms_all)[1]
            rows.append(dict(case=label, variant=name, ms=ms, ms_all=ms_all, tiles=n,
                             full_tiles=full, listed=count, heads=H,
                             rel_diff_full_first=err))  # fmt: skip
            print(f"{label} {name}: {ms:.3f} ms {ms_all}", flush=True)
        print(
            f"{label}: full tiles {full}/{n}, full_first vs mask-all rel diff {err:.1e}", flush=True
        )
    _write(out, rows)


def _write(out, rows):
    """The sweep's rows with the run's metadata (GPU, versions, commit, command)."""
    meta = harness.collect_metadata(torch.device("cuda"), benchmark="tune_block_sparse")
    harness.write_results(out, meta, rows)


if __name__ == "__main__":
    sys.exit(main())
