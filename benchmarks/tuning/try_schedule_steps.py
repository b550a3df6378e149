"""Step times of train_vsa's arms measured on one machine, in one call.

Two questions (and their answers: docs/training.md). Does a scheduled VSA arm step slower at
its target than the unscheduled arm? The scheduled arm compiles one graph per sparsity level,
and from the second level dynamo traces the sparsity as a symbolic float. And what is VSA's
step time against dense's on the same machine? The host-bound VSA step moves from machine to
machine, so arms timed in different sessions do not give the ratio. This runs short arms back
to back (full size, compiled blocks, the same seed), each in its own process so that no
compiled graph carries over:

- ``dense``: ``--arm dense``;
- ``plain``: ``--arm vsa0.875``;
- ``scheduled``: ``--arm vsa0.875-warmup``, a short schedule (4 dense steps, 4 levels over 8);
- ``scheduled-specialized``: the same with ``torch._dynamo.config.specialize_float`` on (one
  graph per level, each with the sparsity a constant).

Each prints its rows; the step ms of the last interval (steps 40-60, all at 0.875) is the
comparison. ``--repeats N`` runs the chosen variants N times in turn (``dense#1``,
``scheduled#1``, ``dense#2``, ...), so that a drift of the machine shows. Writes
``$OUT/try_schedule_steps.json`` (or ``--json``'s name) if ``OUT`` is set: ``{"meta": GPU,
versions, commit, command; "arms": {label: rows}}``. ``--tiny``: the same
arms at ``train_vsa --tiny`` size, eager, on the CPU (a smoke run of this script)::

    PYTHONPATH=src python benchmarks/tuning/try_schedule_steps.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SHORT = ["--steps", "60", "--eval-every", "20", "--eval-crops", "2", "--samples", "1",
         "--sample-steps", "2", "--compile", "blocks", "--no-plot"]  # fmt: skip
SCHEDULE = ["--schedule-warmup", "4", "--schedule-ramp", "8", "--schedule-levels", "4"]
TINY = ["--tiny", "--device", "cpu", "--steps", "4", "--eval-every", "2", "--no-plot"]
TINY_SCHEDULE = ["--schedule-warmup", "1", "--schedule-ramp", "2", "--schedule-levels", "2"]


def variants(schedule: list[str]) -> dict:
    """``{name: (train_vsa arguments, specialise floats)}``."""
    return {
        "dense": (["--arm", "dense"], False),
        "plain": (["--arm", "vsa0.875"], False),
        "scheduled": (["--arm", "vsa0.875-warmup", *schedule], False),
        "scheduled-specialized": (["--arm", "vsa0.875-warmup", *schedule], True),
    }


CHILD = """
import json, sys, torch
from vidsparse.bench.ops import train_vsa
if sys.argv[1] == "1":
    torch._dynamo.config.specialize_float = True
rows = train_vsa.main(sys.argv[2:])
print("ROWS " + json.dumps([{k: r.get(k) for k in ("step", "sparsity", "step_ms", "eval_loss")}
                            for r in rows]))
"""


def run(name: str, argv: list[str], specialize: bool, out_dir: str, size: list[str]) -> list[dict]:
    cmd = [sys.executable, "-c", CHILD, str(int(specialize)), *argv, *size,
           "--out", os.path.join(out_dir, name)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(f"== {name} (exit {proc.returncode})\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}",
          flush=True)  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("ROWS ")]
    return json.loads(lines[-1][5:]) if lines else []


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny, eager, on the CPU")
    every = ",".join(variants([]))
    parser.add_argument("--variants", default="plain,scheduled,scheduled-specialized",
                        help=f"comma-separated, of {every} (default: %(default)s)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the variants")
    parser.add_argument("--json", default="try_schedule_steps.json", help="file name under $OUT")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    size, schedule = (TINY, TINY_SCHEDULE) if args.tiny else (SHORT, SCHEDULE)
    table = variants(schedule)
    unknown = set(args.variants.split(",")) - set(table)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: of {list(table)}")
    results = {}
    meta = run_metadata(args.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.repeats + 1):
            for name in args.variants.split(","):
                label = name if args.repeats == 1 else f"{name}#{round_}"
                results[label] = run(label, *table[name], tmp, size)
                save(meta, results, args.json)  # after each arm: a call cut short keeps those
    for name, rows in results.items():
        print(name, [(r["step"], r["sparsity"], r["step_ms"]) for r in rows])


def run_metadata(tiny: bool) -> dict:
    """Where the arms run (their processes share the machine): GPU, versions, commit."""
    import torch

    from vidsparse.bench.harness import collect_metadata

    on_gpu = not tiny and torch.cuda.is_available()
    return collect_metadata(torch.device("cuda" if on_gpu else "cpu"))


def save(meta: dict, results: dict, name: str) -> None:
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump({"meta": meta, "arms": results}, f, indent=1)


if __name__ == "__main__":
    main()
