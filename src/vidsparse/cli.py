"""The ``vidsparse`` command-line tool.

    vidsparse demo [--out DIR] [--device cpu|cuda] [--sparsity 0.875]
    vidsparse search SAMPLES [--grid T H W] --tile t h w (--alpha A | --target-sparsity S) ...
    vidsparse inspect PLAN [--json] [--png PATH]
    vidsparse bench [OP|all] [--out DIR] [--tiny] [--json] [--list] [-- OP OPTIONS]
    vidsparse tune (--model NAME [--resolution R] | --seq S ...) [--time-budget SECONDS] | --show

Exit codes: 0 ok, 1 failure, 2 bad usage (including unreadable or invalid input files),
130 interrupted (Ctrl-C / SIGINT, at any point, torch's import included: one line, no
traceback; files are written atomically, so none is left half-written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vidsparse.utils.files import atomic_write

EXAMPLES = """examples:
  vidsparse demo                      # dense vs VSA vs PSA on the default workload (out/demo)
  vidsparse demo --out /tmp/r --json  # machine-readable summary on stdout
  vidsparse search calib/ --tile 2 8 8 --alpha 0.05 --out plan.json   # grid from the files
  vidsparse inspect plan.json --png masks.png
  vidsparse bench engine --tiny       # kernel benchmark smoke run
  vidsparse tune --model wan2.1-1.3b --resolution 480p   # tune the kernels for this GPU
  vidsparse tune --show               # the tuning file in effect, and what it changes

