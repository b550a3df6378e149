"""The end-to-end benchmark's models and inputs: diffusers' video transformers built from their
published configs (random weights), one step's latents and conditioning, and synthetic PSA
plans. See ``vidsparse.bench.ops.e2e`` for what is measured.

Workloads (``--model``): Wan 2.1 T2V 1.3B (480p) and 14B (720p), Wan 2.2 TI2V-5B (704x1280,
121 frames; ``WanTransformer3DModel``) and HunyuanVideo 1.5 (720p, 121 frames;
``HunyuanVideo15Transformer3DModel``, whose self-attention is joint video + text attention).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from vidsparse.bench import shapes

# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------

PATCH = (1, 2, 2)  # Wan's patch
# The published diffusers configs of Wan 2.1 T2V (Wan-AI/Wan2.1-T2V-1.3B-Diffusers and
# Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json) and Wan 2.2 TI2V-5B
# (Wan-AI/Wan2.2-TI2V-5B-Diffusers): heads, head_dim and layers are the shape registry's
# (1.3B = 12 heads x 128 = 1536 hidden, 30 layers; 14B = 40 x 128 = 5120, 40 layers; 5B = 24 x
# 128 = 3072, 30 layers); ffn 8960 / 13824 / 14336. text_dim 4096 is the umT5-XXL encoder's
# width. Wan 2.2's VAE has 48 latent channels (16x16x4 compression), Wan 2.1's 16 (8x8x4).
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
_WAN_SHAPES = {
    "wan1.3b": shapes.MODELS["wan1.3b-480p"],
    "wan14b": shapes.MODELS["wan14b-720p"],
    "wan2.2-5b": shapes.MODELS["wan2.2-5b-720p"],
}
_FFN_DIM = {"wan1.3b": 8960, "wan14b": 13824, "wan2.2-5b": 14336}
_WAN_CHANNELS = {"wan1.3b": 16, "wan14b": 16, "wan2.2-5b": 48}
WAN_CONFIGS = {
    name: dict(
        _WAN_COMMON,
        num_attention_heads=shape.heads,
        ffn_dim=_FFN_DIM[name],
        num_layers=shape.layers,
        in_channels=_WAN_CHANNELS[name],
        out_channels=_WAN_CHANNELS[name],
    )
    for name, shape in _WAN_SHAPES.items()
}

# HunyuanVideo 1.5 (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-*): the class defaults of
# diffusers' HunyuanVideo15Transformer3DModel, which are the released 8.3B model's (Tencent's
# config: 54 double-stream blocks of 16 heads x 128 = 2048, patch 1x1x1, Qwen2.5-VL text
# states 3584 wide, byT5 1472, SigLIP image states 1152, RoPE axes 16/56/56). in_channels 65:
# 32 noisy latents, 32 condition latents (zeros for T2V) and a 1-channel mask. target_size and
# task_type only name the checkpoint; the forward does not read them.
_HY15_SHAPE = shapes.MODELS["hunyuan1.5-720p"]
HUNYUAN15_CONFIG = dict(
    in_channels=65,
    out_channels=32,
    num_attention_heads=_HY15_SHAPE.heads,
    attention_head_dim=_HY15_SHAPE.head_dim,
    num_layers=_HY15_SHAPE.layers,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
    use_meanflow=False,
)
CONFIGS = {**WAN_CONFIGS, "hunyuan1.5": HUNYUAN15_CONFIG}

# The conditioning HunyuanVideo15Pipeline hands the transformer for a text-to-video step:
# Qwen2.5-VL states padded to tokenizer_max_length=1000, byT5 glyph states padded to 256,
# 729 SigLIP image tokens that are zeros for T2V (the transformer masks them all out). A
# realistic prompt fills part of that: REAL of each (the masks mark the rest as padding).
HY15_TEXT = (1000, 400)  # (tokens, real tokens) of the Qwen2.5-VL (mllm) states
HY15_BYT5 = (256, 32)  # of the byT5 states (a short quoted caption)
HY15_IMAGE_TOKENS = 729  # vision_num_semantic_tokens


@dataclass(frozen=True)
class ModelEntry:
    """One ``--model``: the diffusers class, its config, and the workload's defaults."""

    family: str  # "wan" (WanTransformer3DModel) or "hunyuan1.5" (HunyuanVideo15Transformer3DModel)
    model_name: str  # the plan's model string
    config: dict
    default_layers: int
    latent_channels: int  # noisy latents (HunyuanVideo 1.5: + condition latents and a mask)
    latent_hw: dict  # resolution -> latent (H, W), before the patch
    default_resolution: str
    default_frames: int
    psa_tile: str  # the default PSA block
    per_token_timestep: bool = False  # Wan 2.2 TI2V-5B's pipeline: a timestep per token


