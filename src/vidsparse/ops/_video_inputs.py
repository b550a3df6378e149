"""What the video ops (VSA, PSA, STA) share: sequence checks, tile-order inputs, the Triton
path's tile rule, and text tokens of joint-attention models (HunyuanVideo) on the engine.

``N`` non-video tokens follow
the video tokens in ``q, k, v``. On the engine they are padded to whole blocks of ``V``
(``tile_volume``) slots and become key blocks ``Nt .. Nt+NTb-1`` after the ``Nt`` video tiles;
their real-token counts go into ``kv_block_sizes``, so padding slots get no weight::

    engine key sequence (tile order, blocks of V = tile_volume slots)
    [ tile 0 | tile 1 | ... | tile Nt-1 | text 0 | text 1 ... (last one partial, padded) ]
      <----------- padded_len ---------> <------------- NTb * V ------------------------>

Every video query block lists the text blocks after its own video key blocks
(:func:`append_columns`), and the text query blocks run as a second launch whose lists are one
dense row expanded over heads and blocks (:func:`dense_rows`).
"""

from __future__ import annotations

import torch

from vidsparse.layout import permute_ops
from vidsparse.layout.grid import VideoGrid, grid_key
from vidsparse.utils import ceil_div
from vidsparse.utils.checks import is_bshd_view

__all__ = [
    "check_triton_tile",
    "check_count",
    "check_sequence_length",
    "text_block_sizes",
    "append_columns",
    "dense_rows",
    "video_tiles",
    "key_sequence",
    "attend_text_queries",
]


def check_triton_tile(grid: VideoGrid, examples: str) -> None:
    """The Triton path runs one engine block per tile: its volume must be a power of two
    >= 16 (``tl.arange`` widths). ``examples`` suggests tiles the op is measured with."""
    volume = grid.tile_volume
    if volume < 16 or volume & (volume - 1):
        raise ValueError(
            f"grid: the Triton path needs a power-of-two tile volume >= 16, got tile "
            f"{grid.tile_shape} (volume {volume}); use e.g. {examples}, or "
            "VIDSPARSE_BACKEND=torch for any tile"
        )


