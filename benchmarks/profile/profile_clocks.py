"""Burst against sustained speed of one block-sparse forward+backward: the same call timed by
``do_bench`` over short and long windows, with the SM clock and board power sampled beside it.

    PYTHONPATH=src python benchmarks/profile/profile_clocks.py [--density 0.125] [--out DIR]

A profiler loop of a few calls on a GPU that was idle a moment before can run its kernels
faster than ``do_bench``'s 200 ms windows measure them: where the gap is the board's power
limit, the clock samples (``nvidia-smi`` every 20 ms) fall as the window grows, and the
sustained number is the one a training step sees. Prints one line per window (median ms, the
SM clock's median and the power's median over the window) and writes ``DIR/clocks.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

from vidsparse.bench import harness
from vidsparse.masks.block_sparse import random_block_lists

WINDOWS_MS = (10, 50, 200, 1000, 3000)


def sampler(path: Path) -> subprocess.Popen | None:
    """``nvidia-smi`` sampling into ``path`` every 20 ms; None (and a message) without it."""
    query = "--query-gpu=timestamp,clocks.sm,power.draw"
    cmd = ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "20"]
    try:
        return subprocess.Popen(cmd, stdout=path.open("w"), stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        print("nvidia-smi not found: times only, no clock or power samples", flush=True)
        return None


def samples_between(path: Path, start: float, end: float) -> tuple[float, float]:
    """Median SM clock (MHz) and power (W) of the samples taken between two ``time.time()``s."""
    clocks, watts = [], []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:  # nvidia-smi's local time, as time.time() and a naive datetime take it
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            clock, power = float(parts[1]), float(parts[2])
        except ValueError:
            continue
        if start <= stamp <= end:
            clocks.append(clock)
            watts.append(power)
    if not clocks:
        return float("nan"), float("nan")
    return statistics.median(clocks), statistics.median(watts)


def main(argv=None):
    import vidsparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--out", default=None, help="folder for clocks.json")
    args = ap.parse_args(argv)
    S, H, D, bs = 32768, 12, 128, 128
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    idx, cnt = random_block_lists(1, H, S // bs, S // bs, density=args.density, device="cuda")

    def forward(q, k, v):
        return vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(bs, bs))

    fn = harness.mode_callable(forward, (q, k, v), "fwd+bwd")
    log = Path(tempfile.mkdtemp()) / "smi.csv"
    proc = sampler(log)
    rows = []
    try:
        for window in WINDOWS_MS:
            time.sleep(2.0)  # idle first: every window starts from a rested board
            start = time.time()
            ms = harness.time_ms(fn, device=q.device, warmup=5, rep=window)
            rows.append({"window_ms": window, "ms": ms, "t0": start, "t1": time.time()})
    finally:
        if proc is not None:
            time.sleep(0.1)
            proc.terminate()
            proc.wait()
    for row in rows:
        row["sm_clock_mhz"], row["power_w"] = samples_between(log, row.pop("t0"), row.pop("t1"))
        print(json.dumps(row), flush=True)
    if args.out:
        meta = harness.collect_metadata(q.device, density=args.density)
        harness.write_results(Path(args.out) / "clocks.json", meta, rows)


if __name__ == "__main__":
    main()
