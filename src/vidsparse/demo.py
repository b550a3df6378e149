"""The built-in demo workload: one Wan-2.1-shaped video self-attention layer, dense vs VSA vs PSA.

q/k/v come from a real clip (81 frames of Big Buck Bunny shipped in ``vidsparse.data``), made
into latent-grid tokens the way Wan 2.1 does, with stand-ins for the trained parts:

1. "VAE": Wan's causal VAE maps 1 + 4k frames to 1 + k latent frames (frame 0 alone, then
   groups of 4) and downsamples 8x in space. We average frames the same way in time and
   area-resize each latent frame to (2H, 2W) "latent pixels" (the clip is centre-cropped to
   the grid's aspect first).
2. "Patch embedding": Wan patchifies 1x2x2 latent pixels into a token. Each token gets
   features from its 2x2 latent pixels: their RGB (12), the luma gradients (2) and the motion
   inside its 4-frame group (3 RGB differences), standardised over the clip.
3. "q/k/v projections": fixed seeded random matrices per head, plus a bias shared by q and k.
   k's matrix is q's rotated partway towards an independent one, so q . k partly measures
   content similarity (like trained heads that attend to similar content) and partly not.
   q and k are RMS-normalised (Wan's qk_norm) and scaled by a per-head gain (how sharp the head
   is), then Wan's 3-D RoPE is applied; the q/k bias under RoPE gives each head a relative-
   position kernel whose reach depends on which RoPE bands (t, h, w) its energy sits in.

So attention reflects real content plus position, with the locality of real video heads, but
no trained weights: the numbers say how VSA and PSA behave on video-like attention, not on Wan
itself.

PSA has no offline plan for these heads, so the demo searches one on the spot, on the same
q/k/v: the default candidate family (``CandidateFamily()``), the objective on a random quarter
of the query blocks, and per head the lowest-error candidate at least ``psa_target`` sparse.
That search is timed apart from the attention.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import vidsparse
from vidsparse.data import CLIP_ATTRIBUTION, load_clip
from vidsparse.masks.stripe import StripeSpec
from vidsparse.plots import SPEC_NOTATION, plot_attention_vs_mask, save_png
from vidsparse.search import Candidate, CandidateFamily, StripeObjective, select_candidates
from vidsparse.testing import rel_l2
from vidsparse.utils.checks import check_device

GPU_GRID, GPU_HEADS, GPU_DIM = (21, 30, 52), 12, 128  # Wan 2.1 1.3B, 480p, 81 frames
CPU_GRID, CPU_HEADS, CPU_DIM = (8, 16, 16), 2, 64  # reduced so the CPU finishes in seconds
VAE_STRIDE_T = 4  # Wan 2.1 VAE: 4x in time (first frame kept alone), 8x in space
ROPE_THETA = 10000.0  # Wan's rope_params default
NUM_FEATURES = 17  # 12 RGB of the 2x2 latent pixels + 2 luma gradients + 3 motion
LUMA = (0.299, 0.587, 0.114)
# PSA blocks: 2x8x8 on the GPU (the block of the H200 run the README records; bench_psa now
# defaults to 1x16x8, which pads Wan's grids less); on the reduced CPU grid the same shape halved
# in space, so the 16x16 frames still hold a 4x4 grid of blocks (4x4x4 blocks in all).
GPU_PSA_TILE, CPU_PSA_TILE = (2, 8, 8), (2, 4, 4)
PSA_QUERY_FRACTION = 0.25  # share of query blocks the on-the-spot search evaluates


# ---- the clip as latent-grid tokens ---------------------------------------------------------


def clip_frame_indices(num_clip_frames: int, num_latent_frames: int) -> list[int]:
    """Which clip frames feed a grid with ``num_latent_frames``: 1 + 4 (T - 1) of them.

    Evenly strided from frame 0 so a short (CPU) grid still spans the clip's motion.
    """
    needed = 1 + VAE_STRIDE_T * (num_latent_frames - 1)
    if needed > num_clip_frames:
        raise ValueError(
            f"a grid of {num_latent_frames} latent frames needs {needed} clip frames,"
            f" the clip has {num_clip_frames}"
        )
    stride = 1 if needed == 1 else (num_clip_frames - 1) // (needed - 1)
    return list(range(0, stride * needed, stride))


def _center_crop_to_aspect(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Crop ``[F, C, Hp, Wp]`` around the centre to the aspect ``height : width``."""
    Hp, Wp = frames.shape[-2:]
    if Hp * width > Wp * height:  # too tall
        keep = round(Wp * height / width)
        top = (Hp - keep) // 2
        return frames[..., top : top + keep, :]
    keep = round(Hp * width / height)
    left = (Wp - keep) // 2
    return frames[..., left : left + keep]


