"""The one runner of the benchmark ops (``registry.py``): ``vidsparse bench`` calls it, and so
does ``python -m vidsparse.bench``::

    python -m vidsparse.bench --list                        # ops, shapes, providers
    python -m vidsparse.bench OP [OPTIONS]                  # e.g. block_sparse --shapes real
    python -m vidsparse.bench OP --help                     # the op's own options
    torchrun --nproc-per-node 2 -m vidsparse.bench parallel [OPTIONS]

Each op writes its JSON (``--out``, default under ``benchmarks/results/``), prints a table, and
returns its rows. A failure is one line (``BenchError``), never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from vidsparse.bench import registry

# `vidsparse bench all`: the names its results are filed under ("engine" is block_sparse's
# historical name, kept for the JSON files and scripts that read them).
ALL_TARGETS = tuple(op.aliases[0] if op.aliases else op.name for op in registry.OPS.values()
                    if op.in_all)  # fmt: skip
TARGETS = (*registry.OPS, *registry.ALIASES)


class BenchError(Exception):
    """A benchmark could not run, or failed: a one-line message (exit code 1)."""


class BenchUsageError(BenchError):
    """Bad usage: an unknown op or option, a launch the op cannot take (exit code 2)."""


def resolve(name: str) -> registry.OpSpec:
    try:
        return registry.get(name)
    except KeyError as exc:
        raise BenchUsageError(exc.args[0]) from None


def check_launch(op: registry.OpSpec) -> None:
    """Multi-GPU ops need one process per GPU, started by torchrun (which sets WORLD_SIZE)."""
    if op.launcher == "torchrun" and "WORLD_SIZE" not in os.environ:
        raise BenchUsageError(
            f"{op.name} runs one process per GPU: torchrun --nproc-per-node N -m vidsparse.bench"
            f" {op.name} [OPTIONS]"
        )


def run(name: str, argv: Sequence[str] = (), *, quiet: bool = False) -> list[dict]:
    """Run op ``name`` with its own command-line options ``argv``; returns its rows.

    ``quiet``: the op's progress and table go to stderr, so that stdout can carry JSON. The
    backend choice an op makes for a CPU run (``VIDSPARSE_BACKEND``) is undone afterwards.
    """
    op = resolve(name)
    check_launch(op)
    try:
        module = op.load()
    except ImportError as exc:
        raise BenchError(f"cannot import {op.module}: {exc}") from None
    redirect = contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext()
    backend = os.environ.get("VIDSPARSE_BACKEND")
    try:
        with redirect:
            rows = module.main(list(argv))
            if _ran_on_cpu(argv) and not {"-h", "--help"} & set(argv):
                from vidsparse.bench.harness import CPU_CAVEAT

                print(f"\n{CPU_CAVEAT}", flush=True)
    except SystemExit as exc:  # the op's own usage checks and one-line refusals
        if exc.code in (None, 0):  # e.g. --help
            return []
        if exc.code == 2:  # argparse, which has printed why
            raise BenchUsageError(
                f"bench {name}: bad options (see python -m vidsparse.bench {op.name} --help)"
            ) from None
        raise BenchError(f"bench {name} stopped: {exc.code}") from None
    except (KeyboardInterrupt, BenchError):
        raise
    except Exception as exc:  # a benchmark failure is reported, not a traceback
        raise BenchError(f"bench {name} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if backend is None:
            os.environ.pop("VIDSPARSE_BACKEND", None)
        else:
            os.environ["VIDSPARSE_BACKEND"] = backend
    return list(rows or [])


def _ran_on_cpu(argv: Sequence[str]) -> bool:
    """Did the op run on the CPU: no GPU visible, or one asked for by ``--device cpu`` (or
    ``--dry-run``)?"""
    import torch

    args = list(argv)
    asked = "--dry-run" in args or "--device=cpu" in args
    asked = asked or any(a == "--device" and b == "cpu" for a, b in zip(args, args[1:]))
    return asked or not torch.cuda.is_available()


def tiny_argv(op: registry.OpSpec) -> list[str]:
    """The options of ``op``'s smoke run (tiny shapes, CPU ok)."""
    if op.tiny_args is None:
        raise BenchUsageError(f"{op.name} has no tiny smoke run: it needs GPUs")
    return list(op.tiny_args)


def run_targets(
    targets: Sequence[str],
    out_dir: str | Path,
    *,
    tiny: bool = False,
    extra: Sequence[str] = (),
    quiet: bool = False,
) -> list[dict]:
    """Run each target, writing ``<out_dir>/<target>.json``; ``extra`` options follow the
    runner's own (``--out``, the tiny options), so they win. Returns
    ``[{"target", "json", "rows"}]``; the first failure raises ``BenchError``."""
    results = []
    for target in targets:
        op = resolve(target)
        json_path = Path(out_dir) / f"{target}.json"
        argv = ["--out", str(json_path)]
        if tiny:
            argv += tiny_argv(op)
        rows = run(target, [*argv, *extra], quiet=quiet)
        results.append({"target": target, "json": str(json_path), "rows": rows})
    return results


USAGE = """usage: python -m vidsparse.bench OP [OPTIONS]   (OP --help for its options)
       python -m vidsparse.bench --list
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n" + registry.describe(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("--list", "list"):
        print(registry.describe())
        return 0
    try:
        run(argv[0], argv[1:])
    except BenchUsageError as exc:
        print(f"vidsparse bench: error: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"vidsparse bench: error: {exc}", file=sys.stderr)
        return 1
    return 0


def script_main(name: str) -> None:
    """Entry of the thin scripts in ``benchmarks/``: ``python benchmarks/bench_X.py OPTIONS``
    is ``python -m vidsparse.bench X OPTIONS``."""
    sys.exit(main([name, *sys.argv[1:]]))
