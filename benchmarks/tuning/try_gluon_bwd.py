"""Time the Hopper Gluon dK/dV kernel (``ops/block_sparse_attn/bwd_sm90.py``) against the Triton
backward's dK/dV kernel, on the engine's timed shape and on VSA's Wan 480p tiles.

Run on an H100/H200 from the repository root (its correctness tests first, apart, since a
hung mbarrier protocol must not eat the run)::

    PYTHONPATH=src python -m pytest -m gpu tests/ops/block_sparse_attn/test_gluon_bwd.py
    PYTHONPATH=src python benchmarks/tuning/try_gluon_bwd.py

Cases (bf16, D=128, random per-head lists, fresh random inputs):

- ``engine``: B=1, H=12, S=32768, 128x128 blocks, density 1/8 (the engine's timed shape);
- ``vsa480``: Wan 2.1 1.3B 480p's 4x4x4 tiles (624 tiles of 64 slots, real sizes from the
  grid, padding keys finite), 64x64 blocks, top-78 lists (sparsity 0.875).

Per case: the Gluon kernels' gradients against the Triton backward's (rel L2), then
``do_bench`` medians of the Gluon dK/dV and dQ kernels for each ring depth, the Triton
backward's kernels from the profiler (two launches: dK/dV and dQ apart), the Triton backward
whole (the library's rows without ``gluon``) and the library's
backward whole (with its Gluon kernels where they apply) with its kernels from the profiler.
At the engine shape cuDNN's dense backward is timed too (fwd+bwd minus fwd), the bar the
backward is held to. Writes ``$OUT/try_gluon_bwd.json`` if ``OUT`` is set; prints a
table last.

``--one-pass`` (128x128 cases only) compares instead the one-pass backward
(``bwd_sm90.dkdvdq_gluon``: dQ by atomics from the dK/dV walk, dq's zeroing and scaling
included) and its ordered kernel (dQ's adds in key-block order, the same bits every run), each
by atomics and by TMA reductions (``by_tma``) and at 2 and 3 stages, with the two Gluon kernels
back to back and with the library's backward whole, and fwd+bwd both ways (forward, preprocess,
backward; the transposed lists cached as the library caches them); its dK, dV against the dK/dV
kernel's bits and its dQ against the dQ kernel's (rel L2), twice
(``$OUT/try_one_pass_bwd.json``).

``--persistent`` (128x128 cases only) compares the persistent dK/dV and dQ kernels (one
program per SM; ``configs.Overrides.persistent_dkdv`` / ``persistent_dq``) with one block a
program: dK/dV at 2 and 3 stages, walked banded and longest first
(``configs.Overrides.persistent_order``), dQ at 3 and 4, banded, in three alternating rounds
(medians), then the library's backward and fwd+bwd with neither, each and both overrides, also
alternated (``harness.alternating_ms``); their gradients against the one-block kernels' bits;
and fwd+bwd with neither and with both replayed from a CUDA graph, beside its kernels' summed
GPU time, which tells host gaps in the eager time from the kernels' own
(``$OUT/try_persistent_bwd.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel is defined: real kernels only

import torch  # noqa: E402

VARIANTS = {"s2": dict(STAGES=2), "s3": dict(STAGES=3)}
D = 128


def _bench(fn) -> float:
    """``harness.time_ms`` of ``fn`` (``do_bench``'s median; its first call, untimed, compiles)
    with the 200 ms of calls this script has always timed."""
    from vidsparse.bench import harness

    return harness.time_ms(fn, device=torch.device("cuda"), rep=200)


def _recorder(rows: list, name: str, density: float):
    """``row(provider, ms, **extra)``: a row of case ``name`` appended to ``rows``, printed."""

    def row(provider, ms, **extra):
        r = {"case": name, "provider": provider, "ms": ms, "density": density, **extra}
        rows.append(r)
        print(json.dumps(r), flush=True)

    return row


def _rel_l2(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _case(name: str, gen: torch.Generator):
    """``(q, k, v, do, idx, cnt, sizes, block, density)`` of case ``name``."""
    from vidsparse.layout.grid import VideoGrid
    from vidsparse.masks.block_sparse import random_block_lists

    if name == "engine":
        B, H, S, bs, sizes = 1, 12, 32768, 128, None
        nq = S // bs
        idx, cnt = random_block_lists(1, H, nq, nq, density=0.125, generator=gen, device="cuda")
    else:  # vsa480
        grid = VideoGrid((21, 30, 52), tile=(4, 4, 4))
        B, H, S, bs = 1, 12, grid.padded_len, 64
        sizes = grid.tile_sizes.to(device="cuda", dtype=torch.int32)
        nq = grid.num_tiles
        idx, cnt = random_block_lists(1, H, nq, nq, count=78, generator=gen, device="cuda")
    q, k, v, do = (
        torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    density = cnt.double().sum().item() / (H * nq * nq)
    return q, k, v, do, idx, cnt, sizes, bs, density


def _triton_row(configs, q, kernel, bs, sizes):
    """The library's config of ``kernel`` for these inputs, without its Gluon kernel."""
    from dataclasses import replace

    from vidsparse.utils.device import target_of

    row = configs.lookup(target_of(q.device), kernel, bs, bs, q.shape[-1], sizes is not None)
    return replace(row, gluon=False)


def run_case(name: str, gen: torch.Generator) -> list[dict]:
    from dataclasses import replace

    from vidsparse.bench import harness
    from vidsparse.ops.block_sparse_attn import bwd, bwd_sm90, configs, fwd
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE
    from vidsparse.ops.block_sparse_attn.lists import cached_transpose

    q, k, v, do, idx, cnt, sizes, bs, density = _case(name, gen)
    B, H, S, _ = q.shape
    scale = D**-0.5
    pf = sizes is not None  # VSA's padding keys are finite (zeros of the tiling)
    o, lse = fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, scale, padding_finite=pf)
    delta, lse2, _, _ = bwd._preprocess(do, o, lse, bs, NO_EPILOGUE.fns(), ())
    q_off, q_idx = cached_transpose(idx, cnt, S // bs)

    def triton_bwd(fused=None):
        with configs.override(fused=fused):
            return bwd.block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, sizes, bs, bs, scale,
                                             padding_finite=pf)  # fmt: skip

    def triton_only(fn):  # the library's rows without their Gluon kernels
        def run():
            with configs.override(
                bwd_dkdv=_triton_row(configs, q, "bwd_dkdv", bs, sizes),
                bwd_dq=_triton_row(configs, q, "bwd_dq", bs, sizes),
            ):
                return fn()

        return run

    def gluon(options):
        opts = replace(configs.GLUON_DKDV[bs], **options)
        return bwd_sm90.dkdv_gluon(q, k, v, do, lse2, delta, q_off, q_idx, bs, scale,
                                   kv_block_sizes=sizes, options=opts)  # fmt: skip

    with configs.override(
        bwd_dkdv=_triton_row(configs, q, "bwd_dkdv", bs, sizes),
        bwd_dq=_triton_row(configs, q, "bwd_dq", bs, sizes),
    ):
        dq_t, dk_t, dv_t = triton_bwd()
    bwd_flops = 2.5 * 4.0 * B * H * S * S * D * density
    rows = []
    row = _recorder(rows, name, density)

    for vname, options in VARIANTS.items():
        try:
            dk, dv = gluon(options)
            errs = {"err_dk_vs_triton": _rel_l2(dk, dk_t), "err_dv_vs_triton": _rel_l2(dv, dv_t),
                    "nan": bool(torch.isnan(dk).any() or torch.isnan(dv).any())}  # fmt: skip
            row(f"gluon_dkdv_{vname}", _bench(lambda o=options: gluon(o)), **errs)
        except Exception as e:  # keep timing the others
            row(f"gluon_dkdv_{vname}", None, error=f"{type(e).__name__}: {e}"[:800])
    for vname, stages in (("s2", 2), ("s3", 3), ("s4", 4)):
        opts = replace(configs.GLUON_DQ[bs], STAGES=stages)

        def gluon_dq(o=opts):
            return bwd_sm90.dq_gluon(q, k, v, do, lse2, delta, idx, cnt, bs, scale,
                                     kv_block_sizes=sizes, options=o)  # fmt: skip

        try:
            dq = gluon_dq()
            errs = {"err_dq_vs_triton": _rel_l2(dq, dq_t), "nan": bool(torch.isnan(dq).any())}
            row(f"gluon_dq_{vname}", _bench(gluon_dq), **errs)
        except Exception as e:  # e.g. a ring that does not fit (64-row kernel, 3+ stages)
            row(f"gluon_dq_{vname}", None, error=f"{type(e).__name__}: {e}"[:800])
    # The Triton kernels apart (two launches), from the profiler: per-call kernel time.
    prof = harness.cuda_profile(triton_only(lambda: triton_bwd(fused=False)), calls=10)
    for ev in prof.key_averages():
        if "dkdv" in ev.key or "_dq_" in ev.key or "preprocess" in ev.key:
            row(f"triton:{ev.key[:60]}", ev.device_time_total / 1e3 / 10)
    for name, fn in (("triton_bwd", triton_only(triton_bwd)), ("library_bwd", triton_bwd)):
        ms = _bench(fn)
        row(name, ms, tflops=bwd_flops / (ms * 1e-3) / 1e12)
    prof = harness.cuda_profile(triton_bwd, calls=10)  # the library's kernels, Gluon's included
    for ev in prof.key_averages():
        if "gluon" in ev.key or "_dq_" in ev.key or "dkdv" in ev.key:
            row(f"library:{ev.key[:60]}", ev.device_time_total / 1e3 / 10)
    if name == "engine":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, scale=scale)

        def cudnn_fwd_bwd():
            torch.autograd.grad(cudnn_fwd(), (qg, kg, vg), do)

        f, fb = _bench(cudnn_fwd), _bench(cudnn_fwd_bwd)
        dense_bwd = 2.5 * 4.0 * B * H * S * S * D
        row("cudnn_dense_bwd", fb - f, tflops=dense_bwd / ((fb - f) * 1e-3) / 1e12)
    return rows


