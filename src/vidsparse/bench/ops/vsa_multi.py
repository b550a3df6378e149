"""VSA beyond one grid, at real sizes: a KV cache, a packed batch, and tiles of 64/128/256.

Three cases (Wan 2.1 1.3B's 12 heads of 128, bf16, B = 1, sparsity 0.875, fwd and fwd+bwd):

- ``kv-cache``: queries of the last 4 latent frames of a 480p video (4 x 30 x 52 tokens) over
  a cache of all 21 frames (21 x 30 x 52) with ``kv_grid``; ``ours`` against cuDNN dense on
  the same q, k, v (speedup = cudnn ms / ours ms), with the cache in natural order and kept
  in tile order, each timed eagerly and from a CUDA graph (both timers for cuDNN too).
- ``packed``: a 480p (21 x 30 x 52), a 720p (21 x 45 x 80) and a 2-second 480p clip
  (9 x 30 x 52) in one call (``grid=[...]``, no padding between them) against the sum of
  the three run alone (``ratio`` = packed ms / sum of alone ms; the goal is <= 1.05).
- ``tiles``: the 480p layer in tiles of 64 (4x4x4), 128 (4x4x8) and 256 (4x8x8) tokens,
  each against cuDNN dense (a tile whose config does not run on this GPU is a row with its
  error).

Run on a GPU::

    python -m vidsparse.bench vsa_multi [--cases kv-cache,packed,tiles] [--modes fwd]
    VIDSPARSE_BACKEND=torch python -m vidsparse.bench vsa_multi --device cpu --tiny
"""

from __future__ import annotations

import argparse
import os

import torch

from vidsparse.bench import harness, registry
from vidsparse.bench.harness import Column, Provider
from vidsparse.bench.sdpa import dense_sdpa

PROVIDERS = ("ours", "cudnn")
CASES = ("kv-cache", "packed", "tiles")
HEADS, HEAD_DIM, SPARSITY = 12, 128, 0.875
GRIDS = {
    "480p": (21, 30, 52),
    "720p": (21, 45, 80),
    "480p-2s": (9, 30, 52),
    "480p-last4": (4, 30, 52),
}
TILES = {"64": (4, 4, 4), "128": (4, 4, 8), "256": (4, 8, 8)}
TINY_GRIDS = {"480p": (5, 6, 7), "720p": (4, 8, 8), "480p-2s": (3, 5, 9), "480p-last4": (1, 6, 7)}

COLUMNS = [
    Column("case", "case"),
    Column("variant", "variant"),
    Column("mode", "mode"),
    Column("provider", "provider"),
    Column("ms", "ms", ".3f"),
    Column("speedup", "vs cuDNN", ".2f"),
    Column("ratio", "packed / alone", ".3f"),
]


