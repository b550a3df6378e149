"""``VideoSparseAttention``: the trainable VSA module (wraps :func:`video_sparse_attn`).

The module owns what training needs beyond the functional op: the gate projection and the
current sparsity. It does not own the q/k/v projections, the normalisation or the output
projection: those stay in the user's attention block, which calls this module where it called
``F.scaled_dot_product_attention``.

Gate design::

    gate = gate_proj(hidden_states)            [B, S, dim] -> [B, S, heads * head_dim]
         -> view [B, S, heads, head_dim] -> transpose -> [B, heads, S, head_dim]   (q's layout)
    o    = o_fine + gate * o_coarse            (one gate value per head and channel, as FastVideo)

``gate_proj`` is zero-initialised (weight and bias), so a freshly built module returns the fine
stage alone. At sparsity 0 the fine stage attends every tile, i.e. it *is* dense attention: a
dense checkpoint fine-tuned with this module starts from exactly its dense output, and the
coarse branch is blended in only as far as training finds it useful.

Without ``hidden_states`` the gate is zero and the output is the fine stage alone (the same
output a zero-initialised gate gives). The ungated ``o_fine + o_coarse`` of the functional op is
deliberately not the module's default: it would move the output away from the dense checkpoint
at step 0. Call :func:`vidsparse.video_sparse_attn` with ``gate=None`` directly if you want it.

Example, inside a DiT attention block::

    self.attn = VideoSparseAttention(dim=hidden, heads=heads, head_dim=hidden // heads)
    ...
    q, k, v = ...                                    # [B, heads, S, head_dim]
    o = self.attn(q, k, v, grid, hidden_states=x)    # x: [B, S, hidden], the block's input
"""

from __future__ import annotations

import torch
from torch import nn

from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.video_sparse_attn.gate import GateProjection
from vidsparse.ops.video_sparse_attn.interface import video_sparse_attn
from vidsparse.utils.checks import check_positive_int, check_scale

__all__ = ["VSAGate", "VideoSparseAttention", "check_sparsity"]


def check_sparsity(name: str, value) -> float:
    """``value`` as a float in ``[0, 1)``; a clear ``TypeError``/``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


class _Sparsity:
    """The checked ``sparsity`` attribute that :class:`SparsitySchedule` sets."""

    @property
    def sparsity(self) -> float:
        return self._sparsity

    @sparsity.setter
    def sparsity(self, value: float) -> None:
        self._sparsity = check_sparsity("sparsity", value)


def _zero_(linear: nn.Linear) -> None:
    nn.init.zeros_(linear.weight)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


_AUTOCAST_INPUTS = (torch.float16, torch.bfloat16, torch.float32)


def _forward_is_hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs more than its class's ``forward``: torch hooks, or a
    forward replaced on the instance (diffusers' and accelerate's hooks wrap it so)."""
    return bool(
        "forward" in module.__dict__
        or module._forward_hooks
        or module._forward_pre_hooks
        or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
    )


