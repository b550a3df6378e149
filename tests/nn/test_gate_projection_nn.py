"""The modules hand VSA their gate as a ``GateProjection`` where its product is the value their
own forward gives, and as a tensor where it is not (another dtype, a hooked or offloaded
module)."""

from __future__ import annotations

import pytest
import torch

from vidsparse import GateProjection
from vidsparse.layout.grid import VideoGrid
from vidsparse.nn import VideoSparseAttention, VSAGate
from vidsparse.nn.vsa import linear_projection

GRID = VideoGrid((3, 5, 6), tile=(2, 2, 2))
B, H, D, DIM = 2, 3, 8, 20


def _gate(dtype=torch.float32) -> VSAGate:
    gate = VSAGate(DIM, H, D, dtype=dtype)
    with torch.no_grad():
        gate.weight.normal_()
        gate.bias.normal_()
    return gate


def _product(projection: GateProjection) -> torch.Tensor:
    x, weight, bias = projection
    return torch.nn.functional.linear(x, weight, bias)


@pytest.mark.parametrize("autocast", [False, True])
def test_projection_forms_the_modules_own_gate(autocast):
    gate, x = _gate(), torch.randn(B, GRID.num_tokens, DIM)
    dtype = torch.bfloat16 if autocast else torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        projection = gate.projection(x, dtype)
        want = gate(x).to(dtype)
    assert all(t.dtype == dtype for t in projection.tensors())
    assert torch.equal(_product(projection), want)


def test_no_projection_where_the_gate_is_formed_in_another_dtype():
    gate, x = _gate(), torch.randn(B, GRID.num_tokens, DIM)
    assert gate.projection(x, torch.bfloat16) is None  # fp32 product, then a cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gate.projection(x, torch.float32) is None
        assert gate.projection(x.double(), torch.bfloat16) is None  # autocast leaves fp64


def test_no_projection_for_a_hooked_or_unmaterialised_module():
    """Offloading and layerwise casting act when the module is called: it must be called."""
    x = torch.randn(B, GRID.num_tokens, DIM)
    hooked = _gate()
    hooked.register_forward_pre_hook(lambda module, args: None)
    assert hooked.projection(x, torch.float32) is None
    wrapped = _gate()
    wrapped.forward = lambda hidden_states: VSAGate.forward(wrapped, hidden_states)
    assert wrapped.projection(x, torch.float32) is None
    meta = VSAGate(DIM, H, D, device="meta")
    assert meta.projection(x, torch.float32) is None


def test_module_hands_the_op_a_projection(monkeypatch, torch_backend):
    """``VideoSparseAttention`` passes its gate as a projection (no gate kept for the
    backward) and as a tensor when its projection is hooked; the same output either way."""
    import vidsparse.nn.vsa as vsa_module

    seen, original = [], vsa_module.video_sparse_attn

    def recorded(*args, gate, **kwargs):
        seen.append(gate)
        return original(*args, gate=gate, **kwargs)

    monkeypatch.setattr(vsa_module, "video_sparse_attn", recorded)
    module = VideoSparseAttention(DIM, H, D)
    with torch.no_grad():
        module.gate_proj.weight.normal_()
    q, k, v = (torch.randn(B, H, GRID.num_tokens, D) for _ in range(3))
    x = torch.randn(B, GRID.num_tokens, DIM)
    o = module(q, k, v, GRID, hidden_states=x, sparsity=0.5)
    module.gate_proj.register_forward_hook(lambda *args: None)
    o_hooked = module(q, k, v, GRID, hidden_states=x, sparsity=0.5)
    assert isinstance(seen[0], GateProjection) and isinstance(seen[1], torch.Tensor)
    assert torch.equal(o, o_hooked)


def test_linear_projection_moves_parameters_to_the_input():
    linear = torch.nn.Linear(DIM, H * D).double()
    x = torch.randn(B, GRID.num_tokens, DIM)
    projection = linear_projection(linear, x, torch.float32)
    assert projection.weight.dtype == projection.bias.dtype == torch.float32
