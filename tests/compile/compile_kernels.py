"""Compile every block-sparse attention kernel for GPUs this machine does not have.

The triton wheel carries the NVIDIA and AMD compilers, so a CPU machine can compile the kernels
for ``cuda:90`` (H100/H200), ``cuda:100`` (B200) and ``hip:gfx942`` / ``hip:gfx950`` (MI300 /
MI350) and read what each one costs: registers, spills, shared memory. ptxas runs as the
installed Triton runs it (its own ptxas for the target, its own flags), so the report is that
of the cubin a launch would load with this Triton. Run by
``tests/compile/test_compile_targets.py`` in a subprocess, because the test suite sets
``TRITON_INTERPRET=1`` and ``@triton.jit`` takes that decision at import; it also runs by
hand::

    PYTHONPATH=src python tests/compile/compile_kernels.py [--targets cuda:90,hip:gfx942] [--jobs 2]

What is compiled is exactly what the library would launch: the launchers
(``block_sparse_attn_fwd`` / ``_bwd``, with VSA's epilogue too, and the layout's
``tile_rows`` / ``untile_rows``) run on meta tensors with their kernels
swapped for recorders and the device target pinned, so the config (``configs.py``), the
arguments, the constexprs and the launch options come from the library's own code, and each
argument is specialised the way Triton's JIT specialises it at launch (unit strides become
constexprs, 16-divisible ints and pointers get divisibility hints, AMD pointers the 32-bit
range hint). The TMA kernels are recorded when the config asks for them (with key-block sizes
only where the caller vouches the padding finite, as VSA and PSA do); the pointer kernels are
recorded for every case, since the library falls back to them when inputs do not allow TMA.
Likewise the backward's two gradient kernels are recorded for every case, and its fused
kernel (both in one launch) where configs.py fuses them and, on Hopper, at 128x128 for every
case and for VSA's combined backward at 64x64 (``fused_modes``).

Prints one JSON line per compiled (target, kernel, specialisation) on stdout, one line per
unavailable target (``{"target": ..., "skipped": reason}``), and a table on stderr. For AMD
targets each line and row also carry SGPRs, the registers the code object allocates, LDS
bytes and the occupancy in waves per SIMD those allow (``amd_occupancy.py``).
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # must happen before triton / vidsparse are imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from concurrent.futures.process import BrokenProcessPool  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import amd_occupancy  # noqa: E402

# name -> (vidsparse Target args, triton GPUTarget args, shared-memory limit in bytes per block)
TARGETS = {
    "cuda:90": (("cuda", 90), ("cuda", 90, 32), 227 * 1024),  # H100 / H200
    "cuda:100": (("cuda", 100), ("cuda", 100, 32), 227 * 1024),  # B200: the Triton kernels
    "hip:gfx942": (("hip", "gfx942"), ("hip", "gfx942", 64), 64 * 1024),  # MI300X: 64 KB LDS
    "hip:gfx950": (("hip", "gfx950"), ("hip", "gfx950", 64), 160 * 1024),  # MI350X: 160 KB LDS
}
BLOCKS = ((64, 64), (128, 64), (128, 128))
HEAD_DIMS = (64, 128)
# fp16 is compiled for one (block, head_dim) per target: it shares every code path with bf16.
FP16_SPOT = ((128, 128), 128)

# Shapes of the problem the launchers are called with: Wan 2.1 1.3B at 480p (624 tiles of 64
# tokens, padded), top-78 lists shared across the batch. Only strides and alignments reach the
# compiler, and those are the ones a real run has.
BATCH, HEADS, SEQ, TOPK = 2, 12, 39_936, 78

KERNEL_NAMES = {
    "block_sparse_attn_fwd_kernel": "fwd",
    "block_sparse_attn_fwd_tma_kernel": "fwd_tma",
    "block_sparse_attn_bwd_preprocess_kernel": "bwd_preprocess",
    "block_sparse_attn_bwd_dkdv_kernel": "bwd_dkdv",
    "block_sparse_attn_bwd_dq_kernel": "bwd_dq",
    "block_sparse_attn_bwd_fused_kernel": "bwd_fused",
}  # any other ``*_kernel`` a launcher calls is recorded too, under a name derived from its own
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


# --------------------------------------------------------------------------------------------
# Availability of the compilers in the installed triton wheel


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` cannot be compiled for with this wheel, or None when it can."""
    try:
        from triton.backends import backends
    except Exception as e:  # pragma: no cover - triton missing or broken
        return f"triton backends cannot be imported: {e!r}"
    backend, arch = TARGETS[name][1][:2]
    plugin = {"cuda": "nvidia", "hip": "amd"}[backend]
    if plugin not in backends:
        return f"the installed triton has no {plugin} backend (has {sorted(backends)})"
    if backend == "cuda":
        from vidsparse.bench.compile import ptxas_path

        path = ptxas_path(arch)
        if not os.access(path, os.X_OK):
            return f"the installed triton has no ptxas at {path}"
    return None


