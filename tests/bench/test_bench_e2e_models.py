"""The e2e benchmark's workloads beyond Wan 2.1 (Wan 2.2 TI2V-5B, HunyuanVideo 1.5,
HunyuanVideo, LTX-Video, LTX-2, Cosmos, Kandinsky 5, SkyReels-V2, Wan VACE, ChronoEdit,
Wan-Animate): tiny runs of the
same diffusers classes on the CPU (numbers meaningless, code paths real), the full-size
workloads' shapes, configs and inputs, and the attention timer counting every call once."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from vidsparse.bench.ops import e2e as bench_e2e  # noqa: E402
from vidsparse.bench.ops import e2e_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_backend")

FAST = ["--device", "cpu", "--tiny", "--warmup", "0", "--reps", "2", "--share-reps", "1"]
METHODS = ["--methods", "dense,vsa,psa", "--psa-sparsities", "0.6"]


NEW_MODELS = [
    "hunyuanvideo", "ltx", "ltx2", "cosmos", "kandinsky5", "skyreels-v2", "wan-vace",
    "chronoedit", "wan-animate",
]  # fmt: skip


def _work(*argv):
    return bench_e2e.make_workload(bench_e2e.parse_args(["--device", "cpu", *argv]))


def _tiny_run(model: str, tmp_path) -> dict:
    out = tmp_path / f"e2e_{model}.json"
    rows = bench_e2e.main([*FAST, *METHODS, "--model", model, "--out", str(out)])
    work = _work("--tiny", "--model", model)
    data = json.loads(out.read_text())
    assert data["rows"] == json.loads(json.dumps(rows))
    assert [(r["method"], r["target"]) for r in rows] == [
        ("dense", None),
        ("vsa", 0.875),
        ("psa", 0.6),
    ]
    meta = data["meta"]
    assert meta["complete"] is True and meta["tiny"] is True and meta["gpu"] == "cpu"
    for key in ("git_commit", "torch", "triton", "diffusers", "timer", "attention_share"):
        assert meta[key], key
    for r in rows:
        assert "error" not in r and "attn_share_error" not in r, r
        for key in ("step_ms", "attn_ms", "attn_share", "rel_l2", "speedup"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["method"], key)
        assert r["attn_ms"] > 0 and r["out_finite"] is True
        # every block's video self-attention, timed once (not once more inside the method);
        # Wan VACE: its VACE blocks' too
        assert r["attn_calls_per_step"] == work.attention_layers
        if r["method"] != "dense":
            assert 0.0 < r["rel_l2"] < 0.5, r
    return data


@pytest.mark.slow
def test_wan22_5b_tiny_run(tmp_path):
    data = _tiny_run("wan2.2-5b", tmp_path)
    meta = data["meta"]
    assert meta["workload"] == "tiny-wan2.2-5b"
    assert meta["model_class"] == "WanTransformer3DModel"
    assert meta["config"]["in_channels"] == 48 and meta["latent_shape"][1] == 48
    assert "for each of the 300 tokens" in meta["inputs"]["timestep"]
    for r in data["rows"]:
        assert r["cross_attn_calls_per_step"] == meta["layers"]  # attn2, told apart by length


@pytest.mark.slow
def test_hunyuan15_tiny_run(tmp_path):
    data = _tiny_run("hunyuan1.5", tmp_path)
    meta = data["meta"]
    assert meta["workload"] == "tiny-hunyuan1.5"
    assert meta["model_class"] == "HunyuanVideo15Transformer3DModel"
    t = e2e_model.TINY_HY15
    joint = t["text"][0] + t["byt5"][0] + t["image"]
    assert meta["grid"] == [5, 6, 10] and meta["joint_text_tokens"] == joint
    assert meta["self_attention_tokens"] == 300 + joint
    assert meta["joint_text_real"] == t["text"][1] + t["byt5"][1]
    for r in data["rows"]:
        # the joint attention is the self-attention; there is no cross-attention
        assert r["cross_attn_calls_per_step"] == 0 and r["cross_attn_ms"] == 0.0
        assert "other_attn_ms" not in r


def test_full_size_workloads():
    def work(*argv):
        return bench_e2e.make_workload(bench_e2e.parse_args(["--device", "cpu", *argv]))

    five = work("--model", "wan2.2-5b")
    assert five.name == "wan2.2-5b-720p" and five.latent == (1, 48, 31, 44, 80)
    assert five.grid_shape == (31, 22, 40) and five.tokens == 27_280 and five.heads == 24
    assert (five.layers, five.full_layers) == (30, 30) and five.psa_tile == (2, 8, 8)
    assert five.self_attn_len == 27_280 and five.cross_keys == 512 and five.per_token_timestep
    assert five.config["ffn_dim"] == 14336 and five.config["num_attention_heads"] * 128 == 3072

    hy = work("--model", "hunyuan1.5")
    assert hy.name == "hunyuan1.5-720p" and hy.latent == (1, 65, 31, 45, 80)
    assert hy.grid_shape == (31, 45, 80) and hy.tokens == 111_600 and hy.heads == 16
    assert (hy.layers, hy.full_layers) == (8, 54) and hy.psa_tile == (1, 16, 8)
    assert hy.joint_text == 1000 + 256 + 729 and hy.self_attn_len == 111_600 + 1985
    assert hy.cross_keys is None
    assert work("--model", "hunyuan1.5", "--layers", "54").layers == 54
    assert work("--model", "hunyuan1.5", "--resolution", "480p").grid_shape == (31, 30, 53)
    with pytest.raises(SystemExit, match="--layers"):
        work("--model", "hunyuan1.5", "--layers", "55")
    with pytest.raises(SystemExit, match="720p"):
        work("--model", "wan2.2-5b", "--resolution", "480p")
    # the Wan 2.1 workloads keep their defaults
    assert work().latent == (1, 16, 21, 60, 104) and work().psa_tile == (1, 16, 8)
    assert work("--model", "wan14b").layers == 8


def test_hunyuan15_config_is_the_class_default():
    """The config is diffusers' HunyuanVideo15Transformer3DModel signature defaults (those of
    the released checkpoints)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    defaults = inspect.signature(HunyuanVideo15Transformer3DModel.__init__).parameters
    for key, value in e2e_model.HUNYUAN15_CONFIG.items():
        want = defaults[key].default
        assert (tuple(value) if isinstance(value, tuple) else value) == want, key


