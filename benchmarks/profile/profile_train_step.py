"""Where a ``train_vsa`` training step's time goes: dense against VSA (torch.profiler).

    PYTHONPATH=src python benchmarks/profile/profile_train_step.py [--arms dense,vsa0.875]
    PYTHONPATH=src python benchmarks/profile/profile_train_step.py --compile blocks --steps 10
    PYTHONPATH=src python benchmarks/profile/profile_train_step.py --tiny --device cpu  # smoke

Per arm: the ``train_vsa`` model and data (``bench/ops/train_vsa.py``: 8 Wan blocks, 6 heads of
128, 32,768 tokens, bf16 autocast, gradient checkpointing; ``--compile blocks`` as
``train_vsa --compile blocks``; ``--compile blocks-graphs`` the same with inductor's CUDA graphs,
an experiment: is the compiled VSA step's host time the launches?), two warm-up steps (the
compiles among them), then

- ``wall``: the median CUDA-synchronised step time of ``--steps`` unprofiled steps (what the
  benchmark's ``step ms`` reports);
- ``kernels``: the sum of the GPU kernel times of one profiled step; ``wall - kernels`` is the
  time the GPU waits on the host (or on nothing: copies and gaps count there too);
- the kernels and the host operators that cost the most, per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from vidsparse.bench.ops import train_vsa
from vidsparse.integrations.diffusers.compile import training_compile_options

WARMUP_STEPS = 2


def arm_run(arm: str, out: str, args) -> train_vsa.Run:
    compile_ = "none" if args.compile == "blocks-graphs" else args.compile
    argv = ["--arm", arm, "--out", out, "--device", args.device, "--compile", compile_]
    argv += ["--tiny"] if args.tiny else []
    run = train_vsa.prepare(train_vsa.parse_args(argv), torch.device(args.device))
    if args.compile == "blocks-graphs":  # as compile_for_training, replayed from CUDA graphs
        options = {**training_compile_options(), "triton.cudagraphs": True}
        run.model.compile_repeated_blocks(fullgraph=True, options=options)
    return run


def train_step(run: train_vsa.Run, step: int, graphs: bool) -> tuple[float, float]:
    if graphs:  # a new iteration: the graphs' outputs of the last step may be overwritten
        torch.compiler.cudagraph_mark_step_begin()
    return train_vsa.train_step(run, step)


def per_step(events, device_kind: str, steps: int, top: int) -> tuple[float, list[str]]:
    """Total self time (ms a step) of the events on ``device_kind``, and the top lines."""
    chosen = [e for e in events if e.device_type.name == device_kind]
    attr = "self_device_time_total" if device_kind == "CUDA" else "self_cpu_time_total"
    chosen.sort(key=lambda e: getattr(e, attr), reverse=True)
    total_ms = sum(getattr(e, attr) for e in chosen) / steps / 1e3
    lines = [f"    {getattr(e, attr) / steps / 1e3:8.3f} ms  {e.count // steps:5d}x  {e.key[:70]}"
             for e in chosen[:top]]  # fmt: skip
    return total_ms, lines


def profile_arm(arm: str, args) -> None:
    with tempfile.TemporaryDirectory() as out:
        run = arm_run(arm, out, args)
        graphs = args.compile == "blocks-graphs"
        for step in range(WARMUP_STEPS):  # compiles, autotuning, allocator warm-up
            train_step(run, step, graphs)
        timed = [train_step(run, WARMUP_STEPS + i, graphs) for i in range(args.steps)]
        walls = [ms for _, ms in timed]
        activities = [ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            for i in range(args.steps):
                train_step(run, WARMUP_STEPS + args.steps + i, graphs)
    events = prof.key_averages()
    wall = statistics.median(walls)
    print(f"{arm}: wall {wall:.1f} ms a step (median of {args.steps})", flush=True)
    losses = " ".join(f"{loss:.5f}" for loss, _ in timed)
    print(f"  losses of the timed steps (a check across --compile modes): {losses}")
    if args.device == "cuda":
        kernels, lines = per_step(events, "CUDA", args.steps, args.top)
        print(f"  kernels {kernels:.1f} ms a step; wall - kernels {wall - kernels:.1f} ms")
        print("  top kernels:", *lines, sep="\n")
    host, lines = per_step(events, "CPU", args.steps, args.top)
    print(f"  host operators (self time, profiled) {host:.1f} ms a step; top:", *lines, sep="\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="dense,vsa0.875", help="train_vsa arms, comma-separated")
    ap.add_argument("--steps", type=int, default=3, help="steps timed, and steps profiled")
    ap.add_argument("--top", type=int, default=15, help="lines of each top list")
    ap.add_argument("--tiny", action="store_true", help="train_vsa's tiny model (CPU smoke)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", choices=("none", "blocks", "blocks-graphs"), default="none",
                    help="blocks: each block compiled, as train_vsa --compile; blocks-graphs: "
                         "the same with inductor's CUDA graphs")  # fmt: skip
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("VIDSPARSE_BACKEND", "torch")  # as train_vsa on the CPU
    for arm in args.arms.split(","):
        profile_arm(arm, args)


if __name__ == "__main__":
    main()
