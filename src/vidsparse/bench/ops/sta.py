"""Sliding-tile attention benchmark: ``vidsparse.sliding_tile_attn`` against FlexAttention with
the same block mask, and cuDNN dense as the reference.

At Wan 2.1 1.3B 480p (21x30x52 tokens in 624 4x4x4 tiles, 12 heads, head_dim 128, bf16), per
window of ``wt x wh x ww`` tiles, fwd and fwd+bwd: ``ours`` on tile-order inputs, ``flex``
(compiled, the same tile mask at 64-token blocks), ``cudnn`` (dense, the reference of every
speedup) and, not by default, ``masked-sdpa`` (SDPA under the S x S token mask). Run on a GPU
(``vidsparse bench sta -- OPTIONS`` is the same)::

    python -m vidsparse.bench sta                          # Wan 1.3B 480p, windows 3x3x3, 5x5x5
    python -m vidsparse.bench sta --windows 3x3x3 --modes fwd --check
    python -m vidsparse.bench sta --device cpu --tiny --check   # CPU smoke run

``benchmarks/README.md`` ("Sliding-tile attention") describes the providers, the FLOP count and
``--check``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from vidsparse.bench import flex, harness, registry, shapes
from vidsparse.bench.harness import Column, Provider
from vidsparse.bench.sdpa import dense_sdpa
from vidsparse.layout import VideoGrid

OP = "sta"
PROVIDERS = ("ours", "flex", "cudnn", "masked-sdpa")
SPARSE_PROVIDERS = ("ours", "flex", "masked-sdpa")
DEFAULT_PROVIDERS = tuple(registry.get(OP).default_providers)
TILE = (4, 4, 4)  # the engine's 64-token tiles
DEFAULT_WINDOWS = "3x3x3,5x5x5"
TINY_WINDOWS = "1x3x3,3x3x3"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHECK_REL_L2 = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-3}
CHECK_QUERY_TILES = 4

COLUMNS = [
    Column("shape", "shape"),
    Column("window", "window"),
    Column("density", "density", ".3f"),
    Column("mode", "mode"),
    Column("provider", "provider"),
    Column("ms", "ms", ".3f"),
    Column("tflops", "eff TFLOP/s", ".4g"),
    Column("speedup_vs_cudnn", "vs cuDNN", ".2f"),
    Column("ours_over_flex", "ours/flex", ".2f"),
    Column("check_rel_l2", "check", ".1e"),
]


# ---------------------------------------------------------------------------------------------
# inputs and masks
# ---------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """One shape's tensors, shared by every provider, window and mode."""

    grid: VideoGrid
    q: torch.Tensor  # [B, H, num_tokens, D], natural order
    k: torch.Tensor
    v: torch.Tensor
    q_t: torch.Tensor  # [B, H, padded_len, D], tile order, padding slots zero
    k_t: torch.Tensor
    v_t: torch.Tensor


def make_inputs(shape, device: torch.device, dtype: torch.dtype, seed: int) -> Inputs:
    """Random q, k, v for ``shape`` (a ``shapes.ModelShape``), natural and tiled."""
    grid = VideoGrid(shape.grid, tile=TILE)
    gen = torch.Generator(device=device).manual_seed(seed)
    size = (1, shape.heads, grid.num_tokens, shape.head_dim)
    q, k, v = (torch.randn(size, device=device, dtype=dtype, generator=gen) for _ in range(3))
    tiled = [grid.tile(x, dim=-2).contiguous() for x in (q, k, v)]
    return Inputs(grid, q, k, v, *tiled)


@dataclass
class Window:
    """One window's masks over one grid, built once and shared by its providers and modes."""

    window: tuple[int, int, int]
    block_mask: torch.Tensor  # bool [NT, NT], tile order
    pairs_per_head: int  # attended real (query, key) pairs
    _flex_mask: object = field(default=None, repr=False)
    _token_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return "x".join(map(str, self.window))

    def flex_mask(self, grid: VideoGrid, device: torch.device):
        if self._flex_mask is None:
            block = grid.tile_volume
            self._flex_mask = flex.block_mask_from_map(
                self.block_mask[None, None],  # broadcast over batch and heads
                (block, block),
                key_valid=grid.real_token_mask(device),
                token_mask_mod=device.type != "cuda",
            )
        return self._flex_mask

    def token_mask(self, grid: VideoGrid, device: torch.device) -> torch.Tensor:
        """bool [S, S] over the tiled sequence: the window's key tiles, real keys only."""
        if self._token_mask is None:
            self._token_mask = token_mask(self.block_mask, grid, device)
        return self._token_mask