def test_full_size_inputs_match_the_pipelines():
    hy = bench_e2e.make_workload(bench_e2e.parse_args(["--device", "cpu", "--model", "hunyuan1.5"]))
    tiny = dataclasses.replace(hy, latent=(1, 65, 1, 2, 2), grid_shape=(1, 2, 2))  # small video
    inputs = bench_e2e.make_inputs(tiny, torch.device("cpu"), torch.float32, 0)
    assert inputs["encoder_hidden_states"].shape == (1, 1000, 3584)
    assert inputs["encoder_attention_mask"].sum() == 400
    assert inputs["encoder_hidden_states_2"].shape == (1, 256, 1472)
    assert inputs["encoder_attention_mask_2"].sum() == 32
    assert inputs["image_embeds"].shape == (1, 729, 1152) and not inputs["image_embeds"].any()
    assert not inputs["hidden_states"][:, 32:].any()  # T2V: zero condition latents and mask


@pytest.mark.parametrize("model", ["wan2.2-5b", "hunyuan1.5"])
@pytest.mark.parametrize("target", [0.6, 0.75])
def test_synthetic_plan_lands_on_the_target(model, target):
    work = bench_e2e.make_workload(bench_e2e.parse_args(["--device", "cpu", "--model", model]))
    plan, achieved, patterns = bench_e2e.synthetic_plan(
        work, target, random.Random(0), bench_e2e.PSA_TOLERANCE
    )
    assert abs(achieved - target) <= 2 * bench_e2e.PSA_SLACK
    assert plan.grid.shape == work.grid_shape and plan.num_heads == work.heads
    assert sum(patterns.values()) == work.layers * work.heads


