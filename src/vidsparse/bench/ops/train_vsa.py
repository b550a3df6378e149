"""VSA, trained: dense against VSA from scratch and as a fine-tune, on real video pixels
(issue 21). One arm per call, each resumable, all arms on the same data::

    python -m vidsparse.bench train_vsa --arm dense --out runs/train_vsa
    python -m vidsparse.bench train_vsa --arm vsa0.875 --out runs/train_vsa
    python -m vidsparse.bench train_vsa --arm vsa0.9 --out runs/train_vsa
    python -m vidsparse.bench train_vsa --arm vsa0.875-warmup --out runs/train_vsa
    python -m vidsparse.bench train_vsa --arm finetune-dense --out runs/train_vsa  # from dense
    python -m vidsparse.bench train_vsa --arm finetune-vsa --out runs/train_vsa    # its end
    python -m vidsparse.bench train_vsa --arm vsa0.875 --out runs/train_vsa --resume
    python -m vidsparse.bench train_vsa --tiny --device cpu --arm dense --out /tmp/tv  # smoke

Model: diffusers' ``WanTransformer3DModel`` from a small config (``MODEL``: 8 blocks, width
768 = 6 heads of 128, FFN 3072, 3 in/out channels, patch 1x2x2), random init from the seed,
trained in pixel space. Text: a fixed zero embedding of 4 tokens (``text_dim`` 64), so the
cross-attention is a learned constant. Data: the shipped clip (``vidsparse.data.load_clip``,
81 frames of 104x180 RGB) cut into random crops of 16 frames x 64 x 128 pixels (16 x 32 x 64 =
32,768 tokens a sample, 512 tiles of 4x4x4) with random horizontal flips and time reversal,
pixels scaled to [-1, 1]. Training crops come from frames 0-64; the held-out set is
``--eval-crops`` fixed crops (seeded positions, no flips) of the last ``--holdout-frames`` (16)
frames, at the noise levels 0.25, 0.5 and 0.75 with fixed noise. Those frames are in no
training crop, but they are the next 0.6 s of the same shot: the same scene and textures, so
the eval loss measures the fit to this clip, not generalisation to other video.

Training: flow matching as Wan (``x_t = (1 - t) x0 + t noise``, the model predicts ``noise -
x0`` at ``timestep = 1000 t``, ``t`` uniform, MSE in float32), AdamW (linear lr warmup, then a
cosine to a tenth of the lr at the arm's last step (or at ``--lr-decay-steps``, then flat), or
``--lr-schedule constant`` as the runs
up to commit d48f07c had it; gradient clipping), bf16 autocast over float32 weights on a GPU
(float32 on the CPU), gradient checkpointing; ``--compile blocks`` compiles each transformer
block for the training steps (regional compilation, as a trainer would; evals and samples run
eagerly). Crops, flips, ``t`` and noise are functions of the seed and the data index (the step; a
fine-tune continues at its init checkpoint's step), so every arm sees the same samples in the
same order, and a resumed arm the samples of an uninterrupted one.

Arms (``ARMS``): ``dense``; ``vsa0.875`` and ``vsa0.9`` from scratch
(``apply_sparse_attention(model, "vsa", sparsity=s, gate=True)``, zero gates, the target from
step 0); ``vsa0.875-warmup`` from scratch too, through ``SparsitySchedule`` from dense to
0.875 (dense for the first 100 steps, then 4 levels over 200); ``finetune-dense`` and
``finetune-vsa`` continue the dense arm's final weights (``--init``, default
``OUT/checkpoints/dense.pt``) with a fresh AdamW, the VSA one through ``SparsitySchedule``
from dense to 0.875 (30 dense steps, 4 levels over 120). ``--schedule-warmup``,
``--schedule-ramp`` and ``--schedule-levels`` set the scheduled arms' dense steps, ramp and
levels.

Measured every ``--eval-every`` steps (and at step 0): the held-out loss (per level and mean),
also of an EMA of the weights (``--ema-decay``, 0.99; 0: none), which smooths out where the
last batch-1 steps happened to leave the weights;
the training loss and the CUDA-synchronised step time (median over the interval); tokens seen,
wall-clock; and per layer, on one held-out sample (crop 0 at t = 0.5), from the q/k/v each
video self-attention call received (``captured_attention``): the dense attention mass VSA
keeps (``kept_mass``: per query, its softmax share of full dense attention in the key tiles
VSA selects for its query tile; the mean over all real queries and heads) and the relative L2
of VSA's attention output (the integration's, gate included) against dense SDPA (float32) on
the same q/k/v. The selection is recomputed with ``block_mean`` and ``topk_lists``. A VSA arm
is measured at its current sparsity; a dense arm "as if" VSA 0.875 were applied to it (the
fine stage alone, as on a stock checkpoint).

Output folder ``OUT`` (``--out DIR``; or a JSON path: the arm's JSON there, the rest beside)::

    OUT/<arm>.json               meta (GPU, versions, commit, config) and one row per eval
    OUT/<arm>_samples.png        20 Euler steps of the flow from noise, 4 frames per sample
    OUT/train_vsa.png            eval loss, step time, kept mass and rel L2 of every arm here
    OUT/checkpoints/<arm>.pt     weights, AdamW and rows: --resume; dense.pt is the fine-tunes'
                                 init (about 1 GB each at full size: do not commit)

``--max-minutes`` bounds a call's training loop (start-up, samples and plots come on top):
when the next step (and eval) would pass it, the arm is checkpointed and stops (``complete:
false`` in its JSON); ``--resume`` continues it with the data, noise and state of an
uninterrupted run, so with its rows: bit for bit on the CPU (tested); on a GPU up to the
kernels' run-to-run differences (atomic-add backward passes; not checked bitwise there).
``--stop-at STEP`` stops at a step. Bad input (an unknown arm, no or a wrong init checkpoint,
a checkpoint of another arm or config, a folder that holds the arm already without
``--resume``) stops before training with one line, exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from vidsparse.bench import harness, registry
from vidsparse.bench.harness import Column
from vidsparse.bench.ops.train_vsa_args import (
    ARMS,
    AS_IF_SPARSITY,
    FINETUNE_ARMS,
    OP,
    SCHEDULES,
    SPARSITY,
    TEXT_TOKENS,
    TILE,
    TrainVsaError,
    check_data,
    complete_args,
)
from vidsparse.bench.ops.train_vsa_data import (
    EVAL_LEVELS,
    load_frames,
    make_eval_set,
    make_inputs,
    mix_seed,
    train_frames,
)
from vidsparse.bench.ops.train_vsa_measure import (
    attention_metrics,
    captured_attention,
    draw_samples,
    plot_curves,
)
from vidsparse.data import CLIP_ATTRIBUTION
from vidsparse.nn import SparsitySchedule
from vidsparse.utils.files import atomic_write

PROVIDERS = ARMS
CHECKPOINT_FORMAT = 2  # 2: with the EMA of the weights
CHECKPOINT_KEYS = ("identity", "step", "steps", "init_step", "model", "optimizer", "ema", "rows",
                   "pending", "totals", "calls")  # fmt: skip
EMA_DECAY = 0.99
EMA_WARMUP = 10  # the EMA's decay after n updates: min(--ema-decay, (1 + n) / (EMA_WARMUP + n))
# Fields of the run an init checkpoint (the dense arm's) must share with a fine-tune.
INIT_FIELDS = ("tiny", "model", "crop", "seed", "holdout_frames", "text_tokens")

COLUMNS = [
    Column("arm", "arm"),
    Column("step", "step"),
    Column("tokens_seen", "tokens"),
    Column("sparsity", "sparsity", ".3f"),
    Column("train_loss", "train loss", ".4f"),
    Column("eval_loss", "eval loss", ".4f"),
    Column("eval_loss_ema", "EMA eval", ".4f"),
    Column("step_ms", "step ms", ".1f"),
    Column("kept_mass_mean", "kept mass", ".3f"),
    Column("attn_rel_l2_mean", "attn rel L2", ".3f"),
]


# ------------------------------------------------------------------------------ model, loss


def text_embeds(args, batch: int, device) -> torch.Tensor:
    return torch.zeros(batch, TEXT_TOKENS, args.model_config["text_dim"], device=device)


def flow_matching_loss(model, x0, text, t, noise) -> torch.Tensor:
    """Wan's objective: at ``x_t = (1 - t) x0 + t noise`` predict the velocity ``noise - x0``."""
    level = t.view(-1, *([1] * (x0.ndim - 1)))
    noisy = (1 - level) * x0 + level * noise
    pred = model(hidden_states=noisy, timestep=t * 1000, encoder_hidden_states=text,
                 return_dict=False)[0]  # fmt: skip
    return F.mse_loss(pred.float(), (noise - x0).float())


