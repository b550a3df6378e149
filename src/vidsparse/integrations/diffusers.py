"""vidsparse attention inside diffusers video transformers (diffusers >= 0.36).

::

    from vidsparse.integrations.diffusers import apply_sparse_attention, remove_sparse_attention

    apply_sparse_attention(pipe.transformer, method="vsa", sparsity=0.875)
    video = pipe(prompt, ...).frames[0]
    remove_sparse_attention(pipe.transformer)        # the stock processors again, exactly

How it plugs in::

    transformer(hidden_states [B, C, F, H, W], ...)
      forward pre-hook: grid = (F / p_t, H / p_h, W / p_w) -> state  (processors never see it)
      video self-attention of layer i -> our processor (layer i):
          q, k, v, q/k norms, RoPE: as the stock processor             [B, S, heads, D]
          attention: SDPA | video_sparse_attn | stripe_attn            on [B, heads, S, D]
          output projection: as the stock processor
      everything else (Wan's cross-attention to text, HunyuanVideo's token refiner): untouched

Methods (``method=``):

- ``"dense"``: SDPA through our processor; equals the stock processor (the proof that the
  processor forms q/k/v exactly as diffusers does).
- ``"vsa"``: :func:`vidsparse.video_sparse_attn` with ``sparsity`` or ``topk`` and, per layer, a
  zero-initialised gate projection registered on the attention module as ``vsa``
  (a :class:`vidsparse.nn.VideoSparseAttention`): trainable, in the state dict, driven by
  :class:`vidsparse.nn.SparsitySchedule`. On HunyuanVideo the joint sequence runs as
  ``video_sparse_attn(text_tokens=N)``: video queries attend their top-k tiles plus every
  (real) text key, text queries attend densely; the gate reads the video stream only.
- ``"psa"``: :func:`vidsparse.stripe_attn` with a search ``plan`` (a :class:`Plan` or a plan
  file; steps the plan marks dense run SDPA) or fixed ``specs``. The plan is indexed by the
  denoising step: set it with :func:`set_denoising_step`, or pass
  :func:`denoising_step_callback` as the pipeline's ``callback_on_step_end``. HunyuanVideo's
  text tokens are attended densely (``stripe_attn(text_tokens=...)``).

Calibration for the PSA search (:func:`capture_calibration`): dense processors (outputs
unchanged) that write each selected layer's video q/k/v at the current denoising step to a
folder as soon as it is computed, one file per (step, layer, forward call), in the format
:func:`vidsparse.search.load_calibration` reads::

    with capture_calibration(pipe.transformer, "calib/", steps=range(10, 50, 10)):
        pipe(prompt, num_inference_steps=50,
             callback_on_step_end=denoising_step_callback(pipe.transformer))
    # vidsparse search calib/ ...   or   vidsparse.search.search("calib/", grid, alpha=...)

All state lives in one :class:`_SparseState` on the transformer; ``remove_sparse_attention``
puts back the original processor objects, removes the hook and the added gate modules.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import SPATIAL_UNITS, StripeSpec
from vidsparse.nn.vsa import VideoSparseAttention, check_sparsity
from vidsparse.ops.stripe_attn.interface import (
    stripe_attn,
    stripe_attn_from_lists,
    stripe_engine_lists,
)
from vidsparse.ops.video_sparse_attn.interface import video_sparse_attn
from vidsparse.search.plan import Plan, load_plan
from vidsparse.search.search import CalibrationSample, save_calibration_sample

__all__ = [
    "SUPPORTED_MODELS",
    "METHODS",
    "apply_sparse_attention",
    "remove_sparse_attention",
    "set_denoising_step",
    "denoising_step_callback",
    "capture_calibration",
    "CalibrationCapture",
    "WanSparseAttnProcessor",
    "HunyuanVideoSparseAttnProcessor",
]

SUPPORTED_MODELS = ("WanTransformer3DModel", "HunyuanVideoTransformer3DModel")
METHODS = ("dense", "vsa", "psa")
GATE_MODULE_NAME = "vsa"  # blocks.<i>.attn1.vsa.gate_proj.weight in Wan's state dict
# PSA: non-persistent buffers of each attention module holding its engine lists (not saved)
_LIST_BUFFERS = ("_vidsparse_psa_indices", "_vidsparse_psa_counts", "_vidsparse_psa_sizes")
_STATE_ATTR = "_vidsparse_state"
_DEFAULT_TILE = (4, 4, 4)


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------


def apply_sparse_attention(
    transformer: nn.Module, method: str = "vsa", *, ulysses=None, **options
) -> None:
    """Route the video self-attention of ``transformer`` through vidsparse.

    Args:
        transformer: a diffusers ``WanTransformer3DModel`` or ``HunyuanVideoTransformer3DModel``
            (the exact classes; see ``SUPPORTED_MODELS``).
        method: ``"dense"`` (SDPA), ``"vsa"`` or ``"psa"``.
        **options: for ``"vsa"``: ``sparsity`` (float in [0, 1)) or ``topk`` (int), ``gate``
            (bool, default True: add a zero-initialised gate projection per layer), ``tile``
            (default (4, 4, 4)). For ``"psa"``: ``plan`` (a Plan or a path) or ``specs`` (one
            list of per-head ``StripeSpec`` for every layer, or one such list per layer),
            ``tile`` (the PSA block; default the plan's, else (4, 4, 4)), ``spatial_unit``
            (for ``specs``; default "block"), ``sink_frames`` (default 0), ``expect_model``
            (checked against the plan file's ``model``). ``"dense"`` takes none.
        ulysses: a :class:`vidsparse.parallel.UlyssesAttention` for sequence parallelism: the
            processors then receive this rank's sequence shard (``[B, S/P, H, D]``, as
            diffusers' context parallelism hands it, e.g. after
            ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))``)
            and run the method over the whole sequence through Ulysses all-to-alls; the latent
            grid still comes from the full input. Not with text tokens (HunyuanVideo) yet.

    Under ``torch.compile`` the processors trace without a graph break. With regional
    compilation (``transformer.compile_repeated_blocks(fullgraph=True)`` after this call) every
    method compiles one graph for all blocks (PSA: one per step bucket; its lists reach the
    blocks as buffers, see ``_PSA.before_forward``). Compiling the whole transformer makes
    PSA's per-layer specs constants, one graph per (layer, step bucket): set
    ``torch._dynamo.config.recompile_limit`` to at least that many there, or the layers past
    torch's limit (8 by default) run eagerly.

    Raises ``TypeError`` for an unsupported model class (listing the supported ones), an
    unknown option name or an option of the wrong type (``gate``, ``plan``, ``specs``),
    ``ValueError`` for bad option values, a plan for another head count or layer set, a model
    already patched, or a stock processor that was replaced by something we do not know.
    """
    _apply(transformer, lambda adapter: _make_method(method, options), ulysses)


def _apply(
    transformer: nn.Module, make_method: Callable[[_ModelAdapter], _Method], ulysses=None
) -> None:
    """Install one processor per video self-attention layer, all sharing one state."""
    adapter = _adapter_for(transformer)
    _check_ulysses(ulysses, adapter)
    if getattr(transformer, _STATE_ATTR, None) is not None:
        raise ValueError(
            "sparse attention (or a calibration capture) is already applied to this "
            "transformer; call remove_sparse_attention(transformer) first"
        )
    layers = adapter.attention_layers(transformer)
    _check_stock_processors(adapter, layers, sequence_parallel=ulysses is not None)
    heads, head_dim, dim = _attention_dims(layers[0][1])
    impl = make_method(adapter)
    impl.check_model(num_layers=len(layers), heads=heads)

    state = _SparseState(adapter=adapter, method=impl, ulysses=ulysses)
    try:
        for index, attn in layers:
            state.originals.append((attn, attn.processor))
            state.added += impl.add_modules(attn, dim=dim, heads=heads, head_dim=head_dim)
            attn.set_processor(adapter.processor_cls(state, index))
    except BaseException:
        _restore(state)  # never leave a half-patched model behind
        raise
    state.hook = transformer.register_forward_pre_hook(_grid_capture_hook(state), with_kwargs=True)
    setattr(transformer, _STATE_ATTR, state)


def remove_sparse_attention(transformer: nn.Module) -> None:
    """Undo :func:`apply_sparse_attention`: the original processor objects, no hook, no gate
    modules; outputs are bit-identical to the model before it was patched."""
    state = _state_of(transformer)
    _restore(state)
    state.hook.remove()
    delattr(transformer, _STATE_ATTR)


def _restore(state: _SparseState) -> None:
    for attn, processor in state.originals:
        attn.set_processor(processor)
    for module, name in state.added:
        delattr(module, name)
    state.originals.clear()
    state.added.clear()


def set_denoising_step(transformer: nn.Module, step: int) -> None:
    """Set the denoising step (0-based) that selects a PSA plan's bucket for later calls."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    _state_of(transformer).step = step