def test_attention_timer_times_each_call_once():
    """Patched, every self-attention call goes through the model module's dispatch name (the
    shim): the timer wraps that name only, so a call is one mark; afterwards the name is
    restored."""
    from diffusers.models.transformers import transformer_wan

    from vidsparse.integrations.diffusers import apply_sparse_attention, remove_sparse_attention

    work = bench_e2e.make_workload(bench_e2e.parse_args(["--device", "cpu", "--tiny"]))
    device = torch.device("cpu")
    model = bench_e2e.build_model(work, device, torch.float32, 0)
    inputs = bench_e2e.make_inputs(work, device, torch.float32, 0)
    stock = transformer_wan.dispatch_attention_fn
    apply_sparse_attention(model, "vsa", sparsity=0.5)
    try:
        shim = transformer_wan.dispatch_attention_fn
        timer = bench_e2e.AttentionTimer(model, device, work.tokens)
        with timer.active(), torch.no_grad():
            assert transformer_wan.dispatch_attention_fn is not shim
            model(**inputs)
        assert transformer_wan.dispatch_attention_fn is shim
        assert len(timer.marks["self"]) == work.layers
        assert len(timer.marks["cross"]) == work.layers and not timer.marks["other"]
    finally:
        remove_sparse_attention(model)
    assert transformer_wan.dispatch_attention_fn is stock


def test_default_out_names_the_workload():
    cpu = torch.device("cpu")
    for model, stem in (("wan2.2-5b", "e2e_wan2.2-5b-720p"), ("hunyuan1.5", "e2e_hunyuan1.5-720p")):
        args = bench_e2e.parse_args(["--device", "cpu", "--model", model])
        assert bench_e2e.default_out(cpu, bench_e2e.make_workload(args)).name == f"{stem}_cpu.json"


# ---- the other covered families ---------------------------------------------------------------


def _meta_and_rows(model, tmp_path):
    data = _tiny_run(model, tmp_path)
    return data["meta"], data["rows"]


@pytest.mark.slow
def test_hunyuanvideo_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("hunyuanvideo", tmp_path)
    assert meta["model_class"] == "HunyuanVideoTransformer3DModel"
    assert meta["dual_stream_layers"] == 1 and meta["single_stream_layers"] == 1
    assert meta["joint_text_tokens"] == 16 and meta["joint_text_real"] == 10
    assert meta["self_attention_tokens"] == 300 + 16
    for r in rows:
        # joint video + text attention (q and k both video + text long) in both block kinds
        assert r["attn_calls_per_step"] == 2 and r["cross_attn_calls_per_step"] == 0
        assert "other_attn_ms" not in r


@pytest.mark.slow
def test_ltx_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("ltx", tmp_path)
    assert meta["model_class"] == "LTXVideoTransformer3DModel"
    assert meta["grid"] == [5, 6, 10] and "packed to [1, 300, 8]" in meta["inputs"]["latents"]
    for r in rows:
        assert r["cross_attn_calls_per_step"] == meta["layers"]  # attn2, T5 text keys
        assert "other_attn_ms" not in r


@pytest.mark.slow
def test_ltx2_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("ltx2", tmp_path)
    assert meta["model_class"] == "LTX2VideoTransformer3DModel"
    assert meta["audio_tokens"] == 11
    for r in rows:
        # per block: video and audio text cross-attention, audio->video and video->audio
        assert r["cross_attn_calls_per_step"] == 4 * meta["layers"]
        assert r["other_attn_calls_per_step"] == meta["layers"]  # the audio self-attention


