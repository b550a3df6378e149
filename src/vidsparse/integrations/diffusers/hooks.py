"""Installing and removing the processors: one per video self-attention layer, all sharing one
:class:`~vidsparse.integrations.diffusers.state.SparseState`, plus the transformer's forward
pre-hook that records the latent grid before any layer runs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vidsparse.integrations.diffusers.models import (
    adapter_for,
    attention_dims,
    check_stock_processors,
)
from vidsparse.integrations.diffusers.state import (
    STATE_ATTR,
    Method,
    ModelAdapter,
    SparseState,
    state_of,
)


def install(
    transformer: nn.Module, make_method: Callable[[ModelAdapter], Method], ulysses=None
) -> None:
    """Install one processor per video self-attention layer, all sharing one state."""
    adapter = adapter_for(transformer)
    _check_ulysses(ulysses, adapter)
    if getattr(transformer, STATE_ATTR, None) is not None:
        raise ValueError(
            "sparse attention (or a calibration capture) is already applied to this "
            "transformer; call remove_sparse_attention(transformer) first"
        )
    layers = adapter.attention_layers(transformer)
    check_stock_processors(adapter, layers, sequence_parallel=ulysses is not None)
    heads, head_dim, dim = attention_dims(layers[0][1])
    impl = make_method(adapter)
    if adapter.has_text_tokens and not impl.supports_text_tokens:
        raise ValueError(
            f"method={impl.name!r} is not supported on {adapter.name}: its self-attention holds "
            "text tokens; supported: WanTransformer3DModel"
        )
    impl.check_model(num_layers=len(layers), heads=heads)

    state = SparseState(adapter=adapter, method=impl, ulysses=ulysses)
    try:
        for index, attn in layers:
            state.originals.append((attn, attn.processor))
            state.added += impl.add_modules(attn, dim=dim, heads=heads, head_dim=head_dim)
            attn.set_processor(adapter.processor_cls(state, index))
    except BaseException:
        _restore(state)  # never leave a half-patched model behind
        raise
    state.hook = transformer.register_forward_pre_hook(_grid_capture_hook(state), with_kwargs=True)
    setattr(transformer, STATE_ATTR, state)


def uninstall(transformer: nn.Module) -> None:
    """Undo :func:`install`: the original processor objects, no hook, no added modules."""
    state = state_of(transformer)
    _restore(state)
    state.hook.remove()
    delattr(transformer, STATE_ATTR)


def _restore(state: SparseState) -> None:
    for attn, processor in state.originals:
        attn.set_processor(processor)
    for module, name in state.added:
        delattr(module, name)
    state.originals.clear()
    state.added.clear()


def _grid_capture_hook(state: SparseState):
    def hook(module, args, kwargs):
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 5:
            got = getattr(hidden_states, "shape", type(hidden_states).__name__)
            raise ValueError(f"expected latents [B, C, F, H, W] as hidden_states, got {got}")
        p_t, p_h, p_w = state.adapter.patch_size(module)
        _, _, frames, height, width = hidden_states.shape
        shape = (frames // p_t, height // p_h, width // p_w)
        state.method.check_grid(shape)
        state.shape = shape
        state.method.before_forward(state, hidden_states.device)
        return None

    return hook


def _check_ulysses(ulysses, adapter: ModelAdapter) -> None:
    if ulysses is None:
        return
    from vidsparse.parallel import UlyssesAttention

    if not isinstance(ulysses, UlyssesAttention):
        raise TypeError(
            f"ulysses must be a vidsparse.parallel.UlyssesAttention, got {type(ulysses).__name__}"
        )
    if ulysses.layout != "bshd":
        raise ValueError(
            f"ulysses must use layout='bshd' (diffusers' [B, S, H, D]), got {ulysses.layout!r}"
        )
    if adapter.has_text_tokens:
        raise ValueError(
            f"sequence parallelism (ulysses=) is not supported on {adapter.name} yet: its joint "
            "attention holds text tokens; supported: WanTransformer3DModel"
        )