def autocast(device):
    if device.type == "cuda":  # bf16 compute, float32 master weights
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_model(args, device, init_state=None):
    """The Wan transformer (seeded init, or ``init_state``'s weights), VSA applied for a VSA
    arm (zero gates at the target; the schedule sets their sparsity every step)."""
    from diffusers import WanTransformer3DModel

    from vidsparse.integrations.diffusers import apply_sparse_attention, compile_for_training

    torch.manual_seed(args.seed)
    model = WanTransformer3DModel(**args.model_config)
    if init_state is not None:
        model.load_state_dict(init_state)
    model.to(device).train()
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    if args.arm in SPARSITY:
        apply_sparse_attention(model, "vsa", sparsity=SPARSITY[args.arm], tile=TILE, gate=True)
    if args.compile == "blocks":
        compile_for_training(model)  # WanTransformerBlock, one graph
    return model


def eager():
    """Evals, metrics and samples run the blocks eagerly: the training step alone is compiled
    (no-grad forwards and the metrics' capture would each need graphs of their own)."""
    return torch.compiler.set_stance("force_eager")


def make_schedule(args) -> SparsitySchedule | None:
    if args.arm in SCHEDULES[args.tiny]:
        return SparsitySchedule(SPARSITY[args.arm], args.schedule_warmup, args.schedule_ramp,
                                args.schedule_levels)  # fmt: skip
    return SparsitySchedule(SPARSITY[args.arm]) if args.arm in SPARSITY else None


