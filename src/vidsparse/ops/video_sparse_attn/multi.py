"""VSA beyond one grid: packed batches, keys on a grid of their own, block-causal slabs and
competing prefix tokens, on both backends (the caller, ``interface.py``, has validated).

Every case is one packed tile sequence per side and a :class:`~.segments.TilePlan`::

    q   [ seq 0 video | seq 1 video | ... | text ]       natural or tile order per sequence
    k   [ seq 0 video | seq 1 video | ... | text ]       (its own grids with kv_grid)
          |  tile each sequence, concatenate
          v
    q_t [ seq 0 tiles | seq 1 tiles | ... ]                                   Nq tiles
    k_t [ (prefix blocks) | seq 0 tiles | seq 1 tiles | ... ]                 Nk tiles
    engine keys  k_t, then exempt text blocks (joined to every list after the selection)

The coarse stage and the selection run per segment in one launch each; the fine stage is one
engine launch over the packed lists, whose indices are already global. Text queries attend
densely, as with one grid.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.block_sparse import refine_block_lists, refine_block_sizes
from vidsparse.ops._video_inputs import (
    append_columns,
    attend_text_queries,
    dense_rows,
    text_block_sizes,
)
from vidsparse.ops.block_sparse_attn.configs import kernel_block_max
from vidsparse.ops.video_sparse_attn.reference import (
    dense_attention,
    is_fine_only,
    vsa_segments_ref,
)
from vidsparse.ops.video_sparse_attn.segments import TilePlan, plan_tensors
from vidsparse.utils import ceil_div
from vidsparse.utils.device import target_of
from vidsparse.utils.dynamo import host_constant

__all__ = ["MultiCall", "video_sparse_attn_multi"]


class MultiCall(NamedTuple):
    """A validated call's static description (hashable: grids and ints)."""

    grids: tuple[VideoGrid, ...]
    kv_grids: tuple[VideoGrid, ...]
    plan: TilePlan
    tiled: bool
    text_tokens: int
    compete: bool  # text tokens tiled and selected like video (else exempt: always attended)

    def video_lens(self, grids) -> list[int]:
        return [g.padded_len if self.tiled else g.num_tokens for g in grids]

    @property
    def text_blocks(self) -> int:
        return ceil_div(self.text_tokens, self.plan.tile_volume)


def _pack_tiles(x: torch.Tensor, grids, lens, tiled: bool) -> torch.Tensor:
    """The video parts of ``x`` (sequence after sequence), each in tile order, concatenated."""
    parts, start = [], 0
    for grid, n in zip(grids, lens):
        video = x[:, :, start : start + n]
        parts.append(video if tiled else grid.tile(video, dim=-2))
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def _unpack_tiles(o_t: torch.Tensor, grids, tiled: bool) -> torch.Tensor:
    """Inverse of :func:`_pack_tiles` for the output."""
    if tiled:
        return o_t
    parts, start = [], 0
    for grid in grids:
        parts.append(grid.untile(o_t[:, :, start : start + grid.padded_len], dim=-2))
        start += grid.padded_len
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def _text_blocks(x: torch.Tensor, video_len: int, blocks: int, volume: int) -> torch.Tensor:
    """The text rows of ``x`` padded with zeros to ``blocks`` whole blocks."""
    text = x[:, :, video_len:]
    pad = blocks * volume - text.shape[2]
    return torch.nn.functional.pad(text, (0, 0, 0, pad)) if pad else text


def _key_tiles(x: torch.Tensor, call: MultiCall) -> torch.Tensor:
    """Keys or values in the engine's order: (competing prefix blocks,) the video tiles of
    every sequence, (exempt text blocks)."""
    lens = call.video_lens(call.kv_grids)
    video = _pack_tiles(x, call.kv_grids, lens, call.tiled)
    if not call.text_tokens:
        return video
    text = _text_blocks(x, sum(lens), call.text_blocks, call.plan.tile_volume)
    return torch.cat([text, video] if call.compete else [video, text], dim=-2)


