"""Try the Gluon (Hopper, FA3-style) block-sparse forward's variants against the Triton kernel.

The library's forward now takes the Gluon kernel on Hopper (``configs.py``: ``gluon=True``); the
baseline here is the Triton TMA kernel it falls back to: ``fwd.block_sparse_attn_fwd`` with
that config minus ``gluon`` (``configs.lookup(target, "fwd", ...)`` passed back through
``configs.override(fwd=...)``, ``triton_fwd`` below), still named "library" in the JSON of the
first run. Each Gluon variant is a ``configs.GluonOptions`` (the library's ``configs.GLUON``
with some fields replaced), set by ``configs.override(gluon=...)`` around the Gluon launcher
``fwd_sm90.block_sparse_attn_fwd_sm90`` (``gluon_fwd`` below).

Run on an H100/H200 from the repository root::

    PYTHONPATH=src python benchmarks/tuning/try_gluon_fwd.py                 # check, then time
    PYTHONPATH=src python benchmarks/tuning/try_gluon_fwd.py --compile-only  # any machine: sm_90

What it does on the GPU:

1. For every Gluon variant (``VARIANTS``), in a child process with a timeout (a hung
   mbarrier protocol must not eat the whole run): correctness on small cases against the
   library kernel and an fp32 PyTorch reference (density 0.5 with empty rows; ragged counts
   0..NK with lists broadcast over the batch; a dense case whose ring phases wrap many times),
   outputs poisoned with NaN beforehand, then at the timed size against the library kernel
   (density 1/8) and cuDNN (density 1).
2. Times (``do_bench`` medians, two alternating rounds) the variants that passed, the library's
   ``block_sparse_attn_fwd`` and cuDNN SDPA dense at B=1, H=12, S=32768, D=128, bf16, at
   density 1 (every block listed) and 1/8 (``random_block_lists``).

TFLOP/s = 4 * B * H * S^2 * D * density / time. Writes ``$OUT/try_gluon_fwd.json`` if ``OUT``
is set; prints a table last.

``--compile-only`` compiles every variant for ``cuda:90`` without a GPU
(``vidsparse.bench.compile.compile_sm90``, which builds ``fwd_sm90.kernel_args`` with the
variant's ``GluonOptions``, as ``tests/compile/compile_kernels.py`` does for the Triton
kernels) and prints registers, spills, shared memory, ptxas's wgmma-serialisation warnings
(C7512 and friends) and a SASS hazard count: instructions that write an A-operand register
of a register-A ``HGMMA`` (the P V wgmma) before a ``WARPGROUP.DEPBAR`` has retired it.
ptxas does not keep those registers reserved (a first version computed the next P while P V
was in flight and ptxas reused them: NaNs whenever the wgmma ran late), so this count must
be 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel is defined: real kernels only

import torch  # noqa: E402

from vidsparse.bench.compile import compile_sm90  # noqa: E402

# Gluon variants: name -> fields of configs.GluonOptions replaced in the library's configs.GLUON.
# reg_*: P fed to the P V wgmma from registers; smem_*: P staged in shared memory (SS wgmma).
# s2/s3: K/V ring depth; pp: ping-pong between the two consumer warpgroups. One query block a
# program, except *_persistent: one program per SM over them (kernels/fwd_sm90_persistent.py).
VARIANTS = {
    "reg_s2_pp": dict(STAGES=2, PINGPONG=True, P_IN_SMEM=False, PERSISTENT=False),
    "reg_s3_pp": dict(STAGES=3, PINGPONG=True, P_IN_SMEM=False, PERSISTENT=False),
    "reg_s2_nopp": dict(STAGES=2, PINGPONG=False, P_IN_SMEM=False, PERSISTENT=False),
    "smem_s2_pp": dict(STAGES=2, PINGPONG=True, P_IN_SMEM=True, PERSISTENT=False),
    "smem_s2_nopp": dict(STAGES=2, PINGPONG=False, P_IN_SMEM=True, PERSISTENT=False),
    "reg_s2_pp_persistent": dict(STAGES=2, PINGPONG=True, P_IN_SMEM=False, PERSISTENT=True),
}
B, H, S, D = 1, 12, 32768, 128
BLOCK = 128
CHILD_TIMEOUT_S = 150


def triton_fwd(q, k, v, idx, cnt, scale):
    """The Triton TMA forward (the config the library uses on Hopper, without ``gluon``)."""
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import configs
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd
    from vidsparse.utils.device import target_of

    cfg = configs.lookup(target_of(q.device), "fwd", BLOCK, BLOCK, q.shape[-1])
    with configs.override(fwd=replace(cfg, gluon=False)):
        return block_sparse_attn_fwd(q, k, v, idx, cnt, None, BLOCK, BLOCK, scale)


def gluon_fwd(q, k, v, idx, cnt, scale, options: dict):
    """The Gluon forward with the library's schedule (``configs.GLUON``) but for ``options``
    (fields of ``configs.GluonOptions``)."""
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import configs
    from vidsparse.ops.block_sparse_attn.fwd_sm90 import block_sparse_attn_fwd_sm90

    with configs.override(gluon=replace(configs.GLUON, **options)):
        return block_sparse_attn_fwd_sm90(q, k, v, idx, cnt, BLOCK, BLOCK, scale)


# ---------------------------------------------------------------------------------------------
# correctness (child process)
# ---------------------------------------------------------------------------------------------


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _poison_allocator(*shapes_dtypes) -> None:
    """Fill and free blocks the caching allocator will hand the launcher's ``torch.empty``
    next, so an unwritten output element shows up as NaN instead of stale zeros."""
    blocks = [
        torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        for shape, dtype in shapes_dtypes
    ]
    del blocks


def _lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |lse - ref| over rows with a finite reference; inf if the -inf pattern differs."""
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(lse)) or torch.isnan(lse).any():
        return float("inf")
    return (lse[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0


def _check_case(name, q, k, v, idx, cnt, options) -> dict:
    """Gluon vs library vs fp32 reference on one small case."""
    from vidsparse.ops.block_sparse_attn.reference import block_sparse_attn_ref

    scale = q.shape[-1] ** -0.5
    o_ref, lse_ref = block_sparse_attn_ref(
        q.float(), k.float(), v.float(), idx, cnt, block_q=BLOCK, block_kv=BLOCK, scale=scale
    )
    o_lib, lse_lib = triton_fwd(q, k, v, idx, cnt, scale)
    _poison_allocator((q.shape, q.dtype), (q.shape[:3], torch.float32))
    o, lse = gluon_fwd(q, k, v, idx, cnt, scale, options)
    torch.cuda.synchronize()
    empty = cnt.expand(q.shape[0], -1, -1) == 0  # [B, H, NQ]
    empty_rows = empty.repeat_interleave(BLOCK, dim=2)  # [B, H, S]
    res = {
        "case": name,
        "nan_o": bool(torch.isnan(o).any()),
        "err_o_vs_ref": _rel_l2(o, o_ref),
        "err_o_lib_vs_ref": _rel_l2(o_lib, o_ref),
        "err_o_vs_lib": _rel_l2(o, o_lib),
        "err_lse_vs_ref": _lse_err(lse, lse_ref),
        "err_lse_lib_vs_ref": _lse_err(lse_lib, lse_ref),
        "empty_rows": int(empty.sum()),
        "empty_rows_ok": bool((o[empty_rows] == 0).all() and (lse[empty_rows] == -math.inf).all()),
    }
    res["ok"] = (
        not res["nan_o"]
        and res["empty_rows_ok"]
        and res["err_o_vs_ref"] < max(2 * res["err_o_lib_vs_ref"], 1e-3) + 2e-3
        and res["err_lse_vs_ref"] < 1e-2
    )
    return res


def check_variant(options: dict) -> dict:
    """Small cases, then the timed size once against the library and cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vidsparse.masks.block_sparse import random_block_lists

    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    out = {"options": options, "cases": []}

    def qkv(b, h, s):  # fresh random inputs per case, never zeros
        return [
            torch.randn(b, h, s, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(3)
        ]

    # 1. B=1, H=2, S=1024, density 0.5, two empty rows.
    nq = 1024 // BLOCK
    counts = torch.full((1, 2, nq), nq // 2, dtype=torch.int32, device="cuda")
    counts[0, 0, 3] = 0
    counts[0, 1, nq - 1] = 0
    idx, cnt = random_block_lists(1, 2, nq, nq, count=counts, generator=gen, device="cuda")
    out["cases"].append(_check_case("B1H2S1024_d0.5_empty", *qkv(1, 2, 1024), idx, cnt, options))
    # 2. B=2, H=2, S=2048, ragged counts 0..NK, lists broadcast over the batch (Bi = 1).
    nq = 2048 // BLOCK
    counts = torch.randint(0, nq + 1, (1, 2, nq), generator=gen, device="cuda")
    idx, cnt = random_block_lists(1, 2, nq, nq, count=counts, generator=gen, device="cuda")
    out["cases"].append(_check_case("B2H2S2048_ragged_bcast", *qkv(2, 2, 2048), idx, cnt, options))
    # 3. B=1, H=2, S=4096, dense (32 blocks per row: the ring's phases wrap many times).
    nq = 4096 // BLOCK
    idx, cnt = random_block_lists(1, 2, nq, nq, density=1.0, generator=gen, device="cuda")
    out["cases"].append(_check_case("B1H2S4096_dense", *qkv(1, 2, 4096), idx, cnt, options))

    # 4. The timed size: density 1/8 against the library, density 1 against cuDNN.
    q, k, v = qkv(B, H, S)
    scale = D**-0.5
    nq = S // BLOCK
    idx, cnt = random_block_lists(1, H, nq, nq, density=0.125, generator=gen, device="cuda")
    o, lse = gluon_fwd(q, k, v, idx, cnt, scale, options)
    o_lib, lse_lib = triton_fwd(q, k, v, idx, cnt, scale)
    big = {
        "case": "timed_size_d1/8_vs_lib",
        "err_o_vs_lib": _rel_l2(o, o_lib),
        "max_lse_diff_vs_lib": (lse - lse_lib).abs().max().item(),
    }
    big["ok"] = big["err_o_vs_lib"] < 1e-2 and big["max_lse_diff_vs_lib"] < 1e-2
    out["cases"].append(big)
    idx, cnt = dense_lists(nq)
    o, lse = gluon_fwd(q, k, v, idx, cnt, scale, options)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o_cudnn = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    o_lib, lse_lib = triton_fwd(q, k, v, idx, cnt, scale)
    dense = {
        "case": "timed_size_dense_vs_cudnn",
        "err_o_vs_cudnn": _rel_l2(o, o_cudnn),
        "err_o_lib_vs_cudnn": _rel_l2(o_lib, o_cudnn),
        "max_lse_diff_vs_lib": (lse - lse_lib).abs().max().item(),
    }
    dense["ok"] = dense["err_o_vs_cudnn"] < 1e-2 and dense["max_lse_diff_vs_lib"] < 1e-2
    out["cases"].append(dense)
    out["ok"] = all(c["ok"] for c in out["cases"])
    return out


def dense_lists(nq: int):
    """Every key block listed for every query block: [1, H, NQ, NQ], [1, H, NQ]."""
    idx = torch.arange(nq, device="cuda", dtype=torch.int32).expand(1, H, nq, nq).contiguous()
    cnt = torch.full((1, H, nq), nq, device="cuda", dtype=torch.int32)
    return idx, cnt


def run_child_check(name: str, options: dict) -> dict:
    """``check_variant`` in a child process, so that a hang costs a timeout, not the run."""
    cmd = [sys.executable, os.path.abspath(__file__), "--check-child", json.dumps(options)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {CHILD_TIMEOUT_S} s (hang?)"}
    wall = round(time.perf_counter() - start, 1)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {
            "ok": False,
            "error": f"rc={proc.returncode}",
            "stderr": proc.stderr[-3000:],
            "wall_s": wall,
        }
    res = json.loads(lines[-1])
    res["wall_s"] = wall
    return res


# ---------------------------------------------------------------------------------------------
# timing (main process)
# ---------------------------------------------------------------------------------------------


def time_all(ok_variants: list[str]) -> list[dict]:
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vidsparse.masks.block_sparse import random_block_lists

    torch.manual_seed(0)
    q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    scale = D**-0.5
    nq = S // BLOCK
    lists = {
        "1": dense_lists(nq),
        "1/8": random_block_lists(1, H, nq, nq, density=0.125, device="cuda"),
    }
    rows = []

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    for round_ in range(2):  # two alternating rounds: their spread is the noise
        for dens, (idx, cnt) in lists.items():
            density = cnt.double().sum().item() / (H * nq * nq)
            flops = 4.0 * B * H * S * S * D * density
            fns = {"library": lambda: triton_fwd(q, k, v, idx, cnt, scale)}
            for name in ok_variants:
                opts = VARIANTS[name]
                fns[name] = lambda o=opts: gluon_fwd(q, k, v, idx, cnt, scale, o)
            if dens == "1":

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, scale=scale
                        )

                fns["cudnn_dense"] = cudnn
            for name, fn in fns.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    ms = bench(fn)
                    rows.append(
                        {
                            "round": round_,
                            "density": dens,
                            "provider": name,
                            "ms": ms,
                            "tflops": flops / (ms * 1e-3) / 1e12,
                        }
                    )
                except Exception as e:  # keep timing the others
                    rows.append(
                        {
                            "round": round_,
                            "density": dens,
                            "provider": name,
                            "error": f"{type(e).__name__}: {e}"[:500],
                        }
                    )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    by = {}
    for r in rows:
        if "ms" in r:
            by.setdefault((r["density"], r["provider"]), []).append(r)
    print(f"\n{'density':>7} {'provider':>16} {'ms (r0, r1)':>18} {'TFLOP/s (r0, r1)':>18}")
    for (dens, prov), rs in sorted(by.items()):
        ms = ", ".join(f"{r['ms']:.3f}" for r in rs)
        tf = ", ".join(f"{r['tflops']:.0f}" for r in rs)
        print(f"{dens:>7} {prov:>16} {ms:>18} {tf:>18}")


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="build for sm_90, no GPU")
    ap.add_argument("--check-child", help=argparse.SUPPRESS)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]

    if args.check_child is not None:
        print(json.dumps(check_variant(json.loads(args.check_child))), flush=True)
        return

    if args.compile_only:
        cases = [(name, VARIANTS[name], False, torch.bfloat16, BLOCK, False) for name in names]
        # the library's schedule also with key-block sizes (PSA), in fp16, and on 64-row tiles
        # with VSA's gate epilogue
        cases += [("default_masked", {}, True, torch.bfloat16, BLOCK, False),
                  ("default_masked_fp16", {}, True, torch.float16, BLOCK, False),
                  ("tiles64", {}, False, torch.bfloat16, 64, False),
                  ("tiles64_masked_combine", {}, True, torch.bfloat16, 64, True)]  # fmt: skip
        for name, options, masked, dtype, block, combine in cases:
            try:
                rep = compile_sm90(options, masked=masked, dtype=dtype, block=block,
                                   combine=combine)  # fmt: skip
            except Exception as e:
                rep = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(name, json.dumps(rep), flush=True)
        return

    props = torch.cuda.get_device_properties(0)
    import triton

    meta = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": dict(B=B, H=H, S=S, D=D, block=BLOCK),
    }
    print(json.dumps(meta), flush=True)
    checks = {}
    for name in names:
        checks[name] = run_child_check(name, VARIANTS[name])
        print(name, json.dumps(checks[name]), flush=True)
    ok = [n for n in names if checks[n].get("ok")]
    # Variants that ran without hanging but missed a tolerance are timed too (flagged), so a
    # near miss still yields a number; crashed or hung ones are not.
    timed = [n for n in names if checks[n].get("cases")]
    rows = time_all(timed)
    result = {"meta": meta, "checks": checks, "passed": ok, "timings": rows}
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "try_gluon_fwd.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("\nchecks:", {n: checks[n].get("ok") for n in names})
    for n in names:
        for c in checks[n].get("cases", []):
            errs = {
                k: (round(v, 5) if isinstance(v, float) else v)
                for k, v in c.items()
                if k.startswith(("err", "max", "ok", "empty_rows_ok"))
            }
            print(f"  {n} {c['case']}: {errs}")
    print_table(rows)


if __name__ == "__main__":
    main()
