"""``vidsparse.nn``: the VSA module (gate, sparsity) and the sparsity schedule, on the CPU."""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vidsparse.layout.grid import VideoGrid
from vidsparse.nn import SparsitySchedule, VideoSparseAttention
from vidsparse.ops.video_sparse_attn import video_sparse_attn, video_sparse_attn_ref
from vidsparse.testing import assert_rel_l2

GRID = VideoGrid((3, 5, 6), tile=(2, 2, 2))  # partial tiles along every axis: 2x3x3 = 18 tiles
B, H, D, DIM = 2, 3, 8, 20
FP64_BOUND = 1e-12


def _qkv(dtype=torch.float64, requires_grad=False, S=GRID.num_tokens):
    return [torch.randn(B, H, S, D, dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


def _hidden(dtype=torch.float64, S=GRID.num_tokens):
    return torch.randn(B, S, DIM, dtype=dtype)


def _module(**kwargs):
    return VideoSparseAttention(DIM, H, D, dtype=torch.float64, **kwargs)


def _randomise_gate(module):
    with torch.no_grad():
        module.gate_proj.weight.normal_()
        module.gate_proj.bias.normal_()


# ---- VideoSparseAttention ------------------------------------------------------------------------


def test_gate_projection_starts_at_zero():
    module = _module()
    assert module.gate_proj.weight.shape == (H * D, DIM)
    assert torch.count_nonzero(module.gate_proj.weight) == 0
    assert torch.count_nonzero(module.gate_proj.bias) == 0
    assert module.sparsity == 0.0


@pytest.mark.parametrize("pass_hidden", [True, False])
def test_zero_init_equals_fine_stage_only(torch_backend, pass_hidden):
    q, k, v = _qkv()
    module = _module(sparsity=0.5)
    hidden = _hidden() if pass_hidden else None
    o = module(q, k, v, GRID, hidden_states=hidden)
    _, parts = video_sparse_attn_ref(q, k, v, GRID, sparsity=0.5, return_parts=True)
    assert_rel_l2("o", o, parts["o_fine"], FP64_BOUND)
    # and the coarse branch is not negligible, so the comparison means something
    assert parts["o_coarse"].abs().max() > 1e-3


def test_dense_at_sparsity_zero_equals_sdpa(torch_backend):
    q, k, v = _qkv()
    o = _module()(q, k, v, GRID, hidden_states=_hidden())
    assert_rel_l2("o", o, F.scaled_dot_product_attention(q, k, v), FP64_BOUND)


def test_gate_matches_functional_op(torch_backend):
    """A non-zero gate is gate_proj(hidden) laid out as [B, H, S, D], fed to the op."""
    q, k, v = _qkv()
    hidden = _hidden()
    module = _module(sparsity=0.6)
    _randomise_gate(module)
    o = module(q, k, v, GRID, hidden_states=hidden)
    weight = module.gate_proj.weight.view(H, D, DIM)
    bias = module.gate_proj.bias.view(H, 1, D)
    gate = torch.einsum("bsc,hdc->bhsd", hidden, weight) + bias  # [B, H, S, D]
    expected = video_sparse_attn(q, k, v, GRID, sparsity=0.6, gate=gate)
    assert_rel_l2("o", o, expected, FP64_BOUND)


def test_tiled_matches_natural_order(torch_backend):
    q, k, v = _qkv()
    hidden = _hidden()
    module = _module(sparsity=0.5)
    _randomise_gate(module)
    o = module(q, k, v, GRID, hidden_states=hidden)
    tile = GRID.tile
    o_tiled = module(tile(q), tile(k), tile(v), GRID, hidden_states=tile(hidden, dim=1), tiled=True)
    assert_rel_l2("o", GRID.untile(o_tiled), o, FP64_BOUND)


def test_gradient_reaches_gate_projection(torch_backend):
    q, k, v = _qkv(requires_grad=True)
    hidden = _hidden()
    module = _module(sparsity=0.5)
    o = module(q, k, v, GRID, hidden_states=hidden)
    o.square().sum().backward()
    assert module.gate_proj.weight.grad.abs().max() > 0
    assert module.gate_proj.bias.grad.abs().max() > 0
    assert all(x.grad is not None and x.grad.abs().max() > 0 for x in (q, k, v))

    with torch.no_grad():  # one SGD step moves the output away from fine-only
        for p in module.parameters():
            p -= 0.1 * p.grad
        o_after = module(q, k, v, GRID, hidden_states=hidden)
    assert (o_after - o).abs().max() > 1e-6


def test_sparsity_attribute_and_per_call_override(torch_backend):
    q, k, v = _qkv()
    hidden = _hidden()
    module = _module()
    _randomise_gate(module)
    module.sparsity = 0.75
    via_attribute = module(q, k, v, GRID, hidden_states=hidden)
    via_override = _module_like(module)(q, k, v, GRID, hidden_states=hidden, sparsity=0.75)
    dense = module(q, k, v, GRID, hidden_states=hidden, sparsity=0.0)
    assert_rel_l2("o", via_attribute, via_override, FP64_BOUND)
    assert (via_attribute - dense).abs().max() > 1e-6
    assert module.sparsity == 0.75  # the override does not stick


def _module_like(module):
    copy = _module()
    copy.load_state_dict(module.state_dict())
    return copy


def test_state_dict_round_trip(torch_backend):
    module = _module()
    _randomise_gate(module)
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    assert set(state) == {"gate_proj.weight", "gate_proj.bias"}
    restored = _module()
    restored.load_state_dict(state)
    torch.testing.assert_close(restored.gate_proj.weight, module.gate_proj.weight)
    torch.testing.assert_close(restored.gate_proj.bias, module.gate_proj.bias)
    q, k, v = _qkv()
    hidden = _hidden()
    torch.testing.assert_close(
        restored(q, k, v, GRID, hidden_states=hidden, sparsity=0.5),
        module(q, k, v, GRID, hidden_states=hidden, sparsity=0.5),
    )


def test_low_precision_gate_is_cast_to_q_dtype(torch_backend):
    q, k, v = _qkv(dtype=torch.bfloat16)
    module = VideoSparseAttention(DIM, H, D)  # fp32 gate projection
    _randomise_gate(module)
    o = module(q, k, v, GRID, hidden_states=_hidden(torch.float32), sparsity=0.5)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")
def test_triton_interpreter_path(triton_backend):
    """The Triton path (interpreter) takes the module's gates: the zero view and a projection."""
    grid = VideoGrid((4, 4, 8))  # 4x4x4 tiles, head_dim 64: what the Triton kernels support
    q, k, v = (torch.randn(1, 2, grid.num_tokens, 64) for _ in range(3))
    module = VideoSparseAttention(DIM, 2, 64)
    hidden = torch.randn(1, grid.num_tokens, DIM)
    _, parts = video_sparse_attn_ref(q, k, v, grid, sparsity=0.5, return_parts=True)
    for hidden_states in (None, hidden):
        o = module(q, k, v, grid, hidden_states=hidden_states, sparsity=0.5)
        assert_rel_l2("o", o, parts["o_fine"], 1e-5)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"dim": 0}, ValueError),
        ({"heads": 2.0}, TypeError),
        ({"head_dim": -1}, ValueError),
        ({"sparsity": 1.0}, ValueError),
        ({"sparsity": -0.1}, ValueError),
        ({"sparsity": "0.5"}, TypeError),
    ],
)
def test_module_bad_arguments(kwargs, error):
    args = {"dim": DIM, "heads": H, "head_dim": D, **kwargs}
    with pytest.raises(error, match=next(iter(kwargs))):
        VideoSparseAttention(**args)