def _latent_hw(shape: shapes.ModelShape, patch) -> tuple[int, int]:
    return (shape.grid[1] * patch[1], shape.grid[2] * patch[2])


# Wan 2.1's latent height x width (8x VAE, before the 2x2 patch): 480x832 and 720x1280 videos,
# from the registry's token grids.
LATENT_HW = {
    "480p": _latent_hw(_WAN_SHAPES["wan1.3b"], PATCH),
    "720p": _latent_hw(_WAN_SHAPES["wan14b"], PATCH),
}
# 128-token PSA blocks (the engine's fast 128x128 configuration) that pad the grids least:
# Wan 480p 21x30x52 -> 21x32x56 (37,632 slots; 2x8x8 makes 39,424, 1x8x16 43,008); Wan 720p
# 21x45x80 -> 21x48x80 (80,640, as 1x8x16; 2x8x8 makes 84,480); HunyuanVideo 1.5 720p
# 31x45x80 -> 31x48x80 (119,040); Wan 2.2 5B 31x22x40 -> 32x24x40 in 2x8x8 (30,720; 1x16x8
# would make 39,680, 1x8x16 35,712).
DEFAULT_PSA_TILE = "1x16x8"
MODELS = {
    "wan1.3b": ModelEntry(
        "wan", "wan2.1-t2v-1.3b", WAN_CONFIGS["wan1.3b"], 30, 16, LATENT_HW, "480p", 81,
        DEFAULT_PSA_TILE,
    ),
    "wan14b": ModelEntry(
        "wan", "wan2.1-t2v-14b", WAN_CONFIGS["wan14b"], 8, 16, LATENT_HW, "720p", 81,
        DEFAULT_PSA_TILE,
    ),
    # 704x1280 under the 16x VAE: 44x80 latents, 22x40 tokens a frame.
    "wan2.2-5b": ModelEntry(
        "wan", "wan2.2-ti2v-5b", WAN_CONFIGS["wan2.2-5b"], 30, 48,
        {"720p": _latent_hw(_WAN_SHAPES["wan2.2-5b"], PATCH)}, "720p", 121, "2x8x8",
        per_token_timestep=True,
    ),
    # 16x VAE, patch 1: 720p -> 45x80 latents; 480p (848x480) -> 30x53.
    "hunyuan1.5": ModelEntry(
        "hunyuan1.5", "hunyuanvideo1.5-t2v", HUNYUAN15_CONFIG, 8, 65,
        {"480p": (30, 53), "720p": _latent_hw(_HY15_SHAPE, (1, 1, 1))}, "720p", 121,
        DEFAULT_PSA_TILE,
    ),
}  # fmt: skip
MODEL_NAMES = {name: entry.model_name for name, entry in MODELS.items()}
DEFAULT_RESOLUTION = {name: entry.default_resolution for name, entry in MODELS.items()}
DEFAULT_LAYERS = {name: entry.default_layers for name, entry in MODELS.items()}
LATENT_CHANNELS = 16  # Wan 2.1's
TEXT_TOKENS = 512  # WanPipeline pads prompts to max_sequence_length=512
TIMESTEP = 500