def one_pass_case(name: str, gen: torch.Generator) -> list[dict]:
    """The one-pass backward against the two Gluon kernels and the library's (``--one-pass``)."""
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import bwd, bwd_sm90, configs, fwd
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE
    from vidsparse.ops.block_sparse_attn.lists import cached_transpose

    q, k, v, do, idx, cnt, sizes, bs, density = _case(name, gen)
    assert bs == 128, "the one-pass kernel takes 128-row blocks"
    B, H, S, _ = q.shape
    scale = D**-0.5
    rows = []
    row = _recorder(rows, name, density)

    def forward():
        return fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, scale)

    o, lse = forward()
    q_off, q_idx = cached_transpose(idx, cnt, S // bs)

    def prep(o, lse, fixed=False):
        of = (k, v, scale, sizes, bs) if fixed else None
        delta, lse2, _, dq_fix = bwd._preprocess(do, o, lse, bs, NO_EPILOGUE.fns(), (),
                                                 dq_fixed_of=of)  # fmt: skip
        return (delta, lse2, dq_fix) if fixed else (delta, lse2)

    def two_kernels(o=o, lse=lse):
        delta, lse2 = prep(o, lse)
        dk, dv = bwd_sm90.dkdv_gluon(q, k, v, do, lse2, delta, q_off, q_idx, bs, scale)
        return bwd_sm90.dq_gluon(q, k, v, do, lse2, delta, idx, cnt, bs, scale), dk, dv

    def one_pass(stages, how, o=o, lse=lse):  # how: "atomics", "tma" or "fixed"
        delta, lse2, *fix = prep(o, lse, fixed=how == "fixed")
        table = configs.GLUON_DKDVDQ if how == "atomics" else configs.GLUON_DKDVDQ_TMA
        opts = replace(table[bs], STAGES=stages)
        dk, dv, dq = bwd_sm90.dkdvdq_gluon(q, k, v, do, lse2, delta, q_off, q_idx, bs, scale,
                                           options=opts, by_tma=how != "atomics",
                                           dq_fix=fix[0] if fix else None)  # fmt: skip
        return dq, dk, dv

    def library():
        return bwd.block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, sizes, bs, bs, scale)

    dq_2, dk_2, dv_2 = two_kernels()
    row("two_kernels", _bench(two_kernels))
    row("fwd+two_kernels", _bench(lambda: two_kernels(*forward())))
    row("library_bwd", _bench(library))
    row("fwd+library_bwd", _bench(lambda: (forward(), library())))
    for how, stages in itertools.product(("fixed", "tma", "atomics"), (2, 3)):
        checks, dqs = {}, []
        for run in (1, 2):
            dq, dk, dv = one_pass(stages, how)
            dqs.append(dq)
            checks[f"run{run}"] = {
                "dk_equal": bool(torch.equal(dk, dk_2)), "dv_equal": bool(torch.equal(dv, dv_2)),
                "err_dq_vs_dq_kernel": _rel_l2(dq, dq_2), "nan": bool(torch.isnan(dq).any()),
            }  # fmt: skip
        checks["dq_same_bits_twice"] = bool(torch.equal(*dqs))
        name = f"one_pass{'' if how == 'atomics' else '_' + how}_s{stages}"
        row(name, _bench(lambda s=stages, t=how: one_pass(s, t)), **checks)
        row(f"fwd+{name}", _bench(lambda s=stages, t=how: one_pass(s, t, *forward())))

    def ordered(stages, by_tma, o=o, lse=lse):  # last: a semaphore protocol that hangs ends it
        delta, lse2 = prep(o, lse)
        opts = replace(configs.GLUON_DKDVDQ_ORDERED[bs], STAGES=stages)
        dk, dv, dq = bwd_sm90.dkdvdq_gluon(q, k, v, do, lse2, delta, q_off, q_idx, bs, scale,
                                           options=opts, ordered_by=(idx, cnt),
                                           by_tma=by_tma)  # fmt: skip
        return dq, dk, dv

    for by_tma, stages in itertools.product((True, False), (2, 3)):
        dq_a, dk, dv = ordered(stages, by_tma)
        dq_b = ordered(stages, by_tma)[0]
        checks = {"dk_equal": bool(torch.equal(dk, dk_2)),
                  "dv_equal": bool(torch.equal(dv, dv_2)),
                  "dq_same_bits_twice": bool(torch.equal(dq_a, dq_b)),
                  "err_dq_vs_dq_kernel": _rel_l2(dq_a, dq_2)}  # fmt: skip
        name = f"one_pass_ordered{'_tma' if by_tma else ''}_s{stages}"
        row(name, _bench(lambda s=stages, t=by_tma: ordered(s, t)), **checks)
        row(f"fwd+{name}", _bench(lambda s=stages, t=by_tma: ordered(s, t, *forward())))
    return rows


