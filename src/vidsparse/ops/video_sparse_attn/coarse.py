"""Coarse stage of Video Sparse Attention (VSA): its launchers and its ``torch.library`` op.

Tile-ordered ``q, k, v`` ``[B, H, P, D]`` become, in two launches and with no ``Nt x Nt``
tensor anywhere::

    q, k, v --kernels/pool.py--------> pooled fp32 [3, B, H, Nt, D] = (qc, kc, vc)
    pooled  --kernels/coarse_topk.py--> oc [B, H, Nt, D], kv_indices [B, H, Nt, topk], kv_counts

Natural-order inputs whose tile copies the fine stage reads (and whose gradients it writes
itself) take :func:`vsa_coarse_stage_natural`: the copies are made by the pooling's read.

The backward runs the coarse attention's gradient as PyTorch matmuls around one launch for the
softmax's gradient (:func:`coarse_attn_bwd`), then one launch of the pooling backward;
selection is not differentiated. On the torch backend the op composes the reference's
functions (``reference.py``). :func:`vsa_coarse_stage` is the entry point: a custom op with
fake and autograd, so ``torch.compile`` sees one opaque op.
"""

from __future__ import annotations

from statistics import NormalDist

import torch
import triton

from vidsparse.layout import permute_ops
from vidsparse.layout.grid import VideoGrid, grid_key
from vidsparse.layout.sizes import padded_len_of
from vidsparse.ops.block_sparse_attn.interface import check_triton_supported
from vidsparse.ops.video_sparse_attn.configs import (
    BWD_CHUNK_ELEMENTS,
    REFERENCE_DTYPES,
    CoarseAttnConfig,
    PoolConfig,
    SoftmaxBwdConfig,
    coarse_attn_config,
    fill_sms,
    pool_config,
    pow2_at_least,
    softmax_bwd_config,
    tile_pool_config,
)
from vidsparse.ops.video_sparse_attn.kernels.coarse_topk import coarse_attn_topk_fwd_kernel
from vidsparse.ops.video_sparse_attn.kernels.pool import (
    tile_mean_pool_bwd_kernel,
    tile_mean_pool_fwd_kernel,
    tile_pool_fwd_kernel,
)
from vidsparse.ops.video_sparse_attn.kernels.softmax_bwd import coarse_softmax_bwd_kernel
from vidsparse.ops.video_sparse_attn.reference import (
    coarse_attention,
    select_topk,
    tile_means_bwd,
    tile_means_of_sizes,
)
from vidsparse.ops.video_sparse_attn.topk import selected_quantile_z
from vidsparse.utils import ceil_div
from vidsparse.utils.backend import resolve_backend
from vidsparse.utils.checks import check_same_device, check_tensor
from vidsparse.utils.device import num_sms, target_of

__all__ = [
    "vsa_coarse_stage",
    "vsa_coarse_stage_natural",
    "vsa_coarse_stage_natural_unchecked",
    "tile_pool_supports",
    "tile_pool_fwd",
    "tile_mean_pool_fwd",
    "tile_mean_pool_bwd",
    "coarse_attn_topk_fwd",
    "coarse_attn_bwd",
    "coarse_softmax_bwd",
    "coarse_grad_dtype",
    "speculates",
]

LOG2E = 1.4426950408889634


def _pooled_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def speculates(cfg: CoarseAttnConfig, topk: int, num_tiles: int) -> bool:
    """Whether the first selection pass collects the middle score-pivot window
    (``SPECULATE`` in ``kernels/coarse_topk.py``): where normal scores would put at most
    ``speculate_fill`` of the scratch capacity in it, so that it fits for most rows. Wider
    windows (many tiles, few pivots) would mostly overflow and only add the collecting cost to
    the first pass."""
    half = cfg.num_pivots // 2
    if cfg.speculate_fill <= 0 or half % 2:
        return False
    z = selected_quantile_z(topk, num_tiles)
    width = 1.0 / (half + 1)  # the window spans z -+ width standard deviations
    expected = num_tiles * (NormalDist().cdf(z + width) - NormalDist().cdf(z - width))
    return expected <= cfg.speculate_fill * cfg.bracket_capacity


