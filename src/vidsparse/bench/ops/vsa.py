"""VSA benchmark: ``vidsparse.video_sparse_attn`` against cuDNN SDPA dense and FastVideo's VSA.

At Wan 2.1 1.3B 480p and 14B 720p (head_dim 128, bf16, B = 1), sparsities 0.875 and 0.9, fwd
and fwd+bwd: ``ours`` (tile-order inputs; its fwd row also carries the coarse/fine split),
``ours-natural`` (tiling and untiling timed too), ``cudnn`` (dense, the reference of every
speedup) and ``fastvideo`` (fastvideo-kernel 0.3.5, its Triton path). Run on a GPU
(``vidsparse bench vsa -- OPTIONS`` is the same)::

    python -m vidsparse.bench vsa                         # both shapes, H200
    python -m vidsparse.bench vsa --shapes wan1.3b-480p --modes fwd
    python -m vidsparse.bench vsa --shapes wan1.3b-480p --sparsities 0.875 --rounds 5
    VIDSPARSE_BACKEND=torch python -m vidsparse.bench vsa --device cpu --tiny   # CPU smoke run

``benchmarks/README.md`` ("VSA: vsa") describes the providers, the split and the FLOP count,
and how to install the FastVideo wheel on a GPU machine without network access.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vidsparse.bench import harness, registry, shapes
from vidsparse.bench.fastvideo import FastVideoUnavailable, load_fastvideo, require_fastvideo
from vidsparse.bench.harness import Column, Provider
from vidsparse.bench.sdpa import dense_sdpa as _pinned_sdpa

# name: (latent grid, heads), from the shape registry; head_dim 128.
SHAPES = {
    name: (shapes.MODELS[name].grid, shapes.MODELS[name].heads)
    for name in registry.get("vsa").shapes
}
_TINY = shapes.TINY["tiny-video"]  # 2x2x3 tiles of 4x4x4, partial at every edge: 300 of 768
TINY_SHAPES = {"tiny": (_TINY.grid, _TINY.heads)}
HEAD_DIM, TINY_HEAD_DIM = shapes.HEAD_DIM, _TINY.head_dim
TILE = (4, 4, 4)
ALL_PROVIDERS = ("ours", "ours-natural", "cudnn", "fastvideo")
PROVIDERS = ALL_PROVIDERS
SPARSE_PROVIDERS = ("ours", "ours-natural", "fastvideo")

COLUMNS = [
    Column("shape", "shape"),
    Column("sparsity", "sparsity", ".3f"),
    Column("topk", "topk"),
    Column("mode", "mode"),
    Column("provider", "provider"),
    Column("ms", "ms", ".3f"),
    Column("tflops", "TFLOP/s", ".0f"),
    Column("speedup", "vs cuDNN", ".2f"),
    Column("coarse_ms", "coarse ms", ".3f"),
    Column("fine_ms", "fine ms", ".3f"),
    Column("coarse_share", "coarse share", ".1%"),
]


# ---------------------------------------------------------------------------------------------
# cases and inputs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One timed measurement: a shape, a sparsity (None for dense cuDNN), a mode."""

    shape: str
    grid_shape: tuple[int, int, int]
    heads: int
    head_dim: int
    sparsity: float | None
    mode: str
    batch: int = 1

    @property
    def grid(self):
        from vidsparse import VideoGrid

        return VideoGrid(self.grid_shape, tile=TILE)

    @property
    def topk(self) -> int | None:
        if self.sparsity is None:
            return None
        return topk_for(self.grid.num_tiles, self.sparsity)


def topk_for(num_tiles: int, sparsity: float) -> int:
    """vidsparse's own rule (``resolve_topk``), so every provider keeps the same tile count."""
    from vidsparse.ops.video_sparse_attn.topk import resolve_topk

    return resolve_topk(num_tiles, sparsity=sparsity)


@dataclass
class Inputs:
    """One shape's tensors, shared by every provider, sparsity and mode (built once: at 720p
    each natural tensor is ~0.8 GB in bf16)."""

    q: torch.Tensor  # [B, H, num_tokens, D], natural order
    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor
    q_t: torch.Tensor  # [B, H, padded_len, D], tile order, padding slots zero
    k_t: torch.Tensor
    v_t: torch.Tensor
    gate_t: torch.Tensor


def make_inputs(case: Case, device: torch.device, dtype: torch.dtype, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    grid = case.grid
    shape = (case.batch, case.heads, grid.num_tokens, case.head_dim)
    q, k, v, gate = (
        torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4)
    )
    tiled = [grid.tile(x, dim=-2).contiguous() for x in (q, k, v, gate)]
    return Inputs(q, k, v, gate, *tiled)


