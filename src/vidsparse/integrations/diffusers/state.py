"""The state the processors of one patched transformer share, and one attention call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from vidsparse.integrations.diffusers.methods import _Method
    from vidsparse.integrations.diffusers.models import _ModelAdapter

_STATE_ATTR = "_vidsparse_state"


@dataclass(frozen=True)
class _Call:
    """One attention call, as a method sees it."""

    attn: nn.Module
    layer: int
    step: int
    shape: tuple[int, int, int]  # latent grid in tokens
    text_tokens: int  # tokens after the video tokens (HunyuanVideo's text), attended densely
    hidden_states: torch.Tensor  # the attention's input [B, S, dim] (VSA's gate reads it)
    mask: torch.Tensor | None  # SDPA key mask [B, 1, 1, S] (HunyuanVideo's text padding)


@dataclass
class _SparseState:
    """What the processors of one transformer share; lives on it as ``_vidsparse_state``."""

    adapter: _ModelAdapter
    method: _Method
    shape: tuple[int, int, int] | None = None  # latent grid in tokens, set by the pre-hook
    step: int = 0
    originals: list = field(default_factory=list)  # (attention module, original processor)
    added: list = field(default_factory=list)  # (module, submodule name) we registered
    hook: Any = None
    ulysses: Any = None  # a vidsparse.parallel.UlyssesAttention: inputs are sequence shards

    def attend(self, attn, layer, query, key, value, hidden_states, text_tokens=0, mask=None):
        """Attention of ``[B, S, heads, D]`` q/k/v (video first, then ``text_tokens``) in
        diffusers' layout; the method sees ``[B, heads, S, D]``."""
        if self.ulysses is not None:
            return self._attend_sharded(attn, layer, query, key, value, hidden_states)
        shape = self._shape_for(query.shape[1] - text_tokens)
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        call = _Call(attn, layer, self.step, shape, text_tokens, hidden_states, mask)
        return self.method.attend(q, k, v, call).transpose(1, 2)

    def _attend_sharded(self, attn, layer, query, key, value, hidden_states):
        """``[B, S/P, heads, D]`` sequence shards in and out; the method runs over the whole
        sequence of this rank's heads between the Ulysses exchanges."""
        shape = self._shape_for(query.shape[1] * self.ulysses.world_size)
        call = _Call(attn, layer, self.step, shape, 0, hidden_states, None)
        return self.method.attend_sharded(query, key, value, call, self.ulysses)

    def _shape_for(self, video_tokens: int) -> tuple[int, int, int]:
        if self.shape is None:
            raise RuntimeError(
                "vidsparse processor called outside the transformer's forward: the latent grid "
                "is recorded by a pre-hook on the transformer, so call the transformer itself"
            )
        T, H, W = self.shape
        if video_tokens != T * H * W:
            raise ValueError(
                f"the attention holds {video_tokens} video tokens but the latent grid "
                f"{T}x{H}x{W} has {T * H * W} (for sequence parallelism pass ulysses= to "
                "apply_sparse_attention; token dropping is not supported)"
            )
        return self.shape


def _state_of(transformer: nn.Module) -> _SparseState:
    state = getattr(transformer, _STATE_ATTR, None)
    if state is None:
        raise ValueError("sparse attention is not applied to this transformer")
    return state
