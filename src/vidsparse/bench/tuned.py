"""A tuning file against the library's defaults, in one run on the GPU it was made for.

``vidsparse tune`` writes a tuning file for a shape; this benchmark times the library's public
ops at that shape twice over, alternately: with the tables' defaults (the file set aside,
``tuning_file.suspended``) and as a user runs them, the file loaded from
``$VIDSPARSE_TUNING_FILE`` (``--tuning-file``). Cases:

- ``engine BQxBK``: ``block_sparse_attn`` on random lists of the shape's density (each block
  size of ``--blocks`` except VSA's 64x64, which the VSA case covers masked);
- ``vsa``: ``video_sparse_attn`` on the model's latent grid, natural order, with a gate, at
  ``--sparsity`` (its tile means, coarse top-k and the engine's 64x64 masked kernels).

Per case and mode (fwd, fwd+bwd): both configs' milliseconds (the mean of the two rounds of
``harness.time_ms``), ``speedup`` = default ms / tuned ms, and the tuned output's relative L2
against the default's (the same inputs). The JSON also lists, per kernel of the shape, whether
the file's entry applied and why not. Run on a GPU::

    vidsparse tune --model wan2.1-1.3b --resolution 480p --out t.json
    python -m vidsparse.bench tuned --tuning-file t.json --model wan2.1-1.3b --resolution 480p
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from vidsparse.bench import harness
from vidsparse.bench.harness import Column
from vidsparse.bench.tune import (
    DEFAULT_BLOCKS,
    TuneOptions,
    TuneUsageError,
    add_shape_arguments,
    configs_for_key,
    parse_blocks,
    plan_jobs,
    shape_from_args,
)
from vidsparse.bench.tune_workloads import KERNEL_CHOICES, key_block_sizes, seq_len
from vidsparse.testing import rel_l2
from vidsparse.utils import tuning_file
from vidsparse.utils.device import target_of

PROVIDERS = ("default", "tuned")
ROUNDS = 2  # default, tuned, default, tuned: drift between them shows in both
COLUMNS = [
    Column("case", "case"),
    Column("mode", "mode"),
    Column("default_ms", "default ms", ".3f"),
    Column("tuned_ms", "tuned ms", ".3f"),
    Column("speedup", "default / tuned", ".3f"),
    Column("rel_l2", "rel L2 vs default", ".1e"),
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tuning-file", required=True, help="the file vidsparse tune wrote")
    add_shape_arguments(ap)
    ap.add_argument("--modes", default="fwd,fwd+bwd", help="comma list of fwd, bwd, fwd+bwd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default results/tuned_<gpu>.json)")
    return ap


def make_inputs(shape, device, dtype, seed):
    """q, k, v ``[B, H, S, D]`` of ``shape`` at length ``S`` (the benchmark's input builder)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, H, D = shape.batch, shape.heads, shape.head_dim

    def randn(S):
        return torch.randn(B, H, S, D, device=device, dtype=dtype, generator=gen)

    return randn


def engine_case(shape, block, randn, device, seed):
    """``block_sparse_attn`` on the shape's tokens padded to whole blocks (the tuner's engine
    inputs: ``seq_len``, key-block sizes where the job is masked)."""
    import vidsparse
    from vidsparse.masks.block_sparse import random_block_lists

    bq, bk = block
    S = seq_len(shape, block)
    masked = shape.grid is None and shape.masked
    sizes = key_block_sizes(shape, bk, S, device) if masked else None
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    B, H = shape.batch, shape.heads
    idx, cnt = random_block_lists(
        B, H, S // bq, S // bk, density=shape.density, generator=gen, device=device
    )

    def forward(q, k, v):
        return vidsparse.block_sparse_attn(
            q, k, v, idx, cnt, block_size=block, kv_block_sizes=sizes
        )

    return forward, (randn(S), randn(S), randn(S))


def vsa_case(shape, randn):
    """``video_sparse_attn`` on the model's grid (natural order, with a gate)."""
    import vidsparse
    from vidsparse.layout.grid import VideoGrid

    grid = VideoGrid(shape.grid)
    sparsity = 1.0 - shape.density

    def forward(q, k, v, gate):
        return vidsparse.video_sparse_attn(q, k, v, grid, gate=gate, sparsity=sparsity)

    n = grid.num_tokens
    return forward, (randn(n), randn(n), randn(n), randn(n))


def cases(shape, blocks, device, dtype, seed) -> list[tuple[str, object, tuple]]:
    randn = make_inputs(shape, device, dtype, seed)
    out = []
    for block in blocks:
        if shape.grid is not None and block == (64, 64):
            continue  # VSA's tiles: the vsa case runs these kernels masked, as a model does
        out.append(
            (f"engine {block[0]}x{block[1]}", *engine_case(shape, block, randn, device, seed))
        )
    if shape.grid is not None:
        out.append(("vsa", *vsa_case(shape, randn)))
    return out


def time_both(forward, inputs, mode, device) -> dict:
    """Both configs' ms (mean over ROUNDS, alternating) and the tuned output's rel L2."""
    with tuning_file.suspended():
        default_fn = harness.mode_callable(forward, inputs, mode)
    tuned_fn = harness.mode_callable(forward, inputs, mode)
    times = {"default": [], "tuned": []}
    for _ in range(ROUNDS):
        with tuning_file.suspended():
            times["default"].append(harness.time_ms(default_fn, device=device))
        times["tuned"].append(harness.time_ms(tuned_fn, device=device))
    row = {f"{k}_ms": sum(v) / len(v) for k, v in times.items()}
    row.update({f"{k}_ms_rounds": v for k, v in times.items()})
    row["speedup"] = row["default_ms"] / row["tuned_ms"]
    row["rel_l2"] = _output_rel_l2(forward, inputs)
    return row


def _output_rel_l2(forward, inputs) -> float:
    with torch.no_grad():
        with tuning_file.suspended():
            ref = forward(*inputs)
        out = forward(*inputs)
    return rel_l2(out, ref)


def entries_in_effect(shape, blocks, target) -> list[dict]:
    """Per kernel of the shape: whether the file's entry applies (the library's own check)."""
    rows = []
    for job in plan_jobs(TuneOptions(shape, blocks, KERNEL_CHOICES)):
        default, in_effect = configs_for_key(target, job.key)
        applies, why = tuning_file.entry_status(target, job.key, default)
        rows.append({
            "kernel": job.describe(), "tuned_applies": applies, "why_not": why,
            "changed": in_effect != default,
        })  # fmt: skip
    return rows


def load_file(path: str, device) -> tuple:
    """Point the library at ``path`` and load it as a user's process would."""
    os.environ[tuning_file.ENV_VAR] = str(Path(path).expanduser().resolve())
    tuning_file.reload()
    target = target_of(device)
    state = tuning_file.loaded(target)
    if state.status != "in effect":
        raise TuneUsageError(f"{path}: tuning file {state.status} ({state.reason})")
    return target, state


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    try:
        modes = harness.split_choices(args.modes, harness.MODES, "mode")
        if not torch.cuda.is_available():
            raise TuneUsageError("no GPU visible: a tuning file is for the GPU it was made on")
        blocks = parse_blocks(args.blocks) if args.blocks else DEFAULT_BLOCKS
        shape = shape_from_args(args, (*blocks, (64, 64)))
        if shape is None:
            raise TuneUsageError("give --model NAME or an explicit shape (--seq S ...)")
        device = torch.device("cuda", torch.cuda.current_device())
        target, state = load_file(args.tuning_file, device)
    except (TuneUsageError, ValueError) as exc:
        print(f"vidsparse bench tuned: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    dtype = torch.bfloat16
    rows = []
    for name, forward, inputs in cases(shape, blocks, device, dtype, args.seed):
        for mode in modes:
            row = {"case": name, "mode": mode, **time_both(forward, inputs, mode, device)}
            print(f"tuned {name} {mode}: default {row['default_ms']:.3f} ms, tuned "
                  f"{row['tuned_ms']:.3f} ms ({row['speedup']:.3f}x)", flush=True)  # fmt: skip
            rows.append(row)
        harness.release_memory(device)
    meta = harness.collect_metadata(
        device, benchmark="tuned", dtype=str(dtype), shape=shape.describe(), blocks=blocks,
        tuning_file=str(state.path), tuning_identity=state.file_identity,
        entries=entries_in_effect(shape, blocks, target), modes=modes, rounds=ROUNDS,
        speedup="default ms / tuned ms, the same inputs, the same process, alternating",
    )  # fmt: skip
    out = args.out or harness.results_dir() / f"tuned_{harness.slug(meta['gpu'])}.json"
    harness.report_results(out, meta, rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