def tile_mean_pool_fwd(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    tile_sizes: torch.Tensor,
    config: PoolConfig | None = None,
) -> torch.Tensor:
    """Means of each tile's real tokens of q, k and v, in one launch.

    ``q_t, k_t, v_t`` ``[B, H, P, D]`` in tile order, ``tile_sizes`` int32 ``[Nt]``; returns
    ``pooled`` fp32 ``[3, B, H, Nt, D]`` = ``(qc, kc, vc)``. Padding slots are not read.
    """
    B, H, P, D = q_t.shape
    num_tiles = tile_sizes.shape[0]
    tile_volume = P // num_tiles
    # fp32 whatever the inputs: the means rank tiles, and bf16 rounding would move scores by
    # more than the gap between neighbouring candidates; at 1/V of the inputs' size it is cheap.
    pooled = torch.empty((3, B, H, num_tiles, D), device=q_t.device, dtype=torch.float32)
    cfg = config or pool_config(target_of(q_t.device), D)
    _launch_pool(q_t, k_t, v_t, pooled, pooled.stride(), tile_sizes, tile_sizes, tile_volume, cfg,
                 separate_kv=False)  # fmt: skip
    return pooled


def _launch_pool(q_t, k_t, v_t, pooled, pooled_strides, q_sizes, k_sizes, volume, cfg, *,
                 separate_kv: bool) -> None:  # fmt: skip
    B, H, _, D = q_t.shape
    nq, nk = q_sizes.shape[0], k_sizes.shape[0]
    grid = (triton.cdiv(max(nq, nk), cfg.tiles_per_program), B * H, 3)
    tile_mean_pool_fwd_kernel[grid](
        q_t, k_t, v_t, pooled, q_sizes, k_sizes,
        *q_t.stride(), *k_t.stride(), *v_t.stride(), *pooled_strides,
        H, nq, nk,
        TILE_VOLUME=volume, TILE_SLOTS=pow2_at_least(volume), HEAD_DIM=D,
        TILES_PER_PROGRAM=cfg.tiles_per_program, SEPARATE_KV=separate_kv,
        **cfg.launch_kwargs(),
    )  # fmt: skip


def tile_mean_pool_fwd_separate(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    q_sizes: torch.Tensor,
    k_sizes: torch.Tensor,
    config: PoolConfig | None = None,
) -> torch.Tensor:
    """:func:`tile_mean_pool_fwd` where k and v have tiles of their own: ``q_t [B, H, Nq*V,
    D]`` with ``q_sizes [Nq]``, ``k_t, v_t [B, H, Nk*V, D]`` with ``k_sizes [Nk]``. Returns
    fp32 ``[B, H, Nq + 2 Nk, D]``: the q means, the k means, the v means (one launch)."""
    B, H, _, D = q_t.shape
    nq, nk = q_sizes.shape[0], k_sizes.shape[0]
    tile_volume = q_t.shape[2] // nq
    pooled = torch.empty((B, H, nq + 2 * nk, D), device=q_t.device, dtype=torch.float32)
    cfg = config or pool_config(target_of(q_t.device), D)
    # stride 0 between q, k and v: SEPARATE_KV places them by rows (pooled is 4-D)
    _launch_pool(q_t, k_t, v_t, pooled, (0, *pooled.stride()), q_sizes, k_sizes, tile_volume,
                 cfg, separate_kv=True)  # fmt: skip
    return pooled


