"""VSA gates (CPU, tiny random weights): created without random initialisation where the model
computes, saved by save_pretrained and loaded back, FastVideo's VSA checkpoint format giving
the output of FastVideo's formula (checked against an independent evaluation of the block's
self-attention), and gates of another model refused."""

import math

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from tiny_models import TINY_MODELS  # noqa: E402

from vidsparse.integrations.diffusers import (  # noqa: E402
    apply_sparse_attention,
    load_sparse_attention,
    remove_sparse_attention,
)
from vidsparse.nn import VSAGate  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_backend")
SPARSITY = 0.5
TILE = (4, 4, 4)


def wan():
    model, inputs = TINY_MODELS["wan_t2v"]()
    return model.eval(), inputs


@torch.no_grad()
def run(model, inputs):
    return model(**inputs, return_dict=False)[0]


def fastvideo_state_dict(model, seed=3) -> dict[str, torch.Tensor]:
    """A Wan state dict in FastVideo's VSA format: the model's weights and per block a
    ``to_gate_compress`` linear (dim -> dim, with bias)."""
    g = torch.Generator().manual_seed(seed)
    state = dict(model.state_dict())
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    for i in range(len(model.blocks)):
        state[f"blocks.{i}.to_gate_compress.weight"] = torch.randn(dim, dim, generator=g) * 0.2
        state[f"blocks.{i}.to_gate_compress.bias"] = torch.randn(dim, generator=g) * 0.2
    return state


# -- an independent evaluation of FastVideo's VSA self-attention --------------------------------


