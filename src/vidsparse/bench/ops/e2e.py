"""End-to-end benchmark: one denoising step of a real-architecture diffusers video transformer.

The transformer is built from its published config (random weights, bf16, eval mode; the
models are ``e2e_model.MODELS``: Wan 2.1 T2V 1.3B and 14B, Wan 2.2 TI2V-5B, HunyuanVideo 1.5,
HunyuanVideo, LTX-Video, LTX-2, Cosmos 1.0 7B, Kandinsky 5.0 Video Lite, SkyReels-V2 14B, Wan
2.1 VACE 14B):
stock dense attention (SDPA, cuDNN first) against VSA and PSA through
``vidsparse.integrations.diffusers``' public ``apply_sparse_attention``, all on the same model
object and inputs. Per method: the step's latency, the video self-attention's time and share of
the step, speedups over dense, relative L2 of the output against dense, peak memory. Run
(``vidsparse bench e2e -- OPTIONS`` is the same)::

    python -m vidsparse.bench e2e                              # Wan 2.1 1.3B, 480p
    python -m vidsparse.bench e2e --model wan14b --layers 8    # Wan 2.1 14B, 720p
    python -m vidsparse.bench e2e --model wan2.2-5b            # Wan 2.2 TI2V-5B, 704x1280
    python -m vidsparse.bench e2e --model hunyuan1.5           # HunyuanVideo 1.5, 720p, 8 blocks
    python -m vidsparse.bench e2e --model ltx2                 # also hunyuanvideo, ltx, cosmos,
                                                               # kandinsky5, skyreels-v2, wan-vace
    python -m vidsparse.bench e2e --model cosmos --layers all --methods dense --warmup 0 \
        --reps 1 --share-reps 0                                # does the whole model fit?
    python -m vidsparse.bench e2e --compile blocks             # every block torch.compile'd
    python -m vidsparse.bench e2e --device cpu --tiny          # CPU smoke run (any --model)
    python -m vidsparse.bench e2e --train                      # a training step (e2e_train)
    python -m vidsparse.bench e2e --train --model wan14b --layers 4

Needs diffusers >= 0.36. ``benchmarks/README.md`` ("End to end in diffusers") says what each
number covers and how to install diffusers on a GPU machine without network access.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vidsparse.bench import harness
from vidsparse.bench.harness import Column
from vidsparse.bench.ops import e2e_train
from vidsparse.bench.ops.e2e_common import (
    AttentionTimer,
    Method,
    add_relative,
    attention_share,
    check_cudnn,
    kernel_support,
    make_methods,
    run_metadata,
    sdpa_context,
    time_steps,
    video_output,
)
from vidsparse.bench.ops.e2e_model import (
    COMPILE_MODES,
    DEFAULT_PSA_TILE,
    LATENT_HW,
    MODELS,
    PSA_SLACK,
    PSA_TOLERANCE,
    WAN_CONFIGS,
    Workload,
    build_model,
    compile_blocks,
    import_model,
    import_wan,
    make_inputs,
    make_workload,
    synthetic_plan,
)
from vidsparse.testing import rel_l2

# Re-exported: the e2e op's model, inputs and plans, as the registry and e2e_ulysses use them,
# and the parts its modes share (e2e_common), as e2e_ulysses and the tests use them.
__all__ = [
    "AttentionTimer",
    "DEFAULT_PSA_TILE",
    "LATENT_HW",
    "MODELS",
    "PSA_SLACK",
    "PSA_TOLERANCE",
    "build_model",
    "import_wan",
    "make_inputs",
    "make_workload",
    "main",
    "synthetic_plan",
    "WAN_CONFIGS",
    "kernel_support",
    "sdpa_context",
    "time_steps",
]

METHODS = ("dense", "vsa", "psa", "psa-plan")
PROVIDERS = METHODS

COLUMNS = [
    Column("method", "method"),
    Column("target", "target", ".2f"),
    Column("sparsity", "sparsity", ".3f"),
    Column("step_ms", "step ms", ".1f"),
    Column("speedup", "speedup", ".2f"),
    Column("attn_ms", "attn ms", ".1f"),
    Column("attn_share", "attn share", ".1%"),
    Column("attn_speedup", "attn x", ".2f"),
    Column("rel_l2", "rel L2", ".4f"),
    Column("peak_mem_gb", "peak GB", ".1f"),
]


# ---------------------------------------------------------------------------------------------
# one method
# ---------------------------------------------------------------------------------------------


def run_method(method: Method, model, inputs, work: Workload, device, args, ref):
    """Patch, run, time, unpatch. Returns the row and (for dense) the reference output."""
    from vidsparse.integrations.diffusers import (
        apply_sparse_attention,
        remove_sparse_attention,
        set_denoising_step,
    )

    row: dict[str, Any] = {"method": method.name, "target": method.target, **(method.info or {})}
    out_ref = None
    patched = False
    if method.skip:
        row["error"] = method.skip
        return row, None
    try:
        if method.options is not None:
            apply_sparse_attention(model, method.kind, **method.options)
            patched = True
            set_denoising_step(model, method.step)

        def step():
            with torch.no_grad(), sdpa_context(device):
                return video_output(model(**inputs))

        started = time.perf_counter()
        first = step()  # compiles kernels (and the blocks under --compile), builds lists
        harness.synchronize(device)
        row["first_step_s"] = time.perf_counter() - started
        if method.name == "dense":
            out_ref = first
            row["rel_l2"] = rel_l2(step(), first)
        elif ref is not None:
            row["rel_l2"] = rel_l2(first, ref)
        row["out_finite"] = bool(torch.isfinite(first).all())
        del first
        for _ in range(args.warmup):
            step()
        if device.type == "cuda":
            harness.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = time_steps(step, device, args.reps)
        row["step_ms"] = statistics.median(times)
        row["step_ms_min"] = min(times)
        row["step_ms_all"] = times
        row["step_ms_per_layer"] = row["step_ms"] / work.layers
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        if args.share_reps > 0:
            try:
                row.update(attention_share(model, step, device, args.share_reps, work.tokens))
            except Exception as exc:  # noqa: BLE001 - the latency stands without the share
                row["attn_share_error"] = harness.error_message(exc)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = harness.error_message(exc)
    finally:
        if patched:
            remove_sparse_attention(model)
        harness.release_memory(device)
    return row, out_ref


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def default_out(
    device: torch.device, work: Workload, compile_mode: str = "none", train: bool = False
) -> Path:
    gpu = harness.slug(harness.gpu_name(device))
    gpu = gpu.removeprefix("nvidia-")  # "NVIDIA H200" -> "h200"
    stem = "e2e_train" if train else "e2e"
    if work.name != "wan1.3b-480p":
        stem += f"_{work.name}"
    if compile_mode != "none":
        stem += "_compiled"
    return harness.results_dir() / f"{stem}_{gpu}.json"


@contextlib.contextmanager
def cpu_backend(device: torch.device) -> Iterator[None]:
    """On the CPU, vidsparse's PyTorch reference (``VIDSPARSE_BACKEND=torch``) unless a backend
    was asked for explicitly; the environment is restored afterwards (in-process callers)."""
    key = "VIDSPARSE_BACKEND"
    old = os.environ.get(key)
    if device.type == "cpu" and (old or "auto").strip().lower() == "auto":
        os.environ[key] = "torch"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _layers(text: str):
    return "all" if text == "all" else int(text)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=sorted(MODELS), default="wan1.3b")
    resolutions = sorted({r for entry in MODELS.values() for r in entry.latent_hw})
    ap.add_argument(
        "--resolution",
        choices=resolutions,
        default=None,
        help="default: 480p for wan1.3b, 720p for wan14b, wan2.2-5b (704x1280 only), hunyuan1.5,"
        " hunyuanvideo, cosmos (704x1280), skyreels-v2, wan-vace; WIDTHxHEIGHT for ltx "
        "(1216x704, or 768x512), ltx2 (1536x1024, or 768x512), kandinsky5 (768x512)",
    )
    ap.add_argument(
        "--frames",
        type=int,
        default=None,
        help="video frames (default 81 for Wan 2.1 and wan-vace, 129 for hunyuanvideo, 121 for "
        "the others)",
    )
    ap.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help="transformer blocks to build, or 'all' (default wan1.3b 30 of 30, wan14b 8 of 40, "
        "wan2.2-5b 30 of 30, hunyuan1.5 8 of 54, hunyuanvideo 9 of 60 (3 dual + 6 single), ltx "
        "28 of 28, ltx2 48 of 48, cosmos 28 of 28, kandinsky5 32 of 32, skyreels-v2 8 of 40, "
        "wan-vace 10 of 40)",
    )
    ap.add_argument(
        "--methods",
        default=None,
        help="of dense,vsa,psa (dense always runs; default dense,vsa,psa, with --train dense,vsa)",
    )
    ap.add_argument("--vsa-sparsity", type=float, default=0.875)
    ap.add_argument("--no-vsa-gate", action="store_true", help="VSA without the gate projection")
    ap.add_argument("--psa-sparsities", default="0.6,0.75")
    ap.add_argument(
        "--psa-tile",
        default=None,
        help=f"PSA block TxHxW (default {DEFAULT_PSA_TILE}; wan2.2-5b and ltx: 2x8x8, the "
        "128-token block that pads their grids least)",
    )
    ap.add_argument("--psa-tolerance", type=float, default=PSA_TOLERANCE)
    ap.add_argument("--psa-plan", default=None, help="also run this searched plan file")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    ap.add_argument("--reps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--share-reps", type=int, default=2, help="instrumented steps (0: skip)")
    ap.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="none",
        help="blocks: torch.compile every transformer block (diffusers' compile_repeated_blocks,"
        " fullgraph) for every method, dense included",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model and grid (CPU smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    e2e_train.add_arguments(ap)
    args = ap.parse_args(argv)
    e2e_train.check_args(args)  # --train's options and the combinations it refuses
    args.methods = args.methods or ("dense,vsa" if args.train else "dense,vsa,psa")
    if args.reps < 1 or args.warmup < 0 or args.share_reps < 0:
        raise SystemExit("--reps must be >= 1, --warmup and --share-reps >= 0")
    if args.compile != "none" and args.share_reps:
        # The share's event pairs wrap Python functions inside the compiled blocks.
        print("--compile: attention share not measured (--share-reps 0)", flush=True)
        args.share_reps = 0
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("the full-size models need a GPU; use --device cpu --tiny on the CPU")
    import_model(MODELS[args.model].family)  # fail now, in one line, if diffusers is missing
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    work = make_workload(args)
    out = Path(args.out) if args.out else default_out(device, work, args.compile, args.train)
    with cpu_backend(device):
        if args.train:
            return e2e_train.run(args, work, device, out)
        return _run(args, work, device, dtype, out)


def _run(args, work: Workload, device, dtype, out: Path) -> list[dict]:
    start = time.perf_counter()
    model = build_model(work, device, dtype, args.seed)
    build_s = time.perf_counter() - start
    if args.compile == "blocks":
        compile_blocks(model, work)
    inputs = make_inputs(work, device, dtype, args.seed)
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    sdpa = check_cudnn(work, device, dtype)
    methods = make_methods(args, work)
    meta = run_metadata(args, work, device, dtype, weights_gb, sdpa, build_s)
    joint = f" + {work.joint_text} text ({work.joint_text_real} real)" if work.joint_text else ""
    print(
        f"{work.name}: {work.layers}/{work.full_layers} layers, grid {work.grid_shape} "
        f"({work.tokens} tokens{joint}), {work.heads} heads, {dtype}, built in {build_s:.1f} s; "
        f"SDPA {sdpa}",
        flush=True,
    )
    base = {
        "workload": work.name,
        "layers": work.layers,
        "full_layers": work.full_layers,
        "tokens": work.tokens,
        "heads": work.heads,
    }
    rows: list[dict] = []
    ref = None
    for method in methods:
        row, out_ref = run_method(method, model, inputs, work, device, args, ref)
        if out_ref is not None:
            ref = out_ref
        rows.append({**base, **row})
        add_relative(rows)
        harness.write_results(out, meta, rows)
        r = rows[-1]
        print(
            f"  {r['method']:<8} target {r.get('target') or 0:.2f} sparsity "
            f"{r.get('sparsity', 0):.3f}: step {r.get('step_ms', float('nan')):.1f} ms, attn "
            f"{r.get('attn_ms', float('nan')):.1f} ms ({r.get('attn_share') or float('nan'):.1%})"
            f", rel L2 {r.get('rel_l2', float('nan')):.4f}"
            + (f"  ERROR {r['error']}" if r.get("error") else "")
            + (f"  WARNING {r['warning']}" if r.get("warning") else ""),
            flush=True,
        )
    meta["complete"] = True
    meta["total_s"] = time.perf_counter() - start
    harness.report_results(out, meta, rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
