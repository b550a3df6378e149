"""``vidsparse.testing.grad_errors``: relative errors per parameter, near-zero references
floored, a missing gradient infinite."""

from __future__ import annotations

import math

import pytest
import torch

from vidsparse.testing import grad_errors


def test_grad_errors_per_parameter():
    g = torch.Generator().manual_seed(0)
    ref = {"big": torch.randn(100, generator=g), "tiny": torch.full((100,), 1e-9)}
    noise = torch.randn(100, generator=g)
    grads = {"big": ref["big"] + 0.01 * noise, "tiny": ref["tiny"] + 1e-6}
    errors = grad_errors(grads, ref)
    assert errors["big"] == pytest.approx(0.01 * noise.norm().item() / ref["big"].norm().item())
    # "tiny" is measured against 1e-3 of the largest norm, not its own (1e-8): 1e-5 / 1e-2.
    floor = 1e-3 * ref["big"].double().norm().item()
    assert errors["tiny"] == pytest.approx(1e-6 * 10 / floor, rel=1e-4)
    assert math.isinf(grad_errors({"big": ref["big"]}, ref)["tiny"])
    assert grad_errors(ref, ref) == {"big": 0.0, "tiny": 0.0}