def denoising_step_callback(transformer: nn.Module) -> Callable:
    """A ``callback_on_step_end`` for diffusers pipelines that advances the step.

    The pipeline calls it after step ``i``; it sets step ``i + 1``, and 0 after the last step
    so the next generation starts at the plan's first (dense) step again. With classifier-free
    guidance the transformer runs twice per step, so counting forward calls would not work.
    """
    _state_of(transformer)  # fail now, not inside the pipeline loop

    def callback(pipe, i: int, t, callback_kwargs: dict) -> dict:
        total = getattr(pipe, "num_timesteps", None)
        if total is not None:
            _state_of(transformer).method.check_num_steps(total)
        step = i + 1
        set_denoising_step(transformer, 0 if total is not None and step >= total else step)
        return callback_kwargs

    return callback


# ---------------------------------------------------------------------------------------------
# shared state and the grid hook
# ---------------------------------------------------------------------------------------------


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


def _grid_capture_hook(state: _SparseState):
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


def _state_of(transformer: nn.Module) -> _SparseState:
    state = getattr(transformer, _STATE_ATTR, None)
    if state is None:
        raise ValueError("sparse attention is not applied to this transformer")
    return state


# ---------------------------------------------------------------------------------------------
# methods: what replaces the attention call
# ---------------------------------------------------------------------------------------------


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


