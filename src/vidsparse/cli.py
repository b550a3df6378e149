"""The ``vidsparse`` command-line tool.

    vidsparse demo [--out DIR] [--device cpu|cuda] [--sparsity 0.875]
    vidsparse search SAMPLES --grid T H W --tile t h w (--alpha A | --target-sparsity S) ...
    vidsparse inspect PLAN [--json]

Exit codes: 0 ok, 1 failure, 2 bad usage (including unreadable or invalid input files).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

EXAMPLES = """examples:
  vidsparse demo                      # dense vs VSA on the default workload, report in out/demo
  vidsparse demo --out /tmp/r --json  # machine-readable summary on stdout
  vidsparse search calib/ --grid 21 30 52 --tile 2 8 8 --alpha 0.05 --out plan.json
  vidsparse inspect plan.json
"""


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
            "Run dense attention and VSA on a Wan-2.1-shaped video self-attention layer and"
            " report time, speedup and error against dense. On a GPU the 480p grid (21x30x52,"
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
            " seconds."
        ),
        epilog=(
            "examples:\n"
            "  vidsparse search calib/ --grid 21 30 52 --tile 2 8 8 --alpha 0.05 --num-steps 50\n"
            "  vidsparse search --from-table losses.pt --target-sparsity 0.75 --out plan75.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("samples", nargs="?", help="calibration .pt file or folder of them")
    p.add_argument("--grid", type=int, nargs=3, metavar=("T", "H", "W"), help="latent grid")
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
    p.add_argument("--num-steps", type=int, help="denoising steps of the schedule")
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
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _add_inspect_parser(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarise a PSA plan file",
        description="Per-layer sparsity and error, and the histogram of chosen stripe patterns.",
        epilog="example:\n  vidsparse inspect plan.json --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan", help="plan file written by `vidsparse search`")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    commands = {"demo": _run_demo, "search": _run_search, "inspect": _run_inspect}
    try:
        return commands[args.command](args)
    except _BadInput as exc:
        print(f"vidsparse: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vidsparse: interrupted", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as exc:
        print(f"vidsparse: error: {exc}", file=sys.stderr)
        return 1


class _BadInput(Exception):
    """A user-supplied file or value is missing, unreadable or invalid: exit code 2."""


def _run_search(args) -> int:
    from vidsparse.layout import VideoGrid
    from vidsparse.search import LossTable, load_calibration, plan_from_table, save_plan, search

    rule = {"alpha": args.alpha, "target_sparsity": args.target_sparsity}
    try:
        if args.from_table:
            plan = plan_from_table(
                LossTable.load(args.from_table), dense_fraction=args.dense_fraction, **rule
            )
            table = None
        else:
            if not args.samples or not args.grid:
                raise _BadInput("SAMPLES and --grid are required unless --from-table is given")
            grid = VideoGrid(tuple(args.grid), tile=tuple(args.tile))
            result = search(
                load_calibration(args.samples),
                grid,
                num_steps=args.num_steps,
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
    return 0


def _run_inspect(args) -> int:
    from vidsparse.search import load_plan

    try:
        plan = load_plan(args.plan)
    except (ValueError, TypeError, OSError) as exc:
        raise _BadInput(str(exc)) from None
    _print_plan_summary(plan, args.json)
    return 0


def _print_plan_summary(plan, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan.summary()))
    else:
        print(plan.format_summary())


def _run_demo(args) -> int:
    if not 0.0 <= args.sparsity < 1.0:
        print("vidsparse: error: --sparsity must be in [0, 1)", file=sys.stderr)
        return 2
    from vidsparse.demo import run_demo

    report = run_demo(
        device=args.device, sparsity=args.sparsity, seed=args.seed, log=None if args.json else print
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    start = time.time()
    sys.exit(main())
