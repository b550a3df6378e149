"""What the end-to-end benchmark's two modes share (``e2e``: one denoising step; ``e2e_train``:
one training step): the methods and their rows, the step and attention timers, the SDPA
backend order and its cuDNN check, the run metadata. Both modes import them from here, so that
neither imports the other but the op's entry (``vidsparse.bench.ops.e2e``, which re-exports
the names its callers use) imports the training mode.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vidsparse.bench import harness
from vidsparse.bench.ops.e2e_model import (
    CLASS_NAMES,
    VSA_TILE,
    Workload,
    plan_file_method,
    synthetic_plan,
)

# ---------------------------------------------------------------------------------------------
# methods
# ---------------------------------------------------------------------------------------------


@dataclass
class Method:
    """One row: how to patch the model (``apply_sparse_attention(model, kind, **options)``;
    no options: the stock model) and what to record about it."""

    name: str
    target: float | None = None
    options: dict | None = None
    kind: str = "dense"
    step: int = 0  # denoising step to set (PSA plans)
    info: dict | None = None  # row fields known before running (sparsity, tiles, ...)
    skip: str | None = None  # why the method cannot run here: the row records it as its error


def kernel_support(work: Workload, device: torch.device) -> tuple[str | None, str | None]:
    """``(why VSA/PSA cannot run, what their rows should know)`` for this head_dim: the Triton
    kernels take ``SUPPORTED_HEAD_DIMS``, the engine's Hopper (Gluon) forward head_dim 128 only
    (other head dims run the Triton kernels); the torch reference takes any."""
    from vidsparse.ops.block_sparse_attn.configs import GLUON_HEAD_DIMS, SUPPORTED_HEAD_DIMS
    from vidsparse.utils.backend import resolve_backend

    d = work.head_dim
    if device.type != "cuda" or resolve_backend(device) == "torch":
        return None, None
    if d not in SUPPORTED_HEAD_DIMS:
        return (
            f"head_dim {d} is not supported by the VSA/PSA Triton kernels (supported: "
            f"{SUPPORTED_HEAD_DIMS}); not run",
            None,
        )
    if d not in GLUON_HEAD_DIMS:
        return None, (
            f"head_dim {d}: the block-sparse engine's Hopper (Gluon) forward takes head_dim "
            f"{GLUON_HEAD_DIMS} only, so this row runs its Triton kernels"
        )
    return None, None


def make_methods(args, work: Workload) -> list[Method]:
    from vidsparse.layout.grid import VideoGrid
    from vidsparse.ops.video_sparse_attn.topk import resolve_topk

    wanted = set(args.methods.split(","))
    unknown = wanted - {"dense", "vsa", "psa"}
    if unknown:
        raise SystemExit(f"--methods takes dense, vsa, psa; got {sorted(unknown)}")
    methods = [Method("dense", info={"sparsity": 0.0, "attention": "stock diffusers SDPA"})]
    skip, kernels = kernel_support(work, torch.device(args.device))
    sparse_info = {"kernels": kernels} if kernels else {}
    if "vsa" in wanted:
        grid = VideoGrid(work.grid_shape, VSA_TILE)
        topk = resolve_topk(grid.num_tiles, sparsity=args.vsa_sparsity)
        methods.append(
            Method(
                "vsa",
                target=args.vsa_sparsity,
                kind="vsa",
                options={"sparsity": args.vsa_sparsity, "gate": not args.no_vsa_gate},
                info={
                    "sparsity": 1.0 - topk / grid.num_tiles,
                    "topk": topk,
                    "tiles": grid.num_tiles,
                    "tile": "x".join(map(str, VSA_TILE)),
                    "padded_tokens": grid.padded_len,
                    "gate": not args.no_vsa_gate,
                    **sparse_info,
                },
                skip=skip,
            )
        )
    if "psa" in wanted:
        grid = VideoGrid(work.grid_shape, work.psa_tile)
        rng = random.Random(args.seed)
        for target in (float(x) for x in args.psa_sparsities.split(",")):
            plan, achieved, patterns = synthetic_plan(work, target, rng, args.psa_tolerance)
            methods.append(
                Method(
                    "psa",
                    target=target,
                    kind="psa",
                    options={"plan": plan},
                    info={
                        "sparsity": achieved,
                        "tile": "x".join(map(str, work.psa_tile)),
                        "tiles": grid.num_tiles,
                        "padded_tokens": grid.padded_len,
                        "plan": "synthetic: family candidates near the target, per (layer, head)",
                        "patterns": patterns,
                        **sparse_info,
                    },
                    skip=skip,
                )
            )
    if args.psa_plan:
        plan, step, sparsity, patterns = plan_file_method(args.psa_plan, work)
        methods.append(
            Method(
                "psa-plan",
                kind="psa",
                step=step,
                options={"plan": plan},
                info={
                    "sparsity": sparsity,
                    "tile": "x".join(map(str, plan.grid.tile_shape)),
                    "tiles": plan.grid.num_tiles,
                    "plan": str(args.psa_plan),
                    "plan_step": step,
                    "patterns": patterns,
                    **sparse_info,
                },
                skip=skip,
            )
        )
    return methods


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


class _Stopwatch:
    """Marks on the device stream (CUDA events) or the host clock (CPU), read after a sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


