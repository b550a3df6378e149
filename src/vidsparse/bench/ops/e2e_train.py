"""The end-to-end benchmark's training step (``e2e --train``): forward and backward of a
real-architecture diffusers transformer (random weights), dense against VSA.

The model trains as a fine-tuning run would (``examples/finetune_vsa.py``): float32 weights,
all trainable, the forward under bf16 autocast on the GPU (``--train-weights bf16``: bf16
weights instead, for models whose float32 copy does not fit; float32 without autocast on the
CPU), gradient checkpointing on every block (``model.enable_gradient_checkpointing()``: the
backward recomputes each block's forward). The loss is flow matching's MSE in float32 of the
output against a fixed velocity target ``noise - x0`` (both standard normal, drawn once, the
same for every method); the step zeroes the gradients, runs forward and backward, and takes no
optimizer step. Methods: dense (stock diffusers SDPA, cuDNN first) and VSA at each of
``--vsa-sparsities`` through ``apply_sparse_attention(model, "vsa", gate=True)`` (the gate
trains with the model; ``--no-vsa-gate`` leaves it out); PSA on request (``--methods``).

Per method: the step's median latency (CUDA events, warmup excluded), the self-attention's
forward (twice: the step's and the checkpoint's recomputation) and backward time and its share
of the step (``AttentionTimer(backward=True)``), peak memory over the timed steps, and the
gradient of the first video self-attention module's parameters against dense's. Run::

    python -m vidsparse.bench e2e --train                              # Wan 2.1 1.3B, 480p
    python -m vidsparse.bench e2e --train --model wan14b --layers 4    # Wan 2.1 14B, 720p
    python -m vidsparse.bench e2e --train --device cpu --tiny          # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn.functional as F

from vidsparse.bench import harness
from vidsparse.bench.harness import Column
from vidsparse.bench.ops.e2e_common import (
    AttentionTimer,
    Method,
    add_relative,
    check_cudnn,
    make_methods,
    run_metadata,
    sdpa_context,
    time_steps,
    video_output,
)
from vidsparse.bench.ops.e2e_model import Workload, build_model, compile_blocks, make_inputs
from vidsparse.testing import grad_errors, rel_l2

DEFAULT_VSA_SPARSITIES = "0.875,0.9"
WEIGHTS = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAIN_ONLY = ("vsa_sparsities", "train_weights")  # options of --train alone

COLUMNS = [
    Column("method", "method"),
    Column("target", "target", ".3f"),
    Column("sparsity", "sparsity", ".3f"),
    Column("step_ms", "step ms", ".1f"),
    Column("speedup", "speedup", ".2f"),
    Column("attn_ms", "attn ms", ".1f"),
    Column("attn_share", "attn share", ".1%"),
    Column("attn_speedup", "attn x", ".2f"),
    Column("peak_mem_gb", "peak GB", ".1f"),
    Column("mem_ratio", "mem x", ".3f"),
    Column("grad_rel_l2", "grad rel L2", ".1e"),
]


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--train",
        action="store_true",
        help="the training step instead: forward + backward with gradient checkpointing, "
        "dense vs VSA (vidsparse.bench.ops.e2e_train)",
    )
    ap.add_argument(
        "--vsa-sparsities",
        default=None,
        help=f"--train: VSA's sparsities, one row each (default {DEFAULT_VSA_SPARSITIES})",
    )
    ap.add_argument(
        "--train-weights",
        choices=sorted(WEIGHTS),
        default=None,
        help="--train: the weights' dtype (default fp32, under bf16 autocast on the GPU)",
    )


def usage_error(message: str) -> NoReturn:
    """One line on stderr and exit code 2, as for bad options."""
    print(f"e2e: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_args(args) -> None:
    """Refuse what the training step cannot take; fill in its defaults."""
    if not args.train:
        for name in TRAIN_ONLY:
            if getattr(args, name) is not None:
                usage_error(f"--{name.replace('_', '-')} is an option of --train")
        return
    args.vsa_sparsities = parse_sparsities(args.vsa_sparsities or DEFAULT_VSA_SPARSITIES)
    args.train_weights = args.train_weights or "fp32"


def parse_sparsities(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        usage_error(f"--vsa-sparsities takes comma-separated floats, got {text!r}")
    bad = [v for v in values if not 0.0 <= v < 1.0]
    if bad:
        usage_error(f"--vsa-sparsities must lie in [0, 1), got {bad}")
    return values


# ---------------------------------------------------------------------------------------------
# methods
# ---------------------------------------------------------------------------------------------


def train_methods(args, work: Workload) -> list[Method]:
    """Dense, VSA at each sparsity (the inference mode's rows, one per sparsity), then PSA's."""
    wanted = set(args.methods.split(","))
    rest = ",".join(sorted(wanted - {"vsa"})) or "dense"
    methods = make_methods(_with(args, methods=rest), work)
    if "vsa" in wanted:
        vsa = [
            make_methods(_with(args, methods="vsa", vsa_sparsity=s, psa_plan=None), work)[1]
            for s in args.vsa_sparsities
        ]
        methods[1:1] = vsa
    return methods


def _with(args, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


# ---------------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------------


def prepare_model(model) -> None:
    """Trainable, in train mode, every block checkpointed."""
    model.train().requires_grad_(True)
    model.enable_gradient_checkpointing()


class TrainStep:
    """One training step of ``model`` on ``inputs``: zeroed gradients, forward (bf16 autocast
    when ``autocast``), the flow-matching MSE, backward; returns the loss."""

    def __init__(self, model, inputs: dict, device: torch.device, autocast: bool, seed: int):
        self.model, self.inputs, self.device, self.autocast = model, inputs, device, autocast
        self.seed = seed
        self._target: torch.Tensor | None = None

    def target(self, out: torch.Tensor) -> torch.Tensor:
        """``noise - x0`` shaped like the output, drawn on the first call."""
        if self._target is None or self._target.shape != out.shape:
            g = torch.Generator().manual_seed(self.seed + 2)
            noise, x0 = (torch.randn(out.shape, generator=g) for _ in range(2))
            self._target = (noise - x0).to(out.device)
        return self._target

    def __call__(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        # The backward recomputes each block's forward: it runs under the SDPA order too.
        with sdpa_context(self.device):
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
                out = video_output(self.model(**self.inputs))
            loss = F.mse_loss(out.float(), self.target(out))
            loss.backward()
        return loss.detach()


def grad_group(model) -> tuple[str, list[torch.nn.Parameter]]:
    """The parameters of the first video self-attention module the integration routes (Wan:
    ``blocks.0.attn1``: q, k, v, out projections and q/k norms; VSA's gate is on the block)."""
    from vidsparse.integrations.diffusers.models import spec_for

    path, attn = spec_for(model).self_attention(model)[0]
    return path, list(attn.parameters())


def group_grad(params) -> torch.Tensor:
    """The group's gradients, flat, float32, on the CPU (off the device's peak memory)."""
    flat = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
        for p in params
    ]
    return torch.cat(flat).cpu()


# ---------------------------------------------------------------------------------------------
# one method
# ---------------------------------------------------------------------------------------------


def run_train_method(method: Method, model, step: TrainStep, params, work, device, args, ref):
    """Patch, step, time, unpatch. Returns the row and the first step's group gradient."""
    from vidsparse.integrations.diffusers import (
        apply_sparse_attention,
        remove_sparse_attention,
        set_denoising_step,
    )

    row: dict[str, Any] = {"method": method.name, "target": method.target, **(method.info or {})}
    if method.skip:
        row["error"] = method.skip
        return row, None
    patched, grads = False, None
    try:
        if method.options is not None:
            apply_sparse_attention(model, method.kind, **method.options)
            patched = True
            set_denoising_step(model, method.step)
        grads = first_step(row, step, params, device, ref)
        timed_steps(row, step, work, device, args)
        if ref is None:  # dense: run to run, its last timed step against its first
            row["grad_rel_l2"] = rel_l2(group_grad(params), grads)
        if args.share_reps > 0:
            try:
                row.update(train_attention_share(model, step, device, args.share_reps, work))
            except Exception as exc:  # noqa: BLE001 - the latency stands without the share
                row["attn_share_error"] = harness.error_message(exc)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = harness.error_message(exc)
    finally:
        if patched:
            remove_sparse_attention(model)
        model.zero_grad(set_to_none=True)
        harness.release_memory(device)
    return row, grads


def first_step(row: dict, step: TrainStep, params, device, ref) -> torch.Tensor:
    """The untimed first step (kernels compile, lists build): its loss and group gradient."""
    started = time.perf_counter()
    loss = step()
    harness.synchronize(device)
    row["first_step_s"] = time.perf_counter() - started
    row["loss"] = float(loss)
    grads = group_grad(params)
    row["grad_finite"] = bool(torch.isfinite(grads).all())
    row["grad_norm"] = float(grads.norm())
    if ref is not None:
        row["grad_rel_l2"] = rel_l2(grads, ref)
    return grads


def timed_steps(row: dict, step: TrainStep, work: Workload, device, args) -> None:
    for _ in range(args.warmup):
        step()
    harness.synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = time_steps(step, device, args.reps)
    row["step_ms"] = statistics.median(times)
    row["step_ms_min"] = min(times)
    row["step_ms_all"] = times
    row["step_ms_per_layer"] = row["step_ms"] / work.layers
    if device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9


def train_attention_share(model, step, device, reps: int, work: Workload) -> dict:
    """Attention time per step, forward (the step's and the recomputation's) plus backward,
    and the self-attention's share, over ``reps`` instrumented steps."""
    timer = AttentionTimer(model, device, work.tokens, backward=True)
    with timer.active():
        step_ms = sum(time_steps(step, device, reps))
    out: dict[str, Any] = {"instr_step_ms": step_ms / reps}
    for kind, name in (("self", "attn"), ("cross", "cross_attn"), ("other", "other_attn")):
        fwd, bwd = timer.marks[kind], timer.marks[f"{kind}_bwd"]
        if kind == "other" and not fwd:
            continue
        out[f"{name}_fwd_ms"] = timer.total_ms(kind) / reps
        out[f"{name}_bwd_ms"] = timer.total_ms(f"{kind}_bwd") / reps
        out[f"{name}_ms"] = out[f"{name}_fwd_ms"] + out[f"{name}_bwd_ms"]
        out[f"{name}_fwd_calls_per_step"] = len(fwd) // reps
        out[f"{name}_bwd_calls_per_step"] = len(bwd) // reps
    out["attn_share"] = out["attn_ms"] * reps / step_ms if step_ms > 0 else None
    out["attn_dtype"] = ",".join(sorted(timer.dtypes.get("self", ())))
    return out


def all_grads(model, step: TrainStep) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one step, float32 on the CPU (off the device's peak)."""
    step()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()
             if p.grad is not None}  # fmt: skip
    model.zero_grad(set_to_none=True)
    return grads


def compiled_against_eager(model, step: TrainStep, eager: dict) -> dict:
    """The compiled dense step's gradients against the eager step's, parameter by parameter
    (relative L2, below 1e-3 of the largest gradient's norm counted as that floor): a compiler
    that drops a parameter's gradient shows here, not only in a diverging run."""
    compiled = all_grads(model, step)
    errors = grad_errors(compiled, eager)
    worst = max(errors, key=errors.get)
    return {"compiled_grad_max_rel": errors[worst], "compiled_grad_worst": worst,
            "compiled_grad_missing": sorted(set(eager) ^ set(compiled))}  # fmt: skip


def add_train_relative(rows: list[dict]) -> None:
    """Speedups and the peak memory ratio against the dense row."""
    add_relative(rows)
    dense = next((r for r in rows if r["method"] == "dense" and "step_ms" in r), None)
    for r in rows:
        if dense is not None and r.get("peak_mem_gb") and dense.get("peak_mem_gb"):
            r["mem_ratio"] = r["peak_mem_gb"] / dense["peak_mem_gb"]


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


def run(args, work: Workload, device: torch.device, out: Path) -> list[dict]:
    start = time.perf_counter()
    dtype = WEIGHTS[args.train_weights]
    autocast = device.type == "cuda"
    model = build_model(work, device, dtype, args.seed)
    build_s = time.perf_counter() - start
    prepare_model(model)
    group, params = grad_group(model)
    inputs = make_inputs(work, device, dtype, args.seed)
    step = TrainStep(model, inputs, device, autocast, args.seed)
    eager = None
    if args.compile == "blocks":
        eager = all_grads(model, step)  # the dense step before compiling: the check's reference
        compile_blocks(model, work, training=True)
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    sdpa = check_cudnn(work, device, torch.bfloat16 if autocast else dtype)
    methods = train_methods(args, work)
    meta = train_metadata(args, work, device, dtype, weights_gb, sdpa, build_s, group)
    print(
        f"{work.name} training step: {work.layers}/{work.full_layers} layers, grid "
        f"{work.grid_shape} ({work.tokens} tokens), {work.heads} heads, "
        f"{meta['training']['weights']}, built in {build_s:.1f} s; SDPA {sdpa}",
        flush=True,
    )
    base = {k: meta[k] for k in ("workload", "layers", "full_layers", "tokens", "heads")}
    rows: list[dict] = []
    ref = None
    for method in methods:
        row, grads = run_train_method(method, model, step, params, work, device, args, ref)
        if method.name == "dense":
            ref = grads
            if eager is not None and "error" not in row:
                row.update(compiled_against_eager(model, step, eager))
        rows.append({**base, **row})
        add_train_relative(rows)
        harness.write_results(out, meta, rows)
        print_row(rows[-1])
    meta["complete"] = True
    meta["total_s"] = time.perf_counter() - start
    harness.report_results(out, meta, rows, COLUMNS)
    return rows


def print_row(r: dict) -> None:
    nan = float("nan")
    print(
        f"  {r['method']:<8} target {r.get('target') or 0:.3f} sparsity "
        f"{r.get('sparsity', 0):.3f}: step {r.get('step_ms', nan):.1f} ms, attn "
        f"{r.get('attn_ms', nan):.1f} ms ({r.get('attn_share') or nan:.1%}), peak "
        f"{r.get('peak_mem_gb') or nan:.1f} GB, grad rel L2 {r.get('grad_rel_l2', nan):.1e}"
        + (f"  ERROR {r['error']}" if r.get("error") else ""),
        flush=True,
    )


def train_metadata(args, work, device, dtype, weights_gb, sdpa, build_s, group) -> dict:
    """The inference mode's metadata, with what the training step does instead."""
    meta = run_metadata(args, work, device, dtype, weights_gb, sdpa, build_s)
    autocast = device.type == "cuda"
    meta.update(
        mode="train",
        vsa_sparsities=args.vsa_sparsities,
        training={
            "weights": f"{args.train_weights} weights, all trainable"
            + (", forward under bf16 autocast" if autocast else ", no autocast"),
            "gradient_checkpointing": "model.enable_gradient_checkpointing(): every block",
            "loss": "F.mse_loss(output.float(), noise - x0), noise and x0 standard normal, drawn "
            "once (the inputs' latents play x_t)",
            "optimizer": "none: zero_grad(set_to_none=True), forward, loss, backward",
            "vsa_gate": not args.no_vsa_gate,
            "grad_group": f"{group}: its parameters' gradients, flat; grad_rel_l2 against dense's "
            "first step (dense: its last timed step against its first)",
        },
        timer=(
            ("CUDA events" if device.type == "cuda" else f"{harness.CPU_TIMER_LABEL} perf_counter")
            + f": 1 + {args.warmup} untimed steps, median of {args.reps} timed steps "
            "(forward + backward each); peak memory over the timed steps"
        ),
        compiled_grad_check=(
            "dense: every parameter's gradient of one compiled step against one eager step "
            "taken before compiling (relative L2, norms below 1e-3 of the largest count as "
            "that floor): compiled_grad_max_rel, compiled_grad_worst, compiled_grad_missing"
            if args.compile == "blocks"
            else None
        ),
        attention_share=(
            "forward: event pair around every call of dispatch_attention_fn in the attention "
            "processors' modules (twice a layer: the step's forward and the checkpoint's "
            "recomputation); backward: an autograd identity on the call's output marks when "
            "its backward starts, one on its q, k, v when their gradients are all done "
            "(autograd runs the nodes made inside the call in between, the VSA gate's "
            "projection included); summed over the instrumented steps, over the step's event "
            f"pair, {args.share_reps} instrumented steps after the timed ones"
        ),
    )
    return meta