# --------------------------------------------------------------------------------------------
# Recording what the launchers would launch


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, kernel, sink):
        self.kernel = kernel
        self.sink = sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.kernel, args, kwargs))

        return launch


@contextlib.contextmanager
def _recording(target, tma_compatible: bool, sink: list):
    """Pin the target, stub the TMA check and record every kernel launch of the launchers."""
    from triton.runtime.jit import JITFunction

    from vidsparse.ops.block_sparse_attn import bwd, fwd, lists

    patches = []
    for module in (fwd, bwd, lists):
        if module is not lists:
            patches.append((module, "tma_compatible", lambda *tensors: tma_compatible))
            patches.append((module, "target_of", lambda device: target))
        for attr in dir(module):
            obj = getattr(module, attr)
            if attr.endswith("_kernel") and isinstance(obj, JITFunction):
                patches.append((module, attr, _Recorder(obj, sink)))
    # The Gluon kernels (Hopper: fwd_sm90.py, bwd_sm90.py) have their own checks
    # (test_gluon_fwd.py, test_compile_bwd_sm90.py); here the Triton kernels they fall back to
    # are recorded.
    patches.append((fwd, "gluon_fits", lambda *args: False))
    patches.append((bwd, "_gluon_kernels", lambda *args: (False, False)))
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    try:
        for module, attr, value in patches:
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def record_launches(target, block_q, block_kv, head_dim, dtype, has_kv_sizes, tma_compatible):
    """``[(kernel, args, kwargs)]`` of one forward and one backward pass, on meta tensors."""
    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.configs import override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd
    from vidsparse.ops.block_sparse_attn.grad_rows import GradRows

    meta = torch.device("meta")
    nq, nk = SEQ // block_q, SEQ // block_kv

    def bhsd():
        return torch.empty(BATCH, HEADS, SEQ, head_dim, dtype=dtype, device=meta)

    def natural():  # [B, S, H, D] storage, as diffusers passes it
        return torch.empty(BATCH, SEQ, HEADS, head_dim, dtype=dtype, device=meta).transpose(1, 2)

    q, k, v, do = bhsd(), bhsd(), bhsd(), bhsd()
    kv_indices = torch.empty(1, HEADS, nq, TOPK, dtype=torch.int32, device=meta)
    kv_counts = torch.empty(1, HEADS, nq, dtype=torch.int32, device=meta)
    kv_sizes = torch.empty(nk, dtype=torch.int32, device=meta) if has_kv_sizes else None
    scale = head_dim**-0.5
    sink: list = []
    with _recording(target, tma_compatible, sink):
        o, lse = block_sparse_attn_fwd(
            q, k, v, kv_indices, kv_counts, kv_sizes, block_q, block_kv, scale
        )
        if has_kv_sizes:  # PSA / VSA callers vouch for finite padding: the TMA kernel on Hopper
            block_sparse_attn_fwd(
                q, k, v, kv_indices, kv_counts, kv_sizes, block_q, block_kv, scale,
                padding_finite=True,
            )  # fmt: skip
        # VSA's fine stage with the fused gate epilogue, at its 4x4x4 tile (64 tokens). With
        # 128-token tiles the epilogue spills 2-7 registers on gfx942/gfx950 (not recorded).
        # Inference, and training: 16-bit outputs then keep o's int8 residual for the backward.
        if has_kv_sizes and block_q == block_kv == 64:
            oc = torch.empty(BATCH, HEADS, nq, head_dim, dtype=torch.float32, device=meta)
            gate_map = torch.empty(SEQ, dtype=torch.int32, device=meta)
            # natural order in training: the gate read through its row map, and o stored
            # through the token map too (configs.override(out_rows=True))
            out_to = GradRows(gate_map, gate_map, SEQ, SEQ, True, True, out=True)
            for residual, rows, out_rows in (
                (False, None, None),
                (True, None, None),
                (True, gate_map, None),
                (True, gate_map, out_to),
            ):
                epilogue = _combine(q, oc, bhsd(), kv_sizes, residual=residual, gate_rows=rows)
                block_sparse_attn_fwd(
                    q, k, v, kv_indices, kv_counts, kv_sizes, block_q, block_kv, scale,
                    padding_finite=True, epilogue=epilogue, out_rows=out_rows,
                )  # fmt: skip
        # The backward as configs.py launches it (fused or not) and as two launches (what runs
        # wherever the configs do not fuse); on Hopper also as one fused launch (fused_modes).
        vsa = has_kv_sizes and block_q == block_kv == 64  # VSA's tiles: its combined backward
        oc = torch.empty(BATCH, HEADS, nq, head_dim, dtype=torch.float32, device=meta)
        dpooled = torch.empty(3, BATCH, HEADS, nq, head_dim, dtype=torch.float32, device=meta)
        plain_modes, vsa_modes = fused_modes(target, block_q, block_kv)
        args = (do, q, k, v, o, lse, kv_indices, kv_counts, kv_sizes, block_q, block_kv, scale)
        for fused in plain_modes:
            with override(fused=fused):
                block_sparse_attn_bwd(*args)
                if has_kv_sizes:  # VSA's backward vouches for finite padding (TMA on Hopper)
                    block_sparse_attn_bwd(*args, padding_finite=True)
        for fused in vsa_modes if vsa else ():
            # the combine's gradients fused, and the coarse branch's (the tile means' shares
            # added on the finished gradients)
            epilogue = _PooledGradStub(q, oc, bhsd(), kv_sizes, dpooled)
            with override(fused=fused):
                block_sparse_attn_bwd(*args, padding_finite=True, epilogue=epilogue)
            if fused is None:  # natural-order inputs: gradients (d gate too) through row maps
                rows = torch.empty(SEQ, dtype=torch.int32, device=meta)
                maps = GradRows(rows, rows, SEQ, SEQ, True, True)
                epilogue = _PooledGradStub(q, oc, bhsd(), kv_sizes, dpooled, gate_rows=rows)
                block_sparse_attn_bwd(*args, padding_finite=True, epilogue=epilogue,
                                      grad_rows=maps)  # fmt: skip
                # and o, dO in natural order (the preprocess reads them through the map)
                out_args = (natural(), *args[1:4], natural(), *args[5:])
                epilogue = _PooledGradStub(q, oc, bhsd(), kv_sizes, dpooled, gate_rows=rows)
                block_sparse_attn_bwd(*out_args, padding_finite=True, epilogue=epilogue,
                                      grad_rows=maps._replace(out=True))  # fmt: skip
    return sink


