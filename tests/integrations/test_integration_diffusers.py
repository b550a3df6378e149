"""vidsparse.integrations.diffusers on tiny randomly initialised diffusers transformers (CPU).

The grids are not tile multiples (3x8x10 tokens against 4x4x4 tiles), so partial tiles are
exercised. Equalities against the stock processor are exact where the same ops run in the same
order (dense, apply/remove) and within fp32 rounding where vidsparse's reference computes the
same attention differently (VSA at sparsity 0, PSA with dense specs).
"""

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers", minversion="0.36")

from diffusers import HunyuanVideoTransformer3DModel, WanTransformer3DModel  # noqa: E402

from vidsparse.integrations.diffusers import (  # noqa: E402
    GATE_MODULE_NAME,
    apply_sparse_attention,
    capture_calibration,
    denoising_step_callback,
    remove_sparse_attention,
    set_denoising_step,
)
from vidsparse.layout.grid import VideoGrid  # noqa: E402
from vidsparse.masks.stripe import StripeSpec  # noqa: E402
from vidsparse.search.plan import HeadChoice, Plan, PlanBucket  # noqa: E402

HEADS, LAYERS = 2, 2
LATENT = (1, 4, 3, 16, 20)  # [B, C, F, H, W] -> 3 x 8 x 10 tokens after the (1, 2, 2) patch
GRID = (3, 8, 10)
ATOL = 2e-5  # fp32 rounding of a different (but exact) attention computation

pytestmark = pytest.mark.usefixtures("torch_backend")


# ---------------------------------------------------------------------------------------------
# tiny models and inputs
# ---------------------------------------------------------------------------------------------


def tiny_wan() -> WanTransformer3DModel:
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=LAYERS,
        rope_max_seq_len=32,
    )
    return model.eval()


def wan_inputs(shape=LATENT) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(shape, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(shape[0], 7, 16, generator=g),
        "return_dict": False,
    }


@torch.no_grad()
def run(model, inputs) -> torch.Tensor:
    return model(**inputs)[0]


@pytest.fixture(scope="module")
def wan():
    return tiny_wan()


@pytest.fixture(scope="module")
def wan_stock_out(wan):
    return run(wan, wan_inputs())


@pytest.fixture
def patched(wan):
    """Yields an apply function; always removes the patch, even when the test fails."""

    def apply(method, **options):
        apply_sparse_attention(wan, method, **options)
        return wan

    yield apply
    if getattr(wan, "_vidsparse_state", None) is not None:
        remove_sparse_attention(wan)


def all_dense(n: int = HEADS) -> list[StripeSpec]:
    return [StripeSpec.dense()] * n


def same_place(n: int = HEADS) -> list[StripeSpec]:
    # Each block attends only to the blocks at its own spatial place, in every temporal block
    # (the 3x8x10 grid has one temporal block of 4x4x4 tiles, so a temporal stripe would be
    # dense here): 1 of the 6 key blocks.
    spec = StripeSpec(t_width=1, t_offset=0, t_stride=1, s_width=1, s_offset=0, s_stride=None)
    return [spec] * n


def make_plan(specs, grid=GRID, heads=HEADS, layers=LAYERS, num_steps=2, dense_steps=1) -> Plan:
    choice = [HeadChoice(s, "block", 0.0, 0.0, 1.0) for s in specs]
    bucket = PlanBucket(dense_steps, num_steps, {i: tuple(choice) for i in range(layers)})
    return Plan(
        model="tiny-wan",
        grid=VideoGrid(grid, (4, 4, 4)),
        num_heads=heads,
        num_steps=num_steps,
        dense_steps=dense_steps,
        buckets=(bucket,),
        selection={"mode": "alpha", "alpha": 0.05, "target_sparsity": None, "metric": "rel_l2"},
    )


# ---------------------------------------------------------------------------------------------
# Wan: equalities
# ---------------------------------------------------------------------------------------------


def test_dense_processor_equals_stock(wan, wan_stock_out, patched):
    # Bit for bit: the same q/k/v ops and the same SDPA call as diffusers' native backend.
    assert torch.equal(run(patched("dense"), wan_inputs()), wan_stock_out)


def test_dense_with_fused_projections_equals_stock(wan_stock_out):
    model = tiny_wan()
    model.fuse_qkv_projections()  # q/k/v come from one to_qkv linear: the stock helper handles it
    apply_sparse_attention(model, "dense")
    assert torch.equal(run(model, wan_inputs()), wan_stock_out)


