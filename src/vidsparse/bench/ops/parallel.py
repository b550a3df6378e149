"""Ulysses sequence parallelism: one video-DiT attention layer on 1 GPU against P GPUs.

One Wan 2.1 14B 720p layer (75,600 tokens, 40 heads, head_dim 128, bf16): ``vsa``
(``ulysses_video_sparse_attn``, sparsity 0.875), ``block_sparse`` (``ulysses_block_sparse_attn``,
density 0.125) and ``comm`` (the exchange alone), each as a ``gpus=1`` row and a ``gpus=P`` row
(the slowest rank's median), with ``speedup = ms(1 GPU) / ms(P GPUs)`` and the P-GPU output
checked against the 1-GPU one. Run with torchrun (one process per GPU)::

    torchrun --nproc-per-node 2 -m vidsparse.bench parallel
    torchrun --nproc-per-node 2 -m vidsparse.bench parallel --modes fwd,fwd+bwd
    torchrun --nproc-per-node 2 -m vidsparse.bench parallel --dry-run --head-chunks 1,2   # CPU

JSON (rank 0): ``benchmarks/results/parallel_<gpu>_<P>gpu.json``. ``benchmarks/README.md``
("Multi-GPU") describes the providers, ``--head-chunks``, the check and the timer.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (before init_process_group: see init_distributed)
import torch.distributed as dist

from vidsparse import VideoGrid, block_sparse_attn, video_sparse_attn
from vidsparse.bench import harness, shapes
from vidsparse.bench.harness import Column
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.ops.video_sparse_attn.topk import resolve_topk
from vidsparse.parallel import (
    ulysses_attention,
    ulysses_block_sparse_attn,
    ulysses_video_sparse_attn,
)

PROVIDERS = ("vsa", "block_sparse", "comm")
MATCH_REL_L2 = 2e-2  # bf16: the P-GPU output equals the 1-GPU output within this
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

COLUMNS = [
    Column("provider", "provider"),
    Column("mode", "mode"),
    Column("gpus", "gpus"),
    Column("head_chunks", "chunks"),
    Column("ms", "ms", ".2f"),
    Column("tflops", "eff. TFLOP/s", ".0f"),
    Column("speedup", "speedup", ".2f"),
    Column("rel_l2_vs_1gpu", "rel L2 vs 1 GPU", ".1e"),
    Column("max_abs_vs_1gpu", "max abs vs 1 GPU", ".1e"),
    Column("match", "match"),
]


@dataclass(frozen=True)
class Layer:
    """One self-attention layer of a video DiT."""

    name: str
    grid: VideoGrid
    heads: int
    head_dim: int
    batch: int = 1


def _layer(name: str, shape: shapes.ModelShape) -> Layer:
    return Layer(name, VideoGrid(shape.grid), heads=shape.heads, head_dim=shape.head_dim)


WAN14B_720P = _layer("wan14b-720p", shapes.MODELS["wan14b-720p"])
TINY = _layer("tiny", shapes.TINY["tiny-parallel"])  # CPU dry run


# ---------------------------------------------------------------------------------------------
# distributed set-up and timing
# ---------------------------------------------------------------------------------------------


def init_distributed(cpu: bool, high_priority: bool = True) -> torch.device:
    """NCCL with one GPU per rank (LOCAL_RANK), or gloo on the CPU for a dry run.

    torch._dynamo is imported at the top, before the group exists: imported later (the engine
    does on its first call) it keeps references to the group past destroy_process_group, and
    gloo then aborts at interpreter exit about one run in four (torch 2.13, CPU).
    """
    # A rank stuck in a collective (the other one failed) gives up instead of holding the GPU.
    timeout = datetime.timedelta(minutes=5)
    if cpu:
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    # NCCL's kernels on a high-priority stream: the pipelined exchange then takes SMs as soon
    # as the attention kernel's programs free them, instead of waiting for its last one.
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = high_priority
    dist.init_process_group("nccl", device_id=device, timeout=timeout, pg_options=options)
    return device


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sum_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median ms of ``reps`` calls after ``warmup`` calls, the slowest rank's. Every rank calls
    ``fn`` exactly ``warmup + reps`` times (collectives inside stay matched)."""
    for _ in range(warmup):
        fn()
    harness.synchronize(device)
    dist.barrier()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return max_over_ranks(statistics.median(times), device)


# ---------------------------------------------------------------------------------------------
# the layer: inputs, the 1-GPU op, the Ulysses op
# ---------------------------------------------------------------------------------------------


