"""PSA stripe attention by brute force: the oracle that ``stripe_attn`` is tested against.

Nothing here uses block lists, tile order or the block-sparse engine. Every token is given the
coordinates of the PSA block it lies in, straight from its ``(t, h, w)`` position, and the
stripe predicate is evaluated for every (query token, key token) pair. The result is a
token-level ``[H, S, S]`` mask and a masked softmax in fp32 (fp64 for fp64 inputs), so this
is for small problems only (``S`` up to a few thousand tokens).

Token mask of one head, natural order, with ``text_tokens`` appended after the video::

                    video keys (S_v)           text keys (N)
                  +---------------------------+-----------+
    video queries | predicate(block(q),       | all True  |
        (S_v)     |   block(k)) or sink(k)    |           |
                  +---------------------------+-----------+
    text queries  | all True                  | all True  |
        (N)       |                           |           |
                  +---------------------------+-----------+
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import StripeSpec, stripe_predicate

__all__ = ["stripe_token_mask", "stripe_attn_ref"]


def _token_block_coords(grid: VideoGrid, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Temporal block ``bt`` and flattened spatial block ``bs = bh*Wb + bw`` of every video
    token, in natural order: two int64 ``[num_tokens]`` tensors."""
    T, H, W = grid.shape
    tile_t, tile_h, tile_w = grid.tile_shape
    _, _, wb = grid.tiles
    n = torch.arange(grid.num_tokens, device=device)
    t, h, w = n // (H * W), (n // W) % H, n % W
    return t // tile_t, (h // tile_h) * wb + (w // tile_w)


def stripe_token_mask(
    grid: VideoGrid,
    specs: Sequence[StripeSpec],
    *,
    spatial_unit: str = "block",
    sink_frames: int = 0,
    text_tokens: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Token-level mask bool ``[H, S, S]``, ``S = grid.num_tokens + text_tokens``, natural
    order: ``mask[h, i, j]`` says whether query token ``i`` attends to key token ``j``.

    Video pairs follow the predicate between the tokens' blocks (plus sink frames: key tokens
    whose temporal block is below ``sink_frames``); any pair with a text token is attended.
    """
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    specs = list(specs)
    device = torch.device("cpu") if device is None else torch.device(device)
    bt, bs = _token_block_coords(grid, device)  # [S_v], [S_v]
    dt = bt.view(1, -1) - bt.view(-1, 1)  # [S_v(q), S_v(k)]: key block minus query block
    ds = bs.view(1, -1) - bs.view(-1, 1)
    _, _, wb = grid.tiles
    video = stripe_predicate(dt, ds, specs, wb=wb, spatial_unit=spatial_unit)  # [H, S_v, S_v]
    if sink_frames:
        video = video | (bt < sink_frames).view(1, 1, -1)
    if not text_tokens:
        return video
    s_v = grid.num_tokens
    s = s_v + text_tokens
    mask = torch.ones(len(specs), s, s, dtype=torch.bool, device=device)
    mask[:, :s_v, :s_v] = video
    return mask


def _masked_attention(q, k, v, mask, scale):
    """Softmax attention where ``mask`` [H, Sq, Skv] is True; rows with no key give o = 0 and
    lse = -inf. Differentiable without NaN, even through empty rows."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale  # [B, H, Sq, Skv]
    s = s.masked_fill(~mask, float("-inf"))
    # Shift by the (detached) row max: the result does not depend on it, so neither does the
    # gradient; an empty row shifts by 0 and its exp is exactly 0 instead of NaN.
    row_max = s.detach().amax(dim=-1, keepdim=True)  # [B, H, Sq, 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    e = torch.exp(s - row_max)  # [B, H, Sq, Skv]
    denom = e.sum(dim=-1, keepdim=True)  # [B, H, Sq, 1]
    o = torch.einsum("bhqk,bhkd->bhqd", e, v) / torch.where(denom > 0, denom, 1.0)
    lse = (row_max + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
    return o, lse


def stripe_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    specs: Sequence[StripeSpec],
    *,
    spatial_unit: str = "block",
    tiled: bool = False,
    sink_frames: int = 0,
    text_tokens: int = 0,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Reference for ``vidsparse.stripe_attn`` (same arguments and layouts).

    Returns ``o`` in fp32 (fp64 for fp64 inputs) and, with ``return_lse``, ``lse`` ``[B, H, S]``
    in the same dtype. In tile order (``tiled=True``) padding rows get ``o = 0``,
    ``lse = -inf``. Differentiable by autograd. Memory is ``O(B * H * S^2)``: small sizes only.
    """
    _, H, seq_len, D = q.shape
    if len(specs) != H:
        raise ValueError(f"specs must hold one StripeSpec per head (H={H}), got {len(specs)}")
    video_len = grid.padded_len if tiled else grid.num_tokens
    if seq_len != video_len + text_tokens:
        raise ValueError(
            f"q's sequence length {seq_len} must be {video_len} video + {text_tokens} text tokens"
        )
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    def natural(x):  # [B, H, S, D] in the caller's layout -> natural order, compute dtype
        x = x.to(dtype)
        if not tiled:
            return x
        video = grid.untile(x[:, :, :video_len], dim=-2)
        return torch.cat([video, x[:, :, video_len:]], dim=-2)

    mask = stripe_token_mask(
        grid,
        specs,
        spatial_unit=spatial_unit,
        sink_frames=sink_frames,
        text_tokens=text_tokens,
        device=q.device,
    )
    o, lse = _masked_attention(natural(q), natural(k), natural(v), mask, scale)
    if tiled:
        o, lse = _to_tile_order(o, lse, grid)
    return (o, lse) if return_lse else o


def _to_tile_order(o, lse, grid: VideoGrid):
    """Natural -> tile order for the video rows of ``o`` [B, H, S, D] and ``lse`` [B, H, S];
    padding rows become o = 0, lse = -inf (what ``stripe_attn`` returns there)."""
    n = grid.num_tokens
    o_video = grid.tile(o[:, :, :n], dim=-2)  # zeros in padding rows
    real = grid.real_token_mask(o.device)  # [padded_len]
    lse_video = grid.tile(lse[:, :, :n], dim=-1).masked_fill(~real, float("-inf"))
    return (
        torch.cat([o_video, o[:, :, n:]], dim=-2),
        torch.cat([lse_video, lse[:, :, n:]], dim=-1),
    )
