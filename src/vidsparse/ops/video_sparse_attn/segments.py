"""Which key tiles each query tile of VSA may select from: the segments of a call.

Self-attention over one grid is one segment: every query tile chooses among every key tile.
The other cases are several segments over one packed tile sequence, so one launch of each
kernel serves them all::

    packed batch (grids g0, g1)     queries [ g0 tiles | g1 tiles ]
                                    keys    [ g0 tiles | g1 tiles ]
                                    segment 0: g0 queries x g0 keys; segment 1: g1 x g1

    key grid of more frames         queries [ chunk tiles ]            (the last Tq frames)
    (a KV cache)                    keys    [ cached tiles | chunk tiles ]

    block-causal over time tiles    query slab t (the tiles of time tile t, absolute) x
                                    key tiles of time tiles 0..t
                                    [ x . . ]
                                    [ x x . ]      one segment per query slab
                                    [ x x x ]

    competing prefix tokens         keys    [ prefix blocks | video tiles ]: the prefix is
                                    tiled like the video and selected by the same top-k

A segment is ``(q_start, q_stop, k_start, k_count, topk)`` in tile units of the packed
sequences: its query tiles choose ``topk`` of the key tiles ``k_start .. k_start+k_count-1``.
Every key range is contiguous: tiles are numbered time-major, and the prefix blocks come first,
so "time tiles 0..t" plus the prefix is one range.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.ops._video_inputs import text_block_sizes
from vidsparse.ops.video_sparse_attn.topk import resolve_topk, selected_quantile_z
from vidsparse.utils.dynamo import host_constant

__all__ = ["Segment", "TilePlan", "plan_tiles", "plan_tensors", "program_table"]


class Segment(NamedTuple):
    q_start: int
    q_stop: int
    k_start: int
    k_count: int
    topk: int


class TilePlan(NamedTuple):
    """Everything the kernels need to know about a call's tiles, as plain ints and tuples of
    them (``torch.compile`` reads its fields as constants and never iterates them)."""

    q_sizes: tuple[int, ...]  # real tokens per query tile, packed over sequences
    k_sizes: tuple[int, ...]  # real tokens per key tile (prefix blocks included)
    flat_segments: tuple[int, ...]  # 5 ints per Segment (what a custom op takes)
    tile_volume: int
    num_q_tiles: int
    num_k_tiles: int
    max_topk: int

    @property
    def segments(self) -> tuple[Segment, ...]:
        return segments_of(self.flat_segments)


def _causal_segments(q_grid, kv_grid, q0, k0, prefix, topk, sparsity) -> list[Segment]:
    """One segment per query time tile: the prefix blocks and the key time tiles up to it."""
    slab = q_grid.tiles[1] * q_grid.tiles[2]  # tiles per time tile (same spatial grid)
    offset = (kv_grid.shape[0] - q_grid.shape[0]) // q_grid.tile_shape[0]  # cached time tiles
    segments = []
    for t in range(q_grid.tiles[0]):
        keys = prefix + min((t + offset + 1) * slab, kv_grid.num_tiles)
        start = q0 + t * slab
        segments.append(Segment(start, start + slab, k0, keys, resolve_topk(keys, topk, sparsity)))
    return segments


def plan_tiles(
    grids: tuple[VideoGrid, ...],
    kv_grids: tuple[VideoGrid, ...],
    *,
    topk: int | None,
    sparsity: float | None,
    causal: bool = False,
    prefix_tokens: int = 0,
) -> TilePlan:
    """The segments of a call: sequence ``i`` has queries on ``grids[i]`` and keys on
    ``kv_grids[i]``, plus ``prefix_tokens`` competing prefix tokens before its key tiles (one
    sequence only). Grids are checked by the caller (same tile shape; causal: same spatial
    size, cached frames a whole number of time tiles). Each segment's ``topk`` comes from
    ``topk`` / ``sparsity`` over the key tiles it may choose from (``resolve_topk``)."""
    volume = grids[0].tile_volume
    prefix_sizes = text_block_sizes(prefix_tokens, volume, "cpu").tolist()
    q_sizes, k_sizes, segments = [], [], []
    for q_grid, kv_grid in zip(grids, kv_grids):
        q0, k0 = len(q_sizes), len(k_sizes)
        k_sizes += prefix_sizes
        q_sizes += q_grid.tile_sizes.tolist()
        k_sizes += kv_grid.tile_sizes.tolist()
        if causal:
            segments += _causal_segments(q_grid, kv_grid, q0, k0, len(prefix_sizes), topk, sparsity)
        else:
            keys = len(k_sizes) - k0
            segments.append(Segment(q0, len(q_sizes), k0, keys, resolve_topk(keys, topk, sparsity)))
    flat = tuple(value for segment in segments for value in segment)
    top = max(s.topk for s in segments)
    return TilePlan(tuple(q_sizes), tuple(k_sizes), flat, volume, len(q_sizes), len(k_sizes), top)


class PlanTensors(NamedTuple):
    """A plan's device tensors (read-only)."""

    # int32 [4, Nq], per query tile: real tokens, its first and last+1 key tile, its topk
    q_info: torch.Tensor
    k_sizes: torch.Tensor  # int32 [Nk]


def plan_tensors(plan: TilePlan, device) -> PlanTensors:
    """The plan's tensors, cached per (plan, device); under ``torch.compile`` they enter the
    graph as constants (they depend on the plan's ints only)."""
    q_info, k_sizes = _plan_tensors_constant(plan.q_sizes, plan.k_sizes, plan.flat_segments, device)
    return PlanTensors(q_info, k_sizes)


@host_constant
def _plan_tensors_constant(q_sizes, k_sizes, flat_segments, device):
    return _plan_tensors(q_sizes, k_sizes, flat_segments, torch.device(device))


@functools.lru_cache(maxsize=32)
def _plan_tensors(q_sizes, k_sizes, flat_segments, device: torch.device):
    lo, hi, keep = ([0] * len(q_sizes) for _ in range(3))
    for seg in segments_of(flat_segments):
        for i in range(seg.q_start, seg.q_stop):
            lo[i], hi[i], keep[i] = seg.k_start, seg.k_start + seg.k_count, seg.topk
    q_info = torch.tensor([list(q_sizes), lo, hi, keep], dtype=torch.int32, device=device)
    return q_info, torch.tensor(k_sizes, dtype=torch.int32, device=device)


def segments_of(flat: list[int] | tuple[int, ...]) -> tuple[Segment, ...]:
    """The segments of ``TilePlan.flat_segments``."""
    return tuple(Segment(*flat[i : i + 5]) for i in range(0, len(flat), 5))


@functools.lru_cache(maxsize=64)
def program_table(segments: tuple[Segment, ...], block_m: int, device: torch.device):
    """The coarse kernel's programs: ``(table, quantile_z)``, one row per program of
    ``block_m`` query tiles, none straddling two segments. ``table`` int32 ``[P, 5]`` holds
    the segment's fields with ``q_start`` advanced to the program's first tile; ``quantile_z``
    fp32 ``[P]`` the normal quantile of its segment's kept share (where its first pivots go)."""
    rows, z = [], []
    for seg in segments:
        for start in range(seg.q_start, seg.q_stop, block_m):
            rows.append((start, seg.q_stop, seg.k_start, seg.k_count, seg.topk))
            z.append(selected_quantile_z(seg.topk, seg.k_count))
    table = torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 5)
    return table, torch.tensor(z, dtype=torch.float32, device=device)
