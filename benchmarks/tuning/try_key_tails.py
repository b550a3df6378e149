"""Short walks of partial tiles against walking them with all rows: VSA's fwd, bwd and
fwd+bwd, and the backward's kernels, in the arms of ``ARMS`` (``_arm`` says what each
turns on): every partial block walked with all rows; partial key blocks walked with fewer
rows in the Triton kernels and the Gluon forward (``configs.key_tails``,
``GluonOptions.KEY_TAILS``); and, the library's default on Hopper, with dK/dV's short walks
of partial query tiles too (``KernelConfig.query_tails``), at the row's 4 warps. At commit
b5c8106 on the H200 the query walks were timed at 8 warps only (then the one spill-free
way): 8 warps doubled dK/dV's time at 480p (4.05 -> 7.89 ms) and the walks took 8% of that
back (7.26 ms), with every wgmma of the kernel serialised by ptxas (C7515, since fixed);
``benchmarks/results/tuning/try_query_walks_b5c8106_h200.json``. At 4 warps (ab17aa1) they
won at both sizes: ``benchmarks/results/tuning/try_key_tails_ab17aa1_h200.json``.

Run on a GPU from the repository root::

    PYTHONPATH=src python benchmarks/tuning/try_key_tails.py [--cases vsa480,vsa720]

Cases (bf16, D=128, gate, natural order, sparsity 0.875, fresh random inputs): ``vsa480``
(Wan 2.1 1.3B 480p: 21x30x52 latent, 12 heads; 169 of its 624 4x4x4 tiles are partial, of 8,
16 and 32 tokens) and ``vsa720`` (Wan 14B 720p: 21x45x80, 40 heads; 340 of 1,440 partial, of 4
and 16 tokens). Per case: the share of VSA's selected key tiles that are partial (random q, k
select them more often than their share of the grid: the tile means of fewer tokens spread
wider), each arm's outputs and gradients against ``none``'s (rel L2), alternating ``do_bench``
medians of each mode for every arm, and the backward's kernels from the profiler.
Writes ``$OUT/try_key_tails.json`` if ``OUT`` is set; prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel is defined: real kernels only

import torch  # noqa: E402

CASES = {  # latent grid, heads
    "vsa480": ((21, 30, 52), 12),
    "vsa720": ((21, 45, 80), 40),
}
MODES = ("fwd", "bwd", "fwd+bwd")
SPARSITY = 0.875
D = 128


def _rel_l2(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _partial_share(q, k, grid) -> float:
    """Of the key tiles VSA selects at ``SPARSITY``, the share that are partial tiles."""
    from vidsparse.ops.video_sparse_attn.reference import coarse_attention, tile_means

    tiled_q, tiled_k = grid.tile(q, dim=2), grid.tile(k, dim=2)
    _, scores = coarse_attention(tile_means(tiled_q, grid), tile_means(tiled_k, grid),
                                 tile_means(tiled_k, grid), D**-0.5)  # fmt: skip
    topk = max(1, round(grid.num_tiles * (1 - SPARSITY)))
    chosen = scores.topk(topk, dim=-1).indices
    sizes = grid.tile_sizes_on(q.device)
    return float((sizes[chosen] < grid.tile_volume).float().mean())


ARMS = ("none", "keys", "query4")


def _arm(name: str):
    """The overrides of arm ``name`` (``ARMS``): ``none`` walks every partial block with all
    rows; ``keys`` the Triton kernels' and the Gluon forward's short walks of partial key
    blocks; ``query4`` (the library's default on Hopper) adds VSA's dK/dV walks of its partial
    query tiles with 32 / 16 rows at the row's 4 warps (``KernelConfig.query_tails``: 84
    bytes of scalar spill on sm_90 with Triton 3.6)."""
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import configs
    from vidsparse.utils.device import target_of

    if name == "none":  # no key tails: no query walks either (they take configs.key_tails' rows)
        return configs.override(key_tails=False)
    row = configs.lookup(target_of(torch.device("cuda")), "bwd_dkdv", 64, 64, D, masked=True)
    return configs.override(bwd_dkdv=replace(row, query_tails=name == "query4"))


def run_case(name: str) -> list[dict]:
    import vidsparse
    from vidsparse.bench import harness

    shape, heads = CASES[name]
    grid = vidsparse.VideoGrid(shape, (4, 4, 4))
    S = grid.num_tokens
    q, k, v, gate = (torch.randn(1, heads, S, D, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))  # fmt: skip

    def forward(q, k, v, gate):
        return vidsparse.video_sparse_attn(q, k, v, grid, gate=gate, sparsity=SPARSITY)

    def grads(arm: str):
        with _arm(arm):
            leaves = [x.detach().requires_grad_() for x in (q, k, v, gate)]
            out = forward(*leaves)
            out.backward(do)
            return [out.detach()] + [x.grad for x in leaves]

    do = torch.randn(1, heads, S, D, device="cuda", dtype=torch.bfloat16)
    results = {arm: grads(arm) for arm in ARMS}
    diffs = {arm: {n: _rel_l2(a, b) for n, a, b in zip(("o", "dq", "dk", "dv", "dgate"),
                                                         results[arm], results["none"])}
             for arm in ARMS[1:]}  # fmt: skip
    share = _partial_share(q, k, grid)
    print(f"{name}: selected partial tiles {share:.3f} (grid {grid.num_tiles}); "
          f"rel L2 against none {diffs}", flush=True)  # fmt: skip

    rows = []
    for mode in MODES:
        make_fn = functools.partial(harness.mode_callable, forward, (q, k, v, gate), mode)
        times = harness.alternating_ms(ARMS, _arm, make_fn, device=q.device)
        for arm, ms_all in times.items():
            ms = sorted(ms_all)[1]
            rows.append(dict(case=name, mode=mode, arm=arm, ms=ms, ms_all=ms_all,
                             selected_partial_share=share,
                             rel_l2_vs_none=diffs.get(arm)))  # fmt: skip
            print(f"{name} {mode} {arm}: {ms:.3f} ms {ms_all}", flush=True)
    for arm in ARMS:
        with _arm(arm):
            fn = harness.mode_callable(forward, (q, k, v, gate), "bwd")
            kernels = harness.kernel_ms(fn, "bwd")
        rows.append(dict(case=name, mode="bwd kernels", arm=arm, kernels_ms=kernels))
        print(f"{name} bwd kernels {arm}: {kernels}", flush=True)
    return rows


def main(argv=None) -> None:
    from vidsparse.bench import harness

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ",".join(CASES))
    args = ap.parse_args(argv)
    rows = []
    for name in args.cases.split(","):
        rows += run_case(name)
    harness.emit_tuning_rows("try_key_tails.json", rows, "try_key_tails")


if __name__ == "__main__":
    main()