def _sdpa(q, k, v, call: _Call) -> torch.Tensor:
    # The same call the native diffusers backend makes, so "dense" matches the stock processor.
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=call.mask, dropout_p=0.0, is_causal=False
    )


class _Method(abc.ABC):
    name = "?"

    # Hooks a method may override; the defaults accept everything.
    def check_model(self, num_layers: int, heads: int) -> None:  # noqa: B027
        return None

    def check_grid(self, shape: tuple[int, int, int]) -> None:  # noqa: B027
        return None

    def check_num_steps(self, num_steps: int) -> None:  # noqa: B027
        return None

    def add_modules(self, attn, *, dim, heads, head_dim) -> list[tuple[nn.Module, str]]:
        return []

    def before_forward(self, state: _SparseState, device: torch.device) -> None:  # noqa: B027
        """Called by the transformer's pre-hook, once per forward, after the grid is known."""
        return None

    @abc.abstractmethod
    def attend(self, q, k, v, call: _Call) -> torch.Tensor:
        """Attention output [B, H, S, D] of one call."""

    def attend_sharded(self, q, k, v, call: _Call, ulysses) -> torch.Tensor:
        """Sequence shards ``[B, S/P, H, D]`` in and out (``ulysses`` set); by default the
        per-call ``attend`` on the rank's heads, which suits head-agnostic methods."""
        return ulysses(lambda heads, qh, kh, vh: self.attend(qh, kh, vh, call), q, k, v)


class _Dense(_Method):
    name = "dense"

    def attend(self, q, k, v, call):
        return _sdpa(q, k, v, call)


class _SparseMethod(_Method):
    """Shared by VSA and PSA: one ``VideoGrid`` per latent shape, and text-padding handling."""

    def __init__(self, tile):
        self.tile = _check_tile(tile)
        self._grids: dict[tuple[int, int, int], VideoGrid] = {}
        self._mask_lengths: tuple = (None, -1, [])  # (mask, its version, real tokens per sample)

    def grid(self, shape) -> VideoGrid:
        grid = self._grids.get(shape)
        if grid is None:
            grid = self._grids[shape] = VideoGrid(shape, self.tile)
        return grid

    def attend(self, q, k, v, call):
        if call.mask is None or all(n == q.shape[2] for n in self._real_lengths(call.mask)):
            return self.sparse(q, k, v, call, call.text_tokens)
        return self._attend_unpadded(q, k, v, call)

    def _real_lengths(self, mask) -> list[int]:
        """Real tokens per sample of the ``[B, 1, 1, S]`` key mask, read back to the host once
        per mask: HunyuanVideo hands the same mask tensor to every layer of a forward, so this
        is one GPU sync per forward instead of one per layer (keyed on the tensor and its
        in-place version counter)."""
        seen, version, lengths = self._mask_lengths
        if mask is not seen or mask._version != version:
            lengths = [int(n) for n in mask.reshape(mask.shape[0], -1).sum(dim=1).tolist()]
            self._mask_lengths = (mask, mask._version, lengths)
        return lengths

    def _attend_unpadded(self, q, k, v, call):
        # The sparse kernels take no key mask, so each sample runs on its real text tokens
        # only. Padded text queries get 0: they feed nothing but padded text tokens, which
        # every later attention masks out as keys, so the video output is unaffected.
        # HunyuanVideo builds the mask as a prefix (video, real text, then padding), so a
        # sample's real tokens are its first n.
        video = q.shape[2] - call.text_tokens
        out = torch.zeros_like(q)
        for b, n in enumerate(self._real_lengths(call.mask)):
            qb, kb, vb = (x[b : b + 1, :, :n] for x in (q, k, v))
            call_b = dataclasses.replace(call, hidden_states=call.hidden_states[b : b + 1])
            out[b : b + 1, :, :n] = self.sparse(qb, kb, vb, call_b, n - video)
        return out

    @abc.abstractmethod
    def sparse(self, q, k, v, call, text_tokens) -> torch.Tensor:
        """The sparse op on one batch of unpadded sequences with ``text_tokens`` text keys."""


