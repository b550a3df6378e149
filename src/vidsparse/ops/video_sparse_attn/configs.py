"""Tunables of the VSA op, per architecture, as data.

- ``pool``: the tile-mean pooling kernels (forward and backward), memory bound.
- ``attn_topk``: the coarse attention + top-k kernel. ``attn_topk_small``, where a table has
  one, takes over on grids of at most ``SMALL_GRID_TILES`` tiles.
- ``softmax_bwd``: the coarse backward's row-wise softmax gradient, memory bound.

Keys are ``(kernel, head_dim)``; ``"*"`` matches any head_dim. Every entry compiles without
spills for ``cuda:90`` and ``hip:gfx942`` (``tests/ops/video_sparse_attn/test_vsa_coarse.py``,
which lists the one accepted exception). Why each entry is what it is, with its measurements:
``benchmarks/NOTES.md`` (VSA coarse stage) and ``benchmarks/results/tuning/tune_vsa_*.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vidsparse.ops.block_sparse_attn.configs import (
    REFERENCE_DTYPES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
)
from vidsparse.utils import tuning_file
from vidsparse.utils.device import Target, triton_version

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_DTYPES",
    "REFERENCE_DTYPES",
    "BWD_CHUNK_ELEMENTS",
    "SMALL_GRID_TILES",
    "PoolConfig",
    "CoarseAttnConfig",
    "SoftmaxBwdConfig",
    "pool_config",
    "softmax_bwd_config",
    "tile_pool_config",
    "coarse_attn_config",
    "fill_sms",
    "pow2_at_least",
]

# What the Triton path takes (SUPPORTED_HEAD_DIMS, SUPPORTED_DTYPES; the torch path also takes
# REFERENCE_DTYPES): the engine's, imported above, since VSA's fine stage runs on the engine;
# the coarse kernels take each of them too.

# Budget, in elements, of one [B, H, chunk, Nt] fp32 temporary of the coarse backward: 2**24
# elements is 64 MiB (Wan 14B 720p, 40 heads x 1440 tiles: 5 chunks of 291 query tiles).
BWD_CHUNK_ELEMENTS = 2**24

# The "attn_topk_small" entries apply up to this many tiles (Wan 480p has 624, 720p 1,440).
SMALL_GRID_TILES = 1024


@dataclass(frozen=True)
class PoolConfig:
    tiles_per_program: int = 2  # a power of two: one [tiles, V, D] load per program
    num_warps: int = 4
    num_stages: int = 1
    # Backend-specific launch options (AMD: waves_per_eu, ...).
    extra: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    def __post_init__(self):
        t = self.tiles_per_program
        if t < 1 or t & (t - 1):
            raise ValueError(f"tiles_per_program must be a power of two, got {t}")

    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.extra)}


@dataclass(frozen=True)
class CoarseAttnConfig:
    block_m: int = 32  # query tiles per program
    block_n: int = 64  # key tiles per step
    num_pivots: int = 8  # thresholds counted per selection pass (half in score, half in key)
    # A row whose bracket holds at most this many keys has them written to a scratch row and
    # is settled exactly (power of two; scratch is B*H*Nt*capacity int32).
    bracket_capacity: int = 128
    # Of the fp32 dots: TF32 on tensor cores where the target has it, exact "ieee" elsewhere.
    input_precision: str = "tf32"
    # Count all pivots of a pass with one row reduction (ranks by binary search over the sorted
    # pivots, a byte-per-rank histogram in an int64) instead of one reduction per pivot. Taken
    # with 4 or 8 pivots and block_n < 256; False keeps the per-pivot counting (for tuning).
    packed_counts: bool = True
    # The first selection pass also collects the window between the middle score pivots when
    # normal scores would fill at most this share of the scratch row there (0: never); a row
    # whose boundary falls in a window that fits is then settled after one pass, not two.
    speculate_fill: float = 0.75
    num_warps: int = 4
    num_stages: int = 2
    extra: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.extra)}


@dataclass(frozen=True)
class SoftmaxBwdConfig:
    block_cols: int = 1024  # columns a step (a power of two; fewer where the rows are shorter)
    row_elements: int = 4096  # rows a program = row_elements // the step's columns
    num_warps: int = 4
    extra: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    def __post_init__(self):
        for name in ("block_cols", "row_elements"):
            n = getattr(self, name)
            if n < 1 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two, got {n}")

    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, **dict(self.extra)}


def _amd(**extra) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(extra.items()))


# (kernel, head_dim) -> config.
HOPPER = {
    # One tile per program on 2 warps: the pooling reads at the memory limit this way.
    ("pool", "*"): PoolConfig(tiles_per_program=1, num_warps=2),
    # Natural-order tiling with the pooling (16 KB read and written a program at D=128 bf16,
    # as the layout's tile kernel moves).
    ("tile_pool", "*"): PoolConfig(tiles_per_program=1, num_warps=4),
    # 4 warps spill 40 B at D=128 (qc and the oc accumulator are fp32 [32, D] in registers), yet
    # were measured faster than 8 spill-free warps, with the same selections.
    ("attn_topk", "*"): CoarseAttnConfig(block_m=32, block_n=64, num_pivots=8,
                                         bracket_capacity=128, input_precision="tf32",
                                         num_warps=4, num_stages=2),
    # Small grids: 4 pivots a pass, half the counting, and 480p still settles in 2 passes;
    # large grids keep 8, as 4 took 3 passes at 720p.
    ("attn_topk_small", "*"): CoarseAttnConfig(block_m=32, block_n=64, num_pivots=4,
                                               bracket_capacity=128, input_precision="tf32",
                                               num_warps=4, num_stages=2),
}  # fmt: skip
# Hopper with Triton >= 3.8: its compiler spills 424-520 B with the 4 warps above (3.6: 40 B),
# and it is not timed there, so the spill-free choice wins: 8 warps, one stage (0 B with 3.8;
# tests/ops/video_sparse_attn/test_vsa_coarse.py). The rows above stay what was measured with
# the GPU image's Triton 3.6.
HOPPER_TRITON_3_8 = {
    key: replace(HOPPER[key], num_warps=8, num_stages=1)
    for key in (("attn_topk", "*"), ("attn_topk_small", "*"))
}
# Other NVIDIA GPUs (untimed): the spill-free choice, 8 warps, one stage (two stages spill 8-16
# B on sm_100 with Triton 3.8).
NVIDIA_GENERIC = {
    ("pool", "*"): PoolConfig(tiles_per_program=2, num_warps=4),
    ("attn_topk", "*"): CoarseAttnConfig(block_m=32, block_n=64, input_precision="tf32",
                                         num_warps=8, num_stages=1),
}  # fmt: skip
# AMD (untimed, so spill-free wins): for a dot with M = block_m <= 32 the MFMA layout puts all
# 4 warps along M, so every warp holds the whole fp32 key block; block_m=16 is the largest
# spill-free choice at D=128 (~200 VGPRs on gfx942). Per-pivot counting: the packed counts
# spill 16 B there.
AMD_CDNA3 = {  # gfx942 (MI300): XF32 dots
    ("pool", "*"): PoolConfig(tiles_per_program=2, num_warps=4, extra=_amd(waves_per_eu=2)),
    ("attn_topk", "*"): CoarseAttnConfig(block_m=16, block_n=64, input_precision="tf32",
                                         packed_counts=False, num_warps=4, num_stages=1,
                                         extra=_amd(waves_per_eu=2)),
}  # fmt: skip
# gfx950 (MI350) has no TF32; "bf16x3" spills at D=128 (256 VGPRs), so exact fp32 FMA dots.
AMD_CDNA4 = {
    ("pool", "*"): PoolConfig(tiles_per_program=2, num_warps=4, extra=_amd(waves_per_eu=2)),
    ("attn_topk", "*"): CoarseAttnConfig(block_m=16, block_n=64, input_precision="ieee",
                                         packed_counts=False, num_warps=4, num_stages=1,
                                         extra=_amd(waves_per_eu=2)),
}  # fmt: skip
# The CPU interpreter: small blocks and scratch keep the tests' grids quick; exact dots.
INTERPRETER = {
    ("pool", "*"): PoolConfig(tiles_per_program=2, num_warps=4),
    ("tile_pool", "*"): PoolConfig(tiles_per_program=2, num_warps=4),
    ("attn_topk", "*"): CoarseAttnConfig(block_m=16, block_n=32, num_pivots=8,
                                         bracket_capacity=32, input_precision="ieee",
                                         num_warps=4, num_stages=1),
    # narrow steps, so the tests' short rows take several
    ("softmax_bwd", "*"): SoftmaxBwdConfig(block_cols=16, row_elements=64),
}  # fmt: skip


def _tables_for(target: Target) -> list[dict]:
    if target.backend == "cpu":
        return [INTERPRETER]
    if target.backend == "hip":
        return [AMD_CDNA4 if str(target.arch).startswith("gfx95") else AMD_CDNA3]
    if target.is_hopper:
        newer = (triton_version() or (0, 0)) >= (3, 8)
        return [HOPPER_TRITON_3_8, HOPPER, NVIDIA_GENERIC] if newer else [HOPPER, NVIDIA_GENERIC]
    return [NVIDIA_GENERIC]


def _lookup(target: Target, kernel: str, head_dim: int, default):
    for table in _tables_for(target):
        for key in ((kernel, head_dim), (kernel, "*")):
            if key in table:
                return table[key]
    return default


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pool_config(target: Target, head_dim: int) -> PoolConfig:
    """Config of the tile-mean pooling kernels (forward and backward); a tuning file's for
    this GPU (``vidsparse tune``) replaces the table's."""
    default = _lookup(target, "pool", head_dim, PoolConfig())
    return tuning_file.tuned_config(target, tuning_file.vsa_key("pool", head_dim), default)


