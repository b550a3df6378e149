"""PSA benchmark: stripe attention against cuDNN dense, and the offline search's run time.

    python -m vidsparse.bench psa                       # both parts, H200
    python -m vidsparse.bench psa --part attn --shapes wan14b-720p
    python -m vidsparse.bench psa --device cpu --tiny   # CPU smoke run

attn: forward of ``vidsparse.stripe_attn`` with mixed per-head stripe specs drawn from the
default candidate family near each target sparsity (sparsity = skipped (query block, key block)
pairs of the padded block grid), per PSA block shape, against cuDNN SDPA dense on the real
tokens, in the same run.

search: wall time of ``build_loss_table`` for one layer (one calibration sample of H heads)
against the default family (about 100 candidates), on the GPU in bf16.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import vidsparse
from vidsparse.bench import harness, registry, shapes
from vidsparse.bench.harness import Column
from vidsparse.bench.sdpa import dense_sdpa
from vidsparse.search import CalibrationSample, CandidateFamily, build_loss_table

PROVIDERS = ("ours", "cudnn", "search")
# name: (latent grid, heads), from the shape registry; head_dim 128.
SHAPES = {
    name: (shapes.MODELS[name].grid, shapes.MODELS[name].heads)
    for name in registry.get("psa").shapes
}
DEFAULT_SHAPES = "wan14b-720p,hunyuan-720p"
_TINY = shapes.TINY["tiny-stripes"]
TINY = {"tiny": (_TINY.grid, _TINY.heads)}
SEARCH_SHAPE = "wan1.3b-480p"  # the search's timed layer (heads: --search-heads)
COLUMNS = [
    Column("shape", "shape"),
    Column("provider", "provider"),
    Column("tile", "block"),
    Column("target", "target", ".2f"),
    Column("sparsity", "sparsity", ".3f"),
    Column("ms", "ms", ".3f"),
    Column("speedup", "vs cuDNN", ".2f"),
]


def mixed_specs(block_grid, heads, target, rng, tolerance=0.05):
    """One block-unit spec per head, drawn from family candidates near ``target`` sparsity."""
    cands = CandidateFamily().on_grid(block_grid)
    sparsity = cands.sparsity.tolist()
    near = [i for i, s in enumerate(sparsity) if abs(s - target) <= tolerance]
    if not near:  # fall back to the closest candidates
        order = sorted(range(len(sparsity)), key=lambda i: abs(sparsity[i] - target))
        near = order[:4]
    wb = block_grid[2]
    picks = [rng.choice(near) for _ in range(heads)]
    specs = [cands[i].block_spec(wb) for i in picks]
    return specs, sum(sparsity[i] for i in picks) / heads


def time_fn(fn, device) -> float:
    return harness.time_ms(fn, device=device)


def make_inputs(grid_shape, heads: int, head_dim: int, device, dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[1, heads, T*H*W, head_dim]`` in natural token order."""
    S = grid_shape[0] * grid_shape[1] * grid_shape[2]
    return tuple(torch.randn(1, heads, S, head_dim, device=device, dtype=dtype) for _ in range(3))


def _shape_table(args) -> dict:
    if args.tiny:
        return TINY
    try:
        return {m.name: (m.grid, m.heads) for m in shapes.select(args.shapes)}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _time_dense(q, k, v, device) -> tuple[float | None, str | None]:
    """cuDNN dense ms (math backend on the CPU), or the error that stopped it."""
    try:
        registry.require("psa", "cudnn", device)
        forward = dense_sdpa("cudnn", device)
        return time_fn(lambda: forward(q, k, v), device), None
    except Exception as exc:  # noqa: BLE001 - recorded; the sparse rows still run
        return None, harness.error_message(exc)


def _time_ours(q, k, v, grid, specs, device) -> float:
    vidsparse.stripe_attn(q, k, v, grid, specs)  # build and cache the lists
    return time_fn(lambda: vidsparse.stripe_attn(q, k, v, grid, specs), device)