class _VSA(_SparseMethod):
    name = "vsa"

    def __init__(self, sparsity=None, topk=None, gate=True, tile=_DEFAULT_TILE):
        super().__init__(tile)
        if (sparsity is None) == (topk is None):
            raise ValueError("method='vsa' needs exactly one of sparsity=... or topk=...")
        self.sparsity = None if sparsity is None else check_sparsity("sparsity", sparsity)
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
            raise ValueError(f"topk must be an int >= 1, got {topk!r}")
        if not isinstance(gate, bool):
            raise TypeError(f"gate must be a bool, got {gate!r}")
        self.topk, self.gate = topk, gate

    def add_modules(self, attn, *, dim, heads, head_dim):
        if not self.gate:
            return []
        if hasattr(attn, GATE_MODULE_NAME):
            raise ValueError(f"{type(attn).__name__} already has an attribute {GATE_MODULE_NAME!r}")
        weight = attn.to_q.weight
        # VideoSparseAttention holds the zero-initialised gate projection and the sparsity a
        # SparsitySchedule sets during fine-tuning.
        module = VideoSparseAttention(
            dim,
            heads,
            head_dim,
            sparsity=self.sparsity or 0.0,
            device=weight.device,
            dtype=weight.dtype,
        )
        attn.add_module(GATE_MODULE_NAME, module)
        return [(attn, GATE_MODULE_NAME)]

    def attend_sharded(self, q, k, v, call, ulysses):
        # The gate projection reads this rank's hidden-state shard: a sequence shard like q,
        # exchanged with q, k, v.
        gate, sparsity = self._gate(q.transpose(1, 2), call, 0)
        return ulysses.video_sparse_attn(
            q,
            k,
            v,
            self.grid(call.shape),
            topk=self.topk,
            sparsity=None if self.topk is not None else sparsity,
            gate=gate.transpose(1, 2),
        )

    def _gate(self, q, call, text_tokens):
        """``(gate [B, H, S, D], sparsity)`` for q ``[B, H, S, D]``."""
        module = getattr(call.attn, GATE_MODULE_NAME, None) if self.gate else None
        if module is None:  # no gate: the fine stage alone, as a zero-initialised gate gives
            return q.new_zeros(()).expand_as(q), self.sparsity
        # The gate projection reads the video stream (HunyuanVideo's processor gets the video
        # tokens as hidden_states, the text separately); text rows have no coarse term, so
        # their gate rows are zeros that video_sparse_attn ignores.
        gate = module.gate(call.hidden_states, q[:, :, : q.shape[2] - text_tokens])
        if text_tokens:
            gate = F.pad(gate, (0, 0, 0, text_tokens))
        return gate, module.sparsity  # a SparsitySchedule may have changed it

    def sparse(self, q, k, v, call, text_tokens):
        gate, sparsity = self._gate(q, call, text_tokens)
        if self.topk is not None:
            sparsity = None
        return video_sparse_attn(
            q,
            k,
            v,
            self.grid(call.shape),
            topk=self.topk,
            sparsity=sparsity,
            gate=gate,
            text_tokens=text_tokens,
        )