def test_only_self_attention_is_routed(wan, patched, monkeypatch):
    # The processors stay diffusers' own objects; only attn1's attention call reaches the
    # method (attn2, the cross-attention, goes to diffusers' dispatch).
    from vidsparse.integrations.diffusers import methods

    processors = dict(wan.attn_processors)
    seen = []
    dense_attend = methods.METHOD_CLASSES["dense"].attend

    def spy(self, q, k, v, call):
        seen.append(call.layer)
        return dense_attend(self, q, k, v, call)

    monkeypatch.setattr(methods.METHOD_CLASSES["dense"], "attend", spy)
    run(patched("dense"), wan_inputs())
    assert seen == list(range(LAYERS))
    assert all(p is processors[name] for name, p in wan.attn_processors.items())


def test_vsa_all_tiles_zero_gate_equals_dense(wan, wan_stock_out, patched):
    out = run(patched("vsa", sparsity=0.0), wan_inputs())
    torch.testing.assert_close(out, wan_stock_out, atol=ATOL, rtol=0)


def test_vsa_topk_all_tiles_equals_dense(wan, wan_stock_out, patched):
    out = run(patched("vsa", topk=10**6, gate=False), wan_inputs())  # clamped to every tile
    torch.testing.assert_close(out, wan_stock_out, atol=ATOL, rtol=0)


def test_vsa_sparse_changes_output(wan, wan_stock_out, patched):
    out = run(patched("vsa", sparsity=0.75), wan_inputs())
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, wan_stock_out, atol=1e-3)


def test_psa_dense_specs_equal_dense(wan, wan_stock_out, patched):
    out = run(patched("psa", specs=all_dense()), wan_inputs())
    torch.testing.assert_close(out, wan_stock_out, atol=ATOL, rtol=0)


def test_psa_per_layer_specs(wan, wan_stock_out, patched):
    out = run(patched("psa", specs=[all_dense(), same_place()]), wan_inputs())
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, wan_stock_out, atol=1e-3)


def test_psa_plan_dense_step_then_bucket(wan, wan_stock_out, patched):
    model = patched("psa", plan=make_plan(same_place()))
    out0 = run(model, wan_inputs())  # step 0: the plan's dense step, SDPA
    torch.testing.assert_close(out0, wan_stock_out, atol=1e-6, rtol=0)
    set_denoising_step(model, 1)  # step 1: the sparse bucket
    out1 = run(model, wan_inputs())
    assert not torch.allclose(out1, wan_stock_out, atol=1e-3)


def test_psa_plan_with_dense_specs_equals_dense(wan, wan_stock_out, patched):
    model = patched("psa", plan=make_plan(all_dense()))
    set_denoising_step(model, 1)
    torch.testing.assert_close(run(model, wan_inputs()), wan_stock_out, atol=ATOL, rtol=0)


def test_psa_plan_file(wan, wan_stock_out, patched, tmp_path):
    from vidsparse.search.plan import save_plan

    path = tmp_path / "plan.json"
    save_plan(make_plan(all_dense()), path)
    with pytest.raises(ValueError, match="model"):
        apply_sparse_attention(wan, "psa", plan=path, expect_model="wan2.1-t2v-1.3b")
    model = patched("psa", plan=str(path), expect_model="tiny-wan")
    torch.testing.assert_close(run(model, wan_inputs()), wan_stock_out, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# Wan: STA (sliding-tile attention)
# ---------------------------------------------------------------------------------------------


def masked_dense_attend(tile, window):
    """The "dense" method's attention under STA's token mask: the reference a patched "sta"
    model must equal."""
    from vidsparse.ops.sliding_tile_attn import sliding_tile_token_mask

    mask = sliding_tile_token_mask(VideoGrid(GRID, tile), window)

    def attend(self, q, k, v, call):
        assert call.shape == GRID
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


@pytest.mark.parametrize(
    "tile, window",
    [
        ((1, 2, 2), (1, 3, 3)),  # tiles 3 x 4 x 5: clamped windows along h and w
        ((4, 4, 4), (1, 1, 3)),  # tiles 1 x 2 x 3 (partial along t and h), dense along w
    ],
)
def test_sta_equals_dense_attention_under_the_window_mask(wan, patched, monkeypatch, tile, window):
    import vidsparse.integrations.diffusers.methods as methods

    out = run(patched("sta", window=window, tile=tile), wan_inputs())
    remove_sparse_attention(wan)
    monkeypatch.setattr(
        methods.METHOD_CLASSES["dense"], "attend", masked_dense_attend(tile, window)
    )
    expected = run(patched("dense"), wan_inputs())
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_sta_window_covering_the_grid_equals_dense(wan, wan_stock_out, patched):
    out = run(patched("sta", window=(3, 1, 1), tile=(1, 8, 10)), wan_inputs())  # 3 x 1 x 1 tiles
    torch.testing.assert_close(out, wan_stock_out, atol=ATOL, rtol=0)


def test_sta_window_larger_than_the_grid_fails_before_any_layer(wan, patched, monkeypatch):
    import vidsparse.integrations.diffusers.methods as methods

    def no_attention(*args, **kwargs):
        raise AssertionError("an attention ran")

    monkeypatch.setattr(methods, "sliding_tile_attn", no_attention)
    model = patched("sta", window=(1, 3, 1))  # the default 4x4x4 tiles: 1 x 2 x 3 of them
    with pytest.raises(ValueError, match="window along h is 3 tiles but the grid has 2"):
        run(model, wan_inputs())


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"window": (2, 1, 1)}, ValueError, "window along t must be odd"),
        ({"window": (1, 1)}, TypeError, "window must be 3"),
        ({"window": (1, 1, 1), "tile": (4, 4)}, ValueError, "tile must be"),
        ({"window": (1, 1, 1), "sparsity": 0.5}, TypeError, r"method='sta' takes options"),
    ],
)
def test_sta_bad_options(wan, options, error, match):
    with pytest.raises(error, match=match):
        apply_sparse_attention(wan, "sta", **options)
    assert not hasattr(wan, "_vidsparse_state")