def test_module_bad_inputs(torch_backend):
    module = _module()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sparsity"):
        module.sparsity = 1.5
    with pytest.raises(ValueError, match="sparsity"):
        module(q, k, v, GRID, sparsity=1.0)
    with pytest.raises(ValueError, match="heads=3"):
        module(q[:, :2], k[:, :2], v[:, :2], GRID)
    with pytest.raises(ValueError, match="hidden_states"):
        module(q, k, v, GRID, hidden_states=torch.randn(B, GRID.num_tokens, DIM + 1))
    with pytest.raises(ValueError, match="hidden_states"):
        module(q, k, v, GRID, hidden_states=torch.randn(B, GRID.num_tokens - 1, DIM))
    with pytest.raises(TypeError, match="hidden_states"):
        module(q, k, v, GRID, hidden_states="x")


# ---- SparsitySchedule ----------------------------------------------------------------------------


def test_schedule_values():
    schedule = SparsitySchedule(target=0.8, warmup_steps=100, ramp_steps=400, num_levels=4)
    expected = {
        0: 0.0,
        99: 0.0,
        100: 0.2,
        199: 0.2,
        200: 0.4,
        299: 0.4,
        300: 0.6,
        399: 0.6,
        400: 0.8,
        499: 0.8,
        500: 0.8,
        10**6: 0.8,
    }
    for step, value in expected.items():
        assert schedule(step) == pytest.approx(value), step
    values = [schedule(s) for s in range(600)]
    assert values == sorted(values)  # never decreases
    assert max(values) == pytest.approx(0.8)


