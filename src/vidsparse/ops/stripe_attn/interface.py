"""Public entry point of PSA (Parameterized Stripe Attention) on the block-sparse engine.

Each head attends along its own stripes of the PSA block grid (a PSA block is one tile of the
``VideoGrid``): the per-head lists come from ``stripe_block_lists`` and every head runs in one
engine call, the tile sizes masking the padding keys of partial tiles. Text tokens (joint
attention, HunyuanVideo) become key blocks after the video tiles (``ops/_video_inputs.py``)::

    block map of one head           video key blocks        text key blocks
                                   k0  k1  k2 ... kNt-1     t0  t1
    call 1: video query block  q0  [ stripe pattern of the  |  1   1 ]   lists [1, H, Nt, K+NTb]
    (all heads at once)        ... [ head (+ sink frames)   |  1   1 ]   stripe row + text
    call 2: text query block   t0  [  1   1   1  ...   1    |  1   1 ]   lists [1, H, NTb, NK]
    (only when N > 0)          t1  [  1   1   1  ...   1    |  1   1 ]   one row, head-broadcast

Text rows are dense, so they run as a second call on stride-0 lists: folded into the first,
every row would be ``Nt + NTb`` wide (100 MB of int32 at HunyuanVideo 720p, 2x8x8 blocks).
Lists are built once per (specs, grid, options, device) and cached, so the engine validates
them once; under ``torch.compile`` they enter the graph as constants (``fullgraph=True``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from vidsparse.layout.grid import VideoGrid, check_video_qkv, grid_key
from vidsparse.masks.stripe import SPATIAL_UNITS, StripeSpec, stripe_block_lists, stripe_block_mask
from vidsparse.ops._video_inputs import (
    append_columns,
    attend_text_queries,
    check_count,
    check_sequence_length,
    check_triton_tile,
    dense_rows,
    key_sequence,
    text_block_sizes,
    untile_output,
    video_tiles,
)
from vidsparse.ops.block_sparse_attn.configs import REFERENCE_DTYPES
from vidsparse.ops.block_sparse_attn.interface import (
    block_sparse_attn_unchecked,
    check_triton_supported,
)
from vidsparse.utils import ceil_div
from vidsparse.utils.backend import resolve_backend
from vidsparse.utils.checks import (
    check_bool,
    check_head_dim,
    check_same_device,
    check_scale,
    softmax_scale,
)
from vidsparse.utils.dynamo import host_constant

__all__ = [
    "stripe_attn",
    "stripe_attn_density",
    "stripe_engine_lists",
    "stripe_attn_from_lists",
    "clear_stripe_attn_cache",
]

# Engine lists per (specs, grid, ...): one entry per (layer, step bucket) of a plan, so it must
# hold a whole model's plan (Wan 14B: 40 layers x a few step buckets; 32 entries made a
# 40-layer plan miss on every call). An entry is O(H * blocks * K) int32: ~7-30 MB at 720p,
# 60-90% sparsity. clear_stripe_attn_cache() frees them.
_CACHE_SIZE = 192


def stripe_attn(
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
    """Stripe attention: every head attends along its own periodic bands of PSA blocks.

    ::

        one frame of 2x3 blocks, head spec t(w=1,o=0,s=inf) s(w=2,o=0,s=3), "block" unit
                 k0 k1 k2 k3 k4 k5          query block q attends to key blocks at spatial
            q0 [  1  1  0  1  1  0 ]        distance |ds| mod 3 <= 1, in its own frame;
            q1 [  1  1  1  0  1  1 ]        each token of q attends to every real token of
            q2 [  0  1  1  1  0  1 ]        the blocks marked 1
            ...

    Args:
        q, k, v: ``[B, H, S, D]``. ``S == grid.num_tokens + text_tokens`` (video in natural
            raster order, then the text tokens), or ``grid.padded_len + text_tokens`` with
            ``tiled=True`` (video in tile order, as ``grid.tile`` makes it).
        grid: the latent :class:`VideoGrid`; its tile is the PSA block (e.g. ``(2, 8, 8)`` or
            ``(1, 8, 16)``), so the block grid is ``grid.tiles``. Partial tiles are padded.
        specs: one :class:`StripeSpec` per head (``H`` of them); heads differ freely.
        spatial_unit: ``"block"`` or ``"row"``, how the spatial stride is measured
            (``masks.stripe`` explains both).
        tiled: inputs and output in tile order; padding rows of the output are zero. Padding
            rows of k and v get no weight but must be finite (``grid.tile`` writes zeros):
            ``0 * inf`` would be NaN.
        sink_frames: key blocks of the first ``sink_frames`` temporal blocks are attended by
            every query block.
        text_tokens: ``N`` non-video tokens after the video tokens: they attend to every token,
            and every video token attends to them.
        scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return the fp32 natural-log log-sum-exp ``[B, H, S]`` (``-inf`` in
            padding rows of the tiled layout).

    Returns ``o`` in q's dtype and layout, or ``(o, lse)``. Differentiable in q, k, v.
    The Triton path needs a power-of-two tile volume >= 16; the torch path takes any.
    """
    specs, device = _validate(
        q, k, v, grid, specs, spatial_unit, tiled, sink_frames, text_tokens, scale, return_lse
    )
    # Under torch.compile an int that changed between calls arrives as a SymInt; these set
    # shapes and key the cached plan, so make Dynamo specialize them (plain ints, guarded on).
    sink_frames, text_tokens = operator.index(sink_frames), operator.index(text_tokens)
    if resolve_backend(device) == "triton":
        _check_triton_supported(q, grid)
    scale = softmax_scale(scale, q.shape[-1])
    plan = _cached_engine_plan(
        tuple(_spec_fields(spec) for spec in specs),
        grid_key(grid),
        spatial_unit,
        sink_frames,
        text_tokens,
        device,
    )
    o, lse = _run_engine(q, k, v, grid, plan, tiled, text_tokens, scale)
    return (o, lse) if return_lse else o


def stripe_engine_lists(
    specs: Sequence[StripeSpec],
    grid: VideoGrid,
    spatial_unit: str = "block",
    sink_frames: int = 0,
    device: torch.device | str | None = None,
    *,
    cached: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The engine lists ``stripe_attn`` launches for ``specs`` (no text tokens):
    ``kv_indices`` int32 ``[1, H, Nt, K]``, ``kv_counts`` int32 ``[1, H, Nt]`` and the key
    blocks' real sizes int32 ``[Nt]`` (``None`` when every block is full). With ``cached``
    (default) they come from ``stripe_attn``'s cache and are read-only; ``cached=False``
    builds them without adding an entry to that cache (for a caller that holds them itself;
    the masks module's own small cache of recent patterns still applies).

    With :func:`stripe_attn_from_lists` they let a model hand each layer's pattern to the
    attention as tensors instead of specs, so that under ``torch.compile`` layers with
    different specs share one graph (specs are Python constants: one graph each)."""
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    specs = _check_specs(specs, heads=len(specs) if isinstance(specs, Sequence) else 0)
    if spatial_unit not in SPATIAL_UNITS:
        raise ValueError(f"spatial_unit must be one of {SPATIAL_UNITS}, got {spatial_unit!r}")
    check_count("sink_frames", sink_frames)
    device = torch.device("cpu" if device is None else device)
    if cached:
        plan = _engine_plan_of_keys(
            tuple(_spec_fields(spec) for spec in specs), grid_key(grid), spatial_unit,
            sink_frames, 0, device,
        )  # fmt: skip
    else:
        plan = _build_engine_plan(specs, grid, spatial_unit, sink_frames, 0, device)
    return plan.video_indices, plan.video_counts, plan.kv_block_sizes


