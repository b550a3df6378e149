"""Per-kernel GPU time of VSA's KV-cache case, with and without ``fill_sms`` (torch.profiler).

    PYTHONPATH=src python benchmarks/profile/profile_kv_cache.py

Queries of the last 4 latent frames of Wan 2.1 1.3B at 480p over a 21-frame cache kept in tile
order, 12 heads of 128, bf16, sparsity 0.875, with a gate (the ``vsa_multi`` kv-cache case).
Per setting: the call's time replayed from a CUDA graph and eagerly (``harness``), then the
mean CUDA time of each kernel over 10 calls. The setting without ``fill_sms`` runs the coarse
top-k in the table's blocks of 32 query tiles; the first setting is repeated last (A/B/A).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import vidsparse
from vidsparse.bench import harness
from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.video_sparse_attn import coarse


def main() -> None:
    grid, kv_grid = VideoGrid((4, 30, 52)), VideoGrid((21, 30, 52))
    device = torch.device("cuda")

    def randn(n):
        return torch.randn(1, 12, n, 128, device=device, dtype=torch.bfloat16)

    q, gate = randn(grid.num_tokens), randn(grid.num_tokens)
    k_t, v_t = kv_grid.tile(randn(kv_grid.num_tokens)), kv_grid.tile(randn(kv_grid.num_tokens))

    def call():
        o_t = vidsparse.video_sparse_attn(
            grid.tile(q), k_t, v_t, grid, kv_grid=kv_grid, gate=grid.tile(gate), tiled=True,
            sparsity=0.875,
        )  # fmt: skip
        return grid.untile(o_t)

    real = coarse.fill_sms
    settings = (("fill_sms on", real), ("fill_sms off", lambda cfg, *a: cfg), ("fill_sms on", real))
    try:
        for name, fill in settings:
            coarse.fill_sms = fill
            with torch.no_grad():
                graph_ms, how = harness.time_graph_ms(call, device=device)
                eager_ms = harness.time_ms(call, device=device)
            print(f"{name}: {graph_ms:.3f} ms ({how}), eager {eager_ms:.3f} ms", flush=True)
            with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call()
                torch.cuda.synchronize()
            for event in prof.key_averages():
                if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
                    per_call = event.self_device_time_total / 10
                    print(f"   {event.key[:60]:<60} {per_call:8.1f} us a call")
    finally:
        coarse.fill_sms = real


if __name__ == "__main__":
    main()
