"""Why does a scheduled VSA arm step slower at its target than the unscheduled arm?

On an H100 (fd3c121, seed 2, 1,200 steps, compiled blocks) ``train_vsa --arm vsa0.875-warmup``
stepped at 157-173 ms once at sparsity 0.875, where ``--arm vsa0.875`` had stepped at 116 ms.
The scheduled arm compiles one graph per sparsity level, and from the second level dynamo
traces the sparsity as a symbolic float. This runs short arms back to back (full size,
compiled blocks, the same seed), each in its own process so that no compiled graph carries
over:

- ``plain``: ``--arm vsa0.875``;
- ``scheduled``: ``--arm vsa0.875-warmup``, a short schedule (4 dense steps, 4 levels over 8);
- ``scheduled-specialized``: the same with ``torch._dynamo.config.specialize_float`` on (one
  graph per level, each with the sparsity a constant).

Each prints its rows; the step ms of the last interval (steps 40-60, all at 0.875) is the
comparison. Writes ``$OUT/try_schedule_steps.json`` if ``OUT`` is set::

    PYTHONPATH=src python benchmarks/tuning/try_schedule_steps.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

SHORT = ["--steps", "60", "--eval-every", "20", "--eval-crops", "2", "--samples", "1",
         "--sample-steps", "2", "--compile", "blocks", "--no-plot"]  # fmt: skip
SCHEDULE = ["--schedule-warmup", "4", "--schedule-ramp", "8", "--schedule-levels", "4"]
VARIANTS = {
    "plain": (["--arm", "vsa0.875"], False),
    "scheduled": (["--arm", "vsa0.875-warmup", *SCHEDULE], False),
    "scheduled-specialized": (["--arm", "vsa0.875-warmup", *SCHEDULE], True),
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


def run(name: str, argv: list[str], specialize: bool, out_dir: str) -> list[dict]:
    cmd = [sys.executable, "-c", CHILD, str(int(specialize)), *argv, *SHORT,
           "--out", os.path.join(out_dir, name)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    print(f"== {name} (exit {proc.returncode})\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}",
          flush=True)  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("ROWS ")]
    return json.loads(lines[-1][5:]) if lines else []


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (argv, specialize) in VARIANTS.items():
            results[name] = run(name, argv, specialize, tmp)
    for name, rows in results.items():
        print(name, [(r["step"], r["sparsity"], r["step_ms"]) for r in rows])
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "try_schedule_steps.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
