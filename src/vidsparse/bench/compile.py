"""Compile the Gluon block-sparse forward (and the dK/dV kernel) for sm_90 on any machine (no
GPU needed), and read back ptxas's resource report and a SASS hazard count.

``tests/ops/block_sparse_attn/test_gluon_fwd.py`` builds every variant the library takes with
``compile_sm90``; ``benchmarks/tuning/try_gluon_fwd.py --compile-only`` does the same for the
variants it sweeps. ``compile_launch_sm90`` compiles any one launch, a Triton kernel's too
(``benchmarks/tuning/try_natural_boxes.py --compile``). Triton's interpreter must be off
(``TRITON_INTERPRET`` unset) before vidsparse's kernels are first imported: interpreted
kernels cannot be compiled.

The hazard: ptxas does not keep the A-operand registers of a register-A ``HGMMA`` (the P V
wgmma) reserved while it is in flight; an instruction that writes one of them before a
``WARPGROUP.DEPBAR`` retires the group gives NaNs whenever the wgmma runs late. A variant the
library takes must count zero such writes.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile

import torch

# The problem the kernel is specialised for (the engine's synthetic 32k shape).
B, H, S, D = 1, 12, 32768, 128
BLOCK = 128


def compile_sm90(
    options: dict,
    *,
    masked: bool = False,
    dtype=torch.bfloat16,
    block: int = BLOCK,
    combine: bool = False,
    residual: bool = False,
    key_tails: bool = False,
    gate_rows: bool = False,
    out_rows: bool = False,
) -> dict:
    """Compile the Gluon kernel for cuda:90 on meta tensors; returns ptxas's resource report.

    ``options``: fields of the schedule (``configs.GluonOptions``: STAGES, PINGPONG, P_IN_SMEM,
    ...) overriding the library's (``{}``: the library's own). ``masked``: the variant with
    key-block sizes (padding keys masked, full blocks first); ``block``: 128 (one query block
    per program) or 64 (two, VSA's tiles); ``combine``: VSA's gate epilogue (the gate, and with
    ``masked`` the real rows of each tile); ``residual``: the combine also stores the int8
    residual of o that a backward reads (as under autograd); ``key_tails``: with ``masked``,
    partial key blocks walked with fewer rows (``GluonOptions.KEY_TAILS``); ``gate_rows``: with
    ``combine``, as VSA calls it in natural order (the gate read through a row map; no query
    block sizes: the caller drops the padding rows); ``out_rows``: o stored by pointers through
    the q map into a ``[B, S, H, D]`` tensor (``GradTargets.output``), as VSA calls it in
    natural order with ``configs.override(out_rows=True)``."""
    _require_compiler("compile_sm90")
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import configs
    from vidsparse.ops.block_sparse_attn import fwd_sm90 as launcher
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE
    from vidsparse.ops.block_sparse_attn.grad_rows import GradRows
    from vidsparse.ops.video_sparse_attn.fine import CoarseCombine, combine_spec

    meta = torch.device("meta")
    q = torch.empty(B, H, S, D, dtype=dtype, device=meta)  # [B, H, S, D]
    lse = torch.empty(B, H, S, dtype=torch.float32, device=meta)  # [B, H, S]
    nq = S // block
    idx = torch.empty(1, H, nq, nq // 8, dtype=torch.int32, device=meta)  # [1, H, NQ, K]
    cnt = torch.empty(1, H, nq, dtype=torch.int32, device=meta)  # [1, H, NQ]
    sizes = torch.empty(nq, dtype=torch.int32, device=meta) if masked else None  # [NK]
    ends = torch.empty(1, H, nq, 3, dtype=torch.int32, device=meta) if masked else None
    epilogue = NO_EPILOGUE
    if combine:  # o_coarse [B, H, NQ, D] fp32, gate like q, real rows per block [NQ]
        oc = torch.empty(B, H, nq, D, dtype=torch.float32, device=meta)
        # partial tiles (padding rows zeroed) come with key-block sizes, full ones without
        rows = torch.empty(nq, dtype=torch.int32, device=meta) if masked else None
        gate_map = torch.empty(S, dtype=torch.int32, device=meta) if gate_rows else None
        spec = combine_spec((), residual, rows_dropped=gate_rows)
        epilogue = CoarseCombine(oc, torch.empty_like(q), None if gate_rows else rows, None,
                                 gate_map, spec=spec)  # fmt: skip
        epilogue.saved = epilogue.forward_saved(q)  # as the engine's custom op sets it
    options = {**options, "KEY_TAILS": True} if key_tails else options
    schedule = replace(configs.GLUON, **options) if options else None
    o, o_to = q, None
    if out_rows:
        o = torch.empty(B, S, H, D, dtype=dtype, device=meta).transpose(1, 2)
        o_map = torch.empty(S, dtype=torch.int32, device=meta)
        o_to = GradRows(o_map, o_map, S, S, True, True, out=True)
    kernel, _, args, kwargs = launcher.kernel_args(
        q, q, q, o, lse, idx, cnt, block, block, D**-0.5, sizes, ends,
        configs.key_tails(block), epilogue=epilogue, options=schedule, out_rows=o_to,
    )  # fmt: skip
    return compile_launch_sm90(kernel, args, kwargs)


def compile_dkdv_sm90(
    options: dict, *, masked: bool = False, dtype=torch.bfloat16, block: int = BLOCK,
    epilogue=None, persistent: bool = False,
) -> dict:  # fmt: skip
    """Compile the Gluon dK/dV kernel (``ops/block_sparse_attn/kernels/bwd_sm90.py``) for
    cuda:90 on meta tensors; returns the report of ``compile_sm90``. ``options``: fields of
    ``configs.GluonBwdOptions`` overriding the library's; ``masked``: with key-block sizes;
    ``epilogue``: ``(epilogue, grad_args)`` whose Gluon dK/dV hook is compiled in (None: none);
    ``persistent``: the persistent kernel (``kernels/bwd_sm90_persistent.py``, 128 rows)."""
    _require_compiler("compile_dkdv_sm90")
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import bwd_sm90, configs
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE

    q, lse2, offsets, indices, sizes = _dkdv_meta(dtype, block, masked)
    hooked, grad_args = epilogue if epilogue is not None else (NO_EPILOGUE, ())
    table = configs.GLUON_DKDV_PERSISTENT if persistent else configs.GLUON_DKDV
    schedule = replace(table[block], **options) if options else None
    kernel, _, args, kwargs = bwd_sm90.kernel_args(
        q, q, q, q, q, q, lse2, lse2, offsets, indices, block, D**-0.5, sizes,
        epilogue=hooked, grad_args=grad_args, options=schedule, persistent=persistent,
    )  # fmt: skip
    return compile_launch_sm90(kernel, args, kwargs)


def compile_dq_sm90(
    options: dict, *, masked: bool = False, dtype=torch.bfloat16, block: int = BLOCK,
    epilogue=None, persistent: bool = False,
) -> dict:  # fmt: skip
    """Compile the Gluon dQ kernel (``ops/block_sparse_attn/kernels/bwd_sm90.py``) for cuda:90
    on meta tensors; returns the report of ``compile_sm90``. ``options``: fields of
    ``configs.GluonBwdOptions`` overriding the library's ``GLUON_DQ``; ``masked``: with
    key-block sizes; ``epilogue``: ``(epilogue, grad_args)`` whose Gluon dQ hook is compiled in
    (None: none); ``persistent``: the persistent kernel (``kernels/bwd_sm90_persistent.py``)."""
    _require_compiler("compile_dq_sm90")
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import bwd_sm90, configs
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE

    meta = torch.device("meta")
    q = torch.empty(B, H, S, D, dtype=dtype, device=meta)  # [B, H, S, D], as k, v, do, dq
    lse2 = torch.empty(B, H, S, dtype=torch.float32, device=meta)  # [B, H, S], as delta
    nq = S // block
    idx = torch.empty(1, H, nq, nq // 8, dtype=torch.int32, device=meta)  # [1, H, NQ, K]
    cnt = torch.empty(1, H, nq, dtype=torch.int32, device=meta)  # [1, H, NQ]
    sizes = torch.empty(nq, dtype=torch.int32, device=meta) if masked else None  # [NK]
    hooked, grad_args = epilogue if epilogue is not None else (NO_EPILOGUE, ())
    table = configs.GLUON_DQ_PERSISTENT if persistent else configs.GLUON_DQ
    schedule = replace(table[block], **options) if options else None
    kernel, _, args, kwargs = bwd_sm90.dq_kernel_args(
        q, q, q, q, q, lse2, lse2, idx, cnt, block, D**-0.5, sizes,
        epilogue=hooked, grad_args=grad_args, options=schedule, persistent=persistent,
    )  # fmt: skip
    return compile_launch_sm90(kernel, args, kwargs)


def compile_dkdvdq_sm90(options: dict, *, masked: bool = False, dtype=torch.bfloat16,
                        ordered: bool = False, by_tma: bool = False,
                        fixed: bool = False) -> dict:  # fmt: skip
    """Compile the one-pass backward (``ops/block_sparse_attn/kernels/bwd_sm90_fused.py``,
    128-row blocks) for cuda:90 on meta tensors; returns the report of ``compile_sm90``.
    ``options``: fields of ``configs.GluonBwdOptions`` overriding the library's;
    ``ordered``: the kernel that adds dQ in key-block order; ``by_tma``: the one that adds by
    TMA reductions; ``fixed`` (with ``by_tma``): in int32 fixed point."""
    _require_compiler("compile_dkdvdq_sm90")
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import bwd_sm90, configs

    q, lse2, offsets, indices, sizes = _dkdv_meta(dtype, BLOCK, masked)
    meta, nk = q.device, S // BLOCK
    dq_acc = torch.empty(B, H, S, D, dtype=torch.int32 if fixed else torch.float32, device=meta)
    table = (configs.GLUON_DKDVDQ_ORDERED if ordered
             else configs.GLUON_DKDVDQ_TMA if by_tma else configs.GLUON_DKDVDQ)  # fmt: skip
    schedule = replace(table[BLOCK], **options) if options else None
    order = None
    if ordered:
        idx = torch.empty(1, H, nk, nk // 8, dtype=torch.int32, device=meta)  # [1, H, NQ, K]
        cnt = torch.empty(1, H, nk, dtype=torch.int32, device=meta)  # [1, H, NQ]
        sems = torch.empty(B * H * nk * 2 + 1, dtype=torch.int32, device=meta)
        order = (idx, cnt, sems[1:], sems[:1])
    kernel, _, args, kwargs = bwd_sm90.dkdvdq_kernel_args(
        q, q, q, q, q, q, dq_acc, lse2, lse2, offsets, indices, BLOCK, D**-0.5, sizes,
        options=schedule, order=order, by_tma=by_tma, dq_fix=lse2 if fixed else None,
    )  # fmt: skip
    return compile_launch_sm90(kernel, args, kwargs)


def _dkdv_meta(dtype, block: int, masked: bool):
    """``(q, lse2, q_offsets, q_indices, kv_block_sizes)`` of a dK/dV launch on meta tensors:
    q [B, H, S, D] (as k, v, do, dk, dv), lse2 [B, H, S] (as delta), transposed lists of
    density 1/8, key-block sizes [NK] when ``masked``."""
    meta = torch.device("meta")
    q = torch.empty(B, H, S, D, dtype=dtype, device=meta)
    lse2 = torch.empty(B, H, S, dtype=torch.float32, device=meta)
    nk = S // block
    offsets = torch.empty(1, H, nk + 1, dtype=torch.int32, device=meta)  # [1, H, NK + 1]
    indices = torch.empty(1, H, nk * (nk // 8), dtype=torch.int32, device=meta)  # [1, H, NQ*K]
    sizes = torch.empty(nk, dtype=torch.int32, device=meta) if masked else None
    return q, lse2, offsets, indices, sizes


def _require_compiler(name: str) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError(
            f"{name} needs real Triton kernels: unset TRITON_INTERPRET before vidsparse's"
            " kernels are imported (e.g. run it in a child process without it)"
        )


def compile_launch_sm90(kernel, args, kwargs) -> dict:
    """Compile the launch ``kernel[grid](*args, **kwargs)`` (a Gluon or a Triton kernel) for
    cuda:90; ptxas's resource report, the SASS hazards and the spills inside wgmma loops."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    call_kwargs = {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    launch_options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    signature, constexprs, attrs = _specialise(kernel, backend, args, call_kwargs)
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    src = source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=target, options=launch_options)
    log = ptxas_log(backend, compiled.asm["ptx"], launch_options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run(
            [cuda_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
        "shared": int(compiled.metadata.shared),
        "num_warps": int(compiled.metadata.num_warps),
        "ptxas_warnings": re.findall(r"\(C7\d+\)[^\n]*", log),
        "sass_a_operand_hazards": len(a_operand_hazards(sass)),
        "loop_spill_instructions": spills_in_mma_loops(sass),
        # float-to-int conversions (quarter rate; the fixed-point dQ's rounding by cvt.rni)
        "f2i": len(re.findall(r"\bF2I\b", sass)),
        # bulk reductions by the TMA unit (the one-pass backward's dQ by_tma)
        "tma_reductions": compiled.asm["ptx"].count("cp.reduce.async.bulk.tensor"),
    }


def _specialise(kernel, backend, args, kwargs) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of a launch as the JIT forms them: constexprs and
    attributes keyed by their path into the arguments, so those inside a tuple argument (an
    epilogue hook's flags) stay constexprs."""
    import inspect

    from triton._utils import find_paths_if, get_iterable_path
    from triton.runtime.jit import native_specialize_impl

    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    values = [bound.arguments[param.name] for param in kernel.params]
    specialised = [
        ("constexpr", value) if param.is_constexpr
        else native_specialize_impl(type(backend), value, param.is_const, True, True)
        for param, value in zip(kernel.params, values)
    ]  # fmt: skip
    types = [entry[0] for entry in specialised]
    signature = {param.name: ty for param, ty in zip(kernel.params, types)}
    constexprs = {
        path: get_iterable_path(values, path)
        for path in find_paths_if(types, lambda _, ty: ty == "constexpr")
    }
    found = [entry[1] for entry in specialised]
    attrs = {
        path: backend.parse_attr(get_iterable_path(found, path))
        for path in find_paths_if(found, lambda _, attr: isinstance(attr, str) and attr)
    }
    return signature, constexprs, attrs


def ptxas_path(arch: int) -> str:
    """The ptxas the installed Triton runs for ``sm_<arch>`` (its own choice: Triton 3.9 takes
    its CUDA 13 ptxas from sm_90 on, earlier ones from sm_100; ``TRITON_PTXAS_PATH`` and
    ``TRITON_PTXAS_BLACKWELL_PATH`` honoured)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def cuda_tool(name: str) -> str:
    """A CUDA binary Triton's wheel ships beside its ptxas (``cuobjdump``, ``nvdisasm``)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return os.path.join(os.path.dirname(get_ptxas(90).path), name)


def ptxas_log(backend, ptx: str, options: dict) -> str:
    """ptxas's ``-v`` report (registers, spills, warnings) of ``ptx``, as the installed
    Triton's own ``make_cubin`` runs it: its ptxas for the backend's arch and its flags
    (``--regAllocOptLevel``, ``-lineinfo``, ... as that Triton passes them), so the report is
    that of the cubin a launch would load. ``options``: the launch options of the compile."""
    from triton import knobs

    opt = backend.parse_options(dict(options))
    out = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(out):
        knobs.nvidia.dump_ptxas_log = True  # make_cubin prints the log it read back
        backend.make_cubin(ptx, {}, opt, backend.target.arch)
    return out.getvalue()


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """``[(address, instruction text)]`` of ``cuobjdump -sass`` output, in order."""
    return [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)
    ]


def spills_in_mma_loops(sass: str) -> int:
    """Local-memory loads and stores (spills) inside the kernel's wgmma loops, in SASS: the
    ranges from a predicated backward branch's target to the branch that hold an HGMMA (a
    loop's back edge; the out-of-line mbarrier retries jump back unpredicated)."""
    ins = sass_instructions(sass)
    branch = re.compile(r"@!?P\d\s+BRA\s+0x([0-9a-f]+)")
    targets = [(int(m.group(1), 16), addr) for addr, text in ins if (m := branch.match(text))]
    mma = [a for a, t in ins if t.startswith("HGMMA")]
    loops = [(lo, hi) for lo, hi in targets if lo < hi and any(lo <= a <= hi for a in mma)]
    spill = re.compile(r"(?:@!?P\d\s+)?(?:STL|LDL)\b")
    return sum(1 for a, t in ins if spill.match(t) and any(lo <= a <= hi for lo, hi in loops))


def a_operand_hazards(sass: str) -> list[tuple[int, int, str]]:
    """Writes to the A-operand registers of an in-flight register-A HGMMA group, in SASS.

    From each group (HGMMAs up to the one marked ``gsb0``), follow the code (fall-through and
    branch targets) until a ``WARPGROUP.DEPBAR.LE gsb0, N`` retires the group (N smaller than
    the number of groups committed since it); report every instruction on the way whose
    destination register is one the group reads as A. Returns ``[(group addr, write addr,
    instruction)]``."""
    ins = sass_instructions(sass)
    at = {addr: i for i, (addr, _) in enumerate(ins)}
    hgmma_a = re.compile(r"HGMMA\.\S+ R\d+, R(\d+),")

    def written(text: str) -> set[int]:
        text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
        op, _, rest = text.partition(" ")
        if op.startswith(("ST", "HGMMA", "BAR", "SYNCS", "WARPGROUP", "BRA", "RED", "ATOM")):
            return set()
        m = re.match(r"R(\d+)\b", rest.strip())
        if not m:
            return set()
        width = 4 if ".128" in op else 2 if (".64" in op or "WIDE" in op) else 1
        return {int(m.group(1)) + i for i in range(width)}

    found, i = [], 0
    while i < len(ins):
        if not hgmma_a.search(ins[i][1]):
            i += 1
            continue
        a_regs, j = set(), i
        while j < len(ins):  # the group: HGMMAs up to the one that commits (gsb0)
            m = hgmma_a.search(ins[j][1])
            if m:
                a_regs |= {int(m.group(1)) + r for r in range(4)}
            if "HGMMA" in ins[j][1] and "gsb0" in ins[j][1]:
                break
            j += 1
        stack, seen = [(j + 1, 0)], set()
        while stack:
            k, later = stack.pop()
            while k < len(ins) and (k, later) not in seen:
                seen.add((k, later))
                text = ins[k][1]
                if "HGMMA" in text and "gsb0" in text:
                    later = min(later + 1, 2)
                wait = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", text)
                if wait and int(wait.group(1)) <= later:
                    break
                if written(text) & a_regs:
                    found.append((ins[i][0], ins[k][0], text))
                branch = re.search(r"BRA (0x[0-9a-f]+)", text)
                if branch and int(branch.group(1), 16) in at:
                    stack.append((at[int(branch.group(1), 16)], later))
                if (branch and not text.startswith("@")) or text.startswith("EXIT"):
                    break
                k += 1
        i = j + 1
    return found