@pytest.mark.slow
def test_cosmos_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("cosmos", tmp_path)
    assert meta["model_class"] == "CosmosTransformer3DModel"
    assert meta["config"]["concat_padding_mask"] is False and meta["latent_shape"][1] == 5
    for r in rows:
        assert r["cross_attn_calls_per_step"] == meta["layers"]
        assert "other_attn_ms" not in r


@pytest.mark.slow
def test_kandinsky5_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("kandinsky5", tmp_path)
    assert meta["model_class"] == "Kandinsky5Transformer3DModel"
    assert meta["heads"] == 2 and meta["head_dim"] == 32  # model_dim / sum(axes_dims)
    for r in rows:
        assert r["cross_attn_calls_per_step"] == meta["layers"]
        # the text blocks' self-attention: text only, not the video's
        assert r["other_attn_calls_per_step"] == meta["config"]["num_text_blocks"]


@pytest.mark.slow
def test_skyreels_v2_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("skyreels-v2", tmp_path)
    assert meta["model_class"] == "SkyReelsV2Transformer3DModel"
    for r in rows:
        assert r["cross_attn_calls_per_step"] == meta["layers"]
        assert "other_attn_ms" not in r


@pytest.mark.slow
def test_wan_vace_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("wan-vace", tmp_path)
    assert meta["model_class"] == "WanVACETransformer3DModel"
    assert meta["config"]["vace_layers"] == [0, 1]
    for r in rows:
        # the blocks' and the VACE blocks' self- (control tokens: the video grid) and
        # cross-attention
        assert r["attn_calls_per_step"] == r["cross_attn_calls_per_step"] == 2 + 2
    psa = next(r for r in rows if r["method"] == "psa")
    assert sum(psa["patterns"].values()) == (2 + 2) * meta["heads"]


def test_new_full_size_workloads():
    """Token grids, heads, default layers and PSA blocks at the published resolutions."""
    want = {
        # model: (name, latent, grid, heads, head_dim, layers, full layers, psa tile)
        "hunyuanvideo": ("hunyuanvideo-720p", (1, 16, 33, 90, 160), (33, 45, 80), 24, 128, 9,
                         60, (1, 16, 8)),
        "ltx": ("ltx-1216x704", (1, 128, 16, 22, 38), (16, 22, 38), 32, 64, 28, 28, (2, 8, 8)),
        "ltx2": ("ltx2-1536x1024", (1, 128, 16, 32, 48), (16, 32, 48), 32, 128, 48, 48,
                 (1, 16, 8)),
        "cosmos": ("cosmos-720p", (1, 17, 16, 88, 160), (16, 44, 80), 32, 128, 28, 28,
                   (1, 16, 8)),
        "kandinsky5": ("kandinsky5-768x512", (1, 33, 31, 64, 96), (31, 32, 48), 28, 64, 32, 32,
                       (1, 16, 8)),
        "skyreels-v2": ("skyreels-v2-720p", (1, 16, 31, 90, 160), (31, 45, 80), 40, 128, 8, 40,
                        (1, 16, 8)),
        "wan-vace": ("wan-vace-720p", (1, 16, 21, 90, 160), (21, 45, 80), 40, 128, 10, 40,
                     (1, 16, 8)),
    }  # fmt: skip
    for model, (name, latent, grid, heads, head_dim, layers, full, tile) in want.items():
        w = _work("--model", model)
        got = (w.name, w.latent, w.grid_shape, w.heads, w.head_dim, w.layers, w.full_layers)
        assert got == (name, latent, grid, heads, head_dim, layers, full), model
        assert w.psa_tile == tile == e2e_model.least_padding_tile(grid), model
    hy = _work("--model", "hunyuanvideo")
    assert hy.tokens == 118_800 and hy.joint_text == 256 and hy.joint_text_real == 96
    assert hy.self_attn_len == 118_800 + 256 and hy.cross_keys is None
    assert (hy.config["num_layers"], hy.config["num_single_layers"]) == (3, 6)
    ltx2 = _work("--model", "ltx2")
    assert ltx2.tokens == 24_576 and ltx2.extra["audio_tokens"] == 126 and ltx2.cross_keys == 1024
    assert (
        _work("--model", "ltx").cross_keys == 128 and _work("--model", "cosmos").cross_keys == 512
    )
    vace = _work("--model", "wan-vace")
    assert vace.config["vace_layers"] == [0, 5] and vace.attention_layers == 12
    assert _work("--model", "ltx", "--resolution", "768x512").grid_shape == (16, 16, 24)
    assert _work("--model", "ltx2", "--resolution", "768x512").grid_shape == (16, 16, 24)
    # --layers all; HunyuanVideo keeps its dual:single proportion, at least one dual block
    assert _work("--model", "wan-vace", "--layers", "all").attention_layers == 48
    for layers, split in ((1, (1, 0)), (2, (1, 1)), (8, (3, 5)), (60, (20, 40))):
        c = _work("--model", "hunyuanvideo", "--layers", str(layers)).config
        assert (c["num_layers"], c["num_single_layers"]) == split
    with pytest.raises(SystemExit, match="1216x704"):
        _work("--model", "ltx", "--resolution", "720p")


