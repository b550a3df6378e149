"""End-to-end benchmark: one denoising step of a real-architecture diffusers video transformer.

The transformer is built from its published config (random weights, bf16, eval mode; the
models are ``e2e_model.MODELS``: Wan 2.1 T2V 1.3B and 14B, Wan 2.2 TI2V-5B, HunyuanVideo 1.5,
HunyuanVideo, LTX-Video, LTX-2, Cosmos 1.0 7B, Kandinsky 5.0 Video Lite, SkyReels-V2 14B, Wan
2.1 VACE 14B):
stock dense attention (SDPA, cuDNN first) against VSA and PSA through
``vidsparse.integrations.diffusers``' public ``apply_sparse_attention``, all on the same model
object and inputs. Per method: the step's latency, the video self-attention's time and share of
the step, speedups over dense, relative L2 of the output against dense, peak memory. Run
(``vidsparse bench e2e -- OPTIONS`` is the same)::

    python -m vidsparse.bench e2e                              # Wan 2.1 1.3B, 480p
    python -m vidsparse.bench e2e --model wan14b --layers 8    # Wan 2.1 14B, 720p
    python -m vidsparse.bench e2e --model wan2.2-5b            # Wan 2.2 TI2V-5B, 704x1280
    python -m vidsparse.bench e2e --model hunyuan1.5           # HunyuanVideo 1.5, 720p, 8 blocks
    python -m vidsparse.bench e2e --model ltx2                 # also hunyuanvideo, ltx, cosmos,
                                                               # kandinsky5, skyreels-v2, wan-vace
    python -m vidsparse.bench e2e --model cosmos --layers all --methods dense --warmup 0 \
        --reps 1 --share-reps 0                                # does the whole model fit?
    python -m vidsparse.bench e2e --compile blocks             # every block torch.compile'd
    python -m vidsparse.bench e2e --device cpu --tiny          # CPU smoke run (any --model)

Needs diffusers >= 0.36. ``benchmarks/README.md`` ("End to end in diffusers") says what each
number covers and how to install diffusers on a GPU machine without network access.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import random
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vidsparse.bench import harness
from vidsparse.bench.harness import Column
from vidsparse.bench.ops.e2e_model import (
    CLASS_NAMES,
    DEFAULT_PSA_TILE,
    LATENT_HW,
    MODELS,
    PSA_SLACK,
    PSA_TOLERANCE,
    VSA_TILE,
    WAN_CONFIGS,
    Workload,
    build_model,
    import_model,
    import_wan,
    make_inputs,
    make_workload,
    plan_file_method,
    synthetic_plan,
)
from vidsparse.testing import rel_l2

# Re-exported: the e2e op's model, inputs and plans, as the registry and e2e_ulysses use them.
__all__ = [
    "DEFAULT_PSA_TILE",
    "LATENT_HW",
    "MODELS",
    "PSA_SLACK",
    "PSA_TOLERANCE",
    "build_model",
    "import_wan",
    "make_inputs",
    "make_workload",
    "main",
    "synthetic_plan",
    "WAN_CONFIGS",
]

METHODS = ("dense", "vsa", "psa", "psa-plan")
PROVIDERS = METHODS

COLUMNS = [
    Column("method", "method"),
    Column("target", "target", ".2f"),
    Column("sparsity", "sparsity", ".3f"),
    Column("step_ms", "step ms", ".1f"),
    Column("speedup", "speedup", ".2f"),
    Column("attn_ms", "attn ms", ".1f"),
    Column("attn_share", "attn share", ".1%"),
    Column("attn_speedup", "attn x", ".2f"),
    Column("rel_l2", "rel L2", ".4f"),
    Column("peak_mem_gb", "peak GB", ".1f"),
]


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
    """

    def __init__(self, model, device: torch.device, video_tokens: int):
        self.model, self.watch, self.video_tokens = model, _Stopwatch(device), video_tokens
        self.marks: dict[str, list] = {"self": [], "cross": [], "other": []}

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
            start = self.watch.mark()
            out = fn(*args, **kwargs)
            self.marks[self.kind(query, key)].append((start, self.watch.mark()))
            return out

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
# one method
# ---------------------------------------------------------------------------------------------


