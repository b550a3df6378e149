"""What the other modules share, defined below them all: one attention call as a method sees
it, the interface of a method (the methods registry implements it), a model's record (the
table of them is in ``models``), and the state of one patched transformer."""

from __future__ import annotations

import abc
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from vidsparse.integrations.diffusers import dispatch
from vidsparse.utils.backend import resolve_backend

logger = logging.getLogger("vidsparse.integrations.diffusers")

STATE_ATTR = "_vidsparse_state"
"""The transformer's attribute that holds its :class:`SparseState` while it is patched."""


@dataclass(frozen=True)
class Call:
    """One video self-attention call, as a method sees it (q/k/v ``[B, H, S, D]``)."""

    attn: nn.Module
    step: int
    shape: tuple[int, int, int]  # latent grid in tokens
    text_tokens: int  # tokens after the video tokens (text, ...), attended densely
    hidden_states: torch.Tensor | None  # the attention module's input [B, S, dim] (the gate's)
    mask: torch.Tensor | None  # bool key mask [B, 1, 1, S] (padded text keys are False)
    # real (unpadded) tokens per sample, video + real text, where the model's inputs tell them
    # before any layer runs (ModelSpec.text_lengths); None: read from ``mask`` when needed
    real_lengths: tuple[int, ...] | None
    # what identifies the mask across layers (to read its real lengths once): the model's mask
    # tensor, or ("forward", n) where the model rebuilds one mask in every layer
    mask_id: Any
    scale: float | None  # softmax scale the model asked for (None: 1/sqrt(D))
    dense_fn: Callable  # diffusers' attention of [B, S, H, D] q/k/v, as the processor asked

    @property
    def layer(self) -> int:
        """The layer index (position in the model's list of video self-attention modules).
        Read it only where it matters: under ``torch.compile`` it is a guard, one graph per
        layer."""
        return self.attn._vidsparse_layer

    def dense(self, q, k, v) -> torch.Tensor:
        """Diffusers' attention (the backend the user chose, the model's mask) of this call."""
        return self.dense_fn(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


class Method(abc.ABC):
    """A method's interface: what replaces the attention call (``methods.py`` registers them)."""

    name = "?"
    supports_text_tokens = True  # runs on models whose self-attention holds text (HunyuanVideo)
    uses_step = False  # reads the denoising step (PSA's plan buckets, the capture)

    # Hooks a method may override; the defaults accept everything.
    def check_model(self, num_layers: int, heads: int) -> None:  # noqa: B027
        return None

    def check_grid(self, shape: tuple[int, int, int]) -> None:  # noqa: B027
        return None

    def check_num_steps(self, num_steps: int) -> None:  # noqa: B027
        return None

    def check_target(self, name: str) -> None:  # noqa: B027
        """Called with the transformer's name when it is patched through its pipeline."""
        return None

    def add_modules(self, parent, attn, *, dim, heads, head_dim) -> list[tuple[nn.Module, str]]:
        """Modules or buffers to register (on ``parent``, the block that holds ``attn``, or on
        ``attn``); returns ``(module, name)`` pairs that removal deletes."""
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
class ModelSpec:
    """What differs between the covered model classes (one row of ``models.MODELS``)."""

    name: str  # the diffusers class name
    # (dotted path, module) of every video self-attention module, in the order the forward
    # runs them; the position in this list is the layer index of plans and captures
    self_attention: Callable[[nn.Module], list[tuple[str, nn.Module]]]
    # the latent grid in tokens (T, H, W), from the transformer and its forward's args/kwargs
    grid: Callable[[nn.Module, tuple, dict], tuple[int, int, int]]
    # tokens after the video in the self-attention (text): "none", or "after" (their count is
    # the call's length minus the grid's tokens; a key mask marks padded ones)
    extra_tokens: str = "none"
    # the model's mask is [B, 1, S, S] = m_i & m_j (HunyuanVideo 1.5): its first row (a video
    # query, always real) is the key mask
    square_key_mask: bool = False
    # real text tokens per sample ([B] tensor) from the forward's inputs, read once per forward
    # by the transformer's pre-hook (outside compiled blocks: no graph break in a layer); the
    # routing checks it once against the model's own mask
    text_lengths: Callable[[nn.Module, tuple, dict], torch.Tensor] | None = None


@dataclass
class SparseState:
    """What the hooks of one transformer share; lives on it as ``_vidsparse_state``."""

    spec: ModelSpec
    method: Method
    name: str = "transformer"  # its name in the pipeline
    layers: list = field(default_factory=list)  # (path, attention module) per layer
    shape: tuple[int, int, int] | None = None  # latent grid in tokens, set by the pre-hook
    step: int = 0
    scheduler: Any = None  # a pipeline's scheduler: the step comes from its step_index
    dispatch_modules: tuple = ()  # model modules whose dispatch_attention_fn routes to us
    handles: list = field(default_factory=list)  # (module, hook id) of every hook we added
    added: list = field(default_factory=list)  # (module, attribute name) we registered
    ulysses: Any = None  # a vidsparse.parallel.UlyssesAttention: inputs are sequence shards
    forwards: int = 0
    text_lengths: tuple[int, ...] | None = None  # this forward's, from ModelSpec.text_lengths
    lengths_checked: bool = False  # text_lengths agreed with the model's mask once
    owner: Any = None  # the patched transformer
    _logged: set = field(default_factory=set)

    def __deepcopy__(self, memo):
        """A deep copy (of the transformer, normally) that routes like the original: the copy
        is registered with the shims too, so removing the original cannot turn the copy's
        sparse attention silently dense."""
        copied = SparseState.__new__(SparseState)
        memo[id(self)] = copied
        for f in fields(self):
            setattr(copied, f.name, copy.deepcopy(getattr(self, f.name), memo))
        for name in copied.dispatch_modules:
            dispatch.attach(name, copied.owner)
        return copied

    def log_once(self, key: str, message: str, *args, level: int = logging.WARNING) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.log(level, message, *args)

    def log_kernels_once(self, device: torch.device) -> None:
        """Log, once, which kernels the method runs on (checked before anything is computed:
        this sits on every routed call)."""
        if "kernels" in self._logged or torch.compiler.is_compiling():
            return
        self.log_once(
            "kernels", "vidsparse: %s runs on the %s kernels (%s)", self.method.name,
            resolve_backend(device), device, level=logging.INFO,
        )  # fmt: skip

    def current_step(self) -> int:
        """The denoising step: the scheduler's (when a pipeline was patched), else the one set
        by ``set_denoising_step`` or the step callback."""
        scheduler = self.scheduler
        if scheduler is None:
            return self.step
        index = getattr(scheduler, "step_index", None)
        if index is None:  # before the first scheduler.step() of this generation
            index = getattr(scheduler, "begin_index", None) or 0
        return int(index)

    def video_shape(self, video_tokens: int) -> tuple[int, int, int]:
        if self.shape is None:
            raise RuntimeError(
                "vidsparse attention called outside the transformer's forward: the latent grid "
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
