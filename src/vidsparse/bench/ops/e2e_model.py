"""The end-to-end benchmark's model and inputs: diffusers' Wan 2.1 transformer built from its
published config (random weights), one step's latents and text states, and synthetic PSA plans.
See ``vidsparse.bench.ops.e2e`` for what is measured.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from vidsparse.bench import shapes

# ---------------------------------------------------------------------------------------------
# models and inputs
# ---------------------------------------------------------------------------------------------

# The published diffusers configs of Wan 2.1 T2V (Wan-AI/Wan2.1-T2V-1.3B-Diffusers and
# Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json): heads, head_dim and layers are the
# shape registry's (1.3B = 12 heads x 128 = 1536 hidden, 30 layers; 14B = 40 x 128 = 5120,
# 40 layers); ffn 8960 / 13824. text_dim 4096 is the umT5-XXL encoder's width.
_WAN_SHAPES = {"wan1.3b": shapes.MODELS["wan1.3b-480p"], "wan14b": shapes.MODELS["wan14b-720p"]}
PATCH = (1, 2, 2)
_WAN_COMMON = dict(
    patch_size=PATCH,
    attention_head_dim=shapes.HEAD_DIM,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
_FFN_DIM = {"wan1.3b": 8960, "wan14b": 13824}
WAN_CONFIGS = {
    name: dict(
        _WAN_COMMON,
        num_attention_heads=shape.heads,
        ffn_dim=_FFN_DIM[name],
        num_layers=shape.layers,
    )
    for name, shape in _WAN_SHAPES.items()
}
MODEL_NAMES = {"wan1.3b": "wan2.1-t2v-1.3b", "wan14b": "wan2.1-t2v-14b"}
DEFAULT_RESOLUTION = {"wan1.3b": "480p", "wan14b": "720p"}
DEFAULT_LAYERS = {"wan1.3b": 30, "wan14b": 8}
# Latent height x width of the VAE (8x spatial downsampling, before the 2x2 patch): 480x832
# and 720x1280 videos, from the registry's token grids.
LATENT_HW = {
    res: (shape.grid[1] * PATCH[1], shape.grid[2] * PATCH[2])
    for res, shape in (("480p", _WAN_SHAPES["wan1.3b"]), ("720p", _WAN_SHAPES["wan14b"]))
}
LATENT_CHANNELS = 16
TEXT_TOKENS = 512  # WanPipeline pads prompts to max_sequence_length=512
TIMESTEP = 500

# Tiny CPU smoke model: 2 heads of 32, 2 blocks; latents 5x12x20 -> a 5x6x10 token grid (partial
# 4x4x4 tiles at every edge); 16 text tokens (not the video token count, so self- and
# cross-attention calls are told apart by their key length, as at full size).
TINY_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=32,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    rope_max_seq_len=64,
)
TINY_LATENT = (1, 4, 5, 12, 20)
TINY_TEXT = (1, 16, 32)

VSA_TILE = (4, 4, 4)  # the integration's default; the VSA kernels work on 64-token tiles
# 128-token blocks (the engine's fast 128x128 configuration) that pad Wan's grids least:
# 480p 21x30x52 -> 21x32x56 (37,632 slots; 2x8x8 makes 39,424, 1x8x16 43,008); 720p
# 21x45x80 -> 21x48x80 (80,640, as 1x8x16; 2x8x8 makes 84,480).
DEFAULT_PSA_TILE = "1x16x8"
TINY_PSA_TILE = (1, 4, 4)
PSA_SLACK = 0.005  # how far the running mean of the drawn specs may stray from the target
PSA_TOLERANCE = 0.1  # the family is coarse near 0.6-0.75 on these grids (4-6 candidates)

DIFFUSERS_MISSING = (
    "the e2e benchmark needs diffusers>=0.36, which this Python cannot import ({exc}); on a GPU "
    "machine without network access, download its wheels on one with it (`python -m pip download "
    "--only-binary=:all: --python-version 3.12 --implementation cp --platform "
    "manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d wheels/ diffusers==0.42.1`), "
    "copy wheels/ over, install them with `python3 -m pip install --no-index --no-deps --target "
    "/tmp/site wheels/*.whl` and set PYTHONPATH=/tmp/site:src (benchmarks/README.md, 'End to "
    "end in diffusers', says which wheels to keep)"
)


def import_wan():
    """diffusers' ``WanTransformer3DModel``, or exit with one line saying how to install it."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as exc:
        raise SystemExit(DIFFUSERS_MISSING.format(exc=exc)) from None
    return WanTransformer3DModel


