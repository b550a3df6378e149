"""The PSA search: calibration samples in, a per-(step bucket, layer, head) plan out.

Two stages, so that trying another tolerance costs seconds, not GPU time::

    calibration samples --build_loss_table--> LossTable --plan_from_table(alpha | target)--> Plan
    (q/k/v per step, layer)   (the objective of every          (selection only: no attention)
                               (sample, head, candidate))

- ``build_loss_table`` runs the objective (``StripeObjective``) once per sample, with a
  progress bar over the (step, layer) samples, and keeps the sufficient statistics of every
  (step, layer, head, candidate); ``LossTable.save`` / ``LossTable.load`` keep them on disk.
- ``plan_from_table`` pools the samples of each step bucket and picks per (bucket, layer, head)
  the sparsest candidate with ``rel_l2 <= alpha`` (ties: the lower error), or, given
  ``target_sparsity``, the lowest-error candidate at least that sparse (ties: the sparser).
  The first ``dense_fraction`` of the steps run dense (default 20%, as the PSA paper).
- ``search`` does both.

Step buckets: by default each sampled step (at or after the dense steps) starts a bucket that
lasts until the next sampled step, and the first bucket starts right after the dense steps; so
samples at steps 10, 20, 30, 40 of a 50-step schedule with 10 dense steps give the buckets
[10, 20), [20, 30), [30, 40), [40, 50). ``bucket_starts`` sets them explicitly.

Calibration samples come from ``vidsparse.search.calibration`` (``load_calibration``: a
folder of ``.safetensors`` files, or older ``.pt`` ones, read one sample at a time). A grid
and step count they record are checked against the search's; ``num_steps`` defaults to the
one they record.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import StripeSpec
from vidsparse.search.calibration import (
    CALIBRATION_FORMAT,
    CalibrationFiles,
    CalibrationSample,
    load_calibration,
    save_calibration_sample,
)
from vidsparse.search.candidates import Candidate, CandidateFamily, CandidateSet
from vidsparse.search.objective import DEFAULT_CHUNK_BYTES, LossStats, StripeObjective
from vidsparse.search.plan import HeadChoice, Plan, PlanBucket
from vidsparse.utils.files import atomic_write

__all__ = [
    "CALIBRATION_FORMAT",
    "LOSS_TABLE_FORMAT",
    "CalibrationSample",
    "CalibrationFiles",
    "load_calibration",
    "save_calibration_sample",
    "LossTable",
    "SearchResult",
    "build_loss_table",
    "plan_from_table",
    "search",
    "select_candidates",
    "dense_step_count",
]

LOSS_TABLE_FORMAT = "vidsparse-psa-losses"
LOSS_TABLE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# the loss table
# ---------------------------------------------------------------------------------------------


@dataclass
class LossTable:
    """Objective statistics of every (sample, head, candidate), enough to re-plan anything.

    Entry ``e`` is one calibration sample at ``steps[e]``, ``layers[e]``; ``err_sq``,
    ``cand_sq`` float64 ``[E, H, C]`` and ``ref_sq`` ``[E, H]`` are its ``LossStats``.
    ``skipped_steps``: sampled steps left out because they were dense when the table was built.
    """

    grid: VideoGrid
    candidates: CandidateSet
    steps: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    err_sq: list[torch.Tensor] = field(default_factory=list)
    cand_sq: list[torch.Tensor] = field(default_factory=list)
    ref_sq: list[torch.Tensor] = field(default_factory=list)
    model: str = ""
    num_steps: int | None = None
    query_fraction: float = 1.0
    skipped_steps: set[int] = field(default_factory=set)
    transformer: str | None = None  # the pipeline member the samples came from, if recorded

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_heads(self) -> int:
        if not self.ref_sq:
            raise ValueError("the loss table is empty")
        return self.ref_sq[0].shape[0]

    def add(self, step: int, layer: int, stats: LossStats) -> None:
        c = len(self.candidates)
        if stats.err_sq.ndim != 2 or stats.err_sq.shape[1] != c:
            raise ValueError(f"stats must be [H, C={c}], got {tuple(stats.err_sq.shape)}")
        if self.ref_sq and stats.ref_sq.shape[0] != self.num_heads:
            raise ValueError(
                f"every sample must have {self.num_heads} heads (as the first), step {step} "
                f"layer {layer} has {stats.ref_sq.shape[0]}"
            )
        self.steps.append(int(step))
        self.layers.append(int(layer))
        self.err_sq.append(stats.err_sq.double().cpu())
        self.cand_sq.append(stats.cand_sq.double().cpu())
        self.ref_sq.append(stats.ref_sq.double().cpu())

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``err_sq``, ``cand_sq`` ``[E, H, C]`` and ``ref_sq`` ``[E, H]`` as tensors."""
        if not self.steps:
            raise ValueError("the loss table is empty")
        return torch.stack(self.err_sq), torch.stack(self.cand_sq), torch.stack(self.ref_sq)

    def pooled(self, entries: Sequence[int]) -> LossStats:
        """Statistics summed over the given entries (samples of one bucket and layer)."""
        idx = list(entries)
        if not idx:
            raise ValueError("no entries to pool")
        return LossStats(
            torch.stack([self.err_sq[i] for i in idx]).sum(0),
            torch.stack([self.cand_sq[i] for i in idx]).sum(0),
            torch.stack([self.ref_sq[i] for i in idx]).sum(0),
        )

    # ---- files ---------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        def stack(xs, shape):
            # float64 as in memory, so a re-plan from the file equals one from the search.
            return torch.stack(xs) if xs else torch.zeros(shape, dtype=torch.float64)

        c = len(self.candidates)
        return {
            "format": LOSS_TABLE_FORMAT,
            "version": LOSS_TABLE_VERSION,
            "grid_shape": list(self.grid.shape),
            "tile": list(self.grid.tile_shape),
            "candidates": [
                {"spec": cand.spec.to_dict(), "spatial_unit": cand.spatial_unit}
                for cand in self.candidates
            ],
            "steps": list(self.steps),
            "layers": list(self.layers),
            "err_sq": stack(self.err_sq, (0, 0, c)),
            "cand_sq": stack(self.cand_sq, (0, 0, c)),
            "ref_sq": stack(self.ref_sq, (0, 0)),
            "model": self.model,
            "num_steps": self.num_steps,
            "query_fraction": float(self.query_fraction),
            "skipped_steps": sorted(self.skipped_steps),
            "transformer": self.transformer,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the table (``torch.save`` of plain data; atomic)."""
        state = self.to_state()
        atomic_write(path, lambda f: torch.save(state, f))

    @classmethod
    def load(cls, path: str | os.PathLike) -> LossTable:
        try:
            state = torch.load(Path(path), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise ValueError(f"loss table {str(path)!r} cannot be read: {exc}") from None
        if not isinstance(state, dict) or state.get("format") != LOSS_TABLE_FORMAT:
            raise ValueError(f"{str(path)!r} is not a vidsparse loss table (field 'format')")
        if state.get("version") != LOSS_TABLE_VERSION:
            raise ValueError(
                f"loss table {str(path)!r}: unsupported version {state.get('version')!r} "
                f"(expected {LOSS_TABLE_VERSION})"
            )
        grid = VideoGrid(state["grid_shape"], state["tile"])
        cands = [
            Candidate(StripeSpec.from_dict(c["spec"]), c["spatial_unit"])
            for c in state["candidates"]
        ]
        table = cls(
            grid=grid,
            candidates=CandidateSet.build(cands, grid.tiles, dedupe=False),
            model=state["model"],
            num_steps=state["num_steps"],
            query_fraction=state["query_fraction"],
            skipped_steps=set(state["skipped_steps"]),
            transformer=state.get("transformer"),  # absent from tables written before it
        )
        for e, (step, layer) in enumerate(zip(state["steps"], state["layers"])):
            stats = LossStats(state["err_sq"][e], state["cand_sq"][e], state["ref_sq"][e])
            table.add(step, layer, stats)
        return table


# ---------------------------------------------------------------------------------------------
# building the table
# ---------------------------------------------------------------------------------------------


def dense_step_count(num_steps: int, dense_fraction: float) -> int:
    """Steps run dense at the start: ``ceil(dense_fraction * num_steps)`` (20% of 50 -> 10)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if isinstance(dense_fraction, bool) or not isinstance(dense_fraction, (int, float)):
        raise TypeError(f"dense_fraction must be a float, got {dense_fraction!r}")
    if not 0.0 <= dense_fraction <= 1.0:
        raise ValueError(f"dense_fraction must lie in [0, 1], got {dense_fraction}")
    # The small epsilon keeps 0.2 * 50 = 10.000000000000002 from becoming 11.
    return min(num_steps, math.ceil(dense_fraction * num_steps - 1e-9))


def _infer_num_steps(samples) -> int:
    """The step count the samples record (they must agree), else the last sampled step + 1."""
    if isinstance(samples, CalibrationFiles):
        recorded = samples.recorded("num_steps")
        if recorded is not None:
            return recorded[0]
        steps = samples.steps()
    elif isinstance(samples, Sequence):
        counts = sorted({s.num_steps for s in samples if s.num_steps is not None})
        if len(counts) > 1:
            raise ValueError(f"the calibration samples record different num_steps: {counts}")
        if counts:
            return counts[0]
        steps = [s.step for s in samples]
    else:
        raise ValueError("num_steps is required when samples is a plain iterable")
    if not steps:
        raise ValueError("no calibration samples given")
    return max(steps) + 1


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _progress(iterable, total, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc="PSA search", unit="sample", dynamic_ncols=True)


def build_loss_table(
    samples: Iterable[CalibrationSample] | str | os.PathLike,
    grid: VideoGrid,
    *,
    family: CandidateFamily | None = None,
    candidates: CandidateSet | Sequence[Candidate] | None = None,
    num_steps: int | None = None,
    dense_fraction: float = 0.2,
    query_fraction: float = 1.0,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    candidate_chunk: int | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    model: str = "",
    progress: bool = True,
) -> LossTable:
    """Run the objective on every calibration sample; return the table of all losses.

    Args:
        samples: ``CalibrationSample`` objects (any iterable; a sequence shows a total in the
            progress bar), or a path for ``load_calibration``.
        grid: the latent video grid; its tile is the PSA block.
        family / candidates: the candidate family (default ``CandidateFamily()``), or an
            explicit candidate set (kept as given when not a ``CandidateSet``).
        num_steps: denoising steps of the schedule (default: the one the samples record,
            else the last sampled step + 1); a sample recording another is refused.
        dense_fraction: samples in the first ``dense_fraction`` of the steps are skipped (they
            run dense in any plan of that fraction).
        query_fraction: fraction of query blocks the objective evaluates (``StripeObjective``).
        device, dtype: where and in what precision to evaluate (default: the GPU in bf16 if
            there is one, else the CPU in fp32).
    """
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a VideoGrid, got {type(grid).__name__}")
    if isinstance(samples, (str, os.PathLike)):
        samples = load_calibration(samples)
    if family is not None and candidates is not None:
        raise ValueError("give at most one of family and candidates")
    if candidates is None:
        candidates = (family or CandidateFamily()).on_grid(grid.tiles)
    elif not isinstance(candidates, CandidateSet):
        candidates = CandidateSet.build(candidates, grid.tiles, dedupe=False)
    if num_steps is None:
        num_steps = _infer_num_steps(samples)
    dense_steps = dense_step_count(num_steps, dense_fraction)
    device = _default_device() if device is None else torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    objective = StripeObjective(
        grid,
        candidates,
        query_fraction=query_fraction,
        seed=seed,
        candidate_chunk=candidate_chunk,
        max_chunk_bytes=max_chunk_bytes,
    )
    table = LossTable(
        grid=grid,
        candidates=candidates,
        model=model,
        num_steps=num_steps,
        query_fraction=query_fraction,
    )
    total = len(samples) if isinstance(samples, Sequence) else None
    bar = _progress(samples, total, progress)
    for sample in bar:
        if not isinstance(sample, CalibrationSample):
            raise TypeError(f"samples must hold CalibrationSample, got {type(sample).__name__}")
        _check_sample_grid(sample, grid, num_steps)
        _check_sample_transformer(sample, table)
        if sample.step >= num_steps:
            raise ValueError(f"sample step {sample.step} is outside num_steps={num_steps}")
        if sample.step < dense_steps:
            table.skipped_steps.add(sample.step)
            continue
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(step=sample.step, layer=sample.layer, refresh=False)
        q, k, v = (x.to(device=device, dtype=dtype) for x in (sample.q, sample.k, sample.v))
        table.add(sample.step, sample.layer, objective(q, k, v, tiled=sample.tiled))
    if not len(table):
        raise ValueError(
            f"no calibration sample at or after step {dense_steps} (the first "
            f"{dense_steps} of {num_steps} steps run dense): nothing to search"
        )
    return table


def _check_sample_transformer(sample: CalibrationSample, table: LossTable) -> None:
    """The table takes the pipeline member the samples record; samples of two are refused
    (Wan 2.2 A14B's experts need a plan each)."""
    if sample.transformer is None:
        return
    if table.transformer is None:
        table.transformer = sample.transformer
    elif sample.transformer != table.transformer:
        raise ValueError(
            f"calibration sample (step {sample.step}, layer {sample.layer}) came from "
            f"{sample.transformer!r}, earlier samples from {table.transformer!r}: search each "
            "transformer's samples (its own subfolder of the capture) separately"
        )


def _check_sample_grid(sample: CalibrationSample, grid: VideoGrid, num_steps: int) -> None:
    recorded = sample.grid_shape
    if recorded is not None and recorded != grid.shape:
        raise ValueError(
            f"calibration sample (step {sample.step}, layer {sample.layer}) was captured on grid "
            f"{tuple(recorded)}, but the search grid is {grid.shape}"
        )
    if sample.num_steps is not None and sample.num_steps != num_steps:
        raise ValueError(
            f"calibration sample (step {sample.step}, layer {sample.layer}) was captured in a "
            f"{sample.num_steps}-step schedule, but the search has num_steps={num_steps}"
        )


# ---------------------------------------------------------------------------------------------
# selection and planning
# ---------------------------------------------------------------------------------------------


def _check_rule(alpha, target_sparsity) -> None:
    if (alpha is None) == (target_sparsity is None):
        raise ValueError("give exactly one of alpha and target_sparsity")
    if alpha is not None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
            raise ValueError(f"alpha must be a number >= 0, got {alpha!r}")
    elif (
        isinstance(target_sparsity, bool)
        or not isinstance(target_sparsity, (int, float))
        or not 0.0 <= target_sparsity <= 1.0
    ):
        raise ValueError(f"target_sparsity must lie in [0, 1], got {target_sparsity!r}")


def select_candidates(
    rel_l2: torch.Tensor,
    sparsity: torch.Tensor,
    *,
    alpha: float | None = None,
    target_sparsity: float | None = None,
) -> torch.Tensor:
    """Per head, the index of the chosen candidate: int64 ``[H]``.

    ``alpha``: the sparsest candidate with ``rel_l2 <= alpha`` (ties: lower error).
    ``target_sparsity``: the lowest-error candidate with ``sparsity >= target`` (ties: sparser).
    ``rel_l2`` is ``[H, C]``, ``sparsity`` ``[C]``.
    """
    _check_rule(alpha, target_sparsity)
    rel = rel_l2.double()
    sp = sparsity.double().to(rel.device).expand_as(rel)
    eps = 1e-12
    if alpha is not None:
        ok = rel <= alpha
        if not bool(ok.any(dim=1).all()):
            head = int((~ok.any(dim=1)).nonzero()[0])
            raise ValueError(
                f"no candidate reaches rel_l2 <= alpha={alpha} for head {head} (best "
                f"{float(rel[head].min()):.4g}); include the dense candidate or raise alpha"
            )
        best = torch.where(ok, sp, -math.inf).amax(dim=1, keepdim=True)
        tied = ok & (sp >= best - eps)
        return torch.where(tied, rel, math.inf).argmin(dim=1)
    ok = sp >= target_sparsity - eps
    if not bool(ok.any()):
        raise ValueError(
            f"no candidate reaches target_sparsity={target_sparsity} (the sparsest has "
            f"{float(sparsity.max()):.4f})"
        )
    best = torch.where(ok, rel, math.inf).amin(dim=1, keepdim=True)
    tied = ok & (rel <= best)
    return torch.where(tied, sp, -math.inf).argmax(dim=1)


def _bucket_bounds(sampled: list[int], dense_steps, num_steps, bucket_starts) -> list[tuple]:
    if bucket_starts is None:
        starts = [dense_steps, *sampled[1:]]
    else:
        starts = sorted({dense_steps, *(int(s) for s in bucket_starts if s > dense_steps)})
        if starts[-1] >= num_steps:
            raise ValueError(f"bucket_starts must be < num_steps={num_steps}, got {starts[-1]}")
    return list(zip(starts, [*starts[1:], num_steps]))


def _pool_by_bucket_and_layer(table: LossTable, bounds) -> tuple[list[tuple[int, int]], LossStats]:
    """Sum the statistics of the samples of each (bucket, layer) at once.

    Returns the (bucket index, layer) keys, sorted, and their pooled ``LossStats`` ``[G, H, C]``.
    """
    starts = [start for start, _ in bounds]
    group_of_entry, keys = [], {}
    for step, layer in zip(table.steps, table.layers):
        if step < starts[0]:
            group_of_entry.append(-1)  # a dense step: not pooled
            continue
        key = (bisect.bisect_right(starts, step) - 1, layer)
        group_of_entry.append(keys.setdefault(key, len(keys)))
    for b, (start, end) in enumerate(bounds):
        if not any(key[0] == b for key in keys):
            raise ValueError(f"no calibration sample falls in the step bucket [{start}, {end})")
    order = sorted(keys)  # by bucket, then layer
    rank = torch.empty(len(keys), dtype=torch.long)
    rank[[keys[k] for k in order]] = torch.arange(len(order))
    group = torch.tensor(group_of_entry, dtype=torch.long)
    used = group >= 0
    index = rank[group[used]]
    err_sq, cand_sq, ref_sq = table.stacked()

    def pool(x):  # [E, ...] -> [G, ...]
        out = torch.zeros(len(order), *x.shape[1:], dtype=x.dtype)
        return out.index_add_(0, index, x[used])

    return order, LossStats(pool(err_sq), pool(cand_sq), pool(ref_sq))


def plan_from_table(
    table: LossTable,
    *,
    alpha: float | None = None,
    target_sparsity: float | None = None,
    num_steps: int | None = None,
    dense_fraction: float = 0.2,
    bucket_starts: Sequence[int] | None = None,
    model: str | None = None,
) -> Plan:
    """Choose a spec per (step bucket, layer, head) from cached losses (no attention runs).

    Exactly one of ``alpha`` (max relative L2 error) and ``target_sparsity``.
    ``num_steps`` and ``model`` default to the table's. ``bucket_starts``: first steps of the
    buckets (default: one bucket per sampled step, see the module docstring); starts at or
    before the dense steps are ignored, the first bucket always begins right after them.
    """
    _check_rule(alpha, target_sparsity)
    if not len(table):
        raise ValueError("the loss table is empty")
    num_steps = table.num_steps if num_steps is None else num_steps
    if num_steps is None:
        num_steps = max(table.steps) + 1
    dense_steps = dense_step_count(num_steps, dense_fraction)
    missing = sorted(s for s in table.skipped_steps if s >= dense_steps)
    if missing:
        raise ValueError(
            f"the loss table has no losses for steps {missing} (they were dense when it was "
            f"built); use dense_fraction >= that of the table, or rebuild it"
        )
    if max(table.steps) >= num_steps:
        raise ValueError(f"the table holds step {max(table.steps)}, outside num_steps={num_steps}")
    sampled = sorted({s for s in table.steps if s >= dense_steps})
    if not sampled:
        raise ValueError(f"no sampled step at or after the {dense_steps} dense steps")

    bounds = _bucket_bounds(sampled, dense_steps, num_steps, bucket_starts)
    keys, stats = _pool_by_bucket_and_layer(table, bounds)  # G groups, stats [G, H, C]
    sparsity = table.candidates.sparsity
    rel, cos = stats.rel_l2, stats.cosine  # [G, H, C]
    g, h, c = rel.shape
    flat = dict(alpha=alpha, target_sparsity=target_sparsity)
    pick = select_candidates(rel.reshape(g * h, c), sparsity, **flat).view(g, h, 1)
    rel_pick = rel.gather(2, pick).squeeze(2).tolist()  # [G][H]
    cos_pick = cos.gather(2, pick).squeeze(2).tolist()
    pick, sparsity_list = pick.squeeze(2).tolist(), sparsity.tolist()
    layers_of: list[dict[int, tuple[HeadChoice, ...]]] = [{} for _ in bounds]
    for i, (b, layer) in enumerate(keys):
        layers_of[b][layer] = tuple(
            _head_choice(table.candidates[ci], sparsity_list[ci], rel_pick[i][hi], cos_pick[i][hi])
            for hi, ci in enumerate(pick[i])
        )
    buckets = [PlanBucket(s, e, layers_of[b]) for b, (s, e) in enumerate(bounds)]
    num_samples = sum(1 for step in table.steps if step >= bounds[0][0])

    units = sorted({c.spatial_unit for c in table.candidates}, key=("block", "row").index)
    return Plan(
        model=table.model if model is None else model,
        grid=table.grid,
        num_heads=table.num_heads,
        num_steps=num_steps,
        dense_steps=dense_steps,
        buckets=tuple(buckets),
        selection={
            "mode": "alpha" if alpha is not None else "target",
            "alpha": None if alpha is None else float(alpha),
            "target_sparsity": None if target_sparsity is None else float(target_sparsity),
            "metric": "rel_l2",
        },
        spatial_units=tuple(units),
        transformer=table.transformer,
        search={
            "num_candidates": len(table.candidates),
            "query_fraction": float(table.query_fraction),
            "num_samples": num_samples,
        },
    )


def _head_choice(candidate: Candidate, sparsity, rel, cos) -> HeadChoice:
    return HeadChoice(
        spec=candidate.spec,
        spatial_unit=candidate.spatial_unit,
        sparsity=float(sparsity),
        rel_l2=float(rel),
        cosine=float(cos),
    )


# ---------------------------------------------------------------------------------------------
# one call
# ---------------------------------------------------------------------------------------------


@dataclass
class SearchResult:
    plan: Plan
    table: LossTable


def search(
    samples: Iterable[CalibrationSample] | str | os.PathLike,
    grid: VideoGrid,
    *,
    alpha: float | None = None,
    target_sparsity: float | None = None,
    num_steps: int | None = None,
    dense_fraction: float = 0.2,
    bucket_starts: Sequence[int] | None = None,
    model: str = "",
    family: CandidateFamily | None = None,
    candidates: CandidateSet | Sequence[Candidate] | None = None,
    query_fraction: float = 1.0,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    candidate_chunk: int | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool = True,
) -> SearchResult:
    """``build_loss_table`` then ``plan_from_table``; returns the plan and the loss table.

    Exactly one of ``alpha`` and ``target_sparsity``; the other arguments are those of
    ``build_loss_table`` and ``plan_from_table``. Save the table (``result.table.save``) to
    re-plan later with another alpha or target in seconds.
    """
    _check_rule(alpha, target_sparsity)  # fail before any GPU time is spent
    table = build_loss_table(
        samples,
        grid,
        family=family,
        candidates=candidates,
        num_steps=num_steps,
        dense_fraction=dense_fraction,
        query_fraction=query_fraction,
        seed=seed,
        device=device,
        dtype=dtype,
        candidate_chunk=candidate_chunk,
        max_chunk_bytes=max_chunk_bytes,
        model=model,
        progress=progress,
    )
    plan = plan_from_table(
        table,
        alpha=alpha,
        target_sparsity=target_sparsity,
        dense_fraction=dense_fraction,
        bucket_starts=bucket_starts,
    )
    return SearchResult(plan, table)