def test_schedule_uneven_ramp_and_jump():
    uneven = SparsitySchedule(target=0.9, warmup_steps=0, ramp_steps=10, num_levels=3)
    assert [round(uneven(s) / 0.3) for s in range(12)] == [1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3]
    jump = SparsitySchedule(target=0.875, warmup_steps=5)
    assert [jump(s) for s in (0, 4, 5, 100)] == [0.0, 0.0, 0.875, 0.875]
    assert SparsitySchedule(target=0.5)(0) == 0.5  # no warmup, no ramp: the target at once


@pytest.mark.parametrize("target", [0.0, 0.5, 0.875])
@pytest.mark.parametrize("warmup, ramp", [(0, 0), (0, 7), (3, 0), (5, 12), (2, 400)])
@pytest.mark.parametrize("levels", [1, 3, 4, 13])
def test_schedule_target_step_is_the_first_step_at_the_target(target, warmup, ramp, levels):
    schedule = SparsitySchedule(target, warmup_steps=warmup, ramp_steps=ramp, num_levels=levels)
    values = [schedule(step) for step in range(warmup + ramp + 5)]
    first = next(step for step, value in enumerate(values) if value == target)
    assert schedule.target_step == first
    assert all(value == target for value in values[first:])


def test_schedule_apply_sets_every_module():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = VideoSparseAttention(DIM, H, D)
            self.mlp = nn.Linear(DIM, DIM)

    model = nn.Sequential(Block(), Block(), nn.ModuleList([Block()]))
    schedule = SparsitySchedule(target=0.875, warmup_steps=10, ramp_steps=20, num_levels=2)
    attns = [m for m in model.modules() if isinstance(m, VideoSparseAttention)]
    assert len(attns) == 3
    assert schedule.apply(model, 0) == 0.0
    assert all(m.sparsity == 0.0 for m in attns)
    assert schedule.apply(model, 15) == pytest.approx(0.4375)
    assert all(m.sparsity == pytest.approx(0.4375) for m in attns)
    assert schedule.apply(model, 30) == 0.875
    assert all(m.sparsity == 0.875 for m in attns)
    assert schedule.apply(attns[0], 0) == 0.0  # a module on its own works too
    with pytest.raises(ValueError, match="no VideoSparseAttention"):
        schedule.apply(nn.Linear(2, 2), 0)


def test_schedule_state_dict_round_trip():
    schedule = SparsitySchedule(target=0.9, warmup_steps=7, ramp_steps=30, num_levels=3)
    state = schedule.state_dict()
    assert state == {"target": 0.9, "warmup_steps": 7, "ramp_steps": 30, "num_levels": 3}
    restored = SparsitySchedule(target=0.1)
    restored.load_state_dict(state)
    assert restored == schedule
    with pytest.raises(ValueError, match="unknown"):
        restored.load_state_dict({**state, "decay": 1})
    with pytest.raises(ValueError, match="target"):
        restored.load_state_dict({**state, "target": 1.0})
    assert restored == schedule  # a rejected state leaves the schedule unchanged


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"target": 1.0}, ValueError, "target"),
        ({"target": -0.5}, ValueError, "target"),
        ({"target": None}, TypeError, "target"),
        ({"target": True}, TypeError, "target"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"warmup_steps": 1.5}, TypeError, "warmup_steps"),
        ({"ramp_steps": -3}, ValueError, "ramp_steps"),
        ({"num_levels": 0}, ValueError, "num_levels"),
        ({"num_levels": "2"}, TypeError, "num_levels"),
    ],
)
def test_schedule_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SparsitySchedule(**{"target": 0.5, **kwargs})


@pytest.mark.parametrize("step, error", [(-1, ValueError), (2.0, TypeError), (None, TypeError)])
def test_schedule_bad_step(step, error):
    with pytest.raises(error, match="step"):
        SparsitySchedule(target=0.5, warmup_steps=1)(step)