LR_SCHEDULES = ("cosine", "constant")
LR_FLOOR = 0.1  # cosine: the last step's lr, as a fraction of --lr


def lr_at(args, step: int) -> float:
    """Linear warmup to ``--lr``, then constant, or a cosine down to ``LR_FLOOR * lr`` at the
    arm's last step (the final weights settle, so the last evals compare arms, not where the
    constant-lr noise of batch-1 steps left each of them), or at ``--lr-decay-steps`` and at
    the floor after it (so the EMA of the last steps averages weights at one lr)."""
    warm = args.lr_warmup
    if step < warm or args.lr_schedule == "constant":
        return args.lr * min(1.0, (step + 1) / max(1, warm))
    progress = min(1.0, (step - warm) / max(1, args.lr_decay_steps - 1 - warm))
    return args.lr * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------------ the run


@dataclass
class Run:
    args: argparse.Namespace
    device: torch.device
    identity: dict
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: SparsitySchedule | None
    frames: torch.Tensor
    eval_set: dict
    init_step: int = 0
    ema: list | None = None  # the EMA of the parameters (float32, model.parameters() order)
    step: int = 0
    rows: list = field(default_factory=list)
    pending: dict = field(default_factory=lambda: {"losses": [], "step_ms": []})
    totals: dict = field(default_factory=lambda: {"wall_s": 0.0, "train_s": 0.0})
    calls: list = field(default_factory=list)
    clock: float = 0.0  # perf_counter at the start of this call's training loop


def wall_s(run: Run) -> float:
    """The arm's wall-clock in its training loops (steps, evals, checkpoints), every call."""
    return run.totals["wall_s"] + time.perf_counter() - run.clock


def sparsity_at(run: Run, step: int) -> float | None:
    return None if run.schedule is None else run.schedule(step)


