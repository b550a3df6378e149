"""``torch.library`` custom ops around the one-pass tile / untile kernels (``permute.py``).

``VideoGrid.tile`` / ``untile`` call these for 4-D ``[B, H, S, D]`` tensors permuted along
``dim=2`` when the Triton backend is in use (``kernel_supports``); everything else keeps the
PyTorch path, which stays the reference. As custom ops with fake and autograd implementations
they are single opaque differentiable nodes to ``torch.compile`` (no graph break around the
launch); the gradient of one is the other:

- ``vidsparse::video_grid_tile``:   d(tile)/dx   = untile(grad)  (padding slots' grads dropped)
- ``vidsparse::video_grid_untile``: d(untile)/dx = tile(grad)    (padding slots get 0)

This module imports no Triton (importing vidsparse must not); ``permute.py`` is imported the
first time a kernel actually runs.
"""

from __future__ import annotations

import torch

from vidsparse.layout.configs import MIN_BLOCK_ROWS
from vidsparse.layout.sizes import padded_len_of
from vidsparse.utils import ceil_div
from vidsparse.utils.backend import resolve_backend, triton_interpret_enabled

__all__ = ["kernel_supports", "tile_op", "untile_op", "KERNEL_DTYPES", "padded_len_of"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# Row indices are int32 in the kernels, and the flat launch grid has < 2**31 programs
# (at least MIN_BLOCK_ROWS rows per program: configs.py).
_MAX_ROWS = 2**31 - 1


def kernel_supports(x: torch.Tensor, dim: int, padded_len: int) -> bool:
    """Whether the one-pass kernel handles ``x`` permuted along (normalised) ``dim``.

    4-D, ``dim == 2``, fp16/bf16/fp32, head dim a power of two in [16, 256], non-empty; on a
    GPU, or on the CPU under ``TRITON_INTERPRET=1``; and the resolved backend is Triton
    (``VIDSPARSE_BACKEND=torch`` keeps the PyTorch path). A CPU tensor without the interpreter
    never reaches ``resolve_backend`` (which would raise under ``VIDSPARSE_BACKEND=triton``):
    tile / untile are general utilities and simply keep the PyTorch path there.
    """
    if x.ndim != 4 or dim != 2 or x.dtype not in KERNEL_DTYPES:
        return False
    B, H, S, D = x.shape
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM or D & (D - 1):
        return False
    if B * H == 0 or B * H * ceil_div(max(S, padded_len), MIN_BLOCK_ROWS) > _MAX_ROWS:
        return False
    if max(S, padded_len) > _MAX_ROWS:
        return False
    if x.device.type == "cuda":
        pass
    elif not (x.device.type == "cpu" and triton_interpret_enabled()):
        return False
    return resolve_backend(x.device) == "triton"


def tile_op(x: torch.Tensor, shape, tile) -> torch.Tensor:
    """Natural ``[B, H, S, D]`` -> contiguous tile order ``[B, H, padded_len, D]``."""
    return torch.ops.vidsparse.video_grid_tile(x, list(shape), list(tile))


def untile_op(x: torch.Tensor, shape, tile, bshd: bool = False) -> torch.Tensor:
    """Tile order ``[B, H, padded_len, D]`` -> natural ``[B, H, S, D]``, contiguous, or with
    ``bshd`` a ``transpose(1, 2)`` view of a contiguous ``[B, S, H, D]`` (what a model that
    holds q, k, v as ``[B, S, H, D]`` flattens back for free)."""
    return torch.ops.vidsparse.video_grid_untile(x, list(shape), list(tile), bshd)


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("vidsparse::video_grid_tile", mutates_args=())
def _video_grid_tile(x: torch.Tensor, shape: list[int], tile: list[int]) -> torch.Tensor:
    from vidsparse.layout.permute import tile_rows

    return tile_rows(x, shape, tile)


@_video_grid_tile.register_fake
def _(x, shape, tile):
    B, H, _, D = x.shape
    return x.new_empty((B, H, padded_len_of(shape, tile), D))


@torch.library.custom_op("vidsparse::video_grid_untile", mutates_args=())
def _video_grid_untile(
    x: torch.Tensor, shape: list[int], tile: list[int], bshd: bool = False
) -> torch.Tensor:
    from vidsparse.layout.permute import untile_rows

    return untile_rows(x, shape, tile, bshd)


@_video_grid_untile.register_fake
def _(x, shape, tile, bshd=False):
    B, H, _, D = x.shape
    T, Hh, W = shape
    if bshd:
        return x.new_empty((B, T * Hh * W, H, D)).transpose(1, 2)
    return x.new_empty((B, H, T * Hh * W, D))


def _setup_context(ctx, inputs, output):
    _, shape, tile, *_ = inputs
    ctx.grid = (list(shape), list(tile))


def _tile_backward(ctx, grad):
    # Each real slot is a copy of one token: the token's gradient is that slot's gradient;
    # padding slots are constants (zeros), their gradient is dropped.
    return torch.ops.vidsparse.video_grid_untile(grad, *ctx.grid), None, None


def _untile_backward(ctx, grad):
    # Each token is a copy of one real slot; padding slots were not used: gradient 0.
    return torch.ops.vidsparse.video_grid_tile(grad, *ctx.grid), None, None, None


_video_grid_tile.register_autograd(_tile_backward, setup_context=_setup_context)
_video_grid_untile.register_autograd(_untile_backward, setup_context=_setup_context)
