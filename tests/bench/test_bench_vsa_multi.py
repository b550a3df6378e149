"""The vsa_multi benchmark's KV-cache variants compute the same attention."""

from __future__ import annotations

import torch

from vidsparse.bench.ops import vsa_multi
from vidsparse.layout.grid import VideoGrid
from vidsparse.testing import assert_rel_l2


def test_a_tile_order_cache_gives_the_natural_order_output(torch_backend):
    grid, kv_grid = VideoGrid(vsa_multi.TINY_GRIDS["480p-last4"]), VideoGrid((5, 6, 7))
    q, k, v, gate = vsa_multi.make_inputs([grid], 2, 16, "cpu", torch.float64, 0, [kv_grid])
    natural = vsa_multi._ours([grid], [kv_grid], topk=3)(q, k, v, gate)
    cached = vsa_multi._cached_tiles(grid, kv_grid, topk=3)(
        q, kv_grid.tile(k), kv_grid.tile(v), gate
    )
    assert cached.shape == natural.shape
    assert_rel_l2("o", cached, natural, 1e-12)  # fp64