def _combine(q, oc, gate, sizes, pooled=None, *, residual: bool, gate_rows=None):
    """VSA's epilogue as its fine stage builds it; with ``residual``, as under autograd; with
    ``gate_rows``, as in natural order (the gate through its map, padding rows dropped)."""
    from vidsparse.ops.video_sparse_attn.fine import CoarseCombine, combine_spec

    natural = gate_rows is not None
    spec = combine_spec((), residual, rows_dropped=natural)
    epilogue = CoarseCombine(oc, gate, None if natural else sizes, pooled, gate_rows, spec=spec)
    epilogue.saved = epilogue.forward_saved(q)  # as the engine's custom op sets it
    return epilogue


def _PooledGradStub(q, oc, gate, sizes, dpooled, gate_rows=None):
    """VSA's epilogue in training (o's residual kept for 16-bit outputs) with the coarse
    attention's backward (a host step, nothing to compile) replaced by a fixed ``dpooled``."""
    epilogue = _combine(q, oc, gate, sizes, torch.empty_like(dpooled), residual=True,
                        gate_rows=gate_rows)  # fmt: skip
    epilogue._pooled_grad = lambda d_coarse, call, kernel=False: dpooled
    return epilogue


def fused_modes(target, block_q, block_kv) -> tuple[tuple, tuple]:
    """The backward's ``fused`` arguments to record, for ``block_sparse_attn_bwd`` and for
    VSA's combined backward: the library's choice (None) and two launches (False) everywhere;
    on Hopper one launch (True) as well, at 128x128 for both (configs.py fuses there; True
    also reaches the masked-key configs, which launch alike) and at 64x64 for VSA's (its
    configs launch alike: the fused kernel's ADD_POOLED epilogues)."""
    if not target.is_hopper:
        return (None, False), (None, False)
    if (block_q, block_kv) == (128, 128):
        return (None, False, True), (None, False, True)
    return (None, False), (None, False, True)