def rope(x, cos, sin):
    """Wan's rotary embedding on [B, S, H, D]: channel pairs (2i, 2i+1) rotated."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out


def tile_ids(grid, tile) -> torch.Tensor:
    """Per token (raster order), the index of its tile in the tile grid (raster order)."""
    t, h, w = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")
    tiles = [math.ceil(n / p) for n, p in zip(grid, tile)]
    ids = (t // tile[0]) * tiles[1] * tiles[2] + (h // tile[1]) * tiles[2] + (w // tile[2])
    return ids.flatten()


def vsa_by_masks(q, k, v, gate, grid, sparsity):
    """``o_fine + gate * o_coarse`` on [B, H, S, D] in float64: coarse attention over the
    tiles' mean q/k/v, the top-k key tiles per query tile by coarse score, exact attention over
    the tokens of those tiles."""
    q, k, v, gate = (x.double() for x in (q, k, v, gate))
    ids = tile_ids(grid, TILE)
    n = int(ids.max()) + 1
    onehot = torch.nn.functional.one_hot(ids, n).double()  # [S, Nt]
    mean = lambda x: torch.einsum("bhsd,sn->bhnd", x, onehot) / onehot.sum(0)[:, None]  # noqa: E731
    scale = q.shape[-1] ** -0.5
    scores = mean(q) @ mean(k).transpose(-1, -2) * scale  # [B, H, Nt, Nt]
    o_coarse = torch.softmax(scores, -1) @ mean(v)
    topk = max(1, math.ceil((1 - sparsity) * n))
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen.scatter_(-1, scores.topk(topk, dim=-1).indices, True)
    token_mask = chosen[:, :, ids][:, :, :, ids]  # [B, H, S, S]
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~token_mask, float("-inf"))
    o_fine = torch.softmax(logits, -1) @ v
    return o_fine + gate * o_coarse[:, :, ids]


def fastvideo_self_attention(block, x, rotary, grid, sparsity, heads):
    """FastVideo's WanTransformerBlock_VSA self-attention on the normed hidden states ``x``:
    q/k/v and gate_compress projections of x, RMS norms on q and k, RoPE on q and k, VSA,
    output projection."""
    attn = block.attn1
    q = attn.norm_q(attn.to_q(x)).unflatten(2, (heads, -1))
    k = attn.norm_k(attn.to_k(x)).unflatten(2, (heads, -1))
    v = attn.to_v(x).unflatten(2, (heads, -1))
    gate = block.to_gate_compress(x).unflatten(2, (heads, -1))
    q, k = rope(q, *rotary), rope(k, *rotary)
    o = vsa_by_masks(*(t.transpose(1, 2) for t in (q, k, v, gate)), grid, sparsity)
    return attn.to_out[0](o.transpose(1, 2).flatten(2).float())


def test_fastvideo_checkpoint_gives_fastvideos_output():
    model, inputs = wan()
    state = fastvideo_state_dict(model)
    seen = {}

    def grab(module, args, output):
        seen["x"], seen["rotary"], seen["out"] = args[0], args[3], output

    load_sparse_attention(model, state, sparsity=SPARSITY)
    try:
        hook = model.blocks[1].attn1.register_forward_hook(grab)
        out = run(model, inputs)
        hook.remove()
        with torch.no_grad():
            expected = fastvideo_self_attention(
                model.blocks[1], seen["x"], seen["rotary"], (3, 8, 10), SPARSITY, heads=2
            )
    finally:
        remove_sparse_attention(model)
    rel = (seen["out"] - expected).norm() / expected.norm()
    assert rel < 1e-5, rel
    assert torch.isfinite(out).all()


def test_save_pretrained_then_load_sparse_attention_round_trips(tmp_path):
    model, inputs = wan()
    apply_sparse_attention(model, "vsa", sparsity=SPARSITY, gate=True)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            block.to_gate_compress.weight.normal_(generator=torch.Generator().manual_seed(i))
    expected = run(model, inputs)
    model.save_pretrained(tmp_path)
    remove_sparse_attention(model)

    from diffusers import WanTransformer3DModel

    loaded = WanTransformer3DModel.from_pretrained(tmp_path).eval()
    load_sparse_attention(loaded, tmp_path)  # options from the saved config
    try:
        assert loaded._vidsparse_state.method.sparsity == SPARSITY
        assert torch.equal(run(loaded, inputs), expected)
    finally:
        remove_sparse_attention(loaded)


def test_gates_of_another_model_are_refused_and_nothing_stays_patched():
    model, _ = wan()
    state = fastvideo_state_dict(model)
    wide = {k: torch.zeros(64, *v.shape[1:]) for k, v in state.items() if "to_gate" in k}
    with pytest.raises(ValueError, match="another model"):
        load_sparse_attention(model, wide, sparsity=SPARSITY)
    assert not hasattr(model, "_vidsparse_state") and not hasattr(
        model.blocks[0], "to_gate_compress"
    )
    extra = {**state, "blocks.7.to_gate_compress.weight": state["blocks.0.to_gate_compress.weight"]}
    with pytest.raises(ValueError, match="unknown.*blocks.7"):
        load_sparse_attention(model, extra, sparsity=SPARSITY)
    with pytest.raises(ValueError, match="no VSA gates"):
        load_sparse_attention(model, model.state_dict(), sparsity=SPARSITY)


def test_no_gate_by_default_and_gate_true_starts_at_zero():
    model, inputs = wan()
    params = sum(p.numel() for p in model.parameters())
    apply_sparse_attention(model, "vsa", sparsity=SPARSITY)
    try:
        assert sum(p.numel() for p in model.parameters()) == params
        ungated = run(model, inputs)
    finally:
        remove_sparse_attention(model)
    apply_sparse_attention(model, "vsa", sparsity=SPARSITY, gate=True)
    try:
        gates = [m for m in model.modules() if isinstance(m, VSAGate)]
        assert len(gates) == len(model.blocks)
        assert all(not g.weight.any() and not g.bias.any() for g in gates)
        assert torch.equal(run(model, inputs), ungated)
    finally:
        remove_sparse_attention(model)


def test_gate_under_layerwise_float8_casting():
    model, inputs = wan()
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    apply_sparse_attention(model, "vsa", sparsity=SPARSITY, gate=True)
    try:
        assert model.blocks[0].to_gate_compress.weight.dtype == torch.float32
        assert torch.isfinite(run(model, inputs)).all()
    finally:
        remove_sparse_attention(model)


def test_gate_under_sequential_offload_meta_weights():
    from accelerate import cpu_offload

    model, inputs = wan()
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.blocks[0].attn1.to_q.weight.is_meta
    apply_sparse_attention(model, "vsa", sparsity=SPARSITY, gate=True)
    try:
        assert model.blocks[0].to_gate_compress.weight.device.type == "cpu"
        assert torch.isfinite(run(model, inputs)).all()
    finally:
        remove_sparse_attention(model)


def test_gate_goes_to_the_op_as_its_projection(monkeypatch):
    """A trained gate reaches ``video_sparse_attn`` as a ``GateProjection`` (not kept for the
    backward on the Triton path): the output and every parameter's gradient equal the gate
    module's own call."""
    import vidsparse.integrations.diffusers.methods as methods
    from vidsparse import GateProjection

    model, inputs = wan()
    model.train()
    apply_sparse_attention(model, "vsa", sparsity=SPARSITY, gate=True)
    try:
        for block in model.blocks:
            torch.nn.init.normal_(block.to_gate_compress.weight, std=0.1)
        seen, original = [], methods.video_sparse_attn

        def recorded(*args, gate, **kwargs):
            seen.append(type(gate))
            return original(*args, gate=gate, **kwargs)

        monkeypatch.setattr(methods, "video_sparse_attn", recorded)
        arms = []
        for as_projection in (True, False):
            if not as_projection:
                monkeypatch.setattr(VSAGate, "projection", lambda self, x, dtype: None)
            model.zero_grad()
            out = model(**inputs, return_dict=False)[0]
            out.square().mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            arms.append((out.detach(), grads))
        layers = len(model.blocks)
        assert seen == [GateProjection] * layers + [torch.Tensor] * layers
        assert torch.equal(arms[0][0], arms[1][0])
        assert arms[0][1].keys() == arms[1][1].keys()
        assert any("to_gate_compress" in name for name in arms[0][1])
        for name, grad in arms[0][1].items():
            assert torch.equal(grad, arms[1][1][name]), name
    finally:
        remove_sparse_attention(model)
