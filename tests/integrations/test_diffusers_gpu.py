"""Every covered model on the GPU's Triton kernels (bf16, tiny random weights): "dense" bit for
bit stock, VSA at sparsity 0 and PSA with dense specs equal to dense within bf16 rounding, a
sparse VSA run finite; Wan under regional compilation; a pipeline under model CPU offload."""

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from tiny_models import TINY_MODELS, first_output  # noqa: E402

from vidsparse.integrations.diffusers import (  # noqa: E402
    apply_sparse_attention,
    remove_sparse_attention,
)
from vidsparse.masks.stripe import StripeSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_backend")]
REL = 2e-2  # bf16 rounding of a different attention computation, through the whole model


def to_bf16(model):
    """``model`` on the GPU in bf16 as ``from_pretrained(torch_dtype=torch.bfloat16)`` loads
    it: the parameters of its ``_keep_in_fp32_modules`` stay in float32 (Kandinsky 5's time
    embedding only runs that way)."""
    model = model.to("cuda", torch.bfloat16)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        if keep & set(name.split(".")):
            param.data = param.data.float()
    return model.eval()


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(request):
    model, inputs = TINY_MODELS[request.param]()
    model = to_bf16(model)
    inputs = {
        k: v.to("cuda", torch.bfloat16 if v.is_floating_point() else v.dtype)
        if isinstance(v, torch.Tensor)
        else v
        for k, v in inputs.items()
    }
    return model, inputs


@torch.no_grad()
def run(model, inputs):
    return first_output(model(**inputs, return_dict=False)).float()


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def heads_of(model) -> int:
    from vidsparse.integrations.diffusers.models import attention_dims, spec_for

    return attention_dims(spec_for(model).self_attention(model)[0][1])[0]


@pytest.mark.parametrize(
    "method, options",
    [
        ("dense", {}),
        ("vsa", {"sparsity": 0.0}),
        ("vsa", {"sparsity": 0.0, "gate": True}),
        ("psa", None),
    ],
)
def test_equals_stock(tiny, method, options):
    model, inputs = tiny
    stock = run(model, inputs)
    if options is None:
        options = {"specs": [StripeSpec.dense()] * heads_of(model)}
    apply_sparse_attention(model, method, **options)
    try:
        out = run(model, inputs)
    finally:
        remove_sparse_attention(model)
    if method == "dense":
        assert torch.equal(out, stock)
    else:
        assert rel(out, stock) < REL
    assert torch.equal(run(model, inputs), stock)


def test_sparse_vsa_runs(tiny):
    model, inputs = tiny
    apply_sparse_attention(model, "vsa", sparsity=0.5)
    try:
        assert torch.isfinite(run(model, inputs)).all()
    finally:
        remove_sparse_attention(model)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_wan_regional_compile():
    model, inputs = TINY_MODELS["wan_t2v"]()
    model = model.to("cuda", torch.bfloat16).eval()
    inputs = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["hidden_states"] = inputs["hidden_states"].bfloat16()
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"].bfloat16()
    apply_sparse_attention(model, "vsa", sparsity=0.5)
    try:
        eager = run(model, inputs)
        torch._dynamo.reset()
        model.compile_repeated_blocks(fullgraph=True)
        assert rel(run(model, inputs), eager) < 1e-2
    finally:
        remove_sparse_attention(model)


def test_pipeline_under_model_cpu_offload():
    # accelerate's offload hook moves the whole transformer (gates included) to the GPU for
    # its forward and back afterwards; the routing and a gate made on the CPU weights follow.
    from test_diffusers_pipelines_all import BUILDERS

    pipe, kwargs = BUILDERS["wan22_ti2v"]()
    pipe.transformer.to(torch.bfloat16)
    kwargs = {
        k: v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) else v
        for k, v in kwargs.items()
    }
    pipe.enable_model_cpu_offload()
    pipe.set_progress_bar_config(disable=True)

    def generate():
        out = pipe(
            **kwargs,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
            return_dict=False,
        )[0]
        return out.float()

    stock = generate()
    apply_sparse_attention(pipe, "dense")
    try:
        assert torch.equal(generate(), stock)
    finally:
        remove_sparse_attention(pipe)
    apply_sparse_attention(pipe, "vsa", sparsity=0.5, gate=True)
    try:
        sparse = generate()
        assert next(pipe.transformer.parameters()).device.type == "cpu"  # offloaded again
    finally:
        remove_sparse_attention(pipe)
    assert torch.isfinite(sparse).all() and not torch.allclose(sparse, stock, atol=1e-3)
    assert torch.equal(generate(), stock)
