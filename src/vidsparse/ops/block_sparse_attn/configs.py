"""Tile configurations per architecture, as data.

The block sizes are fixed by the caller's index format (the lists name key blocks of
``block_kv`` tokens for query blocks of ``block_q`` tokens), so what is tuned here is how a
program runs: warps, pipeline depth and the vendor knobs. Keys are
``(kernel, block_q, block_kv, head_dim)``; a missing key falls back to the family default.
Measured on the H200 for Hopper (see benchmarks/results/); AMD values follow the vendor's
guidance for CDNA3/CDNA4 and are compile-checked in CI, not yet timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from vidsparse.utils.device import Target


@dataclass(frozen=True)
class KernelConfig:
    num_warps: int = 4
    num_stages: int = 2
    # Backend-specific launch options (AMD: waves_per_eu, matrix_instr_nonkdim, kpack).
    extra: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    # Backward only: rows of a query block processed per step (must divide block_q).
    sub_m: int | None = None
    # NVIDIA Hopper, forward and backward: move tiles with tensor descriptors (TMA) when the
    # inputs allow.
    use_tma: bool = False
    # Let Triton split the loop into producer / consumer warps (Hopper; TMA kernel only).
    warp_specialize: bool = False
    # Forward on Hopper: the Gluon kernel (fwd_gluon.py: a TMA loader warp and two ping-ponged
    # consumer warpgroups) where the inputs fit it (fwd_gluon.gluon_fits); else this config's
    # Triton kernel.
    gluon: bool = False
    # Backward with use_tma: the step for the pointer-load kernel, taken when the inputs do not
    # allow TMA (pointer loads hold more registers: the TMA step can spill there).
    pointer_sub_m: int | None = None
    # Backward: run the dK/dV and dQ programs in one launch (bwd.py's fused kernel) where both
    # kernels' configs set this and launch alike (same warps, stages and extras); the last
    # partial wave of one kernel's programs is then filled with the other's.
    fused: bool = False

    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.extra)}

    def for_inputs(self, tma_possible: bool, block_q: int) -> tuple[KernelConfig, bool]:
        """``(config, use TMA)`` for inputs that TMA can (``tma_possible``) or cannot read:
        where this config asks for TMA but the inputs do not allow it, the pointer-load
        kernel's config, whose step divides ``block_q``."""
        if not self.use_tma:
            return self, False
        if tma_possible:
            return self, True
        pointer = replace(self, use_tma=False, sub_m=self.pointer_sub_m or self.sub_m)
        return fit_sub_m(pointer, block_q), False


def _amd(num_warps, num_stages, waves_per_eu=2, nonkdim=16, kpack=2, sub_m=None):
    extra = (("waves_per_eu", waves_per_eu), ("matrix_instr_nonkdim", nonkdim), ("kpack", kpack))
    return KernelConfig(num_warps, num_stages, extra, sub_m)


