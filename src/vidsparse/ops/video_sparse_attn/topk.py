"""How many key tiles each query tile keeps: VSA's ``topk`` / ``sparsity`` rule."""

from __future__ import annotations

import math
from statistics import NormalDist

__all__ = ["resolve_topk", "selected_quantile_z"]

# (1 - sparsity) * num_tiles is often an integer spoiled by rounding (0.3 * 10 =
# 3.0000000000000004); do not let that round up to one more tile.
_TOPK_ROUNDING_SLACK = 1e-9


def resolve_topk(num_tiles: int, topk: int | None = None, sparsity: float | None = None) -> int:
    """Number of key tiles each query tile keeps, from exactly one of ``topk`` / ``sparsity``.

    ``topk = clamp(ceil((1 - sparsity) * num_tiles), 1, num_tiles)``; an explicit ``topk``
    above ``num_tiles`` is clamped to it.
    """
    if (topk is None) == (sparsity is None):
        raise ValueError(
            f"pass exactly one of topk and sparsity, got topk={topk!r}, sparsity={sparsity!r}"
        )
    if topk is not None:
        if isinstance(topk, bool) or not isinstance(topk, int):
            raise TypeError(f"topk must be an int, got {topk!r}")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        return min(topk, num_tiles)
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
        raise TypeError(f"sparsity must be a float in [0, 1], got {sparsity!r}")
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    kept = math.ceil((1.0 - sparsity) * num_tiles - _TOPK_ROUNDING_SLACK)
    return max(1, min(kept, num_tiles))


def selected_quantile_z(topk: int, num_tiles: int) -> float:
    """Where the top-k boundary would sit, in standard deviations above the mean, if a row's
    scores were normal: only steers the first pivots."""
    kept = min(max(topk / num_tiles, 1e-4), 1.0 - 1e-4)
    return NormalDist().inv_cdf(1.0 - kept)