def tile_pool_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shape,
    tile,
    config: PoolConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grid.tile`` of natural-order ``q, k, v`` ``[B, H, S, D]`` (any strides; the grid
    given by ``shape`` and ``tile``) and :func:`tile_mean_pool_fwd` of the copies, with one
    read of each input and one launch. Returns ``(q_t, k_t, v_t, pooled)``: contiguous
    ``[B, H, P, D]`` copies (padding slots zero) and fp32 ``[3, B, H, Nt, D]`` means."""
    B, H, _, D = q.shape
    T, Hh, W = shape
    tT, tH, tW = tile
    P = padded_len_of(shape, tile)
    num_tiles = P // (tT * tH * tW)
    copies = [torch.empty((B, H, P, D), device=q.device, dtype=q.dtype) for _ in range(3)]
    pooled = torch.empty((3, B, H, num_tiles, D), device=q.device, dtype=torch.float32)
    cfg = config or tile_pool_config(target_of(q.device), D)
    grid = (triton.cdiv(num_tiles, cfg.tiles_per_program), B * H, 3)
    tile_pool_fwd_kernel[grid](
        q, k, v, *copies, pooled,
        *q.stride(), *k.stride(), *v.stride(), *pooled.stride(),
        H, num_tiles, P,
        T, Hh, W, ceil_div(Hh, tH), ceil_div(W, tW),
        TILE_T=tT, TILE_H=tH, TILE_W=tW, HEAD_DIM=D, TILES_PER_PROGRAM=cfg.tiles_per_program,
        **cfg.launch_kwargs(),
    )  # fmt: skip
    return copies[0], copies[1], copies[2], pooled


def tile_mean_pool_bwd(
    dpooled: torch.Tensor,
    tile_sizes: torch.Tensor,
    padded_len: int,
    dtype: torch.dtype,
    config: PoolConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient of :func:`tile_mean_pool_fwd`: ``dpooled`` ``[3, B, H, Nt, D]`` ->
    ``(dq, dk, dv)`` ``[B, H, padded_len, D]`` in ``dtype``; each real token of tile ``i`` gets
    ``d mean_i / size_i``, each padding slot 0."""
    _, B, H, num_tiles, D = dpooled.shape
    tile_volume = padded_len // num_tiles
    grads = [
        torch.empty((B, H, padded_len, D), device=dpooled.device, dtype=dtype) for _ in range(3)
    ]
    cfg = config or pool_config(target_of(dpooled.device), D)
    grid = (triton.cdiv(num_tiles, cfg.tiles_per_program), B * H, 3)
    tile_mean_pool_bwd_kernel[grid](
        dpooled, *grads, tile_sizes,
        *dpooled.stride(), *grads[0].stride(), *grads[1].stride(), *grads[2].stride(),
        H, num_tiles,
        TILE_VOLUME=tile_volume, TILE_SLOTS=pow2_at_least(tile_volume), HEAD_DIM=D,
        TILES_PER_PROGRAM=cfg.tiles_per_program,
        **cfg.launch_kwargs(),
    )  # fmt: skip
    return grads[0], grads[1], grads[2]


def coarse_attn_topk_fwd(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    topk: int,
    scale: float,
    config: CoarseAttnConfig | None = None,
    record_passes: bool = False,
):
    """Coarse attention and top-k selection in one launch.

    ``qc, kc, vc`` ``[B, H, Nt, D]`` (fp32 from the pooling kernel); ``1 <= topk <= Nt``.
    Returns ``oc`` ``[B, H, Nt, D]`` (qc's dtype), ``kv_indices`` int32 ``[B, H, Nt, topk]``
    (ascending per row) and ``kv_counts`` int32 ``[B, H, Nt]``; with ``record_passes`` also
    int32 ``[B * H, num_q_blocks]``, the selection passes each program ran.

    With exact (``ieee``) dots the lists are :func:`~.reference.select_topk`'s, ties included;
    TF32 dots (GPUs, see ``configs.py``) perturb the scores by ~1e-3 relative.
    """
    B, H, num_tiles, D = qc.shape
    cfg = config or fill_sms(coarse_attn_config(target_of(qc.device), D, num_tiles),
                             num_tiles, B * H, num_sms(qc.device))  # fmt: skip
    oc = torch.empty((B, H, num_tiles, D), device=qc.device, dtype=qc.dtype)
    kv_indices = torch.empty((B, H, num_tiles, topk), device=qc.device, dtype=torch.int32)
    kv_counts = torch.empty((B, H, num_tiles), device=qc.device, dtype=torch.int32)
    # Keys of the few brackets that get collected: O(Nt * capacity), never O(Nt^2).
    scratch = torch.empty(
        (B * H * num_tiles, cfg.bracket_capacity), device=qc.device, dtype=torch.int32
    )
    grid = (triton.cdiv(num_tiles, cfg.block_m), B * H)
    passes = torch.empty((B * H, grid[0]), device=qc.device, dtype=torch.int32)
    coarse_attn_topk_fwd_kernel[grid](
        qc, kc, vc, oc, kv_indices, kv_counts, scratch, passes, passes, scratch,
        *qc.stride(), *kc.stride(), *vc.stride(), *oc.stride(),
        *kv_indices.stride(), *kv_counts.stride(),
        H, num_tiles, topk,
        float(scale), float(scale) * LOG2E, selected_quantile_z(topk, num_tiles),
        **_selection_constexprs(cfg, topk, num_tiles, D), RECORD_PASSES=record_passes,
        SEGMENTED=False, **cfg.launch_kwargs(),
    )  # fmt: skip
    if record_passes:
        return oc, kv_indices, kv_counts, passes
    return oc, kv_indices, kv_counts