def time_steps(fn: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls, queued back to back, one mark pair per call."""
    watch = _Stopwatch(device)
    marks = []
    for _ in range(reps):
        start = watch.mark()
        fn()
        marks.append((start, watch.mark()))
    harness.synchronize(device)
    return [watch.elapsed_ms(a, b) for a, b in marks]


DISPATCH_NAME = "dispatch_attention_fn"


class AttentionTimer:
    """Marks around every attention call during the steps run inside it.

    Every diffusers processor computes attention through ``dispatch_attention_fn`` as imported
    into its own module (``type(attn.processor).__module__``), and while vidsparse patches a
    model its shim sits under that very name, routing the video self-attention to the method.
    Wrapping the name in each processor module therefore times every attention call once,
    stock or sparse: for a method, its whole replacement (gate, tiling, top-k, kernels,
    untiling) and nothing else. Calls are told apart by their q and k lengths: one length that
    holds the video tokens is the video self-attention (HunyuanVideo's and HunyuanVideo 1.5's
    is joint video + text attention, q and k of one length too; Wan VACE's VACE blocks attend
    the control tokens, the video's grid), different lengths are cross-attention (text, and
    LTX-2's audio<->video), one shorter length is ``other`` (a text-only self-attention, as
    Kandinsky 5's text blocks; LTX-2's audio self-attention).

    With ``backward=True`` each call's backward is marked too (``_BackwardSpan``): from the
    moment autograd reaches the call's output to the moment it has q's, k's and v's gradients.
    """

    def __init__(self, model, device: torch.device, video_tokens: int, backward: bool = False):
        self.model, self.watch, self.video_tokens = model, _Stopwatch(device), video_tokens
        self.marks: dict[str, list] = {"self": [], "cross": [], "other": []}
        # backward=True (the training step): also each call's backward, under "<kind>_bwd"
        self.backward = backward
        if backward:
            self.marks.update({f"{kind}_bwd": [] for kind in ("self", "cross", "other")})
        self.dtypes: dict[str, set[str]] = {}  # q's dtype per kind of call

    def kind(self, query, key) -> str:
        q, k = query.shape[1], key.shape[1]  # [B, S, H, D]
        if q != k:
            return "cross"
        return "self" if q >= self.video_tokens else "other"

    def modules(self) -> list:
        """The modules of the model's attention processors that call ``dispatch_attention_fn``."""
        names = {
            type(m.processor).__module__
            for m in self.model.modules()
            if getattr(m, "processor", None) is not None
        }
        found = [importlib.import_module(name) for name in sorted(names)]
        found = [m for m in found if callable(getattr(m, DISPATCH_NAME, None))]
        if not found:
            raise RuntimeError(
                f"no attention processor module of {type(self.model).__name__} has "
                f"{DISPATCH_NAME}: nothing to time"
            )
        return found

    def _timed(self, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            kind = self.kind(query, key)
            self.dtypes.setdefault(kind, set()).add(str(query.dtype).removeprefix("torch."))
            span = None
            if self.backward and torch.is_grad_enabled():
                span = _BackwardSpan(self.watch, self.marks[f"{kind}_bwd"])
                args, kwargs = span.enter(args, kwargs)
            start = self.watch.mark()
            out = fn(*args, **kwargs)
            self.marks[kind].append((start, self.watch.mark()))
            return out if span is None else span.exit(out)

        return wrapper

    @contextlib.contextmanager
    def active(self) -> Iterator[AttentionTimer]:
        # What each module holds now: diffusers' function, or vidsparse's shim while patched.
        originals = [(m, getattr(m, DISPATCH_NAME)) for m in self.modules()]
        for module, original in originals:
            setattr(module, DISPATCH_NAME, self._timed(original))
        try:
            yield self
        finally:
            for module, original in originals:
                setattr(module, DISPATCH_NAME, original)

    def total_ms(self, kind: str) -> float:
        return sum(self.watch.elapsed_ms(a, b) for a, b in self.marks[kind])


def attention_share(
    model, step: Callable[[], Any], device: torch.device, reps: int, video_tokens: int
) -> dict:
    """Self- and cross-attention time per step and the self-attention share, over ``reps``
    instrumented steps (``benchmarks/README.md``, "End to end in diffusers")."""
    timer = AttentionTimer(model, device, video_tokens)
    with timer.active():
        step_ms = sum(time_steps(step, device, reps))
    attn, cross = timer.total_ms("self"), timer.total_ms("cross")
    out = {
        "attn_ms": attn / reps,
        "cross_attn_ms": cross / reps,
        "attn_share": attn / step_ms if step_ms > 0 else None,
        "instr_step_ms": step_ms / reps,
        "attn_calls_per_step": len(timer.marks["self"]) // reps,
        "cross_attn_calls_per_step": len(timer.marks["cross"]) // reps,
    }
    if timer.marks["other"]:  # text-only self-attention (Kandinsky 5), LTX-2's audio one
        out["other_attn_ms"] = timer.total_ms("other") / reps
        out["other_attn_calls_per_step"] = len(timer.marks["other"]) // reps
    return out


class _Mark(torch.autograd.Function):
    """Identity on its tensors; its backward records ``span``'s mark ``which``."""

    @staticmethod
    def forward(ctx, span, which, *tensors):
        ctx.span, ctx.which = span, which
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.span.mark(ctx.which)
        return (None, None, *grads)


class _BackwardSpan:
    """The backward of one attention call: a mark when autograd reaches its output, one when
    it has the gradients of q, k and v (one node over the three). Autograd runs the ready node
    made last first, so between the two it runs the nodes made inside the call (a VSA gate's
    projection included), not the rest of the block. A call whose backward never runs (a
    checkpoint's recomputation of the forward) leaves no span."""

    def __init__(self, watch: _Stopwatch, sink: list):
        self.watch, self.sink, self.start = watch, sink, None

    def enter(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        names = ("query", "key", "value")
        where = [i if i < len(args) else name for i, name in enumerate(names)]
        tensors = [args[w] if isinstance(w, int) else kwargs[w] for w in where]
        for w, t in zip(where, _Mark.apply(self, "end", *tensors)):
            if isinstance(w, int):
                args[w] = t
            else:
                kwargs[w] = t
        return tuple(args), kwargs

    def exit(self, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            return _Mark.apply(self, "start", out)[0]
        return out

    def mark(self, which: str) -> None:
        if which == "start":
            self.start = self.watch.mark()
        elif self.start is not None:
            self.sink.append((self.start, self.watch.mark()))


# ---------------------------------------------------------------------------------------------
# SDPA backend
# ---------------------------------------------------------------------------------------------


def _sdpa_order():
    from torch.nn.attention import SDPBackend

    return [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]


def sdpa_context(device: torch.device):
    """cuDNN first for every SDPA call on the GPU (falls back only where cuDNN refuses a call;
    ``check_cudnn`` verifies it takes the step's shapes). On the CPU: SDPA's default."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(_sdpa_order(), set_priority=True)


def _backend_taking(q, k, mask) -> str:
    """The first backend of the priority order that takes ``sdpa(q, k, k, attn_mask=mask)``:
    ``"cudnn"``, or the one that does with why the ones before it refused."""
    from torch.nn.attention import sdpa_kernel

    refused = []
    for backend in _sdpa_order()[:-1]:
        name = backend.name.lower().removesuffix("_attention")
        try:
            with warnings.catch_warnings(), sdpa_kernel(backend):
                warnings.simplefilter("ignore")  # each refusal also warns
                F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        except RuntimeError as exc:
            refused.append(f"{name}: {harness.error_message(exc, 120)}")
            continue
        return f"{name} (refused: {'; '.join(refused)})" if refused else name
    return f"math (refused: {'; '.join(refused)})"


def check_cudnn(work: Workload, device: torch.device, dtype: torch.dtype) -> dict:
    """Does cuDNN alone take the self- and cross-attention calls of the step (HunyuanVideo
    1.5: the joint sequence with its [1, 1, S, S] bool mask; HunyuanVideo: with its [1, 1, 1,
    S] key mask)? Where it does not, which backend of the priority order does."""
    if device.type != "cuda":
        return {"backend": "default (CPU)"}
    d = work.head_dim
    calls = {"self": (work.self_attn_len, work.spec.self_mask)}
    if work.cross_keys is not None:
        calls["cross"] = (work.cross_keys, "none")
    out = {"backend": "cuDNN first (sdpa_kernel priority)"}
    q = torch.randn(1, work.heads, work.self_attn_len, d, device=device, dtype=dtype)
    for kind, (keys, masked) in calls.items():
        k = mask = None
        try:
            k = torch.randn(1, work.heads, keys, d, device=device, dtype=dtype)
            if masked != "none":  # the model's mask: the real tokens (video, real text) a prefix
                real = torch.arange(keys, device=device) < work.tokens + work.joint_text_real
                if masked == "key":
                    mask = real[None, None, None, :]
                else:  # S x S bools: 13 GB at 720p
                    mask = (real[:, None] & real[None, :])[None, None]
            out[kind] = _backend_taking(q, k, mask)
        except torch.OutOfMemoryError as exc:  # building the mask
            out[kind] = f"not checked ({harness.error_message(exc, 120)})"
        del k, mask
        harness.release_memory(device)
    del q
    harness.release_memory(device)
    return out


# ---------------------------------------------------------------------------------------------
# outputs and rows
# ---------------------------------------------------------------------------------------------


def video_output(out) -> torch.Tensor:
    """The video output of a ``return_dict=False`` forward: the first element of the tuple
    (LTX-2: (video, audio)), or the tensor itself (Kandinsky 5 returns one)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def add_relative(rows: list[dict]) -> None:
    """Speedups against the dense row."""
    dense = next((r for r in rows if r["method"] == "dense" and "step_ms" in r), None)
    for r in rows:
        if dense is None:
            break
        if r.get("step_ms"):
            r["speedup"] = dense["step_ms"] / r["step_ms"]
        if r.get("attn_ms") and dense.get("attn_ms"):
            r["attn_speedup"] = dense["attn_ms"] / r["attn_ms"]


# ---------------------------------------------------------------------------------------------
# run metadata
# ---------------------------------------------------------------------------------------------


def run_metadata(args, work: Workload, device, dtype, weights_gb, sdpa, build_s) -> dict:
    import diffusers

    truncated = work.layers < work.full_layers
    meta = harness.collect_metadata(
        device,
        benchmark="e2e",
        workload=work.name,
        model=work.model_name,
        model_class=CLASS_NAMES[work.family],
        config={k: list(v) if isinstance(v, tuple) else v for k, v in work.config.items()},
        layers=work.layers,
        full_layers=work.full_layers,
        layers_note=work.spec.layers_note(work)
        or (
            f"first {work.layers} of {work.full_layers} transformer blocks: a step of the whole "
            "model takes about full_layers / layers times as long (step_ms_per_layer); chosen "
            "for run time, memory would hold more (weights_gb is this build's)"
            if truncated
            else "all transformer blocks"
        ),
        weights_gb=weights_gb,
        latent_shape=list(work.latent),
        text_shape=list(work.text),
        timestep=work.timestep,
        inputs=work.inputs_note,
        grid=list(work.grid_shape),
        tokens=work.tokens,
        joint_text_tokens=work.joint_text,
        joint_text_real=work.joint_text_real,
        self_attention_tokens=work.self_attn_len,
        heads=work.heads,
        head_dim=work.head_dim,
        **work.extra,
        dtype=str(dtype),
        diffusers=diffusers.__version__,
        tiny=args.tiny,
        seed=args.seed,
        warmup=args.warmup,
        reps=args.reps,
        share_reps=args.share_reps,
        compile=(
            "every transformer block torch.compile'd (fullgraph, inductor), all methods; "
            + (
                "inductor's mix-order reduction off (compile_for_training's options); "
                if args.train
                else ""
            )
            + "first_step_s includes the compilation"
            if args.compile == "blocks"
            else "eager"
        ),
        sdpa=sdpa,
        build_s=build_s,
        timer=(
            ("CUDA events" if device.type == "cuda" else f"{harness.CPU_TIMER_LABEL} perf_counter")
            + f": 1 + {args.warmup} untimed steps, median of {args.reps} timed steps"
        ),
        attention_share=(
            "event pair around every call of dispatch_attention_fn in the modules of the "
            "model's attention processors (stock: diffusers' function; patched: vidsparse's "
            "shim there, whose sparse path is the whole replaced attention) over the step's "
            "event pair, summed over "
            f"{args.share_reps} instrumented steps; self-attention: q and k of one length "
            "holding the video tokens, cross: different lengths"
        ),
        complete=False,
    )
    meta.pop("flops_convention", None)  # no FLOP rates here
    return meta
