"""The model adapters table (Wan 2.1, HunyuanVideo) and their processors: q/k/v formed as the
stock processor forms them, the attention itself handed to the shared state."""

from __future__ import annotations

import torch
from torch import nn

from vidsparse.integrations.diffusers.state import ModelAdapter, SparseState

SUPPORTED_MODELS = ("WanTransformer3DModel", "HunyuanVideoTransformer3DModel")


# ---------------------------------------------------------------------------------------------
# processors (one per model family): q/k/v as the stock processor, attention through the state
# ---------------------------------------------------------------------------------------------


class _SparseAttnProcessor:
    """What the processors share: the patched transformer's state, and the index of their
    layer (the methods' per-layer choices, e.g. PSA's specs, read it)."""

    def __init__(self, state: SparseState, layer: int):
        self.state, self.layer = state, layer


class WanSparseAttnProcessor(_SparseAttnProcessor):
    """Replaces ``WanAttnProcessor`` on Wan's video self-attention (``blocks[i].attn1``)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("WanSparseAttnProcessor is for self-attention without a mask")
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        # Steps 1-3 of WanAttnProcessor.__call__ for self-attention (no image branch).
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if rotary_emb is not None:
            query = _wan_rotary(query, *rotary_emb)
            key = _wan_rotary(key, *rotary_emb)

        out = self.state.attend(attn, self.layer, query, key, value, hidden_states)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor):
    # A copy of the closure inside WanAttnProcessor.__call__ (it cannot be imported).
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class HunyuanVideoSparseAttnProcessor(_SparseAttnProcessor):
    """Replaces ``HunyuanVideoAttnProcessor2_0`` in HunyuanVideo's dual- and single-stream
    blocks. The joint sequence is ``[video tokens | text tokens]``; text is attended densely
    and its padding (``attention_mask``) is honoured."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is None:
            raise ValueError("HunyuanVideoSparseAttnProcessor expects the text stream")
        text = encoder_hidden_states.shape[1]
        query, key, value = _hunyuan_qkv(
            attn, hidden_states, encoder_hidden_states, image_rotary_emb
        )
        mask = _key_mask(attention_mask, query.shape[0], query.shape[1])
        out = self.state.attend(attn, self.layer, query, key, value, hidden_states, text, mask)
        out = out.flatten(2, 3).to(query.dtype)
        # Step 6 of the stock processor: split the streams, project each.
        out, encoder_out = out[:, :-text], out[:, -text:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            encoder_out = attn.to_add_out(encoder_out)
        return out, encoder_out


def _hunyuan_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb):
    """Steps 1-4 of ``HunyuanVideoAttnProcessor2_0.__call__``: ``[B, S_video + S_text, H, D]``."""
    from diffusers.models.embeddings import apply_rotary_emb

    single_stream = attn.add_q_proj is None  # text goes through the video projections
    text = encoder_hidden_states.shape[1]
    if single_stream:
        hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    query, key, value = _heads_qkv(
        attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k)
    )
    if image_rotary_emb is not None:  # RoPE on the video tokens only
        rope = lambda x: apply_rotary_emb(x, image_rotary_emb, sequence_dim=1)
        if single_stream:
            query = torch.cat([rope(query[:, :-text]), query[:, -text:]], dim=1)
            key = torch.cat([rope(key[:, :-text]), key[:, -text:]], dim=1)
        else:
            query, key = rope(query), rope(key)
    if not single_stream:
        eq, ek, ev = _heads_qkv(
            attn,
            encoder_hidden_states,
            (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
            (attn.norm_added_q, attn.norm_added_k),
        )
        query, key, value = (torch.cat(p, dim=1) for p in ((query, eq), (key, ek), (value, ev)))
    return query, key, value


def _heads_qkv(attn, x, projections, norms):
    """One stream's q, k, v ``[B, S, heads, D]`` through ``projections``, q and k through
    ``norms`` where the model has them."""
    query, key, value = (proj(x).unflatten(2, (attn.heads, -1)) for proj in projections)
    norm_q, norm_k = norms
    if norm_q is not None:
        query = norm_q(query)
    if norm_k is not None:
        key = norm_k(key)
    return query, key, value


def _key_mask(attention_mask, batch: int, seq: int) -> torch.Tensor | None:
    """HunyuanVideo's ``[B, 1, 1, S]`` bool key mask (checked), or ``None`` when there is none;
    a mask with every key real takes the sparse path without the per-sample loop too."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (batch, 1, 1, seq):
        raise ValueError(
            f"expected a bool key mask [B, 1, 1, S] = {(batch, 1, 1, seq)}, got "
            f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
        )
    return attention_mask


# ---------------------------------------------------------------------------------------------
# model adapters
# ---------------------------------------------------------------------------------------------


def _wan_layers(model) -> list[tuple[int, nn.Module]]:
    # attn1 is the video self-attention; attn2 (cross-attention to text) stays stock.
    return [(i, block.attn1) for i, block in enumerate(model.blocks)]


def _hunyuan_layers(model) -> list[tuple[int, nn.Module]]:
    # Dual-stream blocks first, then single-stream: the order the forward runs them.
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    return [(i, block.attn) for i, block in enumerate(blocks)]


_ADAPTERS = {
    "WanTransformer3DModel": ModelAdapter(
        name="WanTransformer3DModel",
        stock_processor="WanAttnProcessor",
        processor_cls=WanSparseAttnProcessor,
        has_text_tokens=False,
        attention_layers=_wan_layers,
        patch_size=lambda m: tuple(m.config.patch_size),
    ),
    "HunyuanVideoTransformer3DModel": ModelAdapter(
        name="HunyuanVideoTransformer3DModel",
        stock_processor="HunyuanVideoAttnProcessor2_0",
        processor_cls=HunyuanVideoSparseAttnProcessor,
        has_text_tokens=True,
        attention_layers=_hunyuan_layers,
        patch_size=lambda m: (m.config.patch_size_t, m.config.patch_size, m.config.patch_size),
    ),
}


def adapter_for(transformer) -> ModelAdapter:
    """The adapter of ``transformer``'s exact class; ``TypeError`` for an unsupported model."""
    # The exact class, not isinstance: subclasses (VACE, Animate, ...) add attention layers
    # this integration has not been checked against.
    name = type(transformer).__name__
    adapter = _ADAPTERS.get(name)
    if adapter is None or not type(transformer).__module__.startswith("diffusers."):
        raise TypeError(
            f"apply_sparse_attention does not support {name}; supported diffusers models: "
            f"{', '.join(SUPPORTED_MODELS)}"
        )
    return adapter


def check_stock_processors(adapter: ModelAdapter, layers, sequence_parallel: bool) -> None:
    """Every layer still has diffusers' stock processor, without context parallelism unless
    ``sequence_parallel``; ``ValueError`` otherwise."""
    for index, attn in layers:
        processor = attn.processor
        if type(processor).__name__ != adapter.stock_processor:
            raise ValueError(
                f"layer {index} uses attention processor {type(processor).__name__}; "
                f"apply_sparse_attention replaces only diffusers' {adapter.stock_processor} "
                "(remove other processors first)"
            )
        if getattr(processor, "_parallel_config", None) is not None and not sequence_parallel:
            raise ValueError(
                "context parallelism is enabled on this transformer, so its attention sees "
                "sequence shards: pass ulysses=vidsparse.parallel.UlyssesAttention() to "
                "apply_sparse_attention"
            )


def attention_dims(attn) -> tuple[int, int, int]:
    """``(heads, head_dim, model dim)`` of an attention module."""
    heads = attn.heads
    inner = attn.to_q.out_features
    return heads, inner // heads, attn.to_q.in_features