def specialise(kernel, args, kwargs, backend_cls):
    """What ``kernel[grid](*args, **kwargs)`` hands the compiler, as plain data.

    Mirrors ``JITFunction.run``: constexpr parameters are constants, every other argument goes
    through the JIT's own specialisation (``native_specialize_impl``), tuples (an epilogue's
    arguments) element by element. Top-level constexprs are keyed by name, those inside a
    tuple by their path; attributes by parameter index or path. Jit functions passed as
    constexprs (epilogue hooks) travel as ``JitRef``s, so jobs can be pickled.
    """
    from triton._utils import find_paths_if, get_iterable_path
    from triton.runtime.jit import native_specialize_impl

    names = kernel.arg_names
    call_kwargs = {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    bound = inspect.signature(kernel.fn).bind(*args, **call_kwargs)
    bound.apply_defaults()
    values = [bound.arguments[param.name] for param in kernel.params]
    specs = []
    for param, value in zip(kernel.params, values):
        if param.is_constexpr:
            specs.append(("constexpr", None))
            continue
        specs.append(native_specialize_impl(
            backend_cls, value, param.is_const, not param.do_not_specialize,
            not param.do_not_specialize_on_alignment,
        ))  # fmt: skip
    types = [ty for ty, _ in specs]
    signature = {param.name: ty for param, ty in zip(kernel.params, types)}
    constexprs = {}
    for path in find_paths_if(types, lambda _, ty: ty == "constexpr"):
        key = names[path[0]] if len(path) == 1 else path
        constexprs[key] = _portable(get_iterable_path(values, path))
    hints = [attr for _, attr in specs]
    attrs = {}
    for path in find_paths_if(hints, lambda _, attr: isinstance(attr, str) and attr):
        attrs[path[0] if len(path) == 1 else path] = get_iterable_path(hints, path)
    return signature, constexprs, attrs, options


class JitRef(NamedTuple):
    """A jit function by module and name (jit functions themselves do not pickle)."""

    module: str
    name: str

    def load(self):
        return getattr(importlib.import_module(self.module), self.name)


def _portable(value):
    from triton.runtime.jit import JITFunction

    if isinstance(value, JITFunction):
        return JitRef(value.fn.__module__, value.__name__)
    return value


def _loaded(value):
    return value.load() if isinstance(value, JitRef) else value


def short_name(function_name: str) -> str:
    if function_name in KERNEL_NAMES:
        return KERNEL_NAMES[function_name]
    return function_name.lstrip("_").removeprefix("block_sparse_attn_").removesuffix("_kernel")


def build_jobs(names):
    """One job per distinct compile, labelled with the first case that needs it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from vidsparse.utils.device import Target

    cases = []
    for (bq, bk), d in [(b, d) for b in BLOCKS for d in HEAD_DIMS]:
        cases.append((bq, bk, d, torch.bfloat16))
    cases.append((*FP16_SPOT[0], FP16_SPOT[1], torch.float16))

    jobs, seen = [], set()
    for name in names:
        target_args, gpu_args, shared_limit = TARGETS[name]
        target = Target(*target_args)
        backend_cls = type(make_backend(GPUTarget(*gpu_args)))
        for bq, bk, d, dtype in cases:
            for has_sizes in (False, True):
                # Both forward paths on NVIDIA: TMA when the config and inputs allow, else generic.
                tma_choices = (False, True) if target.backend == "cuda" else (False,)
                for tma_ok in tma_choices:
                    for kernel, args, kwargs in record_launches(
                        target, bq, bk, d, dtype, has_sizes, tma_ok
                    ):
                        _add_job(
                            jobs, seen, (name, gpu_args, shared_limit), backend_cls,
                            kernel, args, kwargs, short_name(kernel.__name__),
                            block_q=bq, block_kv="BLOCK_N", head_dim=d, dtype=dtype,
                            has_kv_sizes="HAS_KV_SIZES",
                        )  # fmt: skip
    jobs.extend(build_permute_jobs(names))  # VideoGrid.tile / untile kernels
    return jobs


# --------------------------------------------------------------------------------------------
# VideoGrid.tile / untile kernels (vidsparse.layout.permute)

# Wan 14B at 720p: a (21, 45, 80) latent grid, 40 heads; PSA's (2, 8, 8) and VSA's (4, 4, 4)
# tiles. The tile shape and head dim are constexprs; strides only reach the compiler as
# alignments, so a contiguous [B, H, S, D] input and a transposed [B, S, H, D] one are recorded.
PERMUTE_GRID, PERMUTE_HEADS = (21, 45, 80), 40
PERMUTE_TILES = ((4, 4, 4), (2, 8, 8))
PERMUTE_CASES = [(d, torch.bfloat16) for d in HEAD_DIMS] + [(128, torch.float32)]
PERMUTE_KERNEL_NAMES = {"_tile_rows_kernel": "grid_tile", "_untile_rows_kernel": "grid_untile"}
DTYPES.setdefault(torch.float32, "fp32")


@contextlib.contextmanager
def _recording_permute(sink: list):
    """Record every launch of the permute launchers (they pick no target-specific config)."""
    from triton.runtime.jit import JITFunction

    from vidsparse.layout import permute

    saved = {}
    for attr in dir(permute):
        obj = getattr(permute, attr)
        if attr.endswith("_kernel") and isinstance(obj, JITFunction):
            saved[attr] = obj
            setattr(permute, attr, _Recorder(obj, sink))
    try:
        yield
    finally:
        for attr, obj in saved.items():
            setattr(permute, attr, obj)


def record_permute_launches(tile, head_dim, dtype):
    """``[(kernel, args, kwargs)]`` of one tile and one untile, on meta tensors."""
    from vidsparse.layout.permute import tile_rows, untile_rows
    from vidsparse.layout.permute_ops import padded_len_of

    meta = torch.device("meta")
    num_tokens = PERMUTE_GRID[0] * PERMUTE_GRID[1] * PERMUTE_GRID[2]
    padded = padded_len_of(PERMUTE_GRID, tile)
    sink: list = []
    with _recording_permute(sink):
        for seq, launcher in ((num_tokens, tile_rows), (padded, untile_rows)):
            bhsd = torch.empty(1, PERMUTE_HEADS, seq, head_dim, dtype=dtype, device=meta)
            bshd = torch.empty(1, seq, PERMUTE_HEADS, head_dim, dtype=dtype, device=meta)
            for x in (bhsd, bshd.transpose(1, 2)):
                launcher(x, PERMUTE_GRID, tile)
    return sink


def build_permute_jobs(names):
    """One job per distinct compile of the tile / untile kernels, as ``build_jobs`` does."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    jobs, seen = [], set()
    for name in names:
        _, gpu_args, shared_limit = TARGETS[name]
        backend_cls = type(make_backend(GPUTarget(*gpu_args)))
        for tile in PERMUTE_TILES:
            for d, dtype in PERMUTE_CASES:
                for kernel, args, kwargs in record_permute_launches(tile, d, dtype):
                    label = PERMUTE_KERNEL_NAMES.get(kernel.__name__, kernel.__name__.strip("_"))
                    _add_job(
                        jobs,
                        seen,
                        (name, gpu_args, shared_limit),
                        backend_cls,
                        kernel,
                        args,
                        kwargs,
                        label,
                        block_q="BLOCK_S",
                        block_kv=None,
                        head_dim=d,
                        dtype=dtype,
                        has_kv_sizes=None,
                    )  # fmt: skip  (block_q: rows per program; config: tile_t/h/w, block_s)
    return jobs


def _add_job(jobs, seen, target, backend_cls, kernel, args, kwargs, label, **case) -> None:
    """Append the compile job of one recorded launch unless an identical one is queued.

    ``target``: ``(name, gpu_args, shared_limit)``. ``case`` fields given as a str name the
    constexpr that holds the value (``"BLOCK_N"``); others are taken as they are."""
    name, gpu_args, shared_limit = target
    signature, constexprs, attrs, options = specialise(kernel, args, kwargs, backend_cls)
    key = json.dumps(
        [name, kernel.__name__, signature, sorted(map(str, constexprs.items())),
         sorted(map(str, attrs.items())), options], sort_keys=True, default=str,
    )  # fmt: skip
    if key in seen:
        return
    seen.add(key)
    fields = {
        k: constexprs.get(v) if isinstance(v, str) else v for k, v in case.items() if k != "dtype"
    }
    jobs.append(
        {
            "target": name,
            "gpu_target": gpu_args,
            "shared_limit": shared_limit,
            "kernel": label,
            "module": kernel.fn.__module__,
            "function": kernel.__name__,
            **fields,
            "dtype": DTYPES[case["dtype"]],
            "config": _config_of(options, constexprs),
            "signature": signature,
            "constexprs": constexprs,
            "attrs": attrs,
            "options": options,
        }
    )


_CASE_CONSTEXPRS = {"BLOCK_M", "BLOCK_N", "HEAD_DIM", "HAS_KV_SIZES", "DOT_PRECISION"}


def _config_of(options, constexprs):
    """Launch options plus the config's constexprs (SUB_M, WARP_SPECIALIZE, ...)."""
    config = dict(options)
    for key, value in constexprs.items():
        if isinstance(key, str) and key.isupper() and key not in _CASE_CONSTEXPRS:
            # not the unit strides; an epilogue hook by its name
            config[key.lower()] = value.name if isinstance(value, JitRef) else value
    return config


# --------------------------------------------------------------------------------------------
# Compiling (in worker processes) and reading the costs


REPORT_KEYS = ("target", "kernel", "module", "block_q", "block_kv", "head_dim", "dtype",
               "has_kv_sizes", "config", "shared_limit")  # fmt: skip


def compile_job(job):
    """Compile one job; returns the job's report (never raises)."""
    report = {k: job[k] for k in REPORT_KEYS}
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as log:
        try:
            report.update(_compile(job, log))
            report["ok"] = True
        except Exception as e:
            log.seek(0)
            diagnostics = [line for line in log.read().splitlines() if _DIAGNOSTIC.search(line)]
            report["ok"] = False
            report["error"] = "\n".join([f"{type(e).__name__}: {e}", *diagnostics[:20]])[-4000:]
            report["traceback"] = traceback.format_exc()[-4000:]
    report["compile_s"] = round(time.perf_counter() - start, 2)
    return report


def _compile(job, log) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    kernel = getattr(importlib.import_module(job["module"]), job["function"])
    target = GPUTarget(*job["gpu_target"])
    backend = make_backend(target)
    attrs = {
        (key,) if isinstance(key, int) else key: backend.parse_attr(desc)
        for key, desc in job["attrs"].items()
    }
    constexprs = {key: _loaded(value) for key, value in job["constexprs"].items()}
    src = ASTSource(fn=kernel, signature=job["signature"], constexprs=constexprs, attrs=attrs)
    with warnings.catch_warnings(record=True) as caught, _stderr_to(log):
        warnings.simplefilter("always")
        compiled = triton.compile(src, target=target, options=dict(job["options"]))
    usage = {
        "warnings": sorted({str(w.message).split(".")[0] for w in caught}),
        "shared": int(compiled.metadata.shared),
    }
    if target.backend == "cuda":
        usage.update(_ptxas_usage(backend, compiled.asm["ptx"], job["options"]))
    else:
        usage.update(_amdgcn_usage(compiled.asm["amdgcn"]))
        usage.update(_amd_occupancy(usage, target.arch, job["options"].get("num_warps", 4)))
    return usage


_DIAGNOSTIC = re.compile(r"error|unreachable|assert|unsupported|failed", re.IGNORECASE)


@contextlib.contextmanager
def _stderr_to(file):
    """Send file descriptor 2 (where MLIR and LLVM write their diagnostics) to ``file``."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _ptxas_usage(backend, ptx: str, options: dict) -> dict:
    """Registers and spills as ptxas reports them, run as the installed Triton runs it (its
    own ptxas for the target, its own flags: ``vidsparse.bench.compile.ptxas_log``)."""
    from vidsparse.bench.compile import ptxas_log

    log = ptxas_log(backend, ptx, options)
    # "Potential Performance Loss" notes, e.g. C7515: every wgmma of the kernel serialised.
    warnings_ = sorted(set(re.findall(r"\((C75\d\d)\)", log)))
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if not (regs and spills):
        raise RuntimeError(f"cannot read ptxas -v output:\n{log}")
    stores, loads = int(spills.group(1)), int(spills.group(2))
    return {
        "registers": int(regs.group(1)),
        "spills": stores + loads,
        "spill_stores": stores,
        "spill_loads": loads,
        "stack": int(stack.group(1)) if stack else 0,
        "ptxas_warnings": warnings_,
    }


def _amdgcn_usage(asm: str) -> dict:
    """VGPRs, AGPRs, SGPRs (used, and as the kernel descriptor allocates them), spills,
    scratch and static LDS from the kernel's AMDGPU metadata and LLVM's comments."""

    def field(pattern, required=True):
        m = re.search(pattern, asm, re.MULTILINE)
        if m is None:
            if required:
                raise RuntimeError(f"no {pattern!r} in the amdgcn assembly")
            return 0
        return int(m.group(1))

    vgpr_spills = field(r"^\s*\.vgpr_spill_count:\s*(\d+)")
    sgpr_spills = field(r"^\s*\.sgpr_spill_count:\s*(\d+)")
    vgprs, sgprs = field(r"^\s*\.vgpr_count:\s*(\d+)"), field(r"^\s*\.sgpr_count:\s*(\d+)")
    return {
        "registers": vgprs,  # arch VGPRs + AGPRs, per lane
        "agprs": field(r"^; NumAgprs:\s*(\d+)", required=False),
        "sgprs": sgprs,
        # What the kernel descriptor asks for: the registers used, raised by LLVM so that no
        # more waves fit than waves_per_eu allows (hence what the occupancy is computed from).
        "vgprs_allocated": field(r"^; NumVGPRsForWavesPerEU:\s*(\d+)", required=False) or vgprs,
        "sgprs_allocated": field(r"^; NumSGPRsForWavesPerEU:\s*(\d+)", required=False) or sgprs,
        "static_lds": field(r"^\s*\.group_segment_fixed_size:\s*(\d+)"),
        "spills": vgpr_spills + sgpr_spills,
        "vgpr_spills": vgpr_spills,
        "sgpr_spills": sgpr_spills,
        "stack": field(r"^; ScratchSize:\s*(\d+)", required=False),
        # LLVM's figure: registers and static LDS only (Triton's LDS is dynamic).
        "llvm_occupancy": field(r"^; Occupancy:\s*(\d+)", required=False),
    }


def _amd_occupancy(usage: dict, arch: str, num_warps: int) -> dict:
    """LDS bytes a workgroup takes (Triton's dynamic LDS plus any static) and the waves per
    SIMD that registers and LDS allow (``amd_occupancy.occupancy``)."""
    lds = usage["shared"] + usage["static_lds"]
    waves = amd_occupancy.occupancy(arch, num_warps, usage["vgprs_allocated"],
                                    usage["sgprs_allocated"], lds)  # fmt: skip
    return {"lds": lds, **waves}


def run_jobs(jobs, workers):
    if workers <= 1:
        return [compile_job(job) for job in jobs]
    # Longest first (CUDA and the backward kernels), so the pool finishes together.
    order = sorted(
        range(len(jobs)),
        key=lambda i: (
            not jobs[i]["target"].startswith("cuda:"),
            not jobs[i]["kernel"].startswith(("bwd_d", "bwd_fused")),
        ),
    )
    results = [None] * len(jobs)
    ctx = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = {i: pool.submit(compile_job, jobs[i]) for i in order}
            for i, future in futures.items():
                results[i] = future.result()
    except BrokenProcessPool as e:  # a compiler crashed its process: report, do not hang
        for i, job in enumerate(jobs):
            if results[i] is None:
                error = f"compiler process died (this job or one beside it): {e!r}"
                results[i] = {**{k: job[k] for k in REPORT_KEYS}, "ok": False, "error": error}
    return results


def format_table(results) -> str:
    """One row per compile. ``regs``: registers a thread (CUDA) or VGPRs a lane (AMD) used;
    AMD rows also show ``alloc`` (VGPRs the kernel descriptor allocates), ``sgpr``, ``occ``
    (waves per SIMD) and what bounds it; ``shared``: bytes of shared memory / LDS."""
    head = (
        f"{'target':<11} {'kernel':<15} {'bq':>4} {'bk':>4} {'D':>4} {'dt':<5} {'sizes':<5} "
        f"{'config':<48} {'regs':>5} {'alloc':>5} {'sgpr':>5} {'spill':>6} {'stack':>6} "
        f"{'shared':>7} {'occ':>3} {'limit':<8} {'s':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items())
        if not r.get("ok"):
            lines.append(f"{r['target']:<11} {r['kernel']:<15} FAILED: {r['error'][:200]}")
            continue
        amd = "occupancy" in r
        lines.append(
            f"{r['target']:<11} {r['kernel']:<15} {r['block_q']:>4} {r['block_kv'] or '-':>4} "
            f"{r['head_dim']:>4} {r['dtype']:<5} {str(r['has_kv_sizes'] or False)[0]:<5} "
            f"{cfg:<48} {r['registers']:>5} {r['vgprs_allocated'] if amd else '-':>5} "
            f"{r['sgprs'] if amd else '-':>5} {r['spills']:>6} {r['stack']:>6} "
            f"{r['lds'] if amd else r['shared']:>7} {r['occupancy'] if amd else '-':>3} "
            f"{r['occupancy_limit'] if amd else '-':<8} {r['compile_s']:>5}"
        )
    return "\n".join(lines)


def occupancy_summary(results) -> list[str]:
    """Per AMD target, the lowest and highest occupancy of its compiles."""
    lines = []
    for target in sorted({r["target"] for r in results if "occupancy" in r}):
        waves = [r["occupancy"] for r in results if r["target"] == target and "occupancy" in r]
        lines.append(f"{target}: {min(waves)}-{max(waves)} waves per SIMD")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--no-table", action="store_true", help="JSON lines only")
    args = parser.parse_args(argv)
    names = [t for t in args.targets.split(",") if t]
    for name in names:
        if name not in TARGETS:
            parser.error(f"unknown target {name!r}; known: {', '.join(TARGETS)}")

    start = time.perf_counter()
    available = []
    for name in names:
        reason = unavailable_reason(name)
        if reason:
            print(json.dumps({"target": name, "skipped": reason}), flush=True)
        else:
            available.append(name)
    jobs = build_jobs(available)
    results = run_jobs(jobs, args.jobs)
    for r in results:
        print(json.dumps(r), flush=True)
    if not args.no_table:
        print(format_table(results), file=sys.stderr)
        print("\n".join(occupancy_summary(results)), file=sys.stderr)
    failed = sum(not r["ok"] for r in results)
    spilled = sum(r.get("spills", 0) > 0 for r in results)
    print(
        f"{len(results)} compiles, {failed} failed, {spilled} spilling, "
        f"{time.perf_counter() - start:.1f} s with {args.jobs} workers",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
