"""Launch configurations of the VSA coarse-stage kernels, per architecture, as data.

Two kernels are configured (see ``coarse.py``):

- ``pool``: ``_tile_mean_pool_fwd_kernel`` / ``_tile_mean_pool_bwd_kernel``, memory bound; what
  matters is how many tiles one program walks (fewer, longer programs) and the warps per tile.
- ``attn_topk``: ``_coarse_attn_topk_fwd_kernel``; ``block_m`` query tiles per program,
  ``block_n`` key tiles per step, ``num_pivots`` candidate thresholds counted per selection pass
  (half placed in score space, half in the order-preserving integer key space),
  ``bracket_capacity`` (rows whose bracket holds that few keys are settled exactly from a
  scratch copy of them), and the ``input_precision`` of its fp32 dots: TF32 on the tensor
  cores where the target has it (NVIDIA, CDNA3), exact ``ieee`` on CDNA4 (no TF32 there) and in
  the interpreter.

Keys are ``(kernel, head_dim)``; ``"*"`` matches any head_dim. An ``attn_topk_small`` entry,
where a table has one, takes over from ``attn_topk`` on grids of at most ``SMALL_GRID_TILES``
tiles. The Hopper ``attn_topk`` entries were tuned on the H200
(``benchmarks/tune_vsa_coarse.py``); the others are sized from the
register budget (qc ``[block_m, D]`` fp32 and the oc accumulator stay in registers) and
checked to compile without spills for ``cuda:90`` and ``hip:gfx942`` by
``tests/ops/video_sparse_attn/test_vsa_coarse.py`` (which lists the one measured exception).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vidsparse.utils.device import Target

__all__ = ["PoolConfig", "CoarseAttnConfig", "pool_config", "coarse_attn_config", "pow2_at_least"]


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
    block_m: int = 32
    block_n: int = 64
    num_pivots: int = 8
    # A row whose bracket holds at most this many keys has them written to a scratch row and
    # is settled exactly (power of two; scratch is B*H*Nt*capacity int32).
    bracket_capacity: int = 128
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


def _amd(**extra) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(extra.items()))


# (kernel, head_dim) -> config.
# NVIDIA: 4 warps spill at block_m=32 (qc and the oc accumulator are fp32 [32, D] in
# registers: 255 registers + 40 B of spills at D=128; 8 warps fit in ~190), yet on the H200
# 4 warps ran faster with the same selections: 208 vs 287 us at Wan 480p (624 tiles, 12 heads,
# top-78), 3.81 vs 4.82 ms at Wan 14B 720p. Hopper takes the measured winner; the generic
# NVIDIA entry stays spill-free. Pooling: one tile per program on 2 warps, 85 vs 130 us at
# 480p and 559 vs 926 us at 720p (tune_vsa_coarse.py --pool).
HOPPER = {
    ("pool", "*"): PoolConfig(tiles_per_program=1, num_warps=2),
    ("attn_topk", "*"): CoarseAttnConfig(block_m=32, block_n=64, num_pivots=8,
                                         bracket_capacity=128, input_precision="tf32",
                                         num_warps=4, num_stages=2),
    # Grids of at most SMALL_GRID_TILES tiles: 4 pivots a pass. Each pass counts half as many
    # thresholds and 480p still settles in 2 passes: 0.289 -> 0.270 ms for the whole coarse
    # stage in bench_vsa at 480p (both sparsities). At 720p (1,440 tiles) 4 pivots took 3 passes
    # on bench_vsa's data and were slower at sparsity 0.875 (3.59 -> 3.83 ms), faster at 0.9
    # (3.43 -> 3.09), so large grids keep 8 (results/tuning/tune_vsa_pivots_6ae197d.json).
    ("attn_topk_small", "*"): CoarseAttnConfig(block_m=32, block_n=64, num_pivots=4,
                                               bracket_capacity=128, input_precision="tf32",
                                               num_warps=4, num_stages=2),
}  # fmt: skip
# The "attn_topk_small" entries apply up to this many tiles (Wan 480p has 624, 720p 1,440).
SMALL_GRID_TILES = 1024
NVIDIA_GENERIC = {
    ("pool", "*"): PoolConfig(tiles_per_program=2, num_warps=4),
    ("attn_topk", "*"): CoarseAttnConfig(block_m=32, block_n=64, input_precision="tf32",
                                         num_warps=8, num_stages=2),
}  # fmt: skip
# AMD: for a dot with M = block_m <= 32 the MFMA layout puts all 4 warps along M, so every warp
# holds the whole fp32 key block; block_m=16 is the largest spill-free choice at D=128
# (~200 VGPRs on gfx942). A D-chunked score dot would allow larger blocks (not done yet).
AMD_CDNA3 = {  # gfx942 (MI300): XF32 dots
    ("pool", "*"): PoolConfig(tiles_per_program=2, num_warps=4, extra=_amd(waves_per_eu=2)),
    # Per-pivot counting: the packed counts spill 16 B here (untimed on AMD, so spill-free wins).
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
INTERPRETER = {
    ("pool", "*"): PoolConfig(tiles_per_program=2, num_warps=4),
    ("attn_topk", "*"): CoarseAttnConfig(block_m=16, block_n=32, num_pivots=8,
                                         bracket_capacity=32, input_precision="ieee",
                                         num_warps=4, num_stages=1),
}  # fmt: skip


def _tables_for(target: Target) -> list[dict]:
    if target.backend == "cpu":
        return [INTERPRETER]
    if target.backend == "hip":
        return [AMD_CDNA4 if str(target.arch).startswith("gfx95") else AMD_CDNA3]
    if target.is_hopper:
        return [HOPPER, NVIDIA_GENERIC]
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
    """Config of the tile-mean pooling kernels (forward and backward)."""
    return _lookup(target, "pool", head_dim, PoolConfig())


def coarse_attn_config(target: Target, head_dim: int, num_tiles: int) -> CoarseAttnConfig:
    """Config of the coarse attention + top-k kernel, with blocks shrunk to fit ``num_tiles``
    (never below 16, the smallest ``tl.dot`` operand)."""
    cfg = None
    if num_tiles <= SMALL_GRID_TILES:
        cfg = _lookup(target, "attn_topk_small", head_dim, None)
    cfg = cfg or _lookup(target, "attn_topk", head_dim, CoarseAttnConfig())
    fit = max(16, pow2_at_least(num_tiles))
    return replace(cfg, block_m=min(cfg.block_m, fit), block_n=min(cfg.block_n, fit))
