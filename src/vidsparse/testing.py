"""Helpers for checking kernels against fp32 references (used by the tests and benchmarks).

The error-relative rule: a low-precision kernel passes when its error against the
fp32 reference is at most ``factor`` times the error that PyTorch itself makes computing the
same function in the same low precision, plus a small absolute floor. This scales with the
dtype, the problem size and the input scale, where a fixed ``atol`` does not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

# torch.Tensor's methods that read values back to the host (a sync on a GPU).
READING_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                   "numpy", "nonzero")  # fmt: skip


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are zero)."""
    x64, r64 = x.detach().double(), ref.detach().double()
    denom = r64.norm()
    num = (x64 - r64).norm()
    if denom == 0:
        return float(num)
    return float(num / denom)


def grad_errors(grads: dict, ref: dict, floor: float = 1e-3) -> dict[str, float]:
    """Per parameter, the relative L2 of ``grads[name]`` against ``ref[name]``; a reference
    norm below ``floor`` times the largest one counts as that (near-zero gradients are rounding
    noise). A parameter ``ref`` has and ``grads`` lacks: ``inf``."""
    largest = max((float(g.detach().double().norm()) for g in ref.values()), default=0.0)
    errors = {}
    for name, r in ref.items():
        if name not in grads:
            errors[name] = float("inf")
            continue
        r64 = r.detach().double()
        diff = float((grads[name].detach().double() - r64).norm())
        errors[name] = diff / max(float(r64.norm()), floor * largest, 1e-30)
    return errors


def max_abs_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref.detach().double()).abs().max()) if x.numel() else 0.0


def assert_no_nan(name: str, x: torch.Tensor) -> None:
    bad = torch.isnan(x)
    if bad.any():
        raise AssertionError(f"{name}: {int(bad.sum())} NaN elements of {x.numel()}")


def assert_error_relative(
    name: str,
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor,
    *,
    factor: float = 2.0,
    atol: float = 1e-5,
) -> None:
    """``max|out - ref| <= factor * max|baseline - ref| + atol``.

    ``ref`` is the fp32 (or fp64) reference; ``baseline`` is the same function computed by
    PyTorch in the kernel's low precision.
    """
    assert_no_nan(name, out)
    err = max_abs_err(out, ref)
    base = max_abs_err(baseline, ref)
    bound = factor * base + atol
    if not err <= bound:
        raise AssertionError(
            f"{name}: max abs error {err:.3e} > {factor} * baseline {base:.3e} + {atol:.1e}"
            f" (rel L2 {rel_l2(out, ref):.3e}, baseline rel L2 {rel_l2(baseline, ref):.3e})"
        )


def assert_rel_l2(name: str, out: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    """Relative L2 bound; state the dtype it is meant for at the call site."""
    assert_no_nan(name, out)
    err = rel_l2(out, ref)
    if not err <= bound:
        raise AssertionError(f"{name}: relative L2 error {err:.3e} > {bound:.1e}")


def poison_(x: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floating) or a sentinel (integer) so unwritten elements show up."""
    if x.is_floating_point():
        return x.fill_(float("nan"))
    return x.fill_(-12345)


def add_tile_structure(x: torch.Tensor, grid, strength: float, *, tiled: bool) -> torch.Tensor:
    """``x`` plus a random component shared by all tokens of a tile (as real video has), on the
    video part of ``x [B, H, S, D]`` (the first ``num_tokens``, or ``padded_len`` if ``tiled``).

    Spreads VSA's coarse scores so that no top-k decision is a near-tie: a test of the fine
    stage then does not hinge on ties that TF32 coarse scores could break differently from an
    fp32 reference.
    """
    B, H, _, D = x.shape
    per_tile = torch.randn(B, H, grid.num_tiles, 1, D, device=x.device, dtype=x.dtype)
    slots = per_tile.expand(-1, -1, -1, grid.tile_volume, -1).reshape(B, H, -1, D)
    video = slots if tiled else grid.untile(slots, dim=-2)
    extra = torch.zeros_like(x)
    extra[:, :, : video.shape[2]] = video
    return x + strength * extra


@contextlib.contextmanager
def reading_methods_watched(
    on_read: Callable[[str, torch.Tensor], None], names: tuple[str, ...] = READING_METHODS
) -> Iterator[None]:
    """While the block runs, ``on_read(name, tensor)`` before each call of ``torch.Tensor``'s
    methods ``names`` (default: every method that reads values back to the host). Not
    thread-safe: it swaps the methods on the class, and restores them on exit."""
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def watched(name, method):
        def wrapper(self, *args, **kwargs):
            on_read(name, self)
            return method(self, *args, **kwargs)

        return wrapper

    for name, method in saved.items():
        setattr(torch.Tensor, name, watched(name, method))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
