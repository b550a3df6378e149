"""Fine-tune a diffusers video transformer with VSA: a sparsity schedule from dense to the
target, trainable gates, the flow-matching loss the model was trained with.

    python examples/finetune_vsa.py --make-tiny-data data/tiny 8             # random clips
    python examples/finetune_vsa.py --tiny --data data/tiny --output runs/tiny   # CPU, seconds
    python examples/finetune_vsa.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --data latents/ --output runs/wan --target-sparsity 0.875              # one GPU
    accelerate launch --num-processes 8 examples/finetune_vsa.py ...          # data parallel
    python examples/finetune_vsa.py ... --resume runs/wan/checkpoints/step-001000

Data: a folder of ``*.safetensors`` files, one per clip, each holding two tensors:

- ``latents`` ``[C, T, H, W]``: the clip's VAE latents as the transformer sees them (Wan:
  ``(vae.encode(video).latent_dist.mode() - latents_mean) / latents_std``, per channel, the
  inverse of what ``WanPipeline`` does before decoding);
- ``text_embeds`` ``[L, D_text]``: the text encoder's output for its caption (Wan:
  ``pipe.encode_prompt(caption, do_classifier_free_guidance=False,
  max_sequence_length=512)[0][0]``, zero-padded to 512 tokens as the pipeline feeds them).

Every clip has the same shapes (they are batched; cut or resize the videos to one resolution
and frame count first). ``C``, ``D_text`` and the patch divisibility of ``H`` and ``W`` are
checked against the model before training.

Training: Wan's flow matching (``x_t = (1 - t) x0 + t noise``, the model predicts ``noise -
x0`` at ``timestep = t * 1000``), MSE in float32; ``t`` uniform on [0, 1) by default, or
``--timestep-sampling logit-normal``. VSA: ``apply_sparse_attention(model, "vsa",
sparsity=target, gate=True)`` (zero gates: step 0 is the fine stage alone, dense at sparsity
0), and ``SparsitySchedule.apply(model, step)`` before each step. ``--train all`` (default)
or ``--train gates``; AdamW, gradient clipping, gradient checkpointing; ``--compile``
compiles each transformer block (a VSA step is otherwise bound by its launches). ``--method dense``:
the stock model with the same loss, data and seed, the baseline to compare with.

``accelerate`` places the model and runs the processes: on a GPU the weights stay float32 (the
master copy AdamW updates) and the forward runs under bf16 autocast; on the CPU all is float32.
Under ``accelerate launch`` each process takes its own clips of every step (data parallel);
``--sequence-parallel N`` shards each clip's tokens over groups of ``N`` processes (Ulysses).

Output folder::

    loss.jsonl                         one line per step: step, loss, sparsity, lr, seconds
    checkpoints/step-000010/           after 10 steps (every --checkpoint-every, and the last)
        training_state.json            the step and the run's model, method, schedule, data
        transformer/ | gates.safetensors   save_pretrained (--train all) | the gates alone
        optimizer.pt  rng-<process>.pt     AdamW's state; the torch RNG states
    final/transformer/                 save_pretrained of the trained transformer

Noise, ``t`` and the clip order are functions of the seed, the step and the process, so
``--resume CHECKPOINT`` continues with exactly the losses of an uninterrupted run (bit for
bit on the CPU). It takes the command line of the run (``--max-steps`` may grow), and refuses
a checkpoint of another model config, method, schedule or data set. Load the result with the
diffusers integration's lifecycle::

    transformer = WanTransformer3DModel.from_pretrained("runs/wan/final/transformer")
    load_sparse_attention(transformer, "runs/wan/final/transformer")   # gates and options

Bad input (clips of mismatched shapes or without ``text_embeds``, a schedule that never
reaches its target within ``--max-steps``, a checkpoint of another run, an output folder
holding a run) stops before training with one error naming it (exit 2), nothing written.
``--tiny``: a 2-layer random-weight Wan for ``--make-tiny-data``'s clips. More, and what is
measured elsewhere: ``docs/training.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import WanTransformer3DModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from vidsparse.integrations.diffusers import (
    apply_sequence_parallel,
    apply_sparse_attention,
    compile_for_training,
    load_sparse_attention,
    remove_sparse_attention,
)
from vidsparse.nn import SparsitySchedule, VSAGate
from vidsparse.parallel import UlyssesAttention

MODEL_CLASS = WanTransformer3DModel  # Wan first: its forward takes latents, timestep, text
TINY_TRANSFORMER = {  # two heads of 16, two layers; text_dim 24 (tests/integrations/tiny_models)
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16,
    "num_layers": 2, "in_channels": 4, "out_channels": 4, "text_dim": 24, "freq_dim": 32,
    "ffn_dim": 64, "rope_max_seq_len": 64,
}  # fmt: skip
# --make-tiny-data's clips, for --tiny: 3 x 8 x 10 latent tokens, partial 4 x 4 x 4 tiles.
TINY_CLIP = {"latents": (4, 3, 16, 20), "text_embeds": (16, 24)}
TENSORS = ("latents", "text_embeds")
TILE = (4, 4, 4)
# Options whose default depends on --tiny (a short run on the CPU) or not (a real fine-tune).
DEFAULTS = {
    True: dict(max_steps=20, lr=3e-3, target_sparsity=0.5, warmup_steps=2, ramp_steps=8,
               num_levels=2, checkpoint_every=10),
    False: dict(max_steps=4000, lr=1e-5, target_sparsity=0.875, warmup_steps=500,
                ramp_steps=2000, num_levels=4, checkpoint_every=500),
}  # fmt: skip
STATE_FILE, LOSS_LOG = "training_state.json", "loss.jsonl"
CHECKPOINT_FORMAT = 1


class RecipeError(ValueError):
    """Bad input found before training: the message names the problem (the CLI exits 2)."""


# ------------------------------------------------------------------------------ data


@dataclasses.dataclass(frozen=True)
class Clips:
    """The clip files of a data folder and the shapes they all share."""

    files: tuple[Path, ...]
    latents: tuple[int, ...]
    text_embeds: tuple[int, ...]


def scan_clips(folder: str | os.PathLike) -> Clips:
    """Read every clip's tensor shapes (headers only, no data) and check they agree."""
    root = Path(folder)
    if not root.is_dir():
        raise RecipeError(f"--data {str(root)!r} is not a folder")
    files = tuple(sorted(root.glob("*.safetensors")))
    if not files:
        raise RecipeError(f"--data {str(root)!r} holds no .safetensors clips")
    first = clip_shapes(files[0])
    for file in files[1:]:
        for name, expected, found in zip(TENSORS, first, clip_shapes(file)):
            if found != expected:
                raise RecipeError(
                    f"clip {file.name} has {name} of shape {list(found)}, {files[0].name} "
                    f"{list(expected)}: every clip must have the same shapes"
                )
    return Clips(files, *first)


