"""Can attention read a video's natural token order by TMA boxes as fast as tile order?

``benchmarks/NOTES.md`` ("Natural order without tile copies") proposes kernels that read q, k,
v and write o in diffusers' natural ``[B, S, H, D]`` layout, a video tile of one head being a
5-D TMA box ``[1, tT, tH, tW, D]`` of the tensor viewed as ``[B, T, Hh, W, H*D]``. The open
question before writing them: do such boxes (64 rows of 256 bytes, 16 runs of 4 tokens at a
stride of ``H*D`` elements) move data as fast inside an attention kernel as today's 2-D boxes
of 64 contiguous rows? This script answers it with one small Triton TMA forward kernel (one
program per query tile and head, its list of key tiles walked with the online softmax,
every block masked) compiled two ways that differ only in how a tile is addressed:

- ``tiled``: q, k, v in tile order ``[B, H, S_pad, D]`` (``VideoGrid.tile``), boxes of 64
  rows; partial tiles' real tokens first (the tile sizes mask the rest);
- ``natural``: q, k, v as ``[B, S, H, D]``, 5-D boxes at the tile's grid corner; the parts of
  edge tiles past the grid are zero-filled on load and clipped on store, and their rows are
  masked by coordinates.

Timed per arm (alternating ``do_bench`` medians): the kernel alone in each layout, and the
tiled kernel with the tile copies a natural-order caller pays (q, k, v tiled, o untiled).
Both arms' outputs are checked against each other and, on a small grid, against an fp32
PyTorch reference. Not a library kernel: an experiment, deliberately minimal.

Run on a GPU from the repository root::

    PYTHONPATH=src python benchmarks/tuning/try_natural_boxes.py [--out f.json]

``--check`` runs the small reference check only (works under ``TRITON_INTERPRET=1`` on the
CPU); ``--compile`` compiles both arms for sm_90 on any machine and prints registers, spills
and shared memory (``vidsparse.bench.compile.compile_launch_sm90``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.testing import rel_l2
from vidsparse.utils import ceil_div

TILE = (4, 4, 4)
D = 128
CASES = {  # latent grid, heads (bf16, VSA 0.875: 1/8 of the key tiles per query tile)
    "wan480p": ((21, 30, 52), 12),
    "wan720p": ((21, 45, 80), 40),
}
SMALL = ((5, 6, 7), 2)  # the reference check: partial tiles along every axis


@triton.jit
def _tile_corner(tile, NH, NW, TT: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """Grid coordinates (t, h, w) of tile ``tile``'s first token (tiles in raster order)."""
    return (tile // (NH * NW)) * TT, ((tile // NW) % NH) * TH, (tile % NW) * TW


@triton.jit
def _load_tile(
    desc, b, h, tile, NH, NW, TT: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
    HEAD_DIM: tl.constexpr, NATURAL: tl.constexpr,
):  # fmt: skip
    ROWS: tl.constexpr = TT * TH * TW
    if NATURAL:
        t0, h0, w0 = _tile_corner(tile, NH, NW, TT, TH, TW)
        x = desc.load([b, t0, h0, w0, h * HEAD_DIM])
    else:
        x = desc.load([b, h, tile * ROWS, 0])
    return x.reshape(ROWS, HEAD_DIM)


@triton.jit
def _real_rows(
    SIZES, tile, NH, NW, T, HH, W,
    TT: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, NATURAL: tl.constexpr,
):  # fmt: skip
    """Which of the tile's ``TT*TH*TW`` rows hold tokens."""
    rows = tl.arange(0, TT * TH * TW)
    if NATURAL:
        t0, h0, w0 = _tile_corner(tile, NH, NW, TT, TH, TW)
        t = t0 + rows // (TH * TW)
        y = h0 + (rows // TW) % TH
        x = w0 + rows % TW
        return (t < T) & (y < HH) & (x < W)
    return rows < tl.load(SIZES + tile)


@triton.jit
def box_attn_fwd_kernel(
    desc_q, desc_k, desc_v, desc_o, KV_IDX, KV_CNT, SIZES,  # descriptors; lists, counts, tile sizes
    H, NT, K_WIDTH, NH, NW, T, HH, W, qk_scale, TT: tl.constexpr, TH: tl.constexpr,
    TW: tl.constexpr, HEAD_DIM: tl.constexpr, NATURAL: tl.constexpr,
):  # fmt: skip
    ROWS: tl.constexpr = TT * TH * TW
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q = _load_tile(desc_q, b, h, tile, NH, NW, TT, TH, TW, HEAD_DIM, NATURAL)
    list_row = bh.to(tl.int64) * NT + tile
    count = tl.load(KV_CNT + list_row)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for j in tl.range(0, count):
        kt = tl.load(KV_IDX + list_row * K_WIDTH + j)
        k = _load_tile(desc_k, b, h, kt, NH, NW, TT, TH, TW, HEAD_DIM, NATURAL)
        v = _load_tile(desc_v, b, h, kt, NH, NW, TT, TH, TW, HEAD_DIM, NATURAL)
        real = _real_rows(SIZES, kt, NH, NW, T, HH, W, TT, TH, TW, NATURAL)
        qk = tl.where(real[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # every list holds a real key
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    acc = (acc * (1.0 / l_i)[:, None]).to(desc_o.dtype)
    if NATURAL:
        t0, h0, w0 = _tile_corner(tile, NH, NW, TT, TH, TW)
        desc_o.store([b, t0, h0, w0, h * HEAD_DIM], acc.reshape(1, TT, TH, TW, HEAD_DIM))
    else:
        desc_o.store([b, h, tile * ROWS, 0], acc.reshape(1, 1, ROWS, HEAD_DIM))


def natural_descs(q, k, v, o, shape):
    """5-D descriptors over ``[B, S, H, D]`` tensors viewed as ``[B, T, Hh, W, H*D]``."""
    B, S, H, Dh = q.shape
    T, HH, W = shape

    def desc(x):
        x5 = x.view(B, T, HH, W, H * Dh)
        return TensorDescriptor(x5, list(x5.shape), list(x5.stride()), [1, *TILE, Dh])

    return [desc(x) for x in (q, k, v, o)]


def tiled_descs(q_t, k_t, v_t, o_t):
    rows = TILE[0] * TILE[1] * TILE[2]
    return [TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, x.shape[-1]])
            for x in (q_t, k_t, v_t, o_t)]  # fmt: skip


def launch_args(descs, lists, counts, sizes, shape, heads, natural: bool, scale: float):
    """``(args, kwargs)`` of ``box_attn_fwd_kernel``'s launch."""
    T, HH, W = shape
    NH, NW = ceil_div(HH, TILE[1]), ceil_div(W, TILE[2])
    args = (*descs, lists, counts, sizes, heads, lists.shape[2], lists.shape[3], NH, NW, T, HH, W,
            scale * math.log2(math.e))  # fmt: skip
    kwargs = dict(TT=TILE[0], TH=TILE[1], TW=TILE[2], HEAD_DIM=D, NATURAL=natural, num_warps=4,
                  num_stages=3)  # fmt: skip
    return args, kwargs


def launch(descs, lists, counts, sizes, shape, heads, natural: bool, scale: float):
    args, kwargs = launch_args(descs, lists, counts, sizes, shape, heads, natural, scale)
    box_attn_fwd_kernel[(lists.shape[2], lists.shape[0] * heads)](*args, **kwargs)


class Case:
    """One workload's inputs in both layouts, and each arm as a callable."""

    def __init__(self, shape, heads, topk_fraction=0.125, device="cuda", seed=0):
        grid = VideoGrid(shape, TILE)
        self.shape, self.heads, self.grid = shape, heads, grid
        g = torch.Generator(device="cpu").manual_seed(seed)
        S = grid.num_tokens
        dtype = torch.bfloat16 if device != "cpu" else torch.float32

        def rand():
            return torch.randn(1, S, heads, D, generator=g).to(device, dtype)

        self.q, self.k, self.v = rand(), rand(), rand()  # [B, S, H, D], diffusers' layout
        self.o = torch.empty_like(self.q)
        topk = max(1, round(grid.num_tiles * topk_fraction))
        self.lists, self.counts = random_block_lists(
            1, heads, grid.num_tiles, grid.num_tiles, count=topk, generator=g, device="cpu"
        )
        self.lists, self.counts = self.lists.to(device), self.counts.to(device)
        self.sizes = grid.tile_sizes_on(self.q.device)
        self.scale = D**-0.5
        self.nat_descs = natural_descs(self.q, self.k, self.v, self.o, shape)
        self._tile_inputs()

    def _bhsd(self, x):
        return x.transpose(1, 2)

    def _tile_inputs(self):
        g = self.grid
        self.q_t, self.k_t, self.v_t = (g.tile(self._bhsd(x), dim=2).contiguous()
                                        for x in (self.q, self.k, self.v))  # fmt: skip
        self.o_t = torch.empty_like(self.q_t)
        self.tiled_descs = tiled_descs(self.q_t, self.k_t, self.v_t, self.o_t)

    def natural(self):
        launch(self.nat_descs, self.lists, self.counts, self.sizes, self.shape, self.heads,
               True, self.scale)  # fmt: skip
        return self.o

    def tiled_kernel(self):
        launch(self.tiled_descs, self.lists, self.counts, self.sizes, self.shape, self.heads,
               False, self.scale)  # fmt: skip
        return self.o_t

    def tiled_with_copies(self):
        """What a natural-order caller pays today: tile q, k, v, run, untile o."""
        self._tile_inputs()
        self.tiled_kernel()
        return self.grid.untile(self.o_t, dim=2)  # [B, H, S, D]


def reference(case: Case) -> torch.Tensor:
    """fp32 attention of every query to its listed key tiles' real tokens, ``[B, H, S, D]``."""
    g = case.grid
    tile_of = g.index_tensors().scatter_index // g.tile_volume  # the tile of each token
    q, k, v = (case._bhsd(x).float() for x in (case.q, case.k, case.v))
    allowed = torch.zeros(case.heads, g.num_tiles, g.num_tiles, dtype=torch.bool)
    lists = case.lists[0].long().cpu()
    allowed.scatter_(2, lists, True)
    tile_of = tile_of.cpu()
    mask = allowed[:, tile_of][:, :, tile_of].to(q.device)  # [H, S, S]
    s = (q @ k.transpose(-1, -2)) * case.scale
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def check(device) -> dict:
    case = Case(*SMALL, topk_fraction=0.25, device=device)
    ref = reference(case)
    out = {
        "natural": rel_l2(case._bhsd(case.natural()), ref),
        "tiled": rel_l2(case.tiled_with_copies(), ref),
    }
    tol = 1e-5 if case.q.dtype == torch.float32 else 2e-2
    ok = all(err < tol for err in out.values())
    return {"shape": SMALL[0], "heads": SMALL[1], "rel_l2_vs_fp32": out, "ok": ok}


def compile_report() -> list[dict]:
    """Both arms compiled for sm_90 on a small grid: ptxas's usage of each."""
    from vidsparse.bench.compile import compile_launch_sm90

    case = Case(*SMALL, device="cpu")
    case.q, case.k, case.v, case.o = (x.bfloat16() for x in (case.q, case.k, case.v, case.o))
    case.nat_descs = natural_descs(case.q, case.k, case.v, case.o, case.shape)
    case._tile_inputs()
    reports = []
    for natural in (False, True):
        args, kwargs = launch_args(case.nat_descs if natural else case.tiled_descs, case.lists,
                                   case.counts, case.sizes, case.shape, case.heads, natural,
                                   case.scale)  # fmt: skip
        report = compile_launch_sm90(box_attn_fwd_kernel, args, kwargs)
        reports.append({"arm": "natural" if natural else "tiled", **report})
    return reports


def time_case(name: str, reps: int = 3) -> dict:
    from triton.testing import do_bench

    shape, heads = CASES[name]
    case = Case(shape, heads)
    arms = {"tiled kernel": case.tiled_kernel, "natural kernel": case.natural,
            "tiled + copies": case.tiled_with_copies}  # fmt: skip
    o_nat = case._bhsd(case.natural()).float()
    agree = rel_l2(case.tiled_with_copies(), o_nat)
    times = {arm: [] for arm in arms}
    for _ in range(reps):  # alternate the arms: clocks drift over a run
        for arm, fn in arms.items():
            times[arm].append(do_bench(fn, warmup=25, rep=200))
    medians = {arm: sorted(ts)[len(ts) // 2] for arm, ts in times.items()}
    bytes_moved = 4 * case.q.numel() * case.q.element_size()  # q, k, v read once, o written
    return {"case": name, "grid": shape, "heads": heads, "tiles": case.grid.num_tiles,
            "topk": case.lists.shape[-1], "tiled_vs_natural_rel_l2": agree,
            "ms": medians, "ms_all": times, "qkvo_bytes": bytes_moved}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--check", action="store_true", help="the reference check only")
    parser.add_argument("--compile", action="store_true", help="sm_90 compile report only")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.compile:
        for row in compile_report():
            print(json.dumps(row))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"check": check(device)}
    print(json.dumps(results["check"]))
    rows = [{"case": "check", **results["check"]}]
    if not args.check:
        for name in args.cases.split(","):
            rows.append(time_case(name))
            print(json.dumps(rows[-1]))
    if args.out:
        from vidsparse.bench import harness

        meta = harness.collect_metadata(torch.device(device), benchmark="try_natural_boxes")
        harness.write_results(args.out, meta, rows)
    return 0 if results["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
