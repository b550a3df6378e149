"""The end-to-end benchmark's models and inputs: diffusers' video transformers built from their
published configs (random weights), one step's latents and conditioning, and synthetic PSA
plans. See ``vidsparse.bench.ops.e2e`` for what is measured.

Workloads (``--model``), one table entry each (``MODELS``), one family per diffusers class
(``FAMILIES``: how the class is configured, cut to ``--layers`` blocks and called):

- ``wan1.3b``, ``wan14b`` (Wan 2.1 T2V, 480p / 720p), ``wan2.2-5b`` (Wan 2.2 TI2V-5B, 704x1280):
  ``WanTransformer3DModel``;
- ``hunyuan1.5`` (HunyuanVideo 1.5, 720p): ``HunyuanVideo15Transformer3DModel``, joint video +
  text self-attention;
- ``hunyuanvideo`` (HunyuanVideo 13B, 720p 129 frames): ``HunyuanVideoTransformer3DModel``,
  dual- and single-stream blocks, joint video + text self-attention with a key mask;
- ``ltx`` (LTX-Video 2B, 1216x704): ``LTXVideoTransformer3DModel``, head_dim 64;
- ``ltx2`` (LTX-2 19B, 1536x1024): ``LTX2VideoTransformer3DModel``, video and audio streams;
- ``cosmos`` (Cosmos-1.0-Diffusion-7B-Text2World, 704x1280): ``CosmosTransformer3DModel``;
- ``kandinsky5`` (Kandinsky 5.0 Video Lite 2B, 768x512): ``Kandinsky5Transformer3DModel``,
  head_dim 64, channels-last latents;
- ``skyreels-v2`` (SkyReels-V2 T2V 14B 720P): ``SkyReelsV2Transformer3DModel``;
- ``wan-vace`` (Wan 2.1 VACE 14B, 720p): ``WanVACETransformer3DModel`` with control states;
- ``chronoedit`` (ChronoEdit-14B, 720p edit): ``ChronoEditTransformer3DModel``, Wan 2.1 I2V-14B
  blocks (CLIP image and text cross-attention) on the input and edited frames' latents;
- ``wan-animate`` (Wan 2.2 Animate 14B, 720p, 77-frame segment): ``WanAnimateTransformer3DModel``,
  Wan I2V-14B blocks plus pose latents, a motion/face encoder and face adapters.
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

# HunyuanVideo 13B (tencent/HunyuanVideo, hunyuanvideo-community/HunyuanVideo): diffusers'
# conversion script (scripts/convert_hunyuan_video_to_diffusers.py, "HYVideo-T/2-cfgdistill"),
# which are also the class defaults: 24 heads x 128 = 3072, 20 dual-stream + 40 single-stream
# blocks (shape registry "hunyuan-720p"), mlp_ratio 4, patch 1x2x2, 16 latent channels (8x8x4
# VAE), LLaVA-LLaMA-3 text states 4096 wide, CLIP-L pooled 768, guidance-distilled.
_HY_SHAPE = shapes.MODELS["hunyuan-720p"]
HUNYUAN_VIDEO_CONFIG = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=_HY_SHAPE.heads,
    attention_head_dim=_HY_SHAPE.head_dim,
    num_layers=20,
    num_single_layers=40,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=2,
    patch_size_t=1,
    qk_norm="rms_norm",
    guidance_embeds=True,
    text_embed_dim=4096,
    pooled_projection_dim=768,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
    image_condition_type=None,
)

# LTX-Video 2B (Lightricks/LTX-Video, 0.9.x 2B): diffusers' conversion script
# (scripts/convert_ltx_to_diffusers.py) builds LTXVideoTransformer3DModel() with its class
# defaults, written out here: 128 latent channels (VAE 32x32 spatial, 8x temporal), patch 1,
# 32 heads x 64 = 2048, 28 blocks, T5-XXL text states 4096 wide (128 tokens).
_LTX_SHAPE = shapes.MORE_MODELS["ltx-2b-1216x704"]
LTX_CONFIG = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=_LTX_SHAPE.heads,
    attention_head_dim=_LTX_SHAPE.head_dim,
    cross_attention_dim=2048,
    num_layers=_LTX_SHAPE.layers,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=4096,
    attention_bias=True,
    attention_out_bias=True,
)

# LTX-2 19B (Lightricks/LTX-2): diffusers' conversion script (scripts/convert_ltx2_to_diffusers.py,
# version "2.0"): video stream 32 heads x 128 = 4096, audio stream 32 x 64 = 2048, 48
# audio-video blocks, 128 video latent channels (VAE 32x32x8, patch 1), 128 audio channels
# (8 latent channels x 16 mel bins), Gemma-3 connector states 3840 wide. The keys LTX-2.3 added
# (gated_attn, cross_attn_mod, ...) keep their class defaults, which are LTX-2.0's.
_LTX2_SHAPE = shapes.MORE_MODELS["ltx2-19b-1536x1024"]
LTX2_CONFIG = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=_LTX2_SHAPE.heads,
    attention_head_dim=_LTX2_SHAPE.head_dim,
    cross_attention_dim=4096,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    num_layers=_LTX2_SHAPE.layers,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=3840,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    causal_offset=1,
)

# Cosmos-1.0-Diffusion-7B-Text2World (nvidia/Cosmos-1.0-Diffusion-7B-Text2World): diffusers'
# conversion script (scripts/convert_cosmos_to_diffusers.py): 32 heads x 128 = 4096, 28
# blocks, mlp_ratio 4, patch 1x2x2, 16 latent channels (CV8x8x8 tokenizer), T5-11B text
# states 1024 wide, AdaLN-LoRA 256, learnable positional embedding. One departure: the
# published config has in_channels 16 and concat_padding_mask=True, which makes the forward
# resize the pipeline's padding mask with torchvision (not a dependency here); the
# text-to-world padding mask is all zeros, so in_channels 17 with the mask off and that zero
# channel passed as condition_mask is the same patch embedding of the same 17 channels.
_COSMOS_SHAPE = shapes.MORE_MODELS["cosmos-7b-720p"]
COSMOS_CONFIG = dict(
    in_channels=16 + 1,
    out_channels=16,
    num_attention_heads=_COSMOS_SHAPE.heads,
    attention_head_dim=_COSMOS_SHAPE.head_dim,
    num_layers=_COSMOS_SHAPE.layers,
    mlp_ratio=4.0,
    text_embed_dim=1024,
    adaln_lora_dim=256,
    max_size=(128, 240, 240),
    patch_size=(1, 2, 2),
    rope_scale=(2.0, 1.0, 1.0),
    concat_padding_mask=False,
    extra_pos_embed_type="learnable",
)

# Kandinsky 5.0 Video Lite 2B (kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers; the
# original repository's configs/config_5s_sft.yaml): model_dim 1792 with head_dim
# sum(axes_dims) = 16 + 24 + 24 = 64, so 28 heads; ff_dim 7168; 2 text blocks and 32 visual
# blocks; patch 1x2x2; HunyuanVideo VAE (16 channels, 8x8x4); visual_cond (in: 16 noisy + 16
# condition latents + 1 mask channel); Qwen2.5-VL text states 3584 wide, CLIP pooled 768;
# regular (dense) attention, as the 5 s checkpoints run (the 10 s ones use NABLA).
_K5_SHAPE = shapes.MORE_MODELS["kandinsky5-lite-768x512"]
KANDINSKY5_CONFIG = dict(
    in_visual_dim=16,
    in_text_dim=3584,
    in_text_dim2=768,
    time_dim=512,
    out_visual_dim=16,
    patch_size=(1, 2, 2),
    model_dim=_K5_SHAPE.heads * _K5_SHAPE.head_dim,
    ff_dim=7168,
    num_text_blocks=2,
    num_visual_blocks=_K5_SHAPE.layers,
    axes_dims=(16, 24, 24),
    visual_cond=True,
    attention_type="regular",
)

# SkyReels-V2 T2V 14B 720P (Skywork/SkyReels-V2-T2V-14B-720P-Diffusers): the Wan 2.1 14B
# architecture (40 heads x 128, 40 blocks, ffn 13824, umT5 text 4096); inject_sample_info off
# (SkyReelsV2Pipeline, the text-to-video one, passes no fps, which that embedding would need).
_SKYREELS_SHAPE = shapes.MORE_MODELS["skyreels-v2-14b-720p"]
SKYREELS_V2_CONFIG = dict(
    _WAN_COMMON,
    num_attention_heads=_SKYREELS_SHAPE.heads,
    ffn_dim=13824,
    num_layers=_SKYREELS_SHAPE.layers,
    pos_embed_seq_len=None,
    inject_sample_info=False,
    num_frame_per_block=1,
)

# Wan 2.1 VACE 14B (Wan-AI/Wan2.1-VACE-14B-diffusers): Wan 2.1 14B plus 8 VACE blocks after
# blocks 0, 5, ..., 35 (the class defaults, which are the 14B's), 96 control channels: 16 + 16
# latent channels of the (inactive, reactive) control video and 64 of its 8x8-unshuffled mask.
_VACE_SHAPE = shapes.MORE_MODELS["wan-vace-14b-720p"]
WAN_VACE_CONFIG = dict(
    _WAN_COMMON,
    num_attention_heads=_VACE_SHAPE.heads,
    ffn_dim=13824,
    num_layers=_VACE_SHAPE.layers,
    pos_embed_seq_len=None,
    vace_layers=[0, 5, 10, 15, 20, 25, 30, 35],
    vace_in_channels=96,
)

# ChronoEdit-14B (nvidia/ChronoEdit-14B-Diffusers): a fine-tune of Wan 2.1 I2V-14B-720P, whose
# diffusers config (scripts/convert_wan_to_diffusers.py, "Wan-I2V-14B-720p") it keeps: 40 heads x
# 128, 40 blocks, ffn 13824, in_channels 36 (16 noisy latents, 4 mask channels, 16 condition
# latents), image_dim 1280 (CLIP ViT-H/14 penultimate states, 257 tokens), added_kv_proj_dim
# 5120 (the image cross-attention's k/v); rope_temporal_skip_len 8, the class default (a
# 2-frame edit takes RoPE positions 0 and 7: input image and edited frame).
_CHRONO_SHAPE = shapes.MORE_MODELS["chronoedit-14b-720p"]
_WAN_I2V_14B = dict(
    _WAN_COMMON,
    num_attention_heads=_CHRONO_SHAPE.heads,
    ffn_dim=13824,
    num_layers=_CHRONO_SHAPE.layers,
    in_channels=36,
    out_channels=16,
    image_dim=1280,
    added_kv_proj_dim=5120,
    pos_embed_seq_len=None,
)
CHRONOEDIT_CONFIG = dict(_WAN_I2V_14B, rope_temporal_skip_len=8)

# Wan 2.2 Animate 14B (Wan-AI/Wan2.2-Animate-14B-Diffusers): diffusers' conversion script
# (scripts/convert_wan_to_diffusers.py, "Wan2.2-Animate-14B"): the Wan I2V-14B blocks above plus
# the motion encoder (512x512 face frames, style 512, motion 20, out 512; channel sizes the class
# default), the face encoder (hidden 1024, 4 heads) and a face adapter after every 5th block
# (inject_face_latents_blocks 5: after blocks 0, 5, ..., 35).
_ANIMATE_SHAPE = shapes.MORE_MODELS["wan-animate-14b-720p"]
WAN_ANIMATE_CONFIG = dict(
    _WAN_I2V_14B,
    num_layers=_ANIMATE_SHAPE.layers,
    motion_encoder_size=512,
    motion_style_dim=512,
    motion_dim=20,
    motion_encoder_dim=512,
    face_encoder_hidden_dim=1024,
    face_encoder_num_heads=4,
    inject_face_latents_blocks=5,
)

CONFIGS = {
    **WAN_CONFIGS,
    "hunyuan1.5": HUNYUAN15_CONFIG,
    "hunyuanvideo": HUNYUAN_VIDEO_CONFIG,
    "ltx": LTX_CONFIG,
    "ltx2": LTX2_CONFIG,
    "cosmos": COSMOS_CONFIG,
    "kandinsky5": KANDINSKY5_CONFIG,
    "skyreels-v2": SKYREELS_V2_CONFIG,
    "wan-vace": WAN_VACE_CONFIG,
    "chronoedit": CHRONOEDIT_CONFIG,
    "wan-animate": WAN_ANIMATE_CONFIG,
}

# The conditioning HunyuanVideo15Pipeline hands the transformer for a text-to-video step:
# Qwen2.5-VL states padded to tokenizer_max_length=1000, byT5 glyph states padded to 256,
# 729 SigLIP image tokens that are zeros for T2V (the transformer masks them all out). A
# realistic prompt fills part of that: REAL of each (the masks mark the rest as padding).
HY15_TEXT = (1000, 400)  # (tokens, real tokens) of the Qwen2.5-VL (mllm) states
HY15_BYT5 = (256, 32)  # of the byT5 states (a short quoted caption)
HY15_IMAGE_TOKENS = 729  # vision_num_semantic_tokens


@dataclass(frozen=True)
class ModelEntry:
    """One ``--model``: its family (the diffusers class, ``FAMILIES``), config and defaults."""

    family: str  # a key of FAMILIES
    model_name: str  # the plan's model string
    config: dict
    default_layers: int
    latent_channels: int  # noisy latents (+ condition channels where the model takes them)
    latent_hw: dict  # resolution -> latent (H, W), before the patch
    default_resolution: str
    default_frames: int
    psa_tile: str | None = None  # the default PSA block; None: the 128-token block padding least
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
# would make 39,680, 1x8x16 35,712). The entries below without a tile take the least-padding
# one of PSA_TILES (least_padding_tile) at their resolution: HunyuanVideo 33x45x80 -> 1x16x8
# (126,720; 2x8x8 130,560); LTX-Video 16x22x38 -> 2x8x8 (15,360; 1x16x8 20,480, 1x8x16
# 18,432); LTX-2 16x32x48, Kandinsky 5 31x32x48 -> 1x16x8, no padding; Cosmos 16x44x80 ->
# 1x16x8 (61,440, all three tie); SkyReels-V2 31x45x80 -> 1x16x8 (119,040); VACE as Wan 720p.
DEFAULT_PSA_TILE = "1x16x8"
PSA_TILES = ((1, 16, 8), (2, 8, 8), (1, 8, 16))  # in order of preference on a tie


def least_padding_tile(grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """The tile of ``PSA_TILES`` whose block grid pads ``grid`` (T, H, W tokens) least."""

    def slots(tile):
        return math.prod(-(-n // t) * t for n, t in zip(grid, tile))

    return min(PSA_TILES, key=slots)


# Latent (H, W) before the patch per resolution, for the entries below (the resolution keys
# are WIDTHxHEIGHT where there is no "p" name): HunyuanVideo 720x1280 under its 8x VAE: 90x160
# (45x80 tokens); LTX-Video 1216x704 / 768x512 and LTX-2 1536x1024 / 768x512 under the 32x VAE;
# Cosmos 704x1280 under the 8x tokenizer: 88x160; Kandinsky 5 768x512 under the 8x VAE: 64x96.
_HY_HW = {"720p": _latent_hw(_HY_SHAPE, PATCH)}
_LTX_HW = {"1216x704": _latent_hw(_LTX_SHAPE, (1, 1, 1)), "768x512": (16, 24)}
_LTX2_HW = {"1536x1024": _latent_hw(_LTX2_SHAPE, (1, 1, 1)), "768x512": (16, 24)}
_COSMOS_HW = {"720p": _latent_hw(_COSMOS_SHAPE, PATCH)}
_K5_HW = {"768x512": _latent_hw(_K5_SHAPE, PATCH)}
_SKYREELS_HW = {"720p": _latent_hw(_SKYREELS_SHAPE, PATCH)}
_VACE_HW = {"720p": _latent_hw(_VACE_SHAPE, PATCH)}
# ChronoEdit: its script's target area 720x1280 (a 16:9 input stays 1280x720), also 480p
# (832x480, ChronoEditPipeline's signature default); Wan-Animate: WanAnimatePipeline's 1280x720.
_CHRONO_HW = {"720p": _latent_hw(_CHRONO_SHAPE, PATCH), "480p": LATENT_HW["480p"]}
_ANIMATE_HW = {"720p": _latent_hw(_ANIMATE_SHAPE, PATCH)}

# Default --layers: all blocks where a dense step of them takes a few seconds. Memory is not
# the limit: the largest model, LTX-2, has 18.9B parameters (37.8 GB in bf16; HunyuanVideo
# 12.8B, 25.6 GB; SkyReels-V2 14.3B, 28.6 GB; Wan VACE 17.3B, 34.7 GB; Wan-Animate 17.3B, 34.5
# GB; ChronoEdit 16.4B, 32.8 GB; Cosmos 7.2B, 14.5 GB; LTX-Video 1.9B, Kandinsky 5 2.0B) and a
# step's activations take a few GB more, well within a 141 GB H200. The 13-17B models at 720p
# (75,600-118,800 tokens, a dense step of all their blocks roughly 10-30 s) are cut for run
# time, as Wan 14B is: HunyuanVideo to 9 of 60 blocks (3 dual + 6 single, the full model's
# proportion), SkyReels-V2 to 8 of 40, Wan VACE to 10 of 40 with the VACE blocks at 0 and 5
# (the full model's one per five), Wan-Animate to 10 of 40 with the face adapters after blocks
# 0 and 5 (likewise one per five; 8 blocks would also hold two, after 0 and 5, over fewer
# blocks). ChronoEdit's default edit is 2 latent frames (7,200 tokens): all 40 blocks. LTX-2
# runs all 48 (24,576 video tokens), LTX-Video, Cosmos and Kandinsky 5 all theirs.
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
    # HunyuanVideoPipeline's defaults: 720x1280, 129 frames.
    "hunyuanvideo": ModelEntry(
        "hunyuanvideo", "hunyuanvideo-t2v-13b", HUNYUAN_VIDEO_CONFIG, 9, 16, _HY_HW, "720p",
        _HY_SHAPE.frames,
    ),
    # LTX-Video's 1216x704 at 121 frames (also 768x512, its first release's resolution).
    "ltx": ModelEntry(
        "ltx", "ltx-video-2b", LTX_CONFIG, _LTX_SHAPE.layers, 128, _LTX_HW, "1216x704",
        _LTX_SHAPE.frames,
    ),
    # LTX-2's two-stage default output, 1536x1024 (ltx-pipelines: twice the one-stage
    # 768x512, which LTX2Pipeline defaults to), 121 frames at 24 fps.
    "ltx2": ModelEntry(
        "ltx2", "ltx-2-19b", LTX2_CONFIG, _LTX2_SHAPE.layers, 128, _LTX2_HW, "1536x1024",
        _LTX2_SHAPE.frames,
    ),
    # CosmosTextToWorldPipeline's defaults: 704x1280, 121 frames.
    "cosmos": ModelEntry(
        "cosmos", "cosmos-1.0-diffusion-7b-text2world", COSMOS_CONFIG, _COSMOS_SHAPE.layers,
        17, _COSMOS_HW, "720p", _COSMOS_SHAPE.frames,
    ),
    # Kandinsky5T2VPipeline's defaults: 512x768, 121 frames (5 s at 24 fps).
    "kandinsky5": ModelEntry(
        "kandinsky5", "kandinsky-5.0-t2v-lite-2b", KANDINSKY5_CONFIG, _K5_SHAPE.layers, 33,
        _K5_HW, "768x512", _K5_SHAPE.frames,
    ),
    # SkyReels-V2's 720P models: 720x1280, 121 frames.
    "skyreels-v2": ModelEntry(
        "skyreels-v2", "skyreels-v2-t2v-14b-720p", SKYREELS_V2_CONFIG, 8, 16, _SKYREELS_HW,
        "720p", _SKYREELS_SHAPE.frames,
    ),
    # Wan 2.1's 720p, 81 frames.
    "wan-vace": ModelEntry(
        "wan-vace", "wan2.1-vace-14b", WAN_VACE_CONFIG, 10, 16, _VACE_HW, "720p",
        _VACE_SHAPE.frames,
    ),
    # ChronoEditPipeline without temporal reasoning: 5 frames (2 latent frames: the input image
    # and the edit) at 720p; --frames 29 is its temporal-reasoning video (8 latent frames).
    "chronoedit": ModelEntry(
        "chronoedit", "chronoedit-14b", CHRONOEDIT_CONFIG, _CHRONO_SHAPE.layers, 36, _CHRONO_HW,
        "720p", _CHRONO_SHAPE.frames,
    ),
    # WanAnimatePipeline's defaults: 1280x720, segment_frame_length 77 (20 latent frames) after
    # the reference character's latent frame.
    "wan-animate": ModelEntry(
        "wan-animate", "wan2.2-animate-14b", WAN_ANIMATE_CONFIG, 10, 36, _ANIMATE_HW, "720p",
        _ANIMATE_SHAPE.frames,
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
TINY_PATCH1_LATENT = (1, 8, 5, 6, 10)  # 5x6x10 tokens under a patch of 1 (LTX, LTX-2)

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
# workloads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The model to build and the inputs of one step."""

    name: str  # "wan1.3b-480p", "hunyuan1.5-720p", "tiny", ...
    model_name: str  # the plan's model string
    config: dict
    layers: int
    full_layers: int
    latent: tuple[int, ...]  # [B, C, F, H, W] (before any packing or channels-last layout)
    text: tuple[int, int, int]  # [B, tokens, dim] of the main text encoder's states
    grid_shape: tuple[int, int, int]  # tokens after the patch
    psa_tile: tuple[int, int, int]
    family: str = "wan"  # a key of FAMILIES (ModelEntry.family)
    per_token_timestep: bool = False
    # Real tokens of ``text`` (a mask or zeros pad the rest; None: all real). HunyuanVideo 1.5
    # also has byT5 states [B, tokens, dim] and their real tokens, and image states [B, tokens,
    # dim] (zeros: text-to-video, all masked out by the transformer).
    text_real: int | None = None
    text_2: tuple[int, int, int] | None = None
    text_2_real: int | None = None
    image: tuple[int, int, int] | None = None
    extra: dict = field(default_factory=dict)  # family-specific numbers (meta fields too)
    inputs_note: dict = field(default_factory=dict)

    @property
    def spec(self) -> Family:
        return FAMILIES[self.family]

    @property
    def heads(self) -> int:
        return self.spec.heads(self.config)

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim(self.config)

    @property
    def tokens(self) -> int:
        """Video tokens."""
        return math.prod(self.grid_shape)

    @property
    def joint_text(self) -> int:
        """Tokens after the video tokens in the self-attention (HunyuanVideo's text tokens,
        HunyuanVideo 1.5's image, byT5 and text tokens, padding included; 0 where the text
        enters by cross-attention)."""
        return self.spec.joint_text(self)

    @property
    def joint_text_real(self) -> int:
        """Of :attr:`joint_text`, the real (unmasked) ones."""
        return self.spec.joint_text_real(self)

    @property
    def self_attn_len(self) -> int:
        """q and k length of the self-attention calls."""
        return self.tokens + self.joint_text

    @property
    def cross_keys(self) -> int | None:
        """k length of the text cross-attention calls (None: the model has none)."""
        return self.spec.cross_keys(self)

    @property
    def attention_layers(self) -> int:
        """Video self-attention modules the forward runs (the calls per step the integration
        makes sparse): the blocks, plus Wan VACE's VACE blocks."""
        return self.spec.attention_layers(self)

    @property
    def timestep(self) -> float:
        return self.spec.timestep


