"""Pipelines (CPU, tiny random weights): every transformer of a pipeline patched in one call,
the denoising step taken from the scheduler (Wan 2.2 A14B's two experts see the global step),
per-transformer options, the step callback as a composable diffusers PipelineCallback, and
diffusers' own switches (set_attention_backend) keeping their meaning."""

import warnings
from dataclasses import replace

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from diffusers import UniPCMultistepScheduler, WanPipeline  # noqa: E402
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback  # noqa: E402
from tiny_models import TINY_MODELS  # noqa: E402

from vidsparse.integrations.diffusers import (  # noqa: E402
    DenoisingStepCallback,
    apply_sparse_attention,
    remove_sparse_attention,
    set_denoising_step,
)
from vidsparse.integrations.diffusers.state import state_of  # noqa: E402
from vidsparse.layout.grid import VideoGrid  # noqa: E402
from vidsparse.masks.stripe import StripeSpec  # noqa: E402
from vidsparse.search.plan import HeadChoice, Plan, PlanBucket  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_backend")
STEPS = 4
GRID = (3, 4, 5)  # 9 frames, 64 x 80 pixels: 3 x 8 x 10 latents, (1, 2, 2) patch


def tiny_a14b_pipeline() -> WanPipeline:
    """Wan 2.2 A14B's layout: a high-noise ``transformer`` and a low-noise ``transformer_2``
    switching at ``boundary_ratio``; no text encoder or VAE (prompt embeddings given, latents
    returned)."""
    high, _ = TINY_MODELS["wan_t2v"]()
    low, _ = TINY_MODELS["wan_t2v"]()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        transformer=high.eval(),
        transformer_2=low.eval(),
        scheduler=scheduler,
        boundary_ratio=0.95,
    )


def generate(pipe, **kwargs) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 7, 24, generator=g)
    return pipe(
        prompt_embeds=embeds,
        negative_prompt_embeds=embeds.flip(1),
        height=64,
        width=80,
        num_frames=9,
        num_inference_steps=STEPS,
        guidance_scale=2.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(1),
        **kwargs,
    ).frames


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_a14b_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def stock(pipe):
    return generate(pipe)


def record_steps(pipe):
    """The step each transformer's forward runs at, recorded by a pre-hook after ours; and
    the hook handles."""
    seen = {"transformer": [], "transformer_2": []}
    handles = [
        getattr(pipe, name).register_forward_pre_hook(
            lambda m, a, k, log=log: log.append(state_of(m).step), with_kwargs=True
        )
        for name, log in seen.items()
    ]
    return seen, handles


def plan_for(heads=2, layers=2, dense_steps=1, model="tiny", grid=GRID) -> Plan:
    choice = tuple(HeadChoice(StripeSpec.dense(), "block", 0.0, 0.0, 1.0) for _ in range(heads))
    bucket = PlanBucket(dense_steps, STEPS, {i: choice for i in range(layers)})
    return Plan(
        model=model,
        grid=VideoGrid(grid, (4, 4, 4)),
        num_heads=heads,
        num_steps=STEPS,
        dense_steps=dense_steps,
        buckets=(bucket,),
        selection={"mode": "alpha", "alpha": 0.05, "target_sparsity": None, "metric": "rel_l2"},
    )


def test_both_experts_are_patched_and_follow_the_global_step(pipe, stock):
    plans = {"transformer": plan_for(dense_steps=1), "transformer_2": plan_for(dense_steps=2)}
    apply_sparse_attention(pipe, "psa", plan=plans)
    try:
        assert state_of(pipe.transformer).method.plan is plans["transformer"]
        assert state_of(pipe.transformer_2).method.plan is plans["transformer_2"]
        seen, handles = record_steps(pipe)
        try:
            out = generate(pipe)
        finally:
            for handle in handles:
                handle.remove()
    finally:
        remove_sparse_attention(pipe)
    # Classifier-free guidance: two forwards per step; the low-noise expert takes over late
    # and sees the pipeline's step index, not a count of its own calls.
    steps = sorted(set(seen["transformer"]) | set(seen["transformer_2"]))
    assert steps == list(range(STEPS))
    assert seen["transformer_2"] and min(seen["transformer_2"]) > 0
    torch.testing.assert_close(out, stock, atol=1e-4, rtol=0)  # all-dense specs


