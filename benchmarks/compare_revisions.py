"""Time the same workloads on two source trees of vidsparse, in one run on one GPU.

A change that should not move speed (a re-cut, a refactor) is checked by timing both trees
through the public API only (``block_sparse_attn``, ``video_sparse_attn``, ``stripe_attn``),
each tree in its own process (``PYTHONPATH=<tree>/src``), the workloads in the same order, and
the trees alternating over rounds (A B B A ...) so that clock drift falls on both alike::

    python benchmarks/compare_revisions.py --tree before=/path/to/old --tree after=. \\
        --rounds 4 --out benchmarks/results/recut_speed_h200.json

Each figure is the median of ``triton.testing.do_bench`` medians over a tree's rounds; the
JSON holds every round's figure, the ratio ``after / before`` per figure, and whether each is
within ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ENGINE = dict(B=1, H=12, S=32768, D=128, density=1 / 8)
VSA_SHAPES = {"wan1.3b-480p": ((21, 30, 52), 12), "wan14b-720p": ((21, 45, 80), 40)}
PSA_SHAPE = ("wan14b-720p", (21, 45, 80), 40, (1, 8, 16), 0.75)


def _lists(heads, nq, nk, density, device, seed):
    """Random per-head lists of ``round(density * nk)`` distinct key blocks per query block."""
    import torch

    k = max(1, round(density * nk))
    scores = torch.rand(1, heads, nq, nk, generator=torch.Generator().manual_seed(seed))
    idx = scores.argsort(-1)[..., :k].sort(-1).values.to(torch.int32).to(device)
    cnt = torch.full((1, heads, nq), k, dtype=torch.int32, device=device)
    return idx, cnt


def _time(fn) -> float:
    import triton

    fn()  # compile, build and cache lists
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _timed_pair(torch, name, fwd, do):
    """``[(name fwd, ms), (name fwd+bwd, ms)]``: the forward alone, then with its backward."""

    def step():
        fwd().backward(do)

    with torch.no_grad():
        forward = _time(fwd)
    return [(f"{name} fwd", forward), (f"{name} fwd+bwd", _time(step))]


def _engine_rows(torch, vidsparse, device, gen):
    B, H, S, D = (ENGINE[x] for x in "BHSD")
    rows = []
    for block in (128, 64):
        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16,
                               generator=gen).requires_grad_() for _ in range(3))  # fmt: skip
        do = torch.randn_like(q)
        idx, cnt = _lists(H, S // block, S // block, ENGINE["density"], device, block)

        def fwd(q=q, k=k, v=v, idx=idx, cnt=cnt, block=block):
            return vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=block)

        rows += _timed_pair(torch, f"engine {block}x{block} density 1/8", fwd, do)
    return rows


def _vsa_rows(torch, vidsparse, device, gen):
    rows = []
    for shape, (grid_shape, heads) in VSA_SHAPES.items():
        grid = vidsparse.VideoGrid(grid_shape, tile=(4, 4, 4))
        S = grid.num_tokens
        q, k, v, gate = (torch.randn(1, heads, S, 128, device=device, dtype=torch.bfloat16,
                                     generator=gen).requires_grad_() for _ in range(4))  # fmt: skip
        do = torch.randn_like(q)

        def fwd(q=q, k=k, v=v, gate=gate, grid=grid):
            return vidsparse.video_sparse_attn(q, k, v, grid, sparsity=0.875, gate=gate)

        rows += _timed_pair(torch, f"vsa {shape} sparsity 0.875 natural order + gate", fwd, do)
    return rows


def _psa_rows(torch, vidsparse, device, gen):
    import random

    from vidsparse.search import CandidateFamily

    shape, grid_shape, heads, tile, target = PSA_SHAPE
    grid = vidsparse.VideoGrid(grid_shape, tile=tile)
    cands = CandidateFamily().on_grid(grid.tiles)
    sparsity = cands.sparsity.tolist()
    order = sorted(range(len(sparsity)), key=lambda i: abs(sparsity[i] - target))
    rng = random.Random(0)
    specs = [cands[rng.choice(order[:4])].block_spec(grid.tiles[2]) for _ in range(heads)]
    q, k, v = (torch.randn(1, heads, grid.num_tokens, 128, device=device, dtype=torch.bfloat16,
                           generator=gen) for _ in range(3))  # fmt: skip
    with torch.no_grad():
        ms = _time(lambda: vidsparse.stripe_attn(q, k, v, grid, specs))
    return [(f"psa {shape} {'x'.join(map(str, tile))} sparsity ~{target} fwd", ms)]


def worker() -> None:
    """Run the suite on the vidsparse found on PYTHONPATH; one JSON object on stdout."""
    import torch

    import vidsparse

    device = torch.device("cuda")
    rows = []
    for suite in (_engine_rows, _vsa_rows, _psa_rows):
        gen = torch.Generator(device=device).manual_seed(0)
        rows += suite(torch, vidsparse, device, gen)
        torch.cuda.empty_cache()
    print(json.dumps({"vidsparse": vidsparse.__file__, "rows": rows}))


def _run_tree(path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(path / "src"))
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"worker on {path} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _environment() -> dict:
    import torch
    import triton

    # A copy of the tree has no .git (and git would answer for a repository above it): the
    # commit given in VIDSPARSE_GIT_COMMIT comes first.
    commit = os.environ.get("VIDSPARSE_GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()  # fmt: skip
        except OSError:
            commit = ""
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, commit=commit or None)  # fmt: skip


def _figures(runs, trees, tolerance) -> list[dict]:
    """Per workload: each tree's median over its rounds, the ratio, and every round's figure."""
    (base, _), (new, _) = trees
    figures = []
    for name in runs[base][0]:
        before = statistics.median(run[name] for run in runs[base])
        after = statistics.median(run[name] for run in runs[new])
        figures.append(
            dict(
                workload=name,
                ms={base: before, new: after},
                ratio=after / before,
                within=abs(after / before - 1) <= tolerance,
                rounds={label: [run[name] for run in runs[label]] for label in runs},
            )
        )
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a source tree (with src/); exactly two, the first is the baseline",
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    if len(args.tree) != 2 or any("=" not in t for t in args.tree):
        parser.error("give exactly two --tree LABEL=PATH")
    trees = [(label, Path(path).resolve()) for label, path in (t.split("=", 1) for t in args.tree)]
    runs = {label: [] for label, _ in trees}
    figures = []
    for r in range(args.rounds):
        for label, path in trees if r % 2 == 0 else trees[::-1]:
            print(f"round {r + 1}/{args.rounds}: {label}", file=sys.stderr, flush=True)
            runs[label].append(dict(_run_tree(path)["rows"]))
        figures = _figures(runs, trees, args.tolerance)
        if args.out:  # after every round: a run stopped at its time limit keeps what it has
            # Trees as given (relative paths stay relative: no machine's folders in the JSON).
            result = dict(_environment(), trees=dict(t.split("=", 1) for t in args.tree),
                          rounds=r + 1, tolerance=args.tolerance, figures=figures)  # fmt: skip
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    for f in figures:
        before, after = f["ms"].values()
        print(f"{f['workload']:64s} {before:9.3f} {after:9.3f} ms  x{f['ratio']:.3f}")
    return 0 if all(f["within"] for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
