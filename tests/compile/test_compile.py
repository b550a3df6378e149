"""``torch.compile(fullgraph=True)`` of the video ops: one graph, no break, same results.

``stripe_attn`` and ``video_sparse_attn`` build their block lists and tile indices from Python
values (grid, specs, text length, device) on the host: Dynamo runs those builders at trace time
(marked as ``torch.compiler.assume_constant_result`` marks) and their tensors enter the graph as
constants, so the graph holds only tensor ops and the engine's custom ops.
``backend="aot_eager"`` traces the backward too, so gradients are compared as well.
"""

from __future__ import annotations

import pytest
import torch

import vidsparse
from vidsparse import VideoGrid
from vidsparse.masks.stripe import StripeSpec
from vidsparse.ops.stripe_attn import interface as stripe_interface

SPECS = (
    StripeSpec(1, 0, None, 2, -1, 3),
    StripeSpec(2, -1, 2, 1, 0, None),
)
OTHER_SPECS = (
    StripeSpec(1, 0, None, 1, 0, None),
    StripeSpec(1, 1, 3, 3, 2, 5),
)
pytestmark = pytest.mark.dynamo  # every test here traces through Dynamo

PARTIAL = VideoGrid((3, 5, 6), (2, 2, 2))  # partial edge tiles: padding keys are masked
FULL = VideoGrid((4, 4, 4), (2, 2, 2))  # every tile full


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(grid, tiled, text_tokens, n=3, heads=2, dim=16):
    seq = (grid.padded_len if tiled else grid.num_tokens) + text_tokens
    return [
        torch.randn(1, heads, seq, dim, dtype=torch.float64, requires_grad=True) for _ in range(n)
    ]