def train_step(run: Run, step: int) -> tuple[float, float]:
    """One optimiser step at data index ``init_step + step``: ``(loss, milliseconds)``."""
    args, device, model = run.args, run.device, run.model
    x0, noise, t = (x.to(device) for x in make_inputs(run.frames, args, run.init_step + step))
    if run.schedule is not None:
        run.schedule.apply(model, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(args, step)
    harness.synchronize(device)
    start = time.perf_counter()
    with autocast(device):
        loss = flow_matching_loss(model, x0, text_embeds(args, len(x0), device), t, noise)
    loss.backward()
    if args.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    update_ema(run.ema, run.model, args.ema_decay, step)
    value = loss.item()
    harness.synchronize(device)
    return value, (time.perf_counter() - start) * 1e3


def make_ema(model, decay: float) -> list | None:
    """The EMA of ``model``'s parameters, starting at them (None for ``decay`` 0: no EMA)."""
    return [p.detach().float().clone() for p in model.parameters()] if decay > 0 else None


@torch.no_grad()
def update_ema(ema: list | None, model, decay: float, updates: int) -> None:
    """After optimiser step ``updates`` (0-based): ``ema += (1 - d) (weights - ema)`` with
    ``d = min(decay, (1 + updates) / (EMA_WARMUP + updates))``, so the first steps, far from
    the init, are not averaged in at ``decay``'s weight for hundreds of steps."""
    if ema is None:
        return
    d = min(decay, (1 + updates) / (EMA_WARMUP + updates))
    torch._foreach_lerp_(ema, [p.detach().float() for p in model.parameters()], 1 - d)


@contextlib.contextmanager
def ema_weights(run: Run):
    """The model with the EMA's weights in place of its own, restored on exit (in place: the
    compiled blocks and VSA's processors stay as they are)."""
    params = [p.detach() for p in run.model.parameters()]
    saved = [p.clone() for p in params]
    torch._foreach_copy_(params, run.ema)
    try:
        yield
    finally:
        torch._foreach_copy_(params, saved)


@torch.no_grad()
def eval_losses(run: Run) -> dict[str, float]:
    """Held-out loss per noise level (every crop, fixed noise)."""
    args, device, data = run.args, run.device, run.eval_set
    losses = {}
    for level, noise in zip(EVAL_LEVELS, data["noise"]):
        total = 0.0
        for start in range(0, args.eval_crops, args.eval_batch):
            x0 = data["x0"][start : start + args.eval_batch].to(device)
            t = torch.full((len(x0),), level, device=device)
            batch_noise = noise[start : start + args.eval_batch].to(device)
            with autocast(device):
                loss = flow_matching_loss(run.model, x0, text_embeds(args, len(x0), device), t,
                                          batch_noise)  # fmt: skip
            total += float(loss) * len(x0)
        losses[f"{level:g}"] = total / args.eval_crops
    return losses


@torch.no_grad()
def layer_metrics(run: Run, sparsity: float) -> tuple[list[float], list[float]]:
    """Kept mass and attention rel L2 per layer on held-out crop 0 at t = 0.5."""
    args, device = run.args, run.device
    level = EVAL_LEVELS.index(0.5)
    x0 = run.eval_set["x0"][:1].to(device)
    noise = run.eval_set["noise"][level][:1].to(device)
    t = torch.full((1,), 0.5, device=device)
    with captured_attention(run.model) as calls, autocast(device):
        flow_matching_loss(run.model, x0, text_embeds(args, 1, device), t, noise)
    metrics = [attention_metrics(calls[i], sparsity, TILE) for i in sorted(calls)]
    return [m for m, _ in metrics], [r for _, r in metrics]


def evaluate(run: Run) -> dict:
    """The row of step ``run.step``: the interval's training numbers and the held-out ones."""
    start = time.perf_counter()
    with eager():
        row = measure(run, run.step)
    row["eval_s"] = time.perf_counter() - start
    run.pending = {"losses": [], "step_ms": []}
    return row


def measure(run: Run, step: int) -> dict:
    """Held-out losses and the attention metrics at ``step``, with the interval's numbers."""
    args = run.args
    trained = sparsity_at(run, max(step - 1, 0))  # the sparsity the last step trained at
    if run.schedule is not None:
        run.schedule.apply(run.model, max(step - 1, 0))
    losses = eval_losses(run)
    ema_losses = None
    if run.ema is not None:
        with ema_weights(run):
            ema_losses = eval_losses(run)
    metric_sparsity = AS_IF_SPARSITY if trained is None else trained
    mass, rel = layer_metrics(run, metric_sparsity)
    pending = run.pending
    row = {
        "provider": args.arm, "arm": args.arm, "step": step, "global_step": run.init_step + step,
        "tokens_seen": step * args.batch_size * args.tokens, "sparsity": trained,
        "lr": lr_at(args, max(step - 1, 0)), "wall_s": wall_s(run),
        "train_s": run.totals["train_s"],
        "train_loss": statistics.fmean(pending["losses"]) if pending["losses"] else None,
        "train_losses": pending["losses"],
        "step_ms": statistics.median(pending["step_ms"]) if pending["step_ms"] else None,
        "eval_loss": statistics.fmean(losses.values()), "eval_loss_by_t": losses,
        "eval_loss_ema": statistics.fmean(ema_losses.values()) if ema_losses else None,
        "eval_loss_ema_by_t": ema_losses,
        "metric_sparsity": metric_sparsity, "metric_as_if": trained is None,
        "kept_mass": mass, "attn_rel_l2": rel, "kept_mass_mean": statistics.fmean(mass),
        "attn_rel_l2_mean": statistics.fmean(rel),
    }  # fmt: skip
    return row


def report(row: dict) -> None:
    print(
        f"{OP} {row['arm']} step {row['step']}: eval loss {row['eval_loss']:.4f}, "
        f"kept mass {row['kept_mass_mean']:.3f}, attn rel L2 {row['attn_rel_l2_mean']:.3f}"
        + (f", step {row['step_ms']:.1f} ms" if row["step_ms"] is not None else ""),
        flush=True,
    )


def train(run: Run) -> bool:
    """Steps up to ``--steps`` (rows at every eval); False when the budget or ``--stop-at``
    stopped it first (checkpointed)."""
    args = run.args
    run.clock = time.perf_counter()
    budget_s, last_ms, last_eval_s = args.max_minutes * 60, 0.0, 0.0
    if run.step == 0 and not run.rows:
        run.rows.append(evaluate(run))
        report(run.rows[-1])
        last_eval_s = time.perf_counter() - run.clock
    while run.step < args.steps:
        next_eval = (run.step + 1) % args.eval_every == 0 or run.step + 1 == args.steps
        projected = last_ms / 1e3 + (last_eval_s if next_eval else 0.0)
        elapsed = time.perf_counter() - run.clock
        stop = args.stop_at is not None and run.step >= args.stop_at
        if stop or elapsed + projected > budget_s:
            return False
        loss, last_ms = train_step(run, run.step)
        run.step += 1
        run.pending["losses"].append(loss)
        run.pending["step_ms"].append(last_ms)
        run.totals["train_s"] += last_ms / 1e3
        if next_eval:
            eval_start = time.perf_counter()
            run.rows.append(evaluate(run))
            report(run.rows[-1])
            if run.step < args.steps:  # the last one is finish's
                save_checkpoint(run)
            last_eval_s = time.perf_counter() - eval_start
    return True


# ------------------------------------------------------------------------------ checkpoints


def checkpoint_path(out_dir: Path, arm: str) -> Path:
    return out_dir / "checkpoints" / f"{arm}.pt"


def flat(prefix: str, value) -> dict:
    """Nested JSON as ``{"a.b": leaf}``: mismatches are named field by field."""
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in flat(f"{prefix}{key}.", item).items()
        }
    return {prefix[:-1]: value}


