"""The built-in demo workload: one Wan-2.1-shaped video self-attention layer, dense vs VSA.

q/k/v are smooth space-time fields (a few low-frequency waves per head plus noise), so that
attention has the locality of real video latents and tile means are informative. (A version fed
from a real clip is planned; this one says what it is in its report.)
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import vidsparse
from vidsparse.testing import rel_l2

GPU_GRID, GPU_HEADS, GPU_DIM = (21, 30, 52), 12, 128  # Wan 2.1 1.3B, 480p, 81 frames
CPU_GRID, CPU_HEADS, CPU_DIM = (8, 16, 16), 2, 64  # reduced so the CPU finishes in seconds


def smooth_video_qkv(grid_shape, heads, head_dim, *, device, dtype, generator, sharpness=12.0):
    """q, k, v [1, heads, T*H*W, head_dim] with the locality of video attention.

    q and k share random Fourier features of the (t, h, w) position (per head), so q . k is a
    smooth kernel of the distance between positions: attention concentrates on nearby tokens,
    more or less sharply per head. v is a smooth field too. Small noise breaks exact symmetry.
    """
    T, H, W = grid_shape
    t, h, w = torch.meshgrid(
        torch.arange(T, dtype=torch.float32),
        torch.arange(H, dtype=torch.float32),
        torch.arange(W, dtype=torch.float32),
        indexing="ij",
    )
    coords = torch.stack([t, h, w], dim=-1).reshape(-1, 3)  # [S, 3] in tokens
    # Per-head length scales: some heads local (a few tokens), some broad.
    length = torch.empty(heads, 1, 3).uniform_(2.0, 12.0, generator=generator)
    freqs = torch.randn(heads, head_dim, 3, generator=generator) / length  # [Hh, D, 3]
    phase = torch.rand(heads, head_dim, generator=generator) * 2 * math.pi
    feats = torch.cos(torch.einsum("sc,hdc->hsd", coords, freqs) + phase[:, None, :])
    amp = math.sqrt(sharpness * 2.0 / math.sqrt(head_dim))  # q . k * scale peaks near sharpness

    def noisy(x):
        return x + 0.05 * torch.randn(x.shape, generator=generator)

    q, k = noisy(feats * amp), noisy(feats * amp)
    v_freqs = torch.randn(heads, head_dim, 3, generator=generator) / 6.0
    v = torch.sin(torch.einsum("sc,hdc->hsd", coords, v_freqs) + phase.flip(-1)[:, None, :])
    return [x.unsqueeze(0).to(device=device, dtype=dtype) for x in (q, k, noisy(v))]


def _time(
    fn: Callable[[], torch.Tensor], device: torch.device, repeats: int
) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (compilation, caches)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3, out


def run_demo(*, device: str = "auto", sparsity: float = 0.875, seed: int = 0, log=print) -> dict:
    log = log or (lambda *a, **k: None)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
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
    q, k, v = smooth_video_qkv(grid_shape, heads, head_dim, device=dev, dtype=dtype, generator=gen)
    repeats = 10 if on_gpu else 2
    log(
        f"workload: grid {grid_shape} = {grid.num_tokens} tokens, {grid.num_tiles} tiles of 4x4x4,"
        f" {heads} heads, head_dim {head_dim}, {str(dtype).replace('torch.', '')}, {device}"
    )

    dense_ms, dense = _time(lambda: F.scaled_dot_product_attention(q, k, v), dev, repeats)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    rows = [dict(method="dense (SDPA)", ms=dense_ms, speedup=1.0, rel_l2=rel_l2(dense, ref))]
    # An untrained model's gate is zero (the coarse branch is learned during fine-tuning), so the
    # output compared with dense attention is the fine stage over the selected tiles.
    gate = torch.zeros_like(q)
    vsa_ms, vsa = _time(
        lambda: vidsparse.video_sparse_attn(q, k, v, grid, sparsity=sparsity, gate=gate),
        dev,
        repeats,
    )
    rows.append(
        dict(
            method=f"VSA sparsity {sparsity}",
            ms=vsa_ms,
            speedup=dense_ms / vsa_ms,
            rel_l2=rel_l2(vsa, ref),
        )
    )
    log(f"{'method':<22} {'time ms':>9} {'speedup':>8} {'rel L2 vs dense':>16}")
    for r in rows:
        log(f"{r['method']:<22} {r['ms']:>9.2f} {r['speedup']:>7.2f}x {r['rel_l2']:>16.4f}")
    return dict(
        workload=dict(
            grid=list(grid_shape),
            tokens=grid.num_tokens,
            heads=heads,
            head_dim=head_dim,
            dtype=str(dtype),
            device=device,
            inputs="synthetic smooth space-time fields",
            reduced=not on_gpu,
        ),
        results=rows,
        versions=dict(
            vidsparse=vidsparse.__version__,
            torch=torch.__version__,
            python=platform.python_version(),
        ),
    )
