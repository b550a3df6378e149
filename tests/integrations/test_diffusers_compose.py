"""diffusers' own features on a patched model (CPU, tiny random weights): group offloading,
FirstBlockCache, LoRA load/fuse/unload, regional compilation of the models with padded text;
and a diffusers without the dispatch function this
integration routes through is refused with the versions supported."""

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from tiny_models import TINY_MODELS  # noqa: E402

from vidsparse.integrations.diffusers import (  # noqa: E402
    apply_sparse_attention,
    remove_sparse_attention,
)

pytestmark = pytest.mark.usefixtures("torch_backend")


def wan():
    model, inputs = TINY_MODELS["wan_t2v"]()
    return model.eval(), inputs


@torch.no_grad()
def run(model, inputs):
    return model(**inputs, return_dict=False)[0]


def test_group_offloading():
    from diffusers.hooks import apply_group_offloading

    model, inputs = wan()
    stock = run(model, inputs)
    cpu = torch.device("cpu")
    apply_group_offloading(
        model, onload_device=cpu, offload_device=cpu, offload_type="block_level",
        num_blocks_per_group=1,
    )  # fmt: skip
    apply_sparse_attention(model, "dense")
    try:
        assert torch.equal(run(model, inputs), stock)
    finally:
        remove_sparse_attention(model)
    apply_sparse_attention(model, "vsa", sparsity=0.5, gate=True)
    try:
        assert torch.isfinite(run(model, inputs)).all()
    finally:
        remove_sparse_attention(model)


def test_first_block_cache():
    from diffusers import FirstBlockCacheConfig

    model, inputs = wan()
    apply_sparse_attention(model, "vsa", sparsity=0.5)
    try:
        sparse = run(model, inputs)
        model.enable_cache(FirstBlockCacheConfig(threshold=0.2))
        with model.cache_context("cond"):
            first, cached = run(model, inputs), run(model, inputs)
        model.disable_cache()
    finally:
        remove_sparse_attention(model)
    torch.testing.assert_close(first, sparse, atol=1e-6, rtol=0)
    assert torch.isfinite(cached).all()


def test_lora_load_fuse_unload():
    pytest.importorskip("peft")
    from peft import LoraConfig

    model, inputs = wan()
    apply_sparse_attention(model, "vsa", sparsity=0.5)
    try:
        sparse = run(model, inputs)
        model.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k"], init_lora_weights=False))
        with_lora = run(model, inputs)
        model.fuse_lora()
        torch.testing.assert_close(run(model, inputs), with_lora, atol=1e-5, rtol=0)
        model.unfuse_lora()
        model.unload_lora()
        torch.testing.assert_close(run(model, inputs), sparse, atol=1e-5, rtol=0)
    finally:
        remove_sparse_attention(model)
    assert not torch.allclose(with_lora, sparse, atol=1e-4)


def test_a_diffusers_without_the_dispatch_hook_is_refused(monkeypatch):
    from diffusers.models import attention_dispatch

    def dispatch_attention_fn(query, key, value, mask=None):  # another signature
        raise AssertionError("never called")

    monkeypatch.setattr(attention_dispatch, "dispatch_attention_fn", dispatch_attention_fn)
    model, _ = wan()
    with pytest.raises(ImportError, match="supports diffusers >= 0.36"):
        apply_sparse_attention(model, "vsa", sparsity=0.5)
    assert not hasattr(model, "_vidsparse_state")


def test_a_dispatch_replaced_by_another_library_is_refused(monkeypatch):
    from diffusers.models.transformers import transformer_wan

    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", lambda *a, **k: None)
    model, _ = wan()
    with pytest.raises(TypeError, match="another library replaced it"):
        apply_sparse_attention(model, "vsa", sparsity=0.5)


def _counting_regional_compile(model) -> list:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend=backend)
    return graphs


def _band(heads: int) -> list:
    from vidsparse.masks.stripe import StripeSpec

    spec = StripeSpec(t_width=1, t_offset=0, t_stride=1, s_width=1, s_offset=0, s_stride=None)
    return [spec] * heads


@pytest.mark.dynamo
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize("name", ["hunyuan_video", "hunyuan_video15"])
@pytest.mark.parametrize("method", ["vsa", "psa"])
def test_regional_compile_fullgraph_with_padded_text(name, method):
    # The batch's second sample pads its text: the real lengths come from the forward's inputs
    # in the transformer's pre-hook, so no layer reads the mask back (a graph break).
    model, inputs = TINY_MODELS[name]()
    model.eval()
    options = {"sparsity": 0.5} if method == "vsa" else {"specs": _band(2)}
    apply_sparse_attention(model, method, **options)
    try:
        eager = run(model, inputs)
        graphs = _counting_regional_compile(model)
        torch.testing.assert_close(run(model, inputs), eager, atol=1e-5, rtol=0)
    finally:
        remove_sparse_attention(model)
        torch._dynamo.reset()
    assert graphs


def test_text_lengths_that_disagree_with_the_mask_are_refused(monkeypatch):
    # A diffusers that built HunyuanVideo's mask another way than its inputs say must fail
    # loudly, not attend padded text.
    import dataclasses

    from vidsparse.integrations.diffusers import models

    spec = models.MODELS["HunyuanVideoTransformer3DModel"]
    wrong = dataclasses.replace(spec, text_lengths=lambda m, a, kw: spec.text_lengths(m, a, kw) - 1)
    monkeypatch.setitem(models.MODELS, spec.name, wrong)
    model, inputs = TINY_MODELS["hunyuan_video"]()
    apply_sparse_attention(model.eval(), "vsa", sparsity=0.5)
    try:
        with pytest.raises(RuntimeError, match="builds the mask differently"):
            run(model, inputs)
    finally:
        remove_sparse_attention(model)


@pytest.mark.dynamo
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize("method", ["vsa", "psa"])
def test_regional_compile_traces_once_from_a_fresh_patch(method):
    """Compiled before any eager call: every block and every later forward reuse the first
    graph (the method's grid lookup filled a dict that Dynamo guards on, so the second block
    recompiled once)."""
    model, inputs = TINY_MODELS["wan_t2v"]()
    model.eval()
    options = {"sparsity": 0.5} if method == "vsa" else {"specs": _band(2)}
    apply_sparse_attention(model, method, **options)
    try:
        graphs = _counting_regional_compile(model)
        first = run(model, inputs)
        torch.testing.assert_close(run(model, inputs), first, atol=0, rtol=0)
    finally:
        remove_sparse_attention(model)
        torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs"