def token_mask(block_mask: torch.Tensor, grid: VideoGrid, device, rows: int | None = None):
    """bool [rows or S, S]: query slot i may see key slot j (j's tile in i's window, j real)."""
    b = grid.tile_volume
    tiles = block_mask if rows is None else block_mask[: math.ceil(rows / b)]
    mask = tiles.repeat_interleave(b, dim=0).repeat_interleave(b, dim=1)
    if rows is not None:
        mask = mask[:rows]
    return mask & grid.real_token_mask(device)[None, :]


def make_window(window: tuple[int, int, int], grid: VideoGrid, device) -> Window:
    from vidsparse.masks.sliding_tile import sliding_tile_block_mask

    block_mask = sliding_tile_block_mask(grid, window, device=device)
    sizes = grid.tile_sizes_on(device).to(torch.float64)
    pairs = int(round(float(sizes @ block_mask.to(torch.float64) @ sizes)))
    return Window(window, block_mask, pairs)


# ---------------------------------------------------------------------------------------------
# providers
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    shape: shapes.ModelShape
    provider: str
    mode: str
    window: Window | None = None  # None: dense, or masks that could not be built
    label: str = "dense"


def _ours_forward(grid: VideoGrid, window: tuple[int, int, int]) -> Callable:
    import vidsparse

    def forward(q, k, v):
        return vidsparse.sliding_tile_attn(q, k, v, grid, window=window, tiled=True)

    return forward


def _flex_forward(w: Window, grid: VideoGrid, device: torch.device) -> Callable:
    block_mask = w.flex_mask(grid, device)
    options = flex.kernel_options((grid.tile_volume, grid.tile_volume))
    fn = flex.flex_function(device, max_autotune=True)

    def forward(q, k, v):
        return fn(q, k, v, block_mask, options)

    return forward


def _masked_forward(w: Window, grid: VideoGrid, device: torch.device) -> Callable:
    mask = w.token_mask(grid, device)

    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return forward


def check(name: str, out: torch.Tensor, x: Inputs, w: Window) -> float:
    """Relative L2 error of the first query tiles of head 0 (real rows) against an fp32
    masked SDPA; raises above the dtype's bound (a wrong kernel gets no timing)."""
    from vidsparse.testing import rel_l2

    grid = x.grid
    rows = min(CHECK_QUERY_TILES, grid.num_tiles) * grid.tile_volume
    mask = token_mask(w.block_mask, grid, x.q_t.device, rows=rows)
    q, k, v = (t[:1, :1].float() for t in (x.q_t, x.k_t, x.v_t))
    ref = F.scaled_dot_product_attention(q[:, :, :rows], k, v, attn_mask=mask)
    real = grid.real_token_mask(x.q_t.device)[:rows]
    err = rel_l2(out[:1, :1, :rows][..., real, :].float(), ref[..., real, :])
    bound = CHECK_REL_L2[x.q_t.dtype]
    if not err <= bound:
        raise AssertionError(f"{name} check failed: rel L2 {err:.3e} > {bound:.0e} vs reference")
    return err


def make_provider(name: str, x: Inputs, settings: argparse.Namespace) -> Provider:
    device = settings.device

    def make(case: Case):
        registry.require(OP, name, device)
        if name == "cudnn":
            return harness.mode_callable(dense_sdpa("cudnn", device), (x.q, x.k, x.v), case.mode)
        w = case.window
        if name == "ours":
            forward = _ours_forward(x.grid, w.window)
        elif name == "flex":
            forward = _flex_forward(w, x.grid, device)
        else:
            forward = _masked_forward(w, x.grid, device)
        inputs = (x.q_t, x.k_t, x.v_t)
        if settings.check and case.mode == "fwd":
            with torch.no_grad():
                settings.last_check = check(name, forward(*inputs), x, w)
        return harness.mode_callable(forward, inputs, case.mode)

    return Provider(name, make, registry.get(OP).provider(name).description)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