def run_method(method: Method, model, inputs, work: Workload, device, args, ref):
    """Patch, run, time, unpatch. Returns the row and (for dense) the reference output."""
    from vidsparse.integrations.diffusers import (
        apply_sparse_attention,
        remove_sparse_attention,
        set_denoising_step,
    )

    row: dict[str, Any] = {"method": method.name, "target": method.target, **(method.info or {})}
    out_ref = None
    patched = False
    if method.skip:
        row["error"] = method.skip
        return row, None
    try:
        if method.options is not None:
            apply_sparse_attention(model, method.kind, **method.options)
            patched = True
            set_denoising_step(model, method.step)

        def step():
            with torch.no_grad(), sdpa_context(device):
                return video_output(model(**inputs))

        started = time.perf_counter()
        first = step()  # compiles kernels (and the blocks under --compile), builds lists
        harness.synchronize(device)
        row["first_step_s"] = time.perf_counter() - started
        if method.name == "dense":
            out_ref = first
            row["rel_l2"] = rel_l2(step(), first)
        elif ref is not None:
            row["rel_l2"] = rel_l2(first, ref)
        row["out_finite"] = bool(torch.isfinite(first).all())
        del first
        for _ in range(args.warmup):
            step()
        if device.type == "cuda":
            harness.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = time_steps(step, device, args.reps)
        row["step_ms"] = statistics.median(times)
        row["step_ms_min"] = min(times)
        row["step_ms_all"] = times
        row["step_ms_per_layer"] = row["step_ms"] / work.layers
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        if args.share_reps > 0:
            try:
                row.update(attention_share(model, step, device, args.share_reps, work.tokens))
            except Exception as exc:  # noqa: BLE001 - the latency stands without the share
                row["attn_share_error"] = harness.error_message(exc)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = harness.error_message(exc)
    finally:
        if patched:
            remove_sparse_attention(model)
        harness.release_memory(device)
    return row, out_ref


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
# main
# ---------------------------------------------------------------------------------------------


def default_out(device: torch.device, work: Workload, compile_mode: str = "none") -> Path:
    gpu = harness.slug(harness.gpu_name(device))
    gpu = gpu.removeprefix("nvidia-")  # "NVIDIA H200" -> "h200"
    stem = "e2e" if work.name == "wan1.3b-480p" else f"e2e_{work.name}"
    if compile_mode != "none":
        stem += "_compiled"
    return harness.results_dir() / f"{stem}_{gpu}.json"


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------

COMPILE_MODES = ("none", "blocks")


def compile_blocks(model, work: Workload | None = None) -> None:
    """``torch.compile(fullgraph=True)`` of every transformer block, in place (diffusers'
    regional compilation: blocks share one compiled graph while their code sees the same
    Python constants). A graph break anywhere in a block is an error. Every method recompiles
    the blocks once (its hooks are new objects); torch's recompile limit stays as users
    have it, so a method that needed one graph per layer would show it (Dynamo warns and runs
    the excess layers eagerly). A class that declares no ``_repeated_blocks`` (Cosmos) gets
    its family's block class on the instance."""
    names = work.spec.repeated_blocks if work is not None else ()
    if names and not getattr(model, "_repeated_blocks", None):
        model._repeated_blocks = list(names)
    model.compile_repeated_blocks(fullgraph=True)


