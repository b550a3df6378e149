"""Public entry point of Video Sparse Attention (VSA).

Validates everything before any compute, then runs either the PyTorch reference (torch backend)
or the Triton path: the fused coarse-stage kernels (coarse.py) pick each query tile's top-k key
tiles, and the fine stage runs on the block-sparse engine with the tile sizes masking padding.

Text tokens (``text_tokens = N``, joint attention as in HunyuanVideo) reuse PSA's design and
helpers (``vidsparse.ops._video_inputs``): the ``N`` tokens are padded to ``NTb = ceil(N / V)``
blocks of ``V = tile_volume`` slots and appended to the key sequence as key blocks
``Nt .. Nt+NTb-1``, their real counts in ``kv_block_sizes``::

    key sequence   [ tile 0 | ... | tile Nt-1 | text 0 | ... | text NTb-1 (padded) ]

    launch 1: video query tiles   lists [B, H, Nt, topk + NTb]   top-k tiles, then the text
                                                                 blocks (one softmax)
    launch 2: text query blocks   lists [1, H, NTb, Nt + NTb]    dense, one row, stride 0

The coarse stage (pooling, coarse attention, selection) sees the video tokens only. Text rows
get no coarse term (their gate rows are ignored). The top-k lists come from the selection
kernel per call, so the text columns are appended per call (``B*H*Nt*(topk+NTb)`` int32); the
text query lists and key-block sizes are cached per (grid, N, H, device) and, under
``torch.compile``, enter the graph as constants taken from that cache on the host.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from vidsparse.layout.grid import VideoGrid, check_video_qkv, grid_key
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
from vidsparse.ops.block_sparse_attn.configs import (
    REFERENCE_DTYPES,
    active_overrides,
    kernel_block_max,
)
from vidsparse.ops.block_sparse_attn.grad_rows import GradTargets
from vidsparse.ops.block_sparse_attn.interface import check_triton_supported
from vidsparse.ops.video_sparse_attn.gate import (
    GateProjection,
    check_projection,
    is_projection,
    materialized,
)
from vidsparse.ops.video_sparse_attn.multi import MultiCall, video_sparse_attn_multi
from vidsparse.ops.video_sparse_attn.reference import (
    check_number_gate,
    is_fine_only,
    video_sparse_attn_ref,
)
from vidsparse.ops.video_sparse_attn.segments import plan_tiles
from vidsparse.ops.video_sparse_attn.topk import resolve_topk
from vidsparse.utils import ceil_div
from vidsparse.utils.backend import resolve_backend
from vidsparse.utils.checks import (
    check_bool,
    check_head_dim,
    check_qkv,
    check_same_device,
    check_scale,
    check_tensor,
    softmax_scale,
)
from vidsparse.utils.device import CPU_INTERPRETER, target_of
from vidsparse.utils.dynamo import host_constant


def video_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid | Sequence[VideoGrid],
    *,
    topk: int | None = None,
    sparsity: float | None = None,
    gate: torch.Tensor | GateProjection | float | None = None,
    tiled: bool = False,
    scale: float | None = None,
    text_tokens: int = 0,
    kv_grid: VideoGrid | Sequence[VideoGrid] | None = None,
    causal: bool = False,
    text_mode: str = "exempt",
) -> torch.Tensor:
    """Video Sparse Attention: coarse attention over tile means selects, per query tile, the
    ``topk`` key tiles that the fine stage then attends exactly.

    ::

        tokens --tile--> [tile 0 | tile 1 | ... ]     (4x4x4 cubes of the latent video)
        coarse:  Oc = softmax(mean(Q) mean(K)^T * scale) mean(V)     per tile
        select:  top-k key tiles per query tile, by coarse score
        fine:    exact attention over the real tokens of the selected tiles
        o = o_fine + gate * o_coarse        (o_fine + o_coarse without a gate;
                                             o_fine alone with gate=0)

    Args:
        q, k, v: ``[B, H, S, D]``; ``S == grid.num_tokens + text_tokens`` (video in natural
            raster order) or ``S == grid.padded_len + text_tokens`` with ``tiled=True`` (video
            in tile order, as ``grid.tile`` makes), then the text tokens.
        grid: the latent :class:`VideoGrid` (any T x H x W; partial tiles are padded).
        topk / sparsity: exactly one. ``topk = clamp(ceil((1 - sparsity) * num_tiles), 1,
            num_tiles)``; a ``topk`` above ``num_tiles`` is clamped to ``num_tiles``.
        gate: optional tensor shaped like ``q`` weighting the coarse output. Its text rows
            are ignored (text rows have no coarse term; their gradient is zero). ``0`` (the
            number): the fine stage alone, as a zero gate gives (a stock checkpoint, or an
            untrained gate), without a gate tensor to tile and read, o's rounding residual,
            or the coarse branch's backward. A :class:`GateProjection` ``(hidden_states,
            weight, bias)``: the gate ``hidden_states @ weight.T + bias`` (a trained layer's
            ``to_gate_compress``), formed inside the op so that the backward forms it again
            instead of keeping it (one gate-sized activation less in training; gradients go
            to the projection's three tensors).
        tiled: the video part of inputs and output in tile order (padding rows of the output
            are zero). Padding rows of k and v get no weight but must be finite
            (``grid.tile`` writes zeros): ``0 * inf`` would be NaN.
        scale: softmax scale, default ``1 / sqrt(D)``.
        text_tokens: ``N`` non-video tokens after the video tokens (joint attention, e.g.
            HunyuanVideo, or a reference image, audio); text queries attend densely to every
            real token (video and text) and get no coarse term. ``text_mode`` says what the
            video queries do with the text keys.
        kv_grid: the grid of k and v when it differs from q's (a KV cache: q the current
            chunk's frames, k/v the cached frames and the chunk; or another size). Coarse
            attention, selection and the fine stage run over the key grid's tiles; ``topk`` /
            ``sparsity`` count key tiles. Both grids take the same tile shape.
        causal: block-causal over time tiles: a query tile attends the key tiles of its own
            time tile and earlier ones only (q's frames are the last frames of the key grid,
            which must have q's spatial size, its extra frames a whole number of time
            tiles). ``sparsity`` is then relative to the tiles a query tile may attend.
        text_mode: ``"exempt"`` (default): every video query attends all ``N`` text keys in
            one softmax with its top-k tiles, and the coarse stage sees video tokens only.
            ``"compete"``: the text tokens are cut into blocks of ``tile_volume`` tokens that
            enter the coarse stage and the top-k selection like video tiles.

    Packed batches: ``grid`` (and ``kv_grid``) may be a list of grids; the sequence of q then
    holds the videos one after the other (each in natural order, or tiled with
    ``tiled=True``), with no padding between them, and every video attends within itself
    (``topk`` / ``sparsity`` per video). One launch per stage serves the whole batch::

        q = [ video 0 (grid 0) | video 1 (grid 1) | ... ]      S = sum of the videos' tokens

        key tiles:  video 0  video 1         block-causal over time tiles (causal=True):
                   [ x x . . . ]  video 0       q time tile 2  [ x x x . ]
                   [ x x . . . ]                q time tile 1  [ x x . . ]
                   [ . . x x x ]  video 1       q time tile 0  [ x . . . ]
                                                               key time tiles 0 1 2 3

    Returns ``o`` in q's dtype and layout. Differentiable in q, k, v and gate (or the
    projection's tensors).
    """
    if _needs_segments(grid, kv_grid, causal, text_mode, q):
        return _video_sparse_attn_segmented(
            q, k, v, grid, kv_grid, causal, text_mode, topk, sparsity, gate, tiled, scale,
            text_tokens,
        )  # fmt: skip
    device = _validate(q, k, v, grid, topk, sparsity, gate, tiled, scale, text_tokens)
    # Under torch.compile an int that changed between calls arrives as a SymInt; these set
    # shapes and key cached plans, so make Dynamo specialize them (plain ints, guarded on).
    text_tokens = operator.index(text_tokens)
    topk = operator.index(resolve_topk(grid.num_tiles, topk, sparsity))
    scale = softmax_scale(scale, q.shape[-1])
    backend = resolve_backend(device)
    if backend == "triton":
        _check_triton_supported(q, grid)
    if q.numel() == 0:  # B = 0 or H = 0: nothing to attend, on either backend
        return _empty_output(q, k, v, materialized(gate, q.shape[1], q.shape[3]))
    if backend == "torch":
        gate = materialized(gate, q.shape[1], q.shape[3])
        return video_sparse_attn_ref(
            q, k, v, grid, topk=topk, gate=gate, tiled=tiled, scale=scale, text_tokens=text_tokens
        )
    return _video_sparse_attn_composed(q, k, v, grid, topk, gate, tiled, scale, text_tokens)


def _needs_segments(grid, kv_grid, causal, text_mode, q) -> bool:
    """Whether a call leaves the one-grid path: several grids, a key grid of its own, the
    block-causal option, competing text or large tiles (checked in full by that path)."""
    if isinstance(grid, VideoGrid) and kv_grid in (None, grid) and not causal:
        # Tiles above the fine stage's largest block run as several blocks (multi.py).
        return text_mode != "exempt" or grid.tile_volume > _fine_block_cap(q)
    return True


def _fine_block_cap(q) -> int:
    """The engine's ``kernel_block_max`` for q: its fine stage's largest block (anything but a
    tensor fails its checks later: the default)."""
    if not isinstance(q, torch.Tensor):
        return kernel_block_max(CPU_INTERPRETER, None)
    return kernel_block_max(target_of(q.device), q.dtype)


def _video_sparse_attn_segmented(
    q, k, v, grid, kv_grid, causal, text_mode, topk, sparsity, gate, tiled, scale, text_tokens
):
    call = _validate_segmented(
        q, k, v, grid, kv_grid, causal, text_mode, topk, sparsity, gate, tiled, scale,
        text_tokens,
    )  # fmt: skip
    device = check_same_device(q=q, k=k, v=v, gate=_gate_tensor(gate))
    scale = softmax_scale(scale, q.shape[-1])
    backend = resolve_backend(device)
    if backend == "triton":
        check_triton_supported(q)
        check_triton_tile(call.grids[0], "tile=(4, 4, 4)")
    gate = materialized(gate, q.shape[1], q.shape[3])  # this path reads a gate tensor
    if q.numel() == 0 or k.numel() == 0:
        return _empty_output(q, k, v, gate)
    return video_sparse_attn_multi(q, k, v, gate, call, scale, backend)


def _grid_tuple(name: str, grids) -> tuple[VideoGrid, ...]:
    if isinstance(grids, VideoGrid):
        return (grids,)
    if isinstance(grids, (list, tuple)) and grids and all(isinstance(g, VideoGrid) for g in grids):
        return tuple(grids)
    raise TypeError(
        f"{name} must be a vidsparse.VideoGrid or a non-empty list of them, got {grids!r}"
    )


def _validate_segmented(
    q, k, v, grid, kv_grid, causal, text_mode, topk, sparsity, gate, tiled, scale, text_tokens
) -> MultiCall:
    grids = _grid_tuple("grid", grid)
    kv_grids = grids if kv_grid is None else _grid_tuple("kv_grid", kv_grid)
    check_qkv(q, k, v, REFERENCE_DTYPES)
    check_head_dim(q)
    check_bool("tiled", tiled)
    check_bool("causal", causal)
    check_scale(scale)
    check_count("text_tokens", text_tokens)
    if text_mode not in ("exempt", "compete"):
        raise ValueError(f"text_mode must be 'exempt' or 'compete', got {text_mode!r}")
    if len(kv_grids) != len(grids):
        raise ValueError(
            f"kv_grid must list one grid per grid: {len(grids)} grids, {len(kv_grids)} kv grids"
        )
    tiles = {g.tile_shape for g in grids + kv_grids}
    if len(tiles) > 1:
        raise ValueError(f"grid and kv_grid must share one tile shape, got {sorted(tiles)}")
    if text_tokens and len(grids) > 1:
        raise ValueError("text_tokens with a packed batch (several grids) is not supported")
    _check_packed_lengths("q", q, grids, tiled, text_tokens)
    _check_packed_lengths("k", k, kv_grids, tiled, text_tokens)
    if v.shape[:3] != k.shape[:3] or v.shape[3] != q.shape[3] or k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"k and v must be [B, H, S_kv, D] with q's B, H and D: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if causal:
        for g, kg in zip(grids, kv_grids):
            _check_causal_pair(g, kg)
    _check_selection_and_gate(q, kv_grids[0].num_tiles, topk, sparsity, gate)
    # operator.index: plain ints (Dynamo specializes them), never SymInts, as plan keys
    text_tokens = operator.index(text_tokens)
    topk = None if topk is None else operator.index(topk)
    compete = text_mode == "compete" and text_tokens > 0
    keys = tuple(grid_key(g) for g in grids), tuple(grid_key(g) for g in kv_grids)
    plan = _cached_plan(*keys, topk, sparsity, causal, text_tokens if compete else 0)
    return MultiCall(grids, kv_grids, plan, tiled, text_tokens, compete)


@host_constant
def _cached_plan(grid_keys, kv_grid_keys, topk, sparsity, causal, prefix_tokens):
    """The call's :class:`TilePlan` from plain values (Dynamo calls it on the host)."""
    return _plan(grid_keys, kv_grid_keys, topk, sparsity, causal, prefix_tokens)


@functools.lru_cache(maxsize=64)
def _plan(grid_keys, kv_grid_keys, topk, sparsity, causal, prefix_tokens):
    grids, kv_grids = (tuple(VideoGrid(*key) for key in keys) for keys in (grid_keys, kv_grid_keys))
    return plan_tiles(
        grids, kv_grids, topk=topk, sparsity=sparsity, causal=causal, prefix_tokens=prefix_tokens
    )


def _check_packed_lengths(name: str, x, grids, tiled: bool, text_tokens: int) -> None:
    video = sum(g.padded_len if tiled else g.num_tokens for g in grids)
    if x.shape[2] != video + text_tokens:
        what = "padded_len" if tiled else "num_tokens"
        side = "kv_grid" if name != "q" else "grid"
        raise ValueError(
            f"{name}'s sequence length {x.shape[2]} must equal the sum of {side}'s {what} "
            f"({video}) + text_tokens ({text_tokens}) = {video + text_tokens} (tiled={tiled})"
        )


def _check_causal_pair(grid: VideoGrid, kv_grid: VideoGrid) -> None:
    """causal=True needs q's frames to be the key grid's last frames, tile-aligned."""
    if grid.shape[1:] != kv_grid.shape[1:]:
        raise ValueError(
            f"causal=True needs kv_grid's spatial size to equal grid's: grid {grid.shape}, "
            f"kv_grid {kv_grid.shape}"
        )
    extra = kv_grid.shape[0] - grid.shape[0]
    tile_t = grid.tile_shape[0]
    if extra < 0 or extra % tile_t:
        raise ValueError(
            f"causal=True needs kv_grid to have grid's frames plus a whole number of time "
            f"tiles ({tile_t} frames) before them: grid has {grid.shape[0]} frames, kv_grid "
            f"{kv_grid.shape[0]}"
        )


def _empty_output(q, k, v, gate) -> torch.Tensor:
    """The output of an empty batch or head set: shaped like q, in q's dtype, differentiable
    (zero-element gradients) in q, k, v and gate (k and v may be of another length)."""
    o = q * 0 + (k.sum() + v.sum()).to(q.dtype) * 0
    return o if gate is None else o + gate * 0


def _video_sparse_attn_composed(q, k, v, grid, topk, gate, tiled, scale, text_tokens=0):
    """Triton path: the fused coarse stage (pooling, coarse attention, top-k lists) and the
    fine stage on the engine, combined with the gate; with text tokens, the text key blocks
    join every video row's list and the text queries run as a second, dense launch."""
    from vidsparse.ops.video_sparse_attn.fine import vsa_fine_combined  # imports Triton

    B, H, _, D = q.shape
    Nt, V = grid.num_tiles, grid.tile_volume
    video_len = grid.padded_len if tiled else grid.num_tokens
    # Natural order without text: the engine writes dq, dk, dv in q, k, v's own order (no
    # tile copies' backward), so the tile-order copies are made outside autograd; the gate is
    # read and its gradient written through the same map (no copy at all); with out_rows the
    # engine stores o in q's order too (no untiling, no tile-order o kept for the backward).
    grads_to = rows = None
    if not tiled and not text_tokens and active_overrides().grad_rows:
        rows = grid.index_tensors(q.device).token_rows
        overrides = active_overrides()
        grads_to = GradTargets(q, k, v, rows, rows, output=overrides.out_rows,
                               regather=overrides.regather)  # fmt: skip
        q, k, v = q.detach(), k.detach(), v.detach()
    q_t, k_t, v_t, o_coarse, kv_indices, kv_counts, pooled = _tiles_and_coarse_stage(
        q, k, v, grid, topk, scale, tiled, video_len, natural=rows is not None
    )  # q_t, k_t, v_t [B, H, P, D]
    fine_only = is_fine_only(gate)
    if rows is None:  # the gate is tiled: formed here (a projection is read through rows only)
        gate = materialized(gate, H, D)
    if text_tokens:
        # operator.index: plain ints (Dynamo specializes them), never SymInts, as plan keys
        plan = _cached_text_plan(grid_key(grid), text_tokens, operator.index(H), q.device)
        text_pad = plan.text_blocks * V - text_tokens
        k_seq = key_sequence(k, grid, tiled, video_len, text_pad, video=k_t)  # [B, H, P+NTb*V, D]
        v_seq = key_sequence(v, grid, tiled, video_len, text_pad, video=v_t)
        # Every row holds exactly topk entries (selection kernel): concatenate the text blocks.
        kv_indices, kv_counts = append_columns(
            kv_indices, kv_counts, plan.text_columns, full_rows=True
        )
        sizes = plan.kv_block_sizes
    else:
        k_seq, v_seq = k_t, v_t
        sizes = grid.tile_sizes_on(q.device)  # int32, cached

    # The coarse branch and the gate join in the fine kernel's epilogue (fine.py). Padding
    # keys are finite here (zeros from tiling; a tiled input's padding rows are documented
    # finite), so the kernel masks their scores without zeroing their values.
    o = vsa_fine_combined(
        q_t,
        k_seq,
        v_seq,
        kv_indices,
        kv_counts,
        sizes,
        o_coarse,
        _fine_gate(gate, fine_only, rows, grid, tiled, video_len),
        sizes[:Nt] if tiled else None,  # tiled output: padding rows zero; untiling drops them
        V,
        scale,
        pooled=pooled,  # the coarse branch's backward runs inside the fine stage's
        fine_only=fine_only,
        rows_dropped=not tiled,
        grads_to=grads_to,
        gate_rows=rows,
    )  # [B, H, P, D]; with grads_to.output in q's order and layout, [B, H, S, D]
    if not tiled and not (grads_to is not None and grads_to.output):
        o = untile_output(o, grid, q if not text_tokens else None)
    if not text_tokens:
        return o
    o_text, _ = attend_text_queries(
        q, k_seq, v_seq, plan.text_indices, plan.text_counts, sizes,
        video_len=video_len, text_tokens=text_tokens, volume=V, scale=scale,
    )  # fmt: skip
    return torch.cat([o, o_text], dim=-2)


def _tiles_and_coarse_stage(q, k, v, grid: VideoGrid, topk, scale, tiled: bool, video_len: int,
                            natural: bool):  # fmt: skip
    """``(q_t, k_t, v_t, oc, kv_indices, kv_counts, pooled)``: the video part of q, k, v in
    tile order and the coarse stage over it. ``natural``: q, k, v are natural-order video
    whose gradients the fine stage writes (no autograd through the copies), so where the
    kernel takes them the copies come out of the pooling's read (one pass over q, k, v)."""
    from vidsparse.ops.video_sparse_attn import coarse  # imports Triton

    if natural and active_overrides().tile_pool and coarse.tile_pool_supports(q, k, v, grid):
        return coarse.vsa_coarse_stage_natural_unchecked(q, k, v, grid, topk, scale)
    q_t, k_t, v_t = (video_tiles(x, grid, tiled, video_len) for x in (q, k, v))
    stage = coarse.vsa_coarse_stage(q_t, k_t, v_t, grid, topk, scale, return_pooled=True)
    return (q_t, k_t, v_t, *stage)


def _fine_gate(gate, fine_only: bool, rows, grid: VideoGrid, tiled: bool, video_len: int):
    """The gate as the fine stage reads it: as given (a projection too) where ``rows`` maps
    the engine's rows to it, else tiled; None without a gate (or with ``gate=0``)."""
    if gate is None or fine_only:
        return None
    return gate if rows is not None else video_tiles(gate, grid, tiled, video_len)


class _TextPlan(NamedTuple):
    """Per (grid, text_tokens, heads, device) engine inputs for the text tokens (read-only)."""

    text_columns: torch.Tensor  # int32 [NTb]: key blocks Nt .. Nt+NTb-1
    text_indices: torch.Tensor  # int32 [1, H, NTb, Nt+NTb], stride-0 view: dense rows
    text_counts: torch.Tensor  # int32 [1, H, NTb]
    kv_block_sizes: torch.Tensor  # int32 [Nt+NTb]: real tokens per key block
    text_blocks: int  # NTb = ceil(N / V)


@host_constant
def _cached_text_plan(grid_key, text_tokens: int, heads: int, device) -> _TextPlan:
    """``_text_plan`` as the Triton path calls it, the grid given by ``grid_key``. Under
    ``torch.compile`` Dynamo runs it on the host at trace time (its ``lru_cache`` is not
    traced) and the plan's tensors enter the graph as constants: they depend only on the
    Python values of the arguments, which Dynamo guards on."""
    return _text_plan(VideoGrid(*grid_key), text_tokens, heads, device)


@functools.lru_cache(maxsize=32)
def _text_plan(grid: VideoGrid, text_tokens: int, heads: int, device) -> _TextPlan:
    Nt, V = grid.num_tiles, grid.tile_volume
    ntb = ceil_div(text_tokens, V)
    columns = torch.arange(Nt, Nt + ntb, dtype=torch.int32, device=device)
    text_indices, text_counts = dense_rows(heads, ntb, Nt + ntb, device)
    sizes = torch.cat([grid.tile_sizes_on(device), text_block_sizes(text_tokens, V, device)])
    return _TextPlan(columns, text_indices, text_counts, sizes.to(torch.int32).contiguous(), ntb)


def _validate(q, k, v, grid, topk, sparsity, gate, tiled, scale, text_tokens) -> torch.device:
    check_video_qkv(grid, q, k, v, REFERENCE_DTYPES)
    check_head_dim(q)
    check_bool("tiled", tiled)
    check_scale(scale)
    check_count("text_tokens", text_tokens)
    check_sequence_length(q.shape[2], grid, tiled, text_tokens)
    _check_selection_and_gate(q, grid.num_tiles, topk, sparsity, gate)
    return check_same_device(q=q, k=k, v=v, gate=_gate_tensor(gate))


def _gate_tensor(gate) -> torch.Tensor | None:
    """The gate if it is a tensor, a projection's hidden states (``0``, the fine stage alone,
    has no device)."""
    if is_projection(gate):
        return gate.hidden_states
    return gate if isinstance(gate, torch.Tensor) else None


def _check_selection_and_gate(q, num_tiles: int, topk, sparsity, gate) -> None:
    """Exactly one of topk / sparsity, of the right type and range; a gate shaped like q."""
    is_number = isinstance(sparsity, (int, float)) and not isinstance(sparsity, bool)
    if is_number and not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    resolve_topk(num_tiles, topk, sparsity)
    check_number_gate(gate)
    if is_projection(gate):
        check_projection(gate, q)
    elif gate is not None and not is_fine_only(gate):
        check_tensor("gate", gate, ndim=4, dtypes=REFERENCE_DTYPES)
        if gate.shape != q.shape:
            raise ValueError(
                f"gate must be shaped like q {tuple(q.shape)}, got {tuple(gate.shape)}"
            )


def _check_triton_supported(q: torch.Tensor, grid: VideoGrid) -> None:
    check_triton_supported(q)
    check_triton_tile(grid, "tile=(4, 4, 4)")