# ---------------------------------------------------------------------------------------------
# Wan: apply / remove, gate parameters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, options",
    [
        ("dense", {}),
        ("vsa", {"sparsity": 0.5}),
        ("psa", {"specs": same_place()}),
        ("sta", {"window": (1, 1, 1)}),
    ],
)
def test_apply_then_remove_is_bit_identical(wan, wan_stock_out, method, options):
    keys = list(wan.state_dict())
    processors = {name: p for name, p in wan.attn_processors.items()}
    apply_sparse_attention(wan, method, **options)
    run(wan, wan_inputs())
    remove_sparse_attention(wan)
    assert torch.equal(run(wan, wan_inputs()), wan_stock_out)
    assert list(wan.state_dict()) == keys
    assert all(p is processors[name] for name, p in wan.attn_processors.items())
    assert not wan._forward_pre_hooks
    assert not hasattr(wan, "_vidsparse_state")


def test_gate_is_trainable_and_in_state_dict(torch_backend):
    model = tiny_wan()
    apply_sparse_attention(model, "vsa", sparsity=0.5, gate=True)
    state = model.state_dict()
    gate_keys = [k for k in state if f".{GATE_MODULE_NAME}." in k]
    assert gate_keys == [  # FastVideo's keys
        f"blocks.{i}.{GATE_MODULE_NAME}.{p}" for i in range(LAYERS) for p in ("weight", "bias")
    ]
    assert all(not state[k].any() for k in gate_keys)  # zero-initialised

    # Trainable: the gate gets a gradient (through the coarse branch).
    out = model(**wan_inputs())[0]
    out.square().mean().backward()
    grad = model.blocks[0].to_gate_compress.weight.grad
    assert grad is not None and grad.abs().sum() > 0

    # A non-zero gate changes the output, and it round-trips through the state dict.
    with torch.no_grad():
        for i in range(LAYERS):
            model.blocks[i].to_gate_compress.weight.normal_(std=0.1)
    expected = run(model, wan_inputs())
    other = tiny_wan()
    apply_sparse_attention(other, "vsa", sparsity=0.5, gate=True)
    other.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(run(other, wan_inputs()), expected)


def test_sparsity_schedule_drives_the_gate_modules(wan, patched):
    from vidsparse.nn import VSAGate

    model = patched("vsa", sparsity=0.0, gate=True)
    modules = [m for m in model.modules() if isinstance(m, VSAGate)]
    assert len(modules) == LAYERS
    assert all(m.sparsity == 0.0 for m in modules)


# The reference VSA path calls lru_cache'd grid helpers; dynamo traces through them (warning).
@pytest.mark.dynamo
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize(
    "method, options",
    [
        ("dense", {}),
        ("vsa", {"sparsity": 0.5}),
        ("psa", {"specs": same_place()}),
        ("sta", {"window": (1, 1, 3)}),
    ],
)
def test_compiles_without_graph_break(method, options):
    # fullgraph=True fails on any graph break; the eager backend keeps it fast on the CPU.
    model = tiny_wan()
    apply_sparse_attention(model, method, **options)
    expected = run(model, wan_inputs())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(run(compiled, wan_inputs()), expected, atol=1e-5, rtol=0)


def tiny_wan_layers(num_layers: int) -> WanTransformer3DModel:
    config = {k: v for k, v in tiny_wan().config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    return WanTransformer3DModel(**{**config, "num_layers": num_layers}).eval()


def spatial_band(width: int, n: int = HEADS) -> list[StripeSpec]:
    # Wider bands attend more key blocks: every width gives the lists another shape.
    spec = StripeSpec(t_width=1, t_offset=0, t_stride=1, s_width=width, s_offset=0, s_stride=None)
    return [spec] * n


def compile_blocks_counting_graphs(model) -> list:
    """Regional compilation (fullgraph) of ``model``'s blocks; the list fills with every graph
    Dynamo compiles (the backend runs them as traced)."""
    import torch._dynamo

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend=counting_backend)
    return graphs