def test_existing_psa_tiles_pad_least():
    for model in ("wan1.3b", "wan14b", "wan2.2-5b", "hunyuan1.5"):
        w = _work("--model", model)
        assert w.psa_tile == e2e_model.least_padding_tile(w.grid_shape), model


@pytest.mark.parametrize("model", NEW_MODELS)
def test_config_keys_are_the_class_parameters(model):
    """Every key of the config is a parameter of the installed class; where the comment says
    the published config is the class defaults, it is."""
    import diffusers

    entry = e2e_model.MODELS[model]
    cls = getattr(diffusers, e2e_model.CLASS_NAMES[entry.family])
    params = inspect.signature(cls.__init__).parameters
    assert set(entry.config) <= set(params) - {"self"}
    defaults = {"hunyuanvideo": (), "ltx": (), "ltx2": (), "wan-vace": ()}
    defaults["cosmos"] = ("in_channels", "concat_padding_mask")  # COSMOS_CONFIG says why
    if model in defaults:
        for key, value in entry.config.items():
            want = params[key].default
            got = tuple(value) if isinstance(value, tuple) else value
            want = tuple(want) if isinstance(want, tuple) else want
            assert (got == want) != (key in defaults[model]), key


@pytest.mark.parametrize(
    "model, billions",
    [("hunyuanvideo", 12.8), ("ltx", 1.9), ("ltx2", 18.9), ("cosmos", 7.2), ("kandinsky5", 2.0),
     ("skyreels-v2", 14.3), ("wan-vace", 17.3), ("chronoedit", 16.4), ("wan-animate", 17.3)],
)  # fmt: skip
def test_full_size_models_build_at_their_published_size(model, billions):
    """The whole model (all blocks) on the meta device: its parameter count (bf16 weights
    are twice it in GB)."""
    import diffusers

    work = _work("--model", model, "--layers", "all")
    with torch.device("meta"):
        net = getattr(diffusers, e2e_model.CLASS_NAMES[work.family])(**work.config)
    assert sum(p.numel() for p in net.parameters()) / 1e9 == pytest.approx(billions, abs=0.05)


def _small(work, grid=(2, 2, 2)):
    """``work`` on a tiny video grid (full-size conditioning), to check the inputs cheaply."""
    patch = work.spec.patch(work.config)
    latent = (*work.latent[:2], *(n * p for n, p in zip(grid, patch)))
    return dataclasses.replace(work, latent=latent, grid_shape=grid)


def _inputs(model):
    work = _small(_work("--model", model))
    return work, bench_e2e.make_inputs(work, torch.device("cpu"), torch.bfloat16, 0)