def test_per_transformer_options_must_name_every_transformer(pipe):
    with pytest.raises(ValueError, match="per transformer"):
        apply_sparse_attention(pipe, "psa", plan={"transformer": plan_for()})
    assert not hasattr(pipe.transformer, "_vidsparse_state")
    assert not hasattr(pipe.transformer_2, "_vidsparse_state")


def test_a_bad_option_patches_neither_transformer(pipe):
    with pytest.raises(TypeError, match="unknown"):
        apply_sparse_attention(pipe, "vsa", sparsity=0.5, window=3)
    assert not hasattr(pipe.transformer, "_vidsparse_state")
    assert not hasattr(pipe.transformer_2, "_vidsparse_state")


def test_vsa_on_the_pipeline_and_removal(pipe, stock):
    apply_sparse_attention(pipe, "vsa", sparsity=0.5)
    try:
        out = generate(pipe)
    finally:
        remove_sparse_attention(pipe)
    assert torch.isfinite(out).all() and not torch.allclose(out, stock, atol=1e-4)
    assert torch.equal(generate(pipe), stock)


def test_step_callback_is_a_pipeline_callback_that_composes(pipe):
    model = pipe.transformer
    apply_sparse_attention(model, "psa", specs=[StripeSpec.dense()] * 2)
    try:
        callback = DenoisingStepCallback(model)
        assert isinstance(callback, PipelineCallback) and callback.tensor_inputs == []
        seen = []

        class Spy(PipelineCallback):
            tensor_inputs = []

            def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
                seen.append(state_of(model).step)
                return callback_kwargs

        generate(pipe, callback_on_step_end=MultiPipelineCallbacks([callback, Spy()]))
        assert seen == [1, 2, 3, 0]  # after the last step, back to 0 for the next generation
    finally:
        remove_sparse_attention(model)


def test_a_plan_that_never_leaves_its_dense_steps_warns_once():
    model, inputs = TINY_MODELS["wan_t2v"]()
    apply_sparse_attention(model.eval(), "psa", plan=plan_for(dense_steps=1, grid=(3, 8, 10)))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                for _ in range(3 * STEPS):
                    model(**inputs)
        messages = [str(w.message) for w in caught if "not advancing" in str(w.message)]
        assert len(messages) == 1
        set_denoising_step(model, 1)  # a bare transformer: the user drives the step
    finally:
        remove_sparse_attention(model)


def test_set_denoising_step_is_refused_where_the_scheduler_drives_it(pipe):
    apply_sparse_attention(pipe, "vsa", sparsity=0.5)
    try:
        with pytest.raises(ValueError, match="scheduler"):
            set_denoising_step(pipe.transformer, 1)
    finally:
        remove_sparse_attention(pipe)


def test_set_attention_backend_after_apply_keeps_the_sparse_path():
    # diffusers' switch reaches every call the method leaves dense, and the sparse path stays.
    model, inputs = TINY_MODELS["wan_t2v"]()
    model.eval()
    with torch.no_grad():
        apply_sparse_attention(model, "vsa", sparsity=0.5)
        try:
            sparse = model(**inputs)[0]
            model.set_attention_backend("_native_math")
            assert torch.allclose(model(**inputs)[0], sparse, atol=1e-6)
        finally:
            remove_sparse_attention(model)
            model.set_attention_backend("native")
        assert not torch.allclose(model(**inputs)[0], sparse, atol=1e-4)


def test_unsupported_objects_are_named():
    with pytest.raises(TypeError, match="pipeline or a transformer"):
        apply_sparse_attention(object(), "vsa", sparsity=0.5)
    with pytest.raises(TypeError, match="does not support Linear.*Supported diffusers models"):
        apply_sparse_attention(torch.nn.Linear(2, 2), "vsa", sparsity=0.5)