@pytest.mark.dynamo
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize(
    "method, options", [("dense", {}), ("vsa", {"sparsity": 0.5}), ("sta", {"window": (1, 1, 3)})]
)
def test_regional_compile_one_graph_for_all_layers(method, options):
    model = tiny_wan_layers(4)
    apply_sparse_attention(model, method, **options)
    expected = run(model, wan_inputs())
    graphs = compile_blocks_counting_graphs(model)
    torch.testing.assert_close(run(model, wan_inputs()), expected, atol=1e-5, rtol=0)
    assert len(graphs) == 1


@pytest.mark.dynamo
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_regional_compile_shares_graphs_across_psa_layers():
    # Each layer's lists reach the compiled block as buffers, not as specs (constants), padded
    # to one width: four layers with four patterns compile one graph, and every layer still
    # runs its own pattern.
    model = tiny_wan_layers(4)
    apply_sparse_attention(model, "psa", specs=[spatial_band(w) for w in (1, 2, 3, 4)])
    expected = run(model, wan_inputs())
    state = model._vidsparse_state
    widths = {attn._vidsparse_psa_indices.shape[-1] for _, attn in state.layers}
    patterns = {attn._vidsparse_psa_counts.sum().item() for _, attn in state.layers}
    assert state.method.lists_ready and len(widths) == 1 and len(patterns) == 4
    graphs = compile_blocks_counting_graphs(model)
    torch.testing.assert_close(run(model, wan_inputs()), expected, atol=1e-5, rtol=0)
    assert len(graphs) == 1