def test_new_inputs_match_the_pipelines():
    work, x = _inputs("hunyuanvideo")
    assert x["encoder_hidden_states"].shape == (1, 256, 4096)
    assert x["encoder_attention_mask"].sum() == 96 and x["encoder_attention_mask"][0, :96].all()
    assert (
        x["pooled_projections"].shape == (1, 768)
        and x["guidance"] == torch.tensor([6000.0]).bfloat16()
    )
    assert x["timestep"].dtype == torch.float32 and x["hidden_states"].shape == (1, 16, 2, 4, 4)

    work, x = _inputs("ltx")
    assert x["hidden_states"].shape == (1, 8, 128)  # packed [B, S, C]
    assert (x["num_frames"], x["height"], x["width"]) == (2, 2, 2)
    assert x["encoder_hidden_states"].shape == (1, 128, 4096)
    assert (
        x["encoder_attention_mask"].dtype == torch.bool and x["encoder_attention_mask"].sum() == 100
    )
    assert x["timestep"].dtype == torch.float32 and x["rope_interpolation_scale"] == (
        8 / 25,
        32,
        32,
    )

    work, x = _inputs("ltx2")
    assert x["hidden_states"].shape == (1, 8, 128) and x["audio_hidden_states"].shape == (
        1,
        126,
        128,
    )
    for key in ("encoder_hidden_states", "audio_encoder_hidden_states"):
        assert x[key].shape == (1, 1024, 3840)
    assert x["encoder_attention_mask"].all() and x["sigma"] is x["timestep"]
    assert x["fps"] == 24.0 and x["audio_num_frames"] == 126 and x["use_cross_timestep"] is False

    work, x = _inputs("cosmos")
    assert x["hidden_states"].shape == (1, 16, 2, 4, 4)
    assert not x["condition_mask"].any() and x["condition_mask"].shape == (1, 1, 2, 4, 4)
    text = x["encoder_hidden_states"]
    assert text.shape == (1, 512, 1024) and not text[:, 128:].any() and text[:, :128].any()
    assert x["timestep"].item() == pytest.approx(0.25 * math.log(4.0), rel=1e-2) and x["fps"] == 30

    work, x = _inputs("kandinsky5")
    assert x["hidden_states"].shape == (1, 2, 4, 4, 33)  # channels-last
    assert not x["hidden_states"][..., 16:].any()  # T2V: zero visual condition and mask
    assert x["encoder_hidden_states"].shape == (1, 128, 3584) and len(x["text_rope_pos"]) == 128
    assert x["pooled_projections"].shape == (1, 768) and x["sparse_params"] is None
    assert [len(p) for p in x["visual_rope_pos"]] == [2, 2, 2]

    work, x = _inputs("skyreels-v2")
    assert x["encoder_hidden_states"].shape == (1, 512, 4096) and x["timestep"].tolist() == [500]

    work, x = _inputs("wan-vace")
    control = x["control_hidden_states"]
    assert control.shape == (1, 96, 2, 4, 4) and (control[:, 32:] == 1).all()
    assert x["control_hidden_states_scale"].shape == (2,)  # VACE blocks 0 and 5 of 10


def test_kandinsky5_modulations_are_not_zero():
    """Kandinsky 5's adaLN-zero modulations are drawn at random, or every block would be an
    identity and the attention invisible in the output."""
    work = _work("--tiny", "--model", "kandinsky5")
    model = bench_e2e.build_model(work, torch.device("cpu"), torch.float32, 0)
    mods = [m for m in model.modules() if type(m).__name__ == "Kandinsky5Modulation"]
    assert mods and all(m.out_layer.weight.any() for m in mods)