exit codes: 0 ok, 1 failure, 2 bad usage or input, 130 interrupted (Ctrl-C)
"""

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command that Ctrl-C stopped


class _Parser(argparse.ArgumentParser):
    """argparse that exits with 2 and a one-line message (no usage dump) on bad usage."""

    def error(self, message):
        self.exit(2, f"vidsparse: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vidsparse",
        description="Sparse attention for video Diffusion Transformers.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    demo = sub.add_parser(
        "demo",
        help="dense vs sparse attention on a Wan-2.1-shaped layer",
        description=(
            "Run dense attention, VSA and PSA (per-head stripes from a quick search on the"
            " spot, timed apart) on a Wan-2.1-shaped video self-attention layer whose q/k/v"
            " come from a real clip, and report time, speedup, sparsity and error against"
            " dense, with report.json and PNGs in --out. On a GPU the 480p grid (21x30x52,"
            " 12 heads, head_dim 128, bf16); on CPU a reduced grid, said so in the output."
        ),
        epilog="example:\n  vidsparse demo --out out/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--out", default="out/demo", help="folder for report.json (default out/demo)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    demo.add_argument("--sparsity", type=float, default=0.875, help="VSA sparsity (default 0.875)")
    demo.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    demo.add_argument("--seed", type=int, default=0)
    _add_search_parser(sub)
    _add_inspect_parser(sub)
    _add_bench_parser(sub)
    _add_tune_parser(sub)
    return parser


def _add_search_parser(sub) -> None:
    p = sub.add_parser(
        "search",
        help="PSA: pick per-head stripe patterns from calibration samples",
        description=(
            "Offline PSA search: for each (step bucket, layer, head) of the calibration"
            " samples, the sparsest stripe pattern whose output error against dense attention"
            " is <= --alpha, or the lowest-error pattern at >= --target-sparsity. Writes a plan"
            " file; --table keeps every (head, candidate) loss so --from-table re-plans in"
            " seconds. The latent grid and the number of denoising steps default to those the"
            " calibration files record (capture_calibration writes both on a pipeline)."
        ),
        epilog=(
            "examples:\n"
            "  vidsparse search calib/ --tile 2 8 8 --alpha 0.05   # grid, steps: from the files\n"
            "  vidsparse search calib/ --grid 21 30 52 --num-steps 50 --alpha 0.05   # checked\n"
            "  vidsparse search --from-table losses.pt --target-sparsity 0.75 --out plan75.json\n"
            "  vidsparse search calib/ --tile 1 4 4 --alpha 0.05 --png attn.png"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "samples", nargs="?", help="calibration file (.safetensors, or .pt) or folder of them"
    )
    p.add_argument(
        "--grid",
        type=int,
        nargs=3,
        metavar=("T", "H", "W"),
        help="latent grid in tokens (default: the one the calibration files record; given, it"
        " must match it)",
    )
    p.add_argument(
        "--tile",
        type=int,
        nargs=3,
        metavar=("t", "h", "w"),
        default=(2, 8, 8),
        help="PSA block in tokens (default 2 8 8)",
    )
    rule = p.add_mutually_exclusive_group(required=True)
    rule.add_argument("--alpha", type=float, help="max relative L2 error per head")
    rule.add_argument("--target-sparsity", type=float, help="min sparsity per head")
    p.add_argument(
        "--num-steps",
        type=int,
        help="denoising steps of the schedule (default: what the calibration files record,"
        " else the last sampled step + 1; given, it must match the files')",
    )
    p.add_argument(
        "--dense-fraction",
        type=float,
        default=0.2,
        help="first fraction of steps kept dense (default 0.2)",
    )
    p.add_argument(
        "--query-fraction",
        type=float,
        default=1.0,
        help="fraction of query blocks sampled for the losses (default 1)",
    )
    p.add_argument("--model", default="", help="model name recorded in the plan")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--out", default="plan.json", help="plan file to write (default plan.json)")
    p.add_argument("--table", help="also save the loss table here")
    p.add_argument("--from-table", help="re-plan from a saved loss table (no attention runs)")
    p.add_argument(
        "--png",
        help="picture: dense attention beside the chosen masks for a few heads of the first"
        " searched calibration sample (default: --out with .png; the plan's masks alone with"
        " --from-table and no SAMPLES)",
    )
    p.add_argument("--no-png", action="store_true", help="draw no picture")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _add_inspect_parser(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarise a PSA plan file",
        description="Per-layer sparsity and error, and the histogram of chosen stripe patterns.",
        epilog=(
            "examples:\n"
            "  vidsparse inspect plan.json --json\n"
            "  vidsparse inspect plan.json --png masks.png   # chosen masks, a few heads per layer"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan", help="plan file written by `vidsparse search`")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--png", help="also draw the chosen stripe masks (first searched step)")


def _add_bench_parser(sub) -> None:
    from vidsparse.bench.runner import ALL_TARGETS, TARGETS

    p = sub.add_parser(
        "bench",
        help="benchmarks: engine, VSA, PSA, STA, e2e, ... against their peers",
        description=(
            "Run a benchmark op of vidsparse.bench against the peers present on this machine"
            " (cuDNN, flash, FlexAttention, FastVideo, ...): a table, a JSON file per target in"
            f" --out, and a plot. 'all' runs {', '.join(ALL_TARGETS)}. Options after the target"
            " that `vidsparse bench` does not know go to the op itself (after `--` if they"
            " clash; `python -m vidsparse.bench OP --help` lists them). Full sizes need a GPU;"
            " --tiny is a smoke run of tiny shapes that also works on the CPU."
        ),
        epilog=(
            "examples:\n"
            "  vidsparse bench                        # engine, vsa, psa, sta, on the GPU\n"
            "  vidsparse bench vsa --out results/     # VSA only\n"
            "  vidsparse bench engine --tiny --json   # CPU smoke run, rows as JSON on stdout\n"
            "  vidsparse bench block_sparse --shapes real --check   # the op's own options\n"
            "  vidsparse bench --list                 # ops, shapes, providers"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an op's option must not be taken for a prefix of ours
    )
    p.add_argument(
        "target",
        nargs="?",
        default="all",
        choices=(*TARGETS, "all"),
        help="which benchmark (default all)",
    )
    p.add_argument(
        "--out", default="out/bench", help="folder for <target>.json (default out/bench)"
    )
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run (CPU ok)")
    p.add_argument(
        "--json", action="store_true", help="print the rows as JSON on stdout (progress on stderr)"
    )
    p.add_argument("--list", action="store_true", help="list the ops, shapes and providers")


def _add_tune_parser(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="tune the kernels' configs for this GPU (a tuning file the library loads)",
        description=(
            "Sweep the launch configs of the engine's kernels (forward, dK/dV, dQ) and VSA's"
            " coarse kernels (top-k, pooling) for one shape on this GPU: each candidate is"
            " checked against the PyTorch reference, then timed (CUDA events); the fastest that"
            " beats the default is written to a tuning file, which vidsparse then loads for this"
            " GPU: $VIDSPARSE_TUNING_FILE if set, else $XDG_CACHE_HOME/vidsparse/tuning/"
            "<gpu>.json (~/.cache by default). The file is written after each job, so a run"
            " stopped (--time-budget, Ctrl-C) resumes where it stopped. Needs a GPU."
            " docs/tuning.md has the details."
        ),
        epilog=(
            "examples:\n"
            "  vidsparse tune --model wan2.1-1.3b --resolution 480p --time-budget 1800\n"
            "  vidsparse tune --seq 32768 --heads 12 --blocks 128x128 --sparsity 0.9\n"
            "  vidsparse tune --show    # the file in effect; tuned or default, per kernel\n"
            "  vidsparse tune --list-models"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from vidsparse.bench.tune import add_shape_arguments

    add_shape_arguments(p)
    p.add_argument(
        "--kernels", help="comma list of fwd,bwd_dkdv,bwd_dq,attn_topk,pool (default all)"
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="stop cleanly after this long; the same command resumes",
    )
    p.add_argument(
        "--max-candidates",
        type=int,
        metavar="N",
        help="at most N candidates per kernel, the default first",
    )
    p.add_argument("--out", help="tuning file to write (default: where the library looks)")
    p.add_argument("--fresh", action="store_true", help="start over, ignoring an existing file")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--show", action="store_true", help="print what is in effect, tune nothing")
    p.add_argument("--list-models", action="store_true", help="list the --model names")
    p.add_argument("--json", action="store_true", help="print the summary as JSON, no progress bar")
    # Testing only (CI): CPU tensors through the Triton interpreter, at tiny sizes.
    p.add_argument("--interpreter", action="store_true", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # anywhere: parsing, torch's import, a run, a write
        print("vidsparse: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    # Options `vidsparse bench` does not know are its op's own (passed through).
    args, op_args = parser.parse_known_args(argv)
    if op_args and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(op_args)}")
    args.op_args = op_args
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    commands = {
        "demo": _run_demo,
        "search": _run_search,
        "inspect": _run_inspect,
        "bench": _run_bench,
        "tune": _run_tune,
    }
    try:
        return commands[args.command](args)
    except _BadInput as exc:
        print(f"vidsparse: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as exc:
        print(f"vidsparse: error: {exc}", file=sys.stderr)
        return 1


class _BadInput(Exception):
    """A user-supplied file or value is missing, unreadable or invalid: exit code 2."""


def _check_device(device: str) -> None:
    """``--device`` names a device this process can use (cpu, or cuda with a GPU visible)."""
    from vidsparse.utils.checks import check_device

    try:
        check_device("--device", device)
    except ValueError as exc:
        raise _BadInput(str(exc)) from None


def _run_search(args) -> int:
    from vidsparse.layout import VideoGrid
    from vidsparse.search import LossTable, load_calibration, plan_from_table, save_plan, search

    rule = {"alpha": args.alpha, "target_sparsity": args.target_sparsity}
    if args.device is not None:
        _check_device(args.device)
    samples = None
    try:
        if args.samples:
            samples = load_calibration(args.samples)
        if args.from_table:
            plan = plan_from_table(
                LossTable.load(args.from_table), dense_fraction=args.dense_fraction, **rule
            )
            table = None
        else:
            if not args.samples:
                raise _BadInput("SAMPLES is required unless --from-table is given")
            shape, num_steps = _grid_and_steps(args, samples)
            grid = VideoGrid(shape, tile=tuple(args.tile))
            result = search(
                samples,
                grid,
                num_steps=num_steps,
                dense_fraction=args.dense_fraction,
                query_fraction=args.query_fraction,
                model=args.model,
                device=args.device,
                progress=not args.json,
                **rule,
            )
            plan, table = result.plan, result.table
    except (ValueError, TypeError, OSError) as exc:
        raise _BadInput(str(exc)) from None
    save_plan(plan, args.out)
    if table is not None and args.table:
        table.save(args.table)
    _print_plan_summary(plan, args.json)
    if not args.json:
        print(f"plan written to {args.out}")
    if not args.no_png:
        png = args.png or str(Path(args.out).with_suffix(".png"))
        _draw_png(lambda: _draw_search_png(plan, samples, png, args.device), png, args.json)
    return 0


def _grid_and_steps(args, samples) -> tuple[tuple[int, int, int], int | None]:
    """``--grid`` and ``--num-steps``, defaulting to what the calibration files record (they
    must agree); a value given must match theirs. ``_BadInput`` naming the files otherwise."""
    grid = samples.recorded("grid_shape")  # (value, first file recording it) or None
    if args.grid is None:
        if grid is None:
            raise _BadInput(
                f"no calibration file of {args.samples!r} records its latent grid (files "
                "written before the grid was recorded): give --grid T H W"
            )
        shape = grid[0]
    else:
        shape = tuple(args.grid)
        if grid is not None and shape != grid[0]:
            raise _BadInput(
                f"--grid {' '.join(map(str, shape))} does not match the grid "
                f"{' '.join(map(str, grid[0]))} recorded in {str(grid[1])!r}"
            )
    steps = samples.recorded("num_steps")
    num_steps = args.num_steps
    if num_steps is None:
        num_steps = None if steps is None else steps[0]
    elif steps is not None and num_steps != steps[0]:
        raise _BadInput(
            f"--num-steps {num_steps} does not match the {steps[0]} denoising steps recorded "
            f"in {str(steps[1])!r}"
        )
    return shape, num_steps


def _draw_search_png(plan, samples, png: str, device: str | None) -> None:
    from vidsparse import plots

    sample = _sample_to_draw(samples, plan) if samples is not None else None
    if sample is None:  # no q/k the plan searched (e.g. --from-table alone): masks only
        plots.plot_plan_masks(plan, png)
        return
    q, k = (x.to(_picture_device(device)) for x in (sample.q, sample.k))
    plots.plot_attention_vs_mask(
        q,
        k,
        plan.grid,
        plan.specs_for(sample.step, sample.layer),
        png,
        heads=range(min(4, plan.num_heads)),
        tiled=sample.tiled,
        title=f"step {sample.step}, layer {sample.layer}: dense attention vs chosen stripe mask",
    )


def _sample_to_draw(samples, plan):
    """The first sample the plan searched, so that its masks are chosen ones (not the dense
    steps'); ``None`` when no sample fits the plan's steps, layers, heads and grid."""
    grid = plan.grid
    for sample in samples:
        if not 0 <= sample.step < plan.num_steps or sample.num_heads != plan.num_heads:
            continue
        length = grid.padded_len if sample.tiled else grid.num_tokens
        bucket = plan.bucket_for(sample.step)
        if bucket is not None and sample.layer in bucket.layers and sample.q.shape[-2] == length:
            return sample
    return None


def _picture_device(device: str | None):
    import torch

    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _draw_png(draw, png: str, quiet: bool) -> None:
    """Run ``draw``; without matplotlib print a note instead: the picture is an extra, so
    its absence must not fail a command whose main output was written."""
    from vidsparse.plots import PlotsUnavailable

    try:
        draw()
    except PlotsUnavailable as exc:
        print(f"vidsparse: note: {exc}", file=sys.stderr)
        return
    print(f"picture written to {png}", file=sys.stderr if quiet else sys.stdout)


def _run_inspect(args) -> int:
    from vidsparse.search import load_plan

    try:
        plan = load_plan(args.plan)
    except (ValueError, TypeError, OSError) as exc:
        raise _BadInput(str(exc)) from None
    _print_plan_summary(plan, args.json)
    if args.png:
        from vidsparse.plots import plot_plan_masks

        _draw_png(lambda: plot_plan_masks(plan, args.png), args.png, args.json)
    return 0


def _print_plan_summary(plan, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan.summary()))
    else:
        print(plan.format_summary())


def _run_bench(args) -> int:
    from vidsparse.bench import registry, runner

    if args.list:
        print(registry.describe())
        return 0
    import torch

    asks_help = bool({"-h", "--help"} & set(args.op_args))  # the op's own options: no run
    if not args.tiny and not asks_help and not torch.cuda.is_available():
        raise _BadInput(
            "no GPU visible: full-size benchmarks take hours on a CPU; "
            "use `vidsparse bench --tiny` for a smoke run"
        )
    targets = list(runner.ALL_TARGETS) if args.target == "all" else [args.target]
    if args.op_args and len(targets) > 1:
        raise _BadInput(
            f"options {' '.join(args.op_args)} are an op's own: name one benchmark, not all"
        )
    try:
        if asks_help:
            runner.run(targets[0], args.op_args)
            return 0
        results = runner.run_targets(
            targets, args.out, tiny=args.tiny, extra=args.op_args, quiet=args.json
        )
    except runner.BenchUsageError as exc:
        raise _BadInput(str(exc)) from None
    except runner.BenchError as exc:
        print(f"vidsparse: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"results": results}, default=str))
    else:
        for r in results:
            print(f"bench {r['target']}: {len(r['rows'])} rows written to {r['json']}")
    return 0


def _run_tune(args) -> int:
    if args.interpreter:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined (imported)
    from vidsparse.bench import tune

    if args.list_models:
        print(tune.describe_models())
        return 0
    try:
        opts = tune.options_from_args(args)
        if args.show:
            print(tune.show(opts))
            return 0
        summary = tune.run_tune(opts, progress=not args.json)
    except tune.TuneUsageError as exc:
        raise _BadInput(str(exc)) from None
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"tuning file written to {summary['path']}: {summary['entries']} entries, "
          f"{summary['done']} of {summary['jobs']} jobs done")  # fmt: skip
    if summary["stopped"]:
        print("time budget reached: run the same command again to resume")
    if not summary["loaded_by_library"]:
        print("note: vidsparse reads $VIDSPARSE_TUNING_FILE or its cache, not this file: "
              f"export VIDSPARSE_TUNING_FILE={summary['path']} to use it")  # fmt: skip
    return 0


def _run_demo(args) -> int:
    if not 0.0 <= args.sparsity < 1.0:
        print("vidsparse: error: --sparsity must be in [0, 1)", file=sys.stderr)
        return 2
    if args.device != "auto":
        _check_device(args.device)
    from vidsparse.demo import run_demo

    report = run_demo(
        device=args.device,
        sparsity=args.sparsity,
        seed=args.seed,
        log=None if args.json else print,
        out_dir=args.out,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    text = json.dumps(report, indent=2)
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    start = time.time()
    sys.exit(main())
