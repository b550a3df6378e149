"""Every tunable of the engine, per architecture, as data.

The caller's lists fix the block sizes, so a config says how a program runs: warps, pipeline
depth, TMA, the Gluon kernel, vendor knobs. Tables are keyed by ``(kernel, block_q, block_kv,
head_dim)`` ("*" matches any); ``lookup`` is the one way in. Why each Hopper row is what it is
was measured on the H200 (``benchmarks/results/tuning/``, summarised in benchmarks/NOTES.md);
the AMD rows follow the vendor's guidance and are compile-checked, not timed.

Each kernel has rows of its own ("fwd", "bwd_dkdv", "bwd_dq"), so the forward and the two
backward kernels each state their ``num_stages``: no value is shared between passes. The one
exception is the fused backward launch (both gradient kernels in one launch, ``fused``), which
has one set of launch options: it is taken only where both backward rows launch alike, so the
rows agree rather than one overriding the other (``bwd.fused_launch``).

Cache eviction hints (``evict_streamed``, ``evict_resident``) name the policy of a kernel's
pointer loads by role: the tiles its loop streams (forward and dQ: K and V; dK/dV: Q and dO)
and the tiles a program loads once and keeps (forward: Q; dK/dV: K and V; dQ: Q and dO). ""
leaves a load unhinted, so those rows compile as they would without the knob. TMA loads take
no hint (Triton's tensor-descriptor ``load`` has no eviction argument). The NVIDIA rows take
none: no hint was faster on the H200 (``benchmarks/NOTES.md``, eviction hints).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from vidsparse.utils import tuning_file
from vidsparse.utils.device import Target

# What the Triton kernels take (the checks in interface.py read these); the PyTorch reference
# takes fp64 too.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REFERENCE_DTYPES = (*SUPPORTED_DTYPES, torch.float64)
# What ``tl.load(eviction_policy=...)`` takes ("": no hint).
EVICTION_POLICIES = ("", "evict_first", "evict_last")
EVICT_FIRST = "evict_first"
# The largest block a kernel program tiles: a 256x256 block's pipeline needs 320 KB of shared
# memory at D=128 (an H200 has 227 KB), so larger blocks run as 128-token sub-blocks of it.
KERNEL_BLOCK_MAX = 128
# fp32 tiles take twice the bytes: a 128x128 block's fp32 dots overflow Hopper's shared memory
# (and AMD's LDS) too, so fp32 runs in 64-token blocks on GPUs (``kernel_block_max``).
FP32_KERNEL_BLOCK_MAX = 64


@dataclass(frozen=True)
class KernelConfig:
    num_warps: int = 4
    num_stages: int = 2
    # Backend-specific launch options (AMD: waves_per_eu, matrix_instr_nonkdim, kpack).
    extra: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    # Backward only: rows of a query block processed per step (must divide block_q).
    sub_m: int | None = None
    # Hopper: move the loop's tiles with tensor descriptors (TMA) when the inputs allow.
    use_tma: bool = False
    # Let Triton split the loop into producer / consumer warps (TMA forward only).
    warp_specialize: bool = False
    # Hopper: the Gluon kernel (forward: kernels/fwd_sm90.py; dK/dV, dQ: kernels/bwd_sm90.py)
    # where the inputs fit it; it needs use_tma (its loads are TMA's).
    gluon: bool = False
    # Backward with use_tma: the step of the pointer-load kernel taken when the inputs do not
    # allow TMA (pointer loads hold more registers, so the TMA step can spill there).
    pointer_sub_m: int | None = None
    # Backward: dK/dV and dQ programs in one launch where both configs set this and launch
    # alike (one launch has one num_warps, num_stages, ...).
    fused: bool = False
    # Eviction policy ("", "evict_first" or "evict_last") of the pointer loads of the tiles the
    # kernel's loop streams and of those a program keeps (module docstring). Constexprs, not
    # launch options: each half of a fused launch keeps its own.
    evict_streamed: str = ""
    evict_resident: str = ""
    # Masked kernels: partial key blocks that fit in half or a quarter of the block are walked
    # with that many key rows (``key_tails``; forward and dQ: their list walks, dK/dV: a
    # partial block's program). Off where not yet timed: the extra walks cost registers
    # (tests/compile/ found spills on AMD and sm_100 with them).
    key_tails: bool = True
    # dK/dV: the query blocks whose gradient-carrying rows fit in half or a quarter of the
    # block (an epilogue that quiets padding rows says which: ``Epilogue.quiet_rows``) are
    # walked with that many query rows (in the full-row programs; short key programs walk
    # every query block with all rows). Needs sub_m == block_q; off where not yet timed.
    query_tails: bool = False
    # Backward on a GPU, as two launches: dQ's launch runs on a side stream beside dK/dV's where
    # both configs set this, so each kernel's last partial wave of programs does not leave
    # most SMs idle (the other's programs fill them). The gradients are the same bits.
    overlap: bool = False

    def __post_init__(self):
        for name in ("evict_streamed", "evict_resident"):
            if getattr(self, name) not in EVICTION_POLICIES:
                raise ValueError(
                    f"{name} must be one of {EVICTION_POLICIES}, got {getattr(self, name)!r}"
                )

    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.extra)}

    def for_inputs(self, tma_possible: bool, block_q: int) -> tuple[KernelConfig, bool]:
        """``(config, use TMA)``: where this config asks for TMA but the inputs do not allow
        it, the pointer-load kernel's config, whose step divides ``block_q``."""
        if not self.use_tma:
            return self, False
        if tma_possible:
            return self, True
        pointer = replace(self, use_tma=False, sub_m=self.pointer_sub_m or self.sub_m)
        return fit_sub_m(pointer, block_q), False


