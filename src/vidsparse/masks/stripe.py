"""Stripe masks of PSA (Parameterized Stripe Attention).

Each head attends along periodic bands ("stripes") of the block grid, in time and in space.
Between query block ``(tq, hq, wq)`` and key block ``(tk, hk, wk)`` of a ``(Tb, Hb, Wb)`` block
grid, with flattened spatial index ``s = h*Wb + w``, ``dt = tk - tq`` and ``ds = sk - sq``::

    pass_t = (|dt - t_offset| mod t_stride) <= t_width - 1     (no mod when t_stride is None)
    pass_s = (|ds - s_offset| mod P)        <= s_width - 1     P = s_stride       ("block")
                                                               P = s_stride * Wb  ("row")
    attend = pass_t and pass_s

For example ``t(w=1,o=0,s=inf)`` (same frame only) with ``s(w=2,o=0,s=3)`` on a grid of one frame
and 6 spatial blocks gives, per query row, the key blocks at spatial distance 0, 1, 3, 4, 6, ...::

         k0 k1 k2 k3 k4 k5
    q0 [  1  1  0  1  1  0 ]
    q1 [  1  1  1  0  1  1 ]
    q2 [  0  1  1  1  0  1 ]
    ...

The predicate is separable (a time factor times a space factor), so a whole ``[H, N, N]`` mask
is built from ``[H, Tb, Tb]`` and ``[H, S, S]`` factors without ``[H, N, N]`` integer temporaries.
Block order is raster, ``n = (t*Hb + h)*Wb + w``, the tile order of ``VideoGrid``.

**Bounds.** A block grid holds at most ``MAX_GRID_EXTENT = 2**31 - 1`` blocks (the engine's
block indices are int32), so every distance ``dt``, ``ds`` lies within ``±MAX_GRID_EXTENT``.
``StripeSpec`` fields are bounded by the same extent: widths and strides in
``[1, MAX_GRID_EXTENT]``, offsets in ``[-MAX_GRID_EXTENT, MAX_GRID_EXTENT]`` (a wider band or
a farther offset means nothing more on any grid with a single band). Then the predicate's int64
arithmetic cannot overflow: ``|d - offset| <= 2**32`` and the row unit's period
``s_stride * Wb < 2**62``.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from vidsparse.masks.block_sparse import lists_from_dense
from vidsparse.utils.checks import check_device, check_positive_ints, check_tensor

__all__ = [
    "MAX_GRID_EXTENT",
    "SPATIAL_UNITS",
    "StripeSpec",
    "stripe_predicate",
    "stripe_block_mask",
    "stripe_block_lists",
    "stripe_sparsity",
    "clear_stripe_cache",
]

SPATIAL_UNITS = ("block", "row")

# Blocks of a block grid at most (int32 block indices): the bound of every axis extent, distance
# and StripeSpec field (module docstring).
MAX_GRID_EXTENT = 2**31 - 1

_CACHE_SIZE = 32


def _check_int(name: str, value) -> int:
    # numpy integers are accepted (search code produces them); bools are not ints here.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


@dataclass(frozen=True)
class StripeSpec:
    """Stripe parameters of one head (one PSA candidate).

    ``*_width`` in ``[1, MAX_GRID_EXTENT]``: band width; ``*_offset`` in
    ``[-MAX_GRID_EXTENT, MAX_GRID_EXTENT]``: band centre shift; ``*_stride`` in
    ``[1, MAX_GRID_EXTENT]`` or ``None`` (infinite, a single band): band period
    (``MAX_GRID_EXTENT = 2**31 - 1``, the module docstring says why). Hashable, so it can key
    caches; ``to_dict``/``from_dict`` round-trip through plan files (JSON: ``null`` = infinite).
    """

    t_width: int
    t_offset: int
    t_stride: int | None
    s_width: int
    s_offset: int
    s_stride: int | None

    def __post_init__(self) -> None:
        for f in fields(self):
            name = f.name
            value = getattr(self, name)
            if name.endswith("_stride") and value is None:
                continue
            value = _check_int(name, value)
            lo = -MAX_GRID_EXTENT if name.endswith("_offset") else 1
            if not lo <= value <= MAX_GRID_EXTENT:
                if value < 1 and lo == 1:  # the message tests and users know
                    raise ValueError(f"{name} must be >= 1, got {value}")
                raise ValueError(
                    f"{name} must lie in [{lo}, {MAX_GRID_EXTENT}] (MAX_GRID_EXTENT, the most "
                    f"blocks a grid holds), got {value}"
                )
            object.__setattr__(self, name, value)  # normalise numpy ints to int

    @classmethod
    def dense(cls) -> StripeSpec:
        """A spec that attends to every block (strides of 1 make every distance pass)."""
        return cls(t_width=1, t_offset=0, t_stride=1, s_width=1, s_offset=0, s_stride=1)

    def to_dict(self) -> dict[str, int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StripeSpec:
        if not isinstance(data, dict):
            raise TypeError(f"StripeSpec.from_dict needs a dict, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise ValueError(
                f"StripeSpec.from_dict: missing keys {missing}, unknown keys {unknown}; "
                f"expected exactly {names}"
            )
        values = {}
        for n in names:
            v = data[n]
            # Plan files written by hand may say "inf" for an infinite stride.
            if n.endswith("_stride") and (v == "inf" or v == float("inf")):
                v = None
            values[n] = v
        return cls(**values)

    def is_dense(self, block_grid: Sequence[int], spatial_unit: str = "block") -> bool:
        """True when this spec attends to every pair of blocks of ``block_grid``."""
        tb, hb, wb = _check_block_grid(block_grid)
        _check_spatial_unit(spatial_unit)
        # Every (dt, ds) combination occurs in the grid, so dense <=> every dt and every ds pass.
        dt = torch.arange(-(tb - 1), tb).view(-1, 1)
        ds = torch.arange(-(hb * wb - 1), hb * wb).view(1, -1)
        return bool(stripe_predicate(dt, ds, self, wb=wb, spatial_unit=spatial_unit).all())

    def __str__(self) -> str:
        def part(axis: str, w: int, o: int, s: int | None) -> str:
            return f"{axis}(w={w},o={o},s={'inf' if s is None else s})"

        return (
            f"{part('t', self.t_width, self.t_offset, self.t_stride)} "
            f"{part('s', self.s_width, self.s_offset, self.s_stride)}"
        )


# ---------------------------------------------------------------------------------------------
# the predicate (single source of truth for the formula)
# ---------------------------------------------------------------------------------------------


def _check_spatial_unit(spatial_unit) -> str:
    if spatial_unit not in SPATIAL_UNITS:
        raise ValueError(f"spatial_unit must be one of {SPATIAL_UNITS}, got {spatial_unit!r}")
    return spatial_unit


def _check_block_grid(block_grid) -> tuple[int, int, int]:
    tb, hb, wb = check_positive_ints("block_grid", block_grid, length=3)
    if tb * hb * wb > MAX_GRID_EXTENT:
        raise ValueError(
            f"block_grid must hold at most MAX_GRID_EXTENT = {MAX_GRID_EXTENT} blocks (int32 "
            f"block indices), got {(tb, hb, wb)} = {tb * hb * wb} blocks"
        )
    return tb, hb, wb


def _check_distances(name: str, d: torch.Tensor) -> None:
    """Distances between blocks of a grid lie within ``±MAX_GRID_EXTENT`` (int64-safe maths)."""
    if d.numel() and d.device.type != "meta":
        lo, hi = (int(x) for x in torch.aminmax(d))
        if max(-lo, hi) > MAX_GRID_EXTENT:
            raise ValueError(
                f"{name} must lie in [-{MAX_GRID_EXTENT}, {MAX_GRID_EXTENT}] (MAX_GRID_EXTENT: "
                f"distances within a block grid), got values in [{lo}, {hi}]"
            )


def _check_specs(specs) -> tuple[StripeSpec, ...]:
    if isinstance(specs, StripeSpec):
        raise TypeError("specs must be a sequence of StripeSpec (one per head), got one StripeSpec")
    try:
        specs = tuple(specs)
    except TypeError:
        raise TypeError(
            f"specs must be a sequence of StripeSpec, got {type(specs).__name__}"
        ) from None
    if not specs:
        raise ValueError("specs must hold at least one StripeSpec (one per head), got none")
    for i, s in enumerate(specs):
        if not isinstance(s, StripeSpec):
            raise TypeError(f"specs[{i}] must be a StripeSpec, got {type(s).__name__}")
    return specs


def _axis_params(specs: tuple[StripeSpec, ...], axis: str, period_scale: int, device):
    """(offset, width, period) as int64 [H] tensors for axis "t" or "s"; period 0 = infinite."""
    offset = [getattr(s, f"{axis}_offset") for s in specs]
    width = [getattr(s, f"{axis}_width") for s in specs]
    stride = [getattr(s, f"{axis}_stride") for s in specs]
    period = [0 if p is None else p * period_scale for p in stride]

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return as_tensor(offset), as_tensor(width), as_tensor(period)


def _periodic_band(d: torch.Tensor, offset, width, period) -> torch.Tensor:
    """``(|d - offset| mod period) <= width - 1``, no mod where ``period == 0`` (infinite)."""
    dist = (d - offset).abs()
    wrapped = torch.where(period > 0, dist % period.clamp_min(1), dist)
    return wrapped <= width - 1


def _spatial_period_scale(spatial_unit: str, wb: int) -> int:
    return wb if spatial_unit == "row" else 1


def stripe_predicate(
    dt: torch.Tensor,
    ds: torch.Tensor,
    spec: StripeSpec | Sequence[StripeSpec],
    *,
    wb: int,
    spatial_unit: str = "block",
) -> torch.Tensor:
    """Elementwise PSA predicate on integer tensors ``dt = tk - tq``, ``ds = sk - sq``.

    With one ``StripeSpec`` the result has the broadcast shape of ``dt`` and ``ds``; with a
    sequence of ``H`` specs it gains a leading head dim, ``[H, *broadcast_shape]``.
    ``wb`` (blocks per grid row) only matters for ``spatial_unit="row"``. Distances and ``wb``
    lie within ``MAX_GRID_EXTENT`` (``ValueError`` otherwise).
    """
    _check_spatial_unit(spatial_unit)
    single = isinstance(spec, StripeSpec)
    specs = (spec,) if single else _check_specs(spec)
    check_positive_ints("wb", (wb,))
    if wb > MAX_GRID_EXTENT:
        raise ValueError(f"wb must be <= MAX_GRID_EXTENT = {MAX_GRID_EXTENT}, got {wb}")
    dt, ds = torch.as_tensor(dt), torch.as_tensor(ds)
    for name, t in (("dt", dt), ("ds", ds)):
        if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
        _check_distances(name, t)
    shape = torch.broadcast_shapes(dt.shape, ds.shape)
    pass_t, pass_s = _predicate_factors(dt.long(), ds.long(), specs, wb, spatial_unit)
    out = pass_t & pass_s  # [H, *shape]
    return out.reshape(shape) if single else out


def _predicate_factors(dt, ds, specs, wb: int, spatial_unit: str):
    """pass_t [H, *dt.shape] and pass_s [H, *ds.shape] for all heads at once."""
    device = dt.device
    t_off, t_w, t_per = _axis_params(specs, "t", 1, device)
    scale = _spatial_period_scale(spatial_unit, wb)
    s_off, s_w, s_per = _axis_params(specs, "s", scale, device)

    def per_head(x: torch.Tensor, ndim: int) -> torch.Tensor:  # [H] -> [H, 1, ..., 1]
        return x.view(-1, *([1] * ndim))

    pass_t = _periodic_band(
        dt, per_head(t_off, dt.ndim), per_head(t_w, dt.ndim), per_head(t_per, dt.ndim)
    )
    pass_s = _periodic_band(
        ds.to(device), per_head(s_off, ds.ndim), per_head(s_w, ds.ndim), per_head(s_per, ds.ndim)
    )
    return pass_t, pass_s


# ---------------------------------------------------------------------------------------------
# masks and lists (cached)
# ---------------------------------------------------------------------------------------------


def _normalise_device(device) -> torch.device:
    # A device this process cannot use (cuda on a CPU-only torch, a bogus name): a ValueError
    # naming the argument, not torch's AssertionError from deep inside the build.
    device = torch.device("cpu") if device is None else check_device("device", device)
    if device.type == "cuda" and device.index is None:
        # "cuda" and "cuda:0" must hit the same cache entry.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_sink_frames(sink_frames) -> int:
    if isinstance(sink_frames, bool) or not isinstance(sink_frames, int):
        raise TypeError(f"sink_frames must be an int, got {sink_frames!r}")
    if sink_frames < 0:
        raise ValueError(f"sink_frames must be >= 0, got {sink_frames}")
    return sink_frames


def _normalise_args(specs, block_grid, spatial_unit, device, sink_frames):
    return (
        _check_specs(specs),
        _check_block_grid(block_grid),
        _check_spatial_unit(spatial_unit),
        _check_sink_frames(sink_frames),
        _normalise_device(device),
    )


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _stripe_block_mask_cached(specs, block_grid, spatial_unit, sink_frames, device):
    tb, hb, wb = block_grid
    ns = hb * wb
    t = torch.arange(tb, device=device)
    s = torch.arange(ns, device=device)
    dt = t.view(1, tb) - t.view(tb, 1)  # [Tb(q), Tb(k)]
    ds = s.view(1, ns) - s.view(ns, 1)  # [S(q), S(k)]
    pass_t, pass_s = _predicate_factors(dt, ds, specs, wb, spatial_unit)  # [H,Tb,Tb], [H,S,S]
    # mask[h, tq, sq, tk, sk] = pass_t[h, tq, tk] & pass_s[h, sq, sk]
    mask = pass_t[:, :, None, :, None] & pass_s[:, None, :, None, :]  # [H, Tb, S, Tb, S]
    if sink_frames:
        # Sink frames: key blocks of the first frames are always attended (beyond the paper).
        mask |= (t < sink_frames).view(1, 1, 1, tb, 1)
    h = len(specs)
    n = tb * ns
    return mask.reshape(h, n, n).contiguous()


def stripe_block_mask(
    specs: Sequence[StripeSpec],
    block_grid: Sequence[int],
    spatial_unit: str = "block",
    *,
    device: torch.device | str | None = None,
    sink_frames: int = 0,
) -> torch.Tensor:
    """Block mask of per-head stripe patterns: bool ``[H, N, N]``, ``N = Tb * Hb * Wb``.

    ``specs`` holds one ``StripeSpec`` per head; ``block_grid = (Tb, Hb, Wb)``;
    ``spatial_unit`` is ``"block"`` or ``"row"`` (see the module docstring);
    ``sink_frames = n`` makes key blocks of the first ``n`` frames attended by every query
    block. ``mask[h, q, k]`` says whether query block ``q`` attends to key block ``k``.

    Results are cached per (specs, block_grid, spatial_unit, sink_frames, device) and the
    cached tensor itself is returned: callers must not modify it in place (clone first).
    """
    args = _normalise_args(specs, block_grid, spatial_unit, device, sink_frames)
    return _stripe_block_mask_cached(*args)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _stripe_block_lists_cached(specs, block_grid, spatial_unit, sink_frames, device):
    mask = _stripe_block_mask_cached(specs, block_grid, spatial_unit, sink_frames, device)
    return lists_from_dense(mask.unsqueeze(0))


def stripe_block_lists(
    specs: Sequence[StripeSpec],
    block_grid: Sequence[int],
    spatial_unit: str = "block",
    *,
    device: torch.device | str | None = None,
    sink_frames: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block lists of ``stripe_block_mask``: ``kv_indices`` int32 ``[1, H, N, K]`` and
    ``kv_counts`` int32 ``[1, H, N]``, ready for ``block_sparse_attn`` (broadcast over batch).

    Built through the dense mask, which suits block grids up to a few thousand blocks.
    Cached like ``stripe_block_mask``: do not modify the returned tensors in place.
    """
    args = _normalise_args(specs, block_grid, spatial_unit, device, sink_frames)
    return _stripe_block_lists_cached(*args)


def clear_stripe_cache() -> None:
    """Drop the cached masks and lists (frees their memory)."""
    _stripe_block_lists_cached.cache_clear()
    _stripe_block_mask_cached.cache_clear()


def stripe_sparsity(mask: torch.Tensor) -> torch.Tensor:
    """Fraction of skipped block pairs per head: float32 ``[H]`` for a ``[H, N, M]`` mask
    (any leading dims are kept; the last two are reduced)."""
    check_tensor("mask", mask, dtypes=(torch.bool,))
    if mask.ndim < 2:
        raise ValueError(f"mask must have at least 2 dimensions, got shape {tuple(mask.shape)}")
    return 1.0 - mask.float().mean(dim=(-2, -1))