def make_workload(args) -> Workload:
    """``args``: ``model`` (default wan1.3b), ``tiny``, ``layers`` (an int, "all" or None),
    ``resolution``, ``frames``, ``psa_tile`` (None or missing: the model's defaults)."""
    model = getattr(args, "model", None) or "wan1.3b"
    if model not in MODELS:
        raise SystemExit(f"--model must be one of {sorted(MODELS)}, got {model!r}")
    entry = MODELS[model]
    spec = FAMILIES[entry.family]
    if args.tiny:
        config, latent = spec.tiny_config(entry), spec.tiny_latent(entry)
        if entry.family == "wan" and not entry.per_token_timestep:
            names = dict(name="tiny", model_name="tiny-wan")  # Wan 2.1 1.3B and 14B share it
        else:
            names = dict(name=f"tiny-{model}", model_name=f"tiny-{model}")
        psa_tile, default_layers = TINY_PSA_TILE, spec.num_layers(config)
    else:
        resolution = getattr(args, "resolution", None) or entry.default_resolution
        if resolution not in entry.latent_hw:
            raise SystemExit(
                f"--resolution {resolution} is not set up for {model}; choose from "
                f"{sorted(entry.latent_hw)}"
            )
        h, w = entry.latent_hw[resolution]
        frames = getattr(args, "frames", None) or entry.default_frames
        latent = (1, entry.latent_channels, spec.latent_frames(frames), h, w)
        config = dict(entry.config)
        names = dict(name=f"{model}-{resolution}", model_name=entry.model_name)
        psa_tile = getattr(args, "psa_tile", None) or entry.psa_tile
        default_layers = entry.default_layers
    full = spec.num_layers(config)
    layers = full if args.layers == "all" else (args.layers or default_layers)
    if not 1 <= layers <= full:
        raise SystemExit(f"--layers must lie in [1, {full}] for this model, got {layers}")
    spec.set_layers(config, layers)
    grid_shape = tuple(n // p for n, p in zip(latent[2:], spec.patch(config)))
    work = Workload(
        layers=layers,
        full_layers=full,
        config=config,
        latent=latent,
        grid_shape=grid_shape,
        psa_tile=parse_tile(psa_tile) if psa_tile else least_padding_tile(grid_shape),
        family=entry.family,
        per_token_timestep=entry.per_token_timestep,
        **names,
        **spec.conditioning(config, latent, args.tiny),
    )
    return Workload(**{**work.__dict__, "inputs_note": spec.note(work)})


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
        work.spec.after_init(model)
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
    """The keyword arguments of one forward: what the model's diffusers pipeline hands the
    transformer for one text-to-video step of one CFG branch (``meta.inputs`` says what)."""
    g = torch.Generator().manual_seed(seed + 1)
    return work.spec.inputs(work, device, dtype, g)


# ---------------------------------------------------------------------------------------------
# families: one per diffusers class
# ---------------------------------------------------------------------------------------------


def _randn(shape, g: torch.Generator, device, dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(device, dtype)


def _prefix_mask(tokens: int, real: int, device, dtype=torch.long) -> torch.Tensor:
    mask = torch.zeros(1, tokens, dtype=dtype)
    mask[:, :real] = 1
    return mask.to(device)


def _timestep(value, device, dtype) -> torch.Tensor:
    return torch.tensor([float(value)], device=device, dtype=dtype)


def _text_note(work: Workload, what: str) -> str:
    if work.text_real is None:
        return f"{list(work.text)} random ({what})"
    return f"{list(work.text)} random, {work.text_real} real ({what})"


class Family:
    """How one diffusers class is configured, cut to ``--layers`` blocks and called for one
    text-to-video step. The base holds what most classes share; each subclass overrides what
    its class does differently (``FAMILIES`` holds one instance per class)."""

    name = "?"
    class_name = "?"
    vae_t = 4  # the VAE's temporal compression: latent frames = (frames - 1) // vae_t + 1
    text = (TEXT_TOKENS, None)  # full size: (tokens, real tokens; None: all real)
    tiny_text = (16, None)
    self_mask = "none"  # the self-attention's mask: "none", "key" [B,1,1,S], "square" [B,1,S,S]
    timestep = TIMESTEP
    repeated_blocks: tuple[str, ...] = ()  # --compile blocks, where the class declares none

    # -- config --------------------------------------------------------------------------------
    def tiny_config(self, entry: ModelEntry) -> dict:
        raise NotImplementedError

    def tiny_latent(self, entry: ModelEntry) -> tuple[int, ...]:
        return TINY_LATENT

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a ``frames``-frame video (``--frames``)."""
        return (frames - 1) // self.vae_t + 1

    def heads(self, config: dict) -> int:
        return config["num_attention_heads"]

    def head_dim(self, config: dict) -> int:
        return config["attention_head_dim"]

    def patch(self, config: dict) -> tuple[int, int, int]:
        p = config["patch_size"]
        if isinstance(p, (tuple, list)):
            return tuple(p)
        return (config["patch_size_t"], p, p)

    def num_layers(self, config: dict) -> int:
        return config["num_layers"]

    def set_layers(self, config: dict, layers: int) -> None:
        """Cut ``config`` (in place) to ``layers`` blocks."""
        config["num_layers"] = layers

    def after_init(self, model) -> None:
        """Adjust a freshly initialised random model (on its device, seeded)."""
        return None

    # -- conditioning and attention ------------------------------------------------------------
    def text_dim(self, config: dict) -> int:
        raise NotImplementedError

    def conditioning(self, config: dict, latent: tuple[int, ...], tiny: bool) -> dict:
        """Workload fields of the conditioning (``text``, ``text_real``, ``extra``...), for the
        cut ``config`` and the ``latent`` shape."""
        tokens, real = self.tiny_text if tiny else self.text
        return dict(text=(1, tokens, self.text_dim(config)), text_real=real)

    def joint_text(self, work: Workload) -> int:
        return 0

    def joint_text_real(self, work: Workload) -> int:
        return 0

    def cross_keys(self, work: Workload) -> int | None:
        return work.text[1]

    def attention_layers(self, work: Workload) -> int:
        return work.layers

    # -- inputs --------------------------------------------------------------------------------
    def inputs(self, work: Workload, device, dtype, g: torch.Generator) -> dict:
        raise NotImplementedError

    def note(self, work: Workload) -> dict:
        """``meta.inputs``: the inputs in words."""
        raise NotImplementedError

    def layers_note(self, work: Workload) -> str | None:
        """``meta.layers_note`` where "the first N blocks" is not what was built."""
        return None


class _Wan(Family):
    """WanTransformer3DModel (Wan 2.1 T2V, Wan 2.2 TI2V-5B): latents [B, C, F, H, W], umT5
    text states by cross-attention (attn2)."""

    name, class_name = "wan", "WanTransformer3DModel"
    pipeline = "WanPipeline"

    def tiny_config(self, entry):
        config = dict(TINY_CONFIG)
        if entry.per_token_timestep:  # Wan 2.2 TI2V-5B: 48 latent channels
            config.update(in_channels=entry.latent_channels, out_channels=entry.latent_channels)
        return config

    def tiny_latent(self, entry):
        if entry.per_token_timestep:
            return (TINY_LATENT[0], entry.latent_channels, *TINY_LATENT[2:])
        return TINY_LATENT

    def text_dim(self, config):
        return config["text_dim"]

    def conditioning(self, config, latent, tiny):
        return dict(text=TINY_TEXT if tiny else (1, TEXT_TOKENS, config["text_dim"]))

    def patch(self, config):
        return tuple(config["patch_size"])

    def inputs(self, work, device, dtype, g):
        if work.per_token_timestep:
            timestep = torch.full((1, work.tokens), float(TIMESTEP), device=device)
        else:
            timestep = torch.tensor([TIMESTEP], device=device)
        return {
            "hidden_states": _randn(work.latent, g, device, dtype),
            "timestep": timestep,
            "encoder_hidden_states": _randn(work.text, g, device, dtype),
            "return_dict": False,
        }

    def note(self, work):
        return {
            "latents": list(work.latent),
            "timestep": (
                f"{TIMESTEP} for each of the {work.tokens} tokens ([1, tokens]: WanPipeline's "
                "expand_timesteps, as Wan 2.2 TI2V-5B runs)"
                if work.per_token_timestep
                else f"[{TIMESTEP}]"
            ),
            "encoder_hidden_states": (
                f"{list(work.text)} random (umT5 states; {self.pipeline} pads prompts to 512)"
            ),
        }


class _SkyReelsV2(_Wan):
    """SkyReelsV2Transformer3DModel: the Wan architecture, called as SkyReelsV2Pipeline (the
    text-to-video one) calls it (no fps, no diffusion forcing)."""

    name, class_name = "skyreels-v2", "SkyReelsV2Transformer3DModel"
    pipeline = "SkyReelsV2Pipeline"


class _WanVACE(_Wan):
    """WanVACETransformer3DModel: Wan plus VACE blocks that read the control video's tokens
    (the same grid) and add hints to the blocks of ``vace_layers``."""

    name, class_name = "wan-vace", "WanVACETransformer3DModel"
    pipeline = "WanVACEPipeline"
    tiny_mask_channels = 4  # of the tiny control states (full size: 64, the 8x8-unshuffled mask)

    def tiny_config(self, entry):
        channels = TINY_CONFIG["in_channels"]
        return dict(
            TINY_CONFIG, vace_layers=[0, 1], vace_in_channels=2 * channels + self.tiny_mask_channels
        )

    def set_layers(self, config, layers):
        config["num_layers"] = layers
        config["vace_layers"] = [i for i in config["vace_layers"] if i < layers]

    def attention_layers(self, work):
        return work.layers + len(work.config["vace_layers"])

    def _control(self, work) -> tuple[tuple[int, ...], int]:
        """The control states' shape [B, 2C + mask, F, H, W] and their mask channels."""
        B, C, F, H, W = work.latent
        mask = work.config["vace_in_channels"] - 2 * C
        return (B, 2 * C + mask, F, H, W), mask

    def inputs(self, work, device, dtype, g):
        inputs = super().inputs(work, device, dtype, g)
        shape, mask = self._control(work)
        latents = torch.randn((*shape[:1], shape[1] - mask, *shape[2:]), generator=g)
        control = torch.cat([latents, torch.ones(shape[0], mask, *shape[2:])], dim=1)
        inputs.update(
            control_hidden_states=control.to(device, dtype),
            control_hidden_states_scale=torch.ones(
                len(work.config["vace_layers"]), device=device, dtype=dtype
            ),
        )
        return inputs

    def note(self, work):
        shape, mask = self._control(work)
        vace = work.config["vace_layers"]
        return {
            **super().note(work),
            "control_hidden_states": f"{list(shape)}: {shape[1] - mask} random channels (the "
            "VAE latents of the inactive and reactive control video; text-to-video: an empty "
            f"video) and {mask} of ones (its mask: all frames generated)",
            "control_hidden_states_scale": f"[{len(vace)}] ones (conditioning_scale 1.0)",
            "vace_blocks": f"{len(vace)} VACE blocks at {vace}, each a self-attention over the "
            f"control tokens ({work.tokens}, the video's grid)",
        }

    def layers_note(self, work):
        vace = work.config["vace_layers"]
        full = len(WAN_VACE_CONFIG["vace_layers"])
        if work.layers == work.full_layers:
            return None
        return (
            f"first {work.layers} of {work.full_layers} transformer blocks and the {len(vace)} "
            f"VACE blocks ({vace}) of {full} that feed them: a step of the whole model takes "
            "about full_layers / layers times as long (step_ms_per_layer); chosen for run "
            "time, memory would hold more (weights_gb is this build's)"
        )


class _ChronoEdit(_Wan):
    """ChronoEditTransformer3DModel: Wan 2.1 I2V-14B's blocks on the edit's latent frames (the
    input image's and the edited frame's; with temporal reasoning the frames between), each
    block's cross-attention over the CLIP image tokens and the umT5 text (two calls, attn2)."""

    name, class_name = "chronoedit", "ChronoEditTransformer3DModel"
    pipeline = "ChronoEditPipeline"
    image_tokens = 257  # CLIP ViT-H/14 penultimate hidden states: 256 patches + CLS
    tiny_image = (4, 16)  # tokens, width
    mask_channels = 4  # the VAE's temporal factor: the first frame's mask repeated 4 times

    def tiny_config(self, entry):
        c = TINY_CONFIG["in_channels"]
        inner = TINY_CONFIG["num_attention_heads"] * TINY_CONFIG["attention_head_dim"]
        return dict(
            TINY_CONFIG,
            in_channels=2 * c + self.mask_channels,
            out_channels=c,
            image_dim=self.tiny_image[1],
            added_kv_proj_dim=inner,
        )

    def tiny_latent(self, entry):
        # ChronoEdit's 2-frame edit (its 2-frame RoPE path), 2x6x10 tokens
        c = TINY_LATENT[1]
        return (TINY_LATENT[0], 2 * c + self.mask_channels, 2, *TINY_LATENT[3:])

    def conditioning(self, config, latent, tiny):
        fields = super().conditioning(config, latent, tiny)
        tokens = self.tiny_image[0] if tiny else self.image_tokens
        fields.update(image=(1, tokens, config["image_dim"]), extra={"image_tokens": tokens})
        return fields

    def _hidden(self, work, g) -> torch.Tensor:
        """[noisy latents | mask | condition latents], as the pipeline concatenates them: the
        mask marks the first latent frame (the input image / the reference) as given."""
        B, C, F, H, W = work.latent
        noisy = work.config["out_channels"]
        latents = torch.randn(B, noisy, F, H, W, generator=g)
        mask = torch.zeros(B, self.mask_channels, F, H, W)
        mask[:, :, 0] = 1
        condition = torch.randn(B, C - noisy - self.mask_channels, F, H, W, generator=g)
        return torch.cat([latents, mask, condition], dim=1)

    def inputs(self, work, device, dtype, g):
        return {
            "hidden_states": self._hidden(work, g).to(device, dtype),
            "timestep": torch.tensor([TIMESTEP], device=device),
            "encoder_hidden_states": _randn(work.text, g, device, dtype),
            "encoder_hidden_states_image": _randn(work.image, g, device, dtype),
            "return_dict": False,
        }

    def _latents_note(self, work, given: str) -> str:
        B, C, F, H, W = work.latent
        noisy = work.config["out_channels"]
        cond = C - noisy - self.mask_channels
        return (
            f"{list(work.latent)}: {noisy} random noisy-latent channels, {self.mask_channels} mask "
            f"channels (ones on latent frame 0, {given}; zeros after) and {cond} random condition-"
            "latent channels (the VAE latents of the conditioning video)"
        )

    def note(self, work):
        frames = work.latent[2]
        return {
            **super().note(work),
            "latents": self._latents_note(work, "the input image"),
            "frames": f"{frames} latent frames: "
            + (
                "the input image and the edited frame (ChronoEditPipeline without temporal "
                "reasoning runs 5 frames)"
                if frames == 2
                else "the input image, temporal-reasoning frames and the edited frame"
            ),
            "encoder_hidden_states_image": f"{list(work.image)} random (CLIP ViT-H/14 "
            "penultimate states of the input image)",
            "attention": f"video self-attention over {work.tokens} tokens made sparse; per block "
            f"two cross-attention calls (the {work.image[1]} image tokens, the {work.text[1]} text "
            "tokens) stay stock",
        }


class _WanAnimate(_ChronoEdit):
    """WanAnimateTransformer3DModel: Wan I2V-14B blocks over [reference character frame |
    segment frames], the pose latents added to the segment frames' patch embeddings, and after
    every ``inject_face_latents_blocks``-th block a face adapter: a per-latent-frame
    cross-attention from that frame's tokens to its face motion tokens (the motion and face
    encoders' output of the face video), not a video self-attention."""

    name, class_name = "wan-animate", "WanAnimateTransformer3DModel"
    pipeline = "WanAnimatePipeline"

    def tiny_config(self, entry):
        return dict(
            super().tiny_config(entry),
            latent_channels=TINY_CONFIG["in_channels"],
            motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
            motion_encoder_size=16,
            motion_style_dim=8,
            motion_dim=4,
            motion_encoder_dim=8,
            face_encoder_hidden_dim=8,
            face_encoder_num_heads=2,
            inject_face_latents_blocks=2,
        )

    def tiny_latent(self, entry):
        # the reference frame + 4 segment latent frames (13 face frames), 5x6x10 tokens
        c = TINY_LATENT[1]
        return (TINY_LATENT[0], 2 * c + self.mask_channels, *TINY_LATENT[2:])

    def latent_frames(self, frames):
        """The segment's latent frames after the reference character's one."""
        return super().latent_frames(frames) + 1

    @staticmethod
    def face_adapters(config: dict) -> list[int]:
        """The blocks a face adapter follows: 0, inject, 2 inject, ... below num_layers."""
        return list(range(0, config["num_layers"], config["inject_face_latents_blocks"]))

    def after_init(self, model):
        """A face adapter for every adapted block of the cut model: the class builds
        num_layers // inject of them, one short where ``--layers`` is no multiple of inject
        (8 blocks: adapters after 0 and 5, the class builds 1); the missing ones are built as
        the class builds its own (random, seeded)."""
        from diffusers.models.transformers.transformer_wan_animate import (
            WanAnimateFaceBlockAttnProcessor,
            WanAnimateFaceBlockCrossAttention,
        )

        c = model.config
        inner = c.num_attention_heads * c.attention_head_dim
        while len(model.face_adapter) < len(self.face_adapters(dict(c))):
            model.face_adapter.append(
                WanAnimateFaceBlockCrossAttention(
                    dim=inner,
                    heads=c.num_attention_heads,
                    dim_head=c.attention_head_dim,
                    eps=c.eps,
                    cross_attention_dim_head=c.attention_head_dim,
                    processor=WanAnimateFaceBlockAttnProcessor(),
                )
            )

    def conditioning(self, config, latent, tiny):
        fields = super().conditioning(config, latent, tiny)
        F = latent[2]
        fields["extra"].update(
            face_frames=4 * (F - 2) + 1,  # the segment's frames: the face video's length
            face_size=config["motion_encoder_size"],
            face_adapter_blocks=self.face_adapters(config),
        )
        return fields

    def inputs(self, work, device, dtype, g):
        inputs = super().inputs(work, device, dtype, g)
        B, C, F, H, W = work.latent
        pose = work.config["out_channels"]
        size, frames = work.extra["face_size"], work.extra["face_frames"]
        face = torch.rand(B, 3, frames, size, size, generator=g) * 2 - 1  # pixels in [-1, 1]
        inputs.update(
            pose_hidden_states=_randn((B, pose, F - 1, H, W), g, device, dtype),
            face_pixel_values=face.to(device, dtype),
        )
        return inputs

    def note(self, work):
        B, C, F, H, W = work.latent
        e = work.extra
        return {
            **super().note(work),
            "latents": self._latents_note(work, "the reference character")
            + f"; latent frame 0 is the reference character, frames 1-{F - 1} the segment",
            "frames": f"1 reference + {F - 1} segment latent frames (segment_frame_length "
            f"{e['face_frames']}; WanAnimatePipeline, mode 'animate', first segment)",
            "encoder_hidden_states_image": f"{list(work.image)} random (CLIP ViT-H/14 "
            "penultimate states of the character image)",
            "pose_hidden_states": f"{[B, work.config['out_channels'], F - 1, H, W]} random (the "
            "pose video's VAE latents)",
            "face_pixel_values": f"{[B, 3, e['face_frames'], e['face_size'], e['face_size']]} "
            "uniform in [-1, 1] (the face video's pixels; guidance_scale 1: no blanked pass)",
            "attention": f"video self-attention over {work.tokens} tokens made sparse; per block "
            f"the image and text cross-attention, and after blocks {e['face_adapter_blocks']} the "
            f"face adapter (per latent frame, {H * W // 4} tokens to "
            f"{work.config['face_encoder_num_heads'] + 1} face tokens), counted as "
            "cross-attention, stay stock",
        }

    def layers_note(self, work):
        if work.layers == work.full_layers:
            return None
        adapted = self.face_adapters(work.config)
        full = len(self.face_adapters(WAN_ANIMATE_CONFIG))
        return (
            f"first {work.layers} of {work.full_layers} transformer blocks and the "
            f"{len(adapted)} of {full} face adapters after them (after blocks {adapted}): a step "
            "of the whole model takes about full_layers / layers times as long "
            "(step_ms_per_layer); chosen for run time, memory would hold more (weights_gb is "
            "this build's)"
        )


class _Hunyuan15(Family):
    """HunyuanVideo15Transformer3DModel: joint [video | image | byT5 | text] self-attention with
    a [B, 1, S, S] mask the model builds in every layer; no cross-attention."""

    name, class_name = "hunyuan1.5", "HunyuanVideo15Transformer3DModel"
    self_mask = "square"

    def tiny_config(self, entry):
        return dict(TINY_HY15_CONFIG)

    def tiny_latent(self, entry):
        return TINY_HY15["latent"]

    def conditioning(self, config, latent, tiny):
        t = TINY_HY15
        if tiny:
            text, byt5, image = t["text"], t["byt5"], t["image"]
        else:
            text, byt5, image = HY15_TEXT, HY15_BYT5, HY15_IMAGE_TOKENS
        return dict(
            text=(1, text[0], config["text_embed_dim"]),
            text_real=text[1],
            text_2=(1, byt5[0], config["text_embed_2_dim"]),
            text_2_real=byt5[1],
            image=(1, image, config["image_embed_dim"]),
        )

    def joint_text(self, work):
        return work.text[1] + work.text_2[1] + work.image[1]

    def joint_text_real(self, work):
        """The image tokens of text-to-video are masked out."""
        return work.text_real + work.text_2_real

    def cross_keys(self, work):
        return None

    def inputs(self, work, device, dtype, g):
        """What HunyuanVideo15Pipeline passes for one text-to-video step of one CFG branch."""
        B, C, F, H, W = work.latent
        noisy = work.config["out_channels"]
        latents = torch.randn(B, noisy, F, H, W, generator=g)
        hidden = torch.cat([latents, torch.zeros(B, C - noisy, F, H, W)], dim=1)
        return {
            "hidden_states": hidden.to(device, dtype),
            # the pipeline casts the timestep to the latents' dtype
            "timestep": _timestep(TIMESTEP, device, dtype),
            "encoder_hidden_states": _randn(work.text, g, device, dtype),
            "encoder_attention_mask": _prefix_mask(work.text[1], work.text_real, device),
            "encoder_hidden_states_2": _randn(work.text_2, g, device, dtype),
            "encoder_attention_mask_2": _prefix_mask(work.text_2[1], work.text_2_real, device),
            "image_embeds": torch.zeros(work.image, device=device, dtype=dtype),
            "return_dict": False,
        }

    def note(self, work):
        channels = work.config["out_channels"]
        return {
            "latents": f"{list(work.latent)}: {channels} random noisy-latent channels, then the "
            "condition latents and mask as zeros (text-to-video)",
            "timestep": f"[{TIMESTEP}]",
            "encoder_hidden_states": f"{list(work.text)} random, {work.text_real} real "
            "(encoder_attention_mask pads the rest)",
            "encoder_hidden_states_2": f"{list(work.text_2)} random byT5 states, "
            f"{work.text_2_real} real",
            "image_embeds": f"{list(work.image)} zeros (text-to-video: all masked out)",
            "self_attention": f"{work.tokens} video + {work.joint_text} text/image tokens "
            f"({work.joint_text_real} real) in one joint attention; the model passes a "
            "[B, 1, S, S] bool mask",
        }


class _HunyuanVideo(Family):
    """HunyuanVideoTransformer3DModel: dual-stream blocks (video and text streams, one joint
    attention), then single-stream blocks (one joint sequence); the text (after a token refiner)
    follows the video tokens in every self-attention, with a [B, 1, 1, S] key mask."""

    name, class_name = "hunyuanvideo", "HunyuanVideoTransformer3DModel"
    self_mask = "key"
    # HunyuanVideoPipeline: LLaVA-LLaMA-3 states cropped to max_sequence_length=256 after the
    # prompt template; a typical prompt fills 96 of them (encoder_attention_mask pads the rest).
    text = (256, 96)
    tiny_text = (16, 10)
    guidance = 6.0  # HunyuanVideoPipeline's guidance_scale (embedded: guidance-distilled model)

    def tiny_config(self, entry):
        return dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=32,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=2,
            patch_size_t=1,
            text_embed_dim=32,
            pooled_projection_dim=16,
            rope_axes_dim=(8, 12, 12),
        )

    def num_layers(self, config):
        return config["num_layers"] + config["num_single_layers"]

    def set_layers(self, config, layers):
        """``layers`` blocks in the full model's proportion of dual- to single-stream ones (at
        least one dual-stream block): 9 -> 3 + 6, 1 -> 1 + 0."""
        dual, single = config["num_layers"], config["num_single_layers"]
        keep = min(dual, max(1, round(layers * dual / (dual + single))))
        keep = max(keep, layers - single)
        config.update(num_layers=keep, num_single_layers=layers - keep)

    def text_dim(self, config):
        return config["text_embed_dim"]

    def conditioning(self, config, latent, tiny):
        fields = super().conditioning(config, latent, tiny)
        fields["extra"] = dict(
            dual_stream_layers=config["num_layers"],
            single_stream_layers=config["num_single_layers"],
        )
        return fields

    def joint_text(self, work):
        return work.text[1]

    def joint_text_real(self, work):
        return work.text_real

    def cross_keys(self, work):
        return None

    def inputs(self, work, device, dtype, g):
        return {
            "hidden_states": _randn(work.latent, g, device, dtype),
            # t.expand(B).to(latents.dtype): the pipeline's latents are float32
            "timestep": _timestep(TIMESTEP, device, torch.float32),
            "encoder_hidden_states": _randn(work.text, g, device, dtype),
            "encoder_attention_mask": _prefix_mask(work.text[1], work.text_real, device),
            "pooled_projections": _randn(
                (1, work.config["pooled_projection_dim"]), g, device, dtype
            ),
            "guidance": _timestep(self.guidance * 1000.0, device, dtype),
            "return_dict": False,
        }

    def note(self, work):
        pooled = work.config["pooled_projection_dim"]
        return {
            "latents": list(work.latent),
            "timestep": f"[{float(TIMESTEP)}] float32 (the pipeline's latents' dtype)",
            "encoder_hidden_states": _text_note(
                work,
                "LLaVA-LLaMA-3 states; HunyuanVideoPipeline pads them to 256 after the "
                "prompt template, encoder_attention_mask marks the real ones",
            ),
            "pooled_projections": f"[1, {pooled}] random (CLIP-L)",
            "guidance": f"[{self.guidance * 1000.0}] (guidance_scale {self.guidance} x 1000)",
            "self_attention": f"{work.tokens} video + {work.joint_text} text tokens "
            f"({work.joint_text_real} real) in one joint attention, in the dual- and "
            "single-stream blocks alike; the model passes a [B, 1, 1, S] bool key mask",
        }

    def layers_note(self, work):
        c, full = work.config, HUNYUAN_VIDEO_CONFIG
        if work.layers == work.full_layers:
            return "all transformer blocks"
        return (
            f"{c['num_layers']} of {full['num_layers']} dual-stream and "
            f"{c['num_single_layers']} of {full['num_single_layers']} single-stream blocks "
            f"({work.layers} of {work.full_layers}, the full model's proportion): a step of the "
            "whole model takes about full_layers / layers times as long (step_ms_per_layer); "
            "chosen for run time, memory would hold more (weights_gb is this build's)"
        )


def _pack(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, F/pt * H/p * W/p, C * pt * p * p], as LTXPipeline packs them."""
    B, C, F, H, W = latents.shape
    pt, ph, pw = patch
    x = latents.reshape(B, C, F // pt, pt, H // ph, ph, W // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


class _LTX(Family):
    """LTXVideoTransformer3DModel: packed [B, S, C] latents with the latent grid as
    num_frames/height/width; T5 text states by cross-attention (attn2) with a key mask."""

    name, class_name = "ltx", "LTXVideoTransformer3DModel"
    vae_t = 8
    # LTXPipeline: T5-XXL states padded to max_sequence_length=128; a typical (long,
    # descriptive) LTX prompt fills 100 of them
    text = (128, 100)
    tiny_text = (16, 10)
    frame_rate = 25  # LTXPipeline's default
    vae_hw = 32  # the VAE's spatial compression (rope_interpolation_scale)

    def tiny_config(self, entry):
        return dict(
            in_channels=TINY_PATCH1_LATENT[1],
            out_channels=TINY_PATCH1_LATENT[1],
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=32,
            cross_attention_dim=64,
            num_layers=2,
            caption_channels=32,
        )

    def tiny_latent(self, entry):
        return TINY_PATCH1_LATENT

    def text_dim(self, config):
        return config["caption_channels"]

    def _grid_kwargs(self, work) -> dict:
        T, H, W = work.grid_shape
        return dict(num_frames=T, height=H, width=W)

    def inputs(self, work, device, dtype, g):
        latents = torch.randn(work.latent, generator=g)
        return {
            "hidden_states": _pack(latents, self.patch(work.config)).to(device, dtype),
            "encoder_hidden_states": _randn(work.text, g, device, dtype),
            # t.expand(B): the scheduler's float32 timesteps
            "timestep": _timestep(TIMESTEP, device, torch.float32),
            "encoder_attention_mask": _prefix_mask(
                work.text[1], work.text_real, device, torch.bool
            ),
            **self._grid_kwargs(work),
            "rope_interpolation_scale": (self.vae_t / self.frame_rate, self.vae_hw, self.vae_hw),
            "return_dict": False,
        }

    def _video_note(self, work) -> dict:
        B, C, F, H, W = work.latent
        return {
            "latents": f"{list(work.latent)} random, packed to [{B}, {work.tokens}, {C}] "
            "(the pipeline's _pack_latents; patch 1)",
            "timestep": f"[{float(TIMESTEP)}] float32 (the scheduler's timesteps, expanded)",
            "grid": "num_frames, height, width = " + ", ".join(map(str, work.grid_shape)),
        }

    def note(self, work):
        return {
            **self._video_note(work),
            "encoder_hidden_states": _text_note(
                work,
                "T5-XXL states; LTXPipeline pads prompts to 128, encoder_attention_mask "
                "(bool) marks the real ones",
            ),
            "rope_interpolation_scale": f"({self.vae_t}/{self.frame_rate}, {self.vae_hw}, "
            f"{self.vae_hw}): frame_rate {self.frame_rate}, the pipeline's default",
        }


class _LTX2(_LTX):
    """LTX2VideoTransformer3DModel: LTX-2's video and audio streams, each with self-attention,
    text cross-attention and audio<->video cross-attention. Only the video self-attention
    (attn1) is made sparse; the step (both streams) is timed, rel_l2 is the video output's."""

    name, class_name = "ltx2", "LTX2VideoTransformer3DModel"
    # LTX2Pipeline: Gemma-3 states padded to max_sequence_length=1024; the text connectors
    # replace the padding with learned registers, so the transformer's mask is all ones
    text = (1024, None)
    tiny_text = (16, None)
    frame_rate = 24.0  # LTX2Pipeline's default

    def tiny_config(self, entry):
        return dict(
            super().tiny_config(entry),
            audio_in_channels=8,
            audio_out_channels=8,
            audio_num_attention_heads=2,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=16,
        )

    def conditioning(self, config, latent, tiny):
        """Also the audio latent frames of the video's duration, as LTX2Pipeline computes them:
        round(frames / frame_rate * sampling_rate / hop_length / audio_scale_factor)."""
        fields = super().conditioning(config, latent, tiny)
        if tiny:
            audio = 11  # fewer than the 300 video tokens: its self-attention is told apart
        else:
            frames = (latent[2] - 1) * self.vae_t + 1
            c = config
            per_second = c["audio_sampling_rate"] / c["audio_hop_length"] / c["audio_scale_factor"]
            audio = round(frames / self.frame_rate * per_second)
        fields["extra"] = {"audio_tokens": audio}
        return fields

    def inputs(self, work, device, dtype, g):
        latents = torch.randn(work.latent, generator=g)
        audio = work.extra["audio_tokens"]
        timestep = _timestep(TIMESTEP, device, torch.float32)
        mask = torch.ones(1, work.text[1], dtype=torch.long, device=device)
        return {
            "hidden_states": _pack(latents, self.patch(work.config)).to(device, dtype),
            "audio_hidden_states": _randn(
                (1, audio, work.config["audio_in_channels"]), g, device, dtype
            ),
            "encoder_hidden_states": _randn(work.text, g, device, dtype),
            "audio_encoder_hidden_states": _randn(work.text, g, device, dtype),
            "timestep": timestep,
            "sigma": timestep,
            "encoder_attention_mask": mask,
            "audio_encoder_attention_mask": mask,
            **self._grid_kwargs(work),
            "fps": self.frame_rate,
            "audio_num_frames": audio,
            "use_cross_timestep": False,  # LTX-2.0's behaviour (LTX2Pipeline's default is 2.3's)
            "return_dict": False,
        }

    def note(self, work):
        audio = work.extra["audio_tokens"]
        return {
            **self._video_note(work),
            "audio_hidden_states": f"[1, {audio}, {work.config['audio_in_channels']}] random "
            f"(packed audio latents of the video's duration at {self.frame_rate} fps)",
            "encoder_hidden_states": f"{list(work.text)} random, all real (the Gemma-3 text "
            "connectors' video output: padding replaced by learned registers)",
            "audio_encoder_hidden_states": f"{list(work.text)} random (the connectors' audio "
            "output)",
            "masks": "encoder_attention_mask and audio_encoder_attention_mask all ones (the "
            "connectors' mask after the registers)",
            "sigma": "the timestep, as LTX2Pipeline passes it; use_cross_timestep=False (LTX-2.0;"
            " with sigma = timestep both settings compute the same); video_coords and "
            "audio_coords computed in the forward from the grid and fps, as the pipeline does",
            "output": "the video output (rel_l2); the audio output is computed and discarded",
            "attention": f"video self-attention over {work.tokens} tokens made sparse; audio "
            f"self-attention ({audio} tokens, other_attn_ms), text and audio<->video "
            "cross-attention (cross_attn_ms) stay stock",
        }


class _Cosmos(Family):
    """CosmosTransformer3DModel (Cosmos 1.0 Text2World): latents [B, C, F, H, W], T5 text
    states by cross-attention (attn2), no text mask (the pipeline zeroes the padding)."""

    name, class_name = "cosmos", "CosmosTransformer3DModel"
    vae_t = 8
    # CosmosTextToWorldPipeline: T5-11B states padded to max_sequence_length=512, the embeddings
    # past the prompt zeroed; a typical prompt fills 128 of them
    text = (512, 128)
    tiny_text = (16, 10)
    sigma = 4.0  # a mid-trajectory EDM noise level (sigma_max 80, sigma_min 0.002)
    timestep = 0.25 * math.log(sigma)  # EDMEulerScheduler.precondition_noise: c_noise
    fps = 30  # CosmosTextToWorldPipeline's default
    repeated_blocks = ("CosmosTransformerBlock",)  # the class's _repeated_blocks is empty

    def tiny_config(self, entry):
        return dict(
            in_channels=TINY_LATENT[1] + 1,
            out_channels=TINY_LATENT[1],
            num_attention_heads=2,
            attention_head_dim=32,
            num_layers=2,
            mlp_ratio=2.0,
            text_embed_dim=32,
            adaln_lora_dim=8,
            max_size=(8, 32, 32),
            patch_size=(1, 2, 2),
            concat_padding_mask=False,
            extra_pos_embed_type="learnable",
        )

    def tiny_latent(self, entry):
        return (TINY_LATENT[0], TINY_LATENT[1] + 1, *TINY_LATENT[2:])

    def text_dim(self, config):
        return config["text_embed_dim"]

    def inputs(self, work, device, dtype, g):
        B, C, F, H, W = work.latent
        text = torch.randn(work.text, generator=g)
        text[:, work.text_real :] = 0  # the pipeline zeroes the states past the prompt
        return {
            "hidden_states": _randn((B, C - 1, F, H, W), g, device, dtype),
            "timestep": _timestep(self.timestep, device, dtype),
            "encoder_hidden_states": text.to(device, dtype),
            "fps": self.fps,
            # the padding-mask channel (zeros): COSMOS_CONFIG says why it comes in this way
            "condition_mask": torch.zeros(B, 1, F, H, W, device=device, dtype=dtype),
            "return_dict": False,
        }

    def note(self, work):
        B, C, F, H, W = work.latent
        return {
            "latents": f"{[B, C - 1, F, H, W]} random",
            "timestep": f"[{self.timestep:.4f}] in the latents' dtype: 0.25 ln(sigma) at sigma "
            f"{self.sigma} (EDM c_noise)",
            "encoder_hidden_states": f"{list(work.text)} random, the states past {work.text_real}"
            " real tokens zeroed (CosmosTextToWorldPipeline pads prompts to 512; no mask)",
            "fps": self.fps,
            "padding_mask": f"the pipeline's all-zero padding mask as one zero channel "
            f"[{B}, 1, {F}, {H}, {W}] (passed as condition_mask with in_channels 17 and "
            "concat_padding_mask off: the published model's patch embedding of the same "
            "17 channels, without torchvision)",
        }


class _Kandinsky5(Family):
    """Kandinsky5Transformer3DModel: channels-last latents [B, F, H, W, C], text blocks (a
    text-only self-attention), then visual blocks with self- and cross-attention."""

    name, class_name = "kandinsky5", "Kandinsky5Transformer3DModel"
    # Kandinsky5T2VPipeline: Qwen2.5-VL states of the prompt's tokens only (padding="longest"
    # at batch 1: no padding, no mask), up to 256 after the template; a typical prompt: 128
    text = (128, None)
    tiny_text = (12, None)

    def tiny_config(self, entry):
        return dict(
            in_visual_dim=TINY_LATENT[1],
            in_text_dim=32,
            in_text_dim2=16,
            time_dim=16,
            out_visual_dim=TINY_LATENT[1],
            patch_size=(1, 2, 2),
            model_dim=64,
            ff_dim=128,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(8, 12, 12),
            visual_cond=True,
        )

    def tiny_latent(self, entry):
        return (TINY_LATENT[0], 2 * TINY_LATENT[1] + 1, *TINY_LATENT[2:])

    def heads(self, config):
        return config["model_dim"] // self.head_dim(config)

    def head_dim(self, config):
        return sum(config["axes_dims"])

    def num_layers(self, config):
        return config["num_visual_blocks"]

    def set_layers(self, config, layers):
        config["num_visual_blocks"] = layers

    def after_init(self, model):
        # Kandinsky5Modulation zeroes its projection (adaLN-zero): with random weights every
        # block would then be an identity, hiding what the attention does from the output (and
        # from rel_l2). Drawn as nn.Linear draws any other layer instead.
        for module in model.modules():
            if type(module).__name__ == "Kandinsky5Modulation":
                module.out_layer.reset_parameters()

    def text_dim(self, config):
        return config["in_text_dim"]

    def _scale_factor(self, work) -> tuple[float, float, float]:
        """Kandinsky5T2VPipeline._get_scale_factor: (1, 2, 2) for sides within 480..854 px."""
        pixels = [n * 8 for n in work.latent[3:]]
        return (1.0, 2.0, 2.0) if all(480 <= n <= 854 for n in pixels) else (1.0, 3.16, 3.16)

    def inputs(self, work, device, dtype, g):
        B, C, F, H, W = work.latent
        noisy = work.config["in_visual_dim"]
        latents = torch.randn(B, F, H, W, noisy, generator=g)
        hidden = torch.cat([latents, torch.zeros(B, F, H, W, C - noisy)], dim=-1)
        T, h, w = work.grid_shape
        return {
            "hidden_states": hidden.to(device, dtype),
            "encoder_hidden_states": _randn(work.text, g, device, dtype),
            "timestep": _timestep(TIMESTEP, device, dtype),
            "pooled_projections": _randn((1, work.config["in_text_dim2"]), g, device, dtype),
            "visual_rope_pos": [torch.arange(n, device=device) for n in (T, h, w)],
            "text_rope_pos": torch.arange(work.text[1], device=device),
            "scale_factor": self._scale_factor(work),
            "sparse_params": None,
            "return_dict": False,
        }

    def note(self, work):
        B, C, F, H, W = work.latent
        noisy = work.config["in_visual_dim"]
        return {
            "latents": f"[{B}, {F}, {H}, {W}, {C}] channels-last: {noisy} random noisy-latent "
            "channels, then the visual condition and its mask as zeros (text-to-video)",
            "timestep": f"[{float(TIMESTEP)}] in the latents' dtype",
            "encoder_hidden_states": f"{list(work.text)} random (Qwen2.5-VL states of the "
            "prompt's tokens, unpadded; text_rope_pos = arange of them)",
            "pooled_projections": f"[1, {work.config['in_text_dim2']}] random (CLIP)",
            "visual_rope_pos": "arange of each token-grid axis " + str(list(work.grid_shape)),
            "scale_factor": str(self._scale_factor(work)) + " (the pipeline's, for this size)",
            "sparse_params": "None (regular attention, not NABLA)",
            "attention": "the visual blocks' self-attention made sparse; the text blocks' "
            "self-attention (text only: other_attn_ms) and the cross-attention stay stock",
        }


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _Wan(),
        _Hunyuan15(),
        _HunyuanVideo(),
        _LTX(),
        _LTX2(),
        _Cosmos(),
        _Kandinsky5(),
        _SkyReelsV2(),
        _WanVACE(),
        _ChronoEdit(),
        _WanAnimate(),
    )
}
CLASS_NAMES = {name: f.class_name for name, f in FAMILIES.items()}


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
    for layer in range(work.attention_layers):  # Wan VACE: its VACE blocks too
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