@dataclass(frozen=True)
class GluonOptions:
    """The Hopper Gluon forward's schedule (kernels/fwd_sm90.py explains each knob)."""

    STAGES: int = 2
    PINGPONG: bool = True
    P_IN_SMEM: bool = False
    CONSUMER_REGS: int = 240
    LOADER_REGS: int = 24
    # Partial key blocks walked with fewer rows (``key_tails``; an N = 32 / 16 wgmma at 64-key
    # blocks): forward -15% / -20% on Wan 480p / 720p 4x4x4-tile lists (benchmarks/NOTES.md).
    KEY_TAILS: bool = True
    # One program per SM over the 128-row query blocks, the next block's loads under this
    # one's epilogue (``kernels/fwd_sm90_persistent.py``): at 1/8 forward -1 to -3%, at 1/16
    # -3 to -8% (benchmarks/NOTES.md). Lists of 2**31 entries or more take one block a
    # program (int32 offsets), logged.
    PERSISTENT: bool = True
    # The same over pairs of 64-row tiles (video tiles, with a client's epilogue): the tile
    # clients' GPU tests pass with it, but it stays off: at Wan 480p's tiles their forward
    # moved within the noise (-0.2 to -1.4%, H100), and their epilogue variants spill on
    # Triton 3.8 (benchmarks/NOTES.md).
    PERSISTENT_TILES: bool = False

    def as_kwargs(self) -> dict:
        """The kernel's schedule constexprs (``KEY_TAILS`` reaches it as ``TAIL1``/``TAIL2``,
        ``PERSISTENT``, ``PERSISTENT_TILES`` as the choice of kernel)."""
        launcher_only = ("KEY_TAILS", "PERSISTENT", "PERSISTENT_TILES")
        return {k: v for k, v in vars(self).items() if k not in launcher_only}


@dataclass(frozen=True)
class GluonBwdOptions:
    """A Hopper Gluon backward kernel's schedule (kernels/bwd_sm90.py). ``STAGES``: depth of
    its ring (dK/dV: Q / dO steps, 32.5 KB a slot at D = 128, and the 64-row kernel holds two
    rings, so 2 is its most; dQ: 64-key K / V steps, 32 KB a slot). Registers as the
    forward's: the loader warp gives its registers to the two consumer warpgroups, which hold
    their gradient tiles across the list."""

    STAGES: int = 2
    CONSUMER_REGS: int = 240
    LOADER_REGS: int = 24

    def as_kwargs(self) -> dict:
        return dict(vars(self))