class _PSA(_SparseMethod):
    name = "psa"

    def __init__(
        self,
        plan=None,
        specs=None,
        tile=None,
        spatial_unit="block",
        sink_frames=0,
        expect_model=None,
    ):
        if (plan is None) == (specs is None):
            raise ValueError("method='psa' needs exactly one of plan=... or specs=...")
        if isinstance(plan, (str, os.PathLike)):
            plan = load_plan(plan, expect_model=expect_model)
        elif plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be a vidsparse Plan or a path, got {type(plan).__name__}")
        elif plan is not None and expect_model is not None and plan.model != expect_model:
            raise ValueError(f"the plan is for model {plan.model!r}, expected {expect_model!r}")
        if plan is not None:
            if tile is not None and tuple(tile) != plan.grid.tile_shape:
                raise ValueError(
                    f"tile={tuple(tile)} differs from the plan's tile {plan.grid.tile_shape}"
                )
            tile = plan.grid.tile_shape
            if spatial_unit != "block":
                raise ValueError("spatial_unit is for specs=...; plans give block-unit specs")
        if spatial_unit not in SPATIAL_UNITS:
            raise ValueError(f"spatial_unit must be one of {SPATIAL_UNITS}, got {spatial_unit!r}")
        if isinstance(sink_frames, bool) or not isinstance(sink_frames, int) or sink_frames < 0:
            raise ValueError(f"sink_frames must be an int >= 0, got {sink_frames!r}")
        super().__init__(_DEFAULT_TILE if tile is None else tile)
        self.plan, self.raw_specs = plan, specs
        self.spatial_unit, self.sink_frames = spatial_unit, sink_frames
        self.layer_specs: list[tuple[StripeSpec, ...]] = []
        self._plan_specs: dict[tuple[int, int], tuple[StripeSpec, ...]] = {}
        # Set by before_forward: each layer's engine lists are in its attention module's
        # buffers (_LIST_BUFFERS) for this forward's step and grid.
        self.lists_ready = False
        self._lists_key: tuple | None = None

    def check_model(self, num_layers, heads):
        if self.plan is not None:
            _check_plan_fits(self.plan, num_layers, heads)
        else:
            self.layer_specs = _per_layer_specs(self.raw_specs, num_layers, heads)

    def check_grid(self, shape):
        if self.plan is not None and shape != self.plan.grid.shape:
            T, H, W = shape
            pT, pH, pW = self.plan.grid.shape
            raise ValueError(
                f"the PSA plan was made for the latent grid {pT}x{pH}x{pW} (tokens) but the "
                f"transformer got {T}x{H}x{W}: search a plan for this resolution and frame count"
            )

    def check_num_steps(self, num_steps):
        if self.plan is not None and num_steps != self.plan.num_steps:
            raise ValueError(
                f"the PSA plan was searched for {self.plan.num_steps} denoising steps but the "
                f"pipeline runs {num_steps}: its step buckets would not line up"
            )

    def add_modules(self, attn, *, dim, heads, head_dim):
        for name in _LIST_BUFFERS:
            if hasattr(attn, name):
                raise ValueError(f"{type(attn).__name__} already has an attribute {name!r}")
            attn.register_buffer(name, None, persistent=False)  # filled by before_forward
        return [(attn, name) for name in _LIST_BUFFERS]

    def before_forward(self, state, device):
        """Put each layer's engine lists for this step into its attention module's buffers.

        Under ``torch.compile`` buffers are graph inputs, so blocks whose layers have
        different specs share one compiled graph, where specs (Python constants) would give
        each layer its own. Buffer shapes are static to Dynamo, so every layer's lists are
        padded to the widest layer's width (the engine reads only ``kv_counts`` entries of a
        row). They are built once per (step bucket, grid, device), outside ``stripe_attn``'s
        cache, and the buffers hold one step bucket's lists at a time. Only done eagerly and
        for models without text tokens in the self-attention (Wan): when this hook is itself
        traced (the whole transformer compiled), under sequence parallelism, or with text
        tokens (HunyuanVideo), the processors take the specs path instead."""
        if (
            state.ulysses is not None
            or state.adapter.has_text_tokens
            or torch.compiler.is_compiling()
        ):
            self.lists_ready = False
            return
        key = (self._bucket_start(state.step), state.shape, device)
        if key != self._lists_key:
            self._install_lists(state, device)
            self._lists_key = key
        self.lists_ready = True

    def _install_lists(self, state, device) -> None:
        grid = self.grid(state.shape)
        modules = [attn for attn, _ in state.originals]
        lists = []  # per layer: (indices, counts, sizes), or Nones on a dense step
        for attn in modules:
            specs = self.specs_at(state.step, attn.processor.layer)
            lists.append(
                (None, None, None)
                if specs is None
                else stripe_engine_lists(
                    specs, grid, self.spatial_unit, self.sink_frames, device, cached=False
                )
            )
        width = max((i.shape[-1] for i, _, _ in lists if i is not None), default=0)
        for attn, (indices, counts, sizes) in zip(modules, lists):
            if indices is not None and indices.shape[-1] < width:
                padded = indices.new_zeros((*indices.shape[:-1], width))
                padded[..., : indices.shape[-1]] = indices
                indices = padded
            for name, tensor in zip(_LIST_BUFFERS, (indices, counts, sizes)):
                setattr(attn, name, tensor)

    def _bucket_start(self, step: int) -> int | None:
        """What the specs of a step depend on: the plan's bucket (``None``: a dense step)."""
        if self.plan is None:
            return 0
        bucket = self.plan.bucket_for(step)
        return None if bucket is None else bucket.start

    def specs_at(self, step: int, layer: int) -> tuple[StripeSpec, ...] | None:
        """Per-head specs, or ``None`` where the plan runs the step dense."""
        if self.plan is None:
            return self.layer_specs[layer]
        bucket = self.plan.bucket_for(step)
        if bucket is None:
            return None
        key = (bucket.start, layer)
        if key not in self._plan_specs:  # converted once per (bucket, layer), not per call
            self._plan_specs[key] = tuple(self.plan.specs_for(step, layer))
        return self._plan_specs[key]

    def attend_sharded(self, q, k, v, call, ulysses):
        specs = self.specs_at(call.step, call.layer)
        if specs is None:  # a dense step of the plan
            return ulysses(lambda heads, qh, kh, vh: _sdpa(qh, kh, vh, call), q, k, v)
        return ulysses.stripe_attn(
            q,
            k,
            v,
            self.grid(call.shape),
            specs,  # all heads: each rank takes its own
            spatial_unit=self.spatial_unit,  # "block" whenever a plan is given (__init__)
            sink_frames=self.sink_frames,
        )

    def attend(self, q, k, v, call):
        if self._bucket_start(call.step) is None:  # a dense step of the plan (any layer)
            return _sdpa(q, k, v, call)
        return super().attend(q, k, v, call)

    def sparse(self, q, k, v, call, text_tokens):
        indices = getattr(call.attn, _LIST_BUFFERS[0], None)
        if self.lists_ready and text_tokens == 0 and indices is not None:
            # This layer's lists as tensors (before_forward), not its specs: see there.
            counts, sizes = (getattr(call.attn, name) for name in _LIST_BUFFERS[1:])
            return stripe_attn_from_lists(q, k, v, self.grid(call.shape), indices, counts, sizes)
        return stripe_attn(
            q,
            k,
            v,
            self.grid(call.shape),
            self.specs_at(call.step, call.layer),
            spatial_unit=self.spatial_unit,
            sink_frames=self.sink_frames,
            text_tokens=text_tokens,
        )


