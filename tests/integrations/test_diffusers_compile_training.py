"""``compile_for_training``: diffusers' regional compilation with inductor's mix-order
reduction off (it drops the gradients of sliced modulation tables on GPUs; the GPU check is
``benchmarks/tuning/check_compiled_train.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from vidsparse.integrations.diffusers import compile as training_compile  # noqa: E402
from vidsparse.integrations.diffusers import compile_for_training  # noqa: E402
from vidsparse.testing import grad_errors  # noqa: E402


def test_options_turn_mix_order_reduction_off():
    if getattr(torch._inductor.config.triton, "mix_order_reduction", None) is None:
        assert training_compile.training_compile_options() == {}  # a torch without it
    else:
        assert training_compile.training_compile_options() == {"triton.mix_order_reduction": False}


@pytest.mark.dynamo
def test_blocks_compile_with_the_training_options(monkeypatch):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        rope_max_seq_len=32,
    )  # fmt: skip
    seen = []
    real = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, *a, **kw: seen.append(kw) or real(self, *a, **kw)
    )
    compile_for_training(model)
    assert len(seen) == len(model.blocks) == 2
    assert all(kw == {"fullgraph": True, "options": training_compile.training_compile_options()}
               for kw in seen)  # fmt: skip
    assert all(block._compiled_call_impl is not None for block in model.blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's Triton backward")
@pytest.mark.parametrize("method", ["dense", "vsa"])
def test_gpu_compiled_training_gradients_are_eager(method):
    """A 2-block Wan model at ``train_vsa``'s size, where inductor fuses the norm backward's
    reductions (32,768 tokens of width 768), bf16 autocast over fp32 weights, gradient
    checkpointing: every parameter's gradient of the compiled step is the eager step's
    (``scale_shift_table`` and the time embedder were 20-260x off with mix-order reduction
    on)."""
    from diffusers import WanTransformer3DModel

    from vidsparse.integrations.diffusers import apply_sparse_attention, remove_sparse_attention

    config = dict(patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=128,
                  in_channels=3, out_channels=3, text_dim=64, freq_dim=256, ffn_dim=3072,
                  num_layers=2, rope_max_seq_len=1024)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 16, 64, 128, generator=g).cuda()  # 16 x 32 x 64 = 32,768 tokens
    text = torch.randn(1, 8, 64, generator=g).cuda()
    target = torch.randn(x.shape, generator=g).cuda()
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**config).cuda().train()
        model.enable_gradient_checkpointing()
        with torch.no_grad():  # trained-looking tables: the modulation carries gradient
            for block in model.blocks:
                block.scale_shift_table.normal_(generator=torch.Generator("cuda").manual_seed(1))
        if method == "vsa":
            apply_sparse_attention(model, "vsa", sparsity=0.5, gate=True)
        if compiled:
            compile_for_training(model)
        for step in range(2):  # the second step reuses the first's buffers
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16):
                out = model(x, torch.tensor([500.0 + step], device="cuda"), text,
                            return_dict=False)[0]  # fmt: skip
            torch.nn.functional.mse_loss(out.float(), target).backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"no gradient ({'compiled' if compiled else 'eager'}): {missing}"
        grads.append({n: p.grad.float().clone() for n, p in model.named_parameters()})
        if method == "vsa":
            remove_sparse_attention(model)
    eager, compiled = grads
    assert eager.keys() == compiled.keys()
    for name, err in grad_errors(compiled, eager).items():
        assert err < 0.05, (name, err)
