"""``block_sparse_attn(..., deterministic=False)``: the argument's checks, and where the one-pass
backward does not apply (every backend but Hopper at 128x128; the CPU here) the deterministic
backward's gradients, bit for bit, with the reason logged once. The one-pass kernel itself
is tested on the GPU (``test_gluon_bwd.py``)."""

from __future__ import annotations

import logging

import pytest
import torch

import vidsparse
from helpers import make_lists, make_qkv, masked_dense_attention
from vidsparse.ops.block_sparse_attn import bwd


def _grads(q, k, v, do, idx, cnt, bs, sizes, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = vidsparse.block_sparse_attn(*leaves, idx, cnt, block_size=bs, kv_block_sizes=sizes, **kw)
    return torch.autograd.grad(o, leaves, do)


def _problem(dtype, device, bs=16):
    B, H, S, D = 1, 2, 4 * bs, 16
    q, k, v = make_qkv(B, H, S, S, D, dtype=dtype, device=device)
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.5, device=device, empty_rows=1)
    sizes = torch.randint(1, bs + 1, (S // bs,), dtype=torch.int32, device=device)
    return q, k, v, torch.randn_like(q), idx, cnt, bs, sizes


@pytest.mark.parametrize("bad", [None, 0, "no"])
def test_deterministic_must_be_a_bool(bad):
    q, k, v, _, idx, cnt, bs, sizes = _problem(torch.float32, "cpu")
    with pytest.raises(TypeError, match="deterministic"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=bs, deterministic=bad)


def test_torch_backend_gives_the_same_bits_either_way(torch_backend):
    problem = _problem(torch.float64, "cpu")
    exact = _grads(*problem)
    assert all(torch.equal(a, b) for a, b in zip(exact, _grads(*problem, deterministic=False)))
    q, k, v, do, idx, cnt, bs, sizes = problem
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref, _ = masked_dense_attention(*leaves, idx, cnt, bs, bs, sizes)
    for name, g, r in zip("qkv", exact, torch.autograd.grad(ref, leaves, do)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=f"d{name}")


def test_triton_backend_without_the_one_pass_runs_the_deterministic_backward_and_says_so(
    triton_backend, device, caplog
):
    """Off Hopper's Gluon kernels (the interpreter; 16-token blocks) ``deterministic=False``
    takes the deterministic backward: the same bits as the default, the reason logged once."""
    bwd._note_deterministic_backward.cache_clear()
    problem = _problem(torch.float32, device)
    exact = _grads(*problem)
    with caplog.at_level(logging.INFO, logger="vidsparse"):
        for _ in range(2):
            fast = _grads(*problem, deterministic=False)
            assert all(torch.equal(a, b) for a, b in zip(exact, fast))
    notes = [r.getMessage() for r in caplog.records if "deterministic=False" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "128-token blocks" in notes[0] and "deterministic backward runs" in notes[0]


def test_the_one_pass_mode_follows_deterministic_and_the_override():
    """``_one_pass_mode`` on a call where the one pass applies: the configured deterministic
    mode by default (None, the two kernels, or an order-free one: fixed point), the configured
    mode with ``deterministic=False``, the override's mode either way (``ONE_PASS_OFF``:
    none)."""
    from vidsparse.ops.block_sparse_attn import configs
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE

    def mode(deterministic):
        return bwd._one_pass_mode(deterministic, True, 128, NO_EPILOGUE, None)

    assert mode(True) == configs.DETERMINISTIC_ONE_PASS
    assert mode(True) is None or configs.ONE_PASS_MODES[mode(True)].fixed  # the same bits
    with configs.override(one_pass="fixed"):
        assert mode(True) == mode(False) == "fixed"
    assert mode(False) == configs.NONDETERMINISTIC_ONE_PASS
    with configs.override(one_pass="ordered_tma"):
        assert mode(True) == mode(False) == "ordered_tma"
    with configs.override(one_pass=configs.ONE_PASS_OFF):
        assert mode(True) is None and mode(False) is None
    assert bwd._one_pass_mode(False, False, 128, NO_EPILOGUE, None) is None
    assert bwd._one_pass_mode(False, True, 64, NO_EPILOGUE, None) is None


def test_an_override_that_does_not_apply_is_not_noted_as_the_callers_choice(caplog):
    """The note speaks of ``deterministic=False``: a tuning override's mode that does not
    apply (here: no Gluon kernels) falls back silently for a deterministic caller."""
    from vidsparse.ops.block_sparse_attn import configs
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE

    bwd._note_deterministic_backward.cache_clear()
    with caplog.at_level(logging.INFO, logger="vidsparse"), configs.override(one_pass="tma"):
        assert bwd._one_pass_mode(True, False, 128, NO_EPILOGUE, None) is None
        assert not [r for r in caplog.records if "deterministic=False" in r.getMessage()]
        assert bwd._one_pass_mode(False, False, 128, NO_EPILOGUE, None) is None
    notes = [r for r in caplog.records if "deterministic=False" in r.getMessage()]
    assert len(notes) == 1 and "Gluon" in notes[0].getMessage()