GLUON_DKDV = {128: GluonBwdOptions(STAGES=3), 64: GluonBwdOptions(STAGES=2)}
# dK/dV as a persistent kernel (kernels/bwd_sm90_persistent.py; 128 rows): 64 KB more for the
# dK, dV staging buffers. Walked longest first, slower than one block a program on an H100 (2
# stages timed alike; benchmarks/NOTES.md), so only under ``Overrides.persistent_dkdv``.
GLUON_DKDV_PERSISTENT = {128: GluonBwdOptions(STAGES=3)}
# dQ: at 128 rows Q and dO take 64 KB, so 4 steps of 64 keys (two key blocks) fit (2-4 timed
# alike on the H200); the 64-row kernel holds two rings, 2 steps each.
GLUON_DQ = {128: GluonBwdOptions(STAGES=4), 64: GluonBwdOptions(STAGES=2)}
# dQ as a persistent kernel (kernels/bwd_sm90_persistent.py; 128 rows): 32 KB more for dQ's
# staging buffers, which 4 steps still leave room for. Timed alike with one block a program on
# an H100 (3 steps too), so only under ``Overrides.persistent_dq``.
GLUON_DQ_PERSISTENT = {128: GluonBwdOptions(STAGES=4)}
# The persistent backward kernels' walk (lists.walk_order): "banded" (lists.banded_order)
# deals bands of two waves' worth of neighbouring blocks (about a head's key blocks at S=32k)
# in pairs to the programs furthest behind, so the programs resident at a time read one or two
# heads' Q and dO, which L2 holds; "longest_first" (lists.snake_order) sorts all blocks at
# once, so every head is resident at once (on an H100 its dK/dV ran 6-7% slower than one block a
# program, banded 2%: benchmarks/NOTES.md).
PERSISTENT_ORDER = "banded"
PERSISTENT_ORDERS = ("banded", "longest_first")
# dK, dV and dQ in one pass, dQ by fp32 atomics (kernels/bwd_sm90_fused.py; 128 rows): the
# dK/dV kernel's ring plus 32 KB of dS^T tiles, so 3 steps (194 KB; 2 steps timed 2% slower).
# Slower than the two kernels (4.96 against 4.28 ms at 1/8, H100): a tuning override only.
GLUON_DKDVDQ = {128: GluonBwdOptions(STAGES=3)}
# The same with dQ's adds by TMA reductions (``by_tma``): 32 KB more for the consumers' fp32 dQ
# tiles. 2 and 3 steps time alike on an H100, and neither freeing a step's slot before dQ's
# wgmmas retire nor two dQ tiles a consumer pays (benchmarks/NOTES.md).
GLUON_DKDVDQ_TMA = {128: GluonBwdOptions(STAGES=3)}
# The same with dQ's adds in key-block order (``ordered``): 32 KB more for the writer warp's
# tiles; 2 steps take 198,128 bytes, 3 fit too (231,440 of 232,448; timed alike, 8.7 ms: one
# writer warp cannot keep up). The loader and the writer warp share LOADER_REGS: the
# consumers need their 240 (at 232 they spill ~500 bytes), which leaves 32 a thread to the
# third warpgroup; the writer's scalars spill at that (352 bytes).
GLUON_DKDVDQ_ORDERED = {128: GluonBwdOptions(STAGES=2, LOADER_REGS=32)}


class OnePassMode(NamedTuple):
    """How the one-pass backward adds dQ: in key-block order (a writer warp waits its turn),
    by TMA reductions, and as int32 fixed point (by TMA, in any order: integer adds give the
    same bits whatever the order)."""

    ordered: bool
    by_tma: bool
    fixed: bool = False


# Overrides.one_pass's modes
ONE_PASS_MODES = {
    "unordered": OnePassMode(False, False),
    "ordered": OnePassMode(True, False),
    "tma": OnePassMode(False, True),
    "ordered_tma": OnePassMode(True, True),
    "fixed": OnePassMode(False, True, fixed=True),
}


def one_pass_is_fixed(mode: str | None) -> bool:
    """Does one-pass ``mode`` (None: no one pass) sum dQ in fixed point (the preprocess then
    forms the rows' multipliers)?"""
    return mode is not None and ONE_PASS_MODES[mode].fixed


# Rows a program of the fixed-point dQ's conversion (kernels/bwd.py) takes: a memory-bound pass.
DQ_FROM_FIXED_ROWS = 32
# The backward where the caller asks for the same bits on every run (the default): None, the
# two kernels. The one pass with dQ in fixed point ("fixed") gives the same bits on every run
# too, but took 4.52 ms against the two kernels' 4.30 and "tma"'s 4.03 on an H200, and 4.51
# against 4.20 and 3.96 on an H100 with its multipliers through the ring (benchmarks/NOTES.md).
DETERMINISTIC_ONE_PASS = None
# Overrides.one_pass's value for the two kernels (dK/dV, then dQ) whatever the caller asks.
ONE_PASS_OFF = "off"
# The backward where the caller allows gradients in no fixed order (``deterministic=False``):
# the one pass with dQ by TMA reductions. On an H100 at the engine's timed shape (1/8, S=32k)
# it ran in 4.07 ms against the two kernels' 4.37; ordered by TMA (the same bits every run) it
# took 7.9 (benchmarks/NOTES.md).
NONDETERMINISTIC_ONE_PASS = "tma"