class _Capture(_Method):
    """Dense attention (SDPA, as "dense") that first writes the video q/k/v of the selected
    (step, layer) calls to ``out_dir``: one layer's CPU copy in memory at a time."""

    name = "capture"

    def __init__(self, out_dir: Path, steps: frozenset[int] | None, layers: Sequence | None):
        self.out_dir, self.steps, self.raw_layers = out_dir, steps, layers
        self.layers: frozenset[int] | None = None
        self.paths: list[Path] = []
        self._calls: dict[tuple[int, int], int] = {}  # forward calls seen per (step, layer)

    def check_model(self, num_layers, heads):
        if self.raw_layers is None:
            return
        layers = _int_set("layers", self.raw_layers)
        unknown = sorted(i for i in layers if i >= num_layers)
        if unknown:
            raise ValueError(
                f"layers {unknown} do not exist: the model has {num_layers} attention layers "
                f"(0 .. {num_layers - 1})"
            )
        self.layers = layers

    def attend(self, q, k, v, call):
        if (self.steps is None or call.step in self.steps) and (
            self.layers is None or call.layer in self.layers
        ):
            self._save(q, k, v, call)
        return _sdpa(q, k, v, call)

    @torch.compiler.disable  # file I/O: under torch.compile, a graph break here, run eagerly
    def _save(self, q, k, v, call):
        # The search works on the video grid: HunyuanVideo's text tokens are left out (all
        # video keys are real, so its text padding mask does not matter here either).
        video = q.shape[2] - call.text_tokens
        q, k, v = (x[:, :, :video].detach().to("cpu").contiguous() for x in (q, k, v))
        key = (call.step, call.layer)
        n = self._calls[key] = self._calls.get(key, -1) + 1  # CFG runs a step several times
        path = self.out_dir / f"step{call.step:05d}_layer{call.layer:04d}_call{n:03d}.pt"
        sample = CalibrationSample(call.step, call.layer, q, k, v, grid_shape=call.shape)
        save_calibration_sample(sample, path)
        self.paths.append(path)


