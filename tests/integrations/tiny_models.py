"""Tiny random-weight diffusers video transformers (CPU, float32) and inputs for one forward.

``TINY_MODELS[name]() -> (model, inputs)``: ``model(**inputs)`` runs in well under a second.
The latent grid is 3 x 8 x 10 tokens after patching (2 x 8 x 10 for ChronoEdit's two frames),
not a multiple of the 4 x 4 x 4 tiles, so partial tiles are exercised. The HunyuanVideo models
run a batch of two whose second sample pads some text tokens.
"""

from __future__ import annotations

import torch

T, H, W = 3, 16, 20  # latent frames / height / width: 3 x 8 x 10 tokens under a (1, 2, 2) patch
TEXT = 7

_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    text_dim=24,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    rope_max_seq_len=64,
)


def _seeded(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g):
    return torch.randn(*shape, generator=g)


def _text_mask(batch: int, length: int, real_in_last: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, real_in_last:] = 0  # the last sample pads its text
    return mask


def _text_to_video(class_name: str):
    """A Wan-shaped text-to-video model of diffusers class ``class_name`` and its inputs."""
    import diffusers

    torch.manual_seed(0)
    model = getattr(diffusers, class_name)(in_channels=4, out_channels=4, **_WAN)
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(1, 4, T, H, W, g=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(1, TEXT, 24, g=g),
    )
    return model, inputs


def wan_t2v():
    return _text_to_video("WanTransformer3DModel")


def wan_i2v():
    # Wan 2.1 I2V: noise | mask | image latents on channels, CLIP image tokens into attn2; its
    # processor splits the text at a fixed 512 tokens.
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        in_channels=12, out_channels=4, image_dim=20, added_kv_proj_dim=32, **_WAN
    )
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(1, 12, T, H, W, g=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(1, 512, 24, g=g),
        encoder_hidden_states_image=_randn(1, 5, 20, g=g),
    )
    return model, inputs


def wan22_ti2v():
    # Wan 2.2 TI2V-5B: 48 latent channels, a timestep per token (the first frame's tokens at 0).
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(in_channels=48, out_channels=48, **_WAN)
    g = _seeded()
    timestep = torch.full((1, T * (H // 2) * (W // 2)), 500)
    timestep[:, : (H // 2) * (W // 2)] = 0
    inputs = dict(
        hidden_states=_randn(1, 48, T, H, W, g=g),
        timestep=timestep,
        encoder_hidden_states=_randn(1, TEXT, 24, g=g),
    )
    return model, inputs


def wan_vace():
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        in_channels=4, out_channels=4, vace_layers=[0, 1], vace_in_channels=12, **_WAN
    )
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(1, 4, T, H, W, g=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(1, TEXT, 24, g=g),
        control_hidden_states=_randn(1, 12, T, H, W, g=g),
        control_hidden_states_scale=torch.ones(2),
    )
    return model, inputs


def wan_animate():
    # Frame 0 of hidden_states is the reference character; pose latents join frames 1:.
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(0)
    model = WanAnimateTransformer3DModel(
        in_channels=12,
        latent_channels=4,
        out_channels=4,
        image_dim=20,
        added_kv_proj_dim=32,
        motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
        motion_encoder_size=16,
        motion_style_dim=8,
        motion_dim=4,
        motion_encoder_dim=8,
        face_encoder_hidden_dim=8,
        face_encoder_num_heads=2,
        inject_face_latents_blocks=2,
        motion_encoder_batch_size=8,
        **_WAN,
    )
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(1, 12, T, H, W, g=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(1, 512, 24, g=g),
        encoder_hidden_states_image=_randn(1, 5, 20, g=g),
        pose_hidden_states=_randn(1, 4, T - 1, H, W, g=g),
        face_pixel_values=_randn(1, 3, 4 * (T - 2) + 1, 16, 16, g=g),
    )
    return model, inputs


def skyreels_v2():
    return _text_to_video("SkyReelsV2Transformer3DModel")


def chronoedit():
    # Two latent frames (input image, edit); head_dim 32 splits RoPE as its buffers (12/10/10).
    from diffusers import ChronoEditTransformer3DModel

    torch.manual_seed(0)
    model = ChronoEditTransformer3DModel(
        in_channels=12,
        out_channels=4,
        image_dim=20,
        added_kv_proj_dim=64,
        **{**_WAN, "attention_head_dim": 32},
    )
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(1, 12, 2, H, W, g=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(1, 512, 24, g=g),
        encoder_hidden_states_image=_randn(1, 5, 20, g=g),
    )
    return model, inputs


def cosmos(condition_mask: bool = True):
    # concat_padding_mask=False: the padding-mask channel needs torchvision (not a dependency).
    # condition_mask: Video2World's mask channel (Text2World has none: 4 input channels).
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(0)
    model = CosmosTransformer3DModel(
        in_channels=5 if condition_mask else 4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        mlp_ratio=2.0,
        text_embed_dim=24,
        adaln_lora_dim=8,
        max_size=(8, 32, 32),
        patch_size=(1, 2, 2),
        concat_padding_mask=False,
        extra_pos_embed_type="learnable",
    )
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(1, 4, T, H, W, g=g),
        timestep=torch.tensor([0.5]),
        encoder_hidden_states=_randn(1, TEXT, 24, g=g),
        fps=24,
    )
    if condition_mask:
        inputs["condition_mask"] = torch.zeros(1, 1, T, H, W)
    return model, inputs


def kandinsky5():
    # Channels-last latents [B, F, H, W, C]; RoPE positions after the (1, 2, 2) patch.
    from diffusers import Kandinsky5Transformer3DModel

    torch.manual_seed(0)
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=4,
        in_text_dim=24,
        in_text_dim2=12,
        time_dim=16,
        out_visual_dim=4,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(4, 6, 6),
    )
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(1, T, H, W, 4, g=g),
        encoder_hidden_states=_randn(1, TEXT, 24, g=g),
        timestep=torch.tensor([500.0]),
        pooled_projections=_randn(1, 12, g=g),
        visual_rope_pos=[torch.arange(T), torch.arange(H // 2), torch.arange(W // 2)],
        text_rope_pos=torch.arange(TEXT),
        scale_factor=(1.0, 2.0, 2.0),
        sparse_params=None,
    )
    return model, inputs


def hunyuan_video():
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=24,
        pooled_projection_dim=12,
        rope_axes_dim=(4, 6, 6),
    )
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(2, 4, T, H, W, g=g),
        timestep=torch.tensor([500, 500]),
        encoder_hidden_states=_randn(2, TEXT, 24, g=g),
        encoder_attention_mask=_text_mask(2, TEXT, 4),
        pooled_projections=_randn(2, 12, g=g),
        guidance=torch.tensor([6000.0, 6000.0]),
    )
    return model, inputs


def hunyuan_video15():
    # The joint sequence: video, then image, byT5 and text tokens (real ones first per sample).
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=24,
        text_embed_2_dim=20,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
    )
    g = _seeded()
    inputs = dict(
        hidden_states=_randn(2, 9, T, H, W, g=g),
        timestep=torch.tensor([500.0, 500.0]),
        encoder_hidden_states=_randn(2, TEXT, 24, g=g),
        encoder_attention_mask=_text_mask(2, TEXT, 4),
        encoder_hidden_states_2=_randn(2, 5, 20, g=g),
        encoder_attention_mask_2=_text_mask(2, 5, 2),
        image_embeds=torch.zeros(2, 4, 16),
    )
    return model, inputs