@pytest.mark.parametrize("model", NEW_MODELS)
@pytest.mark.parametrize("target", [0.6, 0.75])
def test_synthetic_plan_covers_every_attention_layer(model, target):
    work = _work("--model", model)
    plan, achieved, patterns = bench_e2e.synthetic_plan(
        work, target, random.Random(0), bench_e2e.PSA_TOLERANCE
    )
    assert abs(achieved - target) <= 2 * bench_e2e.PSA_SLACK
    assert plan.grid.shape == work.grid_shape and plan.num_heads == work.heads
    assert sum(patterns.values()) == work.attention_layers * work.heads


def test_head_dims_the_kernels_do_not_take_are_reported(monkeypatch):
    """On the GPU path: head_dim 64 (LTX-Video, Kandinsky 5) runs, noted; one the Triton
    kernels do not take makes the sparse rows record why, without running."""
    import vidsparse.utils.backend as backend

    monkeypatch.setattr(backend, "resolve_backend", lambda device: "triton")
    cuda = torch.device("cuda")
    skip, note = bench_e2e.kernel_support(_work("--model", "ltx"), cuda)
    assert skip is None and "head_dim 64" in note and "Triton" in note
    assert bench_e2e.kernel_support(_work("--model", "cosmos"), cuda) == (None, None)
    odd = _work("--model", "ltx")
    odd = dataclasses.replace(odd, config={**odd.config, "attention_head_dim": 48})
    skip, _ = bench_e2e.kernel_support(odd, cuda)
    assert "head_dim 48 is not supported" in skip
    args = bench_e2e.parse_args(["--device", "cuda", "--model", "ltx", "--psa-sparsities", "0.6"])
    methods = bench_e2e.make_methods(args, dataclasses.replace(_small(odd, (4, 16, 16))))
    assert [m.skip is not None for m in methods] == [False, True, True]
    row, ref = bench_e2e.run_method(methods[1], None, {}, odd, cuda, args, None)
    assert row["error"] == skip and ref is None
    assert bench_e2e.kernel_support(odd, torch.device("cpu")) == (None, None)  # torch path


def test_cosmos_blocks_compile_regionally():
    """CosmosTransformer3DModel declares no _repeated_blocks: the benchmark names its block
    class, so --compile blocks compiles each block."""
    work = _work("--tiny", "--model", "cosmos")
    model = bench_e2e.build_model(work, torch.device("cpu"), torch.float32, 0)
    bench_e2e.compile_blocks(model, work)
    assert model._repeated_blocks == ["CosmosTransformerBlock"]
    assert all(b._compiled_call_impl is not None for b in model.transformer_blocks)


def test_new_default_out_names():
    cpu = torch.device("cpu")
    for model in NEW_MODELS:
        work = _work("--model", model)
        assert bench_e2e.default_out(cpu, work).name == f"e2e_{work.name}_cpu.json"


# ---- ChronoEdit and Wan-Animate ---------------------------------------------------------------


@pytest.mark.slow
def test_chronoedit_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("chronoedit", tmp_path)
    assert meta["model_class"] == "ChronoEditTransformer3DModel"
    assert meta["grid"] == [2, 6, 10] and meta["image_tokens"] == 4  # the 2-frame edit
    for r in rows:
        # per block: the video self-attention; the image and the text cross-attention
        assert r["attn_calls_per_step"] == meta["layers"]
        assert r["cross_attn_calls_per_step"] == 2 * meta["layers"]
        assert "other_attn_ms" not in r


@pytest.mark.slow
def test_wan_animate_tiny_run(tmp_path):
    meta, rows = _meta_and_rows("wan-animate", tmp_path)
    assert meta["model_class"] == "WanAnimateTransformer3DModel"
    assert meta["grid"] == [5, 6, 10] and meta["face_frames"] == 13
    assert meta["face_adapter_blocks"] == [0]
    for r in rows:
        # the face adapter (frame tokens -> face tokens) is cross-attention, not the video's
        # self-attention: only the blocks' self-attention reaches the method
        assert r["attn_calls_per_step"] == meta["layers"]
        assert r["cross_attn_calls_per_step"] == 2 * meta["layers"] + 1
        assert "other_attn_ms" not in r
    psa = next(r for r in rows if r["method"] == "psa")
    assert sum(psa["patterns"].values()) == meta["layers"] * meta["heads"]