def latent_pixels(frames, grid_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The clip as "latent pixels": the stand-in for Wan's VAE.

    Args:
        frames: uint8 ``[F, Hp, Wp, 3]`` (numpy or torch).
        grid_shape: token grid ``(T, H, W)``.

    Returns ``(mean, motion)``, float ``[T, 3, 2H, 2W]`` in [-1, 1] and the last-minus-first
    frame difference of each latent frame's 4-frame group (zero for latent frame 0, which Wan's
    causal VAE encodes alone).
    """
    T, H, W = grid_shape
    x = torch.as_tensor(frames)[clip_frame_indices(len(frames), T)]
    x = x.permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [F, 3, Hp, Wp]
    x = _center_crop_to_aspect(x, H, W)
    x = F.interpolate(x, size=(2 * H, 2 * W), mode="bilinear", antialias=True, align_corners=False)
    first, rest = x[:1], x[1:].reshape(T - 1, VAE_STRIDE_T, *x.shape[1:])
    mean = torch.cat([first, rest.mean(dim=1)])
    motion = torch.cat([torch.zeros_like(first), rest[:, -1] - rest[:, 0]])
    return mean, motion


def patch_features(mean: torch.Tensor, motion: torch.Tensor) -> torch.Tensor:
    """Per-token features ``[T*H*W, NUM_FEATURES]`` (raster order), standardised.

    A token is a 1x2x2 patch of latent pixels, as in Wan's patch embedding.
    """
    T, _, H2, W2 = mean.shape
    H, W = H2 // 2, W2 // 2
    # The 2x2 sub-patches' RGB, channel-major: [T, 3, 2H, 2W] -> [T, H, W, 12].
    rgb = mean.reshape(T, 3, H, 2, W, 2).permute(0, 2, 4, 1, 3, 5).reshape(T, H, W, 12)
    luma = torch.einsum("tchw,c->thw", mean, torch.tensor(LUMA))
    grad_h, grad_w = torch.gradient(luma, dim=(1, 2))
    grads = torch.stack([grad_h, grad_w], dim=1)  # [T, 2, 2H, 2W]
    grads = F.avg_pool2d(grads, 2).permute(0, 2, 3, 1)  # [T, H, W, 2]
    moves = F.avg_pool2d(motion, 2).permute(0, 2, 3, 1)  # [T, H, W, 3]
    feats = torch.cat([rgb, grads, moves], dim=-1).reshape(T * H * W, NUM_FEATURES)
    # Like a LayerNorm upstream: every feature on the same scale, so none dominates by units.
    return (feats - feats.mean(0)) / (feats.std(0) + 1e-6)


# ---- Wan's 3-D RoPE -------------------------------------------------------------------------


def rope_band_pairs(head_dim: int) -> tuple[int, int, int]:
    """Rotation pairs given to (t, h, w), Wan's split: h and w get c // 3 each, t the rest.

    head_dim 128 (64 pairs) -> (22, 21, 21), i.e. 44/42/42 dims; head_dim 64 -> (12, 10, 10).
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    c = head_dim // 2
    return c - 2 * (c // 3), c // 3, c // 3


def rope_angles(grid_shape, head_dim: int) -> torch.Tensor:
    """Rotation angle of every (token, pair): float64 ``[T*H*W, head_dim // 2]``.

    Each axis has its own RoPE ladder ``pos / theta ** (2i / dim_axis)`` over its band, as in
    Wan's ``rope_params``; the bands are laid out [t | h | w].
    """
    T, H, W = grid_shape
    positions = torch.meshgrid(
        *(torch.arange(n, dtype=torch.float64) for n in (T, H, W)), indexing="ij"
    )
    bands = []
    for pairs, pos in zip(rope_band_pairs(head_dim), positions):
        inv_freq = ROPE_THETA ** (-torch.arange(pairs, dtype=torch.float64) * 2 / (2 * pairs))
        bands.append(pos.reshape(-1, 1) * inv_freq)
    return torch.cat(bands, dim=-1)


def apply_wan_rope(x: torch.Tensor, grid_shape) -> torch.Tensor:
    """Wan's 3-D RoPE on ``[..., T*H*W, D]`` (raster order): rotate dims (2i, 2i+1) together."""
    angles = rope_angles(grid_shape, x.shape[-1])
    rot = torch.polar(torch.ones_like(angles), angles)  # complex [S, D/2]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


# ---- q, k, v --------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _band_weights(head_dim: int, generator: torch.Generator) -> torch.Tensor:
    """Per-dim weights ``[D]`` of one head's q/k bias over the RoPE bands.

    A head whose bias sits in the t band only sees temporal offsets; in h/w, spatial ones.
    Dirichlet-like weights make a mix of temporal, spatial and broad heads.
    """
    share = -torch.log(torch.rand(3, generator=generator))
    share = share / share.sum()
    per_pair = torch.cat(
        [torch.full((n,), math.sqrt(s / n)) for s, n in zip(share, rope_band_pairs(head_dim))]
    )
    return per_pair.repeat_interleave(2)


def clip_qkv(frames, grid_shape, heads, head_dim, *, device, dtype, generator):
    """q, k, v ``[1, heads, T*H*W, head_dim]`` from real clip frames (see the module doc)."""
    feats = patch_features(*latent_pixels(frames, grid_shape))  # [S, F]
    Fdim = feats.shape[-1]

    def projection():
        return torch.randn(heads, Fdim, head_dim, generator=generator) / math.sqrt(Fdim)

    w_q, w_other, w_v = projection(), projection(), projection()
    # k's matrix: q's turned by an angle per head; cos(angle) is how much q . k is similarity.
    angle = torch.rand(heads, 1, 1, generator=generator) * (math.pi / 3)
    w_k = torch.cos(angle) * w_q + torch.sin(angle) * w_other
    bias = torch.stack([_band_weights(head_dim, generator) for _ in range(heads)])
    bias = bias * torch.randn(heads, head_dim, generator=generator)  # [heads, D]
    bias_scale = torch.empty(heads, 1, 1).uniform_(0.5, 2.0, generator=generator)
    # Per-head sharpness: the largest logit q . k / sqrt(D) a head can reach is gain^2 sqrt(D).
    gain = torch.empty(heads, 1, 1).uniform_(0.8, 1.6, generator=generator)

    def query_or_key(w):
        x = torch.einsum("sf,hfd->hsd", feats, w) + bias_scale * bias[:, None, :]
        return apply_wan_rope(_rms_norm(x) * gain, grid_shape)

    q, k = query_or_key(w_q), query_or_key(w_k)
    v = torch.einsum("sf,hfd->hsd", feats, w_v)
    return [x.unsqueeze(0).to(device=device, dtype=dtype) for x in (q, k, v)]


# ---- PSA: a per-head stripe search on the spot ----------------------------------------------


@dataclass
class PsaChoice:
    """What the on-the-spot search chose: one candidate per head, on ``grid``'s blocks."""

    grid: vidsparse.VideoGrid
    candidates: list[Candidate]
    specs: list[StripeSpec]  # the candidates as "block"-unit specs (one stripe_attn launch)
    sparsity: list[float]  # per head, of the padded block grid
    search_rel_l2: list[float]  # per head, the objective's estimate on the sampled blocks
    num_candidates: int
    target_sparsity: float
    query_fraction: float
    seconds: float

    def to_dict(self) -> dict:
        return dict(
            tile=list(self.grid.tile_shape),
            block_grid=list(self.grid.tiles),
            heads=[
                dict(
                    candidate=str(c),
                    spec=spec.to_dict(),
                    sparsity=sp,
                    search_rel_l2=err,
                )
                for c, spec, sp, err in zip(
                    self.candidates, self.specs, self.sparsity, self.search_rel_l2
                )
            ],
            search=dict(
                family="CandidateFamily() (the default)",
                num_candidates=self.num_candidates,
                query_fraction=self.query_fraction,
                selection="per head, the lowest rel L2 among candidates >= target_sparsity",
                target_sparsity=self.target_sparsity,
                seconds=self.seconds,
            ),
        )


def search_psa(q, k, v, grid, *, target_sparsity: float, query_fraction: float, seed: int):
    """Per head, the default family's lowest-error candidate at ``>= target_sparsity``.

    The objective (rel L2 of each candidate's output against dense) runs on a random
    ``query_fraction`` of the query blocks; ``grid``'s tile is the PSA block.
    """
    start = time.perf_counter()
    cands = CandidateFamily().on_grid(grid.tiles)
    objective = StripeObjective(grid, cands, query_fraction=query_fraction, seed=seed)
    rel = objective(q, k, v).rel_l2  # [H, C], on the CPU: the search has finished
    pick = select_candidates(rel, cands.sparsity, target_sparsity=target_sparsity).tolist()
    seconds = time.perf_counter() - start
    chosen = [cands[i] for i in pick]
    return PsaChoice(
        grid=grid,
        candidates=chosen,
        specs=[c.block_spec(grid.tiles[2]) for c in chosen],
        sparsity=[float(cands.sparsity[i]) for i in pick],
        search_rel_l2=[float(rel[h, i]) for h, i in enumerate(pick)],
        num_candidates=len(cands),
        target_sparsity=target_sparsity,
        query_fraction=query_fraction,
        seconds=seconds,
    )


# ---- timing and the run ---------------------------------------------------------------------


def _time(
    fn: Callable[[], torch.Tensor], device: torch.device, repeats: int, warmup: int = 1
) -> tuple[float, torch.Tensor]:
    for _ in range(warmup):  # compilation, caches, and on the CPU the allocator settling
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3, out


def _psa_row(q, k, v, ref, grid_shape, psa_target, seed, dense_ms, timing, log):
    """Search PSA's per-head patterns on the spot, then time ``stripe_attn`` with them.

    Returns the results row and the ``PsaChoice``.
    """
    on_gpu = timing["device"].type == "cuda"
    psa_grid = vidsparse.VideoGrid(grid_shape, tile=GPU_PSA_TILE if on_gpu else CPU_PSA_TILE)
    log(
        f"PSA search: default candidate family on {psa_grid.num_tiles} blocks of"
        f" {'x'.join(map(str, psa_grid.tile_shape))}, objective on"
        f" {PSA_QUERY_FRACTION:.0%} of the query blocks; per head the lowest-error candidate"
        f" at sparsity >= {psa_target}"
    )
    psa = search_psa(
        q, k, v, psa_grid, target_sparsity=psa_target, query_fraction=PSA_QUERY_FRACTION, seed=seed
    )
    log(
        f"PSA search: {psa.num_candidates} candidates x {q.shape[1]} heads in {psa.seconds:.2f} s"
        " (not part of the attention time"
        + ("; a first GPU run includes kernel compilation)" if on_gpu else ")")
    )
    log(f"  (notation: {SPEC_NOTATION}; [block]/[row]: the spatial period's unit)")
    for h, (cand, sp, err) in enumerate(zip(psa.candidates, psa.sparsity, psa.search_rel_l2)):
        log(f"  head {h:>2}: {cand}  sparsity {sp:.3f}, search rel L2 {err:.4f}")
    psa_ms, out = _time(lambda: vidsparse.stripe_attn(q, k, v, psa_grid, psa.specs), **timing)
    row = dict(
        method=f"PSA target {psa_target}",
        ms=psa_ms,
        speedup=dense_ms / psa_ms,
        sparsity=sum(psa.sparsity) / len(psa.sparsity),
        rel_l2=rel_l2(out, ref),
        psa=psa.to_dict(),
    )
    return row, psa


def run_demo(
    *,
    device: str = "auto",
    sparsity: float = 0.875,
    psa_target: float = 0.75,
    seed: int = 0,
    log=print,
    out_dir: str | Path | None = None,
) -> dict:
    """Dense vs VSA vs PSA on the clip workload; returns the report. PNGs go to ``out_dir`` if
    given and matplotlib is installed; the report names them relative to ``out_dir``.

    ``sparsity``: VSA's; ``psa_target``: the least sparsity of each head's PSA pattern.
    """
    from vidsparse.ops.video_sparse_attn.topk import resolve_topk

    log = log or (lambda *a, **k: None)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = check_device("device", device)  # before any work: a clear error, not torch's
    on_gpu = dev.type == "cuda"
    grid_shape, heads, head_dim = (
        (GPU_GRID, GPU_HEADS, GPU_DIM) if on_gpu else (CPU_GRID, CPU_HEADS, CPU_DIM)
    )
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        log(
            f"no GPU: running a reduced grid {grid_shape} x {heads} heads x head_dim {head_dim}"
            f" (the GPU demo runs Wan 2.1 480p: {GPU_GRID} x {GPU_HEADS} x {GPU_DIM})"
        )
    grid = vidsparse.VideoGrid(grid_shape)
    gen = torch.Generator().manual_seed(seed)
    frames = load_clip()
    q, k, v = clip_qkv(frames, grid_shape, heads, head_dim, device=dev, dtype=dtype, generator=gen)
    # The CPU's first calls of the reference paths run slower: warm up a few times.
    timing = dict(device=dev, repeats=10 if on_gpu else 4, warmup=1 if on_gpu else 3)
    log(f"inputs: {CLIP_ATTRIBUTION}; patch-embedded, Wan 3-D RoPE")
    log(
        f"workload: grid {grid_shape} = {grid.num_tokens} tokens, {grid.num_tiles} tiles of 4x4x4,"
        f" {heads} heads, head_dim {head_dim}, {str(dtype).replace('torch.', '')}, {device}"
    )

    dense_ms, dense = _time(lambda: F.scaled_dot_product_attention(q, k, v), **timing)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    rows = [
        dict(
            method="dense (SDPA)", ms=dense_ms, speedup=1.0, sparsity=0.0, rel_l2=rel_l2(dense, ref)
        )
    ]
    # An untrained model's gate is zero (the coarse branch is learned during fine-tuning), so the
    # output compared with dense attention is the fine stage over the selected tiles (gate=0).
    vsa_ms, vsa = _time(
        lambda: vidsparse.video_sparse_attn(q, k, v, grid, sparsity=sparsity, gate=0), **timing
    )
    rows.append(
        dict(
            method=f"VSA sparsity {sparsity}",
            ms=vsa_ms,
            speedup=dense_ms / vsa_ms,
            sparsity=1.0 - resolve_topk(grid.num_tiles, sparsity=sparsity) / grid.num_tiles,
            rel_l2=rel_l2(vsa, ref),
        )
    )

    psa_row, psa = _psa_row(q, k, v, ref, grid_shape, psa_target, seed, dense_ms, timing, log)
    rows.append(psa_row)

    log(f"{'method':<22} {'time ms':>9} {'speedup':>8} {'sparsity':>9} {'rel L2 vs dense':>16}")
    for r in rows:
        log(
            f"{r['method']:<22} {r['ms']:>9.2f} {r['speedup']:>7.2f}x {r['sparsity']:>9.3f}"
            f" {r['rel_l2']:>16.4f}"
        )
    log(
        "sparsity: skipped key tiles (VSA) or block pairs (PSA, mean over heads); the PSA"
        " search time above is not in PSA's time"
    )
    if not on_gpu:
        log(
            "CPU times are not meaningful: VSA and PSA run their PyTorch reference paths"
            " (no kernels) on a CPU shared with everything else, so the times and speedups"
            " above say nothing of the method; sparsity and rel L2 hold. Speedups are for a"
            " GPU to show"
        )
    report = dict(
        workload=dict(
            grid=list(grid_shape),
            tokens=grid.num_tokens,
            heads=heads,
            head_dim=head_dim,
            dtype=str(dtype),
            device=device,
            inputs=f"{CLIP_ATTRIBUTION}; patch-embedded, Wan 3-D RoPE",
            reduced=not on_gpu,
        ),
        results=rows,
        versions=dict(
            vidsparse=vidsparse.__version__,
            torch=torch.__version__,
            python=platform.python_version(),
        ),
    )
    if out_dir is not None:
        report["figures"] = write_figures(Path(out_dir), frames, grid, q, k, sparsity, log, psa)
    return report


# ---- pictures -------------------------------------------------------------------------------

MAX_HEADS_SHOWN, MAX_FRAMES_SHOWN = 4, 4
PSA_MASKS_PNG = "psa_masks.png"


def _query_tile(grid, frames, kept: torch.Tensor) -> tuple[int, tuple[int, int, int]]:
    """The query tile the pictures show: id and (t', h', w').

    A representative one: the tile whose kept mass (``kept``, ``[heads, num_tiles]``, averaged
    over the heads shown) is nearest the mean over all query tiles; among the nearest (within
    2 points of it), the one where the clip moves most, whose attention is more telling than
    that of a patch of static grass.
    """
    _, motion = latent_pixels(frames, grid.shape)  # [T, 3, 2H, 2W]
    moving = F.avg_pool2d(motion.abs().mean(1, keepdim=True), 2)[:, 0]  # [T, H, W]
    per_tile = grid.tile(moving.reshape(-1, 1), dim=0)  # zero-padded, tile order
    per_tile = per_tile.reshape(grid.num_tiles, grid.tile_volume).sum(1)
    mass = kept.mean(0)  # [num_tiles]
    gap = (mass - mass.mean()).abs()
    near = gap <= max(float(gap.min()), 0.02)
    tile = int(torch.where(near, per_tile, per_tile.new_full((), -1.0)).argmax())
    return tile, tuple(grid.tile_coords()[tile].tolist())


def vsa_kept_mass(q, k, grid, heads: list[int], sparsity: float, rows: int = 2048):
    """Dense attention mass VSA's selection keeps, per head and query tile: float
    ``[len(heads), num_tiles]``, each the mean over the tile's real queries of the softmax
    mass on the key tiles VSA picks for that query tile (reference coarse stage: tile means,
    coarse scores, top-k). Query rows go ``rows`` at a time (480p on a GPU: 32k keys a row)."""
    from vidsparse.ops.video_sparse_attn.reference import tile_means
    from vidsparse.ops.video_sparse_attn.topk import resolve_topk

    qt, kt = grid.tile(q[0, heads].float()), grid.tile(k[0, heads].float())  # [h, P, D]
    qc, kc = tile_means(qt, grid), tile_means(kt, grid)  # [h, Nt, D]
    scores = qc @ kc.transpose(-1, -2)  # [h, Nt, Nt]
    topk = resolve_topk(grid.num_tiles, sparsity=sparsity)
    chosen = torch.zeros_like(scores).scatter_(2, scores.topk(topk, dim=2).indices, 1.0)
    valid = grid.real_token_mask(q.device)  # [P]
    V, Nt = grid.tile_volume, grid.num_tiles
    per_row = torch.zeros(len(heads), grid.padded_len, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for start in range(0, grid.padded_len, rows):
        stop = min(start + rows, grid.padded_len)
        s = (qt[:, start:stop] @ kt.transpose(-1, -2)) * scale  # [h, r, P]
        p = torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1)
        p_tiles = p.reshape(len(heads), stop - start, Nt, V).sum(-1)  # [h, r, Nt]
        row_tiles = torch.arange(start, stop, device=q.device) // V
        per_row[:, start:stop] = (p_tiles * chosen[:, row_tiles]).sum(-1)
    per_row = per_row * valid  # padding rows count nothing
    sizes = grid.tile_sizes_on(q.device).float()
    return (per_row.reshape(len(heads), Nt, V).sum(-1) / sizes).cpu()


def _tile_tokens(grid, tile: int) -> torch.Tensor:
    """Natural (raster) indices of the real tokens of one tile."""
    index = grid.index_tensors("cpu")
    slots = slice(tile * grid.tile_volume, (tile + 1) * grid.tile_volume)
    return index.gather_index[slots][index.valid[slots]]


def dense_attention_to(q, k, grid, tile: int, heads: list[int]) -> torch.Tensor:
    """Dense attention of one query tile, averaged over its queries: ``[len(heads), T, H, W]``."""
    rows = _tile_tokens(grid, tile).to(q.device)
    qs, ks = q[0, heads][:, rows].float(), k[0, heads].float()
    probs = torch.softmax(qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return probs.mean(dim=1).reshape(len(heads), *grid.shape).cpu()


def vsa_selected_tiles(q, k, grid, tile: int, heads: list[int], sparsity: float) -> torch.Tensor:
    """Key tiles VSA's coarse stage selects for one query tile: bool ``[len(heads), T, H, W]``.

    Recomputed with the reference stages (tile means, coarse scores, top-k) for the few heads.
    """
    from vidsparse.ops.video_sparse_attn.reference import tile_means
    from vidsparse.ops.video_sparse_attn.topk import resolve_topk

    qc = tile_means(grid.tile(q[0, heads].float()), grid)[:, tile]  # [h, D]
    kc = tile_means(grid.tile(k[0, heads].float()), grid)  # [h, Nt, D]
    scores = torch.einsum("hd,hnd->hn", qc, kc)
    topk = resolve_topk(grid.num_tiles, sparsity=sparsity)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen.scatter_(1, scores.topk(topk, dim=1).indices, True)
    # Each token takes its tile's verdict: tile id of token (t, h, w) is that of (t, h, w) // 4.
    ids = torch.arange(grid.num_tiles).reshape(grid.tiles)
    tt, th, tw = grid.tile_shape
    ids = ids.repeat_interleave(tt, 0).repeat_interleave(th, 1).repeat_interleave(tw, 2)
    T, H, W = grid.shape
    return chosen.cpu()[:, ids[:T, :H, :W]]


def _frames_shown(grid, query_t: int) -> list[int]:
    """Up to MAX_FRAMES_SHOWN latent frames spread over the clip, including the query's."""
    T = grid.shape[0]
    picks = {round(i * (T - 1) / (MAX_FRAMES_SHOWN - 1)) for i in range(MAX_FRAMES_SHOWN)}
    picks = sorted(picks - {min(picks, key=lambda t: abs(t - query_t))} | {query_t})
    return picks


def _outline(ax, box, color="red"):
    """Draw ``(top, left, height, width)`` in data coordinates of an imshow."""
    from matplotlib.patches import Rectangle

    top, left, height, width = box
    ax.add_patch(Rectangle((left - 0.5, top - 0.5), width, height, fill=False, ec=color, lw=1.5))


def _query_box(grid, coords) -> tuple[int, int, int, int]:
    _, th, tw = grid.tile_shape
    return coords[1] * th, coords[2] * tw, th, tw


GRID_LEGEND = (
    "each panel: one latent frame t of the key grid (T x H x W tokens), h down, w across;"
    " red box: the query tile (in its own frame)"
)


def _grid_figure(maps, heads, frames_shown, query_t, box, title, cmap, *, colorbar: str,
                 boolean: bool = False):  # fmt: skip
    """One row per head, one column per key frame shown; a colorbar per row (``colorbar``:
    its label; ``boolean``: two ticks, dropped / kept), t/h/w named on the axes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2.6 * len(frames_shown) + 0.9, 2.0 * len(heads) + 0.9),
                 layout="constrained")  # fmt: skip
    axes = fig.subplots(len(heads), len(frames_shown), squeeze=False)
    for row, head in enumerate(heads):
        vmax = 1.0 if boolean else float(maps[row].max())
        for col, t in enumerate(frames_shown):
            ax = axes[row][col]
            image = ax.imshow(maps[row, t].float().numpy(), cmap=cmap, vmin=0, vmax=vmax)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"head {head}, key frame t={t}", fontsize=8)
            if row == len(heads) - 1:
                ax.set_xlabel("w (tokens) ->", fontsize=7)
            if col == 0:
                ax.set_ylabel("<- h (tokens)", fontsize=7)
            if t == query_t:
                _outline(ax, box)
        bar = fig.colorbar(image, ax=list(axes[row]), shrink=0.85)
        bar.set_label(colorbar, fontsize=7)
        bar.ax.tick_params(labelsize=6)
        if boolean:
            bar.set_ticks([0, 1], labels=["dropped", "kept"])
    fig.suptitle(f"{title}\n{GRID_LEGEND}", fontsize=8)
    return fig


def _clip_frame_figure(frames, grid, query_t: int, box):
    """The clip frame at the query's latent frame, with the query tile's pixels outlined."""
    from matplotlib.figure import Figure

    T, H, W = grid.shape
    indices = clip_frame_indices(len(frames), T)
    frame = torch.as_tensor(frames[indices[VAE_STRIDE_T * query_t]]).permute(2, 0, 1)
    frame = _center_crop_to_aspect(frame, H, W).permute(1, 2, 0)
    px = frame.shape[0] / H  # clip pixels per token
    fig = Figure(figsize=(6, 6 * frame.shape[0] / frame.shape[1] + 0.4), layout="constrained")
    ax = fig.subplots()
    ax.imshow(frame.numpy())
    top, left, height, width = box
    _outline(ax, (top * px, left * px, height * px, width * px))
    ax.set_axis_off()
    ax.set_title(
        f"clip frame {indices[VAE_STRIDE_T * query_t]} (latent frame {query_t});"
        " red: the query tile",
        fontsize=8,
    )
    return fig


def write_figures(
    out_dir: Path, frames, grid, q, k, sparsity: float, log, psa: PsaChoice | None = None
) -> list[str]:
    """PNGs of the attention of one query tile, and PSA's chosen block masks (with ``psa``).

    Returns the file names (relative to ``out_dir``); skipped (with a note) without matplotlib.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("matplotlib is not installed: no PNGs (pip install matplotlib)")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    heads = list(range(min(q.shape[1], MAX_HEADS_SHOWN)))
    kept_all = vsa_kept_mass(q, k, grid, heads, sparsity)  # [heads, num_tiles]
    tile, coords = _query_tile(grid, frames, kept_all)
    frames_shown = _frames_shown(grid, coords[0] * grid.tile_shape[0])
    query_t, box = coords[0] * grid.tile_shape[0], _query_box(grid, coords)
    dense = dense_attention_to(q, k, grid, tile, heads)
    chosen = vsa_selected_tiles(q, k, grid, tile, heads, sparsity)
    kept = (dense * chosen).flatten(1).sum(1)  # dense attention mass VSA keeps, per head
    kept_text = ", ".join(f"head {h}: {m:.0%}" for h, m in zip(heads, kept.tolist()))
    mean_text = ", ".join(f"head {h}: {m:.0%}" for h, m in zip(heads, kept_all.mean(1).tolist()))
    log(
        f"VSA picture: query tile {tuple(coords)}, a representative one (its kept dense mass"
        f" nearest the mean over all {grid.num_tiles} query tiles); kept there: {kept_text};"
        f" mean over all query tiles: {mean_text}"
    )
    figures = {
        "attention_dense.png": _grid_figure(
            dense,
            heads,
            frames_shown,
            query_t,
            box,
            f"dense attention of query tile {tuple(coords)} (red) over the keys",
            "magma",
            colorbar="attention probability (mean over the tile's queries)",
        ),
        "vsa_selection.png": _grid_figure(
            chosen,
            heads,
            frames_shown,
            query_t,
            box,
            f"key tiles VSA keeps at sparsity {sparsity} for query tile {tuple(coords)};"
            f" dense mass kept there: {kept_text}\nmean over all {grid.num_tiles} query"
            f" tiles: {mean_text}",
            "viridis",
            colorbar="VSA's selection",
            boolean=True,
        ),
        "clip_frame.png": _clip_frame_figure(frames, grid, query_t, box),
    }
    for name, fig in figures.items():
        save_png(fig, out_dir / name, dpi=110)  # written whole or not at all
    names = list(figures)
    if psa is not None:
        plot_attention_vs_mask(
            q,
            k,
            psa.grid,
            psa.specs,
            out_dir / PSA_MASKS_PNG,
            heads,
            title=(
                f"PSA masks the search chose (lowest error at sparsity >= {psa.target_sparsity})"
                f"\nblocks of {'x'.join(map(str, psa.grid.tile_shape))}, block grid"
                f" {psa.grid.tiles}"
            ),
        )
        names.append(PSA_MASKS_PNG)
    log(f"figures in {out_dir}: {', '.join(names)}")
    return names