def stripe_attn_from_lists(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor | None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """``stripe_attn(q, k, v, grid, specs)`` (natural order, no text tokens) on the lists
    :func:`stripe_engine_lists` gave for those specs. Only their shapes and dtypes are checked
    (their values were checked when they were built); lists from anywhere else are not
    supported."""
    check_video_qkv(grid, q, k, v, REFERENCE_DTYPES)
    check_head_dim(q)
    device = check_same_device(q=q, k=k, v=v, kv_indices=kv_indices, kv_counts=kv_counts)
    check_scale(scale)
    check_sequence_length(q.shape[2], grid, False, 0)
    heads, tiles = q.shape[1], grid.num_tiles
    if kv_indices.dtype != torch.int32 or kv_counts.dtype != torch.int32:
        raise TypeError("kv_indices and kv_counts must be int32 (from stripe_engine_lists)")
    if kv_indices.ndim != 4 or tuple(kv_indices.shape[:3]) != (1, heads, tiles):
        raise ValueError(
            f"kv_indices must be [1, {heads}, {tiles}, K] for this grid and head count, got"
            f" {tuple(kv_indices.shape)}"
        )
    if tuple(kv_counts.shape) != (1, heads, tiles):
        raise ValueError(f"kv_counts must be [1, {heads}, {tiles}], got {tuple(kv_counts.shape)}")
    if kv_block_sizes is not None and tuple(kv_block_sizes.shape) != (tiles,):
        raise ValueError(f"kv_block_sizes must be [{tiles}], got {tuple(kv_block_sizes.shape)}")
    if resolve_backend(device) == "triton":
        _check_triton_supported(q, grid)
    scale = softmax_scale(scale, q.shape[-1])
    plan = _EnginePlan(kv_indices, kv_counts, None, None, kv_block_sizes, 0)
    return _run_engine(q, k, v, grid, plan, False, 0, scale)[0]


def stripe_attn_density(
    specs: Sequence[StripeSpec],
    grid: VideoGrid,
    spatial_unit: str = "block",
    sink_frames: int = 0,
    text_tokens: int = 0,
) -> torch.Tensor:
    """Fraction of (query block, key block) pairs that ``stripe_attn`` computes, per head:
    float32 ``[H]``. Blocks are those of the padded block grid, plus ``ceil(N / V)`` text
    blocks (rows and columns dense) when ``text_tokens = N > 0``. Sparsity is ``1 - density``.
    """
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    check_count("text_tokens", text_tokens)
    mask = stripe_block_mask(specs, grid.tiles, spatial_unit, sink_frames=sink_frames)
    video_pairs = mask.sum(dim=(-2, -1), dtype=torch.float64)  # [H]
    nt = grid.num_tiles
    ntb = ceil_div(text_tokens, grid.tile_volume)
    n = nt + ntb
    # Text blocks: every video row gains ntb columns, and ntb dense rows of n blocks are added.
    attended = video_pairs + nt * ntb + ntb * n
    return (attended / (n * n)).float()


def clear_stripe_attn_cache() -> None:
    """Drop the cached engine lists (``vidsparse.masks.clear_stripe_cache`` drops the masks)."""
    _engine_plan_of_keys.cache_clear()
    _engine_plan.cache_clear()


# --------------------------------------------------------------------------- engine plan


class _EnginePlan(NamedTuple):
    """Everything the engine launches need, built once per configuration (read-only)."""

    video_indices: torch.Tensor  # int32 [1, H, Nt, K(+NTb)]: stripe lists (+ text blocks)
    video_counts: torch.Tensor  # int32 [1, H, Nt]
    text_indices: torch.Tensor | None  # int32 [1, H, NTb, Nt+NTb], stride-0 view; None if N=0
    text_counts: torch.Tensor | None  # int32 [1, H, NTb]
    kv_block_sizes: torch.Tensor | None  # int32 [Nt+NTb]; None when no key slot is padding
    text_blocks: int  # NTb = ceil(N / V)


def _spec_fields(spec: StripeSpec) -> tuple:
    """A spec as a plain tuple of its fields (``StripeSpec(*fields)`` rebuilds it), for
    ``_cached_engine_plan``: Dynamo cannot pass frozen dataclass instances to it as constants.
    ``operator.index`` makes Dynamo specialize (guard on) each int: after a recompile it would
    otherwise trace a changed field as a SymInt, which is no constant."""
    return tuple(
        None if value is None else operator.index(value)
        for value in (
            spec.t_width, spec.t_offset, spec.t_stride, spec.s_width, spec.s_offset, spec.s_stride
        )
    )  # fmt: skip


@host_constant
def _cached_engine_plan(
    spec_fields, grid_key, spatial_unit, sink_frames, text_tokens, device
) -> _EnginePlan:
    """``_engine_plan`` as ``stripe_attn`` calls it, the specs given by ``_spec_fields`` and
    the grid by ``grid_key``.

    Under ``torch.compile`` Dynamo runs this on the host at trace time instead of tracing it,
    and the plan's tensors enter the graph as constants. Tracing it would break the graph
    (building the lists reads tensors back: ``nonzero``, ``.item()``), and the plan depends
    only on the Python values of the arguments, which Dynamo guards on: another grid, spec,
    text length or device traces a new graph.
    """
    return _engine_plan_of_keys(spec_fields, grid_key, spatial_unit, sink_frames, text_tokens,
                                device)  # fmt: skip


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _engine_plan_of_keys(spec_fields, grid_key, spatial_unit, sink_frames, text_tokens, device):
    """Cached on the plain keys, so that a call rebuilds no ``StripeSpec`` (each validated) and
    no ``VideoGrid`` before the lookup (195 us vs 1 us per call at 40 heads, timed on a CPU)."""
    specs = tuple(StripeSpec(*fields) for fields in spec_fields)
    grid = VideoGrid(*grid_key)  # equal to the caller's grid, so the same cache entry
    return _engine_plan(specs, grid, spatial_unit, sink_frames, text_tokens, device)


def _build_engine_plan(specs, grid, spatial_unit, sink_frames, text_tokens, device) -> _EnginePlan:
    video_indices, video_counts = stripe_block_lists(
        specs, grid.tiles, spatial_unit, device=device, sink_frames=sink_frames
    )  # [1, H, Nt, K], [1, H, Nt]
    sizes = grid.tile_sizes_on(device)  # [Nt]
    ntb = ceil_div(text_tokens, grid.tile_volume)
    text_indices = text_counts = None
    if ntb:
        text_columns = torch.arange(grid.num_tiles, grid.num_tiles + ntb, device=device)
        video_indices, video_counts = append_columns(video_indices, video_counts, text_columns)
        text_indices, text_counts = dense_rows(len(specs), ntb, grid.num_tiles + ntb, device)
        sizes = torch.cat([sizes, text_block_sizes(text_tokens, grid.tile_volume, device)])
    # The engine's unmasked kernel is faster (on Hopper it moves tiles by TMA): use it when
    # every key block is full, a property of the grid and N alone (no tensor read back).
    return _EnginePlan(
        video_indices,
        video_counts,
        text_indices,
        text_counts,
        None if _all_key_blocks_full(grid, text_tokens) else sizes.to(torch.int32).contiguous(),
        ntb,
    )


_engine_plan = functools.lru_cache(maxsize=_CACHE_SIZE)(_build_engine_plan)


def _all_key_blocks_full(grid: VideoGrid, text_tokens: int) -> bool:
    """Every key block holds ``tile_volume`` real tokens: the tiles divide the grid, and the
    text tokens fill whole blocks."""
    tiles_divide = all(n % t == 0 for n, t in zip(grid.shape, grid.tile_shape))
    return tiles_divide and text_tokens % grid.tile_volume == 0


# --------------------------------------------------------------------------- running


def _run_engine(q, k, v, grid, plan: _EnginePlan, tiled, text_tokens, scale):
    video_len = grid.padded_len if tiled else grid.num_tokens
    text_pad = plan.text_blocks * grid.tile_volume - text_tokens
    k_seq = key_sequence(k, grid, tiled, video_len, text_pad)  # [B, H, P + NTb*V, D]
    v_seq = key_sequence(v, grid, tiled, video_len, text_pad)

    def attend(q_blocks, kv_indices, kv_counts):  # one engine launch over the key sequence
        # The plan's lists are valid by construction (no checks, no GPU sync); padding keys
        # are finite (zeros from tiling, or a tiled input's documented-finite padding rows),
        # so the kernel masks their scores without zeroing their values.
        return block_sparse_attn_unchecked(
            q_blocks,
            k_seq,
            v_seq,
            kv_indices,
            kv_counts,
            block_q=grid.tile_volume,
            block_kv=grid.tile_volume,
            kv_block_sizes=plan.kv_block_sizes,
            scale=scale,
            padding_finite=True,
        )

    q_video = video_tiles(q, grid, tiled, video_len)  # [B, H, P, D]
    o, lse = attend(q_video, plan.video_indices, plan.video_counts)
    like = None if plan.text_blocks else q  # with text, o is a concatenation anyway
    o, lse = _video_output(o, lse, grid, tiled, like)  # [B, H, video_len, D], [B, H, video_len]
    if not plan.text_blocks:
        return o, lse
    o_text, lse_text = attend_text_queries(
        q, k_seq, v_seq, plan.text_indices, plan.text_counts, plan.kv_block_sizes,
        video_len=video_len, text_tokens=text_tokens, volume=grid.tile_volume, scale=scale,
    )  # fmt: skip
    return torch.cat([o, o_text], dim=-2), torch.cat([lse, lse_text], dim=-1)


def _video_output(o, lse, grid: VideoGrid, tiled: bool, like=None):
    """Engine output of the video query blocks -> the caller's layout (o stored as ``like``
    where that is q in ``[B, S, H, D]`` storage: ``untile_output``)."""
    if not tiled:
        return untile_output(o, grid, like), grid.untile(lse, dim=-1)
    if grid.padded_len == grid.num_tokens:
        return o, lse
    # Padding query rows attended like real ones (their q is zero, not absent): blank them.
    real = grid.real_token_mask(o.device)  # [padded_len]
    return o.masked_fill(~real.view(-1, 1), 0), lse.masked_fill(~real, float("-inf"))


# --------------------------------------------------------------------------- validation


def _validate(
    q, k, v, grid, specs, spatial_unit, tiled, sink_frames, text_tokens, scale, return_lse
):
    check_video_qkv(grid, q, k, v, REFERENCE_DTYPES)
    check_head_dim(q)
    device = check_same_device(q=q, k=k, v=v)
    check_bool("tiled", tiled)
    check_bool("return_lse", return_lse)
    if spatial_unit not in SPATIAL_UNITS:
        raise ValueError(f"spatial_unit must be one of {SPATIAL_UNITS}, got {spatial_unit!r}")
    check_count("sink_frames", sink_frames)
    check_count("text_tokens", text_tokens)
    check_scale(scale)
    specs = _check_specs(specs, heads=q.shape[1])
    check_sequence_length(q.shape[2], grid, tiled, text_tokens)
    return specs, device


def _check_specs(specs, heads: int) -> tuple[StripeSpec, ...]:
    if isinstance(specs, StripeSpec):
        raise TypeError(
            f"specs must be a sequence of {heads} StripeSpec (one per head), got one StripeSpec"
        )
    if not isinstance(specs, Sequence):
        raise TypeError(f"specs must be a sequence of StripeSpec, got {type(specs).__name__}")
    for i, spec in enumerate(specs):
        if not isinstance(spec, StripeSpec):
            raise TypeError(f"specs[{i}] must be a StripeSpec, got {type(spec).__name__}")
    if len(specs) != heads:
        raise ValueError(
            f"specs must hold one StripeSpec per head: q has H={heads} heads, got {len(specs)}"
        )
    return tuple(specs)


def _check_triton_supported(q: torch.Tensor, grid: VideoGrid) -> None:
    check_triton_tile(grid, "tile=(2, 8, 8) or (1, 8, 16) (volume 128) or (4, 4, 4) (64)")
    check_triton_supported(q)