def _params_on(linear: nn.Linear, **target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linear``'s weight and bias moved (and cast) to ``target``."""
    bias = None if linear.bias is None else linear.bias.to(**target)
    return linear.weight.to(**target), bias


def linear_projection(
    linear: nn.Linear, hidden_states: torch.Tensor, dtype
) -> GateProjection | None:
    """``linear(hidden_states)`` as a :class:`GateProjection` whose gate is the value
    ``linear(hidden_states).to(dtype)`` has (its inputs cast as ``F.linear`` under autocast
    casts them, the parameters moved to the input's device). None where the module must be
    called (its forward wrapped or hooked: offloading, layerwise casting; its weight not
    materialised) or where that product is formed in another dtype than ``dtype``: then pass
    the tensor."""
    if linear.weight.is_meta or _forward_is_hooked(linear):
        return None
    device = hidden_states.device
    if torch.is_autocast_enabled(device.type):
        if hidden_states.dtype not in _AUTOCAST_INPUTS:
            return None
        compute = torch.get_autocast_dtype(device.type)
    else:
        compute = hidden_states.dtype
    if compute != dtype:
        return None
    target = {"device": device, "dtype": compute}
    return GateProjection(hidden_states.to(**target), *_params_on(linear, **target))


class VideoSparseAttention(_Sparsity, nn.Module):
    """Trainable Video Sparse Attention with a learned, zero-initialised coarse-branch gate.

    Args:
        dim: channels of ``hidden_states`` (the input of the gate projection).
        heads: attention heads ``H``.
        head_dim: channels per head ``D``.
        sparsity: initial fraction of key tiles each query tile skips, in ``[0, 1)``; default 0
            (dense). Training code usually leaves it to :class:`SparsitySchedule`, which sets
            ``module.sparsity`` every step. It is not part of the state dict (the schedule
            recomputes it from the step when a run resumes).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        bias: whether ``gate_proj`` has a bias (zero-initialised too).

    Attributes:
        gate_proj: ``nn.Linear(dim, heads * head_dim)``, zero-initialised; saved in the state dict.
        sparsity: the sparsity used by :meth:`forward` unless a call overrides it.

    Training loop lines a user adds (see :class:`SparsitySchedule`)::

        schedule = SparsitySchedule(target=0.875, warmup_steps=500, ramp_steps=3000, num_levels=4)
        for step, batch in enumerate(loader):
            schedule.apply(model, step)    # sets .sparsity on every VideoSparseAttention
            loss = model(batch).loss
            ...
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        *,
        sparsity: float = 0.0,
        scale: float | None = None,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.heads = check_positive_int("heads", heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.sparsity = sparsity
        self.scale = check_scale(scale)
        self.gate_proj = nn.Linear(dim, heads * head_dim, bias=bias, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero the gate projection: the output is the fine stage alone (dense at sparsity 0)."""
        _zero_(self.gate_proj)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grid: VideoGrid,
        *,
        hidden_states: torch.Tensor | None = None,
        tiled: bool = False,
        sparsity: float | None = None,
    ) -> torch.Tensor:
        """``o = o_fine + gate * o_coarse`` with ``gate = gate_proj(hidden_states)``.

        Args:
            q, k, v: ``[B, heads, S, head_dim]``; ``S == grid.num_tokens`` (natural order) or
                ``grid.padded_len`` with ``tiled=True``.
            grid: the latent :class:`VideoGrid`.
            hidden_states: ``[B, S, dim]`` in the same token order as q (tile order with
                ``tiled=True``). ``None``: zero gate, the output is the fine stage alone.
            tiled: inputs and output in tile order.
            sparsity: overrides ``self.sparsity`` for this call.

        Returns ``o``: ``[B, heads, S, head_dim]`` in q's dtype.
        """
        self._check_heads(q)
        sparsity = self.sparsity if sparsity is None else check_sparsity("sparsity", sparsity)
        # 0: the fine stage alone
        gate = 0 if hidden_states is None else self._gate_for_op(hidden_states, q)
        return video_sparse_attn(
            q, k, v, grid, sparsity=sparsity, gate=gate, tiled=tiled, scale=self.scale
        )

    def gate(self, hidden_states: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        """The gate in q's layout ``[B, H, S, D]`` and dtype; zeros without ``hidden_states``."""
        if hidden_states is None:  # forward passes 0 instead: no tensor, no coarse term
            return q.new_zeros(()).expand_as(q)
        self._check_hidden_states(hidden_states, q)
        B, S, _ = hidden_states.shape
        gate = self.gate_proj(hidden_states)  # [B, S, H * D]
        gate = gate.view(B, S, self.heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]
        return gate.to(q.dtype)

    def _gate_for_op(self, hidden_states: torch.Tensor, q: torch.Tensor):
        """The gate as the op takes it: its projection, which the op forms and does not keep
        for the backward (``GateProjection``), else the tensor."""
        self._check_hidden_states(hidden_states, q)
        projection = linear_projection(self.gate_proj, hidden_states, q.dtype)
        return projection if projection is not None else self.gate(hidden_states, q)

    def _check_heads(self, q: torch.Tensor) -> None:
        if not isinstance(q, torch.Tensor) or q.ndim != 4:
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be [B, heads, S, head_dim], got {shape}")
        if (q.shape[1], q.shape[3]) != (self.heads, self.head_dim):
            raise ValueError(
                f"q must have heads={self.heads} and head_dim={self.head_dim} "
                f"([B, H, S, D]), got shape {tuple(q.shape)}"
            )

    def _check_hidden_states(self, hidden_states, q: torch.Tensor) -> None:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(
                f"hidden_states must be a torch.Tensor or None, got {type(hidden_states).__name__}"
            )
        expected = (q.shape[0], q.shape[2], self.dim)
        if tuple(hidden_states.shape) != expected:
            raise ValueError(
                f"hidden_states must be [B, S, dim] = {expected} (B and S of q, dim of the "
                f"module), got {tuple(hidden_states.shape)}"
            )
        weight = self.gate_proj.weight
        if hidden_states.device != weight.device:
            raise ValueError(
                f"hidden_states is on {hidden_states.device} but the module's gate_proj is on"
                f" {weight.device}; move one of them (module.to(...))"
            )
        # Under autocast F.linear casts its inputs itself: any floating dtype is fine there.
        autocast = torch.is_autocast_enabled(hidden_states.device.type)
        if hidden_states.dtype != weight.dtype and not (
            autocast and hidden_states.is_floating_point()
        ):
            raise TypeError(
                f"hidden_states must have the dtype of the module's gate_proj, {weight.dtype},"
                f" got {hidden_states.dtype} (cast it, or the module with module.to(dtype))"
            )

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, "
            f"sparsity={self.sparsity}, scale={self.scale}"
        )


