"""What the other modules share, defined below them all: one attention call, the interface of
a method (the methods registry implements it), a model adapter's record (the table of them is in
``models``), and the state the processors of one patched transformer share."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

STATE_ATTR = "_vidsparse_state"
"""The transformer's attribute that holds its :class:`SparseState` while it is patched."""


@dataclass(frozen=True)
class Call:
    """One attention call, as a method sees it."""

    attn: nn.Module
    layer: int
    step: int
    shape: tuple[int, int, int]  # latent grid in tokens
    text_tokens: int  # tokens after the video tokens (HunyuanVideo's text), attended densely
    hidden_states: torch.Tensor  # the attention's input [B, S, dim] (VSA's gate reads it)
    mask: torch.Tensor | None  # SDPA key mask [B, 1, 1, S] (HunyuanVideo's text padding)


class Method(abc.ABC):
    """A method's interface: what replaces the attention call (``methods.py`` registers them)."""

    name = "?"
    supports_text_tokens = True  # runs on models whose self-attention holds text (HunyuanVideo)

    # Hooks a method may override; the defaults accept everything.
    def check_model(self, num_layers: int, heads: int) -> None:  # noqa: B027
        return None

    def check_grid(self, shape: tuple[int, int, int]) -> None:  # noqa: B027
        return None

    def check_num_steps(self, num_steps: int) -> None:  # noqa: B027
        return None

    def add_modules(self, attn, *, dim, heads, head_dim) -> list[tuple[nn.Module, str]]:
        return []

    def before_forward(self, state: SparseState, device: torch.device) -> None:  # noqa: B027
        """Called by the transformer's pre-hook, once per forward, after the grid is known."""
        return None

    @abc.abstractmethod
    def attend(self, q, k, v, call: Call) -> torch.Tensor:
        """Attention output [B, H, S, D] of one call."""

    def attend_sharded(self, q, k, v, call: Call, ulysses) -> torch.Tensor:
        """Sequence shards ``[B, S/P, H, D]`` in and out (``ulysses`` set); by default the
        per-call ``attend`` on the rank's heads, which suits head-agnostic methods."""
        return ulysses(lambda heads, qh, kh, vh: self.attend(qh, kh, vh, call), q, k, v)


@dataclass(frozen=True)
class ModelAdapter:
    """One supported model family: how to find its video self-attention layers and patch size."""

    name: str
    stock_processor: str  # class name of the processor we replace
    processor_cls: type
    has_text_tokens: bool  # text tokens appended in the self-attention
    attention_layers: Callable[[nn.Module], list[tuple[int, nn.Module]]]
    patch_size: Callable[[nn.Module], tuple[int, int, int]]


@dataclass
class SparseState:
    """What the processors of one transformer share; lives on it as ``_vidsparse_state``."""

    adapter: ModelAdapter
    method: Method
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
        call = Call(attn, layer, self.step, shape, text_tokens, hidden_states, mask)
        return self.method.attend(q, k, v, call).transpose(1, 2)

    def _attend_sharded(self, attn, layer, query, key, value, hidden_states):
        """``[B, S/P, heads, D]`` sequence shards in and out; the method runs over the whole
        sequence of this rank's heads between the Ulysses exchanges."""
        shape = self._shape_for(query.shape[1] * self.ulysses.world_size)
        call = Call(attn, layer, self.step, shape, 0, hidden_states, None)
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


def state_of(transformer: nn.Module) -> SparseState:
    """The state of a patched transformer; ``ValueError`` if it is not patched."""
    state = getattr(transformer, STATE_ATTR, None)
    if state is None:
        raise ValueError("sparse attention is not applied to this transformer")
    return state
