"""Synthetic attention heads with planted stripe patterns, to validate the PSA search.

Each head's q and k are rotary (RoPE) embeddings of block positions along two axes, time ``t``
and the flattened spatial block index ``s = h*Wb + w`` (the axes of the stripe predicate), with
amplitudes chosen so that the attention *score* between blocks is exactly::

    score(query block, key block) = strength * (pass_t(dt) + pass_s(ds))       (+ small jitter)

where ``pass_t``, ``pass_s`` are the planted candidate's two predicate factors. Blocks passing
both factors score ``2 * strength``, blocks passing one score ``strength``, others 0; so with a
large ``strength`` almost all attention mass of every query lies on the planted stripe mask.

Why RoPE realises any stripe pattern: a rotary pair at frequency ``w`` gives
``<R(w x_q) u_q, R(w x_k) u_k> = r cos(w (x_k - x_q) - phi)``, a function of the distance
``d = x_k - x_q`` only. Distances on an axis of ``L`` blocks lie in ``[-(L-1), L-1]``, one period
of ``M = 2L - 1`` samples, where any real profile ``g(d)`` is a finite Fourier series::

    g(d) = a_0 + sum_{j=1}^{L-1} a_j cos(w_j d) + b_j sin(w_j d),     w_j = 2 pi j / M

so ``L - 1`` rotary pairs per axis (``u_q`` carrying amplitude and phase) give ``g`` exactly; the
constant ``a_0`` shifts every score of a row alike and is dropped. A periodic stripe of period
``p`` is dominated by the frequencies near ``2 pi / p``: the "one frequency dominates per
axis" picture of real video heads. Every token of a block shares its block's position; a small
per-token jitter keeps tokens distinct; v is a per-block random field plus per-token noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import StripeSpec
from vidsparse.search.candidates import Candidate, candidate_factors

__all__ = ["SyntheticHeads", "planted_stripe_heads", "rope_profile_features", "rope_dims_needed"]


@dataclass
class SyntheticHeads:
    """q, k, v ``[H, S, D]`` in natural token order of ``grid``; ``planted[h]`` is head h's."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    planted: tuple[Candidate, ...]
    grid: VideoGrid