class VSAGate(_Sparsity, nn.Linear):
    """VSA's coarse-branch gate as a projection of its own: ``gate = W x + b``, shaped
    ``[B, S, heads * head_dim]``, weighting the coarse output per head and channel
    (``o = o_fine + gate * o_coarse``). FastVideo's VSA checkpoints of Wan hold it per block as
    ``blocks.<i>.to_gate_compress``; the diffusers integration registers it there.

    Built with zero weight and bias (no random initialisation first: it can be created on a
    large model quickly), so a fresh gate leaves the fine stage alone. ``forward`` casts the
    parameters to the input's device and dtype when they differ, so the gate follows a model
    that is offloaded, or stored in float8 and computed in bf16 (diffusers' layerwise casting).
    ``sparsity`` is the layer's VSA sparsity, set by :class:`SparsitySchedule`.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        *,
        sparsity: float = 0.0,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        nn.Module.__init__(self)
        self.in_features = check_positive_int("dim", dim)
        self.heads = check_positive_int("heads", heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.out_features = heads * head_dim
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.zeros(self.out_features, dim, **factory))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.sparsity = sparsity

    def reset_parameters(self) -> None:
        """Zero weight and bias: the fine stage alone."""
        _zero_(self)

    def projection(self, hidden_states: torch.Tensor, dtype) -> GateProjection | None:
        """The gate ``self(hidden_states).to(dtype)`` as a :class:`GateProjection` for
        :func:`video_sparse_attn`, which forms it and keeps no gate for the backward; None
        where the module must be called as a module (:func:`linear_projection`)."""
        return linear_projection(self, hidden_states, dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(hidden_states.device.type):
            target = {"device": hidden_states.device}  # autocast picks the matmul dtype
        else:
            target = {"device": hidden_states.device, "dtype": hidden_states.dtype}
        return nn.functional.linear(hidden_states, *_params_on(self, **target))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, heads={self.heads}, sparsity={self.sparsity}"