@pytest.mark.dynamo
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_compiled_blocks_follow_patching_across_models():
    """Regional compilation shares one Dynamo cache between every block of a class, in every
    model, and Dynamo does not guard on module hooks: a block graph traced for a model that is
    not patched (while another patched model keeps the shim installed) was reused for a patched
    model, whose attention then stayed dense (its gate got no gradient). Each compiled model
    here computes what it computes eagerly: unpatched beside patched ones, patched after an
    unpatched one compiled, and again unpatched after ``remove_sparse_attention``."""
    torch._dynamo.reset()
    holder = tiny_wan()
    apply_sparse_attention(holder, "vsa", sparsity=0.5)  # alive: the shim stays installed
    dense_expected = run(tiny_wan(), wan_inputs())

    def compiled(model):
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
        return run(model, wan_inputs())

    torch.testing.assert_close(compiled(tiny_wan()), dense_expected, atol=ATOL, rtol=0)
    sparse = tiny_wan()
    apply_sparse_attention(sparse, "vsa", sparsity=0.5)
    sparse_expected = run(sparse, wan_inputs())
    assert (sparse_expected - dense_expected).abs().max() > 1e-3  # VSA changes the output
    torch.testing.assert_close(compiled(sparse), sparse_expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(compiled(tiny_wan()), dense_expected, atol=ATOL, rtol=0)
    remove_sparse_attention(sparse)
    torch.testing.assert_close(run(sparse, wan_inputs()), dense_expected, atol=ATOL, rtol=0)
    apply_sparse_attention(sparse, "vsa", sparsity=0.5)
    torch.testing.assert_close(run(sparse, wan_inputs()), sparse_expected, atol=ATOL, rtol=0)
    remove_sparse_attention(holder)


def test_psa_lists_path_equals_specs_path(wan, patched, monkeypatch):
    # The buffers hold exactly what stripe_attn builds from the specs.
    model = patched("psa", specs=[same_place(), spatial_band(2)])
    via_lists = run(model, wan_inputs())
    assert model._vidsparse_state.method.lists_ready
    monkeypatch.setattr(
        type(model._vidsparse_state.method),
        "before_forward",
        lambda self, state, device: setattr(self, "lists_ready", False),
    )
    torch.testing.assert_close(run(model, wan_inputs()), via_lists, atol=0, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny model runs on the CPU: interpreter")
def test_psa_lists_path_on_the_triton_kernels(triton_backend, monkeypatch):
    # The engine's own kernels (Triton interpreter) behind the lists path: the same output as
    # the specs path, bit for bit, and as the PyTorch reference to fp32 rounding.
    model = tiny_wan()
    apply_sparse_attention(model, "psa", specs=[same_place(), spatial_band(2)])
    via_lists = run(model, wan_inputs())
    method = model._vidsparse_state.method
    assert method.lists_ready
    with monkeypatch.context() as m:
        m.setattr(type(method), "before_forward", lambda self, state, device: None)
        method.lists_ready = False
        torch.testing.assert_close(run(model, wan_inputs()), via_lists, atol=0, rtol=0)
    monkeypatch.setenv("VIDSPARSE_BACKEND", "torch")
    torch.testing.assert_close(run(model, wan_inputs()), via_lists, atol=ATOL, rtol=0)


def test_psa_list_buffers_are_not_saved_and_go_with_remove(wan, patched):
    model = patched("psa", specs=same_place())
    run(model, wan_inputs())
    names = [n for n, _ in model.named_buffers(remove_duplicate=False) if "_vidsparse_psa" in n]
    assert len(names) == 3 * LAYERS
    assert not any("_vidsparse_psa" in key for key in model.state_dict())
    remove_sparse_attention(model)
    assert not any("_vidsparse_psa" in n for n, _ in model.named_buffers())


# ---------------------------------------------------------------------------------------------
# Wan: steps and bad input
# ---------------------------------------------------------------------------------------------


def test_set_denoising_step_checks(wan, patched):
    with pytest.raises(ValueError, match="not applied"):
        set_denoising_step(wan, 0)
    patched("dense")
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        set_denoising_step(wan, -1)


def test_step_callback_advances_and_wraps(wan, patched):
    model = patched("psa", plan=make_plan(all_dense()))
    callback = denoising_step_callback(model)
    pipe = type("Pipe", (), {"num_timesteps": 2})()
    kwargs = {"latents": 1}
    assert callback(pipe, 0, None, kwargs) is kwargs
    assert model._vidsparse_state.step == 1
    callback(pipe, 1, None, kwargs)
    assert model._vidsparse_state.step == 0  # ready for the next generation
    with pytest.raises(ValueError, match="searched for 2 denoising steps but the pipeline runs 3"):
        callback(type("Pipe", (), {"num_timesteps": 3})(), 0, None, kwargs)


def test_failed_apply_leaves_the_model_stock(wan):
    wan.blocks[1].to_gate_compress = nn.Identity()  # a name clash on the second layer only
    try:
        with pytest.raises(ValueError, match="already has an attribute 'to_gate_compress'"):
            apply_sparse_attention(wan, "vsa", sparsity=0.5, gate=True)
        assert not hasattr(wan.blocks[0], "to_gate_compress")
        assert not wan.blocks[0].attn1._forward_pre_hooks
        assert not hasattr(wan, "_vidsparse_state")
    finally:
        del wan.blocks[1].to_gate_compress


def test_unsupported_model_lists_supported():
    with pytest.raises(TypeError, match="WanTransformer3DModel.*HunyuanVideoTransformer3DModel"):
        apply_sparse_attention(nn.Linear(4, 4), "dense")


def test_plan_for_another_grid_is_refused(wan, patched):
    model = patched("psa", plan=make_plan(all_dense(), grid=(3, 8, 12)))
    with pytest.raises(ValueError, match=r"3x8x12 .* got 3x8x10"):
        run(model, wan_inputs())


def test_plan_for_another_model_is_refused(wan):
    with pytest.raises(ValueError, match="4 heads, the model 2"):
        apply_sparse_attention(wan, "psa", plan=make_plan(all_dense(4), heads=4))
    with pytest.raises(ValueError, match=r"no entry for layers \[\] and entries for unknown"):
        apply_sparse_attention(wan, "psa", plan=make_plan(all_dense(), layers=3))
    assert not hasattr(wan, "_vidsparse_state")


@pytest.mark.parametrize(
    "method, options, error, match",
    [
        ("sparse", {}, ValueError, "method must be one of"),
        ("vsa", {}, ValueError, "exactly one of sparsity"),
        ("vsa", {"sparsity": 1.0}, ValueError, "sparsity must be in"),
        ("vsa", {"sparsity": 0.5, "plan": None}, TypeError, r"method='vsa' takes .*\['plan'\]"),
        ("dense", {"sparsity": 0.5}, TypeError, r"method='dense' takes options \[\]"),
        ("psa", {}, ValueError, "exactly one of plan"),
        ("psa", {"specs": all_dense(3)}, ValueError, "expected 2 StripeSpec"),
        ("psa", {"specs": [all_dense()] * 3}, ValueError, "3 per-layer lists"),
        ("psa", {"specs": all_dense(), "tile": (4, 4)}, ValueError, "tile must be"),
    ],
)
def test_bad_options(wan, method, options, error, match):
    with pytest.raises(error, match=match):
        apply_sparse_attention(wan, method, **options)
    assert not hasattr(wan, "_vidsparse_state")  # nothing half-applied


def test_apply_twice_and_remove_unpatched_are_refused(wan, patched):
    with pytest.raises(ValueError, match="not applied"):
        remove_sparse_attention(wan)
    patched("dense")
    with pytest.raises(ValueError, match="already applied"):
        apply_sparse_attention(wan, "dense")


# ---------------------------------------------------------------------------------------------
# HunyuanVideo: joint attention with (padded) text tokens
# ---------------------------------------------------------------------------------------------


def tiny_hunyuan() -> HunyuanVideoTransformer3DModel:
    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=HEADS,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6),
    )
    return model.eval()


