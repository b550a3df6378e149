"""Every covered diffusers video pipeline end to end (CPU, tiny random weights, no downloads):
``"dense"`` reproduces the stock output bit for bit, ``"vsa"`` runs to a finite output of the
same shape, and ``remove_sparse_attention`` restores the stock output bit for bit.

No tokenizers or text encoders: the prompt embeddings are given. A tiny VAE (or CLIP image
encoder, LTX-2's text connectors and audio VAE) from a small config only where the pipeline
needs one; latents returned where it can. Two steps at a small resolution.

On LTX-2 and Wan-Animate the routed calls are counted: only the video self-attention reaches
the method (not LTX-2's audio self-attention or audio-video cross-attentions, nor
Wan-Animate's face adapter); LTX-2's audio latents are compared too.
"""

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

import diffusers  # noqa: E402
import tiny_models  # noqa: E402
from tiny_models import TINY_MODELS, randomize_zero_parameters  # noqa: E402

from vidsparse.integrations.diffusers import (  # noqa: E402
    apply_sparse_attention,
    remove_sparse_attention,
)

pytestmark = pytest.mark.usefixtures("torch_backend")
STEPS = 2


def _embeds(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


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


def _wan_vae(z_dim=4):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )
    return vae.eval()


def _flow_unipc():
    return diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )


def _wan_text(batch=1, tokens=7):
    pos, neg = _embeds(batch, tokens, 24)
    return dict(prompt_embeds=pos, negative_prompt_embeds=neg, guidance_scale=2.0)


def hunyuan_video():
    model, _ = TINY_MODELS["hunyuan_video"]()
    pipe = diffusers.HunyuanVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=model.eval(),
        vae=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
    )
    embeds, _ = _embeds(1, 7, 24)
    pooled, _ = _embeds(1, 12, seed=2)
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[:, 5:] = 0
    kwargs = dict(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        prompt_attention_mask=mask,
        height=64,  # 8x VAE by default: 8 x 10 latents
        width=80,
        num_frames=9,
    )
    return pipe, kwargs


def ltx():
    model, _ = TINY_MODELS["ltx_video"]()
    pipe = diffusers.LTXPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=model.eval(),
    )
    pos, neg = _embeds(1, 7, 24)
    mask = torch.ones(1, 7, dtype=torch.long)
    kwargs = dict(
        prompt_embeds=pos,
        prompt_attention_mask=mask,
        negative_prompt_embeds=neg,
        negative_prompt_attention_mask=mask,
        height=256,  # 32x VAE by default: 8 x 10 latents
        width=320,
        num_frames=17,
    )
    return pipe, kwargs


def skyreels_v2():
    model, _ = TINY_MODELS["skyreels_v2"]()
    pipe = diffusers.SkyReelsV2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=model.eval(),
        vae=None,
        scheduler=_flow_unipc(),
    )
    return pipe, dict(**_wan_text(), height=64, width=80, num_frames=9)


def wan22_ti2v():
    # TI2V-5B: one transformer, 48 latent channels, a timestep per token; its 16x VAE is only
    # used to decode, so the default factors (8x) give the 3 x 8 x 10 latent grid.
    model, _ = TINY_MODELS["wan22_ti2v"]()
    pipe = diffusers.WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        scheduler=_flow_unipc(),
        transformer=model.eval(),
        expand_timesteps=True,
    )
    return pipe, dict(**_wan_text(), height=64, width=80, num_frames=9)


def kandinsky5():
    model, _ = TINY_MODELS["kandinsky5"]()
    pipe = diffusers.Kandinsky5T2VPipeline(
        transformer=model.eval(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    qwen, neg_qwen = _embeds(1, 7, 24)
    clip, neg_clip = _embeds(1, 12, seed=2)
    seqlens = torch.tensor([0, 7], dtype=torch.int32)
    kwargs = dict(
        prompt_embeds_qwen=qwen,
        prompt_embeds_clip=clip,
        prompt_cu_seqlens=seqlens,
        negative_prompt_embeds_qwen=neg_qwen,
        negative_prompt_embeds_clip=neg_clip,
        negative_prompt_cu_seqlens=seqlens,
        guidance_scale=2.0,
        height=64,
        width=80,
        num_frames=9,
    )
    return pipe, kwargs


class _NoGuardrail(diffusers.ModelMixin, diffusers.ConfigMixin):
    """Stands in for Cosmos' guardrail (``cosmos_guardrail``, its own weights), which the
    pipeline insists on; it never sees the transformer. Lets every prompt and video through."""

    def __init__(self):
        super().__init__()
        self.register_buffer("_device", torch.zeros(1), persistent=False)  # for pipe.device

    def check_text_safety(self, prompt):
        return True

    def check_video_safety(self, video):
        return video


def cosmos():
    # CosmosTextToWorldPipeline: no condition mask, so the 4-channel tiny model.
    model, _ = tiny_models.cosmos(condition_mask=False)
    randomize_zero_parameters(model)
    pipe = diffusers.CosmosTextToWorldPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=model.eval(),
        vae=None,
        scheduler=diffusers.EDMEulerScheduler(),
        safety_checker=_NoGuardrail(),
    )
    pos, neg = _embeds(1, 7, 24)
    kwargs = dict(
        prompt_embeds=pos,
        negative_prompt_embeds=neg,
        guidance_scale=2.0,
        height=128,  # 8x VAE, 8x temporal by default: 3 x 8 x 10 latents
        width=160,
        num_frames=17,
    )
    return pipe, kwargs


def wan_vace():
    # The control: inactive and reactive video latents (2 x 4) and the 8x VAE's mask folded
    # into 8 * 8 channels; no video or mask given, so a blank video conditions everything.
    torch.manual_seed(0)
    model = diffusers.WanVACETransformer3DModel(
        in_channels=4, out_channels=4, vace_layers=[0, 1], vace_in_channels=72, **_WAN
    )
    randomize_zero_parameters(model)
    pipe = diffusers.WanVACEPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=_wan_vae(),
        scheduler=_flow_unipc(),
        transformer=model.eval(),
    )
    # 5 frames (2 latent ones): the VAE encodes the control video at every call.
    return pipe, dict(**_wan_text(), height=64, width=80, num_frames=5)


