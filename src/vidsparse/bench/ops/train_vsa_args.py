"""train_vsa's arms and options: their defaults and every check made before a run starts
(``complete_args``), so bad input stops with one line and nothing written."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from vidsparse.bench import harness
from vidsparse.bench.runner import BenchUsageError

OP = "train_vsa"
ARMS = ("dense", "vsa0.875", "vsa0.9", "vsa0.875-warmup", "finetune-dense", "finetune-vsa")
FINETUNE_ARMS = ("finetune-dense", "finetune-vsa")
# the VSA arms' targets
SPARSITY = {"vsa0.875": 0.875, "vsa0.9": 0.9, "vsa0.875-warmup": 0.875, "finetune-vsa": 0.875}
AS_IF_SPARSITY = 0.875  # dense arms: the attention metrics of VSA 0.875 on their q/k/v
TILE = (4, 4, 4)
TEXT_TOKENS = 4
WAN = {"patch_size": (1, 2, 2), "in_channels": 3, "out_channels": 3, "cross_attn_norm": True,
       "qk_norm": "rms_norm_across_heads"}  # fmt: skip
MODEL = {**WAN, "num_attention_heads": 6, "attention_head_dim": 128, "num_layers": 8,
         "ffn_dim": 3072, "text_dim": 64, "freq_dim": 256, "rope_max_seq_len": 1024}  # fmt: skip
TINY_MODEL = {**WAN, "num_attention_heads": 2, "attention_head_dim": 32, "num_layers": 2,
              "ffn_dim": 128, "text_dim": 16, "freq_dim": 32, "rope_max_seq_len": 64}  # fmt: skip
# Pixels (frames, height, width). Tiny: 4 x 10 x 12 tokens, tiles partial along the height.
CROP, TINY_CROP = (16, 64, 128), (4, 20, 24)
DEFAULTS = {
    False: dict(steps=600, finetune_steps=300, eval_every=50, lr=3e-4, lr_warmup=50,
                eval_crops=8, holdout_frames=16, samples=2, sample_steps=20, max_minutes=8.0),
    True: dict(steps=4, finetune_steps=4, eval_every=2, lr=2e-3, lr_warmup=1, eval_crops=2,
               holdout_frames=8, samples=1, sample_steps=2, max_minutes=10.0),
}  # fmt: skip
# The scheduled arms' (dense steps, ramp steps, levels) by default, full size and --tiny: a
# fine-tune leaves dense weights quickly; from scratch, the model first learns dense attention.
SCHEDULES = {
    False: {"vsa0.875-warmup": (100, 200, 4), "finetune-vsa": (30, 120, 4)},
    True: {"vsa0.875-warmup": (1, 2, 2), "finetune-vsa": (1, 2, 2)},
}


class TrainVsaError(BenchUsageError):
    """Bad input found before training: one line, exit status 2 through the runner."""


POSITIVE = ("steps", "batch_size", "eval_every", "eval_crops", "eval_batch", "samples",
            "sample_steps", "schedule_levels")  # fmt: skip
SCHEDULE_ARGS = ("schedule_warmup", "schedule_ramp", "schedule_levels")


def set_schedule_defaults(args) -> None:
    """The scheduled arms' defaults (``SCHEDULES``); the schedule's options refused elsewhere,
    where nothing would read them."""
    given = [k for k in SCHEDULE_ARGS if getattr(args, k) is not None]
    defaults = SCHEDULES[args.tiny].get(args.arm)
    if defaults is None:
        if given:
            raise TrainVsaError(
                f"--{given[0].replace('_', '-')} sets a sparsity schedule, which only "
                f"{' and '.join(SCHEDULES[False])} have (arm {args.arm!r})"
            )
        defaults = (0, 0, 1)
    for key, value in zip(SCHEDULE_ARGS, defaults):
        if getattr(args, key) is None:
            setattr(args, key, value)


def check_data(args, frames: torch.Tensor) -> None:
    _, count, height, width = frames.shape
    f, h, w = args.crop
    if args.holdout_frames < f or count - args.holdout_frames < f:
        raise TrainVsaError(
            f"--holdout-frames {args.holdout_frames} must leave {f}-frame crops on both sides "
            f"of the clip's {count} frames"
        )
    if h > height or w > width:
        raise TrainVsaError(f"crops of {h}x{w} do not fit the clip's {height}x{width} frames")


def complete_args(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults of ``args``' arm and size filled in, every check made, the paths set:
    ``TrainVsaError`` (one line) on bad input, before anything runs."""
    if args.arm not in ARMS:
        raise TrainVsaError(f"unknown arm {args.arm!r}; choose from {', '.join(ARMS)}")
    for key, value in DEFAULTS[args.tiny].items():
        if key != "finetune_steps" and getattr(args, key, None) is None:
            setattr(args, key, value)
    set_schedule_defaults(args)
    if args.steps is None:
        args.steps = DEFAULTS[args.tiny][
            "steps" if args.arm not in FINETUNE_ARMS else "finetune_steps"
        ]
    if args.lr_decay_steps is None:
        args.lr_decay_steps = args.steps
    elif not args.lr_warmup < args.lr_decay_steps <= args.steps:
        raise TrainVsaError(
            f"--lr-decay-steps must be above --lr-warmup ({args.lr_warmup}) and at most --steps "
            f"({args.steps}), got {args.lr_decay_steps}"
        )
    if not 0 <= args.ema_decay < 1:
        raise TrainVsaError(f"--ema-decay must be in [0, 1), got {args.ema_decay}")
    bad = [k for k in POSITIVE if getattr(args, k) < 1]
    bad += [k for k in ("lr_warmup", "schedule_warmup", "schedule_ramp") if getattr(args, k) < 0]
    if bad:
        raise TrainVsaError(
            f"--{bad[0].replace('_', '-')} must be at least {int(bad[0] in POSITIVE)}"
        )
    scheduled = SCHEDULES[args.tiny].get(args.arm)
    if scheduled and args.schedule_warmup + args.schedule_ramp >= args.steps:
        raise TrainVsaError(
            f"the schedule never reaches sparsity {SPARSITY[args.arm]}: --schedule-warmup "
            f"({args.schedule_warmup}) + --schedule-ramp ({args.schedule_ramp}) must be below "
            f"--steps ({args.steps})"
        )
    args.model_config = TINY_MODEL if args.tiny else MODEL
    args.crop = TINY_CROP if args.tiny else CROP
    patch = args.model_config["patch_size"]
    args.tokens = math.prod(c // p for c, p in zip(args.crop, patch))
    out = Path(args.out) if args.out else harness.results_dir() / OP
    args.out_dir, args.json_path = (
        (out.parent, out) if out.suffix == ".json" else (out, out / f"{args.arm}.json")
    )
    return args
