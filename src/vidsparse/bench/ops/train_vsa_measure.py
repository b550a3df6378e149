"""What the VSA training experiment (``train_vsa``) measures and draws: the q/k/v of each
video self-attention call, the dense attention mass VSA's selection keeps, VSA's output error
against dense attention on the same q/k/v, generated frames and the curves of every arm."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vidsparse.layout import VideoGrid
from vidsparse.ops.video_sparse_attn import block_mean, topk_lists, video_sparse_attn
from vidsparse.ops.video_sparse_attn.topk import resolve_topk

# ------------------------------------------------------------------------------ attention


@dataclass
class Captured:
    """One video self-attention call: q/k/v ``[B, H, S, D]``, VSA's output (None when the
    model runs dense), the latent grid shape and the softmax scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None
    shape: tuple[int, int, int]
    scale: float | None


@contextlib.contextmanager
def captured_attention(model):
    """``{layer: Captured}`` of the next forward of ``model``: the calls the diffusers
    integration routes (a model that is not patched is patched with ``"dense"``, which is
    bit-identical to the stock model, for the duration)."""
    from vidsparse.integrations.diffusers import apply_sparse_attention, remove_sparse_attention
    from vidsparse.integrations.diffusers.state import STATE_ATTR, state_of

    temporary = getattr(model, STATE_ATTR, None) is None
    if temporary:
        apply_sparse_attention(model, "dense")
    method, calls = state_of(model).method, {}

    def attend(q, k, v, call):
        out = type(method).attend(method, q, k, v, call)
        kept = out.detach() if method.name == "vsa" else None
        calls[call.layer] = Captured(q.detach(), k.detach(), v.detach(), kept, call.shape,
                                     call.scale)  # fmt: skip
        return out

    method.attend = attend  # the instance's attribute shadows the class's method
    try:
        yield calls
    finally:
        del method.attend
        if temporary:
            remove_sparse_attention(model)


def select_tiles(q, k, grid: VideoGrid, sparsity: float):
    """VSA's selection from the public primitives: tile means, coarse scores, top-k lists."""
    topk = resolve_topk(grid.num_tiles, sparsity=sparsity)
    scores = block_mean(q, grid) @ block_mean(k, grid).transpose(-1, -2)
    return topk_lists(scores, topk)


@torch.no_grad()
def kept_mass(q, k, grid: VideoGrid, kv_indices, kv_counts, scale=None, chunk=2**27) -> float:
    """Mean over the real queries (and batch, heads) of each query's share of its dense softmax
    mass that falls in the key tiles listed for its query tile. ``q, k [B, H, S, D]`` natural
    order; lists as ``topk_lists`` gives them. Query tiles go a few at a time (``chunk``
    score elements), never an S x S tensor."""
    B, H, _, D = q.shape
    scale = D**-0.5 if scale is None else scale
    Nt, V = grid.num_tiles, grid.tile_volume
    real = grid.real_token_mask(q.device)
    q_t, k_t = grid.tile(q.float()) * scale, grid.tile(k.float())
    listed = torch.arange(kv_indices.shape[-1], device=q.device) < kv_counts.unsqueeze(-1)
    chosen = torch.zeros(B, H, Nt, Nt, device=q.device)
    chosen = chosen.scatter_add_(-1, kv_indices.long(), listed.float()) > 0  # [B, H, Nt, Nt]
    tiles = max(1, chunk // (B * H * V * grid.padded_len))
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    for first in range(0, Nt, tiles):
        last = min(Nt, first + tiles)
        scores = q_t[:, :, first * V : last * V] @ k_t.transpose(-1, -2)
        probs = scores.masked_fill(~real, float("-inf")).softmax(-1)
        per_tile = probs.view(B, H, last - first, V, Nt, V).sum(-1)  # [B, H, c, V, Nt]
        kept = (per_tile * chosen[:, :, first:last, None, :]).sum(-1)  # [B, H, c, V]
        total += kept[:, :, real.view(Nt, V)[first:last]].sum(dtype=torch.float64)
    return float(total) / (B * H * grid.num_tokens)


@torch.no_grad()
def attention_metrics(captured: Captured, sparsity: float, tile) -> tuple[float, float]:
    """``(kept mass, rel L2 of VSA's output against dense)`` of one call at ``sparsity``."""
    q, k, v = captured.q, captured.k, captured.v
    grid = VideoGrid(captured.shape, tile)
    mass = kept_mass(q, k, grid, *select_tiles(q, k, grid, sparsity), captured.scale)
    out = captured.out
    if out is None:  # a dense model: VSA as on a stock checkpoint (no gate: the fine stage)
        out = video_sparse_attn(q, k, v, grid, sparsity=sparsity, gate=0, scale=captured.scale)
    dense = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=captured.scale)
    return mass, float((out.float() - dense).norm() / dense.norm())


