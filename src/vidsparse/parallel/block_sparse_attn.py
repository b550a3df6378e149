"""Ulysses over the block-sparse engine: :func:`ulysses_block_sparse_attn`."""

from __future__ import annotations

import torch

from vidsparse.parallel.driver import check_head_chunks, run
from vidsparse.parallel.shards import resolve_context, validate_shards
from vidsparse.utils.tensor_cache import TensorCache

# The rank's slice of a block-list tensor, reused across calls: the engine validates list
# values once per tensor object (reading them back costs a GPU sync), which a fresh slice every
# call would defeat. Per source tensor and version (TensorCache): never stale.
_list_slices = TensorCache(capacity=64)


def _head_slice(src: torch.Tensor, heads: slice) -> torch.Tensor:
    return _list_slices.get(
        "heads", (src,), (heads.start, heads.stop), lambda: src[:, heads].contiguous()
    )


def _pad_lists(src: torch.Tensor, heads: int) -> torch.Tensor:
    """``src`` (``kv_indices`` or ``kv_counts``) with the lists of zero padding heads appended
    up to ``heads`` (``pad_heads=True``): all-zero entries, so counts of 0, empty rows the
    engine skips. Cached like the slices, so the slices of the padded tensor are too."""
    extra = heads - src.shape[1]
    if extra == 0:
        return src
    make = lambda: torch.cat([src, src.new_zeros((src.shape[0], extra, *src.shape[2:]))], 1)
    return _list_slices.get("padded", (src,), (heads,), make)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _block_q(block_size) -> int | None:
    if _is_int(block_size):
        blocks = (block_size,)
    elif isinstance(block_size, (tuple, list)) and len(block_size) == 2:
        blocks = tuple(block_size)
    else:
        return None  # malformed: the engine names the problem (after the exchange, on every rank)
    for b in blocks:
        if _is_int(b) and b <= 0:  # the engine's message, before the checks below divide by it
            raise ValueError(f"block_size must be positive, got {b}")
    return blocks[0] if _is_int(blocks[0]) else None


def _check_block_lists(kv_indices, kv_counts, H: int, S: int, block_q: int | None) -> None:
    for name, x, ndim in (("kv_indices", kv_indices, 4), ("kv_counts", kv_counts, 3)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got {tuple(x.shape)}")
        if x.shape[1] != H:
            raise ValueError(
                f"{name} must hold the lists of all H={H} heads (dim 1; each rank slices its "
                f"own), got shape {tuple(x.shape)}"
            )
    if block_q is None:
        return
    if S % block_q:
        raise ValueError(
            f"the full sequence length S={S} (local shard x world size) is not a multiple of "
            f"block_q={block_q}"
        )
    if kv_indices.shape[2] != S // block_q or kv_counts.shape[2] != S // block_q:
        raise ValueError(
            f"block lists must have S // block_q = {S // block_q} query-block rows for the full "
            f"sequence S={S}, got kv_indices {tuple(kv_indices.shape)}, "
            f"kv_counts {tuple(kv_counts.shape)}"
        )


def ulysses_block_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    group=None,
    layout: str = "bshd",
    check_shards: bool = False,
    head_chunks: int = 1,
    pad_heads: bool = False,
    **engine_kwargs,
):
    """:func:`vidsparse.block_sparse_attn` over a sequence-sharded input.

    Args:
        q, k, v: sequence shards ``[B, S/P, H, D]`` (or ``[B, H, S/P, D]`` with
            ``layout="bhsd"``); self-attention, so ``Sq == Skv == S``.
        kv_indices, kv_counts: the block lists of the *full* sequence and *all* heads,
            ``[B or 1, H, S // block_q, K]`` and ``[B or 1, H, S // block_q]``; each rank uses
            its ``H/P`` heads (the batch dim is kept).
        engine_kwargs: ``block_size``, ``kv_block_sizes`` (full sequence), ``scale``,
            ``return_lse``, ``validate``, ``deterministic`` as for the engine; ``lse`` comes
            back ``[B, S/P, H]`` (bshd) or ``[B, H, S/P]`` (bhsd).
        head_chunks: pipelined exchange for inference (see :func:`ulysses_attention`).
        pad_heads: pad ``H`` with zero heads to a multiple of the world size (see
            :func:`ulysses_attention`); their lists are empty rows.
    """
    from vidsparse.ops.block_sparse_attn import block_sparse_attn

    ctx = resolve_context(group, layout)
    _, S_local, H, _ = validate_shards(ctx, pad_heads, q=q, k=k, v=v)
    padded = ctx.padded_heads(H)
    check_head_chunks(head_chunks, padded, ctx.world_size)
    block_q = _block_q(engine_kwargs.get("block_size", 64))
    _check_block_lists(kv_indices, kv_counts, H, S_local * ctx.world_size, block_q)
    if engine_kwargs.get("validate") is True:  # the lists may have changed behind the cache
        _list_slices.discard((kv_indices, kv_counts))

    def attn_fn(heads, q_h, k_h, v_h):
        idx, cnt = (_head_slice(_pad_lists(x, padded), heads) for x in (kv_indices, kv_counts))
        return block_sparse_attn(q_h, k_h, v_h, idx, cnt, **engine_kwargs)

    return run(ctx, attn_fn, {"q": q, "k": k, "v": v}, check_shards, head_chunks)