# The backward's preprocess reading o and dO through a row map (``GradRows.out``): on Hopper 4
# warps, as the engine-order preprocess (a Wan 480p client in natural order on an H200: 0.207
# ms against 8 warps' 0.308, fwd+bwd 9.25 against 9.39 ms; benchmarks/NOTES.md); elsewhere 8:
# with the heaviest epilogue prologue at D=128 the default 4 hold 252 registers a thread
# already, and the mapped reads pushed cuda:100 (Triton 3.8) into a 24-byte spill. The
# preprocess in the engine's own order keeps the default launch it was timed with.
PREPROCESS_MAPPED_WARPS = 8
PREPROCESS_MAPPED_WARPS_HOPPER = 4


def preprocess_mapped_warps(target: Target) -> int:
    """The mapped preprocess's warps on ``target`` (``Overrides.preprocess_warps`` aside)."""
    return PREPROCESS_MAPPED_WARPS_HOPPER if target.is_hopper else PREPROCESS_MAPPED_WARPS


# Where the Gluon forward applies: 128-row blocks (two consumer halves) or 64-row blocks (two
# blocks a program, 4x4x4 video tiles); the one head_dim measured; 16-bit inputs (wgmma, TMA).
GLUON_BLOCKS = (64, 128)
GLUON_HEAD_DIMS = (128,)
GLUON_DTYPES = (torch.bfloat16, torch.float16)
GLUON = GluonOptions()