@contextlib.contextmanager
def cpu_backend(device: torch.device) -> Iterator[None]:
    """On the CPU, vidsparse's PyTorch reference (``VIDSPARSE_BACKEND=torch``) unless a backend
    was asked for explicitly; the environment is restored afterwards (in-process callers)."""
    key = "VIDSPARSE_BACKEND"
    old = os.environ.get(key)
    if device.type == "cpu" and (old or "auto").strip().lower() == "auto":
        os.environ[key] = "torch"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _layers(text: str):
    return "all" if text == "all" else int(text)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=sorted(MODELS), default="wan1.3b")
    resolutions = sorted({r for entry in MODELS.values() for r in entry.latent_hw})
    ap.add_argument(
        "--resolution",
        choices=resolutions,
        default=None,
        help="default: 480p for wan1.3b, 720p for wan14b, wan2.2-5b (704x1280 only), hunyuan1.5,"
        " hunyuanvideo, cosmos (704x1280), skyreels-v2, wan-vace; WIDTHxHEIGHT for ltx "
        "(1216x704, or 768x512), ltx2 (1536x1024, or 768x512), kandinsky5 (768x512)",
    )
    ap.add_argument(
        "--frames",
        type=int,
        default=None,
        help="video frames (default 81 for Wan 2.1 and wan-vace, 129 for hunyuanvideo, 121 for "
        "the others)",
    )
    ap.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help="transformer blocks to build, or 'all' (default wan1.3b 30 of 30, wan14b 8 of 40, "
        "wan2.2-5b 30 of 30, hunyuan1.5 8 of 54, hunyuanvideo 9 of 60 (3 dual + 6 single), ltx "
        "28 of 28, ltx2 48 of 48, cosmos 28 of 28, kandinsky5 32 of 32, skyreels-v2 8 of 40, "
        "wan-vace 10 of 40)",
    )
    ap.add_argument(
        "--methods", default="dense,vsa,psa", help="of dense,vsa,psa (dense always runs)"
    )
    ap.add_argument("--vsa-sparsity", type=float, default=0.875)
    ap.add_argument("--no-vsa-gate", action="store_true", help="VSA without the gate projection")
    ap.add_argument("--psa-sparsities", default="0.6,0.75")
    ap.add_argument(
        "--psa-tile",
        default=None,
        help=f"PSA block TxHxW (default {DEFAULT_PSA_TILE}; wan2.2-5b and ltx: 2x8x8, the "
        "128-token block that pads their grids least)",
    )
    ap.add_argument("--psa-tolerance", type=float, default=PSA_TOLERANCE)
    ap.add_argument("--psa-plan", default=None, help="also run this searched plan file")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    ap.add_argument("--reps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--share-reps", type=int, default=2, help="instrumented steps (0: skip)")
    ap.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="none",
        help="blocks: torch.compile every transformer block (diffusers' compile_repeated_blocks,"
        " fullgraph) for every method, dense included",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model and grid (CPU smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.share_reps < 0:
        raise SystemExit("--reps must be >= 1, --warmup and --share-reps >= 0")
    if args.compile != "none" and args.share_reps:
        # The share's event pairs wrap Python functions inside the compiled blocks.
        print("--compile: attention share not measured (--share-reps 0)", flush=True)
        args.share_reps = 0
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("the full-size models need a GPU; use --device cpu --tiny on the CPU")
    import_model(MODELS[args.model].family)  # fail now, in one line, if diffusers is missing
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    work = make_workload(args)
    out = Path(args.out) if args.out else default_out(device, work, args.compile)
    with cpu_backend(device):
        return _run(args, work, device, dtype, out)


def _metadata(args, work: Workload, device, dtype, weights_gb, sdpa, build_s) -> dict:
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
            "first_step_s includes the compilation"
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


def _run(args, work: Workload, device, dtype, out: Path) -> list[dict]:
    start = time.perf_counter()
    model = build_model(work, device, dtype, args.seed)
    build_s = time.perf_counter() - start
    if args.compile == "blocks":
        compile_blocks(model, work)
    inputs = make_inputs(work, device, dtype, args.seed)
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    sdpa = check_cudnn(work, device, dtype)
    methods = make_methods(args, work)
    meta = _metadata(args, work, device, dtype, weights_gb, sdpa, build_s)
    joint = f" + {work.joint_text} text ({work.joint_text_real} real)" if work.joint_text else ""
    print(
        f"{work.name}: {work.layers}/{work.full_layers} layers, grid {work.grid_shape} "
        f"({work.tokens} tokens{joint}), {work.heads} heads, {dtype}, built in {build_s:.1f} s; "
        f"SDPA {sdpa}",
        flush=True,
    )
    base = {
        "workload": work.name,
        "layers": work.layers,
        "full_layers": work.full_layers,
        "tokens": work.tokens,
        "heads": work.heads,
    }
    rows: list[dict] = []
    ref = None
    for method in methods:
        row, out_ref = run_method(method, model, inputs, work, device, args, ref)
        if out_ref is not None:
            ref = out_ref
        rows.append({**base, **row})
        add_relative(rows)
        harness.write_results(out, meta, rows)
        r = rows[-1]
        print(
            f"  {r['method']:<8} target {r.get('target') or 0:.2f} sparsity "
            f"{r.get('sparsity', 0):.3f}: step {r.get('step_ms', float('nan')):.1f} ms, attn "
            f"{r.get('attn_ms', float('nan')):.1f} ms ({r.get('attn_share') or float('nan'):.1%})"
            f", rel L2 {r.get('rel_l2', float('nan')):.4f}"
            + (f"  ERROR {r['error']}" if r.get("error") else "")
            + (f"  WARNING {r['warning']}" if r.get("warning") else ""),
            flush=True,
        )
    meta["complete"] = True
    meta["total_s"] = time.perf_counter() - start
    harness.write_results(out, meta, rows)
    harness.print_table(rows, COLUMNS)
    print(f"wrote {out}", flush=True)
    return rows


if __name__ == "__main__":
    main()
