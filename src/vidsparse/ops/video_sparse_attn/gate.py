"""VSA's gate handed over as its projection, so that training keeps no gate-sized activation.

A trained VSA layer computes its gate from the layer's input (FastVideo's ``to_gate_compress``)::

    gate = hidden_states @ weight.T + bias        [B, S, dim] -> [B, S, H * D] -> [B, H, S, D]

Handed to :func:`~vidsparse.video_sparse_attn` as a tensor, the gate is an input of the fine
stage, which keeps it for its backward (Wan 2.1 1.3B at 480p: 100 MB a layer in bf16, at the
training step's peak). Handed as a :class:`GateProjection`, the natural-order Triton path forms
the gate in the forward and drops it after the fine stage has read it; the backward forms it
again from ``hidden_states`` (which the layer's q/k/v projections keep for their own backward
anyway) and returns the projection's gradients itself: one more ``[S, dim] x [dim, H * D]``
matmul a layer in the backward, one gate-sized tensor less kept. Every other path (the PyTorch
backend, tiled inputs, text tokens, packed or large-tile grids, the row-map override off) forms
the gate tensor up front and runs as it does with a tensor: the same values either way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class GateProjection(NamedTuple):
    """The gate as ``hidden_states @ weight.T + bias``, formed inside the op (module docstring).

    ``hidden_states [B, S, dim]`` in q's token order, ``weight [H * D, dim]``, ``bias [H * D]``
    or None; all three in q's dtype and on q's device (cast them first: under autocast the
    op does not cast). Channel ``h * D + d`` of the projection is head ``h``'s channel ``d``.
    """

    hidden_states: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The projection's tensors (the bias when there is one)."""
        return tuple(t for t in self if t is not None)


def is_projection(gate) -> bool:
    return isinstance(gate, GateProjection)


def check_projection(gate: GateProjection, q: torch.Tensor) -> None:
    """``hidden_states``, ``weight`` and ``bias`` fit q ``[B, H, S, D]``: shapes, dtype, device."""
    B, H, S, D = q.shape
    x, weight, bias = gate
    named = {"hidden_states": x, "weight": weight, "bias": bias}
    for name, t in named.items():
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"GateProjection.{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"GateProjection.{name} must have q's dtype and device ({q.dtype}, {q.device}),"
                f" got {t.dtype} on {t.device} (cast it first: the op does not autocast)"
            )
    if x.ndim != 3 or tuple(x.shape[:2]) != (B, S):
        raise ValueError(
            f"GateProjection.hidden_states must be [B, S, dim] with q's B={B} and S={S}, got "
            f"{tuple(x.shape)}"
        )
    if tuple(weight.shape) != (H * D, x.shape[2]):
        raise ValueError(
            f"GateProjection.weight must be [H * D, dim] = {(H * D, x.shape[2])}, got "
            f"{tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (H * D,):
        raise ValueError(
            f"GateProjection.bias must be [H * D] = [{H * D}], got {tuple(bias.shape)}"
        )


def gate_of(gate: GateProjection, heads: int, head_dim: int) -> torch.Tensor:
    """The gate ``[B, H, S, D]`` (a view of the projection's ``[B, S, H * D]`` output)."""
    x, weight, bias = gate
    B, S, _ = x.shape
    return F.linear(x, weight, bias).view(B, S, heads, head_dim).transpose(1, 2)


def materialized(gate, heads: int, head_dim: int):
    """``gate`` with a projection replaced by its tensor (anything else as it is)."""
    return gate_of(gate, heads, head_dim) if is_projection(gate) else gate


def projection_grads(gate: GateProjection, d_gate: torch.Tensor) -> tuple:
    """``(d hidden_states, d weight, d bias)`` from ``d_gate`` shaped like :func:`gate_of`'s
    output: the products autograd's ``linear`` backward forms."""
    x, weight, bias = gate
    B, S, dim = x.shape
    d_out = d_gate.transpose(1, 2).reshape(B * S, weight.shape[0])  # [B * S, H * D]
    dx = (d_out @ weight).view(B, S, dim)
    dw = d_out.t() @ x.reshape(B * S, dim)
    db = None if bias is None else d_out.sum(0)
    return dx, dw, db