def _selection_constexprs(cfg: CoarseAttnConfig, topk: int, num_keys: int, head_dim: int):
    return dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, NUM_PIVOTS=cfg.num_pivots,
        BRACKET_CAPACITY=cfg.bracket_capacity, INPUT_PRECISION=cfg.input_precision,
        PACKED_COUNTS=cfg.packed_counts and cfg.num_pivots in (4, 8) and cfg.block_n < 256,
        SPECULATE=speculates(cfg, topk, num_keys),
    )  # fmt: skip


def coarse_attn_topk_segments(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    segments: tuple,
    scale: float,
    config: CoarseAttnConfig | None = None,
):
    """:func:`coarse_attn_topk_fwd` over segments (``segments.py``): ``qc [B, H, Nq, D]``,
    ``kc, vc [B, H, Nk, D]``; each segment's query tiles attend and select among its own key
    range only, keeping its own ``topk``. Returns ``oc [B, H, Nq, D]``, ``kv_indices`` int32
    ``[B, H, Nq, max topk]`` (indices into the Nk key tiles; entries past a row's count are 0)
    and ``kv_counts`` ``[B, H, Nq]``. One launch for all segments."""
    from vidsparse.ops.video_sparse_attn.segments import program_table

    B, H, nq, D = qc.shape
    widest = max(s.k_count for s in segments)
    max_topk = max(s.topk for s in segments)
    cfg = config or fill_sms(coarse_attn_config(target_of(qc.device), D, widest), nq, B * H,
                             num_sms(qc.device))  # fmt: skip
    table, z = program_table(tuple(segments), cfg.block_m, qc.device)
    oc = torch.empty((B, H, nq, D), device=qc.device, dtype=qc.dtype)
    kv_indices = torch.zeros((B, H, nq, max_topk), device=qc.device, dtype=torch.int32)
    kv_counts = torch.empty((B, H, nq), device=qc.device, dtype=torch.int32)
    scratch = torch.empty((B * H * nq, cfg.bracket_capacity), device=qc.device, dtype=torch.int32)
    grid = (table.shape[0], B * H)
    # Speculation sized by the widest segment (a choice of speed only, never of result).
    typical = max(segments, key=lambda s: s.k_count * (s.q_stop - s.q_start))
    coarse_attn_topk_fwd_kernel[grid](
        qc, kc, vc, oc, kv_indices, kv_counts, scratch, kv_counts, table, z,
        *qc.stride(), *kc.stride(), *vc.stride(), *oc.stride(),
        *kv_indices.stride(), *kv_counts.stride(),
        H, nq, max_topk, float(scale), float(scale) * LOG2E, 0.0,
        **_selection_constexprs(cfg, typical.topk, typical.k_count, D), RECORD_PASSES=False,
        SEGMENTED=True, **cfg.launch_kwargs(),
    )  # fmt: skip
    return oc, kv_indices, kv_counts