# ---------------------------------------------------------------------------------------------
# providers: each make(case) returns the zero-argument function to time
# ---------------------------------------------------------------------------------------------


def make_providers(x: Inputs, device: torch.device) -> dict:
    """The four providers over one shape's shared inputs ``x``."""

    def ours(case):
        import vidsparse

        grid, topk = case.grid, case.topk

        def forward(q, k, v, gate):
            return vidsparse.video_sparse_attn(q, k, v, grid, topk=topk, gate=gate, tiled=True)

        return harness.mode_callable(forward, (x.q_t, x.k_t, x.v_t, x.gate_t), case.mode)

    def ours_natural(case):
        import vidsparse

        grid, topk = case.grid, case.topk

        def forward(q, k, v, gate):
            return vidsparse.video_sparse_attn(q, k, v, grid, topk=topk, gate=gate)

        return harness.mode_callable(forward, (x.q, x.k, x.v, x.gate), case.mode)

    def cudnn(case):
        return harness.mode_callable(dense_sdpa(device), (x.q, x.k, x.v), case.mode)

    def fastvideo(case):
        fv_vsa = load_fastvideo()[0]
        vbs = case.grid.tile_sizes_on(device).to(torch.int32)
        topk = case.topk

        def forward(q, k, v, gate):
            return fv_vsa(q, k, v, vbs, vbs, topk, block_size=TILE, compress_attn_weight=gate)

        return harness.mode_callable(forward, (x.q_t, x.k_t, x.v_t, x.gate_t), case.mode)

    return {
        "ours": Provider("ours", ours, "vidsparse VSA, tiled=True on pre-tiled inputs"),
        "ours-natural": Provider(
            "ours-natural", ours_natural, "vidsparse VSA on natural order (tiling timed)"
        ),
        "cudnn": Provider("cudnn", cudnn, "SDPA dense, cuDNN backend, real tokens"),
        "fastvideo": Provider("fastvideo", fastvideo, "fastvideo_kernel VSA, Triton path"),
    }


def dense_sdpa(device: torch.device) -> Callable[..., torch.Tensor]:
    """SDPA pinned to cuDNN on the GPU (a silent fallback to another backend would change the
    reference); SDPA's math backend on the CPU, where cuDNN attention does not exist."""
    registry.require("vsa", "cudnn", device)
    return _pinned_sdpa("cudnn", device)


# ---------------------------------------------------------------------------------------------
# the coarse / fine split of ours' forward
# ---------------------------------------------------------------------------------------------


SPLIT_REPEATS = 3


def time_split(case: Case, x: Inputs, device: torch.device) -> dict:
    """Forward times of VSA's two stages, each alone, on the tiled inputs.

    The fine stage is timed as VSA runs it (``vsa_fine_combined``: the engine with the gate
    combine in its epilogue) on the lists and coarse output of one coarse call, so neither
    timing includes the other. Each stage is captured in a CUDA graph and its replays timed
    (``harness.time_graph_ms``): the GPU time of its kernels. Timed eagerly and alone, the
    ~0.3 ms coarse stage sits at the edge of being bound by its ~0.17-0.25 ms of host work per
    call (Python checks, custom-op dispatch, two launches) plus do_bench's cache flush, and
    came out 0.29-0.44 ms from run to run; inside VSA's forward the host runs ahead of the GPU
    and that work is hidden. Each figure is the median of ``SPLIT_REPEATS`` alternating
    timings; the single timings are kept as ``coarse_ms_all`` and ``fine_ms_all``, the method
    as ``split_timer``.
    Returns ``coarse_ms``, ``fine_ms`` or a ``split_error``.
    """
    try:
        from vidsparse.ops.video_sparse_attn.coarse import vsa_coarse_stage
        from vidsparse.ops.video_sparse_attn.fine import vsa_fine_combined
    except ImportError as exc:  # the coarse stage imports Triton; a CPU box may lack it
        return {"split_error": f"split skipped: {harness.error_message(exc)}"}
    grid, topk = case.grid, case.topk
    scale = 1.0 / math.sqrt(case.head_dim)
    sizes = grid.tile_sizes_on(device).to(torch.int32)

    def coarse():
        return vsa_coarse_stage(x.q_t, x.k_t, x.v_t, grid, topk, scale)

    try:
        with torch.no_grad():
            o_coarse, kv_indices, kv_counts = coarse()

            def fine():
                return vsa_fine_combined(
                    x.q_t, x.k_t, x.v_t, kv_indices, kv_counts, sizes, o_coarse, x.gate_t,
                    sizes, grid.tile_volume, scale,
                )  # fmt: skip

            times: dict[str, list[float]] = {"coarse_ms": [], "fine_ms": []}
            how = set()
            for _ in range(SPLIT_REPEATS):
                for name, fn in (("coarse_ms", coarse), ("fine_ms", fine)):
                    ms, timer = harness.time_graph_ms(fn, device=device)
                    times[name].append(ms)
                    how.add(timer)
            split: dict = {name: statistics.median(ts) for name, ts in times.items()}
            split.update({f"{name}_all": ts for name, ts in times.items()})
            split["split_timer"] = ", ".join(sorted(how))
            return split
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return {"split_error": harness.error_message(exc)}
    finally:
        harness.release_memory(device)