# Tiny CPU smoke models: 2 heads of 32, 2 blocks; a 5x6x10 token grid (partial 4x4x4 tiles at
# every edge); text lengths unlike the video token count, so self- and cross-attention calls
# are told apart by their key length, as at full size.
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
TINY_HY15_CONFIG = dict(
    in_channels=9,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=32,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=32,
    text_embed_2_dim=16,
    image_embed_dim=16,
    rope_axes_dim=(8, 12, 12),
)
TINY_HY15 = dict(latent=(1, 9, 5, 6, 10), text=(16, 10), byt5=(8, 3), image=4)

VSA_TILE = (4, 4, 4)  # the integration's default; the VSA kernels work on 64-token tiles
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
CLASS_NAMES = {"wan": "WanTransformer3DModel", "hunyuan1.5": "HunyuanVideo15Transformer3DModel"}


def import_model(family: str = "wan"):
    """The diffusers transformer class of ``family``, or exit with one line saying how to
    install diffusers."""
    try:
        import diffusers

        return getattr(diffusers, CLASS_NAMES[family])
    except (ImportError, AttributeError) as exc:
        raise SystemExit(DIFFUSERS_MISSING.format(exc=exc)) from None


def import_wan():
    """diffusers' ``WanTransformer3DModel``, or exit with one line saying how to install it."""
    return import_model("wan")


# ---------------------------------------------------------------------------------------------
# workloads and inputs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The model to build and the inputs of one step."""

    name: str  # "wan1.3b-480p", "hunyuan1.5-720p", "tiny", ...
    model_name: str  # the plan's model string
    config: dict
    layers: int
    full_layers: int
    latent: tuple[int, ...]  # [B, C, F, H, W]
    text: tuple[int, int, int]  # [B, tokens, dim]: Wan's umT5 / HunyuanVideo 1.5's Qwen2.5-VL
    grid_shape: tuple[int, int, int]  # tokens after the patch
    psa_tile: tuple[int, int, int]
    family: str = "wan"  # "wan" or "hunyuan1.5" (ModelEntry.family)
    per_token_timestep: bool = False
    # HunyuanVideo 1.5's conditioning: real tokens of ``text`` (the mask pads the rest), the
    # byT5 states [B, tokens, dim] and their real tokens, the image states [B, tokens, dim]
    # (zeros: text-to-video, all masked out by the transformer).
    text_real: int | None = None
    text_2: tuple[int, int, int] | None = None
    text_2_real: int | None = None
    image: tuple[int, int, int] | None = None
    inputs_note: dict = field(default_factory=dict)

    @property
    def heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def tokens(self) -> int:
        """Video tokens."""
        return math.prod(self.grid_shape)

    @property
    def joint_text(self) -> int:
        """Tokens after the video tokens in the self-attention (HunyuanVideo 1.5's image, byT5
        and text tokens, padding included; Wan: none, its text enters by cross-attention)."""
        if self.family == "wan":
            return 0
        return self.text[1] + self.text_2[1] + self.image[1]

    @property
    def joint_text_real(self) -> int:
        """Of :attr:`joint_text`, the real (unmasked) ones: the image tokens of text-to-video
        are masked out."""
        return 0 if self.family == "wan" else self.text_real + self.text_2_real

    @property
    def self_attn_len(self) -> int:
        """q and k length of the self-attention calls."""
        return self.tokens + self.joint_text

    @property
    def cross_keys(self) -> int | None:
        """k length of the cross-attention calls (None: the model has none)."""
        return self.text[1] if self.family == "wan" else None


