"""Video Sparse Attention (VSA) in plain PyTorch: the oracle for the kernels and the CPU path.

VSA attends in two stages over the tiles of a :class:`~vidsparse.layout.VideoGrid`:

1. **Coarse.** Mean-pool each tile's real tokens into one token (``Qc, Kc, Vc``), run dense
   attention between tiles, ``Oc = softmax(Qc Kc^T * scale) Vc``, and broadcast ``Oc`` back to
   every token of its query tile.
2. **Fine.** For every query tile keep the ``topk`` key tiles with the largest coarse scores,
   and run exact attention from each query token over the real tokens of those tiles only.

``o = o_fine + gate * o_coarse`` (``o_fine + o_coarse`` without a gate; ``o_fine`` alone with
``gate=0``, see :func:`is_fine_only`). Selection is a discrete choice and is not
differentiated; everything else is, by autograd.

**Text tokens** (joint attention, HunyuanVideo): ``text_tokens = N`` non-video tokens after the
video tokens. The coarse stage and the selection see video tokens only. Every video query
attends to its selected tiles *and* all ``N`` text keys, in one softmax; text queries attend
densely to every real key (video and text), and get no coarse term (their gate is ignored).

Everything is computed in fp32 (fp64 for fp64 inputs) and in tile order. The fine stage runs a
few query tiles at a time and gathers only their selected key tiles, so no ``S x S`` tensor ever
exists, even on a Wan 480p grid (32,760 tokens).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from vidsparse.layout.grid import VideoGrid
from vidsparse.ops._video_inputs import check_count
from vidsparse.ops.video_sparse_attn.topk import resolve_topk

__all__ = [
    "tile_means",
    "tile_means_of_sizes",
    "tile_means_bwd",
    "coarse_attention",
    "select_topk",
    "fine_attention",
    "fine_attention_tiles",
    "dense_attention",
    "select_topk_segments",
    "vsa_segments_ref",
    "video_sparse_attn_ref",
]

# Budget, in elements, for the per-chunk temporaries of the fine stage (gathered K and V and the
# score matrix together). 2**26 fp32 elements is 256 MiB.
_FINE_CHUNK_ELEMENTS = 2**26


def is_fine_only(gate) -> bool:
    """Whether ``gate`` is the number 0: the fine stage alone, as a zero gate gives, with no
    gate tensor to read and no coarse term to combine or differentiate (a stock checkpoint)."""
    return isinstance(gate, (int, float)) and not isinstance(gate, bool) and gate == 0


def check_number_gate(gate) -> None:
    """A number given as the gate must be 0 (a bool is no number here)."""
    if isinstance(gate, (int, float)) and not is_fine_only(gate):
        raise ValueError(
            f"a number as gate must be 0 (the fine stage alone), got {gate!r}; weight the "
            "coarse output with a tensor shaped like q"
        )


def tile_means(x_tiled: torch.Tensor, grid: VideoGrid) -> torch.Tensor:
    """Mean of each tile's real tokens: ``[..., padded_len, D] -> [..., num_tiles, D]``.

    Divides by the real token count of each tile (not ``tile_volume``), and ignores whatever
    the padding slots hold.
    """
    _require(
        x_tiled.ndim >= 2 and x_tiled.shape[-2] == grid.padded_len,
        f"x_tiled must be [..., padded_len={grid.padded_len}, D], got {tuple(x_tiled.shape)}",
    )
    return tile_means_of_sizes(x_tiled, grid.index_tensors(x_tiled.device).tile_sizes)


def tile_means_of_sizes(x_tiled: torch.Tensor, tile_sizes: torch.Tensor) -> torch.Tensor:
    """:func:`tile_means` from the tiles' real token counts ``tile_sizes`` int32 ``[Nt]``
    (a tile's real tokens are its first slots): what a custom op, which takes no grid, calls."""
    *lead, P, D = x_tiled.shape
    Nt = tile_sizes.shape[0]
    V = P // Nt
    x = x_tiled.reshape(*lead, Nt, V, D)  # [..., Nt, V, D]
    real = torch.arange(V, device=x.device) < tile_sizes.view(Nt, 1)  # [Nt, V]
    x = x.masked_fill(~real.view(Nt, V, 1), 0)
    sizes = tile_sizes.clamp(min=1).to(x.dtype).view(Nt, 1)  # [Nt, 1]
    return x.sum(dim=-2) / sizes  # [..., Nt, D]


def tile_means_bwd(
    dmeans: torch.Tensor, tile_sizes: torch.Tensor, padded_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Gradient of :func:`tile_means_of_sizes` for each of ``dmeans.unbind(0)``: ``[n, B, H,
    Nt, D]`` -> ``n`` tensors ``[B, H, padded_len, D]`` in ``dtype``; each real token of tile
    ``i`` gets ``d mean_i / size_i``, each padding slot 0 (for custom ops without autograd)."""
    _, B, H, num_tiles, D = dmeans.shape
    tile_volume = padded_len // num_tiles
    real = torch.arange(tile_volume, device=dmeans.device) < tile_sizes.view(-1, 1)  # [Nt, V]
    sizes = tile_sizes.clamp(min=1).to(dmeans.dtype).view(-1, 1, 1)  # [Nt, 1, 1]
    weights = real[..., None].to(dmeans.dtype) / sizes  # [Nt, V, 1]: 1/size on real slots
    grads = []  # separate tensors: custom-op outputs must not alias each other
    for dmean in dmeans.unbind(0):
        dx = dmean.unsqueeze(-2) * weights  # [B, H, Nt, V, D]
        grads.append(dx.reshape(B, H, padded_len, D).to(dtype))
    return tuple(grads)


def coarse_attention(
    qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention between tile means.

    Returns ``oc`` ``[B, H, Nt, D]`` and the pre-softmax ``scores`` ``[B, H, Nt, Nt]`` that the
    selection ranks.
    """
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # [B, H, Nt, Nt]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vc), scores  # [B, H, Nt, D], [B, H, Nt, Nt]


@torch.no_grad()
def select_topk(scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` key tiles with the largest coarse score, per query tile; ties go to the
    smaller tile index (the kernels' rule, so they match exactly).

    Returns ``kv_indices`` int32 ``[B, H, Nt, topk]`` (ascending within each row, so the fine
    kernel walks keys in memory order) and ``kv_counts`` int32 ``[B, H, Nt]`` (all ``topk``).
    """
    _require(
        1 <= topk <= scores.shape[-1],
        f"topk must be in [1, {scores.shape[-1]}] for scores of shape {tuple(scores.shape)}, "
        f"got {topk}",
    )
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    kv_indices = order[..., :topk].sort(dim=-1).values.to(torch.int32)  # [B, H, Nt, topk]
    kv_counts = torch.full(scores.shape[:-1], topk, dtype=torch.int32, device=scores.device)
    return kv_indices, kv_counts


def fine_attention(
    q_tiled: torch.Tensor,
    k_tiled: torch.Tensor,
    v_tiled: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    grid: VideoGrid,
    scale: float,
    k_extra: torch.Tensor | None = None,
    v_extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-sparse attention over tiles: each query token attends to the real tokens of the
    first ``kv_counts[b, h, i]`` tiles listed in ``kv_indices[b, h, i]`` for its tile ``i``,
    plus, when given, the extra keys ``k_extra`` / ``v_extra`` ``[B, H, N, D]`` (text tokens,
    all real), which every query attends in the same softmax.

    Inputs are in tile order ``[B, H, padded_len, D]``; ``kv_indices`` / ``kv_counts`` may have
    a batch dimension of 1 (shared by the batch). Padding keys get no weight; a query that
    attends to nothing gets 0. Padding query rows are computed like any other row, so callers
    zero them if they need to. Computes in the inputs' dtype.
    """
    B, H, seq_len, D = q_tiled.shape
    Nt, V = grid.num_tiles, grid.tile_volume
    _require(
        seq_len == grid.padded_len,
        f"q_tiled must have padded_len={grid.padded_len} rows, got {tuple(q_tiled.shape)}",
    )
    _require(
        kv_indices.ndim == 4 and kv_indices.shape[1:3] == (H, Nt),
        f"kv_indices must be [B or 1, {H}, {Nt}, K], got {tuple(kv_indices.shape)}",
    )
    _require(
        tuple(kv_counts.shape) == tuple(kv_indices.shape[:3]),
        f"kv_counts must be {tuple(kv_indices.shape[:3])}, got {tuple(kv_counts.shape)}",
    )
    key_valid = grid.real_token_mask(q_tiled.device).view(Nt, V)  # [Nt, V]
    return fine_attention_tiles(
        q_tiled, k_tiled, v_tiled, kv_indices, kv_counts, key_valid, scale, k_extra, v_extra
    )


def fine_attention_tiles(
    q_tiled: torch.Tensor,
    k_tiled: torch.Tensor,
    v_tiled: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    k_extra: torch.Tensor | None = None,
    v_extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fine_attention` over tiles of ``V`` slots without a grid: ``q_tiled [B, H,
    Nq*V, D]``, ``k_tiled, v_tiled [B, H, Nk*V, D]``, ``key_valid`` bool ``[Nk, V]`` (the real
    key slots); lists ``[B or 1, H, Nq, K]`` index the ``Nk`` key tiles."""
    B, H, seq_len, D = q_tiled.shape
    Nk, V = key_valid.shape
    Nt = seq_len // V
    K, Dv = kv_indices.shape[-1], v_tiled.shape[-1]
    if k_extra is not None and k_extra.shape[2] == 0:
        k_extra = v_extra = None
    N = 0 if k_extra is None else k_extra.shape[2]
    if K == 0 and N == 0:
        return q_tiled.new_zeros(B, H, seq_len, Dv)
    counts = kv_counts.long().expand(B, H, Nt)  # [B, H, Nt]
    # Entries past a row's count are never read, so they may hold anything (-1 sentinels):
    # point them at tile 0 so the gather stays in range; the key mask drops them.
    listed = torch.arange(K, device=kv_indices.device) < counts.unsqueeze(-1)  # [B, H, Nt, K]
    indices = torch.where(listed, kv_indices.long(), 0)  # [B, H, Nt, K]
    q5 = q_tiled.reshape(B, H, Nt, V, D)
    k5 = k_tiled.reshape(B, H, Nk, V, D)
    v5 = v_tiled.reshape(B, H, Nk, V, Dv)

    chunk = _fine_chunk_tiles(B, H, K, V, max(D, Dv), N)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q_tiled, k_tiled, v_tiled, k_extra, v_extra)
    )
    outputs = []
    for start in range(0, Nt, chunk):
        stop = min(start + chunk, Nt)
        args = (q5[:, :, start:stop], k5, v5, indices[:, :, start:stop], counts[:, :, start:stop])
        if needs_grad and chunk < Nt:
            # Recompute each chunk in backward: otherwise autograd keeps every chunk's gathered
            # keys alive, which adds up to topk/num_tiles of a dense attention's memory.
            out = checkpoint(
                _fine_chunk, *args, key_valid, scale, k_extra, v_extra, use_reentrant=False
            )
        else:
            out = _fine_chunk(*args, key_valid, scale, k_extra, v_extra)
        outputs.append(out)
    return torch.cat(outputs, dim=2).view(B, H, seq_len, Dv)  # [B, H, P, Dv]


def _fine_chunk_tiles(B: int, H: int, K: int, V: int, D: int, N: int = 0) -> int:
    """Query tiles per chunk so that gathered K, V and the scores fit the element budget."""
    per_query_tile = B * H * (K * V + N) * (2 * D + V)
    return max(1, _FINE_CHUNK_ELEMENTS // per_query_tile)


def _fine_chunk(
    q_chunk: torch.Tensor,  # [B, H, C, V, D]
    k5: torch.Tensor,  # [B, H, Nt, V, D]
    v5: torch.Tensor,  # [B, H, Nt, V, Dv]
    indices: torch.Tensor,  # [B, H, C, K] int64
    counts: torch.Tensor,  # [B, H, C] int64
    key_valid: torch.Tensor,  # [Nt, V] bool
    scale: float,
    k_extra: torch.Tensor | None = None,  # [B, H, N, D]: keys every query attends (N > 0)
    v_extra: torch.Tensor | None = None,  # [B, H, N, Dv]
) -> torch.Tensor:
    B, H, C, V, D = q_chunk.shape
    K = indices.shape[-1]
    k_sel = _gather_tiles(k5, indices).view(B, H, C, K * V, D)  # [B, H, C, K*V, D]
    v_sel = _gather_tiles(v5, indices).view(B, H, C, K * V, -1)  # [B, H, C, K*V, Dv]

    # A key counts if it is a real token of one of the first `counts` listed tiles.
    listed = torch.arange(K, device=indices.device) < counts.unsqueeze(-1)  # [B, H, C, K]
    keep = key_valid[indices] & listed.unsqueeze(-1)  # [B, H, C, K, V]
    # A query tile listing no key tile would softmax a row of -inf (NaN); let it see every
    # gathered key instead and zero its output afterwards, which also zeroes its gradients.
    attends = listed[..., :1]  # [B, H, C, 1]: listed tiles are a prefix, so check the first
    keep = (keep | ~attends.unsqueeze(-1)).view(B, H, C, 1, K * V)
    if k_extra is not None:  # the extra keys join every query tile's keys, always kept
        N = k_extra.shape[2]
        k_sel = torch.cat([k_sel, k_extra.unsqueeze(2).expand(B, H, C, N, D)], dim=3)
        v_sel = torch.cat([v_sel, v_extra.unsqueeze(2).expand(B, H, C, N, -1)], dim=3)
        keep = torch.cat([keep & attends.view(B, H, C, 1, 1), keep.new_ones(B, H, C, 1, N)], -1)
        attends = torch.ones_like(attends)  # every query sees at least the extra keys

    # Scale q (C*V*D elements) rather than the scores (C*V*K*V elements).
    scores = torch.matmul(q_chunk * scale, k_sel.transpose(-1, -2))  # [B, H, C, V, K*V]
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    out = torch.matmul(probs, v_sel)  # [B, H, C, V, Dv]
    return out * attends.unsqueeze(-1).to(out.dtype)


@torch.no_grad()
def select_topk_segments(scores: torch.Tensor, q_info: torch.Tensor, max_topk: int):
    """:func:`select_topk` where each query tile chooses among its own key range and keeps its
    own count: ``scores [B, H, Nq, Nk]``, ``q_info`` int32 ``[4, Nq]`` (``segments.py``: rows
    1-3 are the first and last+1 key tile and the topk of each query tile). Returns
    ``kv_indices [B, H, Nq, max_topk]`` (ascending; entries past a row's count are 0) and
    ``kv_counts [B, H, Nq]``."""
    B, H, nq, nk = scores.shape
    first, stop, keep = (row.long() for row in q_info[1:4])
    allowed = _key_range_mask(first, stop, nk)  # [Nq, Nk]
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :max_topk]
    listed = torch.arange(max_topk, device=scores.device) < keep.unsqueeze(-1)  # [Nq, K]
    chosen = torch.where(listed, order, nk).sort(dim=-1).values  # unlisted entries last
    kv_indices = torch.where(listed, chosen, 0).to(torch.int32)
    kv_counts = keep.to(torch.int32).expand(B, H, nq).contiguous()
    return kv_indices, kv_counts


def _key_range_mask(first: torch.Tensor, stop: torch.Tensor, num_keys: int) -> torch.Tensor:
    keys = torch.arange(num_keys, device=first.device)
    return (keys >= first.unsqueeze(-1)) & (keys < stop.unsqueeze(-1))


def vsa_segments_ref(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    q_info: torch.Tensor,
    k_sizes: torch.Tensor,
    scale: float,
    gate_t: torch.Tensor | None = None,
    k_extra: torch.Tensor | None = None,
    v_extra: torch.Tensor | None = None,
    return_parts: bool = False,
    max_topk: int | None = None,
):
    """VSA over tiles of ``V`` slots whose queries and keys differ (packed batches, key grids
    of their own, block-causal slabs, competing prefix blocks; ``segments.py``).

    ``q_t [B, H, Nq*V, D]`` and ``k_t, v_t [B, H, Nk*V, D]`` in tile order (compute dtype),
    ``q_info`` int32 ``[4, Nq]`` (real tokens, key range and topk per query tile), ``k_sizes``
    int32 ``[Nk]``; ``gate_t`` like ``q_t`` or 0 (:func:`is_fine_only`); ``k_extra, v_extra
    [B, H, N, D]`` exempt keys every query attends (text). Coarse attention and selection run
    within each query tile's key range. ``max_topk``: the largest topk of ``q_info`` if the
    caller knows it (saves reading it back). Returns ``o_t`` like ``q_t`` (padding rows 0),
    or ``(o_t, parts)``.
    """
    nq, nk = q_info.shape[1], k_sizes.shape[0]
    V = q_t.shape[2] // nq
    qc = tile_means_of_sizes(q_t, q_info[0])
    kc, vc = (tile_means_of_sizes(x, k_sizes) for x in (k_t, v_t))
    allowed = _key_range_mask(q_info[1].long(), q_info[2].long(), nk)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # [B, H, Nq, Nk]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    o_coarse = torch.matmul(probs, vc)  # [B, H, Nq, D]
    max_topk = int(q_info[3].max()) if max_topk is None else max_topk
    kv_indices, kv_counts = select_topk_segments(scores, q_info, max_topk)
    key_valid = torch.arange(V, device=q_t.device) < k_sizes.view(-1, 1)  # [Nk, V]
    o_fine = fine_attention_tiles(
        q_t, k_t, v_t, kv_indices, kv_counts, key_valid, scale, k_extra, v_extra
    )
    B, H, _, Dv = o_fine.shape
    o5 = o_fine.view(B, H, nq, V, Dv)
    if not is_fine_only(gate_t):
        coarse = o_coarse.unsqueeze(-2)  # [B, H, Nq, 1, Dv]
        if gate_t is not None:
            coarse = gate_t.reshape(B, H, nq, V, Dv) * coarse
        o5 = o5 + coarse
    real = torch.arange(V, device=q_t.device) < q_info[0].view(-1, 1)  # [Nq, V]
    o_t = o5.masked_fill(~real.view(nq, V, 1), 0).reshape(B, H, nq * V, Dv)
    if not return_parts:
        return o_t
    parts = {"kv_indices": kv_indices, "kv_counts": kv_counts, "coarse_scores": scores}
    return o_t, parts


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Plain attention ``softmax(q k^T * scale) v`` over every key, chunked over query rows so
    no score block exceeds the element budget (checkpointed per chunk under autograd).

    ``q`` ``[B, H, Sq, D]``, ``k`` / ``v`` ``[B, H, Skv, D]``, all real tokens. VSA's text
    queries attend densely this way (``Sq = N`` is small, ``Skv`` is the whole sequence).
    """
    B, H, Sq, _ = q.shape
    Skv = k.shape[2]
    rows = max(1, _FINE_CHUNK_ELEMENTS // max(1, B * H * Skv))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outputs = []
    for start in range(0, Sq, rows):
        q_chunk = q[:, :, start : start + rows]
        if needs_grad and rows < Sq:
            outputs.append(checkpoint(_dense_chunk, q_chunk, k, v, scale, use_reentrant=False))
        else:
            outputs.append(_dense_chunk(q_chunk, k, v, scale))
    return torch.cat(outputs, dim=2)


def _dense_chunk(q, k, v, scale: float) -> torch.Tensor:
    scores = torch.matmul(q * scale, k.transpose(-1, -2))  # [B, H, rows, Skv]
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _gather_tiles(x5: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x5[b, h, indices[b, h, c, j]]``: ``[B, H, Nt, V, D]`` -> ``[B, H, C*K, V, D]``."""
    B, H, Nt, V, D = x5.shape
    # index_select of whole tiles (rows of V*D) from a [B*H*Nt, V*D] view copies contiguous
    # rows; torch.gather with a broadcast index would look up every element on its own.
    head_offset = torch.arange(B * H, device=indices.device).view(B, H, 1, 1) * Nt
    rows = (indices + head_offset).reshape(-1)  # [B*H*C*K]
    return x5.reshape(B * H * Nt, V * D).index_select(0, rows).view(B, H, -1, V, D)


def video_sparse_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    *,
    topk: int | None = None,
    sparsity: float | None = None,
    gate: torch.Tensor | None = None,
    tiled: bool = False,
    scale: float | None = None,
    text_tokens: int = 0,
    return_parts: bool = False,
):
    """Reference VSA: ``o = o_fine + gate * o_coarse`` (see the module docstring).

    Args:
        q, k, v: ``[B, H, S, D]``. ``S == grid.num_tokens + text_tokens`` in natural order, or
            ``S == grid.padded_len + text_tokens`` with ``tiled=True`` (video in tile order;
            padding slots ignored), the text tokens last.
        grid: the :class:`VideoGrid` the sequence lives on.
        topk / sparsity: exactly one; see :func:`resolve_topk`.
        gate: optional tensor shaped like ``q`` (same layout) weighting the coarse output of
            the video rows; its text rows are ignored. ``0``: the fine stage alone.
        tiled: the video part of inputs and output is in tile order; padding rows of the output
            are zero.
        scale: softmax scale, ``1/sqrt(D)`` by default (both stages).
        text_tokens: ``N`` non-video tokens after the video tokens. Video queries attend to
            their top-k tiles and all text keys (one softmax); text queries attend densely to
            every real token; coarse stage and selection use video tokens only.
        return_parts: also return a dict with ``o_fine``, ``o_coarse`` (per token, ungated,
            in the output's layout; text rows: ``o_fine`` holds their dense attention and
            ``o_coarse`` zeros), ``o_coarse_tiles`` ``[B, H, Nt, D]``, ``coarse_scores``
            ``[B, H, Nt, Nt]``, ``kv_indices``, ``kv_counts`` (video tiles only) and ``topk``.

    Returns:
        ``o`` in ``q.dtype`` and ``q``'s layout, or ``(o, parts)`` with ``return_parts``.
    """
    check_count("text_tokens", text_tokens)
    _check_shapes(q, k, v, gate, grid, tiled, text_tokens)
    B, H, _, D = q.shape
    Nt, V = grid.num_tiles, grid.tile_volume
    topk = resolve_topk(Nt, topk, sparsity)
    scale = D**-0.5 if scale is None else float(scale)
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    video_len = grid.padded_len if tiled else grid.num_tokens

    def to_compute_tiles(x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :video_len].to(compute_dtype)
        return x if tiled else grid.tile(x, dim=-2)  # [B, H, P, D]

    q_t, k_t, v_t = to_compute_tiles(q), to_compute_tiles(k), to_compute_tiles(v)
    k_x, v_x = (x[:, :, video_len:].to(compute_dtype) for x in (k, v))  # [B, H, N, D]

    qc, kc, vc = tile_means(q_t, grid), tile_means(k_t, grid), tile_means(v_t, grid)
    o_coarse_tiles, coarse_scores = coarse_attention(qc, kc, vc, scale)  # [B, H, Nt, Dv]
    kv_indices, kv_counts = select_topk(coarse_scores.detach(), topk)

    o_fine = fine_attention(
        q_t, k_t, v_t, kv_indices, kv_counts, grid, scale, k_extra=k_x, v_extra=v_x
    )  # [B, H, P, Dv]
    Dv = o_fine.shape[-1]
    o_fine5 = o_fine.view(B, H, Nt, V, Dv)
    o_coarse5 = o_coarse_tiles.unsqueeze(-2)  # [B, H, Nt, 1, Dv]: broadcast, not materialised
    if is_fine_only(gate):
        o5 = o_fine5
    elif gate is None:
        o5 = o_fine5 + o_coarse5
    else:
        gate5 = to_compute_tiles(gate).reshape(B, H, Nt, V, Dv)
        o5 = o_fine5 + gate5 * o_coarse5

    o_text = None
    if text_tokens:
        # Text queries: dense over every real key, the video keys in natural order (no padding).
        q_x = q[:, :, video_len:].to(compute_dtype)
        k_all = torch.cat([grid.untile(k_t, dim=-2), k_x], dim=-2)  # [B, H, S_video + N, D]
        v_all = torch.cat([grid.untile(v_t, dim=-2), v_x], dim=-2)
        o_text = dense_attention(q_x, k_all, v_all, scale)  # [B, H, N, Dv]

    padding_rows = ~grid.real_token_mask(q.device).view(Nt, V, 1)
    o = _to_output_layout(o5.masked_fill(padding_rows, 0), grid, tiled, q.dtype, o_text)
    if not return_parts:
        return o

    o_coarse = o_coarse5.expand(B, H, Nt, V, Dv).masked_fill(padding_rows, 0)
    parts = {
        "o_fine": _to_output_layout(
            o_fine5.masked_fill(padding_rows, 0), grid, tiled, q.dtype, o_text
        ),
        "o_coarse": _to_output_layout(
            o_coarse,
            grid,
            tiled,
            q.dtype,
            None if o_text is None else torch.zeros_like(o_text),
        ),
        "o_coarse_tiles": o_coarse_tiles.to(q.dtype),
        "coarse_scores": coarse_scores.detach(),
        "kv_indices": kv_indices,
        "kv_counts": kv_counts,
        "topk": topk,
    }
    return o, parts


def _to_output_layout(
    x5: torch.Tensor,
    grid: VideoGrid,
    tiled: bool,
    dtype: torch.dtype,
    text: torch.Tensor | None = None,
) -> torch.Tensor:
    B, H, Nt, V, D = x5.shape
    x = x5.reshape(B, H, Nt * V, D)  # [B, H, P, D]
    if not tiled:
        x = grid.untile(x, dim=-2)  # [B, H, S, D]
    if text is not None:
        x = torch.cat([x, text], dim=-2)  # the text rows after the video rows
    return x.to(dtype)


def _check_shapes(q, k, v, gate, grid: VideoGrid, tiled: bool, text_tokens: int = 0) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require(
            isinstance(x, torch.Tensor) and x.ndim == 4,
            f"{name} must be a 4-D tensor [B, H, S, D], got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}",
        )
    _require(isinstance(grid, VideoGrid), f"grid must be a VideoGrid, got {type(grid).__name__}")
    expected_s = (grid.padded_len if tiled else grid.num_tokens) + text_tokens
    what = "padded_len" if tiled else "num_tokens"
    _require(
        q.shape[2] == expected_s,
        f"q must have S == grid.{what} + text_tokens = {expected_s} (tiled={tiled}, "
        f"text_tokens={text_tokens}), got {tuple(q.shape)}",
    )
    _require(k.shape == q.shape, f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    _require(
        v.shape[:3] == q.shape[:3],
        f"v must be [{q.shape[0]}, {q.shape[1]}, {q.shape[2]}, Dv], got {tuple(v.shape)}",
    )
    check_number_gate(gate)
    if gate is not None and not is_fine_only(gate):
        _require(
            isinstance(gate, torch.Tensor) and tuple(gate.shape) == tuple(v.shape),
            f"gate must be shaped like the output {tuple(v.shape)}, got "
            f"{tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate).__name__}",
        )


def _require(condition: bool, message: str) -> None:
    # A real exception, not `assert`, so the check survives `python -O`.
    if not condition:
        raise ValueError(message)