def rope_profile_features(profile: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary features whose dot product reproduces ``profile`` up to a constant.

    ``profile``: float ``[2L - 1]``, the target score for distances ``d = -(L-1) .. L-1``.
    Returns ``q_feat``, ``k_feat`` float64 ``[L, 2(L-1)]`` (one row per position ``x``) with
    ``q_feat[x_q] . k_feat[x_k] = profile[x_k - x_q + L-1] - mean(profile)``.
    """
    m = profile.numel()
    if m % 2 != 1:
        raise ValueError(f"profile must have an odd length 2L-1, got {m}")
    length = (m + 1) // 2
    g = profile.double()
    d = torch.arange(-(length - 1), length, dtype=torch.float64)  # [M]
    j = torch.arange(1, length, dtype=torch.float64)  # [L-1]
    omega = 2 * math.pi * j / m  # [L-1]
    phase = omega[:, None] * d[None, :]  # [L-1, M]
    a = (2.0 / m) * (g * phase.cos()).sum(-1)  # [L-1]
    b = (2.0 / m) * (g * phase.sin()).sum(-1)
    r = torch.hypot(a, b).sqrt()  # amplitude split evenly between q and k
    phi = torch.atan2(b, a)
    x = torch.arange(length, dtype=torch.float64)[:, None]  # [L, 1]
    # q rotates by w*x + phi, k by w*x: their dot is r^2 cos(w (x_k - x_q) - phi).
    q_feat = torch.stack((r * (omega * x + phi).cos(), r * (omega * x + phi).sin()), -1)
    k_feat = torch.stack((r * (omega * x).cos(), r * (omega * x).sin()), -1)
    return q_feat.flatten(1), k_feat.flatten(1)  # [L, 2(L-1)]


def rope_dims_needed(block_grid: Sequence[int]) -> int:
    """Head dims the construction needs on a ``(Tb, Hb, Wb)`` block grid."""
    tb, hb, wb = block_grid
    return 2 * (tb - 1) + 2 * (hb * wb - 1)


def _as_candidate(x, spatial_unit: str) -> Candidate:
    if isinstance(x, Candidate):
        return x
    if isinstance(x, StripeSpec):
        return Candidate(x, spatial_unit)
    raise TypeError(f"planted patterns must be Candidate or StripeSpec, got {type(x).__name__}")


def _check_no_empty_rows(cand: Candidate, pass_t, pass_s, tb: int, ns: int) -> None:
    """A query block with no planted key would spread its attention elsewhere: refuse it."""
    for axis, passes, length in (("time", pass_t, tb), ("space", pass_s, ns)):
        # rows[x_q] = any key position x_k with pass[x_k - x_q]
        x = torch.arange(length)
        hit = passes[(x[None, :] - x[:, None]) + length - 1]  # [L(q), L(k)]
        if not bool(hit.any(dim=1).all()):
            raise ValueError(
                f"planted pattern {cand} leaves some query blocks without any key block along "
                f"{axis} on this grid; choose one whose every row attends somewhere"
            )


def planted_stripe_heads(
    grid: VideoGrid,
    planted: Sequence[Candidate | StripeSpec],
    *,
    head_dim: int | None = None,
    batch: int | None = None,
    strength: float = 12.0,
    jitter: float = 0.05,
    spatial_unit: str = "block",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> SyntheticHeads:
    """Heads whose attention mass lies on known stripe masks (one planted pattern per head).

    Args:
        grid: the video grid; its tile is the PSA block.
        planted: one ``Candidate`` (or ``StripeSpec``, read in ``spatial_unit``) per head.
        head_dim: default: the smallest multiple of 16 holding ``rope_dims_needed`` dims.
        batch: add a leading batch dim of this size (independent jitter and v per item).
        strength: score gap between planted and non-planted blocks (softmax logits).
        jitter: per-token noise on q/k, relative to the features' RMS.

    Returns q, k, v ``[H, S, D]`` (or ``[B, H, S, D]``) in natural order, ``S = num_tokens``.
    """
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a VideoGrid, got {type(grid).__name__}")
    cands = tuple(_as_candidate(p, spatial_unit) for p in planted)
    if not cands:
        raise ValueError("planted must hold at least one pattern (one per head)")
    tb, hb, wb = grid.tiles
    ns = hb * wb
    needed = rope_dims_needed(grid.tiles)
    if head_dim is None:
        head_dim = max(16, -(-needed // 16) * 16)
    if head_dim < needed:
        raise ValueError(
            f"head_dim={head_dim} is too small: block grid {grid.tiles} needs {needed} dims"
        )
    gen = torch.Generator().manual_seed(seed)
    n, vol = grid.num_tiles, grid.tile_volume
    t_of_block = torch.arange(n) // ns  # raster block order: n = t*Ns + s
    s_of_block = torch.arange(n) % ns

    qs, ks, vs = [], [], []
    for cand in cands:
        pass_t, pass_s = candidate_factors(cand, grid.tiles)
        _check_no_empty_rows(cand, pass_t, pass_s, tb, ns)
        qt, kt = rope_profile_features(strength * pass_t.double())  # [Tb, 2(Tb-1)]
        qsp, ksp = rope_profile_features(strength * pass_s.double())  # [Ns, 2(Ns-1)]
        qb = torch.cat((qt[t_of_block], qsp[s_of_block]), -1)  # [N, needed]
        kb = torch.cat((kt[t_of_block], ksp[s_of_block]), -1)
        q, k, v = _tokens(qb, kb, batch, head_dim, vol, jitter, gen)
        qs.append(q)
        ks.append(k)
        vs.append(v)

    def natural(xs):  # per head [B, padded_len, D] -> [B, H, num_tokens, D]
        x = torch.stack(xs, dim=1).to(dtype)
        x = grid.untile(x, dim=2)
        return x if batch is not None else x[0]

    return SyntheticHeads(natural(qs), natural(ks), natural(vs), cands, grid)


def _tokens(qb, kb, batch, head_dim, vol, jitter, gen):
    """Block features [N, F] -> token q, k, v [B, N*vol, head_dim] in tile order."""
    n, f = qb.shape
    bsz = 1 if batch is None else batch
    pad = head_dim - f
    qb = torch.nn.functional.pad(qb, (0, pad))
    kb = torch.nn.functional.pad(kb, (0, pad))
    # The engine scales scores by 1/sqrt(D): pre-scale q so that q.k/sqrt(D) is the profile.
    qb = qb * math.sqrt(head_dim)
    rms_q = float(qb.square().mean().sqrt()) or 1.0
    rms_k = float(kb.square().mean().sqrt()) or 1.0
    shape = (bsz, n, vol, head_dim)
    q = qb[None, :, None] + jitter * rms_q * torch.randn(shape, generator=gen, dtype=torch.float64)
    k = kb[None, :, None] + jitter * rms_k * torch.randn(shape, generator=gen, dtype=torch.float64)
    v_block = torch.randn(bsz, n, 1, head_dim, generator=gen, dtype=torch.float64)
    v = v_block + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    return (x.reshape(bsz, n * vol, head_dim) for x in (q, k, v))