def persistent_case(name: str, gen: torch.Generator) -> list[dict]:
    """The persistent dK/dV and dQ kernels against one block a program (see the module's
    docstring)."""
    import statistics
    from dataclasses import replace

    from vidsparse.bench import harness
    from vidsparse.ops.block_sparse_attn import bwd, bwd_sm90, configs, fwd
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE
    from vidsparse.ops.block_sparse_attn.lists import cached_transpose

    q, k, v, do, idx, cnt, sizes, bs, density = _case(name, gen)
    assert bs == 128, "the persistent kernels take 128-row blocks"
    scale = D**-0.5
    o, lse = fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, scale)
    delta, lse2 = bwd._preprocess(do, o, lse, bs, NO_EPILOGUE.fns(), ())[:2]
    q_off, q_idx = cached_transpose(idx, cnt, q.shape[2] // bs)
    rows = []
    row = _recorder(rows, name, density)

    def walked(order: str, fn):  # the persistent kernels' walk, one of PERSISTENT_ORDERS
        def run():
            with configs.override(persistent_order=order):
                return fn()

        return run

    def dkdv(persistent: bool, stages: int, order: str = "banded"):
        table = configs.GLUON_DKDV_PERSISTENT if persistent else configs.GLUON_DKDV
        opts = replace(table[bs], STAGES=stages)
        return walked(order, lambda: bwd_sm90.dkdv_gluon(
            q, k, v, do, lse2, delta, q_off, q_idx, bs, scale, options=opts,
            persistent=persistent))  # fmt: skip

    def dq(persistent: bool, stages: int, order: str = "banded"):
        table = configs.GLUON_DQ_PERSISTENT if persistent else configs.GLUON_DQ
        opts = replace(table[bs], STAGES=stages)
        return walked(order, lambda: (bwd_sm90.dq_gluon(
            q, k, v, do, lse2, delta, idx, cnt, bs, scale, options=opts,
            persistent=persistent),))  # fmt: skip

    arms = {"dkdv_one_block_s3": dkdv(False, 3), "dkdv_one_block_s2": dkdv(False, 2)}
    arms |= {f"dkdv_persistent_{o}_s{s}": dkdv(True, s, o)
             for o in ("banded", "longest_first") for s in (2, 3)}  # fmt: skip
    arms |= {"dq_one_block_s4": dq(False, 4), "dq_persistent_banded_s4": dq(True, 4),
             "dq_persistent_banded_s3": dq(True, 3)}  # fmt: skip
    references = {"dkdv": arms["dkdv_one_block_s3"](), "dq": arms["dq_one_block_s4"]()}
    same_bits = {n: all(torch.equal(a, b) for a, b in zip(fn(), references[n.split("_")[0]]))
                 for n, fn in arms.items()}  # fmt: skip
    times = {n: [] for n in arms}
    for _ in range(3):  # alternating rounds: the machine's drift falls on every arm alike
        for n, fn in arms.items():
            times[n].append(_bench(fn))
    for n in arms:
        row(n, statistics.median(times[n]), rounds=times[n], same_bits=same_bits[n])

    def library():
        return bwd.block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, sizes, bs, bs, scale)

    def forward_and_library():
        return fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, scale), library()

    switches = {
        "one_block": dict(persistent_dkdv=False, persistent_dq=False),
        "persistent_dkdv": dict(persistent_dkdv=True, persistent_dq=False),
        "persistent_dq": dict(persistent_dkdv=False, persistent_dq=True),
        "persistent_both": dict(persistent_dkdv=True, persistent_dq=True),
    }
    for name, fn in (("library_bwd", library), ("fwd+library_bwd", forward_and_library)):
        times = harness.alternating_ms(switches, lambda tag: configs.override(**switches[tag]),
                                       lambda f=fn: f, device=q.device)  # fmt: skip
        for tag, rounds in times.items():
            row(f"{name}_{tag}", statistics.median(rounds), rounds=rounds)
    for tag in ("one_block", "persistent_both"):  # eager fwd+bwd against its kernels' GPU time
        with configs.override(**switches[tag]):
            ms, how = harness.time_graph_ms(forward_and_library, device=q.device)
            summed = harness.summed_kernel_ms(forward_and_library, calls=10)
        row(f"fwd+library_bwd_{tag}_graph", ms, how=how, summed_kernel_ms=round(summed, 4))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="engine,vsa480")
    ap.add_argument("--one-pass", action="store_true", help="the one-pass backward's A/B")
    ap.add_argument("--persistent", action="store_true", help="the persistent dK/dV's A/B")
    args = ap.parse_args()
    import triton

    props = torch.cuda.get_device_properties(0)
    meta = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("VIDSPARSE_GIT_COMMIT")}  # fmt: skip
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    for name in args.cases.split(","):
        study = (one_pass_case if args.one_pass
                 else persistent_case if args.persistent else run_case)  # fmt: skip
        rows += study(name, gen)
    out_dir = os.environ.get("OUT")
    if out_dir:
        out_name = ("try_one_pass_bwd.json" if args.one_pass
                    else "try_persistent_bwd.json" if args.persistent
                    else "try_gluon_bwd.json")  # fmt: skip
        with open(os.path.join(out_dir, out_name), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{'case':>7} {'provider':>60} {'ms':>8}  extra")
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        extra = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in ("case", "provider", "ms", "density")}  # fmt: skip
        print(f"{r['case']:>7} {r['provider']:>60} {ms:>8}  {extra}")


if __name__ == "__main__":
    main()
