"""Pictures of PSA plans: chosen stripe masks, and dense attention beside them.

- ``plot_plan_masks(plan, "masks.png")``: the block masks a plan chose, for a few heads of a
  few layers at one step.
- ``plot_attention_vs_mask(q, k, grid, specs, "attn.png")``: for a few heads, the dense
  block-level attention map next to the head's stripe mask, with the share of attention mass
  the mask keeps.
- ``block_attention_map(q, k, grid, heads)``: that map as a tensor, ``[len(heads), N, N]``:
  the mean attention probability of each (query block, key block) pair.

matplotlib is a dependency, imported lazily inside the plotting functions (cheap imports);
where it is missing they raise ``PlotsUnavailable``, so importing this module never fails.
Figures are drawn with the object-oriented API (no pyplot, no global backend switch) and
written atomically.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import StripeSpec, stripe_block_mask, stripe_sparsity

__all__ = [
    "PlotsUnavailable",
    "block_attention_map",
    "plot_plan_masks",
    "plot_attention_vs_mask",
]

# Query rows per head for the dense map: beyond this, each query block is represented by an
# evenly spaced subset of its tokens (exact softmax rows), which keeps the CPU cost at
# ``rows * S * D`` instead of ``S * S * D`` on full-size grids.
DEFAULT_MAX_QUERY_ROWS = 4096
_CHUNK_ELEMENTS = 1 << 24  # scores per chunk (64 MiB in fp32): never an S x S tensor
_MAX_PLAN_LAYERS = 6  # rows of a plan figure when no layers are given


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


def _figure_class():
    # Imported lazily: matplotlib is an optional dependency.
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsUnavailable(
            "matplotlib is not installed, so no PNG was drawn (pip install matplotlib)"
        ) from None
    return Figure


def save_png(fig, out_png: str | os.PathLike, dpi: int = 100) -> str:
    from vidsparse.utils.files import atomic_write  # a PNG is never left half-written

    path = os.fspath(out_png)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
    return path


# ---------------------------------------------------------------------------------------------
# dense block-level attention
# ---------------------------------------------------------------------------------------------


def _first_batch(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.ndim == 4:
        x = x[0]  # pictures show one prompt
    if x.ndim != 3:
        raise ValueError(f"{name} must be [H, S, D] or [B, H, S, D], got shape {tuple(x.shape)}")
    return x


def _query_rows(grid: VideoGrid, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile-order query slots ``[N, m]`` and their weights ``[N, m]`` (sum 1 per block).

    All slots (padding weighted 0) when they fit ``max_rows``: the map is then exact.
    Otherwise ``m`` evenly spaced real tokens of each block, equally weighted.
    """
    n, v = grid.num_tiles, grid.tile_volume
    valid = grid.real_token_mask("cpu").view(n, v)
    if n * v <= max_rows:
        slots = torch.arange(n * v).view(n, v)
        weights = valid.float()
    else:
        m = max(1, max_rows // n)
        counts = valid.sum(1, keepdim=True)  # >= 1: every tile holds a real token
        # Real slots first within each tile (stable), then pick ranks spread over the count.
        real_first = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
        ranks = torch.arange(m).view(1, m) * counts // m
        slots = real_first.gather(1, ranks) + torch.arange(n).view(n, 1) * v
        weights = torch.ones(n, m)
    return slots, weights / weights.sum(1, keepdim=True)


def block_attention_map(
    q: torch.Tensor,
    k: torch.Tensor,
    grid: VideoGrid,
    heads: Sequence[int],
    *,
    tiled: bool = False,
    max_query_rows: int = DEFAULT_MAX_QUERY_ROWS,
) -> torch.Tensor:
    """Mean attention probability per (query block, key block): float32 ``[len(heads), N, N]``.

    ``q``, ``k``: ``[H, S, D]`` or ``[B, H, S, D]`` (batch 0 is used), natural order or tiled;
    blocks are ``grid``'s tiles. ``map[h, i, j]`` is the softmax probability from a query of
    block ``i`` to a key of block ``j``, averaged over the real tokens of both (so each row,
    weighted by the key counts, sums to 1). Scores go through softmax in chunks of query
    rows, never as an S x S tensor. Exact when ``num_tiles * tile_volume <= max_query_rows``;
    above that, each query block averages an evenly spaced subset of its tokens.
    """
    q, k = _first_batch(q, "q"), _first_batch(k, "k")
    if not tiled:
        q, k = grid.tile(q, dim=-2), grid.tile(k, dim=-2)
    heads = [int(h) for h in heads]
    if any(not 0 <= h < q.shape[0] for h in heads):
        raise ValueError(f"heads {heads} out of range for {q.shape[0]} heads")
    n, v = grid.num_tiles, grid.tile_volume
    key_valid = grid.real_token_mask(q.device)
    key_counts = grid.tile_sizes_on(q.device).float()
    slots, weights = _query_rows(grid, max_query_rows)
    slots, weights = slots.to(q.device), weights.to(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    chunk = max(1, _CHUNK_ELEMENTS // max(1, k.shape[-2]))
    maps = []
    for h in heads:
        qh = q[h].float()[slots.flatten()]  # [N*m, D]
        kh = k[h].float()
        rows = []
        for start in range(0, qh.shape[0], chunk):
            scores = (qh[start : start + chunk] @ kh.T) * scale
            probs = torch.softmax(scores.masked_fill(~key_valid, float("-inf")), dim=-1)
            rows.append(probs.view(-1, n, v).sum(-1) / key_counts)  # mean over the key block
        per_row = torch.cat(rows).view(n, -1, n)  # [N(q), m, N(k)]
        maps.append((per_row * weights.unsqueeze(-1)).sum(1))
    return torch.stack(maps).cpu()


def _mass_kept(attn: torch.Tensor, mask: torch.Tensor, grid: VideoGrid) -> float:
    """Share of the attention mass that falls inside ``mask`` (``[N, N]`` each)."""
    sizes = grid.tile_sizes.float()
    mass = attn * sizes.view(1, -1)  # per query: probability mass on each key block
    kept = (mass * mask.float()).sum(1)  # per query block
    return float((kept * sizes).sum() / sizes.sum())


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------


# How a StripeSpec reads in the figures' labels (str(StripeSpec)); the demo logs it too.
SPEC_NOTATION = (
    "t(w,o,s): stripes along time, w block-frames wide, offset o, period s (inf: one stripe);"
    " s(w,o,s): the same over the flattened spatial block index h*Wb+w"
)


def _integer_ticks(ax) -> None:
    """Block indices are whole numbers: no 2.5 on the axes of a small grid."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_mask(ax, mask: torch.Tensor, title: str) -> None:
    ax.imshow(mask.float().numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title, fontsize=7)
    ax.set_xlabel("key block", fontsize=7)
    ax.set_ylabel("query block", fontsize=7)
    ax.tick_params(labelsize=6)
    _integer_ticks(ax)


def _draw_attention(ax, attn: torch.Tensor, title: str):
    # Log scale: attention is heavy-tailed, and the stripes live in the small values too.
    floor = max(float(attn[attn > 0].min()), 1e-12) if bool((attn > 0).any()) else 1e-12
    image = ax.imshow(
        attn.clamp_min(floor).log10().numpy(), cmap="viridis", interpolation="nearest"
    )
    ax.set_title(title, fontsize=7)
    ax.set_xlabel("key block", fontsize=7)
    ax.set_ylabel("query block", fontsize=7)
    ax.tick_params(labelsize=6)
    _integer_ticks(ax)
    return image


def _spec_label(spec: StripeSpec, sparsity: float) -> str:
    return f"{spec}\nsparsity {sparsity:.2f}"


def plot_attention_vs_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    grid: VideoGrid,
    specs: Sequence[StripeSpec],
    out_png: str | os.PathLike,
    heads: Sequence[int] = (0, 1, 2, 3),
    *,
    spatial_unit: str = "block",
    tiled: bool = False,
    title: str | None = None,
    max_query_rows: int = DEFAULT_MAX_QUERY_ROWS,
) -> str:
    """For each head of ``heads`` (those beyond the head count are dropped), the dense
    block-level attention map (log10 of the mean probability per block pair, see
    ``block_attention_map``) beside its stripe mask from ``specs`` (one spec per head), with
    the share of attention mass the mask keeps. Returns the PNG's path.
    """
    Figure = _figure_class()
    num_heads = _first_batch(q, "q").shape[0]
    if len(specs) != num_heads:
        raise ValueError(f"expected one spec per head ({num_heads}), got {len(specs)}")
    heads = [int(h) for h in heads if 0 <= int(h) < num_heads]
    if not heads:
        raise ValueError(f"no head of {num_heads} selected to draw")
    attn = block_attention_map(q, k, grid, heads, tiled=tiled, max_query_rows=max_query_rows)
    masks = stripe_block_mask([specs[h] for h in heads], grid.tiles, spatial_unit).cpu()
    fig = Figure(figsize=(6.4, 3.0 * len(heads)), layout="constrained")
    axes = fig.subplots(len(heads), 2, squeeze=False)
    sparsities = stripe_sparsity(masks).tolist()
    for row, h in enumerate(heads):
        kept = _mass_kept(attn[row], masks[row], grid)
        image = _draw_attention(axes[row][0], attn[row], f"head {h}: dense attention (log10)")
        fig.colorbar(image, ax=axes[row][0], shrink=0.8)
        label = f"head {h}: {_spec_label(specs[h], sparsities[row])}, mass kept {kept:.2f}"
        _draw_mask(axes[row][1], masks[row], label)
    fig.suptitle(
        (title or f"dense attention vs stripe mask, blocks {grid.tiles}")
        + " (black: attended)"
        + "\n"
        + _wrapped(SPEC_NOTATION),
        fontsize=8,
    )
    return save_png(fig, out_png)


def _wrapped(text: str, width: int = 90) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, max(width, 60)))


def _plan_step(plan, step: int | None) -> int:
    # Default: the first searched step; a fully dense plan has none, so its first step.
    if step is not None:
        return step
    return plan.dense_steps if plan.dense_steps < plan.num_steps else 0


def plot_plan_masks(
    plan,
    out_png: str | os.PathLike,
    *,
    step: int | None = None,
    layers: Sequence[int] | None = None,
    heads: int = 4,
) -> str:
    """The block masks a plan chose at ``step`` (default: the first searched step): one row
    per layer (default: the plan's first few layers), one column per head for the first
    ``heads`` heads, each titled with its spec and sparsity. Returns the PNG's path."""
    Figure = _figure_class()
    step = _plan_step(plan, step)
    layers = list(plan.layers[:_MAX_PLAN_LAYERS] if layers is None else layers)
    if not layers:
        raise ValueError("the plan has no layers to draw")
    cols = max(1, min(int(heads), plan.num_heads))
    fig = Figure(figsize=(2.6 * cols, 2.8 * len(layers)), layout="constrained")
    axes = fig.subplots(len(layers), cols, squeeze=False)
    for row, layer in enumerate(layers):
        specs = plan.specs_for(step, layer)[:cols]
        masks = stripe_block_mask(specs, plan.grid.tiles, "block").cpu()
        sparsities = stripe_sparsity(masks).tolist()
        for h in range(cols):
            label = f"layer {layer} head {h}\n{_spec_label(specs[h], sparsities[h])}"
            _draw_mask(axes[row][h], masks[h], label)
    fig.suptitle(
        f"PSA plan {plan.model or '(unnamed model)'}: step {step}, blocks {plan.grid.tiles}"
        " (black: attended)\n" + _wrapped(SPEC_NOTATION, 40 * cols),
        fontsize=8,
    )
    return save_png(fig, out_png)