def video_sparse_attn_multi(q, k, v, gate, call: MultiCall, scale: float, backend: str):
    """``o`` in q's dtype and layout for a validated call (see the module docstring)."""
    q_lens = call.video_lens(call.grids)
    if backend == "torch":
        return _multi_torch(q, k, v, gate, call, q_lens, scale)
    return _multi_triton(q, k, v, gate, call, q_lens, scale)


def _multi_torch(q, k, v, gate, call: MultiCall, q_lens, scale):
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    tensors = plan_tensors(call.plan, q.device)
    q_t = _pack_tiles(q.to(compute), call.grids, q_lens, call.tiled)
    gate_t = gate if gate is None or is_fine_only(gate) else _pack_tiles(
        gate.to(compute), call.grids, q_lens, call.tiled)  # fmt: skip
    k_all, v_all = _key_tiles(k.to(compute), call), _key_tiles(v.to(compute), call)
    pooled_keys = call.plan.num_k_tiles * call.plan.tile_volume
    k_x = v_x = None
    if call.text_tokens and not call.compete:  # exempt text: extra keys, never selected
        kv_len = sum(call.video_lens(call.kv_grids))
        k_x, v_x = (x[:, :, kv_len:].to(compute) for x in (k, v))
    o_t = vsa_segments_ref(
        q_t, k_all[:, :, :pooled_keys], v_all[:, :, :pooled_keys], tensors.q_info,
        tensors.k_sizes, scale, gate_t, k_x, v_x, max_topk=call.plan.max_topk,
    )  # fmt: skip
    o = _unpack_tiles(o_t, call.grids, call.tiled)
    if call.text_tokens:
        o = torch.cat([o, _text_queries_torch(q, k, v, call, q_lens, scale, compute)], dim=-2)
    return o.to(q.dtype)


def _text_queries_torch(q, k, v, call: MultiCall, q_lens, scale, compute):
    """Text queries attend densely to every real key (video in natural order, then text)."""
    kv_len = sum(call.video_lens(call.kv_grids))
    keys = []
    for x in (k, v):
        x = x.to(compute)
        video = x[:, :, :kv_len]
        if call.tiled:  # natural order without the padding rows
            video = _unpack_tiles(video, call.kv_grids, tiled=False)
        keys.append(torch.cat([video, x[:, :, kv_len:]], dim=-2))
    return dense_attention(q[:, :, sum(q_lens) :].to(compute), keys[0], keys[1], scale)