def run_identity(args, init: dict | None) -> dict:
    """What a checkpoint must share with the command that resumes it (``--steps`` may grow
    under a constant lr, or past ``--lr-decay-steps``)."""
    schedule = make_schedule(args)
    identity = {
        "arm": args.arm, "tiny": args.tiny, "model": args.model_config, "crop": args.crop,
        "text_tokens": TEXT_TOKENS, "seed": args.seed, "batch_size": args.batch_size,
        "lr": args.lr, "lr_warmup": args.lr_warmup, "lr_schedule": args.lr_schedule,
        # the cosine's span: a resume must keep it (constant: the steps may grow)
        "lr_steps": args.lr_decay_steps if args.lr_schedule == "cosine" else None,
        "weight_decay": args.weight_decay, "ema_decay": args.ema_decay,
        "max_grad_norm": args.max_grad_norm, "eval_every": args.eval_every,
        "eval_crops": args.eval_crops, "holdout_frames": args.holdout_frames,
        "compile": args.compile, "init": init,
        "schedule": None if schedule is None else schedule.state_dict(),
    }  # fmt: skip
    return json.loads(json.dumps(identity))  # tuples as lists, as a checkpoint holds them


def differences(saved: dict, now: dict, keys=None) -> str:
    saved, now = flat("", saved), flat("", now)
    names = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    names = [k for k in names if keys is None or k.split(".")[0] in keys]
    return "; ".join(f"{k} {saved.get(k)!r} there, {now.get(k)!r} here" for k in names)


def read_checkpoint(path: Path, what: str) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same bad input
        message = f"{what} {path} is not a {OP} checkpoint ({type(exc).__name__})"
        raise TrainVsaError(message) from None
    if not isinstance(state, dict) or state.get("benchmark") != OP:
        raise TrainVsaError(f"{what} {path} is not a {OP} checkpoint")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise TrainVsaError(
            f"{what} {path} has format {state.get('format')!r}, not {CHECKPOINT_FORMAT}"
        )
    missing = [key for key in CHECKPOINT_KEYS if key not in state]
    if missing or not isinstance(state["identity"], dict):
        raise TrainVsaError(f"{what} {path} is an incomplete {OP} checkpoint (no {missing})")
    return state