def _ltx_inputs(g, **extra):
    return dict(
        hidden_states=_randn(1, T * (H // 2) * (W // 2), 8, g=g),
        encoder_hidden_states=_randn(1, TEXT, 24, g=g),
        timestep=torch.tensor([500]),
        encoder_attention_mask=torch.ones(1, TEXT, dtype=torch.long),
        num_frames=T,
        height=H // 2,
        width=W // 2,
        **extra,
    )


def ltx_video():
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=24,
    )
    return model, _ltx_inputs(_seeded(), rope_interpolation_scale=(0.8, 32, 32))


def ltx2_video():
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=2,
        caption_channels=24,
    )
    g = _seeded()
    audio = 11
    inputs = _ltx_inputs(
        g,
        audio_hidden_states=_randn(1, audio, 8, g=g),
        audio_encoder_hidden_states=_randn(1, TEXT, 24, g=g),
        sigma=torch.tensor([0.5]),
        audio_encoder_attention_mask=torch.ones(1, TEXT, dtype=torch.long),
        fps=24.0,
        audio_num_frames=audio,
    )
    inputs["timestep"] = torch.tensor([500.0])
    return model, inputs


def randomize_zero_parameters(model) -> None:
    """Draw the parameters that are all zero at random (small, seeded)."""
    g = _seeded(2)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and not param.any():
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


def _nonzero(factory):
    """``factory`` with the zero-initialised parameters drawn at random instead: adaLN-Zero
    style modulations start at zero (Kandinsky 5's make every block an identity), which would
    hide what the attention does from the output."""

    def build():
        model, inputs = factory()
        randomize_zero_parameters(model)
        return model, inputs

    build.__name__ = factory.__name__
    return build


TINY_MODELS = {
    "wan_t2v": _nonzero(wan_t2v),
    "wan_i2v": _nonzero(wan_i2v),
    "wan22_ti2v": _nonzero(wan22_ti2v),
    "wan_vace": _nonzero(wan_vace),
    "wan_animate": _nonzero(wan_animate),
    "skyreels_v2": _nonzero(skyreels_v2),
    "chronoedit": _nonzero(chronoedit),
    "cosmos": _nonzero(cosmos),
    "kandinsky5": _nonzero(kandinsky5),
    "hunyuan_video": _nonzero(hunyuan_video),
    "hunyuan_video15": _nonzero(hunyuan_video15),
    "ltx_video": _nonzero(ltx_video),
    "ltx2_video": _nonzero(ltx2_video),
}


def first_output(out) -> torch.Tensor:
    """The video output of a forward (a tensor, or the first element of a tuple/output)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.sample