def _int_set(name: str, values) -> frozenset[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be an iterable of ints >= 0 or None, got {values!r}")
    values = list(values)
    bad = [x for x in values if isinstance(x, bool) or not isinstance(x, int) or x < 0]
    if bad or not values:
        raise ValueError(f"{name} must be a non-empty iterable of ints >= 0, got {values!r}")
    return frozenset(values)


class CalibrationCapture:
    """What :func:`capture_calibration` returns: a handle on the installed capture, and a
    context manager that removes it on exit.

    ``paths``: the files written so far, in the order they were written. ``remove()`` puts the
    original processors back (the same as :func:`remove_sparse_attention`).
    """

    def __init__(self, transformer: nn.Module, out_dir: Path, method: _Capture):
        self.transformer, self.out_dir, self._method = transformer, out_dir, method

    @property
    def paths(self) -> list[Path]:
        return list(self._method.paths)

    @property
    def active(self) -> bool:
        state = getattr(self.transformer, _STATE_ATTR, None)
        return state is not None and state.method is self._method

    def remove(self) -> None:
        if not self.active:
            raise ValueError("this calibration capture is no longer applied to the transformer")
        remove_sparse_attention(self.transformer)

    def __enter__(self) -> CalibrationCapture:
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            self.remove()


def capture_calibration(
    transformer: nn.Module,
    out_dir: str | os.PathLike,
    *,
    steps: Iterable[int] | None = None,
    layers: Iterable[int] | None = None,
) -> CalibrationCapture:
    """Record calibration samples for the PSA search while the transformer runs.

    Installs, on every video self-attention layer, a processor that attends densely (the
    outputs equal the stock processor's bit for bit) and, for the selected steps and layers,
    writes that call's video q/k/v (``[B, heads, S_video, head_dim]``, CPU copies in the
    model's dtype) with :func:`vidsparse.search.save_calibration_sample` before moving on, so
    memory holds one layer's copy at a time. One file per (step, layer, forward call):
    ``step{s}_layer{l}_call{n}.pt`` (``n`` counts repeated forwards of one step, such as the
    two passes of classifier-free guidance; the search pools them). The grid is recorded in
    every file and checked by the search.

    The step is the one set by :func:`set_denoising_step`, or by
    :func:`denoising_step_callback` in a pipeline (0 until then). HunyuanVideo: only the video
    tokens are saved (the search works on the video grid).

    Args:
        transformer: as :func:`apply_sparse_attention` (no sparse attention applied).
        out_dir: a folder, created if missing; it must not hold ``.pt`` files yet (the search
            reads every ``.pt`` file of the folder).
        steps: denoising steps to record (default all).
        layers: attention layer indices to record (default all; HunyuanVideo counts the
            dual-stream blocks, then the single-stream ones).

    Returns a :class:`CalibrationCapture`; use it as a context manager, or call ``remove()``.
    """
    step_set = None if steps is None else _int_set("steps", steps)
    if layers is not None:
        _int_set("layers", layers)  # fail before touching the folder
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(p.suffix == ".pt" for p in out.iterdir()):
        raise ValueError(
            f"out_dir {str(out)!r} already holds .pt files; capture into an empty folder (the "
            "search reads every .pt file of it)"
        )
    method = _Capture(out, step_set, None if layers is None else list(layers))
    out.mkdir(parents=True, exist_ok=True)
    _apply(transformer, lambda adapter: method)
    return CalibrationCapture(transformer, out, method)


def _check_ulysses(ulysses, adapter: _ModelAdapter) -> None:
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


def _make_method(method: str, options: dict) -> _Method:
    classes = {"dense": _Dense, "vsa": _VSA, "psa": _PSA}
    if method not in classes:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    allowed = list(inspect.signature(classes[method]).parameters)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"method={method!r} takes options {allowed}, got unknown {unknown}")
    return classes[method](**options)


def _check_tile(tile) -> tuple[int, int, int]:
    ok = isinstance(tile, Sequence) and len(tile) == 3
    ok = ok and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tile)
    if not ok:
        raise ValueError(f"tile must be 3 positive ints (T, H, W), got {tile!r}")
    return tuple(tile)


def _check_plan_fits(plan: Plan, num_layers: int, heads: int) -> None:
    if plan.num_heads != heads:
        raise ValueError(f"the PSA plan has {plan.num_heads} heads, the model {heads}")
    for bucket in plan.buckets:
        have = set(bucket.layers)
        extra = sorted(have - set(range(num_layers)))
        missing = sorted(set(range(num_layers)) - have)
        if extra or missing:
            raise ValueError(
                f"the PSA plan does not fit this model's {num_layers} layers: bucket steps "
                f"[{bucket.start}, {bucket.end}) has no entry for layers {missing} and entries "
                f"for unknown layers {extra}"
            )