def load_init(args) -> tuple[dict, int, dict]:
    """The dense weights a fine-tune starts from: ``(state_dict, step, what identifies them)``."""
    path = Path(args.init) if args.init else checkpoint_path(args.out_dir, "dense")
    if not path.is_file():
        raise TrainVsaError(
            f"--arm {args.arm} continues a dense checkpoint: {path} does not exist (run --arm "
            "dense into this --out first, or pass --init CHECKPOINT)"
        )
    state = read_checkpoint(path, "--init")
    arm = state["identity"].get("arm")
    if arm != "dense":
        raise TrainVsaError(f"--init {path} is a checkpoint of arm {arm!r}, not of the dense arm")
    mismatch = differences(state["identity"], run_identity(args, None), INIT_FIELDS)
    if mismatch:
        raise TrainVsaError(f"--init {path} is of another config: {mismatch}")
    if args.init is None and state["step"] < state["steps"]:
        raise TrainVsaError(
            f"the dense arm in {path} is at step {state['step']} of {state['steps']}: finish it "
            f"(--arm dense --resume), or pass --init {path} to start from it as it is"
        )
    digest = hashlib.sha256(json.dumps(state["identity"], sort_keys=True).encode()).hexdigest()
    return state["model"], state["step"], {"file": path.name, "step": state["step"],
                                           "identity_sha256": digest[:16]}  # fmt: skip


def resume_state(args) -> dict | None:
    """The arm's checkpoint for ``--resume`` (None without it); refuses a folder that holds
    the arm already unless resumed."""
    path = checkpoint_path(args.out_dir, args.arm)
    if not args.resume:
        if path.exists():
            raise TrainVsaError(
                f"{args.out_dir} holds a run of arm {args.arm} already ({path}): pass --resume "
                "to continue it, or another --out"
            )
        return None
    if not path.is_file():
        raise TrainVsaError(f"--resume: {path} does not exist (nothing to continue)")
    state = read_checkpoint(path, "--resume")
    mismatch = differences(
        {k: v for k, v in state["identity"].items() if k != "init"},
        {k: v for k, v in run_identity(args, None).items() if k != "init"},
    )
    if mismatch:
        raise TrainVsaError(f"--resume {path} is a checkpoint of another run: {mismatch}")
    if state["step"] > args.steps:
        raise TrainVsaError(f"--steps {args.steps} is below the checkpoint's step {state['step']}")
    return state


def save_checkpoint(run: Run) -> None:
    """Everything a resumed call needs, written atomically; the dense arm's is the fine-tunes'
    init."""
    state = {
        "format": CHECKPOINT_FORMAT, "benchmark": OP, "identity": run.identity, "step": run.step,
        "steps": run.args.steps, "init_step": run.init_step, "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(), "ema": run.ema, "rows": run.rows,
        "pending": run.pending,
        "totals": {**run.totals, "wall_s": wall_s(run)}, "calls": run.calls,
    }  # fmt: skip
    path = checkpoint_path(run.args.out_dir, run.args.arm)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(state, f))


def restore(run: Run, state: dict) -> None:
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    if state["ema"] is not None:
        run.ema = [t.to(run.device) for t in state["ema"]]
    run.step, run.rows, run.pending = state["step"], state["rows"], state["pending"]
    run.totals, run.calls = state["totals"], state["calls"]


# ------------------------------------------------------------------------------ outputs


@torch.no_grad()
@eager()
def generate(run: Run) -> torch.Tensor:
    """``--samples`` videos from seeded noise by ``--sample-steps`` Euler steps of the flow
    (t from 1 to 0, ``dx/dt`` = the predicted velocity), in [-1, 1] on the CPU."""
    args, device = run.args, run.device
    generator = torch.Generator().manual_seed(mix_seed(args.seed, "samples"))
    x = torch.randn(args.samples, 3, *args.crop, generator=generator).to(device)
    text = text_embeds(args, args.samples, device)
    levels = torch.linspace(1.0, 0.0, args.sample_steps + 1).tolist()
    for t, t_next in zip(levels[:-1], levels[1:]):
        timestep = torch.full((args.samples,), t * 1000, device=device)
        with autocast(device):
            velocity = run.model(hidden_states=x, timestep=timestep, encoder_hidden_states=text,
                                 return_dict=False)[0]  # fmt: skip
        x = x + (t_next - t) * velocity.float()
    return x.clamp(-1, 1).cpu()