def _clip_image_encoder():
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=20,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
    )  # 5 image tokens of width 20 (the transformers' image_dim)
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32)
    return CLIPVisionModel(config).eval(), processor


def _video(num_frames, height=64, width=80, seed=4):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    shape = (height, width, 3)
    return [
        Image.fromarray(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).numpy())
        for _ in range(num_frames)
    ]


def _image(height=64, width=80):
    return _video(1, height, width, seed=3)[0]


def chronoedit():
    model, _ = TINY_MODELS["chronoedit"]()
    encoder, processor = _clip_image_encoder()
    pipe = diffusers.ChronoEditPipeline(
        tokenizer=None,
        text_encoder=None,
        image_encoder=encoder,
        image_processor=processor,
        transformer=model.eval(),
        vae=_wan_vae(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    kwargs = dict(**_wan_text(tokens=512), image=_image(), height=64, width=80, num_frames=5)
    return pipe, kwargs


def wan_animate():
    # Frame 0 of the latents is the character (the image, VAE-encoded behind a mask); one segment
    # of 5 frames (2 latent ones) posed by the pose video, its face video (16 x 16: the motion
    # encoder's size) blanked for the unconditional pass.
    model, _ = TINY_MODELS["wan_animate"]()
    encoder, processor = _clip_image_encoder()
    pipe = diffusers.WanAnimatePipeline(
        tokenizer=None,
        text_encoder=None,
        vae=_wan_vae(),
        scheduler=_flow_unipc(),
        image_processor=processor,
        image_encoder=encoder,
        transformer=model.eval(),
    )
    kwargs = dict(
        **_wan_text(tokens=512),
        image=_image(),
        pose_video=_video(5),
        face_video=_video(5, 16, 16, seed=5),
        height=64,
        width=80,
        segment_frame_length=5,
    )
    return pipe, kwargs


def _ltx2_vae():
    # LTX-2's factors, 32x spatial (a 4 x 4 patch, three 2x blocks) and 8x temporal; only its
    # latent statistics are read (latents returned), 8 channels as the transformer's input.
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTX2Video(
        latent_channels=8,
        block_out_channels=(8, 8, 8),
        decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False,) * 4,
        downsample_type=("spatiotemporal",) * 3,
        upsample_type=("spatiotemporal",) * 3,
        upsample_residual=(False,) * 3,
        upsample_factor=(1,) * 3,
        patch_size=4,
    )
    return vae.eval()


def _ltx2_audio_vae():
    # 2 latent channels x 4 latent mel bins (16 / 4): the transformer's 8 audio input channels,
    # which base_channels' latent statistics normalize; 25 audio latents a second.
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTX2Audio(
        base_channels=8,
        ch_mult=(1,),
        num_res_blocks=1,
        resolution=32,
        latent_channels=2,
        mel_bins=16,
    )
    return vae.eval()


def _ltx2_connectors():
    # The text encoder's stacked hidden states (2 layers of width 24) into the transformer's
    # 24 caption channels, for the video and the audio stream; padding becomes 4 registers.
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=24,
        text_proj_in_factor=2,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=12,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=4,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=12,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=4,
        connector_rope_base_seq_len=32,
    )
    return connectors.eval()


