"""bfloat16 on the Triton interpreter: refused before any launch, on every op, where the
interpreter does not compute it.

Triton's interpreter keeps bf16 as raw bits and its ``tl.dot`` multiplies those, so a kernel
run returns values off by ~1e10 without an error of its own. The ops probe the interpreter
(``ops.block_sparse_attn.interpreter``) and say so instead; float16 on the same path, bf16 on
the torch backend, and bf16 on an interpreter whose ``tl.dot`` computes (the tests' shim)
compute.
"""

from __future__ import annotations

import pytest
import torch

import vidsparse
from helpers import forbid_calls, masked_dense_attention
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.ops.block_sparse_attn import fwd as fwd_module
from vidsparse.testing import rel_l2

GRID = vidsparse.VideoGrid((4, 8, 8))  # 256 tokens, 4 tiles of 64
STRIPE_GRID = vidsparse.VideoGrid((4, 8, 8), tile=(1, 4, 4))


def _engine(q):
    idx, cnt = random_block_lists(1, q.shape[1], 4, 4, density=0.5)
    return vidsparse.block_sparse_attn(q, q, q, idx, cnt, block_size=64)


CALLS = {
    "block_sparse_attn": _engine,
    "video_sparse_attn": lambda q: vidsparse.video_sparse_attn(q, q, q, GRID, topk=2),
    "stripe_attn": lambda q: vidsparse.stripe_attn(
        q, q, q, STRIPE_GRID, [vidsparse.StripeSpec(1, 0, None, 1, 0, None)] * 2
    ),
    "sliding_tile_attn": lambda q: vidsparse.sliding_tile_attn(q, q, q, GRID, window=(1, 1, 1)),
}


def _q(dtype):
    return torch.randn(1, 2, GRID.num_tokens, 16).to(dtype)


pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's bf16")


@pytest.mark.parametrize("op", CALLS)
def test_bf16_refused_on_the_interpreter_before_any_launch(triton_backend, monkeypatch, op):
    forbid_calls(monkeypatch, fwd_module, "block_sparse_attn_fwd")
    with pytest.raises(TypeError, match="interpreter .* does not compute bfloat16"):
        CALLS[op](_q(torch.bfloat16))


@pytest.mark.parametrize("op", CALLS)
def test_bf16_computes_on_the_torch_backend(torch_backend, op):
    o = CALLS[op](_q(torch.bfloat16))
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()


def test_fp16_computes_on_the_interpreter(triton_backend):
    q = _q(torch.float16)
    idx, cnt = random_block_lists(1, 2, 4, 4, density=0.5)
    o = vidsparse.block_sparse_attn(q, q, q, idx, cnt, block_size=64)
    ref, _ = masked_dense_attention(q, q, q, idx, cnt, 64, 64)
    assert rel_l2(o, ref) < 5e-3


def test_bf16_computes_where_the_interpreter_does(triton_backend, exact_bf16_interpreter):
    """The probe runs again for a patched interpreter: bf16 goes through, and is right."""
    q = _q(torch.bfloat16)
    idx, cnt = random_block_lists(1, 2, 4, 4, density=0.5)
    o = vidsparse.block_sparse_attn(q, q, q, idx, cnt, block_size=64)
    ref, _ = masked_dense_attention(q, q, q, idx, cnt, 64, 64)
    assert rel_l2(o, ref) < 2e-2
