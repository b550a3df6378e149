"""The PSA candidate family: which stripe patterns the search may choose per head.

A candidate is a ``StripeSpec`` plus the ``spatial_unit`` that reads its spatial stride
(``"block"``: the stride counts flattened blocks; ``"row"``: it counts block rows). The family
is the product of a few *time* options and a few *space* options, each given as explicit ranges
(``AxisRange``), so the default set and any custom set are written down rather than hidden in
code::

    time (t_width, t_offset, t_stride)          space (s_width, s_offset, s_stride, unit)
      one frame at lag 0, +-1, +-2  (1, o, inf)     a band of 1 block at 0, +-1     (1, o, inf)
      windows of 3 / 5 frames  (2 or 3, 0, inf)     a band of 3 blocks              (2, 0, inf)
      every frame / 2nd / 3rd   (1, 0, 1|2|3)       every block / 3rd / 5th / 6th   ("block")
                                                    every row / 3rd row, same column  ("row")

That is 10 x 10 = 100 candidates by default, over the ranges of the PSA paper:
T_offset in {0,+-1,+-2}, T_stride in {1,2,3,inf}, S_offset in {0,+-1}, S_stride in {1,3,5,6,inf}.
Offsets go with the bands, where they move the band; periodic stripes are anchored on the
diagonal (offset 0), which every attention head we know of keeps. ``CandidateFamily.paper()``
is the full product of the paper's ranges (width 1) in both units, for a wider search.

On a concrete block grid, candidates whose masks coincide are merged (the first one is kept),
masks that attend to nothing are dropped, and the dense candidate is always present, first, so
that the search can always fall back on it. Masks and sparsities come from the separable
predicate (a time factor over frame distances times a space factor over block distances),
never from an ``N x N`` mask.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from vidsparse.masks.stripe import MAX_GRID_EXTENT, SPATIAL_UNITS, StripeSpec, stripe_predicate
from vidsparse.utils.checks import check_positive_ints

__all__ = [
    "AxisRange",
    "Candidate",
    "CandidateFamily",
    "CandidateSet",
    "candidate_factors",
    "candidate_sparsity",
]

_DENSE_T = {"t_width": 1, "t_offset": 0, "t_stride": 1}
_DENSE_S = {"s_width": 1, "s_offset": 0, "s_stride": 1}


# ---------------------------------------------------------------------------------------------
# one candidate
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A stripe spec and the unit of its spatial stride. Hashable; ``str`` gives a short label."""

    spec: StripeSpec
    spatial_unit: str = "block"

    def __post_init__(self) -> None:
        if not isinstance(self.spec, StripeSpec):
            raise TypeError(f"Candidate.spec must be a StripeSpec, got {type(self.spec).__name__}")
        if self.spatial_unit not in SPATIAL_UNITS:
            raise ValueError(
                f"Candidate.spatial_unit must be one of {SPATIAL_UNITS}, got {self.spatial_unit!r}"
            )

    @classmethod
    def dense(cls) -> Candidate:
        return cls(StripeSpec.dense(), "block")

    def block_spec(self, wb: int) -> StripeSpec:
        """The same mask as a ``"block"``-unit spec on a grid with ``wb`` blocks per row.

        A row-unit period of ``p`` rows is a block-unit period of ``p * wb`` blocks, so every
        candidate of a grid can run in one ``spatial_unit="block"`` launch.
        """
        if self.spatial_unit == "block" or self.spec.s_stride is None:
            return self.spec
        period = self.spec.s_stride * wb
        if period > MAX_GRID_EXTENT:
            # Longer than any |ds - s_offset| of any grid (ds within MAX_GRID_EXTENT - 1): the
            # mod never wraps, a single band.
            if period >= MAX_GRID_EXTENT + abs(self.spec.s_offset):
                return replace(self.spec, s_stride=None)
            raise ValueError(
                f"s_stride={self.spec.s_stride} rows of {wb} blocks is a period of {period} "
                f"blocks, beyond MAX_GRID_EXTENT = {MAX_GRID_EXTENT}"
            )
        return replace(self.spec, s_stride=period)

    def __str__(self) -> str:
        if self == Candidate.dense():
            return "dense"
        return f"{self.spec} [{self.spatial_unit}]"


# ---------------------------------------------------------------------------------------------
# the family
# ---------------------------------------------------------------------------------------------


def _as_int_tuple(name: str, values, *, allow_none: bool = False, positive: bool = False):
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence, got {values!r}") from None
    if not values:
        raise ValueError(f"{name} must not be empty")
    for v in values:
        if v is None and allow_none:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints{' or None' if allow_none else ''}, got {v!r}")
        if positive and v < 1:
            raise ValueError(f"{name} must hold values >= 1, got {v}")
    return values