def ltx2():
    # Video and audio latents (3 x 8 x 10 and 18 tokens: 17 frames at 24 fps) denoised together;
    # no vocoder (latents returned). Per step the guided batch of two, then the batch of one
    # with the audio-video cross-attentions off (modality guidance); STG left off, its default
    # block (28) is not in this 2-layer model.
    model, _ = TINY_MODELS["ltx2_video"]()
    pipe = diffusers.LTX2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=_ltx2_vae(),
        audio_vae=_ltx2_audio_vae(),
        text_encoder=None,
        tokenizer=None,
        connectors=_ltx2_connectors(),
        transformer=model.eval(),
        vocoder=None,
    )
    pos, neg = _embeds(1, 8, 48)
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[:, :3] = 0  # Gemma pads on the left
    kwargs = dict(
        prompt_embeds=pos,
        prompt_attention_mask=mask,
        negative_prompt_embeds=neg,
        negative_prompt_attention_mask=mask,
        guidance_scale=2.0,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        height=256,
        width=320,
        num_frames=17,
    )
    return pipe, kwargs


BUILDERS = {
    "wan_vace": wan_vace,
    "wan_animate": wan_animate,
    "chronoedit": chronoedit,
    "kandinsky5": kandinsky5,
    "cosmos": cosmos,
    "hunyuan_video": hunyuan_video,
    "ltx": ltx,
    "ltx2": ltx2,
    "skyreels_v2": skyreels_v2,
    "wan22_ti2v": wan22_ti2v,
}


def _generate(pipe, kwargs):
    return pipe(
        **kwargs,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
        return_dict=False,
    )


def _output(out) -> torch.Tensor:
    out = out[0]
    if isinstance(out, (list, tuple)):
        out = out[0]
    return torch.as_tensor(out)


# their tiny VAE encodes a video every generation (Wan-Animate's also decodes its segment)
SLOW = {"wan_vace", "chronoedit", "wan_animate"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in BUILDERS]
)
def test_pipeline_dense_vsa_and_removal(name):
    pipe, kwargs = BUILDERS[name]()
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return _output(_generate(pipe, kwargs))

    stock = generate()
    assert torch.isfinite(stock).all()
    apply_sparse_attention(pipe, "dense")
    try:
        dense = generate()
    finally:
        remove_sparse_attention(pipe)
    assert torch.equal(dense, stock)
    apply_sparse_attention(pipe, "vsa", sparsity=0.5)
    try:
        sparse = generate()
    finally:
        remove_sparse_attention(pipe)
    assert sparse.shape == stock.shape and torch.isfinite(sparse).all()
    assert not torch.allclose(sparse, stock, atol=1e-4)
    assert torch.equal(generate(), stock)


# Per pipeline: the tokens of one routed call (the whole latent grid after patching) and the
# batch of each transformer forward in one step.
ROUTED = {
    "ltx2": (3 * 8 * 10, [2, 1]),  # the guided batch, then modality guidance's
    "wan_animate": ((1 + 2) * 4 * 5, [1, 1]),  # the conditional pass, then the unconditional
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in ROUTED]
)
def test_only_the_video_self_attention_is_routed(name, monkeypatch):
    # Each forward routes attn1 of its two blocks, in order, and nothing else: LTX-2's audio
    # self-attention (18 tokens), its text and audio-video cross-attentions, Wan-Animate's text
    # and image cross-attention and its face adapter all go to diffusers' dispatch.
    from vidsparse.integrations.diffusers import methods

    pipe, kwargs = BUILDERS[name]()
    pipe.set_progress_bar_config(disable=True)
    seen = []
    vsa = methods.METHOD_CLASSES["vsa"]
    vsa_attend = vsa.attend

    def spy(self, q, k, v, call):
        seen.append((call.layer, q.shape[0], q.shape[2]))
        return vsa_attend(self, q, k, v, call)

    monkeypatch.setattr(vsa, "attend", spy)
    apply_sparse_attention(pipe, "vsa", sparsity=0.5)
    try:
        _generate(pipe, kwargs)
    finally:
        remove_sparse_attention(pipe)
    tokens, batches = ROUTED[name]
    expected = [(layer, b, tokens) for _ in range(STEPS) for b in batches for layer in (0, 1)]
    assert seen == expected


def test_ltx2_audio_is_stock_under_dense_and_after_removal():
    # The audio latents (the pipeline's second output) too: bit for bit under "dense"; VSA on the
    # video reaches them through the audio-video cross-attentions only.
    pipe, kwargs = ltx2()
    pipe.set_progress_bar_config(disable=True)
    stock = _generate(pipe, kwargs)[1]
    assert stock.shape == (1, 2, 18, 4) and torch.isfinite(stock).all()
    apply_sparse_attention(pipe, "dense")
    try:
        dense = _generate(pipe, kwargs)[1]
    finally:
        remove_sparse_attention(pipe)
    assert torch.equal(dense, stock)
    apply_sparse_attention(pipe, "vsa", sparsity=0.5)
    try:
        sparse = _generate(pipe, kwargs)[1]
    finally:
        remove_sparse_attention(pipe)
    assert torch.isfinite(sparse).all() and not torch.allclose(sparse, stock, atol=1e-4)
    assert torch.equal(_generate(pipe, kwargs)[1], stock)