# ---------------------------------------------------------------------------------------------
# running the cases
# ---------------------------------------------------------------------------------------------


def base_row(case: Case, provider: str) -> dict:
    grid = case.grid
    row = dict(
        shape=case.shape,
        grid="x".join(map(str, case.grid_shape)),
        batch=case.batch,
        heads=case.heads,
        head_dim=case.head_dim,
        tokens=grid.num_tokens,
        padded_tokens=grid.padded_len,
        num_tiles=grid.num_tiles,
        sparsity=case.sparsity,
        topk=case.topk,
        mode=case.mode,
        provider=provider,
    )
    return row


def attended_pairs(case: Case) -> float:
    """Real (query, key) pairs: all of them for dense, the nominal ``topk / num_tiles`` share
    for sparse providers (the selected tiles' real sizes vary at the grid's edges)."""
    dense = harness.dense_pairs(case.batch, case.heads, case.grid.num_tokens, case.grid.num_tokens)
    return dense if case.topk is None else dense * case.topk / case.grid.num_tiles


def run_one(provider: Provider, case: Case, device: torch.device) -> dict:
    row = base_row(case, provider.name)
    if provider.name == "fastvideo":
        try:
            require_fastvideo()
        except FastVideoUnavailable as exc:
            return dict(row, error=str(exc))
    flops = harness.attention_flops(attended_pairs(case), case.head_dim, case.mode)
    return harness.run_case(provider, case, device=device, flops=flops, row=row)


def bench_shape(name, grid_shape, heads, args, device, dtype, split: bool) -> list[dict]:
    """All rows of one shape: cuDNN per mode, then each sparsity x sparse provider x mode
    (``split``: ours' fwd rows carry the coarse/fine split)."""
    head_dim = TINY_HEAD_DIM if args.tiny else HEAD_DIM
    dense_case = Case(name, grid_shape, heads, head_dim, None, args.modes[0])
    x = make_inputs(dense_case, device, dtype, args.seed)
    providers = make_providers(x, device)
    rows = []
    cudnn_ms = {}
    if "cudnn" in args.providers:
        for mode in args.modes:
            row = run_one(
                providers["cudnn"], Case(name, grid_shape, heads, head_dim, None, mode), device
            )
            cudnn_ms[mode] = row.get("ms")
            rows.append(dict(row, speedup=1.0 if row.get("ms") else None))
            report(row)
    for sparsity in args.sparsities:
        for mode in args.modes:
            case = Case(name, grid_shape, heads, head_dim, sparsity, mode)
            for pname in [p for p in SPARSE_PROVIDERS if p in args.providers]:
                row = run_one(providers[pname], case, device)
                row["speedup"] = speedup(cudnn_ms.get(mode), row.get("ms"))
                if pname == "ours" and mode == "fwd" and split:
                    row.update(split_fields(case, x, device, row.get("ms")))
                rows.append(row)
                report(row)
    del x, providers
    harness.release_memory(device)
    return rows


def speedup(reference_ms: float | None, ms: float | None) -> float | None:
    return reference_ms / ms if reference_ms and ms else None


def split_fields(case: Case, x: Inputs, device: torch.device, total_ms: float | None) -> dict:
    split = time_split(case, x, device)
    if "coarse_ms" in split and total_ms:
        split["coarse_share"] = split["coarse_ms"] / total_ms
    return split


