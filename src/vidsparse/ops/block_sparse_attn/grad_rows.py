"""Gradients (and, on request, the output) written in the caller's own row order
(``GradRows``): their layout, and the PyTorch backend's scatter into it and gather from it
(the Triton kernels store and load through the maps themselves)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class GradRows(NamedTuple):
    """Gradients written in the caller's own row order (a layout the engine's blocks are a
    permutation of, with padding): query row ``i``'s dq goes to row ``q_rows[i]`` of a
    ``[B, H, q_len, D]`` tensor, key row ``j``'s dk and dv to row ``kv_rows[j]`` of
    ``[B, H, kv_len, D]`` ones; -1, and the padding keys that key-block sizes mask, go nowhere.
    Every row of the outputs must be some row's destination: they are not zeroed first. Maps
    int32 with a unit stride, ``[Sq]`` and ``[Skv]``. ``*_bshd``: that side's gradients are
    stored ``[B, S, H, D]`` (diffusers' layout, seen as ``[B, H, S, D]``). The Triton kernels
    run (the Gluon ones store whole blocks by TMA). ``out``: the forward stored o in the q
    side's order and layout too (``GradTargets.output``), so o and dO arrive in it and the
    preprocess reads them through ``q_rows``."""

    q_rows: torch.Tensor
    kv_rows: torch.Tensor
    q_len: int
    kv_len: int
    q_bshd: bool = False
    kv_bshd: bool = False
    out: bool = False

    def layouts(self) -> tuple[tuple[int, bool], tuple[int, bool]]:
        return (self.q_len, self.q_bshd), (self.kv_len, self.kv_bshd)


class GradTargets(NamedTuple):
    """Where the engine's gradients go when its q, k, v are copies of other tensors in another
    row order (the engine's internal entry, ``grads_to``): ``q``, ``k``, ``v`` (``[B, H, S', D]``,
    any strides; ``[B, S, H, D]`` storage is kept) get them in their own order, engine query row
    ``i``'s at row ``q_rows[i]``, key row ``j``'s at ``kv_rows[j]`` (-1: none; int32, unit
    stride), and the copies get none. Every row of q, k, v must be some engine row's target.
    ``output``: the forward's o too comes in q's order and layout (query row ``i``'s at row
    ``q_rows[i]``), so no tile-order o is ever allocated or kept for the backward.
    ``regather``: the backward keeps these tensors rather than the copies and gathers the
    copies from them again (rows mapped to -1 as zeros), so copies longer than their targets
    (padding rows) are not kept between the passes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_rows: torch.Tensor
    kv_rows: torch.Tensor
    output: bool = False
    regather: bool = False

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The five tensors, as the custom ops take them."""
        return self.q, self.k, self.v, self.q_rows, self.kv_rows


def empty_grads(layout: tuple[int, bool] | None, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Empty gradients of ``xs`` (``[B, H, S, D]``): like them, or of ``layout``'s rows and
    storage (``GradRows``)."""
    if layout is None:
        return [torch.empty_like(x) for x in xs]
    rows, bshd = layout
    B, H, _, D = xs[0].shape
    shape = (B, rows, H, D) if bshd else (B, H, rows, D)
    empties = [x.new_empty(shape) for x in xs]
    return [x.transpose(1, 2) for x in empties] if bshd else empties


def empty_output(q: torch.Tensor, out_rows: GradRows | None) -> torch.Tensor:
    """The forward's empty o: like q, or in ``out_rows``' q-side layout
    (``GradTargets.output``)."""
    if out_rows is None:
        return torch.empty_like(q)
    (o,) = empty_grads(out_rows.layouts()[0], q)
    return o


def output_map(out_rows: GradRows | None, o: torch.Tensor) -> tuple:
    """The forward kernels' ``(O_ROWS, OUT_MAPPED)``: the q-side map of ``out_rows``, or
    ``o`` as a pointer never read and False."""
    return (o, False) if out_rows is None else (out_rows.q_rows, True)


def scatter_grads(grads, grad_rows: GradRows, kv_block_sizes: torch.Tensor | None,
                  block_kv: int):  # fmt: skip
    """``(dq, dk, dv)`` in the engine's row order, moved to the rows ``grad_rows`` gives (the
    PyTorch backend's path); the padding keys that ``kv_block_sizes`` masks go nowhere, as in
    the kernels."""
    dq, dk, dv = grads
    q_layout, kv_layout = grad_rows.layouts()
    (out_q,) = empty_grads(q_layout, dq)
    out_k, out_v = empty_grads(kv_layout, dk, dv)
    q_keep = grad_rows.q_rows >= 0
    kv_keep = grad_rows.kv_rows >= 0
    if kv_block_sizes is not None:  # each key block's real keys are its first rows
        offsets = torch.arange(dk.shape[2], device=dk.device) % block_kv
        kv_keep &= offsets < kv_block_sizes.long().repeat_interleave(block_kv)[: dk.shape[2]]
    for out, grad, rows, keep in ((out_q, dq, grad_rows.q_rows, q_keep),
                                  (out_k, dk, grad_rows.kv_rows, kv_keep),
                                  (out_v, dv, grad_rows.kv_rows, kv_keep)):  # fmt: skip
        scatter_rows(out, grad, rows, keep)
    return out_q, out_k, out_v


def scatter_rows(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
                 keep: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``out[:, :, rows[i]] = x[:, :, i]`` for the rows ``keep`` marks (the PyTorch path of a
    store through a row map)."""
    out[:, :, rows[keep].long()] = x[:, :, keep].to(out.dtype)
    return out


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[:, :, i] = x[:, :, rows[i]]``, 0 where ``rows[i]`` is -1 (the PyTorch path of a
    load through a row map), contiguous."""
    keep = (rows >= 0)[:, None]
    return x[:, :, rows.clamp_min(0).long()].masked_fill(~keep, 0).contiguous()