# ------------------------------------------------------------------------------ figures


def draw_samples(path: Path, samples: torch.Tensor, real: torch.Tensor, title: str) -> None:
    """A held-out crop, then each sample: 4 frames a row."""
    from matplotlib.figure import Figure

    from vidsparse.plots import save_png

    videos = [("held-out crop", real), *((f"sample {i}", s) for i, s in enumerate(samples))]
    frames = real.shape[1]
    picks = sorted({round(i * (frames - 1) / 3) for i in range(4)})
    aspect = real.shape[3] / real.shape[2]
    fig = Figure(figsize=(1.9 * aspect * len(picks) + 0.6, 1.9 * len(videos) + 0.6))
    axes = fig.subplots(len(videos), len(picks), squeeze=False)
    for r, (label, video) in enumerate(videos):
        for c, frame in enumerate(picks):
            ax = axes[r][c]
            ax.imshow(((video[:, frame] + 1) / 2).clamp(0, 1).permute(1, 2, 0).numpy())
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(label, fontsize=8)
            if r == 0:
                ax.set_title(f"frame {frame}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_png(fig, path, dpi=110)


def arm_results(out_dir: Path, benchmark: str) -> dict[str, list[dict]]:
    """The rows of every arm's JSON of ``benchmark`` in ``out_dir`` (an arm's newest file)."""
    found = {}
    for path in sorted(out_dir.glob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        meta = data.get("meta", {}) if isinstance(data, dict) else {}
        if meta.get("benchmark") == benchmark and isinstance(meta.get("arm"), str):
            found[meta["arm"]] = data.get("rows", [])
    return found


PANELS = (("eval_loss", "held-out loss (mean of t = 0.25, 0.5, 0.75), log scale"),
          ("step_ms", "step time, ms (median over the interval)"),
          ("kept_mass", "kept dense attention mass (mean of layers; thin: each)"),
          ("attn_rel_l2", "attention rel L2 vs dense (mean of layers; thin: each)"))  # fmt: skip


def plot_curves(out_dir: Path, path: Path, title: str, benchmark: str, arms) -> None:
    """Every arm of ``arms`` found in ``out_dir`` against the step (the fine-tunes continue the
    dense arm's); dashed: a dense arm measured as if VSA ran on its q/k/v; dotted: the held-out
    loss of the EMA of the weights."""
    from matplotlib.figure import Figure

    from vidsparse.plots import save_png

    results = arm_results(out_dir, benchmark)
    fig = Figure(figsize=(13, 8.5))
    axes = list(fig.subplots(2, 2).flat)
    for index, arm in enumerate(arms):
        for ax, (key, _) in zip(axes, PANELS):
            draw_arm(ax, results.get(arm, []), key, arm, f"C{index}")
        draw_arm(axes[0], results.get(arm, []), "eval_loss_ema", f"{arm} (EMA)", f"C{index}", ":")
    for ax, (key, label) in zip(axes, PANELS):
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step (fine-tunes continue the dense arm's count)", fontsize=8)
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            if key == "eval_loss":  # the first evals would flatten the rest on a linear axis
                ax.set_yscale("log")
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def draw_arm(ax, rows: list[dict], key: str, arm: str, color: str, style: str = "-") -> None:
    rows = [r for r in rows if r.get(key) is not None]
    if not rows:
        return
    x = [r["global_step"] for r in rows]
    if rows[-1].get("metric_as_if") and key in ("kept_mass", "attn_rel_l2"):
        style = "--"
    if isinstance(rows[0][key], list):
        for layer in range(len(rows[0][key])):
            ax.plot(x, [r[key][layer] for r in rows], color=color, alpha=0.25, linewidth=0.7)
        y = [r[f"{key}_mean"] for r in rows]
        as_if = f"{arm} (as if VSA {rows[-1].get('metric_sparsity')})"
        label = as_if if style == "--" else arm
    else:
        y, label = [r[key] for r in rows], arm
    ax.plot(x, y, style, color=color, marker="o", markersize=3, label=label)