def metadata(run: Run, complete: bool) -> dict:
    args, device = run.args, run.device
    f, h, w = args.crop
    patch = args.model_config["patch_size"]
    return harness.collect_metadata(
        device, benchmark=OP, arm=args.arm, complete=complete, tiny=args.tiny,
        dtype="bf16 autocast over float32 weights" if device.type == "cuda" else "float32",
        model={"class": "diffusers.WanTransformer3DModel", **args.model_config,
               "parameters": sum(p.numel() for p in run.model.parameters())},
        crop_pixels=[f, h, w], latent_grid=[f // patch[0], h // patch[1], w // patch[2]],
        tokens_per_sample=args.tokens, tile=list(TILE), batch_size=args.batch_size,
        steps=args.steps, step=run.step, lr=args.lr, lr_warmup=args.lr_warmup,
        lr_schedule=args.lr_schedule, lr_floor=LR_FLOOR if args.lr_schedule == "cosine" else None,
        lr_decay_steps=args.lr_decay_steps if args.lr_schedule == "cosine" else None,
        weight_decay=args.weight_decay, ema_decay=args.ema_decay, ema_warmup=EMA_WARMUP,
        max_grad_norm=args.max_grad_norm,
        gradient_checkpointing=args.gradient_checkpointing, compile=args.compile, seed=args.seed,
        sparsity=SPARSITY.get(args.arm), schedule=run.identity["schedule"],
        init=run.identity["init"], init_step=run.init_step, calls=run.calls,
        data={"clip": CLIP_ATTRIBUTION, "pixels": "[-1, 1]",
              "train_frames": list(train_frames(args)), "augment": "random crop, horizontal "
              "flip, time reversal", "text": f"{TEXT_TOKENS} zero text tokens"},
        eval={"crops": args.eval_crops, "starts_tyx": run.eval_set["starts"],
              "frames": [args.clip_frames - args.holdout_frames, args.clip_frames],
              "levels": list(EVAL_LEVELS), "note": "held-out frames are in no training crop, "
              "but they are the same shot (the next frames): fit to this clip, not "
              "generalisation"},
        metrics={"kept_mass": "per query, its dense softmax mass in the key tiles VSA selects "
                 "for its query tile (block_mean + topk_lists on the layer's q/k), mean over "
                 "real queries and heads", "attn_rel_l2": "||o_vsa - o_dense|| / ||o_dense||, "
                 "o_dense float32 SDPA on the same q/k/v", "sample": "held-out crop 0, t = 0.5",
                 "as_if": f"dense arms: VSA {AS_IF_SPARSITY} without a gate on their q/k/v",
                 "step_ms": "CUDA-synchronised optimiser step (EMA update included), median "
                 "over the interval", "eval_loss_ema": "the held-out loss of the EMA of the "
                 "weights (decay min(ema_decay, (1 + n) / (ema_warmup + n)) after n steps)"},
    )  # fmt: skip


def finish(run: Run, complete: bool) -> list[dict]:
    """Checkpoint, JSON, samples (a finished arm) and the plot of all arms in the folder."""
    args = run.args
    run.calls[-1]["end_step"] = run.step
    save_checkpoint(run)
    where = harness.device_name(run.device)
    if complete:
        png = args.out_dir / f"{args.arm}_samples.png"
        title = f"{OP} {args.arm}: {args.sample_steps} Euler steps, step {run.step} ({where})"
        draw_samples(png, generate(run), run.eval_set["x0"][0], title)
        print(f"wrote {png}", flush=True)
    harness.write_results(args.json_path, metadata(run, complete), run.rows)
    print(f"wrote {args.json_path}", flush=True)
    if args.plot:
        plot = args.out_dir / f"{OP}.png"
        title = f"{OP}: Wan, {args.tokens} tokens a sample, {where}"
        plot_curves(args.out_dir, plot, title, OP, ARMS)
        print(f"wrote {plot}", flush=True)
    harness.print_table(run.rows, COLUMNS)
    if not complete:
        print(f"{OP} {args.arm}: stopped at step {run.step} of {args.steps}; continue with "
              "--resume", flush=True)  # fmt: skip
    return run.rows


# ------------------------------------------------------------------------------ the command


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=f"python -m vidsparse.bench {OP}", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add = ap.add_argument
    add("--arm", default="dense", help=f"one of {', '.join(ARMS)} (default %(default)s)")
    add("--out", help=f"output folder, or a JSON path (default benchmarks/results/{OP})")
    add("--tiny", action="store_true", help="2 blocks of width 64, small crops (CPU)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--seed", type=int, default=0)
    add("--steps", type=int, help="optimiser steps of the arm (600; fine-tunes 300)")
    add("--batch-size", type=int, default=1, help="crops a step")
    add("--lr", type=float, help="AdamW's lr after warmup (3e-4)")
    add("--lr-warmup", type=int, help="steps of linear lr warmup (50)")
    add(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default="cosine",
        help=f"after warmup: cosine to {LR_FLOOR:g} lr at the last step (default), or constant",
    )
    add("--lr-decay-steps", type=int,
        help="cosine: the lr reaches its floor here and stays (default: --steps)")  # fmt: skip
    add("--weight-decay", type=float, default=0.01)
    add("--ema-decay", type=float, default=EMA_DECAY,
        help="the evals also run an EMA of the weights with this decay (0: no EMA)")  # fmt: skip
    add("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    add("--eval-every", type=int, help="steps between evals (50)")
    add("--eval-crops", type=int, help="held-out crops (8)")
    add("--eval-batch", type=int, default=4, help="held-out crops a forward")
    add("--holdout-frames", type=int, help="last frames of the clip kept for eval (16)")
    add("--schedule-warmup", type=int,
        help="vsa0.875-warmup, finetune-vsa: dense steps first (100, 30)")  # fmt: skip
    add("--schedule-ramp", type=int,
        help="vsa0.875-warmup, finetune-vsa: steps of the levels (200, 120)")  # fmt: skip
    add("--schedule-levels", type=int,
        help="vsa0.875-warmup, finetune-vsa: sparsity levels (4)")  # fmt: skip
    add(
        "--init",
        help="fine-tunes: the dense checkpoint to start from (default "
        "OUT/checkpoints/dense.pt; --resume continues from its own)",
    )
    add("--resume", action="store_true", help="continue OUT/checkpoints/<arm>.pt")
    add("--max-minutes", type=float, help="training loop budget of this call (8)")
    add("--stop-at", type=int, help="stop (checkpointed) at this step")
    add("--samples", type=int, help="generated videos at the end (2)")
    add("--sample-steps", type=int, help="Euler steps of each (20)")
    add("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    add("--compile", choices=("none", "blocks"), default="none",
        help="blocks: torch.compile each transformer block for the training steps (diffusers' "
        "compile_repeated_blocks, fullgraph); evals and samples run eagerly")  # fmt: skip
    add("--no-plot", dest="plot", action="store_false", help="no train_vsa.png")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return complete_args(build_parser().parse_args(argv))


def prepare(args, device: torch.device) -> Run:
    """Every check, then the model, optimiser, data and (``--resume``) the saved state."""
    frames = load_frames()
    args.clip_frames = frames.shape[1]
    check_data(args, frames)
    saved = resume_state(args)
    init_state, init_step, init = None, 0, None
    if saved is not None:
        init_step, init = saved["init_step"], saved["identity"]["init"]
    elif args.arm in FINETUNE_ARMS:
        init_state, init_step, init = load_init(args)
    model = build_model(args, device, init_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  fused=device.type == "cuda")  # fmt: skip
    ema = make_ema(model, args.ema_decay)
    run = Run(args, device, run_identity(args, init), model, optimizer, make_schedule(args),
              frames, make_eval_set(frames, args), init_step, ema)  # fmt: skip
    if saved is not None:
        restore(run, saved)
    run.calls.append({"start_step": run.step, "device": harness.device_name(device)})
    return run


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        # The reference path, not the Triton interpreter (tests set TRITON_INTERPRET=1).
        os.environ.setdefault("VIDSPARSE_BACKEND", "torch")
        if not args.tiny:
            raise TrainVsaError("the full-size experiment needs a GPU; use --tiny on the CPU")
    registry.require(OP, args.arm, device)
    run = prepare(args, device)
    start = time.perf_counter()
    complete = train(run)
    run.calls[-1]["wall_s"] = round(time.perf_counter() - start, 1)
    return finish(run, complete)


if __name__ == "__main__":
    main()
