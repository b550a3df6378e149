"""The models table: per covered diffusers class, only what differs between them -- which
modules are the video self-attention, how the latent grid follows from the forward's inputs,
and whether text tokens follow the video tokens in that attention. Everything else (q/k/v,
norms, RoPE, masks, output projections) stays the model's own code."""

from __future__ import annotations

from torch import nn

from vidsparse.integrations.diffusers.state import ModelSpec

# ---------------------------------------------------------------------------------------------
# grids from the forward's inputs
# ---------------------------------------------------------------------------------------------


def _argument(args: tuple, kwargs: dict, name: str, position: int):
    if name in kwargs:
        return kwargs[name]
    if len(args) > position:
        return args[position]
    raise ValueError(f"the transformer was called without {name}")


def _latents(args, kwargs):
    hidden_states = _argument(args, kwargs, "hidden_states", 0)
    if getattr(hidden_states, "ndim", None) != 5:
        got = getattr(hidden_states, "shape", type(hidden_states).__name__)
        raise ValueError(f"expected latents [B, C, F, H, W] as hidden_states, got {got}")
    return hidden_states


def _patched(sizes, patch) -> tuple[int, int, int]:
    return tuple(int(n) // int(p) for n, p in zip(sizes, patch))


def _grid_from_patch_size(model, args, kwargs):
    """``[B, C, F, H, W]`` latents and ``config.patch_size = (p_t, p_h, p_w)`` (Wan's family,
    Cosmos)."""
    return _patched(_latents(args, kwargs).shape[2:], model.config.patch_size)


def _grid_from_patch_t(model, args, kwargs):
    """``[B, C, F, H, W]`` latents, ``config.patch_size_t`` and a square ``config.patch_size``
    (HunyuanVideo, HunyuanVideo 1.5)."""
    p = model.config.patch_size
    return _patched(_latents(args, kwargs).shape[2:], (model.config.patch_size_t, p, p))


def _grid_channels_last(model, args, kwargs):
    """``[B, F, H, W, C]`` latents and ``config.patch_size`` (Kandinsky 5)."""
    hidden_states = _argument(args, kwargs, "hidden_states", 0)
    if getattr(hidden_states, "ndim", None) != 5:
        got = getattr(hidden_states, "shape", type(hidden_states).__name__)
        raise ValueError(f"expected latents [B, F, H, W, C] as hidden_states, got {got}")
    return _patched(hidden_states.shape[1:4], model.config.patch_size)


def _packed_sizes(kwargs) -> tuple[int, int, int]:
    missing = [k for k in ("num_frames", "height", "width") if kwargs.get(k) is None]
    if missing:
        raise ValueError(
            f"the transformer was called without {', '.join(missing)}: the latent grid of "
            "packed [B, S, C] hidden_states comes from them (pass them as keyword arguments)"
        )
    return tuple(int(kwargs[k]) for k in ("num_frames", "height", "width"))


def _grid_ltx(model, args, kwargs):
    """Packed ``[B, S, C]`` latents; the grid is the ``num_frames``/``height``/``width`` kwargs
    (LTX-Video patches before the transformer)."""
    return _packed_sizes(kwargs)


def _grid_ltx2(model, args, kwargs):
    """Packed ``[B, S, C]`` latents; LTX-2 patches ``num_frames``/``height``/``width`` in the
    transformer, rounding up."""
    sizes = _packed_sizes(kwargs)
    patch = (model.config.patch_size_t, model.config.patch_size, model.config.patch_size)
    return tuple(-(-n // p) for n, p in zip(sizes, patch))


# ---------------------------------------------------------------------------------------------
# real text tokens from the forward's inputs (models whose self-attention holds text)
# ---------------------------------------------------------------------------------------------


def _text_hunyuan(model, args, kwargs):
    """HunyuanVideo keeps, after the video, the text tokens ``encoder_attention_mask`` marks."""
    return _argument(args, kwargs, "encoder_attention_mask", 3).bool().sum(dim=1)


def _text_hunyuan15(model, args, kwargs):
    """HunyuanVideo 1.5 moves the real tokens of its three streams first: the Qwen2.5-VL and
    byT5 tokens their masks mark, and the image tokens unless every image embedding is zero
    (text-to-video)."""
    text = _argument(args, kwargs, "encoder_attention_mask", 3).bool().sum(dim=1)
    text_2 = _argument(args, kwargs, "encoder_attention_mask_2", 6).bool().sum(dim=1)
    image = _argument(args, kwargs, "image_embeds", 7)
    image_tokens = (image != 0).any().to(text.dtype) * image.shape[1]
    return text + text_2 + image_tokens


# ---------------------------------------------------------------------------------------------
# which modules are the video self-attention
# ---------------------------------------------------------------------------------------------


def _modules(model, *patterns: tuple[str, str]) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` for ``<blocks>.<i>.<attr>`` of each ``(blocks, attr)`` pattern, in the
    order given (the order the forward runs them)."""
    out = []
    for blocks, attr in patterns:
        for i, block in enumerate(getattr(model, blocks, None) or ()):
            out.append((f"{blocks}.{i}.{attr}", getattr(block, attr)))
    return out


def _wan_layers(model):
    # attn1 is the video self-attention; attn2 (cross-attention to text and image) stays stock.
    return _modules(model, ("blocks", "attn1"))


def _vace_layers(model):
    # The VACE blocks (run first, on the control video's tokens: the same grid) and the blocks.
    return _modules(model, ("vace_blocks", "attn1"), ("blocks", "attn1"))


def _hunyuan_layers(model):
    # Dual-stream blocks, then single-stream ones; both hold the joint [video | text] sequence.
    return _modules(model, ("transformer_blocks", "attn"), ("single_transformer_blocks", "attn"))


def _hunyuan15_layers(model):
    return _modules(model, ("transformer_blocks", "attn"))


def _transformer_blocks_attn1(model):
    # LTX, LTX-2 (attn1; audio_attn1 and the audio-video cross-attentions stay stock), Cosmos.
    return _modules(model, ("transformer_blocks", "attn1"))


def _kandinsky_layers(model):
    # The visual blocks' self-attention; the text blocks' self-attention is over text only.
    return _modules(model, ("visual_transformer_blocks", "self_attention"))


# Video tokens are in raster (t, h, w) order in every model below; conditioning frames
# (VACE's references, Wan-Animate's character, ChronoEdit's input image) are frames of the grid.
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("WanTransformer3DModel", _wan_layers, _grid_from_patch_size),
        ModelSpec("WanVACETransformer3DModel", _vace_layers, _grid_from_patch_size),
        ModelSpec("WanAnimateTransformer3DModel", _wan_layers, _grid_from_patch_size),
        ModelSpec("SkyReelsV2Transformer3DModel", _wan_layers, _grid_from_patch_size),
        ModelSpec("ChronoEditTransformer3DModel", _wan_layers, _grid_from_patch_size),
        ModelSpec(
            "HunyuanVideoTransformer3DModel",
            _hunyuan_layers,
            _grid_from_patch_t,
            "after",
            text_lengths=_text_hunyuan,
        ),
        ModelSpec(
            "HunyuanVideo15Transformer3DModel",
            _hunyuan15_layers,
            _grid_from_patch_t,
            "after",
            square_key_mask=True,
            text_lengths=_text_hunyuan15,
        ),
        ModelSpec("LTXVideoTransformer3DModel", _transformer_blocks_attn1, _grid_ltx),
        ModelSpec("LTX2VideoTransformer3DModel", _transformer_blocks_attn1, _grid_ltx2),
        ModelSpec("CosmosTransformer3DModel", _transformer_blocks_attn1, _grid_from_patch_size),
        ModelSpec("Kandinsky5Transformer3DModel", _kandinsky_layers, _grid_channels_last),
    )
}
SUPPORTED_MODELS = tuple(MODELS)

# Video transformers of diffusers this integration does not cover, and why.
_DIRECT_SDPA = "its attention calls F.scaled_dot_product_attention directly"
UNSUPPORTED_MODELS = {
    "CogVideoXTransformer3DModel": f"{_DIRECT_SDPA} on the joint [text | video] sequence",
    "ConsisIDTransformer3DModel": f"{_DIRECT_SDPA} on the joint [text | video] sequence",
    "EasyAnimateTransformer3DModel": f"{_DIRECT_SDPA} on the joint [text | video] sequence",
    "MochiTransformer3DModel": f"{_DIRECT_SDPA}, one call per sample",
    "AllegroTransformer3DModel": _DIRECT_SDPA,
    "LatteTransformer3DModel": f"{_DIRECT_SDPA}, spatial and temporal attention apart",
    "SanaVideoTransformer3DModel": "its attention is linear (ReLU kernels), not softmax",
}


def spec_for(transformer) -> ModelSpec:
    """The record of ``transformer``'s exact class; ``TypeError`` listing the covered ones."""
    # The exact class, not isinstance: a subclass may add attention layers this table has not
    # been checked against.
    name = type(transformer).__name__
    spec = MODELS.get(name)
    if spec is not None and type(transformer).__module__.startswith("diffusers."):
        return spec
    reason = UNSUPPORTED_MODELS.get(name, "it is not in vidsparse's models table")
    raise TypeError(
        f"vidsparse does not support {name}: {reason}. Supported diffusers models: "
        f"{', '.join(SUPPORTED_MODELS)}"
    )


def check_no_foreign_parallelism(layers, sequence_parallel: bool) -> None:
    """``ValueError`` if diffusers' context parallelism is on and ``ulysses=`` was not given."""
    for path, attn in layers:
        processor = getattr(attn, "processor", None)
        if getattr(processor, "_parallel_config", None) is not None and not sequence_parallel:
            raise ValueError(
                f"context parallelism is enabled on this transformer ({path}), so its "
                "attention sees sequence shards: pass "
                "ulysses=vidsparse.parallel.UlyssesAttention() to apply_sparse_attention"
            )


def query_projection(attn) -> nn.Linear:
    """The attention module's q projection (``to_q``; Kandinsky 5: ``to_query``)."""
    for name in ("to_q", "to_query"):
        proj = getattr(attn, name, None)
        if isinstance(proj, nn.Linear):
            return proj
    raise TypeError(f"{type(attn).__name__} has no to_q/to_query projection")


def attention_dims(attn) -> tuple[int, int, int]:
    """``(heads, head_dim, model dim)`` of an attention module."""
    heads = getattr(attn, "heads", None) or attn.num_heads
    proj = query_projection(attn)
    return heads, proj.out_features // heads, proj.in_features
