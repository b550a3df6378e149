"""What ``vidsparse tune`` runs for each kernel: inputs, the table's default, the candidates,
one run of a candidate, and the check of its output against the PyTorch reference.

One ``Workload`` per tuning job. The engine's candidates reach its launchers through
``configs.override(...)``; VSA's coarse kernels take their config as an argument. Candidate 0
is always the library's default (the tables, with any tuning file suspended), and every
candidate's error is judged against the default's: at most ``ERROR_FACTOR`` times it (or the
reference's own rounding to the inputs' dtype, if larger) plus ``atol``.
"""

from __future__ import annotations

import abc
import itertools
import math
from dataclasses import dataclass, fields, replace

import torch

from vidsparse.layout import VideoGrid
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.testing import rel_l2
from vidsparse.utils import tuning_file
from vidsparse.utils.device import Target

ERROR_FACTOR = 2.0
# The default's own output must be this close to the reference (relative L2), else the job is
# not tuned: a wrong default is a bug to report, not a baseline to match.
DEFAULT_REL_L2 = 5e-2
VSA_TILE = (4, 4, 4)
VSA_BLOCK = 64  # tokens of a 4x4x4 tile


@dataclass(frozen=True)
class Shape:
    """One tuning problem: ``[B, H, S, D]`` inputs, block lists of ``density``. ``grid``: a
    model's latent grid (VSA tiles, padded lengths); else ``seq`` tokens, and ``masked``
    masks part of the last key block."""

    label: str
    batch: int
    heads: int
    head_dim: int
    density: float
    grid: tuple[int, int, int] | None = None
    seq: int | None = None
    masked: bool = False

    def describe(self) -> str:
        where = f"grid {'x'.join(map(str, self.grid))}" if self.grid else f"S {self.seq}"
        return (
            f"{self.label}: B {self.batch}, H {self.heads}, {where}, D {self.head_dim}, "
            f"density {self.density:g}"
        )


@dataclass(frozen=True)
class Job:
    """One kernel at one block size of one shape: what is tuned and recorded as one entry."""

    kernel: str  # "fwd" | "bwd_dkdv" | "bwd_dq" | "attn_topk" | "pool"
    block: tuple[int, int]
    shape: Shape

    @property
    def engine(self) -> bool:
        return self.kernel in ENGINE_KERNELS

    @property
    def masked(self) -> bool:
        """Key-block sizes mask padding keys: VSA's tiles of a model grid, or ``--masked``."""
        if self.shape.grid is not None:
            return self.block == (VSA_BLOCK, VSA_BLOCK)
        return self.shape.masked

    @property
    def vsa_kernel(self) -> str:
        """``attn_topk_small`` up to SMALL_GRID_TILES tiles, as ``coarse_attn_config`` picks."""
        from vidsparse.ops.video_sparse_attn.configs import SMALL_GRID_TILES

        if self.kernel != "attn_topk":
            return self.kernel
        return "attn_topk_small" if num_tiles(self.shape) <= SMALL_GRID_TILES else "attn_topk"

    @property
    def key(self) -> tuple:
        D = self.shape.head_dim
        if self.engine:
            return tuning_file.engine_key(self.kernel, *self.block, D, self.masked)
        return tuning_file.vsa_key(self.vsa_kernel, D)

    @property
    def job_id(self) -> str:
        """The key and the shape it was measured at: what a resumed run skips."""
        s = self.shape
        where = "x".join(map(str, s.grid)) if s.grid else f"S{s.seq}{'m' if s.masked else ''}"
        shape = f"B{s.batch}-H{s.heads}-{where}-D{s.head_dim}-d{s.density:g}"
        return f"{'/'.join(map(str, self.key))}@{shape}"

    def describe(self) -> str:
        op, kernel, *rest = self.key
        if op == "engine":
            return f"engine {kernel} {rest[0]}x{rest[1]} head_dim {rest[2]}"
        return f"vsa {kernel} head_dim {rest[0]}"


ENGINE_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
VSA_KERNELS = ("attn_topk", "pool")
KERNEL_CHOICES = (*ENGINE_KERNELS, *VSA_KERNELS)