def make_workload(args) -> Workload:
    """``args``: ``model`` (default wan1.3b), ``tiny``, ``layers``, ``resolution``, ``frames``,
    ``psa_tile`` (None or missing: the model's defaults)."""
    model = getattr(args, "model", None) or "wan1.3b"
    if model not in MODELS:
        raise SystemExit(f"--model must be one of {sorted(MODELS)}, got {model!r}")
    entry = MODELS[model]
    if args.tiny:
        return _tiny_workload(model, entry, args.layers)
    resolution = getattr(args, "resolution", None) or entry.default_resolution
    if resolution not in entry.latent_hw:
        raise SystemExit(
            f"--resolution {resolution} is not set up for {model}; choose from "
            f"{sorted(entry.latent_hw)}"
        )
    h, w = entry.latent_hw[resolution]
    frames = (getattr(args, "frames", None) or entry.default_frames) - 1
    latent = (1, entry.latent_channels, frames // 4 + 1, h, w)  # the VAEs' 4x temporal step
    config = dict(entry.config)
    psa_tile = parse_tile(getattr(args, "psa_tile", None) or entry.psa_tile)
    common = dict(
        name=f"{model}-{resolution}",
        model_name=entry.model_name,
        config=config,
        latent=latent,
        psa_tile=psa_tile,
        family=entry.family,
        per_token_timestep=entry.per_token_timestep,
    )
    if entry.family == "wan":
        text = (1, TEXT_TOKENS, config["text_dim"])
        return _finish(args.layers or entry.default_layers, text, entry, **common)
    return _finish(
        args.layers or entry.default_layers,
        (1, HY15_TEXT[0], config["text_embed_dim"]),
        entry,
        text_real=HY15_TEXT[1],
        text_2=(1, HY15_BYT5[0], config["text_embed_2_dim"]),
        text_2_real=HY15_BYT5[1],
        image=(1, HY15_IMAGE_TOKENS, config["image_embed_dim"]),
        **common,
    )


def _tiny_workload(model: str, entry: ModelEntry, layers: int | None) -> Workload:
    if entry.family == "hunyuan1.5":
        config, t = dict(TINY_HY15_CONFIG), TINY_HY15
        return _finish(
            layers or config["num_layers"],
            (1, t["text"][0], config["text_embed_dim"]),
            entry,
            name=f"tiny-{model}",
            model_name=f"tiny-{model}",
            config=config,
            latent=t["latent"],
            psa_tile=TINY_PSA_TILE,
            family=entry.family,
            text_real=t["text"][1],
            text_2=(1, t["byt5"][0], config["text_embed_2_dim"]),
            text_2_real=t["byt5"][1],
            image=(1, t["image"], config["image_embed_dim"]),
        )
    config, latent, name, model_name = dict(TINY_CONFIG), TINY_LATENT, "tiny", "tiny-wan"
    if entry.per_token_timestep:  # Wan 2.2 TI2V-5B: 48 latent channels, per-token timesteps
        channels = entry.latent_channels
        config.update(in_channels=channels, out_channels=channels)
        latent = (latent[0], channels, *latent[2:])
        name = model_name = f"tiny-{model}"
    return _finish(
        layers or config["num_layers"],
        TINY_TEXT,
        entry,
        name=name,
        model_name=model_name,
        config=config,
        latent=latent,
        psa_tile=TINY_PSA_TILE,
        family=entry.family,
        per_token_timestep=entry.per_token_timestep,
    )


def _finish(layers: int, text, entry: ModelEntry, **fields) -> Workload:
    config = fields["config"]
    full = config["num_layers"]
    if not 1 <= layers <= full:
        raise SystemExit(f"--layers must lie in [1, {full}] for this model, got {layers}")
    config["num_layers"] = layers
    if entry.family == "wan":
        patch = tuple(config["patch_size"])
    else:
        patch = (config["patch_size_t"], config["patch_size"], config["patch_size"])
    latent = fields["latent"]
    grid_shape = tuple(n // p for n, p in zip(latent[2:], patch))
    work = Workload(layers=layers, full_layers=full, text=text, grid_shape=grid_shape, **fields)
    return _with_note(work)


def _with_note(work: Workload) -> Workload:
    """The inputs in words, for the results' ``meta.inputs``."""
    note: dict[str, Any] = {
        "latents": list(work.latent),
        "timestep": (
            f"{TIMESTEP} for each of the {work.tokens} tokens ([1, tokens]: WanPipeline's "
            "expand_timesteps, as Wan 2.2 TI2V-5B runs)"
            if work.per_token_timestep
            else f"[{TIMESTEP}]"
        ),
    }
    if work.family == "wan":
        note["encoder_hidden_states"] = (
            f"{list(work.text)} random (umT5 states; WanPipeline pads prompts to 512)"
        )
    else:
        channels = work.config["out_channels"]
        note.update(
            latents=f"{list(work.latent)}: {channels} random noisy-latent channels, then the "
            "condition latents and mask as zeros (text-to-video)",
            encoder_hidden_states=f"{list(work.text)} random, {work.text_real} real "
            "(encoder_attention_mask pads the rest)",
            encoder_hidden_states_2=f"{list(work.text_2)} random byT5 states, "
            f"{work.text_2_real} real",
            image_embeds=f"{list(work.image)} zeros (text-to-video: all masked out)",
            self_attention=f"{work.tokens} video + {work.joint_text} text/image tokens "
            f"({work.joint_text_real} real) in one joint attention; the model passes a "
            "[B, 1, S, S] bool mask",
        )
    return Workload(**{**work.__dict__, "inputs_note": note})


def parse_tile(text) -> tuple[int, int, int]:
    if isinstance(text, tuple):
        return text
    parts = tuple(int(x) for x in text.lower().split("x"))
    if len(parts) != 3 or min(parts) < 1:
        raise SystemExit(f"a tile is TxHxW, e.g. 2x8x8; got {text!r}")
    return parts


def build_model(work: Workload, device: torch.device, dtype: torch.dtype, seed: int):
    """Random-weight transformer on ``device`` in ``dtype``; modules diffusers keeps in fp32 when
    it loads a checkpoint in bf16 (``_keep_in_fp32_modules``; Wan: RoPE tables, time embedder,
    scale/shift tables, the FP32LayerNorms) are kept in fp32 here too."""
    cls = import_model(work.family)
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
    if work.family != "wan":
        return _hunyuan15_inputs(work, device, dtype, g)
    if work.per_token_timestep:
        timestep = torch.full((1, work.tokens), float(TIMESTEP), device=device)
    else:
        timestep = torch.tensor([TIMESTEP], device=device)
    return {
        "hidden_states": torch.randn(work.latent, generator=g).to(device, dtype),
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(work.text, generator=g).to(device, dtype),
        "return_dict": False,
    }


def _prefix_mask(tokens: int, real: int, device) -> torch.Tensor:
    mask = torch.zeros(1, tokens, dtype=torch.long)
    mask[:, :real] = 1
    return mask.to(device)


def _hunyuan15_inputs(work: Workload, device, dtype, g: torch.Generator) -> dict:
    """What HunyuanVideo15Pipeline passes for one text-to-video step of one CFG branch."""
    B, C, F, H, W = work.latent
    noisy = work.config["out_channels"]
    latents = torch.randn(B, noisy, F, H, W, generator=g)
    hidden = torch.cat([latents, torch.zeros(B, C - noisy, F, H, W)], dim=1)
    return {
        "hidden_states": hidden.to(device, dtype),
        # the pipeline casts the timestep to the latents' dtype
        "timestep": torch.tensor([float(TIMESTEP)], device=device, dtype=dtype),
        "encoder_hidden_states": torch.randn(work.text, generator=g).to(device, dtype),
        "encoder_attention_mask": _prefix_mask(work.text[1], work.text_real, device),
        "encoder_hidden_states_2": torch.randn(work.text_2, generator=g).to(device, dtype),
        "encoder_attention_mask_2": _prefix_mask(work.text_2[1], work.text_2_real, device),
        "image_embeds": torch.zeros(work.image, device=device, dtype=dtype),
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