def hunyuan_inputs(real_text=(9, 5)) -> dict:
    g = torch.Generator().manual_seed(1)
    batch, text = len(real_text), 9
    mask = torch.zeros(batch, text, dtype=torch.long)
    for b, n in enumerate(real_text):
        mask[b, :n] = 1  # sample 1 has padded text tokens
    return {
        "hidden_states": torch.randn((batch, *LATENT[1:]), generator=g),
        "timestep": torch.tensor([500] * batch),
        "encoder_hidden_states": torch.randn(batch, text, 16, generator=g),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, 8, generator=g),
        "guidance": torch.tensor([3.0] * batch),
        "return_dict": False,
    }


@pytest.fixture(scope="module")
def hunyuan():
    return tiny_hunyuan()


@pytest.fixture(scope="module")
def hunyuan_stock_out(hunyuan):
    return run(hunyuan, hunyuan_inputs())


@pytest.mark.parametrize(
    "method, options, atol",
    [
        ("dense", {}, 0.0),
        ("psa", {"specs": all_dense()}, ATOL),
        ("vsa", {"sparsity": 0.0}, ATOL),  # all tiles, zero-initialised gate
        ("vsa", {"topk": 10**6, "gate": False}, ATOL),
    ],
)
def test_hunyuan_equals_stock(hunyuan, hunyuan_stock_out, method, options, atol):
    apply_sparse_attention(hunyuan, method, **options)
    try:
        out = run(hunyuan, hunyuan_inputs())
    finally:
        remove_sparse_attention(hunyuan)
    torch.testing.assert_close(out, hunyuan_stock_out, atol=atol, rtol=0)
    assert torch.equal(run(hunyuan, hunyuan_inputs()), hunyuan_stock_out)


def test_hunyuan_refuses_sta(hunyuan):
    with pytest.raises(ValueError, match="method='sta' is not supported on HunyuanVideo"):
        apply_sparse_attention(hunyuan, "sta", window=(1, 1, 1))
    assert not hasattr(hunyuan, "_vidsparse_state")


def test_hunyuan_sparse_psa_runs(hunyuan, hunyuan_stock_out):
    apply_sparse_attention(hunyuan, "psa", specs=same_place())
    try:
        out = run(hunyuan, hunyuan_inputs())
        # Text tokens in every call: the specs path, no per-layer lists built for nothing.
        state = hunyuan._vidsparse_state
        assert not state.method.lists_ready
        assert all(attn._vidsparse_psa_indices is None for _, attn in state.layers)
    finally:
        remove_sparse_attention(hunyuan)
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, hunyuan_stock_out, atol=1e-3)


def test_hunyuan_sparse_vsa_runs_and_removes_exactly(hunyuan, hunyuan_stock_out):
    keys = list(hunyuan.state_dict())
    processors = dict(hunyuan.attn_processors)
    apply_sparse_attention(hunyuan, "vsa", sparsity=0.5, gate=True)
    try:
        gate_keys = [k for k in hunyuan.state_dict() if f".{GATE_MODULE_NAME}." in k]
        assert gate_keys == [
            f"{blocks}.0.{GATE_MODULE_NAME}.{p}"
            for blocks in ("transformer_blocks", "single_transformer_blocks")
            for p in ("weight", "bias")
        ]
        out = run(hunyuan, hunyuan_inputs())
        # A non-zero gate (the coarse branch) reaches the output.
        with torch.no_grad():
            for block in (hunyuan.transformer_blocks[0], hunyuan.single_transformer_blocks[0]):
                block.to_gate_compress.weight.normal_(std=0.1)
        gated = run(hunyuan, hunyuan_inputs())
    finally:
        remove_sparse_attention(hunyuan)
    assert torch.isfinite(out).all() and torch.isfinite(gated).all()
    assert not torch.allclose(out, hunyuan_stock_out, atol=1e-3)
    assert not torch.allclose(gated, out, atol=1e-4)
    assert torch.equal(run(hunyuan, hunyuan_inputs()), hunyuan_stock_out)
    assert list(hunyuan.state_dict()) == keys
    assert all(p is processors[name] for name, p in hunyuan.attn_processors.items())