@dataclass(frozen=True)
class Workload:
    """The model to build and the inputs of one step."""

    name: str  # "wan1.3b-480p", "tiny"
    model_name: str  # the plan's model string
    config: dict
    layers: int
    full_layers: int
    latent: tuple[int, ...]  # [B, C, F, H, W]
    text: tuple[int, int, int]  # [B, tokens, text_dim]
    grid_shape: tuple[int, int, int]  # tokens after the patch
    psa_tile: tuple[int, int, int]

    @property
    def heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def tokens(self) -> int:
        return math.prod(self.grid_shape)


def make_workload(args) -> Workload:
    if args.tiny:
        config = dict(TINY_CONFIG)
        layers = args.layers or config["num_layers"]
        latent, text, psa_tile = TINY_LATENT, TINY_TEXT, TINY_PSA_TILE
        name, model_name, full = "tiny", "tiny-wan", config["num_layers"]
    else:
        config = dict(WAN_CONFIGS[args.model])
        full = config["num_layers"]
        layers = args.layers or DEFAULT_LAYERS[args.model]
        resolution = args.resolution or DEFAULT_RESOLUTION[args.model]
        h, w = LATENT_HW[resolution]
        frames = (args.frames - 1) // 4 + 1  # the VAE's 4x temporal compression (81 -> 21)
        latent = (1, LATENT_CHANNELS, frames, h, w)
        text = (1, TEXT_TOKENS, config["text_dim"])
        psa_tile = parse_tile(args.psa_tile)
        name, model_name = f"{args.model}-{resolution}", MODEL_NAMES[args.model]
    if not 1 <= layers <= full:
        raise SystemExit(f"--layers must lie in [1, {full}] for this model, got {layers}")
    config["num_layers"] = layers
    p_t, p_h, p_w = config["patch_size"]
    grid_shape = (latent[2] // p_t, latent[3] // p_h, latent[4] // p_w)
    return Workload(name, model_name, config, layers, full, latent, text, grid_shape, psa_tile)


def parse_tile(text: str) -> tuple[int, int, int]:
    parts = tuple(int(x) for x in text.lower().split("x"))
    if len(parts) != 3 or min(parts) < 1:
        raise SystemExit(f"a tile is TxHxW, e.g. 2x8x8; got {text!r}")
    return parts


def build_model(work: Workload, device: torch.device, dtype: torch.dtype, seed: int):
    """Random-weight transformer on ``device`` in ``dtype``; modules diffusers keeps in fp32 when
    it loads a checkpoint in bf16 (``_keep_in_fp32_modules``: RoPE tables, time embedder,
    scale/shift tables, the FP32LayerNorms) are kept in fp32 here too."""
    cls = import_wan()
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the GPU: seconds, not minutes, for 14B
        model = cls(**work.config)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    # Tensor by tensor (``model.to(dtype)`` would cast the fp32 modules too, and warn).
    for module_name, module in model.named_modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None or not t.is_floating_point():
                    continue
                full = f"{module_name}.{name}" if module_name else name
                target = torch.float32 if keep.intersection(full.split(".")) else dtype
                if isinstance(t, torch.nn.Parameter):
                    t.data = t.data.to(target)
                else:
                    tensors[name] = t.to(target)
    return model.eval().requires_grad_(False)


def make_inputs(work: Workload, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "hidden_states": torch.randn(work.latent, generator=g).to(device, dtype),
        "timestep": torch.tensor([TIMESTEP], device=device),
        "encoder_hidden_states": torch.randn(work.text, generator=g).to(device, dtype),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------
# PSA plans
# ---------------------------------------------------------------------------------------------


def synthetic_plan(work: Workload, target: float, rng: random.Random, tolerance: float):
    """A one-step PSA plan with a spec near ``target`` for every (layer, head).

    Returns ``(plan, achieved sparsity, pattern histogram)``. The candidates are the default
    family's distinct masks on the block grid (dense excluded) within ``tolerance`` of the
    target, plus the nearest one on each side of the target where that side has none within
    it (on Wan 480p in 1x16x8 blocks the family has nothing between 0.499 and 0.663, so a
    target of 0.6 mixes the two), drawn uniformly at random; a draw that would move the
    running mean more than ``PSA_SLACK`` off the target is redrawn from the side that brings
    it back, so the model-wide mean lands on the target while the heads still mix patterns.
    """
    from vidsparse.layout.grid import VideoGrid
    from vidsparse.search.candidates import CandidateFamily
    from vidsparse.search.plan import HeadChoice, Plan, PlanBucket

    grid = VideoGrid(work.grid_shape, work.psa_tile)
    cands = CandidateFamily().on_grid(grid.tiles)
    sparsity = cands.sparsity.tolist()
    sparse = [i for i in range(len(cands)) if sparsity[i] > 0.0]
    pool = [i for i in sparse if abs(sparsity[i] - target) <= tolerance]
    for side in (
        [i for i in sparse if sparsity[i] <= target],
        [i for i in sparse if sparsity[i] >= target],
    ):
        if side and not set(side) & set(pool):
            pool.append(min(side, key=lambda i: abs(sparsity[i] - target)))
    below = [i for i in pool if sparsity[i] <= target]
    above = [i for i in pool if sparsity[i] >= target]
    total, drawn = 0.0, 0
    patterns: Counter[str] = Counter()
    layers = {}
    for layer in range(work.layers):
        heads = []
        for _ in range(work.heads):
            i = rng.choice(pool)
            mean = (total + sparsity[i]) / (drawn + 1)
            if abs(mean - target) > PSA_SLACK:
                i = rng.choice((below if mean > target else above) or pool)
            total, drawn = total + sparsity[i], drawn + 1
            patterns[str(cands[i])] += 1
            # No search ran: the objective fields are unknown (NaN), not zero.
            heads.append(
                HeadChoice(cands[i].spec, cands[i].spatial_unit, sparsity[i], math.nan, math.nan)
            )
        layers[layer] = tuple(heads)
    plan = Plan(
        model=work.model_name,
        grid=grid,
        num_heads=work.heads,
        num_steps=1,
        dense_steps=0,
        buckets=(PlanBucket(0, 1, layers),),
        selection={"mode": "target", "alpha": None, "target_sparsity": target, "metric": "rel_l2"},
        search={"num_candidates": len(cands), "query_fraction": 1.0, "num_samples": 0},
    )
    return plan, total / drawn, dict(patterns.most_common())


def plan_file_method(path: str, work: Workload) -> tuple[Any, int, float, dict]:
    """A searched plan file: ``(plan, step, sparsity at that step, patterns)``; it runs at its
    first sparse step (``dense_steps``)."""
    from vidsparse.search.plan import load_plan

    plan = load_plan(path)
    step = plan.dense_steps
    if step >= plan.num_steps:
        raise ValueError(f"the plan {path} runs every step dense")
    bucket = plan.bucket_for(step)
    choices = [c for heads in bucket.layers.values() for c in heads]
    patterns = Counter(str(c.candidate) for c in choices)
    sparsity = sum(c.sparsity for c in choices) / len(choices)
    return plan, step, sparsity, dict(patterns.most_common())