def _multi_triton(q, k, v, gate, call: MultiCall, q_lens, scale):
    from vidsparse.ops.video_sparse_attn.fine import vsa_fine_combined

    plan, volume = call.plan, call.plan.tile_volume
    tensors = plan_tensors(plan, q.device)
    q_t = _pack_tiles(q, call.grids, q_lens, call.tiled)
    k_seq, v_seq = _key_tiles(k, call), _key_tiles(v, call)
    pooled_rows = plan.num_k_tiles * volume
    oc, kv_indices, kv_counts, pooled = torch.ops.vidsparse.vsa_coarse_segments(
        q_t.detach(), k_seq[:, :, :pooled_rows].detach(), v_seq[:, :, :pooled_rows].detach(),
        tensors.q_info, tensors.k_sizes, list(plan.flat_segments), scale,
    )  # fmt: skip
    sizes = tensors.k_sizes  # competing prefix blocks are key tiles of the plan already
    if call.text_tokens and not call.compete:  # exempt text blocks join every list
        text = _cached_text_keys(plan.k_sizes, plan.tile_volume, call.text_tokens, q.device)
        sizes = text.kv_block_sizes
        kv_indices, kv_counts = append_columns(kv_indices, kv_counts, text.columns)
    fine_only = is_fine_only(gate)
    gate_t = None if gate is None or fine_only else _pack_tiles(gate, call.grids, q_lens,
                                                                call.tiled)  # fmt: skip
    split = max(1, volume // kernel_block_max(target_of(q.device), q.dtype))
    block = volume // split
    if split > 1:  # large tiles: the engine runs them as `split` blocks each
        kv_indices, kv_counts, sizes, oc = _split_tiles(kv_indices, kv_counts, sizes, oc, split,
                                                         block)  # fmt: skip
    o_t = vsa_fine_combined(
        q_t, k_seq, v_seq, kv_indices, kv_counts, sizes, oc, gate_t, tensors.q_info, block,
        scale, pooled=pooled, segments=plan.flat_segments, fine_only=fine_only,
    )  # fmt: skip
    o = _unpack_tiles(o_t, call.grids, call.tiled)
    if not call.text_tokens:
        return o
    text_rows = ceil_div(call.text_tokens, block)  # the text queries in blocks of `block`
    rows, counts = dense_rows(q.shape[1], text_rows, k_seq.shape[2] // block, q.device)
    o_text, _ = attend_text_queries(
        q, k_seq, v_seq, rows, counts, sizes, video_len=sum(q_lens),
        text_tokens=call.text_tokens, volume=block, scale=scale,
    )  # fmt: skip
    return torch.cat([o, o_text], dim=-2)


def _split_tiles(kv_indices, kv_counts, sizes, oc, split: int, block: int):
    """Tile lists as lists of blocks ``block = tile // split``: each listed tile becomes its
    ``split`` blocks, each query tile's row serves its ``split`` query blocks, every key
    tile's size splits over its blocks, and ``oc`` gets one row per query block."""
    blocks, counts = refine_block_lists(kv_indices, kv_counts, split)
    block_sizes = refine_block_sizes(sizes, split, block)
    return blocks, counts, block_sizes, oc.repeat_interleave(split, dim=2)


class _TextKeys(NamedTuple):
    columns: torch.Tensor  # int32 [NTb]: the exempt text key blocks
    kv_block_sizes: torch.Tensor  # int32: real tokens of every engine key block


@host_constant
def _cached_text_keys(k_sizes, volume: int, text_tokens: int, device) -> _TextKeys:
    """The exempt text key blocks after the plan's key tiles ``k_sizes`` (a tuple of ints);
    Dynamo calls it on the host and takes its tensors as constants."""
    return _text_keys(k_sizes, volume, text_tokens, torch.device(device))


@functools.lru_cache(maxsize=32)
def _text_keys(k_sizes, volume: int, text_tokens: int, device) -> _TextKeys:
    text = text_block_sizes(text_tokens, volume, device)
    start = len(k_sizes)
    columns = torch.arange(start, start + text.shape[0], dtype=torch.int32, device=device)
    sizes = torch.tensor(k_sizes, dtype=torch.int32, device=device)
    return _TextKeys(columns, torch.cat([sizes, text]).to(torch.int32).contiguous())


# ============================================================================ custom op


@torch.library.custom_op("vidsparse::vsa_coarse_segments", mutates_args=())
def _vsa_coarse_segments(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    q_info: torch.Tensor,
    k_sizes: torch.Tensor,
    segments: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pooling, coarse attention and selection over segments (Triton), not differentiated:
    the fine stage's backward forms the coarse branch's gradient from ``pooled``."""
    from vidsparse.ops.video_sparse_attn.coarse import (
        coarse_attn_topk_segments,
        tile_mean_pool_fwd_separate,
    )
    from vidsparse.ops.video_sparse_attn.segments import segments_of

    pooled = tile_mean_pool_fwd_separate(q_t, k_t, v_t, q_info[0], k_sizes)
    nq, nk = q_info.shape[1], k_sizes.shape[0]
    qc, kc, vc = pooled[:, :, :nq], pooled[:, :, nq : nq + nk], pooled[:, :, nq + nk :]
    oc, kv_indices, kv_counts = coarse_attn_topk_segments(qc, kc, vc, segments_of(segments), scale)
    return oc, kv_indices, kv_counts, pooled


@_vsa_coarse_segments.register_fake
def _(q_t, k_t, v_t, q_info, k_sizes, segments, scale):
    B, H, _, D = q_t.shape
    nq, nk = q_info.shape[1], k_sizes.shape[0]
    max_topk = max(segments[4::5])
    return (
        q_t.new_empty((B, H, nq, D), dtype=torch.float32),
        q_t.new_empty((B, H, nq, max_topk), dtype=torch.int32),
        q_t.new_empty((B, H, nq), dtype=torch.int32),
        q_t.new_empty((B, H, nq + 2 * nk, D), dtype=torch.float32),
    )