def test_hunyuan_vsa_ignores_padded_text(hunyuan):
    # Sample 1 has 5 real text tokens of 9: what sits in the 4 padded slots must not reach
    # its video output (the sparse path runs each sample on its real tokens only).
    inputs = hunyuan_inputs()
    other = hunyuan_inputs()
    other["encoder_hidden_states"][1, 5:] += 10.0
    apply_sparse_attention(hunyuan, "vsa", sparsity=0.5)
    try:
        out, out_other = run(hunyuan, inputs), run(hunyuan, other)
    finally:
        remove_sparse_attention(hunyuan)
    torch.testing.assert_close(out_other[1], out[1], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# calibration capture for the PSA search
# ---------------------------------------------------------------------------------------------


def test_capture_two_steps_feeds_the_search(wan, wan_stock_out, tmp_path):
    from vidsparse.search import load_calibration, search

    processors = dict(wan.attn_processors)
    calib = tmp_path / "calib"
    with capture_calibration(wan, calib) as capture:
        out0 = run(wan, wan_inputs())
        set_denoising_step(wan, 1)
        out1 = run(wan, wan_inputs())
    # Dense attention through the capture: the outputs are the stock ones, bit for bit.
    assert torch.equal(out0, wan_stock_out) and torch.equal(out1, wan_stock_out)
    # Restored: the original processor objects, no hook, no state.
    assert all(p is processors[name] for name, p in wan.attn_processors.items())
    assert not wan._forward_pre_hooks and not hasattr(wan, "_vidsparse_state")
    assert not capture.active
    assert torch.equal(run(wan, wan_inputs()), wan_stock_out)

    names = sorted(p.name for p in calib.iterdir())
    expected = [f"step{s:05d}_layer{i:04d}_call000.safetensors" for s in (0, 1) for i in range(2)]
    assert names == expected
    assert sorted(p.name for p in capture.paths) == names
    samples = load_calibration(calib)
    assert [(x.step, x.layer) for x in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    tokens = GRID[0] * GRID[1] * GRID[2]
    for x in samples:
        assert x.grid_shape == GRID and not x.tiled
        assert x.num_steps is None  # a bare transformer: no scheduler tells the step count
        assert tuple(x.q.shape) == (1, HEADS, tokens, 16) and x.q.dtype == torch.float32

    grid = VideoGrid(GRID, (4, 4, 4))
    result = search(
        calib,
        grid,
        target_sparsity=0.5,
        num_steps=2,
        dense_fraction=0.5,
        model="tiny-wan",
        device="cpu",
        progress=False,
    )
    plan = result.plan
    assert (plan.num_steps, plan.dense_steps, plan.num_heads) == (2, 1, HEADS)
    assert [(b.start, b.end, sorted(b.layers)) for b in plan.buckets] == [(1, 2, [0, 1])]
    assert result.table.skipped_steps == {0}
    # The plan drives the model it was captured on.
    apply_sparse_attention(wan, "psa", plan=plan)
    try:
        set_denoising_step(wan, 1)
        out = run(wan, wan_inputs())
    finally:
        remove_sparse_attention(wan)
    assert torch.isfinite(out).all()


def test_capture_samples_are_the_attention_inputs(wan, tmp_path, monkeypatch):
    # Layer 0's q/v as the stock model hands them to diffusers' dispatch (its first call).
    import diffusers.models.transformers.transformer_wan as transformer_wan

    from vidsparse.search import load_calibration

    seen = []
    stock = transformer_wan.dispatch_attention_fn

    def spy(query, key, value, *args, **kwargs):
        seen.append((query, value))
        return stock(query, key, value, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(transformer_wan, "dispatch_attention_fn", spy)
        run(wan, wan_inputs())
    q, v = (x.transpose(1, 2) for x in seen[0])
    with capture_calibration(wan, tmp_path, layers=[0]):
        run(wan, wan_inputs())
    (sample,) = list(load_calibration(tmp_path))
    assert torch.equal(sample.q, q) and torch.equal(sample.v, v)


def test_capture_selects_steps_and_layers_and_counts_calls(wan, wan_stock_out, tmp_path):
    with capture_calibration(wan, tmp_path, steps=[1, 3], layers=[1]) as capture:
        for step in range(3):
            set_denoising_step(wan, step)
            run(wan, wan_inputs())
        run(wan, wan_inputs())  # step 2 again: not selected
        set_denoising_step(wan, 1)
        assert torch.equal(run(wan, wan_inputs()), wan_stock_out)  # step 1 again (CFG-like)
    assert [p.name for p in capture.paths] == [
        "step00001_layer0001_call000.safetensors",
        "step00001_layer0001_call001.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in capture.paths]


def test_capture_with_the_step_callback(wan, tmp_path):
    with capture_calibration(wan, tmp_path, layers=[0]) as capture:
        callback = denoising_step_callback(wan)
        pipe = type("Pipe", (), {"num_timesteps": 2})()
        for i in range(2):
            run(wan, wan_inputs())
            callback(pipe, i, None, {})
    assert [p.name for p in capture.paths] == [
        "step00000_layer0000_call000.safetensors",
        "step00001_layer0000_call000.safetensors",
    ]


def test_capture_on_a_pipeline_records_the_schedule_and_the_search_reads_it(wan, tmp_path):
    # A pipeline's scheduler gives the step (its step_index) and the step count (its timesteps
    # after set_timesteps); the search then needs neither --grid nor --num-steps.
    from diffusers import UniPCMultistepScheduler

    from vidsparse.cli import main
    from vidsparse.search import load_calibration, load_plan

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True)
    pipe = type("Pipe", (), {"components": {}, "transformer": wan, "scheduler": scheduler})()
    calib = tmp_path / "calib"
    scheduler.set_timesteps(4)
    with capture_calibration(pipe, calib, layers=[0]) as capture:
        for step in (0, 2):
            scheduler._step_index = None if step == 0 else step  # as scheduler.step() leaves it
            run(wan, wan_inputs())
    assert [p.name for p in capture.paths] == [
        "step00000_layer0000_call000.safetensors",
        "step00002_layer0000_call000.safetensors",
    ]
    files = load_calibration(calib)
    assert [(i.step, i.grid_shape, i.num_steps) for i in files.infos()] == [
        (0, GRID, 4),
        (2, GRID, 4),
    ]
    plan = tmp_path / "plan.json"
    argv = ["search", str(calib), "--tile", "4", "4", "4", "--alpha", "0.5", "--device", "cpu"]
    assert main([*argv, "--out", str(plan), "--no-png", "--json"]) == 0
    loaded = load_plan(plan)
    assert (loaded.grid.shape, loaded.num_steps, loaded.dense_steps) == (GRID, 4, 1)


def test_scheduler_steps_only_after_set_timesteps():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from vidsparse.integrations.diffusers.capture import scheduler_steps

    scheduler = FlowMatchEulerDiscreteScheduler()
    assert scheduler_steps(scheduler) is None  # the training timesteps until set_timesteps
    scheduler.set_timesteps(7)
    assert scheduler_steps(scheduler) == 7
    assert scheduler_steps(None) is None and scheduler_steps(object()) is None


def test_capture_remove_and_apply_exclusivity(wan, wan_stock_out, tmp_path):
    capture = capture_calibration(wan, tmp_path / "a")
    with pytest.raises(ValueError, match="already applied"):
        apply_sparse_attention(wan, "dense")
    with pytest.raises(ValueError, match="already applied"):
        capture_calibration(wan, tmp_path / "b")
    capture.remove()
    with pytest.raises(ValueError, match="no longer applied"):
        capture.remove()
    assert torch.equal(run(wan, wan_inputs()), wan_stock_out)
    assert not list((tmp_path / "a").iterdir())  # nothing ran: nothing written


def test_capture_hunyuan_saves_video_tokens_only(hunyuan, hunyuan_stock_out, tmp_path):
    from vidsparse.search import load_calibration

    with capture_calibration(hunyuan, tmp_path):
        out = run(hunyuan, hunyuan_inputs())  # padded text in sample 1
    assert torch.equal(out, hunyuan_stock_out)
    assert torch.equal(run(hunyuan, hunyuan_inputs()), hunyuan_stock_out)
    samples = list(load_calibration(tmp_path))
    assert [(x.step, x.layer) for x in samples] == [(0, 0), (0, 1)]  # dual, then single stream
    tokens = GRID[0] * GRID[1] * GRID[2]
    for x in samples:
        assert x.grid_shape == GRID
        for t in (x.q, x.k, x.v):
            assert tuple(t.shape) == (2, HEADS, tokens, 16)


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"layers": [2]}, ValueError, r"layers \[2\] do not exist: the model has 2"),
        ({"layers": []}, ValueError, "non-empty"),
        ({"steps": [-1]}, ValueError, "ints >= 0"),
        ({"steps": 3}, TypeError, "iterable"),
    ],
)
def test_capture_bad_options(wan, tmp_path, options, error, match):
    with pytest.raises(error, match=match):
        capture_calibration(wan, tmp_path, **options)
    assert not hasattr(wan, "_vidsparse_state")
    assert all(type(b.attn1.processor).__name__ == "WanAttnProcessor" for b in wan.blocks)


def test_capture_refuses_a_folder_with_calibration_files(wan, tmp_path):
    (tmp_path / "old.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="already holds"):
        capture_calibration(wan, tmp_path)
    assert not hasattr(wan, "_vidsparse_state")


def test_key_mask_lengths_read_once_per_mask_and_again_after_inplace_change():
    """Every layer of a HunyuanVideo forward gets the same mask tensor: its per-sample lengths
    are read back once, and again when the mask changes in place."""
    from vidsparse.integrations.diffusers.methods import _VSA

    method = _VSA(sparsity=0.5)
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    assert method._real_lengths(mask) == [10, 10]
    assert method._real_lengths(mask) is method._real_lengths(mask)  # cached
    mask[1, ..., 6:] = False
    assert method._real_lengths(mask) == [10, 6]
    assert method._real_lengths(mask.clone()) == [10, 6]