def seeded(shape, n: int, *, seed: int, dtype, device) -> list[torch.Tensor]:
    """The same tensors on every rank (one generator on each rank's device, same seed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(n)]


def local_shard(x_bhsd: torch.Tensor) -> torch.Tensor:
    """This rank's ``[B, S/P, H, D]`` slice of a full ``[B, H, S, D]`` tensor (contiguous, as a
    model would hold it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    S = x_bhsd.shape[2]
    return x_bhsd[:, :, rank * S // world : (rank + 1) * S // world].transpose(1, 2).contiguous()


@dataclass
class Case:
    """The two ways of computing one provider's layer on the same inputs."""

    full_inputs: list[torch.Tensor]  # [B, H, S, D]
    single: Callable[..., torch.Tensor]  # full_inputs -> o [B, H, S, D]
    sharded: Callable[..., torch.Tensor]  # (*local shards, head_chunks=n) -> o [B, S/P, H, D]
    pairs: float  # attended (query, key) pairs, for effective TFLOP/s


def vsa_case(layer: Layer, sparsity: float, dtype, device) -> Case:
    grid = layer.grid
    shape = (layer.batch, layer.heads, grid.num_tokens, layer.head_dim)
    inputs = seeded(shape, 4, seed=0, dtype=dtype, device=device)  # q, k, v, gate
    vsa = {"sparsity": sparsity}
    density = resolve_topk(grid.num_tiles, sparsity=sparsity) / grid.num_tiles
    return Case(
        inputs,
        lambda q, k, v, g: video_sparse_attn(q, k, v, grid, gate=g, **vsa),
        lambda q, k, v, g, head_chunks=1: ulysses_video_sparse_attn(
            q, k, v, grid, gate=g, head_chunks=head_chunks, **vsa
        ),
        pairs=layer.batch * layer.heads * grid.num_tokens**2 * density,
    )


def block_sparse_case(layer: Layer, sparsity: float, dtype, device) -> Case:
    grid = layer.grid
    shape = (layer.batch, layer.heads, grid.padded_len, layer.head_dim)
    inputs = seeded(shape, 3, seed=1, dtype=dtype, device=device)
    nb = grid.num_tiles
    count = resolve_topk(nb, sparsity=sparsity)
    gen = torch.Generator(device=device).manual_seed(2)
    idx, cnt = random_block_lists(1, layer.heads, nb, nb, count=count, generator=gen, device=device)
    engine = {"block_size": grid.tile_volume, "kv_block_sizes": grid.tile_sizes_on(device)}
    return Case(
        inputs,
        lambda q, k, v: block_sparse_attn(q, k, v, idx, cnt, **engine),
        lambda q, k, v, head_chunks=1: ulysses_block_sparse_attn(
            q, k, v, idx, cnt, head_chunks=head_chunks, **engine
        ),
        pairs=layer.batch * layer.heads * grid.num_tokens**2 * count / nb,
    )


def exchange_only(q, k, v, g):
    """The vsa layer's traffic without its attention: q, k, v and gate to heads in one fused
    all-to-all, then one tensor back (the "attention" returns q's head shard)."""
    return ulysses_attention(lambda heads, q, k, v, g: q, q, k, v, g)


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------


def compare_outputs(o_sharded: torch.Tensor, o_full: torch.Tensor, device) -> dict:
    """rel L2 and max abs of the P-GPU output against the 1-GPU output, over all ranks."""
    ref = local_shard(o_full).double()
    diff = o_sharded.double() - ref
    num = sum_over_ranks(float(diff.pow(2).sum()), device)
    den = sum_over_ranks(float(ref.pow(2).sum()), device)
    rel = math.sqrt(num / den) if den else math.sqrt(num)
    max_abs = max_over_ranks(float(diff.abs().max()), device)
    return {"rel_l2_vs_1gpu": rel, "max_abs_vs_1gpu": max_abs, "match": rel <= MATCH_REL_L2}


def measure(provider: str, case: Case, mode: str, args, device) -> list[dict]:
    world = dist.get_world_size()
    base = {"provider": provider, "mode": mode, "shape": args.layer.name}
    flops = harness.attention_flops(case.pairs, args.layer.head_dim, mode)
    single = harness.mode_callable(case.single, case.full_inputs, mode)
    ms1 = time_ms(single, device, args.warmup, args.reps)
    del single
    rows = [{**base, "gpus": 1, "ms": ms1, "tflops": harness.tflops(flops, ms1)}]
    harness.release_memory(device)
    if world == 1:
        return rows

    shards = [local_shard(x) for x in case.full_inputs]
    with torch.no_grad():
        o_full = case.single(*case.full_inputs)
    # head_chunks > 1 pipelines the exchanges in inference only (with autograd recording the
    # one-shot exchange runs), so backward modes measure head_chunks=1 alone.
    for chunks in args.head_chunks if mode == "fwd" else [1]:
        with torch.no_grad():
            check = compare_outputs(case.sharded(*shards, head_chunks=chunks), o_full, device)

        def call(*xs, chunks=chunks):
            return case.sharded(*xs, head_chunks=chunks)

        sharded = harness.mode_callable(call, shards, mode)
        msp = time_ms(sharded, device, args.warmup, args.reps)
        del sharded
        harness.release_memory(device)
        row = {**base, "gpus": world, "head_chunks": chunks, "ms": msp}
        rows.append({**row, "tflops": harness.tflops(flops, msp), "speedup": ms1 / msp, **check})
    return rows


def measure_comm(layer: Layer, dtype, args, device) -> list[dict]:
    """The exchange of the vsa layer alone (forward): q, k, v, gate in, one tensor out."""
    shape = (layer.batch, layer.heads, layer.grid.num_tokens, layer.head_dim)
    shards = [local_shard(x) for x in seeded(shape, 4, seed=3, dtype=dtype, device=device)]
    with torch.no_grad():
        ms = time_ms(lambda: exchange_only(*shards), device, args.warmup, args.reps)
    base = {"provider": "comm", "mode": "fwd", "shape": layer.name, "gpus": dist.get_world_size()}
    return [{**base, "ms": ms}]


def run(args, device, dtype, write: Callable[[list[dict]], None]) -> list[dict]:
    rows: list[dict] = []
    builders = {"vsa": vsa_case, "block_sparse": block_sparse_case}
    for provider in args.providers:
        if provider == "comm":
            if dist.get_world_size() > 1:
                rows += measure_comm(args.layer, dtype, args, device)
                write(rows)
            continue
        case = builders[provider](args.layer, args.sparsity, dtype, device)
        for mode in args.modes:
            rows += measure(provider, case, mode, args, device)
            write(rows)
            if dist.get_rank() == 0:
                harness.print_table([r for r in rows if r["mode"] == mode][-4:], COLUMNS)
        del case
        harness.release_memory(device)
    return rows


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _csv(choices: Sequence[str]):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--providers", type=_csv(PROVIDERS), default=list(PROVIDERS))
    p.add_argument("--modes", type=_csv(harness.MODES), default=["fwd"])
    p.add_argument("--sparsity", type=float, default=0.875)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per case")
    p.add_argument("--reps", type=int, default=10, help="timed calls per case (median)")
    p.add_argument(
        "--head-chunks",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[1, 2, 4],
        help="P-GPU forward rows for each: heads in this many pipelined groups (1 = one-shot)",
    )
    p.add_argument("--out", default=None, help="JSON path (default results/parallel_*.json)")
    p.add_argument(
        "--normal-priority",
        action="store_true",
        help="NCCL on a normal-priority stream (default: high priority, see init_distributed)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, gloo, a tiny layer, fp32: exercise the paths"
    )
    args = p.parse_args(argv)
    args.layer = TINY if args.dry_run else WAN14B_720P
    if args.dry_run:
        args.dtype, args.warmup, args.reps = "fp32", 1, 2
    local_heads = args.layer.heads // int(os.environ.get("WORLD_SIZE", 1))
    bad = [n for n in args.head_chunks if n < 1 or local_heads % n]
    if bad:
        p.error(f"--head-chunks {bad} must divide the {local_heads} heads of a rank")
    return args


def default_out(device: torch.device, world: int) -> Path:
    name = f"parallel_{harness.slug(harness.gpu_name(device))}_{world}gpu.json"
    return harness.results_dir() / name


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    if args.dry_run:
        # The reference path, not the Triton interpreter (tests set TRITON_INTERPRET=1).
        os.environ["VIDSPARSE_BACKEND"] = "torch"
    device = init_distributed(cpu=args.dry_run, high_priority=not args.normal_priority)
    dtype = DTYPES[args.dtype]
    world, rank = dist.get_world_size(), dist.get_rank()
    layer = args.layer
    if layer.heads % world:
        raise SystemExit(f"{layer.heads} heads do not split over {world} ranks")
    out = Path(args.out) if args.out else default_out(device, world)
    meta = harness.collect_metadata(
        device,
        benchmark="parallel",
        world_size=world,
        backend=dist.get_backend(),
        nccl_high_priority_stream=not args.dry_run and not args.normal_priority,
        layer={
            "name": layer.name,
            "grid": list(layer.grid.shape),
            "tile": list(layer.grid.tile_shape),
            "num_tokens": layer.grid.num_tokens,
            "padded_len": layer.grid.padded_len,
            "heads": layer.heads,
            "head_dim": layer.head_dim,
            "batch": layer.batch,
        },
        dtype=args.dtype,
        sparsity=args.sparsity,
        warmup_calls=args.warmup,
        timed_calls=args.reps,
        parallel_timer="fixed call count, CUDA events per call, median, max over ranks",
        match_rel_l2=MATCH_REL_L2,
        complete=False,
    )
    if rank == 0:
        print(f"{world} ranks, {meta['gpu']}, {layer}; results -> {out}", flush=True)

    def write(rows):
        if rank == 0:
            harness.write_results(out, meta, rows)

    rows = run(args, device, dtype, write)
    meta["complete"] = True
    write(rows)
    if rank == 0:
        print()
        harness.print_table(rows, COLUMNS)
        print(f"\nwrote {out}", flush=True)
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