def test_chronoedit_and_wan_animate_full_size():
    chrono = _work("--model", "chronoedit")
    assert chrono.name == "chronoedit-720p" and chrono.latent == (1, 36, 2, 90, 160)
    assert chrono.grid_shape == (2, 45, 80) and chrono.tokens == 7_200 and chrono.heads == 40
    assert (chrono.layers, chrono.full_layers) == (40, 40) and chrono.psa_tile == (1, 16, 8)
    assert chrono.image == (1, 257, 1280) and chrono.cross_keys == 512
    c = chrono.config
    assert (c["in_channels"], c["image_dim"], c["added_kv_proj_dim"]) == (36, 1280, 5120)
    # temporal reasoning's 29 frames: 8 latent frames
    assert _work("--model", "chronoedit", "--frames", "29").grid_shape == (8, 45, 80)
    assert _work("--model", "chronoedit", "--resolution", "480p").grid_shape == (2, 30, 52)

    anim = _work("--model", "wan-animate")
    assert anim.name == "wan-animate-720p" and anim.latent == (1, 36, 21, 90, 160)
    assert anim.grid_shape == (21, 45, 80) and anim.tokens == 75_600 and anim.heads == 40
    assert (anim.layers, anim.full_layers) == (10, 40) and anim.psa_tile == (1, 16, 8)
    assert anim.extra["face_frames"] == 77 and anim.extra["face_size"] == 512
    assert anim.extra["face_adapter_blocks"] == [0, 5] and anim.attention_layers == 10
    assert "face adapters" in anim.spec.layers_note(anim)
    assert _work("--model", "wan-animate", "--layers", "8").extra["face_adapter_blocks"] == [0, 5]
    full = _work("--model", "wan-animate", "--layers", "all")
    assert full.extra["face_adapter_blocks"] == list(range(0, 40, 5))


def test_chronoedit_and_wan_animate_inputs_match_the_pipelines():
    work, x = _inputs("chronoedit")
    h = x["hidden_states"]
    assert h.shape == (1, 36, 2, 4, 4) and x["timestep"].tolist() == [500]
    assert (h[:, 16:20, 0] == 1).all() and not h[:, 16:20, 1:].any()  # the input image's mask
    assert x["encoder_hidden_states"].shape == (1, 512, 4096)
    assert x["encoder_hidden_states_image"].shape == (1, 257, 1280)

    work, x = _inputs("wan-animate")
    h = x["hidden_states"]
    assert h.shape == (1, 36, 2, 4, 4) and (h[:, 16:20, 0] == 1).all()
    assert not h[:, 16:20, 1:].any()  # the reference frame's mask; the segment's all zeros
    assert x["pose_hidden_states"].shape == (1, 16, 1, 4, 4)
    assert x["encoder_hidden_states_image"].shape == (1, 257, 1280)
    face = x["face_pixel_values"]
    assert face.shape == (1, 3, 77, 512, 512) and face.min() >= -1 and face.max() <= 1


def test_wan_animate_cut_to_any_layers_keeps_its_face_adapters():
    """A cut that is no multiple of inject_face_latents_blocks still has an adapter after every
    adapted block (the class alone would build one too few) and runs."""
    work = _work("--tiny", "--model", "wan-animate", "--layers", "1")
    assert work.extra["face_adapter_blocks"] == [0]
    model = bench_e2e.build_model(work, torch.device("cpu"), torch.float32, 0)
    assert len(model.blocks) == 1 and len(model.face_adapter) == 1
    inputs = bench_e2e.make_inputs(work, torch.device("cpu"), torch.float32, 0)
    with torch.no_grad():
        out = model(**inputs)[0]
    assert out.shape == (1, 4, *work.latent[2:]) and torch.isfinite(out).all()