def tile_pool_config(target: Target, head_dim: int) -> PoolConfig:
    """Config of the natural-order tiling-and-pooling kernel (``kernels/pool.py``'s
    ``tile_pool_fwd_kernel``): one tile a program on 4 warps where the table has no row."""
    return _lookup(target, "tile_pool", head_dim, PoolConfig(tiles_per_program=1, num_warps=4))


def softmax_bwd_config(target: Target, num_cols: int) -> SoftmaxBwdConfig:
    """Config of the coarse backward's softmax gradient kernel (``kernels/softmax_bwd.py``),
    its column step shrunk to fit rows of ``num_cols``. One default on GPUs: a memory-bound
    row pass with no dot, whose first column step holds Wan 480p's 624-tile rows whole."""
    cfg = _lookup(target, "softmax_bwd", 0, SoftmaxBwdConfig())
    return replace(cfg, block_cols=min(cfg.block_cols, pow2_at_least(num_cols)))


def coarse_attn_config(target: Target, head_dim: int, num_tiles: int) -> CoarseAttnConfig:
    """Config of the coarse attention + top-k kernel, with blocks shrunk to fit ``num_tiles``
    (never below 16, the smallest ``tl.dot`` operand). A tuning file's config for this GPU
    (``vidsparse tune``; small grids tuned apart) replaces the table's before the fit."""
    cfg = None
    small = num_tiles <= SMALL_GRID_TILES
    if small:
        cfg = _lookup(target, "attn_topk_small", head_dim, None)
    cfg = cfg or _lookup(target, "attn_topk", head_dim, CoarseAttnConfig())
    tuned = tuning_file.vsa_key("attn_topk_small" if small else "attn_topk", head_dim)
    cfg = tuning_file.tuned_config(target, tuned, cfg)
    fit = max(16, pow2_at_least(num_tiles))
    return replace(cfg, block_m=min(cfg.block_m, fit), block_n=min(cfg.block_n, fit))


def fill_sms(cfg: CoarseAttnConfig, query_tiles: int, rows: int, sms: int) -> CoarseAttnConfig:
    """``cfg`` with ``block_m`` halved (never below 16) while its launch of
    ``ceil(query_tiles / block_m) * rows`` programs leaves SMs idle: few query tiles over
    many keys (a KV cache: Wan 480p's last 4 frames are 104 tiles, 48 programs of 32 on an
    H200's 132 SMs) would otherwise run on a third of the GPU."""
    block_m = cfg.block_m
    while block_m > 16 and -(-query_tiles // block_m) * rows < sms:
        block_m //= 2
    return cfg if block_m == cfg.block_m else replace(cfg, block_m=block_m)