@dataclass(frozen=True)
class ListReorderConfig:
    """The full-blocks-first reorder kernel (lists.py): list entries per program, warps."""

    row_elements: int = 1024  # rows * next_power_of_2(K): 8 entries a thread, spill-free

    def num_warps(self, elements: int) -> int:
        return min(16, max(4, elements // 256))  # keeps 8 entries a thread past 1,024 too


LIST_REORDER = ListReorderConfig()


@dataclass(frozen=True)
class ListTransposeConfig:
    """The transposed lists' kernels (lists.transpose_lists): list entries a program of the
    two walks over the pairs, bitmap words a program of the word counts, and the offsets'
    columns a step."""

    pair_elements: int = 1024  # as LIST_REORDER's row_elements
    word_elements: int = 1024
    offsets_step: int = 1024

    def num_warps(self, elements: int) -> int:
        return min(16, max(4, elements // 256))


LIST_TRANSPOSE = ListTransposeConfig()

# Partial key blocks (a video grid's edge tiles, a text tail) are walked with fewer key rows
# than the block holds: a block of s real keys takes the smallest of block_kv / 4, block_kv / 2
# and block_kv rows that holds s, so its dots shrink with it (Wan 480p's 4x4x4 grid has edge
# tiles of 8, 16 and 32 tokens). A dot needs at least 16 rows on every target.
MIN_TAIL_ROWS = 16


def key_tails(block_kv: int) -> tuple[int, int]:
    """``(tail1, tail2)``: the rows of the two short walks of ``block_kv``-token key blocks,
    ``block_kv // 2`` and ``block_kv // 4``, each 0 where under ``MIN_TAIL_ROWS`` (no such
    walk) or where tuning turned them off (``override(key_tails=False)``)."""
    if not _active.key_tails:
        return 0, 0
    return tuple(r if r >= MIN_TAIL_ROWS else 0 for r in (block_kv // 2, block_kv // 4))


def _amd(num_warps, *, stages, waves_per_eu, sub_m=None, streamed="", resident="", nonkdim=16,
         kpack=2):  # fmt: skip
    extra = (("waves_per_eu", waves_per_eu), ("matrix_instr_nonkdim", nonkdim), ("kpack", kpack))
    return KernelConfig(num_warps, stages, extra, sub_m, evict_streamed=streamed,
                        evict_resident=resident, key_tails=False)  # fmt: skip


# Kernels: "fwd", "bwd_dkdv", "bwd_dq"; "<kernel>_masked" rows apply when kv_block_sizes masks
# padding keys (more registers live) and fall back to the plain row when absent.
# Hopper rows: the fastest spill-free config at B=1, H=12, S=32768, D=128, density 1/8
# (benchmarks/tuning/tune_block_sparse.py); D=64 reuses them, compile-checked, except at
# 128x128, whose D=64 rows `vidsparse tune` measured at that shape (4 warps: forward 1.39x,
# fwd+bwd 1.24x the D=128 rows'; benchmarks/results/tuned_d64-s32k_h200.json). A row that
# accepts a spill says so (tests/compile/test_compile_targets.py lists it with its gain).
HOPPER = {
    # Gluon where it fits (square 128 / 64 blocks); else Triton's TMA kernel.
    ("fwd", 128, 128, "*"): KernelConfig(8, 3, use_tma=True, gluon=True),
    ("fwd", 128, 128, 64): KernelConfig(4, 3, use_tma=True),  # Gluon takes D=128 only
    ("fwd", 128, 64, "*"): KernelConfig(8, 2, use_tma=True),  # 4 warps is faster but spills
    ("fwd", 64, 64, "*"): KernelConfig(4, 2, use_tma=True, gluon=True),
    # Masked keys: TMA only where the caller vouches the padding finite (the video ops do),
    # else the pointer kernel with these warps and stages.
    ("fwd_masked", 128, 128, "*"): KernelConfig(8, 3, use_tma=True, gluon=True),
    ("fwd_masked", 128, 64, "*"): KernelConfig(8, 2),
    ("fwd_masked", 64, 64, "*"): KernelConfig(4, 2, use_tma=True, gluon=True),
    # Backward: TMA loads of the loop's tiles free the registers that made 64-row pointer
    # steps spill; pointer loads (fp32, padding of unknown content, unaligned strides) keep
    # the spill-free 32-row step. 128x128 fuses both kernels into one launch (24 B spilled
    # outside the loops at D=128 with TMA, accepted for the measured gain) where dK/dV does
    # not run in the Gluon kernel (D=128, 16-bit, contiguous: ``gluon``; GLUON_DKDV). At 64x64
    # the Gluon dK/dV kernel was slower than Triton's (4.14 vs 3.82 ms on 4x4x4 video tiles), so
    # it is off there. The 64x64 Gluon dQ kernel was 3% faster than Triton's on those tiles
    # (2.915 vs 2.998 ms) but is off: gradients stored through row maps (a tile client in
    # natural order) cannot take it, and tile order alone would not repay a second path.
    # The masked 64x64 dK/dV walks partial query blocks with fewer rows where an epilogue
    # declares quiet rows (query_tails): 84 B of spill on sm_90 and still faster on 4x4x4
    # video tiles (benchmarks/NOTES.md). Where the pair runs as two launches (the Gluon kernels
    # at 128x128; 64x64 with key-block sizes, on video tiles), dQ runs beside dK/dV on a side
    # stream (overlap; timed faster at both, benchmarks/NOTES.md).
    ("bwd_dkdv", 128, 128, "*"): KernelConfig(
        8, 2, sub_m=64, use_tma=True, pointer_sub_m=32, fused=True, gluon=True, overlap=True
    ),
    ("bwd_dkdv", 128, 128, 64): KernelConfig(
        4, 2, sub_m=32, use_tma=True, pointer_sub_m=16, fused=True
    ),
    ("bwd_dkdv", 128, 64, "*"): KernelConfig(4, 2, sub_m=64),
    ("bwd_dkdv", 64, 64, "*"): KernelConfig(4, 2, sub_m=64, use_tma=True),
    ("bwd_dkdv_masked", 128, 128, 128): KernelConfig(8, 2, sub_m=32),
    ("bwd_dkdv_masked", 128, 64, 128): KernelConfig(4, 2, sub_m=32),
    ("bwd_dkdv_masked", 64, 64, 128): KernelConfig(
        4, 2, sub_m=64, use_tma=True, pointer_sub_m=32, query_tails=True, overlap=True
    ),
    ("bwd_dq", 128, 128, "*"): KernelConfig(
        8, 2, sub_m=128, use_tma=True, fused=True, gluon=True, overlap=True
    ),
    ("bwd_dq", 128, 128, 64): KernelConfig(4, 2, sub_m=64, use_tma=True, fused=True),
    ("bwd_dq", 128, 64, "*"): KernelConfig(4, 2, sub_m=64),
    ("bwd_dq", 64, 64, "*"): KernelConfig(4, 2, sub_m=64, use_tma=True, overlap=True),
    ("bwd_dq_masked", 128, 128, 128): KernelConfig(8, 2, sub_m=64),
}
# Every NVIDIA GPU that is not a Hopper (Ampere sm_80, Ada, Blackwell sm_100, ...): the Triton
# pointer kernels, no TMA, no Gluon, no short walks of partial key blocks (not timed; sm_100's
# masked 128x128 dQ at D=64 spills 4 B with them). Compile-checked for cuda:100 with Triton
# 3.6 and 3.8 (spill-free; tests/compile/), not timed: 128-row forward blocks take 8 warps (4 spill
# 84-3,608 bytes, the S and O tiles of 128 rows in 128 threads' registers), one stage with
# key-block sizes at 128x128 (two spill 280 B on 3.8); 64x64 with sizes three stages (two
# spill 16 B on 3.8); the masked 128x128 backward 8 warps of 64-row steps (4 spill 8-60 B).
# (A table of its own, ahead of NVIDIA_GENERIC: its masked rows must not reach a Hopper, whose
# lookup would take them over its own plain rows.)
NVIDIA_NON_HOPPER = {
    ("fwd", 128, "*", "*"): KernelConfig(8, 2, key_tails=False),
    ("fwd_masked", 128, 128, "*"): KernelConfig(8, 1, key_tails=False),
    ("fwd_masked", 64, 64, "*"): KernelConfig(4, 3, key_tails=False),
    ("bwd_dkdv_masked", 128, 128, "*"): KernelConfig(8, 1, sub_m=64, key_tails=False),
    ("bwd_dq_masked", 128, 128, "*"): KernelConfig(8, 1, sub_m=64, key_tails=False),
}
NVIDIA_GENERIC = {
    ("fwd", "*", "*", "*"): KernelConfig(4, 2, key_tails=False),
    ("bwd_dkdv", "*", "*", "*"): KernelConfig(4, 1, sub_m=64, key_tails=False),
    ("bwd_dq", "*", "*", "*"): KernelConfig(4, 1, sub_m=64, key_tails=False),
}
# CDNA3/4 (MI300, MI350). Each kernel's rows state its own stages: one for every pass for now,
# as ROCm's Triton attention kernels run (not yet timed per pass). Eviction hints as the ROCm
# blog's block-sparse kernels on MI325X: evict_first on the forward's streamed K, V and on the
# backward's Q, dO, K and V (the dK/dV loop's Q, dO and its program's own K, V tile, which no
# other dK/dV program reads; the dQ loop's K, V). The AMD backends of Triton 3.6 and 3.8 drop
# the hint when they lower the loads (buffer loads carry none): the rows compile as unhinted
# ones there, and take effect with a Triton that lowers it. No short walks of partial key
# blocks (``_amd``): with them the masked kernels spill 1-32 VGPRs on gfx942 and gfx950.
AMD_CDNA = {
    # 8 warps cap a wave at 256 VGPRs: the 128x128x128 tile with key-block sizes spills there
    # on gfx942, so it runs 4 warps at occupancy 1.
    ("fwd", 128, 128, 128): _amd(4, stages=1, waves_per_eu=1, streamed=EVICT_FIRST),
    ("fwd", 128, "*", "*"): _amd(8, stages=1, waves_per_eu=2, streamed=EVICT_FIRST),
    ("fwd", 64, "*", "*"): _amd(4, stages=1, waves_per_eu=2, streamed=EVICT_FIRST),
    # 128 key rows: 32-row query steps (as ROCm's FlashAttention backward) stay spill-free.
    ("bwd_dkdv", 128, 128, "*"): _amd(4, stages=1, waves_per_eu=1, sub_m=32,
                                      streamed=EVICT_FIRST, resident=EVICT_FIRST),
    ("bwd_dkdv", "*", "*", "*"): _amd(4, stages=1, waves_per_eu=1, sub_m=64,
                                      streamed=EVICT_FIRST, resident=EVICT_FIRST),
    ("bwd_dq", "*", "*", "*"): _amd(4, stages=1, waves_per_eu=1, sub_m=64,
                                    streamed=EVICT_FIRST),
}  # fmt: skip
# CPU interpreter: the fused backward and dK/dV's short query walks, so the tests against the
# reference cover them.
INTERPRETER = {
    ("fwd", "*", "*", "*"): KernelConfig(4, 1),
    ("bwd_dkdv", "*", "*", "*"): KernelConfig(4, 1, sub_m=None, fused=True, query_tails=True),
    ("bwd_dq", "*", "*", "*"): KernelConfig(4, 1, sub_m=None, fused=True),
}


def _tables_for(target: Target) -> list[dict]:
    if target.backend == "cpu":
        return [INTERPRETER]
    if target.backend == "hip":
        return [AMD_CDNA]
    if target.is_hopper:
        return [HOPPER, NVIDIA_GENERIC]
    return [NVIDIA_NON_HOPPER, NVIDIA_GENERIC]


def _table_lookup(target, kernel, block_q, block_kv, head_dim, masked) -> KernelConfig:
    plain = [(kernel, block_q, block_kv, head_dim), (kernel, block_q, block_kv, "*"),
             (kernel, block_q, "*", "*"), (kernel, "*", "*", "*")]  # fmt: skip
    masked_keys = [(f"{kernel}_masked", block_q, block_kv, d) for d in (head_dim, "*")]
    # Masked rows across every table first: a Hopper masked row beats a generic plain one.
    for keys in (masked_keys, plain) if masked else (plain,):
        for table in _tables_for(target):
            for key in keys:
                if key in table:
                    return table[key]
    return KernelConfig()


@dataclass(frozen=True)
class Overrides:
    """Tuning only (benchmarks/tuning/, tests): configs and launch choices that replace the
    tables' inside ``override(...)``. None keeps the library's choice."""

    fwd: KernelConfig | None = None
    bwd_dkdv: KernelConfig | None = None
    bwd_dq: KernelConfig | None = None
    fused: bool | None = None  # backward: one launch (True) or two (False)
    overlap: bool | None = None  # backward's two launches: on two streams (True) or one
    full_first: bool = True  # False: walk every key block masked, in the given order
    key_tails: bool = True  # False: partial key blocks are walked with all block_kv rows
    # False: callers whose q, k, v are copies in another row order (natural-order video) take
    # the copies' own backward instead of gradients stored through row maps (``GradTargets``;
    # an epilogue's own tensors read through such maps follow the same switch)
    grad_rows: bool = True
    # True (with grad_rows): such callers also take o in their own row order, stored by the
    # forward's kernels through the q map (``GradTargets.output``), instead of untiling a
    # tile-order o (no tile-order o is kept for the backward: benchmarks/NOTES.md).
    out_rows: bool = True
    # True (with grad_rows): such callers' backward keeps their q, k, v rather than the copies
    # and gathers the copies again (``GradTargets.regather``): the copies' padding rows are not
    # kept between the passes, for a gather of q, k, v in the backward (benchmarks/NOTES.md).
    regather: bool = False
    # True (with grad_rows): such callers may make their tile-order copies in a read of their
    # own that does more with the rows (a client's pooling) instead of in a tiling pass.
    tile_pool: bool = True
    # False: the backward's transposed lists by a sort in PyTorch
    # (``masks.transpose_block_lists``) instead of the bitmap kernels (``lists.transpose_lists``).
    transpose_kernels: bool = True
    # The warps of the preprocess that reads o and dO through a row map (None:
    # PREPROCESS_MAPPED_WARPS).
    preprocess_warps: int | None = None
    gluon: GluonOptions | None = None
    # One of ONE_PASS_MODES: the Hopper backward in one pass where it applies (128x128, no
    # epilogue, engine order; ``bwd_sm90.dkdvdq_gluon``), dQ's adds in key-block order or by
    # the consumers' atomics, each by TMA reductions ("tma", "ordered_tma") or not, or in
    # fixed point ("fixed"), whatever the caller's ``deterministic``; ONE_PASS_OFF: the two
    # kernels. None: DETERMINISTIC_ONE_PASS / NONDETERMINISTIC_ONE_PASS (benchmarks/NOTES.md).
    one_pass: str | None = None
    # True: the Hopper dK/dV kernel at 128x128 as a persistent kernel, key blocks walked as
    # PERSISTENT_ORDER says (``bwd_sm90.dkdv_gluon``; the same bits). Off: no faster on an H100
    # under either walk (benchmarks/NOTES.md).
    persistent_dkdv: bool = False
    # True: the same for the dQ kernel's query blocks.
    persistent_dq: bool = False
    # The persistent kernels' walk, one of PERSISTENT_ORDERS (None: PERSISTENT_ORDER).
    persistent_order: str | None = None


_active = Overrides()


@contextlib.contextmanager
def override(**changes):
    """Replace configs for the calls inside the block (tuning, comparisons, tests)::

    with override(fwd=KernelConfig(4, 2), fused=False):
        ...
    """
    global _active
    saved = _active
    _active = replace(_active, **changes)
    try:
        yield _active
    finally:
        _active = saved


def active_overrides() -> Overrides:
    return _active


def persistent_walk_is_banded() -> bool:
    """Do the persistent backward kernels walk banded (``PERSISTENT_ORDER``, or the active
    override's ``persistent_order``)? Raises on a walk that is not one of
    ``PERSISTENT_ORDERS``."""
    order = _active.persistent_order or PERSISTENT_ORDER
    if order not in PERSISTENT_ORDERS:
        raise ValueError(f"persistent_order must be one of {PERSISTENT_ORDERS}, got {order!r}")
    return order == "banded"


def lookup(
    target: Target,
    kernel: str,
    block_q: int,
    block_kv: int,
    head_dim: int,
    masked: bool = False,
    fp32: bool = False,
) -> KernelConfig:
    """The config of ``kernel`` ("fwd", "bwd_dkdv" or "bwd_dq"); ``masked`` when key-block sizes
    mask padding keys; ``fp32`` for fp32 inputs (``fit_fp32``). Backward configs come with
    ``sub_m`` dividing ``block_q``. A tuning file's config for this GPU (``vidsparse tune``,
    ``utils/tuning_file.py``) replaces the table's row; an active ``override`` beats both."""
    chosen = getattr(_active, kernel)
    cfg = chosen or tuning_file.tuned_config(
        target,
        tuning_file.engine_key(kernel, block_q, block_kv, head_dim, masked),
        _table_lookup(target, kernel, block_q, block_kv, head_dim, masked),
    )
    if fp32 and not chosen:
        cfg = fit_fp32(cfg)
    return cfg if kernel == "fwd" else fit_sub_m(cfg, block_q)


def fit_fp32(cfg: KernelConfig) -> KernelConfig:
    """The tables' configs are for 16-bit inputs; fp32 tiles take twice the shared memory, so
    fp32 takes one stage and backward steps of at most 64 rows, on blocks of at most
    ``FP32_KERNEL_BLOCK_MAX`` tokens. It is the accurate path (``dot_precision``), not a fast
    one, so nothing is lost that a benchmark measures."""
    step = None if cfg.sub_m is None else min(cfg.sub_m, 64)
    pointer_step = None if cfg.pointer_sub_m is None else min(cfg.pointer_sub_m, 64)
    return replace(cfg, num_stages=1, sub_m=step, pointer_sub_m=pointer_step)


def kernel_block_max(target: Target, dtype: torch.dtype | None) -> int:
    """The largest block a kernel program tiles on ``target`` for inputs of ``dtype``: larger
    blocks run as sub-blocks of it (``interface._kernel_blocks``). The interpreter has no
    shared memory to fit, so fp32 keeps 128-token blocks there (a quarter of the programs)."""
    if dtype == torch.float32 and target.backend != "cpu":
        return FP32_KERNEL_BLOCK_MAX
    return KERNEL_BLOCK_MAX


def dot_precision(target: Target, dtype: torch.dtype) -> str | None:
    """The kernels' ``tl.dot(input_precision=...)``: the default (None) for 16-bit inputs. For
    fp32, NVIDIA GPUs from Ampere on take "tf32x3" (three TF32 tensor-core products: errors
    at fp32's rounding) because their "ieee" dots are FMA loops that spill heavily and are
    slow to compile (``benchmarks/NOTES.md``); AMD (fp32 MFMA) and the interpreter take
    "ieee"."""
    if dtype != torch.float32:
        return None
    tensor_cores = target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 80
    return "tf32x3" if tensor_cores else "ieee"


def gluon_options() -> GluonOptions:
    return _active.gluon or GLUON


def fit_sub_m(cfg: KernelConfig, block_q: int) -> KernelConfig:
    """``cfg`` with its step halved until it divides ``block_q`` (at most ``block_q``)."""
    sub = min(cfg.sub_m or block_q, block_q)
    while block_q % sub:
        sub //= 2
    return replace(cfg, sub_m=sub)