def clip_shapes(file: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(latents shape, text_embeds shape)`` of one clip file, checked for rank."""
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        missing = [name for name in TENSORS if name not in keys]
        if missing:
            raise RecipeError(
                f"clip {file.name} has no {' and no '.join(missing)} tensor (it holds "
                f"{sorted(keys)}; each clip needs latents [C, T, H, W] and text_embeds [L, D])"
            )
        shapes = tuple(tuple(f.get_slice(name).get_shape()) for name in TENSORS)
    for name, shape, rank in zip(TENSORS, shapes, (4, 2)):
        if len(shape) != rank:
            raise RecipeError(f"clip {file.name}: {name} must have {rank} dims, got {list(shape)}")
    return shapes


def check_clips_fit_model(clips: Clips, config: dict, sequence_parallel: int = 1) -> None:
    """The clips' channels, text width and latent size against the model's config (and their
    tokens against the processes that share them)."""
    channels, frames, height, width = clips.latents
    patch_t, patch_h, patch_w = config["patch_size"]
    tokens = frames // patch_t * (height // patch_h) * (width // patch_w)
    problems = []
    if channels != config["in_channels"]:
        problems.append(
            f"latents have {channels} channels, the model's in_channels is {config['in_channels']}"
        )
    if clips.text_embeds[1] != config["text_dim"]:
        problems.append(
            f"text_embeds are {clips.text_embeds[1]} wide, the model's text_dim is "
            f"{config['text_dim']}"
        )
    if height % patch_h or width % patch_w:
        problems.append(
            f"latent size {height}x{width} is not a multiple of the patch {patch_h}x{patch_w}"
        )
    elif tokens % sequence_parallel:  # Ulysses: equal shards
        problems.append(f"{tokens} tokens a clip do not split over {sequence_parallel} processes")
    if problems:
        raise RecipeError(f"the clips do not fit the model: {'; '.join(problems)}")


def make_tiny_data(folder: str | os.PathLike, count: int, seed: int = 0) -> list[Path]:
    """Write ``count`` random clips of ``TINY_CLIP``'s shapes (for ``--tiny``) into ``folder``;
    refuses a folder that holds clips already.

    The latents are smooth (a coarse random grid, upsampled) so that there is structure across
    tokens to learn: i.i.d. noise latents teach a model no more than to shrink its output."""
    root = Path(folder)
    if count < 1:
        raise RecipeError(f"--make-tiny-data needs at least 1 clip, got {count}")
    if root.is_dir() and any(root.glob("*.safetensors")):
        raise RecipeError(f"{str(root)!r} holds .safetensors clips already")
    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    channels, *size = TINY_CLIP["latents"]
    paths = []
    for i in range(count):
        coarse = torch.randn(1, channels, 2, 3, 4, generator=generator)
        latents = F.interpolate(coarse, size=size, mode="trilinear")[0]
        clip = {
            "latents": (latents / latents.std()).contiguous(),
            "text_embeds": torch.randn(TINY_CLIP["text_embeds"], generator=generator),
        }
        paths.append(root / f"clip_{i:05d}.safetensors")
        save_file(clip, str(paths[-1]))
    return paths


def mix_seed(*parts) -> int:
    """A 63-bit seed from the run's seed and a purpose, step, process...: independent streams
    that a resumed run recomputes rather than restores."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, count: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(mix_seed(seed, "order", epoch))
    return tuple(torch.randperm(count, generator=generator).tolist())


def batch_clips(step: int, batch_size: int, process: int, processes: int, count: int, seed: int):
    """Clip indices of ``process`` at ``step``: one seeded shuffle per epoch, walked in global
    batches of ``batch_size * processes`` clips (the order depends on nothing else)."""
    start = (step * processes + process) * batch_size
    positions = range(start, start + batch_size)
    return [epoch_order(seed, p // count, count)[p % count] for p in positions]


def load_batch(clips: Clips, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(latents [B, C, T, H, W], text_embeds [B, L, D])`` in float32 on ``device``."""
    loaded = [load_file(str(clips.files[i])) for i in indices]
    return tuple(torch.stack([c[name].float() for c in loaded]).to(device) for name in TENSORS)


# ------------------------------------------------------------------------------ the loss


def sample_t(args, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Noise levels in [0, 1): uniform, or logit-normal (more weight on the middle levels)."""
    device = generator.device
    if args.timestep_sampling == "uniform":
        return torch.rand(batch, generator=generator, device=device)
    normal = torch.randn(batch, generator=generator, device=device)
    return torch.sigmoid(args.logit_mean + args.logit_std * normal)


def flow_matching_loss(model, latents, text, t, noise) -> torch.Tensor:
    """Wan's objective: at ``x_t = (1 - t) x0 + t noise`` predict the velocity ``noise - x0``."""
    level = t.view(-1, *([1] * (latents.ndim - 1)))
    noisy = (1 - level) * latents + level * noise
    pred = model(
        hidden_states=noisy, timestep=t * 1000, encoder_hidden_states=text, return_dict=False
    )[0]
    return F.mse_loss(pred.float(), (noise - latents).float())


# ------------------------------------------------------------------------------ the model


def model_identity(config) -> dict:
    """The model's constructor arguments, defaults filled in, as plain JSON: two configs of
    one architecture compare equal however they were written."""
    params = inspect.signature(MODEL_CLASS.__init__).parameters
    full = {n: config.get(n, p.default) for n, p in params.items() if n not in ("self", "kwargs")}
    return json.loads(json.dumps(full, default=str))


def base_config(args) -> dict:
    """The config of the model the command names (no weights read)."""
    if args.tiny:
        return model_identity(TINY_TRANSFORMER)
    return model_identity(MODEL_CLASS.load_config(args.model, subfolder=args.subfolder))


def method_identity(args) -> dict:
    if args.method == "dense":
        return {"method": "dense", "train": args.train}
    return {
        "method": "vsa",
        "train": args.train,
        "sparsity": args.target_sparsity,
        "tile": list(args.tile),
    }


def build_model(args, resume: Path | None, ulysses: UlyssesAttention | None = None):
    """The float32 transformer with the method applied: fresh, or the checkpoint's.
    ``ulysses``: its self-attention takes sequence shards (``--sequence-parallel``)."""
    vsa = {"sparsity": args.target_sparsity, "tile": tuple(args.tile), "ulysses": ulysses}
    if resume is not None and args.train == "all":  # every weight from the checkpoint
        model = MODEL_CLASS.from_pretrained(resume / "transformer", torch_dtype=torch.float32)
        if args.method == "vsa":  # the gates and options that save_pretrained wrote
            load_sparse_attention(model, resume / "transformer", **vsa)
    elif args.tiny:
        torch.manual_seed(args.seed)  # random weights, the same in every run of this seed
        model = MODEL_CLASS(**TINY_TRANSFORMER)
    else:
        model = MODEL_CLASS.from_pretrained(
            args.model, subfolder=args.subfolder, torch_dtype=torch.float32
        )
    if resume is not None and args.train == "gates":  # the stock weights, the saved gates
        load_sparse_attention(model, resume / "gates.safetensors", **vsa)
    elif resume is None and args.method == "vsa":
        # Applied at the target so that save_pretrained records it for inference; the
        # schedule sets each gate's sparsity before every step.
        apply_sparse_attention(model, "vsa", gate=True, **vsa)
    if args.method == "dense" and ulysses is not None:  # the stock attention, over shards
        apply_sparse_attention(model, "dense", ulysses=ulysses)
    return model


def sequence_parallel(args, accelerator: Accelerator) -> UlyssesAttention | None:
    """The Ulysses handle of this process's group of ``--sequence-parallel`` processes, with
    ``pad_heads``: a head count the group does not divide (Wan 1.3B's 12 on 8) runs padded."""
    size, processes = args.sequence_parallel, accelerator.num_processes
    if processes % size:
        raise RecipeError(f"--sequence-parallel {size} does not divide the {processes} processes")
    if size == 1:
        return None
    group = None if size == processes else torch.distributed.new_subgroups(size)[0]
    return UlyssesAttention(group, pad_heads=True)


def gate_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, VSAGate)]


def trainable_parameters(model, train: str) -> list[torch.nn.Parameter]:
    """Freeze what ``--train`` leaves alone; the parameters AdamW updates, in model order."""
    if train == "gates":
        model.requires_grad_(False)
        for gate in gate_modules(model):
            gate.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------ the schedule


def make_schedule(args) -> SparsitySchedule | None:
    if args.method == "dense":
        return None
    try:
        schedule = SparsitySchedule(
            args.target_sparsity, args.warmup_steps, args.ramp_steps, args.num_levels
        )
    except (TypeError, ValueError) as error:
        raise RecipeError(f"sparsity schedule: {error}") from None
    reached = schedule.target_step
    if reached >= args.max_steps:
        raise RecipeError(
            f"the sparsity schedule reaches its target {schedule.target} at step {reached}, "
            f"outside the step budget (--max-steps {args.max_steps}): shorten --warmup-steps "
            "or --ramp-steps, or raise --max-steps"
        )
    return schedule


# ------------------------------------------------------------------------------ checkpoints


def read_checkpoint(path: Path) -> dict:
    """The checkpoint's ``training_state.json``."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise RecipeError(
            f"--resume {str(path)!r} is not a checkpoint of this recipe (no {STATE_FILE})"
        )
    try:
        state = json.loads(state_file.read_text())
    except json.JSONDecodeError as error:
        raise RecipeError(f"--resume {str(path)!r}: {STATE_FILE} is not JSON ({error})") from None
    if state.get("format") != CHECKPOINT_FORMAT:
        raise RecipeError(
            f"--resume {str(path)!r}: checkpoint format {state.get('format')!r}, this recipe "
            f"reads {CHECKPOINT_FORMAT}"
        )
    return state


def check_checkpoint_files(path: Path, state: dict, processes: int) -> None:
    train = state["identity"]["method"]["train"]
    weights = "transformer" if train == "all" else "gates.safetensors"
    needed = [weights, "optimizer.pt", *(f"rng-{i}.pt" for i in range(processes))]
    missing = [name for name in needed if not (path / name).exists()]
    if missing:
        raise RecipeError(f"--resume {str(path)!r} lacks {missing} (an incomplete checkpoint)")


# What a differing part of the run identity means, for the error.
IDENTITY_PARTS = {
    "model": "another model config",
    "method": "another method",
    "schedule": "another sparsity schedule",
    "data": "another data set, batch size, seed or process count",
}


def check_resume_matches(path: Path, saved: dict, current: dict) -> None:
    """Refuse a checkpoint whose run differs from this command's, naming what differs."""
    for part, meaning in IDENTITY_PARTS.items():
        old, new = flatten(saved.get(part)), flatten(current[part])
        keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        if keys:
            diff = "; ".join(
                f"{k or part}: {old.get(k)!r} there, {new.get(k)!r} here" for k in keys
            )
            raise RecipeError(f"--resume {str(path)!r} is a checkpoint of {meaning} ({diff})")


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts as one dict of dotted keys (a non-dict value under the key ``prefix``)."""
    if not isinstance(value, dict):
        return {prefix: value}
    flat = {}
    for key, item in value.items():
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else key))
    return flat


def save_checkpoint(accelerator, model, optimizer, folder: Path, step: int, identity: dict):
    """Write ``checkpoints/step-N`` through a temporary folder renamed at the end, so that a
    run killed while saving leaves no checkpoint that looks complete."""
    final = folder / f"step-{step:06d}"
    staging = folder / f".{final.name}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_states(), staging / f"rng-{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()  # every process's RNG file is in before the rename
    if accelerator.is_main_process:
        write_weights(accelerator.unwrap_model(model), staging, identity["method"]["train"])
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        state = {"format": CHECKPOINT_FORMAT, "step": step, "identity": identity}
        (staging / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # a resumed run passing this step again
        staging.rename(final)
    accelerator.wait_for_everyone()


def write_weights(model, folder: Path, train: str) -> None:
    if train == "all":  # weights, gates, and the method's options in config.json
        model.save_pretrained(folder / "transformer")
    else:  # the stock weights did not change: the gates alone, under save_pretrained's keys
        gates = {k: v for k, v in model.state_dict().items() if is_gate_key(model, k)}
        save_file({k: v.contiguous() for k, v in gates.items()}, str(folder / "gates.safetensors"))


def is_gate_key(model, key: str) -> bool:
    module_path = key.rpartition(".")[0]
    return isinstance(model.get_submodule(module_path), VSAGate)


def rng_states() -> dict:
    """Torch's global RNG states (the recipe draws from its own per-step generators, but the
    model may use the global ones, e.g. dropout)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(path: Path) -> None:
    states = torch.load(path, weights_only=True)
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# ------------------------------------------------------------------------------ output


def check_output_folder(output: Path, resume: Path | None) -> None:
    """A new run needs an empty folder; a resumed one its own run's folder (or an empty one)."""
    if output.exists() and not output.is_dir():
        raise RecipeError(f"--output {str(output)!r} exists and is not a folder")
    if not output.is_dir() or not any(output.iterdir()):
        return
    if resume is not None and resume.resolve().parent.parent == output.resolve():
        return
    hint = "resume it with --resume CHECKPOINT, or" if resume is None else "resume into"
    raise RecipeError(f"--output {str(output)!r} holds files already: {hint} choose another folder")


def open_loss_log(output: Path, start_step: int):
    """``loss.jsonl`` opened for appending; the lines of steps at or after ``start_step`` (a run
    resumed from an earlier checkpoint redoes them) are dropped first."""
    path = output / LOSS_LOG
    if path.exists():
        kept = [
            line
            for line in path.read_text().splitlines()
            if line and json.loads(line)["step"] < start_step
        ]
        staging = path.with_suffix(".partial")
        staging.write_text("".join(line + "\n" for line in kept))
        staging.replace(path)
    return path.open("a")


# ------------------------------------------------------------------------------ training


@dataclasses.dataclass
class Run:
    """Everything checked and built before the first step."""

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    schedule: SparsitySchedule | None
    clips: Clips
    identity: dict
    start_step: int


def prepare_run(args) -> Run:
    """Check the whole input (nothing written), then build the model and optimizer."""
    accelerator = Accelerator(mixed_precision=mixed_precision(args.mixed_precision))
    schedule = make_schedule(args)
    clips = scan_clips(args.data)
    resume = Path(args.resume) if args.resume else None
    check_output_folder(Path(args.output), resume)
    saved = read_checkpoint(resume) if resume else None
    config = base_config(args)
    check_clips_fit_model(clips, config, args.sequence_parallel)
    ulysses = sequence_parallel(args, accelerator)
    identity = run_identity(args, config, schedule, clips, accelerator.num_processes)
    if saved is not None:
        check_resume_matches(resume, saved["identity"], identity)
        check_checkpoint_files(resume, saved, accelerator.num_processes)
        if saved["step"] > args.max_steps:
            raise RecipeError(
                f"--resume {str(resume)!r} is at step {saved['step']}, past --max-steps "
                f"{args.max_steps}"
            )
        if schedule is not None:
            schedule.load_state_dict(saved["identity"]["schedule"])
    model = build_model(args, resume, ulysses)
    try:
        run = make_run(args, accelerator, model, schedule, clips, identity, resume, saved)
        if ulysses is not None:  # each rank runs the model on its chunk of the tokens
            apply_sequence_parallel(model, ulysses.group)  # hooks of this model alone: kept
        return run
    except BaseException:
        unpatch(args, model)
        raise


def make_run(args, accelerator, model, schedule, clips, identity, resume, saved) -> Run:
    """The optimiser over the trainable parameters, both prepared by ``accelerate``; the
    checkpoint's optimiser and RNG states when resuming."""
    if args.gradient_checkpointing:  # recompute each block's activations in the backward
        model.enable_gradient_checkpointing()
    if args.compile:  # regional: one graph for every block (diffusers' _repeated_blocks)
        compile_for_training(model)
    params = trainable_parameters(model, args.train)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    model, optimizer = accelerator.prepare(model.train(), optimizer)
    if saved is not None:
        optimizer.load_state_dict(torch.load(resume / "optimizer.pt", weights_only=True))
        restore_rng_states(resume / f"rng-{accelerator.process_index}.pt")
    start = saved["step"] if saved else 0
    return Run(accelerator, model, optimizer, params, schedule, clips, identity, start)


def run_identity(args, config: dict, schedule, clips: Clips, processes: int) -> dict:
    """What a checkpoint must share with the command that resumes it, in four parts
    (``IDENTITY_PARTS``). ``--max-steps`` and ``--checkpoint-every`` may differ; AdamW's
    settings come from its saved state. ``sequence_parallel`` only when on (older and
    data-parallel checkpoints match as before)."""
    return {
        "model": {"class": MODEL_CLASS.__name__, "config": config},
        "method": method_identity(args),
        "schedule": None if schedule is None else schedule.state_dict(),
        "data": {
            "clips": len(clips.files),
            "latents": list(clips.latents),
            "text_embeds": list(clips.text_embeds),
            "batch_size": args.batch_size,
            "seed": args.seed,
            "processes": processes,
            **({"sequence_parallel": sp} if (sp := args.sequence_parallel) > 1 else {}),
        },
    }


def mixed_precision(choice: str) -> str:
    if choice == "auto":  # bf16 autocast over float32 weights where it is fast
        return "bf16" if torch.cuda.is_available() else "no"
    return choice


def train_step(args, run: Run, step: int) -> tuple[float, float]:
    """One optimiser step at ``step``; ``(mean loss over the processes, sparsity)``."""
    accelerator = run.accelerator
    sparsity = 0.0 if run.schedule is None else run.schedule.apply(run.model, step)
    # The processes of one sequence-parallel group take the same clips and noise.
    process = accelerator.process_index // args.sequence_parallel
    processes = accelerator.num_processes // args.sequence_parallel
    indices = batch_clips(
        step, args.batch_size, process, processes, len(run.clips.files), args.seed
    )
    latents, text = load_batch(run.clips, indices, accelerator.device)
    generator = torch.Generator(accelerator.device)
    generator.manual_seed(mix_seed(args.seed, "noise", step, process))
    noise = torch.randn(latents.shape, generator=generator, device=accelerator.device)
    t = sample_t(args, latents.shape[0], generator)
    loss = flow_matching_loss(run.model, latents, text, t, noise)
    # Under sequence parallelism each process's gradients hold its own tokens' share of the
    # gradient, whose sum is the model's; DDP averages over all processes, hence the factor.
    accelerator.backward(loss * args.sequence_parallel)
    if args.max_grad_norm > 0:
        accelerator.clip_grad_norm_(run.params, args.max_grad_norm)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return accelerator.reduce(loss.detach(), "mean").item(), sparsity


def train(args) -> None:
    """Check, build, train to ``--max-steps`` with checkpoints, save the result, unpatch."""
    run = prepare_run(args)
    try:
        run_steps(args, run)
    finally:  # as after any use: the attention routing is process-wide while a model is patched
        unpatch(args, run.accelerator.unwrap_model(run.model))


def unpatch(args, model) -> None:
    if args.method == "vsa" or args.sequence_parallel > 1:
        remove_sparse_attention(model)


def run_steps(args, run: Run) -> None:
    """The steps from ``run.start_step``, the loss log, checkpoints and the final save."""
    accelerator, output = run.accelerator, Path(args.output)
    main_process = accelerator.is_main_process
    if main_process:
        describe(args, run)
        output.mkdir(parents=True, exist_ok=True)
    loss_log = open_loss_log(output, run.start_step) if main_process else None
    bar = tqdm(
        total=args.max_steps,
        initial=run.start_step,
        desc="finetune_vsa",
        disable=not main_process or args.no_progress,
    )
    for step in range(run.start_step, args.max_steps):
        start = time.perf_counter()
        loss, sparsity = train_step(args, run, step)
        if main_process:
            lr = run.optimizer.param_groups[0]["lr"]
            seconds = round(time.perf_counter() - start, 4)
            record = {"step": step, "loss": loss, "sparsity": sparsity, "lr": lr}
            loss_log.write(json.dumps({**record, "seconds": seconds}) + "\n")
            loss_log.flush()
        bar.update()
        bar.set_postfix(loss=f"{loss:.4f}", sparsity=f"{sparsity:g}")
        done = step + 1
        if done % args.checkpoint_every == 0 or done == args.max_steps:
            save_checkpoint(
                accelerator, run.model, run.optimizer, output / "checkpoints", done, run.identity
            )
    bar.close()
    if main_process:
        loss_log.close()
        accelerator.unwrap_model(run.model).save_pretrained(output / "final" / "transformer")
        print(
            f"done: step {args.max_steps}; losses in {output / LOSS_LOG}, the transformer "
            f"in {output / 'final' / 'transformer'}"
        )
    accelerator.wait_for_everyone()


def describe(args, run: Run) -> None:
    model = "tiny random-weight" if args.tiny else args.model
    count = sum(p.numel() for p in run.params)
    clips = run.clips
    print(
        f"model: {model} {MODEL_CLASS.__name__}, method {args.method}, training {args.train} "
        f"({count:,} parameters) on {run.accelerator.device} "
        f"({run.accelerator.mixed_precision} mixed precision)"
    )
    sp, processes = args.sequence_parallel, run.accelerator.num_processes
    unit = f"groups of {sp} processes (sequence parallel)" if sp > 1 else "processes"
    print(
        f"data: {len(clips.files)} clips, latents {list(clips.latents)}, text_embeds "
        f"{list(clips.text_embeds)}, batch {args.batch_size} x {processes // sp} {unit}"
    )
    if run.schedule is not None:
        print(f"schedule: {run.schedule}, at the target from step {run.schedule.target_step}")
    if run.start_step:
        print(f"resumed from {args.resume} at step {run.start_step}")


# ------------------------------------------------------------------------------ the command


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--make-tiny-data",
        nargs=2,
        metavar=("DIR", "N"),
        help="write N random clips for --tiny into DIR, then exit",
    )
    parser.add_argument("--data", help="folder of clips (*.safetensors: latents, text_embeds)")
    parser.add_argument("--output", help="folder for the loss log, checkpoints and the result")
    parser.add_argument("--model", default="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    parser.add_argument("--subfolder", default="transformer", help="of --model")
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight Wan, CPU")
    parser.add_argument("--method", choices=("vsa", "dense"), default="vsa")
    parser.add_argument(
        "--train",
        choices=("all", "gates"),
        default="all",
        help="the parameters AdamW updates (default %(default)s)",
    )
    parser.add_argument("--target-sparsity", type=float, help="VSA: key tiles skipped at the end")
    parser.add_argument("--warmup-steps", type=int, help="steps at sparsity 0 first")
    parser.add_argument("--ramp-steps", type=int, help="steps over which the levels rise")
    parser.add_argument("--num-levels", type=int, help="sparsity levels up to the target")
    parser.add_argument("--tile", type=int, nargs=3, default=TILE, help="VSA tile (T H W)")
    parser.add_argument("--max-steps", type=int, help="optimiser steps in all")
    parser.add_argument("--batch-size", type=int, default=1, help="clips per step and process")
    parser.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                        help="shard each clip's tokens over N processes (Ulysses)")  # fmt: skip
    parser.add_argument("--lr", type=float)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    parser.add_argument(
        "--timestep-sampling", choices=("uniform", "logit-normal"), default="uniform"
    )
    parser.add_argument("--logit-mean", type=float, default=0.0)
    parser.add_argument("--logit-std", type=float, default=1.0)
    parser.add_argument(
        "--mixed-precision",
        choices=("auto", "no", "bf16"),
        default="auto",
        help="auto: bf16 autocast on a GPU, float32 on the CPU",
    )
    parser.add_argument(
        "--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer block (fewer, fused kernels: the step's host time)",
    )
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    parser.add_argument("--resume", metavar="CHECKPOINT", help="a checkpoints/step-N folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.make_tiny_data:
        if not args.make_tiny_data[1].isdigit():
            parser.error(
                f"--make-tiny-data DIR N: N must be a count, got {args.make_tiny_data[1]!r}"
            )
        return args
    if not args.data or not args.output:
        parser.error("--data and --output are needed (or --make-tiny-data DIR N)")
    for key, value in DEFAULTS[args.tiny].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("max_steps", "batch_size", "checkpoint_every", "sequence_parallel"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.compile and args.sequence_parallel > 1:
        parser.error("--compile does not take --sequence-parallel: the exchange breaks the graph")
    if args.method == "dense" and args.train == "gates":
        parser.error("--train gates needs --method vsa (dense attention has no gates)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("vidsparse").setLevel(logging.INFO)  # what it patches and loads
    try:
        if args.make_tiny_data:
            folder, count = args.make_tiny_data
            paths = make_tiny_data(folder, int(count), seed=args.seed)
            print(f"tiny data: {len(paths)} clips -> {folder}")
        else:
            train(args)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