def _assert_same(f, inputs, explain=False):
    """``f`` compiled with fullgraph=True (an error on any graph break) gives eager's output
    and gradients. ``explain``: also count graphs and breaks with ``torch._dynamo.explain``."""
    if explain:
        explained = torch._dynamo.explain(f)(*inputs)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        assert explained.graph_count == 1
        torch._dynamo.reset()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(*inputs), f(*inputs)
    got, want = (
        (got if isinstance(got, tuple) else (got,)),
        (want if isinstance(want, tuple) else (want,)),
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    # Square the output so the gradient depends on it (a plain sum has softmax-invariant terms).
    grads = torch.autograd.grad(got[0].square().sum(), inputs)
    grads_eager = torch.autograd.grad(want[0].square().sum(), inputs)
    for g, w in zip(grads, grads_eager):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- stripe_attn


@pytest.mark.slow
@pytest.mark.parametrize(
    "grid, tiled, text_tokens",
    [
        (PARTIAL, False, 0),
        (PARTIAL, False, 5),
        (PARTIAL, True, 0),
        (PARTIAL, True, 5),
        (FULL, False, 8),  # every key block full: the plan has no kv_block_sizes
        (FULL, True, 0),
    ],
    ids=["natural", "natural-text", "tiled", "tiled-text", "full-natural-text", "full-tiled"],
)
def test_stripe_attn_fullgraph(torch_backend, grid, tiled, text_tokens):
    q, k, v = _qkv(grid, tiled, text_tokens)

    def f(q, k, v):
        return vidsparse.stripe_attn(
            q, k, v, grid, SPECS, tiled=tiled, text_tokens=text_tokens, sink_frames=1,
            return_lse=True,
        )  # fmt: skip

    _assert_same(f, (q, k, v), explain=text_tokens == 5)


def test_stripe_attn_fullgraph_row_unit_and_list_specs(torch_backend):
    q, k, v = _qkv(PARTIAL, False, 3)

    def f(q, k, v):
        return vidsparse.stripe_attn(
            q, k, v, PARTIAL, list(OTHER_SPECS), spatial_unit="row", text_tokens=3, scale=0.3
        )

    _assert_same(f, (q, k, v))


@pytest.mark.slow
def test_stripe_attn_compiled_follows_new_specs(torch_backend):
    """The plan is a graph constant: changing the specs must trace a new graph, not reuse it."""
    q, k, v = _qkv(PARTIAL, False, 5)
    state = {"specs": SPECS}

    def f(q, k, v):
        return vidsparse.stripe_attn(q, k, v, PARTIAL, state["specs"], text_tokens=5)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    outputs = {}
    for specs in (SPECS, OTHER_SPECS, SPECS):
        state["specs"] = specs
        got = compiled(q, k, v)
        torch.testing.assert_close(got, f(q, k, v), rtol=0, atol=1e-12)
        outputs.setdefault(specs, got)
    assert not torch.allclose(outputs[SPECS], outputs[OTHER_SPECS])


@pytest.mark.slow
def test_grid_and_specs_built_inside_the_compiled_function(torch_backend):
    """A grid and specs made in the traced code are no real objects at trace time: only
    their Python values reach the host-side builders. Cold caches: what the trace builds and
    caches are real tensors that eager calls reuse."""
    from vidsparse.layout import grid as grid_module

    stripe_interface.clear_stripe_attn_cache()
    grid_module._tile_index_cached.cache_clear()

    def f(q, k, v):
        grid = VideoGrid((3, 5, 6), (2, 2, 2))
        specs = [StripeSpec(1, 0, None, 2, -1, 3), StripeSpec(2, -1, 2, 1, 0, None)]
        o = vidsparse.stripe_attn(q, k, v, grid, specs, text_tokens=5)
        return o + vidsparse.video_sparse_attn(q, k, v, grid, topk=2, text_tokens=5)

    q, k, v = _qkv(PARTIAL, False, 5)
    _assert_same(f, (q, k, v))
    plan = stripe_interface._engine_plan(SPECS, PARTIAL, "block", 0, 5, torch.device("cpu"))
    assert stripe_interface._engine_plan.cache_info().hits >= 1
    assert all(type(t) is torch.Tensor for t in plan if isinstance(t, torch.Tensor))
    assert all(type(t) is torch.Tensor for t in PARTIAL.index_tensors("cpu"))


@pytest.mark.slow
def test_compiled_follows_new_grid_text_and_sinks(torch_backend):
    """Grid, text length and sink frames key the plan too: each change retraces correctly
    (changed ints must not turn into SymInts, which could not key the cached plan)."""
    state = {}

    def f(q, k, v):
        return vidsparse.stripe_attn(
            q, k, v, state["grid"], SPECS, text_tokens=state["n"], sink_frames=state["sinks"]
        )

    def g(q, k, v):
        return vidsparse.video_sparse_attn(q, k, v, state["grid"], topk=2, text_tokens=state["n"])

    compiled_f = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled_g = torch.compile(g, fullgraph=True, backend="aot_eager")
    configs = [(PARTIAL, 5, 0), (FULL, 8, 1), (PARTIAL, 3, 1)]
    for grid, n, sinks in configs:
        state.update(grid=grid, n=n, sinks=sinks)
        q, k, v = (x.detach() for x in _qkv(grid, False, n))
        torch.testing.assert_close(compiled_f(q, k, v), f(q, k, v), rtol=0, atol=1e-12)
        torch.testing.assert_close(compiled_g(q, k, v), g(q, k, v), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "grid", [PARTIAL, FULL, VideoGrid((2, 4, 4), (1, 2, 3)), VideoGrid((5, 3, 2), (1, 3, 2))]
)
@pytest.mark.parametrize("text_tokens", [0, 1, 8, 12])
def test_all_key_blocks_full_matches_tile_sizes(grid, text_tokens):
    """The host-side check agrees with the tensor one it replaced."""
    plan = stripe_interface._engine_plan(SPECS, grid, "block", 0, text_tokens, torch.device("cpu"))
    ntb = -(-text_tokens // grid.tile_volume)
    sizes = torch.cat([grid.tile_sizes, torch.tensor([grid.tile_volume] * ntb, dtype=torch.int32)])
    if text_tokens % grid.tile_volume:
        sizes[-1] = text_tokens % grid.tile_volume
    all_full = bool((sizes == grid.tile_volume).all())
    assert stripe_interface._all_key_blocks_full(grid, text_tokens) == all_full
    assert (plan.kv_block_sizes is None) == all_full
    if not all_full:
        torch.testing.assert_close(plan.kv_block_sizes, sizes)


# ----------------------------------------------------------------------------- VSA


@pytest.mark.slow
@pytest.mark.parametrize(
    "tiled, text_tokens, gated",
    [(False, 0, False), (False, 5, True), (True, 5, False), (True, 0, True)],
    ids=["natural", "natural-text-gate", "tiled-text", "tiled-gate"],
)
def test_video_sparse_attn_fullgraph_torch(torch_backend, tiled, text_tokens, gated):
    q, k, v, gate = _qkv(PARTIAL, tiled, text_tokens, n=4)

    def f(q, k, v, gate):
        return vidsparse.video_sparse_attn(
            q, k, v, PARTIAL, topk=3, tiled=tiled, text_tokens=text_tokens,
            gate=gate if gated else None,
        )  # fmt: skip

    inputs = (q, k, v, gate) if gated else (q, k, v)
    _assert_same(f if gated else (lambda q, k, v: f(q, k, v, None)), inputs, explain=True)


def _need_triton_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("runs the Triton interpreter on CPU tensors")
    from vidsparse.utils.backend import triton_interpret_enabled

    if not triton_interpret_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on CPU machines)")


@pytest.mark.slow
def test_stripe_attn_fullgraph_triton_interpreter(triton_backend):
    _need_triton_interpreter()
    grid = VideoGrid((4, 4, 6), (2, 2, 4))  # volume 16, partial tiles along W
    q, k, v = (torch.randn(1, 2, grid.num_tokens + 5, 16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return vidsparse.stripe_attn(q, k, v, grid, SPECS, text_tokens=5)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    grads_eager = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, w in zip(grads, grads_eager):
        torch.testing.assert_close(g, w)


@pytest.mark.slow
@pytest.mark.parametrize("text_tokens", [0, 5])
def test_video_sparse_attn_fullgraph_triton_interpreter(triton_backend, text_tokens):
    """The Triton path (coarse-stage and engine custom ops, the cached text plan)."""
    _need_triton_interpreter()
    grid = VideoGrid((4, 4, 6), (2, 2, 4))  # volume 16, partial tiles along W
    seq = grid.num_tokens + text_tokens
    q, k, v, gate = (torch.randn(1, 2, seq, 16, requires_grad=True) for _ in range(4))

    def f(q, k, v, gate):
        return vidsparse.video_sparse_attn(
            q, k, v, grid, topk=2, text_tokens=text_tokens, gate=gate
        )

    explained = torch._dynamo.explain(f)(q, k, v, gate)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, gate), f(q, k, v, gate)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, gate))
    grads_eager = torch.autograd.grad(want.square().sum(), (q, k, v, gate))
    for g, w in zip(grads, grads_eager):
        torch.testing.assert_close(g, w)


