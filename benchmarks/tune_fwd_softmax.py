"""Forward-kernel experiments on the softmax side of the loop (H200), next to the library kernel.

    PYTHONPATH=src python benchmarks/tune_fwd_softmax.py --out fwd_softmax.json

The TMA forward runs at ~80% of cuDNN's dense rate; the exp2 on the MUFU pipe and a softmax
that does not overlap the tensor cores are the suspects (NOTES.md). Two variants of the TMA
kernel test them:

- ``EXP2_SPLIT``: 2 or 4 computes 1/2 or 1/4 of a block's exponentials with a polynomial on the
  FMA pipe instead of MUFU (as FlashAttention 4 does on Blackwell).
- ``PIPELINE_QK``: issues the next block's Q K^T before this block's softmax, so the wgmma can
  run while the softmax does.

Each variant is checked against the library kernel (relative error) before it is timed, at
B=1, H=12, S=32768, D=128, density 1/8 and 1, and on VSA's padded 64-token tiles (480p).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.ops.block_sparse_attn.configs import KernelConfig
from vidsparse.ops.block_sparse_attn.fwd import (
    LOG2E,
    _broadcast_strides,
    _finish_rows,
    _tma_key_block,
    block_sparse_attn_fwd,
)


@triton.jit
def _exp2_poly(x):
    """2^x for x <= 0 on the FMA/ALU pipes: x = n + f with n = round(x), 2^f by a degree-3
    minimax polynomial on [-0.5, 0.5] (relative error 7.5e-5), 2^n added to the exponent bits.
    x is clamped at -126 so the exponent never wraps: -inf gives ~1e-38, not 0."""
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0  # 1.5 * 2^23: the low mantissa bits of t now hold round(x)
    n = t - 12582912.0
    f = x - n
    p = 0.05517132 * f + 0.24261054
    p = p * f + 0.69326099
    p = p * f + 0.99992811
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_mixed(x, SPLIT: tl.constexpr):
    """exp2 of [BM, BN] with 1/SPLIT of the columns on the polynomial (SPLIT 0: all MUFU)."""
    if SPLIT == 0:
        return tl.math.exp2(x)
    BM: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, [BM, BN // 2, 2]))  # even, odd columns
    a = tl.math.exp2(a)
    if SPLIT == 2:
        b = _exp2_poly(b)
    else:
        b1, b2 = tl.split(tl.reshape(b, [BM, BN // 4, 2]))
        b = tl.reshape(tl.join(tl.math.exp2(b1), _exp2_poly(b2)), [BM, BN // 2])
    return tl.reshape(tl.join(a, b), [BM, BN])


@triton.jit
def _softmax_pv(qk, v, real, m_i, l_i, acc, qk_scale, MASK_KEYS: tl.constexpr, SPLIT: tl.constexpr):
    if MASK_KEYS:
        qk = tl.where(real[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = _exp2_mixed(qk * qk_scale - m_sub[:, None], SPLIT)  # [BM, BN]
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _fwd_variant_kernel(
    desc_q,
    desc_k,
    desc_v,
    desc_o,
    LSE,
    KV_IDX,
    KV_CNT,
    KV_SIZES,
    stride_ib,
    stride_ih,
    stride_iq,
    stride_ik,
    stride_cb,
    stride_ch,
    stride_cq,
    H,
    Sq,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_KV_SIZES: tl.constexpr,
    SPLIT: tl.constexpr,
    PIPELINE_QK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q = desc_q.load([b, h, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)  # [BM, D]
    idx_row = (
        KV_IDX
        + b.to(tl.int64) * stride_ib
        + h.to(tl.int64) * stride_ih
        + pid_m.to(tl.int64) * stride_iq
    )
    count = tl.load(
        KV_CNT
        + b.to(tl.int64) * stride_cb
        + h.to(tl.int64) * stride_ch
        + pid_m.to(tl.int64) * stride_cq
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BM, D]
    offs_n = tl.arange(0, BLOCK_N)
    if PIPELINE_QK:
        if count > 0:
            k, v, real = _tma_key_block(
                desc_k,
                desc_v,
                KV_SIZES,
                b,
                h,
                tl.load(idx_row),
                offs_n,
                BLOCK_N,
                HEAD_DIM,
                HAS_KV_SIZES,
                False,
            )
            qk = tl.dot(q, tl.trans(k))
            for j in range(1, count):
                k_n, v_n, real_n = _tma_key_block(
                    desc_k,
                    desc_v,
                    KV_SIZES,
                    b,
                    h,
                    tl.load(idx_row + j * stride_ik),
                    offs_n,
                    BLOCK_N,
                    HEAD_DIM,
                    HAS_KV_SIZES,
                    False,
                )
                qk_n = tl.dot(q, tl.trans(k_n))  # issued before this block's softmax
                m_i, l_i, acc = _softmax_pv(
                    qk, v, real, m_i, l_i, acc, qk_scale, HAS_KV_SIZES, SPLIT
                )
                qk = qk_n
                v = v_n
                real = real_n
            m_i, l_i, acc = _softmax_pv(qk, v, real, m_i, l_i, acc, qk_scale, HAS_KV_SIZES, SPLIT)
    else:
        for j in range(0, count):
            k, v, real = _tma_key_block(
                desc_k,
                desc_v,
                KV_SIZES,
                b,
                h,
                tl.load(idx_row + j * stride_ik),
                offs_n,
                BLOCK_N,
                HEAD_DIM,
                HAS_KV_SIZES,
                False,
            )
            qk = tl.dot(q, tl.trans(k))
            m_i, l_i, acc = _softmax_pv(qk, v, real, m_i, l_i, acc, qk_scale, HAS_KV_SIZES, SPLIT)
    acc, lse = _finish_rows(acc, m_i, l_i)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    desc_o.store([b, h, pid_m * BLOCK_M, 0], acc.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse)


def fwd_variant(q, k, v, idx, cnt, sizes, block, cfg: KernelConfig, split: int, pipeline: bool):
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, H, S, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)

    def desc(x):
        return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, block, D])

    _fwd_variant_kernel[(S // block, B * H)](
        desc(q), desc(k), desc(v), desc(o), lse, idx, cnt, sizes if sizes is not None else cnt,
        *_broadcast_strides(idx), *_broadcast_strides(cnt),
        H, S, D**-0.5 * LOG2E,
        BLOCK_M=block, BLOCK_N=block, HEAD_DIM=D, HAS_KV_SIZES=sizes is not None,
        SPLIT=split, PIPELINE_QK=pipeline, **cfg.launch_kwargs(),
    )  # fmt: skip
    return o, lse


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fwd_softmax.json")
    args = ap.parse_args(argv)
    from vidsparse.layout import VideoGrid

    D, H = 128, 12
    rows = []
    cases = []
    S = 32768
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for block, warps, stages in ((128, 8, 3), (64, 4, 2)):
        n = S // block
        for d in (0.125, 1.0):
            idx, cnt = random_block_lists(1, H, n, n, density=d, device="cuda")
            work = 4 * H * S * S * D * d
            cases.append(
                (f"S32k_{block}_d{d}", q, k, v, idx, cnt, None, block, warps, stages, work)
            )
    grid = VideoGrid((21, 30, 52))
    Sv, nt = grid.padded_len, grid.num_tiles
    qv, kv, vv = (torch.randn(1, H, Sv, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sizes = grid.tile_sizes_on("cuda").to(torch.int32)
    idx, cnt = random_block_lists(1, H, nt, nt, count=78, device="cuda")
    cases.append(("vsa480p_64", qv, kv, vv, idx, cnt, sizes, 64, 4, 2, 4 * H * Sv * 78 * 64 * D))

    for label, q_, k_, v_, idx, cnt, sz, block, warps, stages, work in cases:
        cfg = KernelConfig(warps, stages, use_tma=True)
        lib = lambda: block_sparse_attn_fwd(  # noqa: E731
            q_, k_, v_, idx, cnt, sz, block, block, D**-0.5, cfg, padding_finite=True
        )
        ref = lib()[0].float()
        ms = bench(lib)
        rows.append(dict(case=label, variant="library", ms=ms, tflops=work / ms / 1e9))
        print(f"{label} library: {ms:.3f} ms {work / ms / 1e9:.0f} TFLOP/s", flush=True)
        for split, pipe, st in itertools.product((0, 2, 4), (False, True), (stages,)):
            if split == 0 and not pipe and st == stages:
                continue  # == library
            c = KernelConfig(warps, st, use_tma=True)
            try:
                out = fwd_variant(q_, k_, v_, idx, cnt, sz, block, c, split, pipe)[0].float()
                err = ((out - ref).norm() / ref.norm()).item()
                ms = bench(lambda: fwd_variant(q_, k_, v_, idx, cnt, sz, block, c, split, pipe))
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported
                print(
                    f"{label} split={split} pipe={pipe} s={st}: {type(e).__name__}: {str(e)[:200]}"
                )
                continue
            rows.append(
                dict(case=label, variant=f"split{split}_pipe{int(pipe)}_s{st}", ms=ms,
                     tflops=work / ms / 1e9, rel_err_vs_library=err)
            )  # fmt: skip
            print(
                f"{label} split={split} pipe={pipe} s={st}: {ms:.3f} ms {work / ms / 1e9:.0f}"
                f" TFLOP/s err {err:.1e}",
                flush=True,
            )
    meta = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__
    )
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
