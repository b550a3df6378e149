"""Shared pieces of the fuzz harness: hypothesis profiles and the case budget, backend
switching, list builders (README.md beside this file says how to run the profiles).

``VIDSPARSE_FUZZ=ci`` (the default, what ``make test`` runs): a few hundred cases in all,
under two minutes on two cores. ``VIDSPARSE_FUZZ=long``: 40x as many (over 10,000 cases).
Each test draws its own share (``examples(n)``: ``n`` cases in the ci profile, ``40 n`` in the
long one); the number of cases a run executed is printed at its end (``conftest.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from helpers import flash_gradients_fp32, gradient_term_magnitudes, masked_dense_attention

# Relative error of o allowed against the fp64 reference, per input dtype: ~10x the largest
# seen over the long profile on the CPU (fp32 with room for the GPU's tf32x3 dots). Dropping
# one listed block of ten moves o by ~0.1-0.3, so each bound catches it.
TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# lse is accumulated in fp32 from the inputs as given (the reference reads the same rounded
# values), whatever their dtype: ~1.4e-5 worst seen, relative to max(1, |lse|).
LSE_TOL = 1e-4


PROFILES = {"ci": 1, "long": 40}
PROFILE = os.environ.get("VIDSPARSE_FUZZ", "ci")
if PROFILE not in PROFILES:
    raise pytest.UsageError(f"VIDSPARSE_FUZZ must be one of {sorted(PROFILES)}, got {PROFILE!r}")

for _name in PROFILES:
    settings.register_profile(
        f"vidsparse-{_name}",
        deadline=None,  # interpreter cases take seconds
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
        # Failing cases are replayed first next time; kept where git ignores them.
        database=DirectoryBasedExampleDatabase(
            Path(__file__).resolve().parents[2] / ".pytest_cache" / "hypothesis"
        ),
    )
settings.load_profile(f"vidsparse-{PROFILE}")

CASES = {"count": 0}


def examples(n: int, *, shrink: bool = True):
    """``@settings`` giving a test ``n`` cases in the ci profile, ``40 n`` in the long one.
    ``shrink=False``: a failure is reported as drawn (where each case compiles kernels of its
    own, shrinking it would take many minutes)."""
    phases = None if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=n * PROFILES[PROFILE], **({"phases": phases} if phases else {}))


def count_case() -> None:
    CASES["count"] += 1


@contextlib.contextmanager
def backend(name: str):
    """``VIDSPARSE_BACKEND=name`` for one case (hypothesis runs many cases per test, so the
    function-scoped fixtures of tests/conftest.py do not fit)."""
    old = os.environ.get("VIDSPARSE_BACKEND")
    os.environ["VIDSPARSE_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VIDSPARSE_BACKEND", None)
        else:
            os.environ["VIDSPARSE_BACKEND"] = old


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def block_lists(draw, bi: int, h: int, nq: int, nk: int, *, max_k: int | None = None):
    """Valid lists ``[bi, h, nq, K]``: distinct entries in ``[0, nk)``, any count in
    ``[0, K]`` per row (empty rows too), and garbage (anything) past each row's count."""
    k = draw(st.integers(0, nk if max_k is None else min(max_k, nk)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = generator(seed)
    counts = torch.randint(0, k + 1, (bi, h, nq), generator=g, dtype=torch.int32)
    order = torch.rand(bi, h, nq, nk, generator=g).argsort(-1)[..., :k].to(torch.int32)
    garbage = torch.randint(-(2**31), 2**31 - 1, (bi, h, nq, k), generator=g, dtype=torch.int32)
    live = torch.arange(k) < counts[..., None]
    return torch.where(live, order, garbage).contiguous(), counts


def check_against_dense(out, lse, q, k, v, idx, cnt, bq, bk, sizes, scale):
    """o and lse of a call against the fp64 dense attention of the same lists (relative
    error of o; rows that attend to nothing: o = 0, lse = -inf)."""
    ref, ref_lse = masked_dense_attention(q, k, v, idx, cnt, bq, bk, sizes, scale)
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert ref.norm() == 0 or err <= tol, float(err)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)  # rows that attend to nothing: -inf
    assert (out.double()[empty] == 0).all()  # ... and o = 0
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], rtol=LSE_TOL, atol=LSE_TOL)


def check_gradients(grads, q, k, v, idx, cnt, bq, bk, sizes, scale):
    """``grads`` (of ``out.sum()``, fp32 inputs) against the fp64 reference, element by
    element: within 4x the max error of the same algorithm in fp32 PyTorch
    (``flash_gradients_fp32``) plus the rounding of ``p`` from a base-2 exponent of ``|s|``
    (16 fp32 epsilons of the largest ``|s|``) times the element's sum of absolute terms. A
    fixed tolerance fails on large logits (scale 3, inputs 4x), where ``dp - delta`` cancels."""
    ref, _ = masked_dense_attention(q, k, v, idx, cnt, bq, bk, sizes, scale)
    refs = torch.autograd.grad(ref.sum(), (q, k, v))
    lists = (idx, cnt, bq, bk, sizes, scale)
    base = flash_gradients_fp32(q, k, v, torch.ones_like(q), *lists)
    terms = gradient_term_magnitudes(q, k, v, torch.ones_like(q), *lists)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q.detach().double() @ k.detach().double().transpose(-1, -2)).abs().max()
    ulps = 16 * torch.finfo(torch.float32).eps * (1 + float(logits) * scale * math.log2(math.e))
    for name, g, r, b, t in zip("qkv", grads, refs, base, terms):
        err = (g.double() - r).abs()
        bound = 4 * (b.double() - r).abs().max() + ulps * t
        worst = int((err - bound).argmax())
        e, limit = float(err.flatten()[worst]), float(bound.flatten()[worst])
        assert (err <= bound).all(), f"d{name}: error {e:.3e} > {limit:.3e} at {worst}"