def bench_attention(args, device, dtype, rows):
    table = _shape_table(args)
    tiles = (
        [(1, 4, 4)]
        if args.tiny
        else [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    )
    rng = random.Random(args.seed)
    for name, (grid_shape, heads) in table.items():
        D = _TINY.head_dim if args.tiny else shapes.HEAD_DIM
        q, k, v = make_inputs(grid_shape, heads, D, device, dtype)
        S = q.shape[2]
        base = dict(shape=name, heads=heads, tokens=S, head_dim=D)
        skipped = registry.unavailable("psa", "cudnn", device)
        if skipped:  # on the CPU: no cuDNN, no dense row (and no speedups)
            registry.note_skipped(skipped)
            dense_ms, dense_error = None, None
        else:
            dense_ms, dense_error = _time_dense(q, k, v, device)
        dense_row = dict(base, provider="cudnn", tile="dense", target=0.0, sparsity=0.0)
        if skipped:
            pass
        elif dense_error:
            rows.append(dict(dense_row, error=dense_error))
            print(f"{name}: cuDNN dense ERROR {dense_error}", flush=True)
        else:
            rows.append(dict(dense_row, ms=dense_ms, speedup=1.0))
            print(f"{name}: cuDNN dense {dense_ms:.2f} ms", flush=True)
        for tile in tiles:
            grid = vidsparse.VideoGrid(grid_shape, tile=tile)
            for target in [float(x) for x in args.sparsities.split(",")]:
                specs, achieved = mixed_specs(grid.tiles, heads, target, rng)
                row = dict(
                    base,
                    provider="ours",
                    tile="x".join(map(str, tile)),
                    target=target,
                    sparsity=achieved,
                    padded_tokens=grid.padded_len,
                )
                try:
                    ms = _time_ours(q, k, v, grid, specs, device)
                    row.update(ms=ms, speedup=dense_ms / ms if dense_ms else None)
                except Exception as exc:  # record and go on
                    row.update(error=harness.error_message(exc))
                rows.append(row)
                print(
                    f"  tile {tile} target {target:.2f} achieved {achieved:.3f}:"
                    f" {row.get('ms', float('nan')):.2f} ms {row.get('speedup') or 0:.2f}x",
                    flush=True,
                )
        q = k = v = None  # free the inputs before the next shape
        harness.release_memory(device)


def bench_search(args, device, dtype, rows):
    if args.tiny:
        grid_shape, heads, D = _TINY.grid, _TINY.heads, _TINY.head_dim
    else:
        grid_shape, heads, D = shapes.MODELS[SEARCH_SHAPE].grid, args.search_heads, shapes.HEAD_DIM
    tile = (1, 4, 4) if args.tiny else tuple(int(x) for x in args.search_tile.split("x"))
    grid = vidsparse.VideoGrid(grid_shape, tile=tile)
    q, k, v = (torch.randn(heads, grid.num_tokens, D, device=device, dtype=dtype) for _ in range(3))
    sample = CalibrationSample(step=10, layer=0, q=q, k=k, v=v)
    for fraction in (1.0, 0.25):
        kwargs = dict(
            num_steps=20,
            dense_fraction=0.0,
            query_fraction=fraction,
            device=device,
            dtype=dtype,
            progress=False,
        )
        build_loss_table([sample], grid, **kwargs)  # warm-up: compilation, list caches
        harness.synchronize(device)
        start = time.perf_counter()
        table = build_loss_table([sample], grid, **kwargs)
        harness.synchronize(device)
        seconds = time.perf_counter() - start
        rows.append(
            dict(
                shape=f"search {grid_shape}",
                provider="search",
                tile="x".join(map(str, tile)),
                heads=heads,
                tokens=grid.num_tokens,
                query_fraction=fraction,
                candidates=len(table.candidates),
                seconds=seconds,
            )
        )
        print(
            f"search: {heads} heads x default family, {grid.num_tokens} tokens, query_fraction"
            f" {fraction}: {seconds:.2f} s",
            flush=True,
        )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", choices=("all", "attn", "search"), default="all")
    ap.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help=f"comma list of shape names, e.g. {list(SHAPES)}"
    )
    ap.add_argument("--tiles", default="1x16x8,1x8x16,2x8x8")
    ap.add_argument("--sparsities", default="0.6,0.75,0.9")
    ap.add_argument("--search-heads", type=int, default=40)
    ap.add_argument("--search-tile", default="2x8x8")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-plot", action="store_true", help="write no PNG beside the JSON")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[dict] = []
    if args.part in ("all", "attn"):
        bench_attention(args, device, dtype, rows)
    if args.part in ("all", "search"):
        bench_search(args, device, dtype, rows)
    meta = harness.collect_metadata(device, benchmark="psa", dtype=str(dtype), tiny=args.tiny)
    out = args.out or harness.results_dir() / f"psa_{harness.slug(meta['gpu'])}.json"
    shown = [r for r in rows if r.get("provider") != "search"]
    harness.report_results(out, meta, rows, COLUMNS, shown)
    if not args.no_plot:
        png = draw(rows, Path(out).with_suffix(".png"), harness.device_name(device))
        if png:
            print(f"wrote {png}")
    return rows


def draw(rows: list[dict], path: Path, gpu: str):
    """Speedup over cuDNN dense against achieved sparsity, a line per PSA block shape."""
    return harness.plot(
        path,
        [r for r in rows if r.get("provider") in ("ours", "cudnn")],
        x="sparsity",
        y="speedup",
        series=("tile",),
        panels=("shape",),
        reference=lambda r: r["provider"] == "cudnn",
        xlabel="sparsity (skipped block pairs of the padded block grid)",
        ylabel="speedup over cuDNN dense (forward)",
        title=f"PSA stripe_attn, {gpu}",
        logx=False,
    )


if __name__ == "__main__":
    main()