@dataclass(frozen=True)
class AxisRange:
    """Explicit ranges of one axis: every combination of ``widths x offsets x strides``.

    ``strides`` may hold ``None`` (infinite: a single band). ``units`` only matters for space
    ranges (which spatial units to read the strides in); time ranges ignore it.
    """

    widths: tuple[int, ...] = (1,)
    offsets: tuple[int, ...] = (0,)
    strides: tuple[int | None, ...] = (None,)
    units: tuple[str, ...] = ("block",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", _as_int_tuple("widths", self.widths, positive=True))
        object.__setattr__(self, "offsets", _as_int_tuple("offsets", self.offsets))
        strides = _as_int_tuple("strides", self.strides, allow_none=True, positive=True)
        object.__setattr__(self, "strides", strides)
        units = tuple(self.units)
        bad = [u for u in units if u not in SPATIAL_UNITS]
        if not units or bad:
            raise ValueError(f"units must be a non-empty subset of {SPATIAL_UNITS}, got {units!r}")
        object.__setattr__(self, "units", units)

    def combinations(self) -> Iterable[tuple[int, int, int | None]]:
        for s in self.strides:
            for o in self.offsets:
                for w in self.widths:
                    yield w, o, s


DEFAULT_TIME = (
    AxisRange(widths=(1,), offsets=(0, 1, -1, 2, -2), strides=(None,)),  # one frame at a lag
    AxisRange(widths=(2, 3), offsets=(0,), strides=(None,)),  # windows of 3 and 5 frames
    AxisRange(widths=(1,), offsets=(0,), strides=(1, 2, 3)),  # every frame, 2nd, 3rd frame
)
DEFAULT_SPACE = (
    AxisRange(widths=(1,), offsets=(0, 1, -1), strides=(None,)),  # one block at a shift
    AxisRange(widths=(2,), offsets=(0,), strides=(None,)),  # a band of 3 neighbouring blocks
    AxisRange(widths=(1,), offsets=(0,), strides=(1, 3, 5, 6), units=("block",)),
    AxisRange(widths=(1,), offsets=(0,), strides=(1, 3), units=("row",)),  # same column
)


@dataclass(frozen=True)
class CandidateFamily:
    """The candidate set as explicit ranges: every time option x every space option.

    ``CandidateFamily()`` is the default family of 100 candidates (module docstring);
    ``CandidateFamily.paper()`` the full product of the PSA paper's ranges. ``candidates()``
    lists the nominal candidates (grid-independent); ``on_grid(block_grid)`` the distinct ones
    of a block grid with their sparsities.
    """

    time: tuple[AxisRange, ...] = DEFAULT_TIME
    space: tuple[AxisRange, ...] = DEFAULT_SPACE
    extra: tuple[Candidate, ...] = field(default_factory=tuple)  # appended as given

    def __post_init__(self) -> None:
        for name in ("time", "space"):
            ranges = tuple(getattr(self, name))
            if not ranges or not all(isinstance(r, AxisRange) for r in ranges):
                raise TypeError(f"CandidateFamily.{name} must be a non-empty tuple of AxisRange")
            object.__setattr__(self, name, ranges)
        extra = tuple(self.extra)
        if not all(isinstance(c, Candidate) for c in extra):
            raise TypeError("CandidateFamily.extra must hold Candidate objects")
        object.__setattr__(self, "extra", extra)

    @classmethod
    def paper(cls) -> CandidateFamily:
        """All combinations of the paper's ranges, width 1, both spatial units."""
        return cls(
            time=(AxisRange(offsets=(0, 1, -1, 2, -2), strides=(1, 2, 3, None)),),
            space=(AxisRange(offsets=(0, 1, -1), strides=(1, 3, 5, 6, None), units=SPATIAL_UNITS),),
        )

    def candidates(self) -> list[Candidate]:
        """Nominal candidates, dense first, exact duplicates removed (order kept)."""
        times = [t for r in self.time for t in r.combinations()]
        spaces = [(*s, u) for r in self.space for s in r.combinations() for u in r.units]
        out = [Candidate.dense()]
        for tw, to, ts in times:
            for sw, so, ss, unit in spaces:
                spec = StripeSpec(tw, to, ts, sw, so, ss)
                # An infinite spatial stride reads the same in both units: keep one spelling.
                out.append(Candidate(spec, "block" if ss is None else unit))
        out.extend(self.extra)
        return list(dict.fromkeys(out))

    def __len__(self) -> int:
        return len(self.candidates())

    def on_grid(self, block_grid: Sequence[int]) -> CandidateSet:
        """The distinct, non-empty candidates of a ``(Tb, Hb, Wb)`` block grid."""
        return CandidateSet.build(self.candidates(), block_grid)


# ---------------------------------------------------------------------------------------------
# masks through the separable factors
# ---------------------------------------------------------------------------------------------


def candidate_factors(
    candidate: Candidate, block_grid: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two factors of a candidate's block mask on ``(Tb, Hb, Wb)``.

    Returns ``pass_t`` bool ``[2*Tb - 1]`` over frame distances ``dt = -(Tb-1) .. Tb-1`` and
    ``pass_s`` bool ``[2*Ns - 1]`` over flattened spatial distances ``ds`` (``Ns = Hb*Wb``):
    ``mask[(tq, sq), (tk, sk)] = pass_t[tk - tq + Tb-1] & pass_s[sk - sq + Ns-1]``.
    """
    tb, hb, wb = check_positive_ints("block_grid", block_grid, length=3)
    ns = hb * wb
    spec, unit = candidate.spec, candidate.spatial_unit
    dt = torch.arange(-(tb - 1), tb)
    ds = torch.arange(-(ns - 1), ns)
    # The predicate is the single source of truth; make the other axis dense to read a factor.
    time_only = replace(spec, **_DENSE_S)
    space_only = replace(spec, **_DENSE_T)
    pass_t = stripe_predicate(dt, torch.zeros((), dtype=torch.long), time_only, wb=wb)
    pass_s = stripe_predicate(
        torch.zeros((), dtype=torch.long), ds, space_only, wb=wb, spatial_unit=unit
    )
    return pass_t, pass_s


def _axis_density(passes: torch.Tensor, length: int) -> float:
    """Fraction of (query, key) pairs of an axis of ``length`` whose distance passes."""
    d = torch.arange(-(length - 1), length)
    pairs = (length - d.abs()).double()  # how many pairs have distance d
    return float((passes.double() * pairs).sum() / length**2)


def candidate_sparsity(candidates: Sequence[Candidate], block_grid: Sequence[int]) -> torch.Tensor:
    """Fraction of skipped (query block, key block) pairs per candidate: float64 ``[C]``.

    Equals ``stripe_sparsity(stripe_block_mask(...))`` without building the ``N x N`` masks.
    """
    tb, hb, wb = check_positive_ints("block_grid", block_grid, length=3)
    out = []
    for c in candidates:
        pass_t, pass_s = candidate_factors(c, (tb, hb, wb))
        out.append(1.0 - _axis_density(pass_t, tb) * _axis_density(pass_s, hb * wb))
    return torch.tensor(out, dtype=torch.float64)


@dataclass(frozen=True)
class CandidateSet:
    """Distinct candidates of one block grid, dense first, with their sparsities.

    ``sparsity`` float64 ``[C]`` counts the skipped pairs of the (padded) block grid.
    """

    candidates: tuple[Candidate, ...]
    block_grid: tuple[int, int, int]
    sparsity: torch.Tensor

    @classmethod
    def build(
        cls, candidates: Iterable[Candidate], block_grid: Sequence[int], *, dedupe: bool = True
    ) -> CandidateSet:
        """Merge candidates with identical masks (first kept), drop empty ones, put dense first.

        With ``dedupe=False`` the candidates are kept as given (order, duplicates, no added
        dense); useful when the caller's order must be preserved.
        """
        block_grid = check_positive_ints("block_grid", block_grid, length=3)
        candidates = list(candidates)
        for i, c in enumerate(candidates):
            if not isinstance(c, Candidate):
                raise TypeError(f"candidates[{i}] must be a Candidate, got {type(c).__name__}")
        if dedupe:
            candidates = _distinct_masks([Candidate.dense(), *candidates], block_grid)
        if not candidates:
            raise ValueError("the candidate set is empty")
        return cls(tuple(candidates), block_grid, candidate_sparsity(candidates, block_grid))

    def __len__(self) -> int:
        return len(self.candidates)

    def __iter__(self):
        return iter(self.candidates)

    def __getitem__(self, i: int) -> Candidate:
        return self.candidates[i]

    def block_specs(self) -> tuple[StripeSpec, ...]:
        """Every candidate as a ``"block"``-unit spec of this grid (one launch serves all)."""
        wb = self.block_grid[2]
        return tuple(c.block_spec(wb) for c in self.candidates)

    def index(self, candidate: Candidate) -> int:
        return self.candidates.index(candidate)


def _distinct_masks(candidates: list[Candidate], block_grid) -> list[Candidate]:
    # Every (dt, ds) pair occurs in the grid, so two non-empty masks are equal exactly when
    # both factors are equal: the factors are a complete, cheap key.
    seen: set[tuple[bytes, bytes]] = set()
    out = []
    for c in candidates:
        pass_t, pass_s = candidate_factors(c, block_grid)
        if not bool(pass_t.any()) or not bool(pass_s.any()):
            continue  # attends to nothing on this grid: never a useful choice
        key = (pass_t.numpy().tobytes(), pass_s.numpy().tobytes())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out
