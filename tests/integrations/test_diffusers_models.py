"""Every covered diffusers video transformer, on tiny random-weight configs (CPU): the routing
changes nothing under "dense" (bit for bit, under two attention backends), VSA at sparsity 0 and
PSA with dense specs equal dense within fp32 rounding, and removal restores the stock model."""

import copy
import dataclasses
import importlib

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from diffusers.models.attention_dispatch import attention_backend  # noqa: E402
from tiny_models import TINY_MODELS, first_output  # noqa: E402

from vidsparse.integrations.diffusers import (  # noqa: E402
    SUPPORTED_MODELS,
    apply_sparse_attention,
    dispatch,  # noqa: E402
    remove_sparse_attention,
)
from vidsparse.masks.stripe import StripeSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_backend")
ATOL = 2e-5  # fp32 rounding of a different (exact) attention computation
BACKENDS = ("native", "_native_math")


@torch.no_grad()
def run(model, inputs) -> torch.Tensor:
    return first_output(model(**inputs, return_dict=False))


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(request):
    model, inputs = TINY_MODELS[request.param]()
    return model.eval(), inputs


@pytest.fixture
def patched(tiny):
    model, inputs = tiny

    def apply(method, **options):
        apply_sparse_attention(model, method, **options)
        return model

    yield apply
    if getattr(model, "_vidsparse_state", None) is not None:
        remove_sparse_attention(model)


def test_every_tiny_model_is_a_supported_class():
    names = {type(TINY_MODELS[name]()[0]).__name__ for name in TINY_MODELS}
    assert names == set(SUPPORTED_MODELS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_is_bitwise_stock(tiny, patched, backend):
    model, inputs = tiny
    with attention_backend(backend):
        stock = run(model, inputs)
        patched("dense")
        out = run(model, inputs)
    assert torch.equal(out, stock)


@pytest.mark.parametrize("gate", [False, True])
def test_vsa_at_sparsity_zero_equals_dense(tiny, patched, gate):
    model, inputs = tiny
    stock = run(model, inputs)
    out = run(patched("vsa", sparsity=0.0, gate=gate), inputs)
    torch.testing.assert_close(out, stock, atol=ATOL, rtol=0)


def test_psa_with_dense_specs_equals_dense(tiny, patched):
    model, inputs = tiny
    stock = run(model, inputs)
    out = run(patched("psa", specs=[StripeSpec.dense()] * _heads(model)), inputs)
    torch.testing.assert_close(out, stock, atol=ATOL, rtol=0)


def _heads(model) -> int:
    from vidsparse.integrations.diffusers.models import attention_dims, spec_for

    return attention_dims(spec_for(model).self_attention(model)[0][1])[0]


def test_sparse_vsa_changes_the_output_and_remove_restores_it(tiny):
    model, inputs = tiny
    keys = list(model.state_dict())
    stock = run(model, inputs)
    apply_sparse_attention(model, "vsa", sparsity=0.5, gate=True)
    modules = model._vidsparse_state.dispatch_modules
    try:
        out = run(model, inputs)
    finally:
        remove_sparse_attention(model)
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, stock, atol=1e-4)
    assert torch.equal(run(model, inputs), stock)
    assert list(model.state_dict()) == keys
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    for name in modules:
        assert importlib.import_module(name).dispatch_attention_fn is dispatch_attention_fn


def test_deepcopy_of_a_patched_model_is_independent(tiny):
    model, inputs = tiny
    stock = run(model, inputs)
    apply_sparse_attention(model, "vsa", sparsity=0.5)
    try:
        sparse = run(model, inputs)
        twin = copy.deepcopy(model)
        remove_sparse_attention(twin)
        assert torch.equal(run(twin, inputs), stock)  # the copy is stock again ...
        assert torch.equal(run(model, inputs), sparse)  # ... the original still sparse
        assert twin._forward_pre_hooks == {} and model._forward_pre_hooks
        # The other order: the original removed first, the copy still routes.
        twin = copy.deepcopy(model)
    finally:
        remove_sparse_attention(model)
    assert torch.equal(run(model, inputs), stock)
    try:
        assert torch.equal(run(twin, inputs), sparse)
    finally:
        remove_sparse_attention(twin)
    assert torch.equal(run(twin, inputs), stock)


def test_routes_are_closed_after_every_forward(tiny, patched):
    model, inputs = tiny
    run(patched("vsa", sparsity=0.5), inputs)
    assert dispatch.ROUTES == []


@pytest.mark.parametrize("name", ["hunyuan_video", "hunyuan_video15"])
def test_padded_text_lengths_are_read_once_per_forward(name, monkeypatch):
    # One host sync per forward for the text padding, not one per layer: the transformer's
    # pre-hook reads the lengths from the forward's text masks; the mask the model builds is
    # read back once per patched model, to check that the two agree.
    from vidsparse.integrations.diffusers import methods, models

    model, inputs = TINY_MODELS[name]()
    mask_reads, input_reads = [], []
    real = methods.real_lengths
    monkeypatch.setattr(methods, "real_lengths", lambda mask: mask_reads.append(1) or real(mask))
    spec = models.MODELS[type(model).__name__]

    def counted(module, args, kwargs):
        input_reads.append(1)
        return spec.text_lengths(module, args, kwargs)

    monkeypatch.setitem(models.MODELS, spec.name, dataclasses.replace(spec, text_lengths=counted))
    apply_sparse_attention(model.eval(), "vsa", sparsity=0.5)
    try:
        run(model, inputs)
        run(model, inputs)
    finally:
        remove_sparse_attention(model)
    assert len(input_reads) == 2  # two forwards, each over several layers
    assert len(mask_reads) == 1


def all_dense_plan(plan):
    """``plan`` with every head's choice replaced by the dense pattern."""
    import dataclasses

    from vidsparse.search.plan import HeadChoice

    dense = HeadChoice(StripeSpec.dense(), "block", 0.0, 0.0, 1.0)
    buckets = tuple(
        dataclasses.replace(b, layers={i: (dense,) * plan.num_heads for i in b.layers})
        for b in plan.buckets
    )
    return dataclasses.replace(plan, buckets=buckets)


def test_capture_search_plan_apply(tiny, tmp_path):
    from vidsparse.integrations.diffusers import capture_calibration, set_denoising_step
    from vidsparse.layout.grid import VideoGrid
    from vidsparse.search import load_calibration, search

    model, inputs = tiny
    stock = run(model, inputs)
    with capture_calibration(model, tmp_path):
        for step in (0, 1):
            set_denoising_step(model, step)
            assert torch.equal(run(model, inputs), stock)
    (shape,) = {s.grid_shape for s in load_calibration(tmp_path)}
    result = search(
        tmp_path, VideoGrid(shape, (4, 4, 4)), target_sparsity=0.5, num_steps=2,
        dense_fraction=0.5, model=type(model).__name__, device="cpu", progress=False,
    )  # fmt: skip
    choices = [c for b in result.plan.buckets for layer in b.layers.values() for c in layer]
    assert any(c.spec != StripeSpec.dense() for c in choices)  # the search found sparse heads
    for plan, dense in ((result.plan, False), (all_dense_plan(result.plan), True)):
        apply_sparse_attention(model, "psa", plan=plan)
        try:
            set_denoising_step(model, 1)  # the plan's sparse step
            out = run(model, inputs)
        finally:
            remove_sparse_attention(model)
        assert torch.isfinite(out).all()
        if dense:
            torch.testing.assert_close(out, stock, atol=ATOL, rtol=0)
