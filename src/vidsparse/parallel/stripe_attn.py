"""Ulysses over PSA (stripe attention): :func:`ulysses_stripe_attn`."""

from __future__ import annotations

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import StripeSpec
from vidsparse.parallel.driver import TiledExchange, check_head_chunks, run
from vidsparse.parallel.shards import check_grid_length, resolve_context, validate_shards

# The spec of a zero padding head (pad_heads=True): each query block attends its own block
# alone, the fewest blocks a valid spec visits (the padded heads' outputs are dropped).
PAD_SPEC = StripeSpec(t_width=1, t_offset=0, t_stride=None, s_width=1, s_offset=0, s_stride=None)


def _slice_specs(specs, H: int, heads: slice) -> tuple:
    """The specs of global ``heads``, past ``H`` (padding heads) ``PAD_SPEC``."""
    try:
        specs = tuple(specs)
    except TypeError:
        raise TypeError(
            f"specs must be a sequence of StripeSpec (one per head), got {type(specs).__name__}"
        ) from None
    if len(specs) != H:
        raise ValueError(f"specs must hold one StripeSpec per head (H={H}), got {len(specs)}")
    return (specs + (PAD_SPEC,) * max(0, heads.stop - H))[heads]


def _check_stripe_length(grid, stripe_kwargs: dict, S_local: int, world: int) -> None:
    """``check_grid_length`` with stripe_attn's ``tiled`` and ``text_tokens`` options."""
    tiled = stripe_kwargs.get("tiled", False)
    text = stripe_kwargs.get("text_tokens", 0)
    if isinstance(grid, VideoGrid) and (
        not isinstance(tiled, bool) or isinstance(text, bool) or not isinstance(text, int)
    ):
        return  # malformed: stripe_attn names the problem (same on every rank)
    check_grid_length(grid, tiled, S_local, world, text_tokens=text)


def ulysses_stripe_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    specs,
    *,
    group=None,
    layout: str = "bshd",
    check_shards: bool = False,
    head_chunks: int = 1,
    pad_heads: bool = False,
    **stripe_kwargs,
) -> torch.Tensor:
    """:func:`vidsparse.stripe_attn` (PSA) over a sequence-sharded input.

    ``specs``: one :class:`StripeSpec` per head of the full model (``H`` of them); each rank
    uses its ``H/P``. ``stripe_kwargs`` (``spatial_unit``, ``tiled``, ``sink_frames``,
    ``text_tokens``, ``scale``, ``return_lse``) pass through; they describe the full sequence,
    ``(grid.padded_len if tiled else grid.num_tokens) + text_tokens`` long, split evenly.
    ``head_chunks``: pipelined exchange for inference (see :func:`ulysses_attention`).
    ``pad_heads``: pad ``H`` with zero heads to a multiple of the world size (see
    :func:`ulysses_attention`); they get ``PAD_SPEC``.
    """
    ctx = resolve_context(group, layout)
    _, S_local, H, _ = validate_shards(ctx, pad_heads, q=q, k=k, v=v)
    check_head_chunks(head_chunks, ctx.padded_heads(H), ctx.world_size)
    _check_stripe_length(grid, stripe_kwargs, S_local, ctx.world_size)
    _slice_specs(specs, H, ctx.head_slice(H))  # wrong count: raise before exchanging
    try:
        from vidsparse.ops.stripe_attn import stripe_attn
    except ImportError as exc:
        raise ImportError(f"vidsparse.ops.stripe_attn is not available: {exc}") from exc

    def attn_fn(heads, q_h, k_h, v_h):
        return stripe_attn(q_h, k_h, v_h, grid, _slice_specs(specs, H, heads), **stripe_kwargs)

    def tiled_attn_fn(heads, q_t, k_t, v_t):
        kwargs = {**stripe_kwargs, "tiled": True}
        return stripe_attn(q_t, k_t, v_t, grid, _slice_specs(specs, H, heads), **kwargs)

    # Natural order, video only, o only: in inference the exchange tiles and untiles on the way.
    plain = not any(stripe_kwargs.get(key) for key in ("tiled", "text_tokens", "return_lse"))
    exchange = TiledExchange(grid, tiled_attn_fn) if plain else None
    return run(ctx, attn_fn, {"q": q, "k": k, "v": v}, check_shards, head_chunks, exchange)
