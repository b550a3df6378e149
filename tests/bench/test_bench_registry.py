"""The op registry and the shape registry: every op declares shapes, an input builder and
providers its module implements; the shapes are the models' published token grids."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vidsparse.bench import registry, shapes


@pytest.mark.parametrize("name", registry.names())
def test_every_op_has_shapes_inputs_and_providers(name):
    op = registry.get(name)
    assert op.shapes and op.providers and op.description
    for shape in op.shapes:
        shapes.get(shape)  # a registered shape, by name
    names = op.provider_names
    assert len(set(names)) == len(names)
    assert op.default_providers, "an op with no default provider runs nothing"
    assert sum(p.reference for p in op.providers) <= 1
    for p in op.providers:
        assert p.description
        assert set(p.needs) <= set(registry.REQUIREMENTS), (p.name, p.needs)
    module = op.load()
    assert callable(module.main)
    assert callable(op.input_builder())
    # The module implements exactly the providers the registry lists.
    assert set(module.PROVIDERS) == set(names), (name, module.PROVIDERS, names)
    assert op.launcher in ("python", "torchrun")
    assert op.tiny_args is None or "--tiny" in op.tiny_args or "--dry-run" in op.tiny_args


def test_aliases_and_unknown_names():
    assert registry.get("engine") is registry.get("block_sparse")
    with pytest.raises(KeyError, match="block_sparse"):
        registry.get("nope")


def test_listing_names_every_op_and_provider():
    text = registry.describe()
    for op in registry.OPS.values():
        assert op.name in text
        for p in op.providers:
            assert p.name in text


def test_unavailable_provider_gives_a_one_line_reason(monkeypatch):
    monkeypatch.setitem(registry.REQUIREMENTS, "sta", lambda device: "not in this build")
    cpu = torch.device("cpu")
    assert registry.unavailable("sta", "ours", cpu) == "ours: not in this build"
    with pytest.raises(registry.ProviderUnavailable, match="ours: not in this build"):
        registry.require("sta", "ours", cpu)
    # cuDNN and flash are GPU backends of SDPA: on the CPU they are skipped, not substituted.
    assert "GPU backend" in registry.unavailable("sta", "cudnn", cpu)
    assert "GPU backend" in registry.unavailable("block_sparse", "flash", cpu)
    assert registry.unavailable("block_sparse", "flex", cpu) is None  # eager forward on CPU
    assert "no backward" in registry.mode_unavailable("block_sparse", "flex", "fwd+bwd", cpu)
    assert registry.mode_unavailable("block_sparse", "flex", "fwd", cpu) is None
    assert registry.mode_unavailable("block_sparse", "ours", "bwd", cpu) is None
    assert registry.unavailable("e2e_ulysses", "vsa", cpu).startswith("vsa: needs a CUDA GPU")


@pytest.mark.parametrize("need", sorted(registry.REQUIREMENTS))
def test_requirement_checks_answer_without_raising(need):
    reason = registry.REQUIREMENTS[need](torch.device("cpu"))
    assert reason is None or (isinstance(reason, str) and "\n" not in reason)


# ---- shapes ---------------------------------------------------------------------------------

# name: (video tokens, heads, layers, text tokens)
PUBLISHED = {
    "wan1.3b-480p": (21 * 30 * 52, 12, 30, 0),
    "wan14b-720p": (21 * 45 * 80, 40, 40, 0),
    "hunyuan-720p": (33 * 45 * 80, 24, 60, 256),
    "wan2.2-5b-720p": (31 * 22 * 40, 24, 30, 0),
    "wan2.2-a14b-720p": (21 * 45 * 80, 40, 40, 0),
    "hunyuan1.5-720p": (31 * 45 * 80, 16, 54, 0),
}


def test_model_shapes_match_the_models_token_counts():
    assert set(shapes.MODELS) == set(PUBLISHED)
    for name, (tokens, heads, layers, text) in PUBLISHED.items():
        m = shapes.MODELS[name]
        assert (m.tokens, m.heads, m.layers, m.text_tokens) == (tokens, heads, layers, text)
        assert m.head_dim == 128 and m.hidden == heads * 128
        # Latent frames: the VAEs' 4x temporal compression of F = 4k + 1 frames.
        assert m.grid[0] == (m.frames - 1) // 4 + 1
    assert shapes.MODELS["wan1.3b-480p"].tokens == 32_760
    assert shapes.MODELS["wan14b-720p"].tokens == 75_600
    assert shapes.MODELS["hunyuan-720p"].tokens == 118_800
    assert shapes.MODELS["wan2.2-a14b-720p"].grid == shapes.MODELS["wan14b-720p"].grid
    assert shapes.MODELS["hunyuan1.5-720p"].estimate is True
    assert sum(m.estimate for m in shapes.MODELS.values()) == 1


def test_model_shapes_in_4x4x4_tiles():
    """The tile counts and padded lengths the committed results were measured at."""
    want = {
        "wan1.3b-480p": (624, 39_936),
        "wan14b-720p": (1_440, 92_160),
        "hunyuan-720p": (2_160, 138_240),
    }
    for name, (tiles, padded) in want.items():
        grid = shapes.MODELS[name].video_grid()
        assert (grid.num_tiles, grid.padded_len) == (tiles, padded)


def test_select_and_unknown_shape():
    assert [s.name for s in shapes.select("wan14b-720p, hunyuan-720p")] == [
        "wan14b-720p",
        "hunyuan-720p",
    ]
    assert shapes.get("synthetic-32k").seq_len == 32768
    with pytest.raises(ValueError, match="wan1.3b-480p"):
        shapes.select("wan-nope")


E2E_SHAPES = {
    "wan1.3b": "wan1.3b-480p",
    "wan14b": "wan14b-720p",
    "wan2.2-5b": "wan2.2-5b-720p",
    "hunyuan1.5": "hunyuan1.5-720p",
}


@pytest.mark.parametrize("model", sorted(E2E_SHAPES))
def test_e2e_model_takes_its_dims_from_the_shape_registry(model):
    from vidsparse.bench.ops import e2e_model

    m = shapes.MODELS[E2E_SHAPES[model]]
    config = e2e_model.CONFIGS[model]
    assert config["num_attention_heads"] == m.heads and config["num_layers"] == m.layers
    assert config["attention_head_dim"] == m.head_dim
    args = SimpleNamespace(
        tiny=False, model=model, layers=None, resolution=None, frames=m.frames, psa_tile="1x16x8"
    )
    work = e2e_model.make_workload(args)
    assert work.grid_shape == m.grid and work.tokens == m.tokens and work.heads == m.heads


def test_other_ops_read_the_shape_registry():
    from vidsparse.bench.ops import block_sparse, parallel, psa, vsa

    for name, (grid, heads) in {**vsa.SHAPES, **psa.SHAPES}.items():
        assert (grid, heads) == (shapes.MODELS[name].grid, shapes.MODELS[name].heads)
    layer = parallel.WAN14B_720P
    assert layer.grid.shape == shapes.MODELS["wan14b-720p"].grid and layer.heads == 40
    real = block_sparse.build_shapes("real", tiny=False)
    assert [s.name for s in real] == ["wan1.3b-480p", "wan14b-720p", "hunyuan-720p"]
    assert all(s.real_len == shapes.MODELS[s.name].tokens for s in real)
    # Any registered model can be asked for by name.
    (five_b,) = block_sparse.build_shapes("wan2.2-5b-720p", tiny=False)
    assert five_b.real_len == math.prod((31, 22, 40)) and five_b.heads == 24