def coarse_grad_dtype(input_dtype: torch.dtype) -> torch.dtype | None:
    """``grad_dtype`` of :func:`coarse_attn_bwd` for inputs of ``input_dtype``: bf16 for bf16,
    as the fine stage's kernels form their gradients; fp16 inputs keep fp32 there (d o_coarse
    sums a tile's rows of do and can leave fp16's range under loss scaling); fp32 / fp64 keep
    their precision (None)."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else None


@torch.no_grad()
def coarse_attn_bwd(
    doc: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scale: float,
    grad_dtype: torch.dtype | None = None,
    *,
    kernel: bool = False,
) -> torch.Tensor:
    """Gradient of ``oc = softmax(qc kc^T * scale) vc``, chunked over query tiles (each
    ``[B, H, chunk, Nk]`` temporary within ``BWD_CHUNK_ELEMENTS``). ``qc`` may have ``Nq``
    tiles and ``kc, vc`` ``Nk`` (one segment of a plan: ``fine._coarse_bwd_per_segment``).

    The probabilities are recomputed in qc's precision (fp32): at large input scales the
    softmax is sharp and bf16 scores would be off by ~25%. The four gradient matmuls run in
    ``grad_dtype`` (default qc's), with the products accumulated in fp32: bf16 there costs
    ~4e-3 relative error, like any bf16 gradient, and runs on the tensor cores. ``kernel``
    (the Triton backend's callers): the softmax's gradient in one launch
    (:func:`coarse_softmax_bwd`) for fp32 tiles; in PyTorch ops otherwise, and for fp64 tiles
    (the torch backend's), whose scores stay fp64.

    Returns ``dpooled`` ``[3, B, H, max(Nq, Nk), D]`` = ``(dqc, dkc, dvc)`` in qc's dtype.
    """
    B, H, num_tiles, D = qc.shape
    num_keys = kc.shape[2]
    low = grad_dtype or qc.dtype
    doc_low, qc_low, kc_low, vc_t_low = (
        x.to(low) for x in (doc, qc, kc, vc.transpose(-1, -2))
    )  # fmt: skip
    dpooled = torch.zeros((3, B, H, max(num_tiles, num_keys), D), device=qc.device, dtype=qc.dtype)
    dqc, dkc, dvc = (g[:, :, :n] for g, n in zip(dpooled.unbind(0), (num_tiles,) + (num_keys,) * 2))
    kc_t = kc.transpose(-1, -2)  # [B, H, D, Nk]
    fused = kernel and qc.dtype == torch.float32
    softmax_grads = coarse_softmax_bwd if fused else _softmax_grads_torch
    chunk = max(1, BWD_CHUNK_ELEMENTS // max(1, B * H * num_keys))
    for start in range(0, num_tiles, chunk):
        rows = slice(start, min(start + chunk, num_tiles))
        do_rows = doc_low[:, :, rows]  # [B, H, c, D]
        scores = torch.matmul(qc[:, :, rows], kc_t)  # [B, H, c, Nk], unscaled
        dprobs = torch.matmul(do_rows, vc_t_low)  # [B, H, c, Nk]
        probs, dscores = softmax_grads(scores, dprobs, scale, low)  # both in low
        dvc += torch.matmul(probs.transpose(-1, -2), do_rows)  # [B, H, Nk, D]
        dqc[:, :, rows] = torch.matmul(dscores, kc_low)  # [B, H, c, D]
        dkc += torch.matmul(dscores.transpose(-1, -2), qc_low[:, :, rows])  # [B, H, Nk, D]
    return dpooled


def _softmax_grads_torch(scores, dprobs, scale: float, out_dtype: torch.dtype):
    """:func:`coarse_softmax_bwd` in PyTorch ops (scores' precision)."""
    probs = torch.softmax(scores * scale, dim=-1)
    dprobs = dprobs.to(probs.dtype)
    delta = (probs * dprobs).sum(dim=-1, keepdim=True)
    dscores = (probs * dprobs.sub_(delta)).mul_(scale)
    return probs.to(out_dtype), dscores.to(out_dtype)


def coarse_softmax_bwd(
    scores: torch.Tensor,
    dprobs: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
    config: SoftmaxBwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, ds)`` in ``out_dtype`` for fp32 raw scores ``s`` ``[..., Nk]`` and ``dprobs``
    (same shape, any float dtype): ``p = softmax(scale * s)`` and ``ds = p * (dprobs -
    rowsum(p * dprobs)) * scale``, computed in fp32 (``kernels/softmax_bwd.py``)."""
    if scores.dtype != torch.float32 or dprobs.shape != scores.shape:
        raise ValueError(
            f"coarse_softmax_bwd takes fp32 scores and dprobs of their shape, got"
            f" {scores.dtype} {tuple(scores.shape)} and {tuple(dprobs.shape)}"
        )
    num_cols = scores.shape[-1]
    scores, dprobs = scores.contiguous(), dprobs.contiguous()
    probs, dscores = (torch.empty_like(scores, dtype=out_dtype) for _ in range(2))
    num_rows = scores.numel() // max(1, num_cols)
    if num_rows == 0 or num_cols == 0:
        return probs, dscores
    cfg = config or softmax_bwd_config(target_of(scores.device), num_cols)
    rows = max(1, cfg.row_elements // cfg.block_cols)
    coarse_softmax_bwd_kernel[(triton.cdiv(num_rows, rows),)](
        scores, dprobs, probs, dscores, num_cols, num_cols, num_cols, num_cols,
        num_rows, num_cols, float(scale), float(scale) * LOG2E,
        ROWS=rows, BLOCK_COLS=cfg.block_cols, **cfg.launch_kwargs(),
    )  # fmt: skip
    return probs, dscores


# ============================================================================ custom ops


@torch.library.custom_op("vidsparse::vsa_coarse_stage_fwd", mutates_args=())
def _vsa_coarse_stage_fwd_op(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    tile_sizes: torch.Tensor,
    topk: int,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        pooled = tile_mean_pool_fwd(q_t, k_t, v_t, tile_sizes)
        oc, kv_indices, kv_counts = coarse_attn_topk_fwd(
            pooled[0], pooled[1], pooled[2], topk, scale
        )
        return oc, kv_indices, kv_counts, pooled
    dtype = _pooled_dtype(q_t.dtype)
    pooled = torch.stack([tile_means_of_sizes(x.to(dtype), tile_sizes) for x in (q_t, k_t, v_t)])
    oc, scores = coarse_attention(pooled[0], pooled[1], pooled[2], scale)
    kv_indices, kv_counts = select_topk(scores, topk)
    return oc, kv_indices, kv_counts, pooled


@_vsa_coarse_stage_fwd_op.register_fake
def _(q_t, k_t, v_t, tile_sizes, topk, scale, backend):
    B, H, _, D = q_t.shape
    num_tiles = tile_sizes.shape[0]
    dtype = _pooled_dtype(q_t.dtype)
    return (
        q_t.new_empty((B, H, num_tiles, D), dtype=dtype),
        q_t.new_empty((B, H, num_tiles, topk), dtype=torch.int32),
        q_t.new_empty((B, H, num_tiles), dtype=torch.int32),
        q_t.new_empty((3, B, H, num_tiles, D), dtype=dtype),
    )


@torch.library.custom_op("vidsparse::vsa_coarse_stage_bwd", mutates_args=())
def _vsa_coarse_stage_bwd_op(
    doc: torch.Tensor,
    pooled: torch.Tensor,
    tile_sizes: torch.Tensor,
    padded_len: int,
    dtype: torch.dtype,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dpooled = coarse_attn_bwd(doc, pooled[0], pooled[1], pooled[2], scale,
                              coarse_grad_dtype(dtype), kernel=backend == "triton")  # fmt: skip
    if backend == "triton":
        return tile_mean_pool_bwd(dpooled, tile_sizes, padded_len, dtype)
    return tile_means_bwd(dpooled, tile_sizes, padded_len, dtype)


@_vsa_coarse_stage_bwd_op.register_fake
def _(doc, pooled, tile_sizes, padded_len, dtype, scale, backend):
    _, B, H, _, D = pooled.shape
    return tuple(pooled.new_empty((B, H, padded_len, D), dtype=dtype) for _ in range(3))


def _setup_context(ctx, inputs, output):
    q_t, k_t, v_t, tile_sizes, topk, scale, backend = inputs
    oc, kv_indices, kv_counts, pooled = output
    ctx.save_for_backward(pooled, tile_sizes)
    ctx.meta = (q_t.shape[2], q_t.dtype, scale, backend)
    ctx.mark_non_differentiable(kv_indices, kv_counts, pooled)


def _backward(ctx, doc, _dindices, _dcounts, _dpooled):
    pooled, tile_sizes = ctx.saved_tensors
    padded_len, dtype, scale, backend = ctx.meta
    dq, dk, dv = torch.ops.vidsparse.vsa_coarse_stage_bwd(
        doc, pooled, tile_sizes, padded_len, dtype, scale, backend
    )
    return dq, dk, dv, None, None, None, None


_vsa_coarse_stage_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("vidsparse::vsa_coarse_stage_natural", mutates_args=())
def _vsa_coarse_stage_natural_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shape: list[int],
    tile: list[int],
    topk: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:  # fmt: skip
    q_t, k_t, v_t, pooled = tile_pool_fwd(q, k, v, shape, tile)
    oc, kv_indices, kv_counts = coarse_attn_topk_fwd(pooled[0], pooled[1], pooled[2], topk, scale)
    return q_t, k_t, v_t, oc, kv_indices, kv_counts, pooled


@_vsa_coarse_stage_natural_op.register_fake
def _(q, k, v, shape, tile, topk, scale):
    B, H, _, D = q.shape
    P = padded_len_of(shape, tile)
    num_tiles = P // (tile[0] * tile[1] * tile[2])
    copies = tuple(q.new_empty((B, H, P, D)) for _ in range(3))
    return (
        *copies,
        q.new_empty((B, H, num_tiles, D), dtype=torch.float32),
        q.new_empty((B, H, num_tiles, topk), dtype=torch.int32),
        q.new_empty((B, H, num_tiles), dtype=torch.int32),
        q.new_empty((3, B, H, num_tiles, D), dtype=torch.float32),
    )


# ============================================================================ entry point


def vsa_coarse_stage(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    grid: VideoGrid,
    topk: int,
    scale: float | None = None,
    *,
    return_pooled: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The coarse stage of VSA: tile means, coarse attention and top-k selection.

    ::

        q_t, k_t, v_t [B, H, P, D] (tile order; padding slots ignored, whatever they hold)
          -> qc, kc, vc = means of each tile's real tokens            [B, H, Nt, D] fp32
          -> oc = softmax(qc kc^T * scale) vc                         [B, H, Nt, D] fp32
          -> per query tile, the topk key tiles of largest score      kv_indices, kv_counts

    Args:
        q_t, k_t, v_t: ``[B, H, grid.padded_len, D]`` in tile order (``grid.tile``), one dtype.
        grid: the :class:`VideoGrid`; its ``tile_sizes`` mask the padding slots.
        topk: key tiles kept per query tile, ``>= 1``; values above ``num_tiles`` are clamped.
        scale: softmax scale, ``1 / sqrt(D)`` by default.

    Returns ``(oc, kv_indices, kv_counts)``: ``oc`` fp32 (fp64 for fp64 inputs), differentiable
    in q_t, k_t, v_t (each real token of tile i gets ``d qc_i / size_i``, padding gets 0);
    ``kv_indices`` int32 ``[B, H, Nt, topk]``, ascending in each row, ties broken towards the
    smaller tile index; ``kv_counts`` int32 ``[B, H, Nt]``, ``topk`` (fewer only in rows whose
    scores hold NaN). Both feed
    ``block_sparse_attn(..., block_size=grid.tile_volume, kv_block_sizes=grid.tile_sizes_on(...))``
    directly. ``return_pooled`` adds the tile means ``[3, B, H, Nt, D]`` (qc, kc, vc; not
    differentiable), which VSA's fine stage takes to fuse this stage's backward into its own.
    """
    _validate(q_t, k_t, v_t, grid, topk, scale)
    device = check_same_device(q_t=q_t, k_t=k_t, v_t=v_t)
    D = q_t.shape[-1]
    topk = min(int(topk), grid.num_tiles)
    scale = D**-0.5 if scale is None else float(scale)
    backend = resolve_backend(device)
    if backend == "triton":
        check_triton_supported(q_t)
    tile_sizes = grid.tile_sizes_on(device)
    oc, kv_indices, kv_counts, pooled = torch.ops.vidsparse.vsa_coarse_stage_fwd(
        q_t, k_t, v_t, tile_sizes, topk, scale, backend
    )
    if return_pooled:
        return oc, kv_indices, kv_counts, pooled
    return oc, kv_indices, kv_counts


def tile_pool_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: VideoGrid) -> bool:
    """Whether :func:`vsa_coarse_stage_natural` takes these inputs: what ``grid.tile``'s
    kernel takes (``permute_ops.kernel_supports``), q, k and v of one shape and dtype, and
    none of them needing a gradient (the caller's fine stage writes those)."""
    return (
        q.shape == k.shape == v.shape
        and q.dtype == k.dtype == v.dtype
        and not (q.requires_grad or k.requires_grad or v.requires_grad)
        and permute_ops.kernel_supports(q, 2, grid.padded_len)
    )


def vsa_coarse_stage_natural(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: VideoGrid, topk: int, scale: float
) -> tuple[torch.Tensor, ...]:
    """:func:`vsa_coarse_stage` of ``grid.tile(q)``, ``grid.tile(k)``, ``grid.tile(v)`` with
    ``return_pooled=True``, for natural-order ``[B, H, grid.num_tokens, D]`` inputs that
    :func:`tile_pool_supports` takes: the tile copies are made in the pooling's read, one pass
    over q, k and v instead of two. Returns ``(q_t, k_t, v_t, oc, kv_indices, kv_counts,
    pooled)``, none differentiable: the caller (VSA's fine stage) runs this stage's backward
    from ``pooled`` and writes the gradients of q, k and v itself."""
    if not tile_pool_supports(q, k, v, grid):
        raise ValueError(
            "vsa_coarse_stage_natural takes q, k, v of one shape and dtype, needing no"
            " gradient, that grid.tile's kernel takes"
        )
    return vsa_coarse_stage_natural_unchecked(q, k, v, grid, topk, scale)


def vsa_coarse_stage_natural_unchecked(q, k, v, grid: VideoGrid, topk: int, scale: float):
    """:func:`vsa_coarse_stage_natural` for a caller that has asked
    :func:`tile_pool_supports` already (VSA's entry, once a call)."""
    topk = min(int(topk), grid.num_tiles)
    shape, tile = (list(part) for part in grid_key(grid))
    outputs = torch.ops.vidsparse.vsa_coarse_stage_natural(q, k, v, shape, tile, topk, float(scale))
    return tuple(outputs)


def _validate(q_t, k_t, v_t, grid, topk, scale) -> None:
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        check_tensor(name, x, ndim=4, dtypes=REFERENCE_DTYPES)
    if not (q_t.dtype == k_t.dtype == v_t.dtype):
        raise TypeError(
            f"q_t, k_t, v_t must share a dtype, got {q_t.dtype}, {k_t.dtype}, {v_t.dtype}"
        )
    if not (q_t.shape == k_t.shape == v_t.shape):
        raise ValueError(
            f"q_t, k_t, v_t must have the same shape [B, H, P, D], got {tuple(q_t.shape)},"
            f" {tuple(k_t.shape)}, {tuple(v_t.shape)}"
        )
    if q_t.shape[2] != grid.padded_len:
        raise ValueError(
            f"q_t must be in tile order with grid.padded_len = {grid.padded_len} rows for {grid},"
            f" got {tuple(q_t.shape)} (tile it with grid.tile(x, dim=-2))"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0
    ):
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