# (kernel, block_q, block_kv, head_dim) -> config. "*" matches any block size or head_dim.
# "<kernel>_masked" entries apply when kv_block_sizes masks padding keys (more registers live);
# they fall back to the plain entry when absent.
# Hopper: measured on the H200 at B=1, H=12, S=32768, D=128, density 1/8 (tune_block_sparse.py);
# the D=64 entries follow the D=128 ones and are compile-checked, not tuned. Where the fastest
# measured config spilled registers (tests/compile/test_compile_targets.py), the next spill-free one
# is used: dK/dV at 128x128 and every masked dK/dV step 32 query rows instead of 64.
HOPPER = {
    # 128x128: the Gluon kernel, 598 vs 456 TFLOP/s at density 1/8 and 650 vs 461 dense
    # (benchmarks/results/tuning/try_gluon_fwd_h200.json); Triton's TMA kernel where it cannot go.
    ("fwd", 128, 128, "*"): KernelConfig(8, 3, use_tma=True, gluon=True),
    ("fwd", 128, 64, "*"): KernelConfig(8, 2, use_tma=True),  # 4 warps: 1.15x faster, spills
    # 64x64 (VSA's tiles): the Gluon kernel with two query tiles a program, one per consumer.
    ("fwd", 64, 64, "*"): KernelConfig(4, 2, use_tma=True, gluon=True),
    # Masked keys: TMA when the caller vouches the padding is finite (VSA, PSA), else the
    # pointer kernel with these warps/stages (fwd.py). VSA 480p 64x64: 2.99 ms TMA vs 3.39
    # pointer; PSA-like 128x128 (1x8x16 tiles): 6.43 vs 7.12 ms (tune_block_sparse --masked).
    ("fwd_masked", 128, 128, "*"): KernelConfig(8, 3, use_tma=True, gluon=True),
    ("fwd_masked", 128, 64, "*"): KernelConfig(8, 2),
    ("fwd_masked", 64, 64, "*"): KernelConfig(4, 2, use_tma=True, gluon=True),
    # Backward: TMA loads of the loop's tiles (query rows for dK/dV, key blocks for dQ) free
    # the registers that spilled 64-row dK/dV steps with pointer loads, and are faster: whole
    # backward at density 1/8, 128x128 6.74 -> 5.63 ms (dK/dV) / 6.50 (dQ); 64x64 5.77 ->
    # 5.38 / 5.39; VSA 480p 8.77 -> 7.86 / 8.28 (tune_block_sparse.py --bwd-tma).
    # Pointer loads (fp32, padding of unknown content, unaligned strides) keep the spill-free
    # 32-row steps where 64 spills.
    # 128x128: both kernels in one launch (fused: the pair launches alike, 8 warps, 2 stages),
    # since each alone ends in a partial wave (at S=32768, 12 heads: 3072 whole-SM programs,
    # 23.3 waves on 132 SMs). Whole backward, one launch vs two (compare_bwd_launch.py, H200,
    # results/tuning/compare_bwd_launch_1ec0e64.json): 5.33 -> 5.24 ms at density 1/8, 2.90 ->
    # 2.81 ms at 1/16, bit-identical gradients. At D=128 with TMA it spills 24 bytes outside its
    # loops (test_compile_targets.KNOWN_SPILLS), accepted for that measured gain.
    ("bwd_dkdv", 128, 128, "*"): KernelConfig(
        8, 2, sub_m=64, use_tma=True, pointer_sub_m=32, fused=True
    ),
    ("bwd_dkdv", 128, 64, "*"): KernelConfig(4, 2, sub_m=64),
    ("bwd_dkdv", 64, 64, "*"): KernelConfig(4, 2, sub_m=64, use_tma=True),
    ("bwd_dkdv_masked", 128, 128, 128): KernelConfig(8, 2, sub_m=32),
    ("bwd_dkdv_masked", 128, 64, 128): KernelConfig(4, 2, sub_m=32),
    ("bwd_dkdv_masked", 64, 64, 128): KernelConfig(4, 2, sub_m=64, use_tma=True, pointer_sub_m=32),
    ("bwd_dq", 128, 128, "*"): KernelConfig(8, 2, sub_m=128, use_tma=True, fused=True),
    ("bwd_dq", 128, 64, "*"): KernelConfig(4, 2, sub_m=64),
    ("bwd_dq", 64, 64, "*"): KernelConfig(4, 2, sub_m=64, use_tma=True),
    ("bwd_dq_masked", 128, 128, 128): KernelConfig(8, 2, sub_m=64),
}
NVIDIA_GENERIC = {
    ("fwd", "*", "*", "*"): KernelConfig(4, 2),
    ("bwd_dkdv", "*", "*", "*"): KernelConfig(4, 1, sub_m=64),
    ("bwd_dq", "*", "*", "*"): KernelConfig(4, 1, sub_m=64),
}
AMD_CDNA = {
    # 8 warps cap a wave at 256 VGPRs; the 128x128x128 tile with key-block sizes spills there
    # on gfx942 (tests/compile/compile_kernels.py), so it runs 4 warps at occupancy 1 instead.
    ("fwd", 128, 128, 128): _amd(4, 1, waves_per_eu=1),
    ("fwd", 128, "*", "*"): _amd(8, 1, waves_per_eu=2),
    ("fwd", 64, "*", "*"): _amd(4, 1, waves_per_eu=2),
    # 128 key rows: 32-row query steps (as ROCm's FlashAttention backward) to stay spill-free.
    ("bwd_dkdv", 128, 128, "*"): _amd(4, 1, waves_per_eu=1, sub_m=32),
    ("bwd_dkdv", "*", "*", "*"): _amd(4, 1, waves_per_eu=1, sub_m=64),
    ("bwd_dq", "*", "*", "*"): _amd(4, 1, waves_per_eu=1, sub_m=64),
}
# CPU CI: the backward takes the fused launch, so the tests that run it against the reference
# cover it (the two launches are compared with it in test_block_sparse_attn.py).
INTERPRETER = {
    ("fwd", "*", "*", "*"): KernelConfig(4, 1),
    ("bwd_dkdv", "*", "*", "*"): KernelConfig(4, 1, sub_m=None, fused=True),
    ("bwd_dq", "*", "*", "*"): KernelConfig(4, 1, sub_m=None, fused=True),
}


def _table_for(target: Target) -> list[dict]:
    if target.backend == "cpu":
        return [INTERPRETER]
    if target.backend == "hip":
        return [AMD_CDNA]
    if target.is_hopper:
        return [HOPPER, NVIDIA_GENERIC]
    return [NVIDIA_GENERIC]


def _lookup(
    target: Target, kernel: str, block_q: int, block_kv: int, head_dim: int, masked: bool = False
):
    if masked:
        for table in _table_for(target):
            for key in (
                (f"{kernel}_masked", block_q, block_kv, head_dim),
                (f"{kernel}_masked", block_q, block_kv, "*"),
            ):
                if key in table:
                    return table[key]
    for table in _table_for(target):
        for key in (
            (kernel, block_q, block_kv, head_dim),
            (kernel, block_q, block_kv, "*"),
            (kernel, block_q, "*", "*"),
            (kernel, "*", "*", "*"),
        ):
            if key in table:
                return table[key]
    return KernelConfig()


def fit_sub_m(cfg: KernelConfig, block_q: int) -> KernelConfig:
    """``cfg`` with its step halved until it divides ``block_q`` (at most ``block_q``)."""
    sub = cfg.sub_m or block_q
    sub = min(sub, block_q)
    while block_q % sub:
        sub //= 2
    return replace(cfg, sub_m=sub)


def forward_config(
    target: Target,
    block_q: int,
    block_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    masked: bool = False,
) -> KernelConfig:
    """Config of the forward kernel; ``masked`` when kv_block_sizes masks padding keys."""
    return _lookup(target, "fwd", block_q, block_kv, head_dim, masked)


def backward_config(
    target: Target, kernel: str, block_q: int, block_kv: int, head_dim: int, masked: bool = False
) -> KernelConfig:
    """``kernel`` is "bwd_dkdv" or "bwd_dq"; the result has ``sub_m`` dividing ``block_q``."""
    return fit_sub_m(_lookup(target, kernel, block_q, block_kv, head_dim, masked), block_q)