def num_tiles(shape: Shape) -> int:
    if shape.grid is not None:
        return VideoGrid(shape.grid, tile=VSA_TILE).num_tiles
    return shape.seq // VSA_BLOCK


def seq_len(shape: Shape, block: tuple[int, int]) -> int:
    """Tokens of the engine's inputs: a grid's tile-ordered length at VSA tiles, else its
    tokens padded to whole blocks; an explicit ``seq`` as given."""
    if shape.grid is None:
        return shape.seq
    if block == (VSA_BLOCK, VSA_BLOCK):
        return VideoGrid(shape.grid, tile=VSA_TILE).padded_len
    step = max(block)
    return -(-math.prod(shape.grid) // step) * step


def key_block_sizes(shape: Shape, block_kv: int, S: int, device) -> torch.Tensor:
    """Real keys per key block: a grid's tile sizes, or full blocks and a half-full last."""
    if shape.grid is not None:
        return VideoGrid(shape.grid, tile=VSA_TILE).tile_sizes_on(device).to(torch.int32)
    sizes = torch.full((S // block_kv,), block_kv, dtype=torch.int32, device=device)
    sizes[-1] = block_kv // 2
    return sizes


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref|``; inf where ``out`` holds a NaN or an infinity the reference has not."""
    diff = (out.double() - ref.double()).abs()
    bad = ~torch.isfinite(diff)
    if bad.any():
        return math.inf
    return float(diff.max()) if diff.numel() else 0.0


class Yardstick:
    """The default's error per output (or the reference's own rounding to the output's dtype,
    if larger): a candidate's may be ``ERROR_FACTOR`` times it plus ``atol``."""

    def __init__(self, outs, refs):
        self.bounds = [
            max(max_abs_error(o, r), max_abs_error(r.to(o.dtype), r)) for o, r in zip(outs, refs)
        ]
        self.atols = [1e-5 if o.dtype in (torch.float32, torch.float64) else 1e-3 for o in outs]
        self.default_rel = max(rel_l2(o, r) for o, r in zip(outs, refs))

    def failure(self, names, outs, refs) -> str | None:
        for name, out, ref, bound, atol in zip(names, outs, refs, self.bounds, self.atols):
            err = max_abs_error(out, ref)
            if not err <= ERROR_FACTOR * bound + atol:
                return f"{name}: max abs error {err:.3e} > {ERROR_FACTOR} x default's {bound:.3e}"
        return None


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------


class Workload(abc.ABC):
    """The inputs of one job and how to run a config on them (one subclass per kernel family:
    its table default, its candidates, one run, the reference)."""

    names: tuple[str, ...] = ()

    def __init__(self, job: Job, target: Target, device: torch.device, dtype, generator):
        self.job, self.target, self.device, self.dtype = job, target, device, dtype
        self.generator = generator

    def randn(self, *shape, dtype=None) -> torch.Tensor:
        return torch.randn(
            *shape, generator=self.generator, device=self.device, dtype=dtype or self.dtype
        )

    @abc.abstractmethod
    def default(self):
        """The table's config for this job: candidate 0."""

    @abc.abstractmethod
    def candidates(self) -> list:
        """The configs to try, the default first."""

    @abc.abstractmethod
    def run(self, cfg) -> tuple[torch.Tensor, ...]:
        """The outputs (and gradients) of one run with ``cfg``."""

    @abc.abstractmethod
    def reference(self) -> tuple[torch.Tensor, ...]:
        """The same outputs from the PyTorch reference."""

    def compared(self, outs, refs) -> tuple[tuple, tuple]:
        """The outputs checked against the reference's numbers, and those numbers."""
        return tuple(outs), tuple(refs)

    def failure(self, outs, refs, yardstick: Yardstick) -> str | None:
        return yardstick.failure(self.names, *self.compared(outs, refs))


def engine_default(target: Target, job: Job):
    """The engine's table config for ``job`` (any tuning file suspended): candidate 0."""
    from vidsparse.ops.block_sparse_attn import configs

    bq, bk = job.block
    with tuning_file.suspended():
        return configs.lookup(target, job.kernel, bq, bk, job.shape.head_dim, job.masked)


def dedup(configs: list) -> list:
    out = []
    for cfg in configs:
        if cfg not in out:
            out.append(cfg)
    return out


def with_extra(extra: tuple, **knobs) -> tuple:
    return tuple({**dict(extra), **knobs}.items())


class EngineWorkload(Workload):
    """The engine's forward, or its backward with one of the two gradient kernels varied
    (timed as the whole backward: preprocess, dK/dV, dQ, one launch or two)."""

    def __init__(self, job, target, device, dtype, generator, partner=None):
        super().__init__(job, target, device, dtype, generator)
        shape, (bq, bk) = job.shape, job.block
        S = seq_len(shape, job.block)
        B, H, D = shape.batch, shape.heads, shape.head_dim
        self.q, self.k, self.v, self.do = (self.randn(B, H, S, D) for _ in range(4))
        self.sizes = key_block_sizes(shape, bk, S, device) if job.masked else None
        self.idx, self.cnt = random_block_lists(
            B, H, S // bq, S // bk, density=shape.density, generator=generator, device=device
        )
        self.scale = D**-0.5
        self.partner = partner  # the other gradient kernel's config (None: its default)
        self.names = ("o",) if job.kernel == "fwd" else ("dq", "dk", "dv")
        if job.kernel != "fwd":
            with tuning_file.suspended():
                self.o, self.lse = self._forward()

    def _args(self):
        bq, bk = self.job.block
        return (self.idx, self.cnt, self.sizes, bq, bk, self.scale)

    def _forward(self):
        from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

        return block_sparse_attn_fwd(self.q, self.k, self.v, *self._args(), padding_finite=True)

    def default(self):
        return engine_default(self.target, self.job)

    def candidates(self) -> list:
        default, kernel, bq = self.default(), self.job.kernel, self.job.block[0]
        if kernel in ("fwd", "bwd_dkdv", "bwd_dq") and self._runs_gluon(default):
            # The Gluon kernels' schedules are GluonOptions / GluonBwdOptions: warps, stages
            # and steps, the fields swept here, do not reach them, so every candidate would
            # time the same kernel.
            return [default]
        hip = self.target.backend == "hip"
        stages = (1, 2) if hip else ((1, 2, 3, 4) if kernel == "fwd" else (1, 2, 3))
        steps = (default.sub_m,) if kernel == "fwd" else tuple(m for m in (32, 64, 128) if m <= bq)
        waves = (1, 2) if hip else (None,)  # AMD: occupancy hint
        out = [default]
        for warps, stage, step, wave in itertools.product((4, 8), stages, steps, waves):
            extra = default.extra if wave is None else with_extra(default.extra, waves_per_eu=wave)
            out.append(replace(default, num_warps=warps, num_stages=stage, sub_m=step, extra=extra))
        return dedup(out)

    def _runs_gluon(self, cfg) -> bool:
        """Whether the forward (or a backward kernel) would launch the Gluon kernel with
        ``cfg`` on these inputs (a Gluon row whose inputs do not fit it, D=64 say, runs
        Triton's TMA kernel instead; the backward kernels' rule adds do like q, which the
        tuner's is)."""
        from vidsparse.ops.block_sparse_attn.fwd import gluon_fits

        if not (cfg.gluon and cfg.use_tma and self.target.is_hopper):
            return False
        return gluon_fits(self.q, self.k, self.v, *self.job.block)

    def run(self, cfg):
        from vidsparse.ops.block_sparse_attn import configs
        from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd

        if self.job.kernel == "fwd":
            with configs.override(fwd=cfg):
                return (self._forward()[0],)
        other = self.partner or self._partner_default()
        pair = (
            {"bwd_dkdv": cfg, "bwd_dq": other}
            if self.job.kernel == "bwd_dkdv"
            else {"bwd_dkdv": other, "bwd_dq": cfg}
        )
        with configs.override(**pair):
            return block_sparse_attn_bwd(
                self.do,
                self.q,
                self.k,
                self.v,
                self.o,
                self.lse,
                *self._args(),
                padding_finite=True,
            )

    def _partner_default(self):
        other = "bwd_dq" if self.job.kernel == "bwd_dkdv" else "bwd_dkdv"
        return engine_default(self.target, replace(self.job, kernel=other))

    def reference(self):
        from vidsparse.ops.block_sparse_attn.reference import (
            block_sparse_attn_bwd_ref,
            block_sparse_attn_ref,
        )

        bq, bk = self.job.block
        q, k, v, do = (x.float() for x in (self.q, self.k, self.v, self.do))
        kw = dict(block_q=bq, block_kv=bk, kv_block_sizes=self.sizes, scale=self.scale)
        o, _ = block_sparse_attn_ref(q, k, v, self.idx, self.cnt, **kw)
        if self.job.kernel == "fwd":
            return (o,)
        return block_sparse_attn_bwd_ref(do, q, k, v, o, self.idx, self.cnt, **kw)


class CoarseWorkload(Workload):
    """VSA's coarse attention + top-k kernel on tile means: its output and its selection."""

    names = ("oc",)

    def __init__(self, job, target, device, dtype, generator):
        super().__init__(job, target, device, dtype, generator)
        shape = job.shape
        self.tiles = num_tiles(shape)
        B, H, D = shape.batch, shape.heads, shape.head_dim
        self.qc, self.kc, self.vc = (
            self.randn(B, H, self.tiles, D, dtype=torch.float32) for _ in range(3)
        )
        self.topk = max(1, min(self.tiles, round(shape.density * self.tiles)))
        self.scale = D**-0.5

    def default(self):
        from vidsparse.ops.video_sparse_attn.configs import SMALL_GRID_TILES, coarse_attn_config

        # The table's row before the fit to the grid (what a tuned entry replaces): asked at a
        # tile count of the same kind (small or not) whose fit shrinks nothing.
        small = self.job.vsa_kernel == "attn_topk_small"
        with tuning_file.suspended():
            return coarse_attn_config(
                self.target,
                self.job.shape.head_dim,
                SMALL_GRID_TILES if small else 4 * SMALL_GRID_TILES,
            )

    def candidates(self) -> list:
        default, fit = self.default(), self._fit()
        out = [default]
        for bm, bn, pivots, warps, stages in itertools.product(
            (16, 32, 64), (32, 64, 128), (4, 8), (4, 8), (1, 2)
        ):
            cfg = replace(default, block_m=min(bm, fit), block_n=min(bn, fit), num_pivots=pivots,
                          num_warps=warps, num_stages=stages)  # fmt: skip
            out.append(cfg)
        return dedup(out)

    def _fit(self) -> int:
        from vidsparse.ops.video_sparse_attn.configs import pow2_at_least

        return max(16, pow2_at_least(self.tiles))

    def run(self, cfg):
        from vidsparse.ops.video_sparse_attn.coarse import coarse_attn_topk_fwd

        # As coarse_attn_config hands it to the kernel: blocks shrunk to the grid.
        fit = self._fit()
        cfg = replace(cfg, block_m=min(cfg.block_m, fit), block_n=min(cfg.block_n, fit))
        return coarse_attn_topk_fwd(self.qc, self.kc, self.vc, self.topk, self.scale, config=cfg)

    def reference(self):
        from vidsparse.ops.video_sparse_attn.reference import coarse_attention

        oc, scores = coarse_attention(
            self.qc.double(), self.kc.double(), self.vc.double(), self.scale
        )
        return oc, scores

    def compared(self, outs, refs):
        return (outs[0],), (refs[0],)  # oc; the lists are checked against the scores

    def failure(self, outs, refs, yardstick):
        _, idx, cnt = outs
        bad = super().failure(outs, refs, yardstick)
        return bad or selection_failure(idx, cnt, refs[1], self.topk, self.qc, self.kc, self.scale)


def selection_failure(idx, cnt, scores, topk, qc, kc, scale) -> str | None:
    """Whether the lists are a top-``topk`` of ``scores`` up to the dots' rounding (TF32 on
    GPUs): every row ``topk`` distinct tiles, none scoring below the k-th best by more than
    1e-2 of its largest possible score."""
    if not bool((cnt == topk).all()):
        return "selection: a row's count is not topk"
    n = scores.shape[-1]
    idx = idx.long()
    if bool(((idx < 0) | (idx >= n)).any()):
        return "selection: an index out of range"
    if topk > 1 and bool((idx.sort(-1).values.diff(dim=-1) == 0).any()):
        return "selection: a tile listed twice in a row"
    kth = scores.topk(topk, dim=-1).values[..., -1:]  # [B, H, Nt, 1]
    picked = scores.gather(-1, idx)
    reach = (
        qc.double().norm(dim=-1, keepdim=True)
        * kc.double().norm(dim=-1).amax(-1)[..., None, None]
        * scale
    )
    if bool((picked < kth - 1e-2 * reach).any()):
        return "selection: a tile scoring well below the k-th best"
    return None


class PoolWorkload(Workload):
    """VSA's tile-mean pooling, forward and backward (one config serves both)."""

    names = ("pooled", "dq", "dk", "dv")

    def __init__(self, job, target, device, dtype, generator):
        super().__init__(job, target, device, dtype, generator)
        shape = job.shape
        self.tiles = num_tiles(shape)
        B, H, D = shape.batch, shape.heads, shape.head_dim
        self.padded = self.tiles * VSA_BLOCK
        self.q, self.k, self.v = (self.randn(B, H, self.padded, D) for _ in range(3))
        self.sizes = key_block_sizes(shape, VSA_BLOCK, self.padded, device)
        self.dpooled = self.randn(3, B, H, self.tiles, D, dtype=torch.float32)

    def default(self):
        from vidsparse.ops.video_sparse_attn.configs import pool_config

        with tuning_file.suspended():
            return pool_config(self.target, self.job.shape.head_dim)

    def candidates(self) -> list:
        default = self.default()
        out = [default]
        for tiles, warps in itertools.product((1, 2, 4), (2, 4, 8)):
            out.append(replace(default, tiles_per_program=tiles, num_warps=warps))
        return dedup(out)

    def run(self, cfg):
        from vidsparse.ops.video_sparse_attn.coarse import tile_mean_pool_bwd, tile_mean_pool_fwd

        pooled = tile_mean_pool_fwd(self.q, self.k, self.v, self.sizes, config=cfg)
        grads = tile_mean_pool_bwd(self.dpooled, self.sizes, self.padded, self.dtype, config=cfg)
        return (pooled, *grads)

    def reference(self):
        from vidsparse.ops.video_sparse_attn.reference import tile_means_bwd, tile_means_of_sizes

        pooled = torch.stack(
            [tile_means_of_sizes(x.float(), self.sizes) for x in (self.q, self.k, self.v)]
        )
        grads = tile_means_bwd(self.dpooled, self.sizes, self.padded, torch.float32)
        return (pooled, *grads)


def make_workload(job: Job, target, device, dtype, generator, partner=None) -> Workload:
    if job.engine:
        return EngineWorkload(job, target, device, dtype, generator, partner)
    if job.kernel == "attn_topk":
        return CoarseWorkload(job, target, device, dtype, generator)
    return PoolWorkload(job, target, device, dtype, generator)


# ---------------------------------------------------------------------------------------------
# configs as the tuning file holds them
# ---------------------------------------------------------------------------------------------


def tuned_fields(job: Job, cfg) -> dict:
    """The fields of ``cfg`` a tuning file records for ``job`` (``extra`` as an object, left
    out when empty)."""
    allowed = tuning_file.KERNELS[job.key[:2]]
    out = {name: tuning_file.jsonable(getattr(cfg, name)) for name in allowed if name != "extra"}
    if cfg.extra:
        out["extra"] = dict(cfg.extra)
    return out


def base_fields(job: Job, cfg) -> dict:
    """The default's other fields: a tuned entry applies only while they are unchanged."""
    allowed = tuning_file.KERNELS[job.key[:2]]
    return {
        f.name: tuning_file.jsonable(getattr(cfg, f.name))
        for f in fields(cfg)
        if f.name not in allowed
    }


def describe_config(job: Job, cfg) -> str:
    parts = [f"{k}={v}" for k, v in tuned_fields(job, cfg).items()]
    return " ".join(parts)
