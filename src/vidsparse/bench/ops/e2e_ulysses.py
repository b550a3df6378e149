"""A diffusers Wan step on P GPUs: diffusers' context parallelism with vidsparse's routing.

    torchrun --nproc-per-node 2 -m vidsparse.bench e2e_ulysses
    torchrun --nproc-per-node 2 -m vidsparse.bench e2e_ulysses --methods vsa \\
        --layers 10 --head-chunks 2

Each rank builds the same random-weight Wan 2.1 transformer twice (the e2e op's model and
inputs: 1.3B at 480p, 81 frames, one denoising step, bf16):

- ``gpus=1``: the model alone on the rank's GPU, sparse attention applied as in the e2e op;
- ``gpus=P``: ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))``
  (diffusers shards the sequence: the rotary tables and the first block's input split, the
  output gathered), then ``apply_sparse_attention(..., ulysses=UlyssesAttention(...))``: the
  video self-attention runs vidsparse's method over the whole sequence of the rank's heads
  between two all-to-alls; the cross-attention stays diffusers' own context-parallel path.

Rows per method (``dense`` is stock diffusers SDPA in both, diffusers' own Ulysses on P GPUs):
step latency (median of ``--reps`` after ``--warmup``, the slowest rank's), speedup of P GPUs
over 1, and the relative L2 of the P-GPU output against the 1-GPU output (bf16).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

import torch
import torch._dynamo  # noqa: F401  (before init_process_group: see ops/parallel.py)
import torch.distributed as dist

from vidsparse.bench import harness
from vidsparse.bench.harness import Column
from vidsparse.bench.ops import e2e as bench_e2e
from vidsparse.testing import rel_l2

METHODS = ("dense", "vsa")
PROVIDERS = METHODS
make_inputs = bench_e2e.make_inputs  # the input builder: the e2e op's

COLUMNS = [
    Column("method", "method"),
    Column("gpus", "gpus"),
    Column("head_chunks", "chunks"),
    Column("step_ms", "step ms", ".1f"),
    Column("speedup", "speedup", ".2f"),
    Column("rel_l2_vs_1gpu", "rel L2 vs 1 GPU", ".1e"),
]


def slowest(ms: float, device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def step_ms(model, inputs, device, args) -> tuple[float, torch.Tensor]:
    with torch.no_grad(), bench_e2e.sdpa_context(device):
        out = model(**inputs)[0]
        for _ in range(args.warmup):
            model(**inputs)
        dist.barrier()
        times = bench_e2e.time_steps(lambda: model(**inputs), device, args.reps)
    return slowest(statistics.median(times), device), out


def apply(model, method: str, ulysses=None) -> None:
    """``dense``: stock diffusers (on P GPUs its own context-parallel attention); ``vsa``:
    vidsparse at sparsity 0.875, through ``ulysses`` on P GPUs."""
    from vidsparse.integrations.diffusers import apply_sparse_attention

    if method == "dense":
        return
    if method != "vsa":
        raise SystemExit(f"--methods takes dense, vsa; got {method!r}")
    kwargs = {"ulysses": ulysses} if ulysses is not None else {}
    apply_sparse_attention(model, "vsa", sparsity=0.875, **kwargs)


def run(args, device, dtype) -> list[dict]:
    from diffusers import ContextParallelConfig

    from vidsparse.parallel import UlyssesAttention

    world = dist.get_world_size()
    work = bench_e2e.make_workload(args)
    local_heads = work.heads // world
    bad = [n for n in args.head_chunks if n < 1 or local_heads % n]
    if bad:  # before any model is built, on every rank alike
        raise SystemExit(f"--head-chunks {bad} must divide the {local_heads} heads of a rank")
    inputs = bench_e2e.make_inputs(work, device, dtype, args.seed)
    rows = []
    for method in args.methods.split(","):
        single = bench_e2e.build_model(work, device, dtype, args.seed)
        apply(single, method)
        ms1, ref = step_ms(single, inputs, device, args)
        del single
        torch.cuda.empty_cache()
        base = {"method": method, "shape": work.name, "layers": work.layers}
        rows.append({**base, "gpus": 1, "step_ms": ms1})
        for chunks in args.head_chunks if method != "dense" else [1]:
            model = bench_e2e.build_model(work, device, dtype, args.seed)
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            apply(model, method, UlyssesAttention(head_chunks=chunks))
            msp, out = step_ms(model, inputs, device, args)
            del model
            torch.cuda.empty_cache()
            rows.append(
                {
                    **base,
                    "gpus": world,
                    "head_chunks": chunks,
                    "step_ms": msp,
                    "speedup": ms1 / msp,
                    "rel_l2_vs_1gpu": rel_l2(out, ref),
                }
            )
        if dist.get_rank() == 0:
            harness.print_table(rows, COLUMNS)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="dense,vsa")
    p.add_argument("--model", choices=sorted(bench_e2e.WAN_CONFIGS), default="wan1.3b")
    p.add_argument("--resolution", choices=sorted(bench_e2e.LATENT_HW), default=None)
    p.add_argument("--frames", type=int, default=None, help="default: the model's (e2e's)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--head-chunks", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.tiny, args.psa_tile = False, None  # None: the model's default PSA block
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=5))
    try:
        rows = run(args, device, torch.bfloat16)
        if dist.get_rank() == 0:
            out = args.out or harness.results_dir() / "e2e_ulysses_h200.json"
            meta = harness.collect_metadata(
                device, benchmark="e2e_ulysses", gpus=dist.get_world_size()
            )
            print(f"wrote {harness.write_results(out, meta, rows)}")
        return rows
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