def test_capture_refuses_a_folder_with_calibration_files(tmp_path):
    from vidsparse.integrations.diffusers import capture_calibration

    model, _ = TINY_MODELS["wan_t2v"]()
    (tmp_path / "step00000_layer0000_call000.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="already holds calibration files"):
        capture_calibration(model, tmp_path)
    assert not hasattr(model, "_vidsparse_state")


def test_capture_over_a_pipeline_writes_a_folder_per_transformer(pipe, stock, tmp_path):
    from vidsparse.integrations.diffusers import capture_calibration
    from vidsparse.search import load_calibration

    with capture_calibration(pipe, tmp_path, layers=[0]):
        out = generate(pipe)
    assert torch.equal(out, stock)  # the capture attends densely, as the stock model
    steps = {}
    for name in ("transformer", "transformer_2"):
        samples = list(load_calibration(tmp_path / name))
        steps[name] = {s.step for s in samples}
        assert all(s.grid_shape == GRID for s in samples)
        assert {s.transformer for s in samples} == {name}  # recorded for its plan
    assert steps["transformer"] | steps["transformer_2"] == set(range(STEPS))
    assert min(steps["transformer_2"]) > 0


def test_a_plan_searched_on_one_expert_is_refused_for_the_other(pipe):
    # Wan 2.2 A14B's experts share every shape: only the recorded member tells their plans
    # apart, and swapping them would run the wrong masks without a word.
    plans = {
        "transformer": replace(plan_for(), transformer="transformer_2"),
        "transformer_2": replace(plan_for(), transformer="transformer"),
    }
    with pytest.raises(ValueError, match="searched on the pipeline's 'transformer_2'"):
        apply_sparse_attention(pipe, "psa", plan=plans)
    assert not hasattr(pipe.transformer, "_vidsparse_state")
    assert not hasattr(pipe.transformer_2, "_vidsparse_state")
    matching = {name: replace(plan_for(), transformer=name) for name in plans}
    apply_sparse_attention(pipe, "psa", plan=matching)
    remove_sparse_attention(pipe)
    # A bare transformer has no pipeline name to compare: the user's choice stands.
    apply_sparse_attention(pipe.transformer_2, "psa", plan=matching["transformer"])
    remove_sparse_attention(pipe.transformer_2)


def test_load_sparse_attention_on_a_pipeline_follows_its_scheduler_and_is_all_or_nothing(pipe):
    from vidsparse.integrations.diffusers import load_sparse_attention

    def gates(model, rows):
        dim = model.config.num_attention_heads * model.config.attention_head_dim
        return {
            f"blocks.{i}.to_gate_compress.{p}": torch.ones(rows, dim)
            if p == "weight"
            else torch.ones(rows)
            for i in range(len(model.blocks))
            for p in ("weight", "bias")
        }

    good = {name: gates(getattr(pipe, name), 32) for name in ("transformer", "transformer_2")}
    bad = {**good, "transformer_2": gates(pipe.transformer_2, 64)}  # another model's shape
    with pytest.raises(ValueError, match="another model"):
        load_sparse_attention(pipe, bad, sparsity=0.5)
    assert not hasattr(pipe.transformer, "_vidsparse_state")
    assert not hasattr(pipe.transformer_2, "_vidsparse_state")
    load_sparse_attention(pipe, good, sparsity=0.5)
    try:
        for name in ("transformer", "transformer_2"):
            state = state_of(getattr(pipe, name))
            assert state.scheduler is pipe.scheduler and state.name == name
            assert torch.equal(getattr(pipe, name).blocks[0].to_gate_compress.bias, torch.ones(32))
    finally:
        remove_sparse_attention(pipe)


def test_gates_of_a_one_transformer_pipeline_load_from_its_pipeline_folder(tmp_path):
    """A Wan 2.1 pipeline (one transformer) saved whole: its gates load from the pipeline
    folder, as the docs say (they were looked for in the folder itself), and from the
    transformer's own folder too."""
    from vidsparse.integrations.diffusers import load_sparse_attention

    model, _ = TINY_MODELS["wan_t2v"]()
    apply_sparse_attention(model, "vsa", sparsity=0.5, gate=True)
    with torch.no_grad():
        for block in model.blocks:
            block.to_gate_compress.bias.fill_(0.25)
    model.save_pretrained(tmp_path / "pipeline" / "transformer")
    remove_sparse_attention(model)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction")
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, vae=None, transformer=model.eval(), scheduler=scheduler
    )
    for source in (tmp_path / "pipeline", tmp_path / "pipeline" / "transformer"):
        load_sparse_attention(pipe, source)
        try:
            bias = pipe.transformer.blocks[-1].to_gate_compress.bias
            assert torch.equal(bias, torch.full_like(bias, 0.25)), source
        finally:
            remove_sparse_attention(pipe)
