"""The end-to-end benchmark's model families, part 2: HunyuanVideo, LTX, Cosmos, Kandinsky
and the ``FAMILIES`` table."""

from __future__ import annotations

import math

import torch

from vidsparse.bench.ops.e2e_configs import (
    HUNYUAN_VIDEO_CONFIG,
    HY15_BYT5,
    HY15_IMAGE_TOKENS,
    HY15_TEXT,
    TIMESTEP,
    TINY_HY15,
    TINY_HY15_CONFIG,
    TINY_LATENT,
    TINY_PATCH1_LATENT,
)
from vidsparse.bench.ops.e2e_families import (
    ChronoEdit,
    Family,
    SkyReelsV2,
    Wan,
    WanAnimate,
    WanVACE,
    prefix_mask,
    randn,
    text_note,
    timestep_tensor,
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
            "timestep": timestep_tensor(TIMESTEP, device, dtype),
            "encoder_hidden_states": randn(work.text, g, device, dtype),
            "encoder_attention_mask": prefix_mask(work.text[1], work.text_real, device),
            "encoder_hidden_states_2": randn(work.text_2, g, device, dtype),
            "encoder_attention_mask_2": prefix_mask(work.text_2[1], work.text_2_real, device),
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

    text_dim_key = "text_embed_dim"

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
            "hidden_states": randn(work.latent, g, device, dtype),
            # t.expand(B).to(latents.dtype): the pipeline's latents are float32
            "timestep": timestep_tensor(TIMESTEP, device, torch.float32),
            "encoder_hidden_states": randn(work.text, g, device, dtype),
            "encoder_attention_mask": prefix_mask(work.text[1], work.text_real, device),
            "pooled_projections": randn(
                (1, work.config["pooled_projection_dim"]), g, device, dtype
            ),
            "guidance": timestep_tensor(self.guidance * 1000.0, device, dtype),
            "return_dict": False,
        }

    def note(self, work):
        pooled = work.config["pooled_projection_dim"]
        return {
            "latents": list(work.latent),
            "timestep": f"[{float(TIMESTEP)}] float32 (the pipeline's latents' dtype)",
            "encoder_hidden_states": text_note(
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

    text_dim_key = "caption_channels"

    def _grid_kwargs(self, work) -> dict:
        T, H, W = work.grid_shape
        return dict(num_frames=T, height=H, width=W)

    def inputs(self, work, device, dtype, g):
        latents = torch.randn(work.latent, generator=g)
        return {
            "hidden_states": _pack(latents, self.patch(work.config)).to(device, dtype),
            "encoder_hidden_states": randn(work.text, g, device, dtype),
            # t.expand(B): the scheduler's float32 timesteps
            "timestep": timestep_tensor(TIMESTEP, device, torch.float32),
            "encoder_attention_mask": prefix_mask(work.text[1], work.text_real, device, torch.bool),
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
            "encoder_hidden_states": text_note(
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
        timestep = timestep_tensor(TIMESTEP, device, torch.float32)
        mask = torch.ones(1, work.text[1], dtype=torch.long, device=device)
        return {
            "hidden_states": _pack(latents, self.patch(work.config)).to(device, dtype),
            "audio_hidden_states": randn(
                (1, audio, work.config["audio_in_channels"]), g, device, dtype
            ),
            "encoder_hidden_states": randn(work.text, g, device, dtype),
            "audio_encoder_hidden_states": randn(work.text, g, device, dtype),
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

    text_dim_key = "text_embed_dim"

    def inputs(self, work, device, dtype, g):
        B, C, F, H, W = work.latent
        text = torch.randn(work.text, generator=g)
        text[:, work.text_real :] = 0  # the pipeline zeroes the states past the prompt
        return {
            "hidden_states": randn((B, C - 1, F, H, W), g, device, dtype),
            "timestep": timestep_tensor(self.timestep, device, dtype),
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

    text_dim_key = "in_text_dim"

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
            "encoder_hidden_states": randn(work.text, g, device, dtype),
            "timestep": timestep_tensor(TIMESTEP, device, dtype),
            "pooled_projections": randn((1, work.config["in_text_dim2"]), g, device, dtype),
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
        Wan(),
        _Hunyuan15(),
        _HunyuanVideo(),
        _LTX(),
        _LTX2(),
        _Cosmos(),
        _Kandinsky5(),
        SkyReelsV2(),
        WanVACE(),
        ChronoEdit(),
        WanAnimate(),
    )
}
CLASS_NAMES = {name: f.class_name for name, f in FAMILIES.items()}
