"""The methods registry: what replaces the attention call, by ``method=`` name.

Each method is a subclass of :class:`~vidsparse.integrations.diffusers.state.Method` declared
here with ``@_register``; its constructor's parameters are the options ``apply_sparse_attention``
accepts for it and its docstring says what they mean (``apply_sparse_attention``'s help lists
them all). Adding a method is a class in this file: the routed attention call, the pre-hook and
the state call it through the hooks of ``Method`` (``state.py``, with their defaults).

- ``"dense"``: diffusers' own attention call, routed through vidsparse; equals the stock model
  bit for bit under any attention backend (the proof that the routing changes nothing).
- ``"vsa"``: :func:`vidsparse.video_sparse_attn`, optionally with a trainable per-layer gate.
- ``"psa"``: :func:`vidsparse.stripe_attn` with a search plan or fixed specs.
- ``"sta"``: :func:`vidsparse.sliding_tile_attn`, a fixed window of tiles.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import os
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vidsparse.integrations.diffusers.models import query_projection
from vidsparse.integrations.diffusers.state import Method
from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.sliding_tile import check_sliding_window
from vidsparse.masks.stripe import SPATIAL_UNITS, StripeSpec
from vidsparse.nn.vsa import VSAGate, check_sparsity
from vidsparse.ops.sliding_tile_attn import sliding_tile_attn
from vidsparse.ops.stripe_attn.interface import (
    stripe_attn,
    stripe_attn_from_lists,
    stripe_engine_lists,
)
from vidsparse.ops.video_sparse_attn.interface import video_sparse_attn
from vidsparse.ops.video_sparse_attn.reference import is_fine_only
from vidsparse.search.plan import Plan, load_plan

# The VSA gate's name on the block that holds each video self-attention module: FastVideo's
# (blocks.<i>.to_gate_compress.{weight,bias} in a Wan state dict).
GATE_MODULE_NAME = "to_gate_compress"
_GATE_REF = "_vidsparse_gate"  # the attention module's plain reference to its layer's gate
# PSA: non-persistent buffers of each attention module holding its engine lists (not saved)
_LIST_BUFFERS = ("_vidsparse_psa_indices", "_vidsparse_psa_counts", "_vidsparse_psa_sizes")
_DEFAULT_TILE = (4, 4, 4)

# name -> method class, filled by @_register in declaration order
METHOD_CLASSES: dict[str, type[Method]] = {}


def _register(cls: type[Method]) -> type[Method]:
    METHOD_CLASSES[cls.name] = cls
    return cls


@_register
class _Dense(Method):
    """``"dense"``: diffusers' own attention call through vidsparse's routing, bit-identical
    to the stock model under any attention backend. No options."""

    name = "dense"

    def attend(self, q, k, v, call):
        return call.dense(q, k, v)


def real_lengths(mask: torch.Tensor) -> list[int]:
    """Real (True) keys per sample of a ``[B, 1, 1, S]`` key mask: one host sync."""
    return [int(n) for n in mask.reshape(mask.shape[0], -1).sum(dim=1).tolist()]


class _SparseMethod(Method):
    """Shared by the sparse methods: one ``VideoGrid`` per latent shape, and text-padding
    handling."""

    def __init__(self, tile):
        self.tile = _check_tile(tile)
        self._mask_lengths: tuple = (None, -1, [])  # (mask, its version, real tokens per sample)

    def grid(self, shape) -> VideoGrid:
        # Built on every call, not kept in a dict: Dynamo guards on a dict's contents, so its
        # first insertion recompiled the second compiled block. A grid is a few ints; its
        # index tensors are cached by (shape, tile) in vidsparse.layout.
        return VideoGrid(shape, self.tile)

    def attend(self, q, k, v, call):
        lengths = self._lengths(call)
        if lengths is None or all(n == q.shape[2] for n in lengths):
            return self.sparse(q, k, v, call, call.text_tokens)
        return self._attend_unpadded(q, k, v, call, lengths)

    def _lengths(self, call) -> tuple[int, ...] | list[int] | None:
        """Real tokens per sample: from the model's inputs where its spec reads them (no host
        read in the layer), else from the mask."""
        if call.mask is None:
            return None
        if call.real_lengths is not None:
            return call.real_lengths
        return self._real_lengths(call.mask, call.mask_id)

    @torch.compiler.disable  # reads lengths back to the host: a graph break under compile
    def _real_lengths(self, mask, mask_id=None) -> list[int]:
        """Real tokens per sample of the ``[B, 1, 1, S]`` key mask, read back to the host once
        per mask rather than once per layer: keyed on ``mask_id`` (``Call.mask_id``: the
        model's mask tensor and its in-place version, or the forward where the model builds
        the same mask in every layer)."""
        key = mask_id if mask_id is not None else mask
        version = key._version if isinstance(key, torch.Tensor) else None
        seen, seen_version, lengths = self._mask_lengths
        same = seen is key if isinstance(key, torch.Tensor) else seen == key
        if not same or seen_version != version:
            lengths = real_lengths(mask)
            self._mask_lengths = (key, version, lengths)
        return lengths

    def _attend_unpadded(self, q, k, v, call, lengths):
        # The sparse kernels take no key mask, so each sample runs on its real text tokens
        # only. Padded text queries get 0: they feed nothing but padded text tokens, which
        # every later attention masks out as keys, so the video output is unaffected.
        # HunyuanVideo builds the mask as a prefix (video, real text, then padding), so a
        # sample's real tokens are its first n.
        video = q.shape[2] - call.text_tokens
        out = torch.zeros_like(q)
        for b, n in enumerate(lengths):
            qb, kb, vb = (x[b : b + 1, :, :n] for x in (q, k, v))
            call_b = dataclasses.replace(call, hidden_states=call.hidden_states[b : b + 1])
            out[b : b + 1, :, :n] = self.sparse(qb, kb, vb, call_b, n - video)
        return out

    @abc.abstractmethod
    def sparse(self, q, k, v, call, text_tokens) -> torch.Tensor:
        """The sparse op on one batch of unpadded sequences with ``text_tokens`` text keys."""


@_register
class _VSA(_SparseMethod):
    """``"vsa"``: :func:`vidsparse.video_sparse_attn` with ``sparsity`` (float in [0, 1)) or
    ``topk`` (int), ``tile`` (default (4, 4, 4)) and ``gate`` (bool, default False).

    Without a gate (a stock checkpoint) the output is the fine stage alone. ``gate=True`` (to
    fine-tune, or to load trained gates with ``load_sparse_attention``) registers per layer a
    zero :class:`vidsparse.nn.VSAGate` as ``to_gate_compress`` on the block that holds the
    attention (FastVideo's name: ``blocks.<i>.to_gate_compress`` in Wan), on the device and
    dtype of the attention's weights: ``o = o_fine + gate(x) * o_coarse`` with ``x`` the
    attention's input; trainable, in the state dict, driven by
    :class:`vidsparse.nn.SparsitySchedule`. On joint video+text attention (HunyuanVideo) the
    sequence runs as ``video_sparse_attn(text_tokens=N)``: video queries attend their top-k
    tiles plus every (real) text key, text queries attend densely; the gate reads the video
    stream only."""

    name = "vsa"

    def __init__(self, sparsity=None, topk=None, gate=False, tile=_DEFAULT_TILE):
        super().__init__(tile)
        if (sparsity is None) == (topk is None):
            raise ValueError("method='vsa' needs exactly one of sparsity=... or topk=...")
        self.sparsity = None if sparsity is None else check_sparsity("sparsity", sparsity)
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
            raise ValueError(f"topk must be an int >= 1, got {topk!r}")
        if not isinstance(gate, bool):
            raise TypeError(f"gate must be a bool, got {gate!r}")
        self.topk, self.gate = topk, gate

    def add_modules(self, parent, attn, *, dim, heads, head_dim):
        if not self.gate:
            return []
        if hasattr(parent, GATE_MODULE_NAME):
            raise ValueError(
                f"{type(parent).__name__} already has an attribute {GATE_MODULE_NAME!r}"
            )
        weight = query_projection(attn).weight
        module = VSAGate(
            dim,
            heads,
            head_dim,
            sparsity=self.sparsity or 0.0,
            device=_storage_device(weight),
            dtype=_compute_dtype(weight),
        )
        parent.add_module(GATE_MODULE_NAME, module)
        # Also reachable from the attention module (not as a submodule: the state dict keeps
        # FastVideo's key), so the call finds it without reading the layer index.
        attn.__dict__[_GATE_REF] = module
        return [(parent, GATE_MODULE_NAME), (attn, _GATE_REF)]

    def attend_sharded(self, q, k, v, call, ulysses):
        # The gate projection reads this rank's hidden-state shard: a sequence shard like q,
        # exchanged with q, k, v.
        gate, sparsity = self._gate(q.transpose(1, 2), call, 0, projected=False)
        return ulysses.video_sparse_attn(
            q,
            k,
            v,
            self.grid(call.shape),
            topk=self.topk,
            sparsity=None if self.topk is not None else sparsity,
            gate=gate if is_fine_only(gate) else gate.transpose(1, 2),
            scale=call.scale,
        )

    def _gate(self, q, call, text_tokens, projected=True):
        """``(gate [B, H, S, D], sparsity)`` for q ``[B, H, S, D]``; gate 0 without a gate
        module (the fine stage alone, as a zero gate gives, at no gate's cost). Without text
        (and ``projected``) the gate goes as its projection where it can: the op forms it
        and keeps none for the backward (``vidsparse.GateProjection``)."""
        module = getattr(call.attn, _GATE_REF, None) if self.gate else None
        if module is None:
            return 0, self.sparsity
        if projected and not text_tokens:
            projection = module.projection(call.hidden_states, q.dtype)
            if projection is not None:
                return projection, module.sparsity
        # The gate reads the video stream (HunyuanVideo's attention gets the video tokens as
        # hidden_states, the text separately); text rows have no coarse term, so their gate
        # rows are zeros that video_sparse_attn ignores.
        B, H, S, D = q.shape
        video = S - text_tokens
        gate = module(call.hidden_states).view(B, video, H, D).transpose(1, 2).to(q.dtype)
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
            scale=call.scale,
        )


def _storage_device(weight: torch.Tensor) -> torch.device:
    # Sequential CPU offload leaves meta tensors in the model; the gate then lives on the CPU
    # and VSAGate.forward moves it to the input's device.
    return torch.device("cpu") if weight.is_meta else weight.device


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    # Layerwise casting stores weights in float8 and computes in a wider dtype: keep the gate
    # in float32 then (VSAGate.forward casts to the input's dtype).
    if weight.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return weight.dtype
    return torch.float32


@_register
class _PSA(_SparseMethod):
    """``"psa"``: :func:`vidsparse.stripe_attn` with ``plan`` (a search :class:`Plan` or a
    plan file; steps the plan marks dense run SDPA) or ``specs`` (one list of per-head
    ``StripeSpec`` for every layer, or one such list per layer), ``tile`` (the PSA block;
    default the plan's, else (4, 4, 4)), ``spatial_unit`` (for ``specs``; default "block"),
    ``sink_frames`` (default 0), ``expect_model`` (checked against the plan file's
    ``model``). The plan is indexed by the denoising step: set it with
    ``set_denoising_step``, or pass ``denoising_step_callback`` as the pipeline's
    ``callback_on_step_end``. HunyuanVideo's text tokens are attended densely
    (``stripe_attn(text_tokens=...)``)."""

    name = "psa"
    uses_step = True

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
        self._dense_forwards = 0  # forwards in a row on the plan's dense steps (see below)

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

    def check_target(self, name):
        searched = None if self.plan is None else self.plan.transformer
        if searched is not None and searched != name:
            raise ValueError(
                f"the PSA plan was searched on the pipeline's {searched!r} but is given to its "
                f"{name!r}: pass one plan per transformer ({{{searched!r}: plan, ...}})"
            )

    def check_num_steps(self, num_steps):
        if self.plan is not None and num_steps != self.plan.num_steps:
            raise ValueError(
                f"the PSA plan was searched for {self.plan.num_steps} denoising steps but the "
                f"pipeline runs {num_steps}: its step buckets would not line up"
            )

    def add_modules(self, parent, attn, *, dim, heads, head_dim):
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
        tokens (HunyuanVideo), the routed calls take the specs path instead."""
        self._warn_if_never_sparse(state)
        if (
            state.ulysses is not None
            or state.spec.extra_tokens != "none"
            or torch.compiler.is_compiling()
        ):
            self.lists_ready = False
            return
        key = (self._bucket_start(state.step), state.shape, device)
        if key != self._lists_key:
            self._install_lists(state, device)
            self._lists_key = key
        self.lists_ready = True

    def _warn_if_never_sparse(self, state) -> None:
        """Warn once when a whole generation's worth of forwards (two per step, for
        classifier-free guidance) ran on the plan's dense steps: the step is not advancing, so
        the plan never gets to its sparse steps."""
        if self.plan is None or torch.compiler.is_compiling():
            return
        if self._bucket_start(state.step) is not None:
            self._dense_forwards = 0
            return
        self._dense_forwards += 1
        if self._dense_forwards == 2 * self.plan.num_steps + 1:
            warnings.warn(
                f"vidsparse: {self._dense_forwards} forwards in a row ran on the PSA plan's "
                f"dense steps (step {state.step}); the denoising step is not advancing, so no "
                "sparse step runs. Patch the pipeline (apply_sparse_attention(pipe, ...)), or "
                "call set_denoising_step / pass DenoisingStepCallback",
                stacklevel=2,
            )

    def _install_lists(self, state, device) -> None:
        grid = self.grid(state.shape)
        modules = [attn for _, attn in state.layers]
        lists = []  # per layer: (indices, counts, sizes), or Nones on a dense step
        for layer in range(len(modules)):
            specs = self.specs_at(state.step, layer)
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
            return ulysses(lambda heads, qh, kh, vh: call.dense(qh, kh, vh), q, k, v)
        return ulysses.stripe_attn(
            q,
            k,
            v,
            self.grid(call.shape),
            specs,  # all heads: each rank takes its own
            spatial_unit=self.spatial_unit,  # "block" whenever a plan is given (__init__)
            sink_frames=self.sink_frames,
            scale=call.scale,
        )

    def attend(self, q, k, v, call):
        if self._bucket_start(call.step) is None:  # a dense step of the plan (any layer)
            return call.dense(q, k, v)
        return super().attend(q, k, v, call)

    def sparse(self, q, k, v, call, text_tokens):
        indices = getattr(call.attn, _LIST_BUFFERS[0], None)
        if self.lists_ready and text_tokens == 0 and indices is not None:
            # This layer's lists as tensors (before_forward), not its specs: see there.
            counts, sizes = (getattr(call.attn, name) for name in _LIST_BUFFERS[1:])
            grid = self.grid(call.shape)
            return stripe_attn_from_lists(q, k, v, grid, indices, counts, sizes, scale=call.scale)
        return stripe_attn(
            q,
            k,
            v,
            self.grid(call.shape),
            self.specs_at(call.step, call.layer),
            spatial_unit=self.spatial_unit,
            sink_frames=self.sink_frames,
            text_tokens=text_tokens,
            scale=call.scale,
        )


@_register
class _STA(_SparseMethod):
    """``"sta"``: :func:`vidsparse.sliding_tile_attn` with ``window`` (3 odd ints, in tiles;
    default (3, 3, 3); each at most the latent grid's tiles along its axis, checked when the
    transformer first sees the grid) and ``tile`` (default (4, 4, 4)). Not on HunyuanVideo:
    ``sliding_tile_attn`` takes no text tokens."""

    name = "sta"
    supports_text_tokens = False

    def __init__(self, window=(3, 3, 3), tile=_DEFAULT_TILE):
        super().__init__(tile)
        self.window = check_sliding_window(window)

    def check_grid(self, shape):
        # In the pre-hook: a window larger than the grid fails before any layer runs.
        check_sliding_window(self.window, self.grid(shape))

    def sparse(self, q, k, v, call, text_tokens):
        return sliding_tile_attn(q, k, v, self.grid(call.shape), self.window, scale=call.scale)


METHODS = tuple(METHOD_CLASSES)


def make_method(method: str, options: dict) -> Method:
    """The registered method called ``method``, built from ``options`` (checked by name)."""
    cls = METHOD_CLASSES.get(method)
    if cls is None:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    allowed = list(inspect.signature(cls).parameters)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"method={method!r} takes options {allowed}, got unknown {unknown}")
    return cls(**options)


def describe_methods(indent: str = "") -> str:
    """Each registered method's docstring, every line prefixed by ``indent`` (to append to
    ``apply_sparse_attention``'s docstring, whose body is indented by four spaces)."""
    text = "\n\n".join(
        inspect.cleandoc(cls.__doc__ or name) for name, cls in METHOD_CLASSES.items()
    )
    return "\n".join(indent + line if line else "" for line in text.split("\n"))


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
