"""The e2e benchmark's Wan 2.2 TI2V-5B and HunyuanVideo 1.5 workloads: tiny runs of the same
diffusers classes on the CPU (numbers meaningless, code paths real), the full-size workloads'
shapes, and the attention timer counting every call once."""

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


def _tiny_run(model: str, tmp_path) -> dict:
    out = tmp_path / f"e2e_{model}.json"
    rows = bench_e2e.main([*FAST, *METHODS, "--model", model, "--out", str(out)])
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
        # every block's video self-attention, timed once (not once more inside the method)
        assert r["attn_calls_per_step"] == meta["layers"]
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