def _per_layer_specs(specs, num_layers: int, heads: int) -> list[tuple[StripeSpec, ...]]:
    """``specs``: one per-head list for all layers, or one such list per layer."""
    if not isinstance(specs, Sequence) or not specs:
        raise ValueError("specs must be a non-empty list of StripeSpec (or of such lists)")
    per_layer = [specs] * num_layers if isinstance(specs[0], StripeSpec) else list(specs)
    if len(per_layer) != num_layers:
        raise ValueError(f"specs has {len(per_layer)} per-layer lists, the model {num_layers}")
    out = []
    for i, layer_specs in enumerate(per_layer):
        if not isinstance(layer_specs, Sequence) or len(layer_specs) != heads:
            n = len(layer_specs) if isinstance(layer_specs, Sequence) else layer_specs
            raise ValueError(f"specs for layer {i}: expected {heads} StripeSpec, got {n!r}")
        if not all(isinstance(s, StripeSpec) for s in layer_specs):
            raise TypeError(f"specs for layer {i} must all be StripeSpec")
        out.append(tuple(layer_specs))
    return out


# ---------------------------------------------------------------------------------------------
# processors (one per model family): q/k/v as the stock processor, attention through the state
# ---------------------------------------------------------------------------------------------


class WanSparseAttnProcessor:
    """Replaces ``WanAttnProcessor`` on Wan's video self-attention (``blocks[i].attn1``)."""

    def __init__(self, state: _SparseState, layer: int):
        self.state, self.layer = state, layer

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


class HunyuanVideoSparseAttnProcessor:
    """Replaces ``HunyuanVideoAttnProcessor2_0`` in HunyuanVideo's dual- and single-stream
    blocks. The joint sequence is ``[video tokens | text tokens]``; text is attended densely
    and its padding (``attention_mask``) is honoured."""

    def __init__(self, state: _SparseState, layer: int):
        self.state, self.layer = state, layer

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
    query, key, value = (
        proj(hidden_states).unflatten(2, (attn.heads, -1))
        for proj in (attn.to_q, attn.to_k, attn.to_v)
    )
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    if image_rotary_emb is not None:  # RoPE on the video tokens only
        rope = lambda x: apply_rotary_emb(x, image_rotary_emb, sequence_dim=1)
        if single_stream:
            query = torch.cat([rope(query[:, :-text]), query[:, -text:]], dim=1)
            key = torch.cat([rope(key[:, :-text]), key[:, -text:]], dim=1)
        else:
            query, key = rope(query), rope(key)
    if not single_stream:
        eq, ek, ev = (
            proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        query, key, value = (torch.cat(p, dim=1) for p in ((query, eq), (key, ek), (value, ev)))
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


@dataclass(frozen=True)
class _ModelAdapter:
    name: str
    stock_processor: str  # class name of the processor we replace
    processor_cls: type
    has_text_tokens: bool  # text tokens appended in the self-attention
    attention_layers: Callable[[nn.Module], list[tuple[int, nn.Module]]]
    patch_size: Callable[[nn.Module], tuple[int, int, int]]


def _wan_layers(model) -> list[tuple[int, nn.Module]]:
    # attn1 is the video self-attention; attn2 (cross-attention to text) stays stock.
    return [(i, block.attn1) for i, block in enumerate(model.blocks)]


def _hunyuan_layers(model) -> list[tuple[int, nn.Module]]:
    # Dual-stream blocks first, then single-stream: the order the forward runs them.
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    return [(i, block.attn) for i, block in enumerate(blocks)]


_ADAPTERS = {
    "WanTransformer3DModel": _ModelAdapter(
        name="WanTransformer3DModel",
        stock_processor="WanAttnProcessor",
        processor_cls=WanSparseAttnProcessor,
        has_text_tokens=False,
        attention_layers=_wan_layers,
        patch_size=lambda m: tuple(m.config.patch_size),
    ),
    "HunyuanVideoTransformer3DModel": _ModelAdapter(
        name="HunyuanVideoTransformer3DModel",
        stock_processor="HunyuanVideoAttnProcessor2_0",
        processor_cls=HunyuanVideoSparseAttnProcessor,
        has_text_tokens=True,
        attention_layers=_hunyuan_layers,
        patch_size=lambda m: (m.config.patch_size_t, m.config.patch_size, m.config.patch_size),
    ),
}


def _adapter_for(transformer) -> _ModelAdapter:
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


def _check_stock_processors(adapter: _ModelAdapter, layers, sequence_parallel: bool) -> None:
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


def _attention_dims(attn) -> tuple[int, int, int]:
    heads = attn.heads
    inner = attn.to_q.out_features
    return heads, inner // heads, attn.to_q.in_features