def base_row(case: Case, x: Inputs, dtype: torch.dtype) -> dict:
    grid, shape = x.grid, case.shape
    dense = shape.heads * grid.num_tokens**2
    w = case.window
    dense_case = case.label == "dense"
    if dense_case:
        pairs = dense
    else:
        pairs = None if w is None else shape.heads * w.pairs_per_head
    return {
        "shape": shape.name,
        "provider": case.provider,
        "window": case.label,
        "mode": case.mode,
        "batch": 1,
        "heads": shape.heads,
        "head_dim": shape.head_dim,
        "tokens": grid.num_tokens,
        "padded_tokens": grid.padded_len,
        "num_tiles": grid.num_tiles,
        "tile": "x".join(map(str, grid.tile_shape)),
        "kv_tiles": grid.num_tiles if dense_case else math.prod(map(int, case.label.split("x"))),
        "dtype": str(dtype).replace("torch.", ""),
        "pairs": pairs,
        "density": None if pairs is None else pairs / dense,
    }


def bench_shape(shape, args, settings) -> list[dict]:
    """All rows of one shape: cuDNN per mode, then window x mode x sparse provider."""
    device, dtype = settings.device, settings.dtype
    x = make_inputs(shape, device, dtype, args.seed)
    providers = {p: make_provider(p, x, settings) for p in args.providers}
    plan: list[tuple[Case, str | None]] = [
        (Case(shape, "cudnn", mode), None) for mode in args.modes if "cudnn" in args.providers
    ]
    noted: set[str] = set()
    for window in args.windows:
        try:
            w, error = make_window(window, x.grid, device), None
        except Exception as exc:  # noqa: BLE001 - e.g. the masks module missing, a bad window
            w, error = None, f"window masks: {harness.error_message(exc)}"
        label = "x".join(map(str, window))
        for mode in args.modes:
            for p in (p for p in SPARSE_PROVIDERS if p in args.providers):
                skipped = registry.mode_unavailable(OP, p, mode, device)
                if skipped:  # FlexAttention's backward on the CPU
                    if skipped not in noted:
                        noted.add(skipped)
                        registry.note_skipped(skipped)
                    continue
                plan.append((Case(shape, p, mode, w, label), error))
    rows = []
    for case, error in plan:
        if error:
            rows.append(dict(base_row(case, x, dtype), error=error))
        else:
            rows.append(run_one(providers[case.provider], case, x, args, settings))
        _report(rows[-1])
    del x, providers
    harness.release_memory(device)
    return rows


def run_one(provider: Provider, case: Case, x: Inputs, args, settings) -> dict:
    row = base_row(case, x, settings.dtype)
    flops = harness.attention_flops(row["pairs"], case.shape.head_dim, case.mode)
    row["flops"] = flops
    settings.last_check = None
    row = harness.run_case(
        provider, case, device=settings.device, flops=flops, row=row,
        warmup=args.warmup, rep=args.rep,
    )  # fmt: skip
    if settings.last_check is not None and not row.get("error"):
        row["check_rel_l2"] = settings.last_check
    return row


def add_ratios(rows: list[dict]) -> None:
    """``speedup_vs_cudnn`` (cuDNN dense ms / ms), ``vs_cudnn`` (TFLOP/s over cuDNN's) and, on
    ours' rows, ``ours_over_flex`` (flex ms / ours ms, same window and mode: equal work)."""

    def ok(r):
        return not r.get("error") and r.get("ms")

    def find(**match):
        return next((r for r in rows if ok(r) and all(r[k] == v for k, v in match.items())), None)

    for row in rows:
        if not ok(row):
            continue
        common = {"shape": row["shape"], "mode": row["mode"]}
        cudnn = find(provider="cudnn", **common)
        if cudnn:
            row["speedup_vs_cudnn"] = cudnn["ms"] / row["ms"]
            if row.get("tflops") and cudnn.get("tflops"):
                row["vs_cudnn"] = row["tflops"] / cudnn["tflops"]
        if row["provider"] == "ours":
            other = find(provider="flex", window=row["window"], **common)
            if other:
                row["ours_over_flex"] = other["ms"] / row["ms"]


