"""A/Bs of the backward (``--study``), each arm of ``STUDIES`` timed alternately in one
process. ``overlap`` (the default): the backward's dQ launch on a side stream beside dK/dV's
(``KernelConfig.overlap``) against the two launches one after the other on one stream.
``grad-rows``: VSA in natural order with its gradients stored by the kernels through row
maps (``GradTargets``; since 8da4264 the gate read and d gate stored through the same map too)
against the tile copies and their own backward (``configs.override(grad_rows=False)``: dq, dk,
dv and d gate untiled by ``index_select``'s backward); the engine case does not apply there.
``out-rows``: VSA in natural order with o stored by the forward's kernels through the token map
and dO read through it by the preprocess (``configs.override(out_rows=True)``) against the
untiling of a tile-order o (and the tiling of dO by its backward); the forward is timed too
(inference gains as well), and each arm's peak memory over one forward and backward (the tiled
o the untiling keeps for the backward is what it would save). ``tile-pool``: VSA in natural
order with q, k, v tiled in the coarse stage's pooling read (``configs.override(tile_pool=True)``,
one pass over them) against a tiling pass, then the pooling of the copies; forward, memory
and backward timed as for ``out-rows`` (the two pooling kernels may add a tile's rows in
another order, so the arms need not be the same bits). ``preprocess-warps``: VSA in natural
order with the backward's preprocess (o and dO read through the token map, VSA's prologue) on
4, 8 (``configs.PREPROCESS_MAPPED_WARPS``) and 16 warps (``configs.override(preprocess_warps=N)``;
its row sums may add in another order, so the gradients may differ in their last bits).
``coarse-softmax``: VSA in natural order with the coarse attention's softmax gradient in one
launch (``coarse_softmax_bwd``, what the Triton path runs) against PyTorch's softmax and
elementwise chain (the arm patches ``fine.coarse_attn_bwd``; exp2 against exp and another
order of the row sums, so not the same bits). ``transpose-kernels``: the backward's transposed
lists (new every VSA call) built by bitmap kernels (``lists.transpose_lists``) against a sort in
PyTorch (``configs.override(transpose_kernels=False)``; the same lists, so the same bits).

Why it might pay: at 128x128 the Gluon dK/dV and dQ kernels each launch 3,072 programs of one
a SM (23.3 waves on 132 SMs), and on one stream dQ's programs wait for dK/dV's last partial
wave, which leaves most SMs idle; VSA's 64x64 kernels (Triton, several programs a SM) end
in a tail of their own. On two streams the other kernel's programs fill those SMs. The
gradients are the same bits either way (each kernel writes its own outputs; no atomics):
checked here on the timed inputs.

Run on a GPU from the repository root::

    PYTHONPATH=src python benchmarks/tuning/try_bwd_overlap.py [--study STUDY]
        [--cases engine,vsa480,vsa720]

Cases (bf16, D=128, fresh random inputs): ``engine`` (the engine at 128x128, density 1/8,
B=1, H=12, S=32,768, random per-head lists: the README's engine table), ``vsa480`` and
``vsa720`` (VSA natural order with the gate at sparsity 0.875 on Wan 480p / 720p). Per case
and mode (bwd, fwd+bwd): alternating ``do_bench`` medians of three rounds per arm, the
backward's kernels from the profiler, and the bit-identity of the gradients. Writes
``$OUT/try_bwd_overlap.json`` (``try_grad_rows.json``, ``try_out_rows.json``,
``try_tile_pool.json``, ``try_preprocess_warps.json``, ``try_coarse_softmax.json``,
``try_transpose_kernels.json`` for those studies) if ``OUT`` is set;
prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel is defined: real kernels only

import torch  # noqa: E402

VSA_CASES = {  # latent grid, heads
    "vsa480": ((21, 30, 52), 12),
    "vsa720": ((21, 45, 80), 40),
}
CASES = ("engine", *VSA_CASES)
MODES = ("bwd", "fwd+bwd")
# study -> {arm: the configs.override of the arm}
STUDIES = {
    "overlap": {"one": dict(overlap=False), "two": dict(overlap=True)},
    "grad-rows": {"copies": dict(grad_rows=False), "mapped": dict(grad_rows=True)},
    "out-rows": {"untiled": dict(out_rows=False), "stored": dict(out_rows=True)},
    "tile-pool": {"separate": dict(tile_pool=False), "fused": dict(tile_pool=True)},
    "preprocess-warps": {f"warps{n}": dict(preprocess_warps=n) for n in (4, 8, 16)},
    "coarse-softmax": {"ops": dict(coarse_softmax_kernel=False),
                       "kernel": dict(coarse_softmax_kernel=True)},
    "transpose-kernels": {"sort": dict(transpose_kernels=False),
                          "kernels": dict(transpose_kernels=True)},
}  # fmt: skip
OUTPUT = {"overlap": "try_bwd_overlap.json", "grad-rows": "try_grad_rows.json",
          "out-rows": "try_out_rows.json", "tile-pool": "try_tile_pool.json",
          "preprocess-warps": "try_preprocess_warps.json",
          "coarse-softmax": "try_coarse_softmax.json",
          "transpose-kernels": "try_transpose_kernels.json"}  # fmt: skip
# studies that time the forward alone too, and record each arm's peak memory
FORWARD_STUDIES = ("out-rows", "tile-pool")
D = 128


def _entering(arms: dict[str, dict]):
    """``enter(arm)``: the ``configs.override`` of ``arms[arm]`` (``coarse_softmax_kernel``,
    not an override: ``_coarse_softmax``)."""

    @contextlib.contextmanager
    def enter(arm):
        from vidsparse.ops.block_sparse_attn import configs

        changes = dict(arms[arm])
        kernel = changes.pop("coarse_softmax_kernel", None)
        with configs.override(**changes), _coarse_softmax(kernel):
            yield

    return enter


@contextlib.contextmanager
def _coarse_softmax(kernel: bool | None):
    """VSA's coarse backward with its softmax gradient in one launch (True) or in PyTorch ops
    (False) whatever its caller asks; None leaves the library's choice."""
    from vidsparse.ops.video_sparse_attn import fine

    if kernel is None:
        yield
        return
    original = fine.coarse_attn_bwd

    def forced(*args, **kwargs):
        return original(*args, **{**kwargs, "kernel": kernel})

    fine.coarse_attn_bwd = forced
    try:
        yield
    finally:
        fine.coarse_attn_bwd = original