def report(row: dict) -> None:
    """One progress line per row, so a long GPU run shows where it is."""
    ms = row.get("ms")
    cells = [row["shape"], f"s={row['sparsity']}", row["mode"], row["provider"]]
    cells.append(f"{ms:.3f} ms" if ms is not None else f"ERROR {row.get('error')}")
    if row.get("speedup"):
        cells.append(f"{row['speedup']:.2f}x vs cuDNN")
    if row.get("coarse_ms") is not None:
        cells.append(f"coarse {row['coarse_ms']:.3f} ms, fine {row['fine_ms']:.3f} ms")
    print("  ".join(cells), flush=True)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--sparsities", default="0.875,0.9")
    ap.add_argument("--modes", default="fwd,fwd+bwd", help="comma list of fwd, bwd, fwd+bwd")
    ap.add_argument("--providers", default=",".join(ALL_PROVIDERS))
    ap.add_argument("--no-split", dest="split", action="store_false", help="skip coarse/fine")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny grid (CPU smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default results/vsa_<gpu>.json)")
    ap.add_argument("--no-plot", dest="plot", action="store_false", help="no PNG beside the JSON")
    harness.add_rounds_argument(ap, "speedups")
    args = ap.parse_args(argv)
    choices = functools.partial(harness.split_choices, allow_empty=True)
    args.modes = choices(args.modes, harness.MODES, "mode")
    args.providers = choices(args.providers, ALL_PROVIDERS, "provider")
    args.sparsities = [float(s) for s in args.sparsities.split(",") if s.strip()]
    names = choices(args.shapes, tuple(SHAPES), "shape") if not args.tiny else []
    args.shape_table = TINY_SHAPES if args.tiny else {n: SHAPES[n] for n in names}
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        # The CPU run exercises the code paths on the PyTorch reference backend.
        os.environ.setdefault("VIDSPARSE_BACKEND", "torch")
    # bf16 is the benchmark's dtype; the CPU smoke run uses fp32 (CPU bf16 matmuls are slow).
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.providers = registry.runnable_providers("vsa", args.providers, device)
    rows = run_rounds(args, device, dtype)
    meta = collect_meta(args, device, dtype)
    out = args.out or harness.results_dir() / f"vsa_{harness.slug(meta['gpu'])}.json"
    harness.report_results(out, meta, rows, harness.with_spread(COLUMNS, args.rounds))
    if args.plot:
        png = draw(rows, Path(out).with_suffix(".png"), harness.device_name(device))
        if png:
            print(f"wrote {png}", flush=True)
    return rows


def run_rounds(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Every shape's rows, ``args.rounds`` times in turn, merged into one row a case
    (``harness.in_rounds``: median ms, each speedup taken within its round); the coarse/fine
    split is timed in the first round only."""

    def run_round(r: int) -> list[dict]:
        split = args.split and r == 0
        return [
            row
            for name, (grid_shape, heads) in args.shape_table.items()
            for row in bench_shape(name, grid_shape, heads, args, device, dtype, split)
        ]

    return harness.in_rounds(args.rounds, run_round, ("speedup",))


def draw(rows: list[dict], path: Path, gpu: str):
    """Speedup over cuDNN dense against sparsity, a line per provider, a panel per shape and
    mode."""
    return harness.plot(
        path,
        rows,
        x="sparsity",
        y="speedup",
        series=("provider",),
        panels=("shape", "mode"),
        reference=lambda r: r["provider"] == "cudnn",
        xlabel="sparsity (key tiles skipped)",
        ylabel="speedup over cuDNN dense",
        title=f"VSA, {gpu}",
        logx=False,
    )


def collect_meta(args, device, dtype) -> dict:
    fastvideo = {"requested": "fastvideo" in args.providers}
    if fastvideo["requested"]:
        _, path, version, error = load_fastvideo()
        fastvideo.update(
            callable=path,
            version=version,
            error=error,
            FASTVIDEO_VSA_TRITON=os.environ.get("FASTVIDEO_VSA_TRITON"),
            call="video_sparse_attn(q_t, k_t, v_t, vbs, vbs, topk, block_size=(4, 4, 4), "
            "compress_attn_weight=gate_t)",
        )
    return harness.collect_metadata(
        device,
        benchmark="vsa",
        dtype=str(dtype),
        tiny=args.tiny,
        tile=list(TILE),
        shapes={n: {"grid": list(g), "heads": h} for n, (g, h) in args.shape_table.items()},
        sparsities=args.sparsities,
        modes=args.modes,
        providers=args.providers,
        speedup="cudnn ms / provider ms, same shape and mode",
        split=(
            "ours fwd rows (each the median of 3 alternating timings): coarse_ms = "
            "vsa_coarse_stage alone, fine_ms = "
            "vsa_fine_combined (engine + gate epilogue) on one coarse call's lists, coarse_share = "
            "coarse_ms / ours fwd ms"
        ),
        sparse_pairs="nominal: dense real pairs * topk / num_tiles",
        rounds=args.rounds,
        fastvideo=fastvideo,
    )


if __name__ == "__main__":
    main()