@pytest.mark.slow
@pytest.mark.parametrize("regather", [False, True])
def test_video_sparse_attn_gate_projection_fullgraph_triton_interpreter(triton_backend,
                                                                         regather):  # fmt: skip
    """A ``GateProjection`` (its tensors the engine's epilogue slots, its gradients the
    backward op's) compiles without a graph break and gives the eager values and gradients;
    so does the backward that gathers the tile copies again (``configs.override(regather=)``)."""
    from vidsparse.ops.block_sparse_attn import configs

    _need_triton_interpreter()
    with configs.override(regather=regather):
        _check_gate_projection_compiles()


def _check_gate_projection_compiles():
    grid = VideoGrid((4, 4, 6), (2, 2, 4))
    q, k, v = (torch.randn(1, 2, grid.num_tokens, 16, requires_grad=True) for _ in range(3))
    x = torch.randn(1, grid.num_tokens, 12, requires_grad=True)
    weight, bias = torch.randn(32, 12, requires_grad=True), torch.randn(32, requires_grad=True)
    leaves = (q, k, v, x, weight, bias)

    def f(q, k, v, x, weight, bias):
        gate = vidsparse.GateProjection(x, weight, bias)
        return vidsparse.video_sparse_attn(q, k, v, grid, topk=2, gate=gate)

    explained = torch._dynamo.explain(f)(*leaves)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(*leaves), f(*leaves)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), leaves)
    grads_eager = torch.autograd.grad(want.square().sum(), leaves)
    for g, w in zip(grads, grads_eager):
        torch.testing.assert_close(g, w)


# ----------------------------------------------------------------------------- VideoGrid


def test_host_constant_marks_like_torch():
    """``host_constant`` sets what ``torch.compiler.assume_constant_result`` sets (it avoids
    importing torch._dynamo, and Triton with it, when vidsparse is imported)."""
    from vidsparse.utils.dynamo import host_constant

    def ours():
        return 0

    def theirs():
        return 0

    assert vars(host_constant(ours)) == vars(torch.compiler.assume_constant_result(theirs))
    assert vars(ours)


def test_grid_tile_untile_fullgraph():
    """The tile indices are graph constants: no trace of their (bincount) build."""
    grid = PARTIAL
    x = torch.randn(2, grid.num_tokens, 3, requires_grad=True)

    def f(x):
        tiled = grid.tile(x, dim=1) * grid.real_token_mask(x.device).view(-1, 1)
        return grid.untile(tiled + grid.tile_sizes_on(x.device).sum(), dim=1)

    _assert_same(f, (x,), explain=True)