def _report(row: dict) -> None:
    harness.print_progress(f"{row['shape']} {row['window']} {row['mode']} {row['provider']}", row)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _window(text: str) -> tuple[int, int, int]:
    parts = tuple(int(p) for p in text.lower().split("x"))
    if len(parts) != 3:
        raise SystemExit(f"a window is TxHxW in tiles, e.g. 3x3x3; got {text!r}")
    return parts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default=",".join(registry.get(OP).shapes), help="shape names")
    p.add_argument("--windows", default=None, help=f"comma list (default {DEFAULT_WINDOWS})")
    p.add_argument("--modes", default="fwd,fwd+bwd", help="comma list of fwd, bwd, fwd+bwd")
    p.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS), help=f"of {PROVIDERS}")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 (GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny grid (CPU smoke run)")
    p.add_argument("--check", action="store_true", help="compare fwd outputs to the reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=harness.DO_BENCH_WARMUP_MS, help="ms")
    p.add_argument("--rep", type=int, default=harness.DO_BENCH_REP_MS, help="ms")
    p.add_argument("--out", default=None, help="JSON path (default results/sta_<gpu>.json)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="no PNG beside the JSON")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.modes = harness.split_choices(args.modes, harness.MODES, "modes")
    args.providers = harness.split_choices(args.providers, PROVIDERS, "providers")
    windows = args.windows or (TINY_WINDOWS if args.tiny else DEFAULT_WINDOWS)
    args.windows = [_window(w) for w in windows.split(",") if w.strip()]
    if args.tiny:
        args.shape_list = [shapes.TINY["tiny-sta"]]
    else:
        try:
            args.shape_list = shapes.select(args.shapes)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    return args


def default_out(device: torch.device) -> Path:
    gpu = harness.slug(harness.gpu_name(device)).removeprefix("nvidia-")  # -> sta_h200.json
    return harness.results_dir() / f"sta_{gpu}.json"


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        # The reference path, not the Triton interpreter (tests set TRITON_INTERPRET=1).
        os.environ.setdefault("VIDSPARSE_BACKEND", "torch")
    # bf16 is the benchmark's dtype; the CPU smoke run uses fp32 (CPU bf16 matmuls are slow).
    if args.dtype:
        dtype = DTYPES[args.dtype]
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    settings = argparse.Namespace(device=device, dtype=dtype, check=args.check, last_check=None)
    args.providers = registry.runnable_providers(OP, args.providers, device)
    out = Path(args.out) if args.out else default_out(device)
    meta = harness.collect_metadata(
        device,
        benchmark=OP,
        dtype=str(dtype).replace("torch.", ""),
        tiny=args.tiny,
        seed=args.seed,
        check=args.check,
        tile=list(TILE),
        shapes=[s.describe() for s in args.shape_list],
        windows=["x".join(map(str, w)) for w in args.windows],
        modes=args.modes,
        providers=args.providers,
        flex_compile=(
            "torch.compile(dynamic=False), kernel_options BLOCK_M=BLOCK_N=64, " + flex.FLEX64_NOTE
            if device.type == "cuda"
            else "eager (CPU dry run)"
        ),
        speedup="cudnn ms / provider ms, same shape and mode",
        complete=False,
    )
    rows: list[dict] = []
    for shape in args.shape_list:
        rows += bench_shape(shape, args, settings)
        harness.write_results(out, meta, rows)
    add_ratios(rows)
    meta["complete"] = True
    harness.report_results(out, meta, rows, COLUMNS)
    if args.plot:
        png = harness.plot(
            out.with_suffix(".png"),
            rows,
            x="density",
            y="tflops",
            series=("provider",),
            panels=("shape", "mode"),
            reference=lambda r: r["provider"] == "cudnn",
            xlabel="density (attended real pairs / dense)",
            ylabel="effective TFLOP/s",
            title=f"sliding-tile attention on {harness.device_name(device)}",
            logx=False,
        )
        if png:
            print(f"wrote {png}", flush=True)
    return rows