def check_count(name: str, value) -> int:
    """``value`` must be an int >= 0 (not a bool); the error names ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_sequence_length(seq_len: int, grid: VideoGrid, tiled: bool, text_tokens: int) -> None:
    """``seq_len`` must be ``(grid.padded_len if tiled else grid.num_tokens) + text_tokens``."""
    video_len = grid.padded_len if tiled else grid.num_tokens
    if seq_len == video_len + text_tokens:
        return
    other_len = grid.num_tokens if tiled else grid.padded_len
    hint = ""
    if seq_len == other_len + text_tokens and other_len != video_len:
        hint = f" (it fits tiled={not tiled})"
    raise ValueError(
        f"q's sequence length {seq_len} must equal "
        f"{'grid.padded_len' if tiled else 'grid.num_tokens'} ({video_len}) + "
        f"text_tokens ({text_tokens}) = {video_len + text_tokens} for {grid!r}{hint}"
    )


def text_block_sizes(text_tokens: int, volume: int, device) -> torch.Tensor:
    """Real text tokens in each text block: ``[V, V, ..., N - (NTb - 1) * V]``, int32."""
    ntb = ceil_div(text_tokens, volume)
    starts = torch.arange(ntb, device=device) * volume
    return (text_tokens - starts).clamp(max=volume).to(torch.int32)


def append_columns(kv_indices, kv_counts, columns, *, full_rows: bool = False):
    """Append the key blocks ``columns`` [C] to every row, right after its ``count`` entries.

    Rows stay ascending because the appended blocks come after every video tile.
    ``full_rows=True`` promises every count equals ``K`` (VSA's top-k lists): then the columns
    are simply concatenated, one pass over the lists.
    """
    bi, h, nq, k = kv_indices.shape
    c = columns.numel()
    if full_rows:
        tail = columns.to(device=kv_indices.device, dtype=torch.int32).expand(bi, h, nq, c)
        wide = torch.cat([kv_indices.to(torch.int32), tail], dim=-1)  # [Bi, H, NQ, K + C]
        return wide, (kv_counts + c).to(torch.int32)
    wide = torch.zeros(bi, h, nq, k + c, dtype=torch.int32, device=kv_indices.device)
    wide[..., :k] = kv_indices
    slots = kv_counts.long().unsqueeze(-1) + torch.arange(c, device=kv_indices.device)
    values = columns.to(torch.int32).expand(bi, h, nq, c)
    wide.scatter_(-1, slots, values)  # [Bi, H, NQ, K + C]
    return wide, (kv_counts + c).to(torch.int32)


def dense_rows(heads: int, rows: int, num_kv_blocks: int, device):
    """Lists of ``rows`` query blocks that attend to every key block: one row in memory,
    expanded (stride 0) to ``[1, heads, rows, num_kv_blocks]``."""
    row = torch.arange(num_kv_blocks, dtype=torch.int32, device=device)
    count = torch.full((1,), num_kv_blocks, dtype=torch.int32, device=device)
    return row.expand(1, heads, rows, num_kv_blocks), count.expand(1, heads, rows)


def video_tiles(x, grid: VideoGrid, tiled: bool, video_len: int) -> torch.Tensor:
    """The video part of ``x`` in tile order, ``[B, H, padded_len, D]`` (a view when tiled)."""
    video = x[:, :, :video_len]
    return video if tiled else grid.tile(video, dim=-2)


def untile_output(o_t: torch.Tensor, grid: VideoGrid, like: torch.Tensor | None) -> torch.Tensor:
    """``o_t`` (tile order) in natural order, stored as ``like`` is where that is a
    ``[B, S, H, D]`` tensor seen as ``[B, H, S, D]`` (q as diffusers' processors pass it; so is
    SDPA's output then): transposing and flattening it back costs no copy. Otherwise (no
    ``like``, another layout, or no untile kernel for it) contiguous."""
    bshd = like is not None and is_bshd_view(like)
    if bshd and permute_ops.kernel_supports(o_t, 2, grid.padded_len):
        return permute_ops.untile_op(o_t, *grid_key(grid), bshd=True)
    return grid.untile(o_t, dim=-2)


def key_sequence(x, grid: VideoGrid, tiled: bool, video_len: int, text_pad: int, video=None):
    """Keys or values as the engine reads them: video tiles, then text padded to whole blocks.

    ``video``: the video tiles of ``x`` if the caller already has them (saves a re-tiling).
    """
    if x.shape[2] == video_len:  # no text
        return video_tiles(x, grid, tiled, video_len) if video is None else video
    if tiled and text_pad == 0:
        return x  # already tile order followed by whole text blocks: no copy
    if video is None:
        video = video_tiles(x, grid, tiled, video_len)
    parts = [video, x[:, :, video_len:]]
    if text_pad:
        parts.append(x.new_zeros(*x.shape[:2], text_pad, x.shape[-1]))
    return torch.cat(parts, dim=-2)


def attend_text_queries(q, k_seq, v_seq, text_indices, text_counts, kv_block_sizes, *,
                        video_len: int, text_tokens: int, volume: int, scale: float):  # fmt: skip
    """The text queries' launch (dense rows over the whole key sequence): q's rows past
    ``video_len`` padded to whole blocks of ``volume``; returns ``(o, lse)`` of the
    ``text_tokens`` real rows. The lists come from a cached plan (valid by construction: no
    checks, no GPU sync) and the padding keys are finite (zeros, or a tiled input's
    documented-finite padding rows), so the engine may read them by TMA."""
    from vidsparse.ops.block_sparse_attn.interface import block_sparse_attn_unchecked

    text_pad = ceil_div(text_tokens, volume) * volume - text_tokens
    q_text = torch.nn.functional.pad(q[:, :, video_len:], (0, 0, 0, text_pad))  # [B, H, NTb*V, D]
    o, lse = block_sparse_attn_unchecked(
        q_text, k_seq, v_seq, text_indices, text_counts, block_q=volume, block_kv=volume,
        kv_block_sizes=kv_block_sizes, scale=scale, padding_finite=True,
    )  # fmt: skip
    return o[:, :, :text_tokens], lse[:, :, :text_tokens]
