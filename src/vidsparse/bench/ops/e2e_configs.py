"""The end-to-end benchmark's model table: published configs, workload defaults and tiny CPU
configs (see ``e2e_model`` for the workloads built from them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