def _engine_problem():
    """``(forward, inputs)`` of the README's engine case."""
    import vidsparse
    from vidsparse.masks.block_sparse import random_block_lists

    H, S, block = 12, 32768, 128
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    idx, cnt = random_block_lists(1, H, S // block, S // block, density=1 / 8, generator=gen,
                                  device="cuda")  # fmt: skip
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def forward(q, k, v):
        return vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(block, block))

    return forward, (q, k, v)


def _vsa_problem(name: str):
    import vidsparse

    shape, heads = VSA_CASES[name]
    grid = vidsparse.VideoGrid(shape, (4, 4, 4))
    S = grid.num_tokens
    inputs = tuple(torch.randn(1, heads, S, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))  # fmt: skip

    def forward(q, k, v, gate):
        return vidsparse.video_sparse_attn(q, k, v, grid, gate=gate, sparsity=0.875)

    return forward, inputs


def _grads(forward, inputs, do, enter, arm):
    """``[o, dq, dk, dv, ...]`` of one forward and backward in ``arm``."""
    with enter(arm):
        leaves = [x.detach().requires_grad_() for x in inputs]
        o = forward(*leaves)
        o.backward(do)
        return [o.detach(), *(x.grad for x in leaves)]


def _peak_mb(forward, inputs, do, enter, arm) -> float:
    """Peak memory over one forward and backward in ``arm``, above what was allocated before
    (MB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _grads(forward, inputs, do, enter, arm)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_case(name: str, arms: dict[str, dict], study: str) -> list[dict]:
    from vidsparse.bench import harness

    enter = _entering(arms)
    forward, inputs = _engine_problem() if name == "engine" else _vsa_problem(name)
    do = torch.randn_like(inputs[0])
    first, *others = (_grads(forward, inputs, do, enter, arm) for arm in arms)
    identical = all(torch.equal(a, b) for other in others for a, b in zip(first, other))
    print(f"{name}: output and gradients bit-identical across arms: {identical}", flush=True)

    rows = []
    if study in FORWARD_STUDIES:
        for arm in arms:
            peak = _peak_mb(forward, inputs, do, enter, arm)
            rows.append(dict(case=name, mode="peak memory", arm=arm, peak_mb=peak))
            print(f"{name} peak memory {arm}: {peak:.1f} MB", flush=True)
    for mode in ("fwd", *MODES) if study in FORWARD_STUDIES else MODES:
        make_fn = functools.partial(harness.mode_callable, forward, inputs, mode)
        times = harness.alternating_ms(arms, enter, make_fn, device=inputs[0].device)
        for arm, ms_all in times.items():
            ms = sorted(ms_all)[1]
            rows.append(dict(case=name, mode=mode, arm=arm, ms=ms, ms_all=ms_all,
                             bit_identical=identical))  # fmt: skip
            print(f"{name} {mode} {arm}: {ms:.3f} ms {ms_all}", flush=True)
    for arm in arms:
        with enter(arm):
            kernels = harness.kernel_ms(harness.mode_callable(forward, inputs, "bwd"), "bwd")
        rows.append(dict(case=name, mode="bwd kernels", arm=arm, kernels_ms=kernels))
        print(f"{name} bwd kernels {arm}: {kernels}", flush=True)
    return rows


def main(argv=None) -> None:
    from vidsparse.bench import harness

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", choices=list(STUDIES), default="overlap")
    ap.add_argument("--cases", help="comma-separated, of " + ",".join(CASES) + " (default: "
                    "all; the other studies: the VSA cases)")  # fmt: skip
    args = ap.parse_args(argv)
    cases = args.cases or ",".join(c for c in CASES if args.study == "overlap" or c != "engine")
    rows = []
    for name in cases.split(","):
        rows += [dict(row, study=args.study)
                 for row in run_case(name, STUDIES[args.study], args.study)]  # fmt: skip
    harness.emit_tuning_rows(OUTPUT[args.study], rows, "try_bwd_overlap", study=args.study)


if __name__ == "__main__":
    main()