def make_inputs(grids, heads, head_dim, device, dtype, seed, kv_grids=None):
    """q (and gate) over ``grids``, k and v over ``kv_grids`` (default the same), natural
    order, the videos one after the other."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q_len = sum(g.num_tokens for g in grids)
    kv_len = sum(g.num_tokens for g in (kv_grids or grids))

    def randn(n):
        return torch.randn(1, heads, n, head_dim, device=device, dtype=dtype, generator=gen)

    return randn(q_len), randn(kv_len), randn(kv_len), randn(q_len)


def _ours(grids, kv_grids=None, topk=None):
    import vidsparse

    grid = grids if len(grids) > 1 else grids[0]

    def forward(q, k, v, gate):
        return vidsparse.video_sparse_attn(
            q, k, v, grid, kv_grid=kv_grids, gate=gate, sparsity=None if topk else SPARSITY,
            topk=topk,
        )  # fmt: skip

    return forward


def _time(name, fn, leaves, mode, device) -> dict:
    provider = Provider(name, lambda _case: harness.mode_callable(fn, leaves, mode), name)
    return harness.run_case(provider, None, device=device, flops=None, row={})


def _row(case, variant, mode, provider, timed) -> dict:
    return {"case": case, "variant": variant, "mode": mode, "provider": provider, **timed}


def _speedup(reference: dict, row: dict):
    ref_ms, ms = reference.get("ms"), row.get("ms")
    return ref_ms / ms if ref_ms and ms else None


def _cached_tiles(grid, kv_grid, topk=None):
    """VSA over a KV cache kept in tile order (as a streaming model keeps it: a chunk of 4
    latent frames appends whole time tiles): the chunk's q and gate are tiled and its output
    untiled inside the timed call, the cache is not."""
    import vidsparse

    def forward(q, k_t, v_t, gate):
        o_t = vidsparse.video_sparse_attn(
            grid.tile(q), k_t, v_t, grid, kv_grid=kv_grid, gate=grid.tile(gate), tiled=True,
            sparsity=None if topk else SPARSITY, topk=topk,
        )  # fmt: skip
        return grid.untile(o_t)

    return forward


def _time_graphed(fn, leaves, mode, device) -> dict:
    """``ms`` of ``fn`` in ``mode`` replayed from a CUDA graph (``harness.time_graph_ms``: the
    GPU time, without the host's launch work), or its error."""
    try:
        ms, timer = harness.time_graph_ms(harness.mode_callable(fn, leaves, mode), device=device)
        return {"ms": ms, "timer": timer}
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return {"error": harness.error_message(exc)}
    finally:
        harness.release_memory(device)


def bench_kv_cache(args, device, dtype) -> list[dict]:
    """The chunk's queries over the cache: natural order (the cache tiled on every call) and
    a tile-order cache, each timed eagerly (the host's work per call included) and from a
    CUDA graph (the kernels' GPU time; what a compiled streaming model or a long stream of
    layers sees), against cuDNN dense timed the same way."""
    from vidsparse.layout.grid import VideoGrid

    grid, kv_grid = VideoGrid(args.grids["480p-last4"]), VideoGrid(args.grids["480p"])
    q, k, v, gate = make_inputs([grid], HEADS, args.head_dim, device, dtype, args.seed, [kv_grid])
    k_t, v_t = (kv_grid.tile(x.detach()).requires_grad_() for x in (k, v))
    variants = {
        "natural order": (_ours([grid], [kv_grid]), (q, k, v, gate)),
        "tile-order cache": (_cached_tiles(grid, kv_grid), (q, k_t, v_t, gate)),
    }
    rows = []
    for mode in args.modes:
        for timer in ("eager", "cuda-graph"):
            dense_fn = dense_sdpa("cudnn", device)
            dense = _row("kv-cache", f"4 of 21 frames, {timer}", mode, "cudnn",
                         _kv_time("cudnn", dense_fn, (q, k, v), mode, device, timer))  # fmt: skip
            rows.append(dense)
            for layout, (fn, leaves) in variants.items():
                ours = _row("kv-cache", f"4 of 21 frames, {layout}, {timer}", mode, "ours",
                            _kv_time("ours", fn, leaves, mode, device, timer))  # fmt: skip
                ours["speedup"] = _speedup(dense, ours)
                rows.append(ours)
            _report(rows[-1 - len(variants) :])
    return rows


def _kv_time(name, fn, leaves, mode, device, timer) -> dict:
    if timer == "eager" or device.type != "cuda":
        return _time(name, fn, leaves, mode, device)
    return _time_graphed(fn, leaves, mode, device)


def bench_packed(args, device, dtype) -> list[dict]:
    from vidsparse.layout.grid import VideoGrid

    grids = [VideoGrid(args.grids[n]) for n in ("480p", "720p", "480p-2s")]
    q, k, v, gate = make_inputs(grids, HEADS, args.head_dim, device, dtype, args.seed)
    rows = []
    for mode in args.modes:
        packed = _row("packed", "480p+720p+480p-2s", mode, "ours",
                      _time("ours", _ours(grids), (q, k, v, gate), mode, device))  # fmt: skip
        alone, start = [], 0
        for name, g in zip(("480p", "720p", "480p-2s"), grids):
            sl = slice(start, start + g.num_tokens)
            start += g.num_tokens
            leaves = tuple(x[:, :, sl].detach().clone() for x in (q, k, v, gate))
            alone.append(_row("packed", f"{name} alone", mode, "ours",
                              _time("ours", _ours([g]), leaves, mode, device)))  # fmt: skip
        total = [r.get("ms") for r in alone]
        if all(total) and packed.get("ms"):
            packed["ratio"] = packed["ms"] / sum(total)
        rows += [packed, *alone]
        _report(rows[-4:])
    return rows


def bench_tiles(args, device, dtype) -> list[dict]:
    from vidsparse.layout.grid import VideoGrid

    shape = args.grids["480p"]
    q, k, v, gate = make_inputs([VideoGrid(shape)], HEADS, args.head_dim, device, dtype, args.seed)
    rows = []
    for mode in args.modes:
        dense_fn = dense_sdpa("cudnn", device)
        dense = _row("tiles", "dense", mode, "cudnn",
                     _time("cudnn", dense_fn, (q, k, v), mode, device))  # fmt: skip
        rows.append(dense)
        for name, tile in TILES.items():
            grid = VideoGrid(shape, tile)
            row = _row("tiles", f"tile {name} {tile}", mode, "ours",
                       _time("ours", _ours([grid]), (q, k, v, gate), mode, device))  # fmt: skip
            row["speedup"] = _speedup(dense, row)
            rows.append(row)
        _report(rows[-1 - len(TILES) :])
    return rows


def _report(rows):
    for row in rows:
        what = f"vsa_multi {row['case']} {row['variant']} {row['mode']} {row['provider']}"
        result = f"ERROR {row['error']}" if row.get("error") else f"{row['ms']:.3f} ms"
        print(f"{what}: {result}", flush=True)


BENCHES = {"kv-cache": bench_kv_cache, "packed": bench_packed, "tiles": bench_tiles}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    ap.add_argument("--modes", default="fwd,fwd+bwd", help="comma list of fwd, bwd, fwd+bwd")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny grids (CPU smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default results/vsa_multi_<gpu>.json)")
    args = ap.parse_args(argv)
    args.cases = harness.split_choices(args.cases, CASES, "case")
    args.modes = harness.split_choices(args.modes, harness.MODES, "mode")
    args.grids = TINY_GRIDS if args.tiny else GRIDS
    args.head_dim = 16 if args.tiny else HEAD_DIM
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("VIDSPARSE_BACKEND", "torch")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        registry.require("vsa_multi", "cudnn", device)
    rows: list[dict] = []
    for case in args.cases:
        rows += BENCHES[case](args, device, dtype)
        harness.release_memory(device)
    meta = harness.collect_metadata(
        device, benchmark="vsa_multi", dtype=str(dtype), tiny=args.tiny, heads=HEADS,
        head_dim=args.head_dim, sparsity=SPARSITY, grids=args.grids, tiles=TILES,
        cases=args.cases, modes=args.modes,
        speedup="cudnn ms / ours ms, the same q, k, v (and gate for ours), same mode",
        ratio="packed ms / sum of the videos' ms run alone, same mode",
        inputs="natural order, with a gate",
    )  # fmt: skip
    out = args.out or harness.results_dir() / f"vsa_multi_{harness.slug(meta['gpu'])}.json"
    harness.report_results(out, meta, rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
