"""The end-to-end benchmark's model families, part 1: the shared base and the Wan-like
classes (``e2e_families_more`` holds the others and the ``FAMILIES`` table)."""

from __future__ import annotations

import abc
from typing import Any

import torch

from vidsparse.bench.ops.e2e_configs import (
    TEXT_TOKENS,
    TIMESTEP,
    TINY_CONFIG,
    TINY_LATENT,
    TINY_TEXT,
    WAN_ANIMATE_CONFIG,
    WAN_VACE_CONFIG,
    ModelEntry,
)

# ---------------------------------------------------------------------------------------------
# families: one per diffusers class
# ---------------------------------------------------------------------------------------------


def randn(shape, g: torch.Generator, device, dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(device, dtype)


def prefix_mask(tokens: int, real: int, device, dtype=torch.long) -> torch.Tensor:
    mask = torch.zeros(1, tokens, dtype=dtype)
    mask[:, :real] = 1
    return mask.to(device)


def timestep_tensor(value, device, dtype) -> torch.Tensor:
    return torch.tensor([float(value)], device=device, dtype=dtype)


def text_note(work: Any, what: str) -> str:
    if work.text_real is None:
        return f"{list(work.text)} random ({what})"
    return f"{list(work.text)} random, {work.text_real} real ({what})"


class Family(abc.ABC):
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
    text_dim_key = "text_dim"  # the config key of the text states' width

    # -- config --------------------------------------------------------------------------------
    @abc.abstractmethod
    def tiny_config(self, entry: ModelEntry) -> dict:
        """The tiny CPU config of this family's class."""

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
        """Width of the text states the transformer takes (its config's ``text_dim_key``)."""
        return config[self.text_dim_key]

    def conditioning(self, config: dict, latent: tuple[int, ...], tiny: bool) -> dict:
        """Workload fields of the conditioning (``text``, ``text_real``, ``extra``...), for the
        cut ``config`` and the ``latent`` shape."""
        tokens, real = self.tiny_text if tiny else self.text
        return dict(text=(1, tokens, self.text_dim(config)), text_real=real)

    def joint_text(self, work: Any) -> int:
        return 0

    def joint_text_real(self, work: Any) -> int:
        return 0

    def cross_keys(self, work: Any) -> int | None:
        return work.text[1]

    def attention_layers(self, work: Any) -> int:
        return work.layers

    # -- inputs --------------------------------------------------------------------------------
    @abc.abstractmethod
    def inputs(self, work: Any, device, dtype, g: torch.Generator) -> dict:
        """The forward's keyword arguments for one step of one CFG branch."""

    @abc.abstractmethod
    def note(self, work: Any) -> dict:
        """``meta.inputs``: the inputs in words."""

    def layers_note(self, work: Any) -> str | None:
        """``meta.layers_note`` where "the first N blocks" is not what was built."""
        return None


class Wan(Family):
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
            "hidden_states": randn(work.latent, g, device, dtype),
            "timestep": timestep,
            "encoder_hidden_states": randn(work.text, g, device, dtype),
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


class SkyReelsV2(Wan):
    """SkyReelsV2Transformer3DModel: the Wan architecture, called as SkyReelsV2Pipeline (the
    text-to-video one) calls it (no fps, no diffusion forcing)."""

    name, class_name = "skyreels-v2", "SkyReelsV2Transformer3DModel"
    pipeline = "SkyReelsV2Pipeline"


class WanVACE(Wan):
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


class ChronoEdit(Wan):
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
            "encoder_hidden_states": randn(work.text, g, device, dtype),
            "encoder_hidden_states_image": randn(work.image, g, device, dtype),
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


class WanAnimate(ChronoEdit):
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
            pose_hidden_states=randn((B, pose, F - 1, H, W), g, device, dtype),
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
