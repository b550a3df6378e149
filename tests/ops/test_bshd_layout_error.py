"""A [B, S, H, D] tensor where [B, H, S, D] is expected: the error says so, on every op."""

from __future__ import annotations

import pytest
import torch

import vidsparse

GRID = vidsparse.VideoGrid((4, 8, 8))  # 256 tokens, 4 tiles of 64


def _bshd():
    return torch.randn(1, GRID.num_tokens, 2, 16)  # [B, S, H, D]: 256 tokens, 2 heads


CALLS = {
    "video_sparse_attn": lambda x: vidsparse.video_sparse_attn(x, x, x, GRID, topk=2),
    "stripe_attn": lambda x: vidsparse.stripe_attn(
        x,
        x,
        x,
        vidsparse.VideoGrid((4, 8, 8), tile=(1, 4, 4)),
        [vidsparse.StripeSpec(1, 0, None, 1, 0, None)] * 2,
    ),  # fmt: skip
    "sliding_tile_attn": lambda x: vidsparse.sliding_tile_attn(x, x, x, GRID, window=(1, 1, 1)),
}


@pytest.mark.parametrize("op", CALLS)
def test_video_ops_name_the_bshd_layout(torch_backend, op):
    with pytest.raises(ValueError, match=r"looks like \[B, S, H, D\].*transpose\(1, 2\)"):
        CALLS[op](_bshd())
    CALLS[op](_bshd().transpose(1, 2))  # the fix the message gives runs


def test_engine_names_the_bshd_layout(torch_backend):
    q = torch.randn(1, 128, 2, 16)  # [B, S=128, H=2, D]
    idx = torch.zeros(1, 2, 2, 1, dtype=torch.int32)
    cnt = torch.ones(1, 2, 2, dtype=torch.int32)
    bshd = r"not a multiple of block_q=64.*looks like \[B, S, H, D\]"
    with pytest.raises(ValueError, match=bshd):
        vidsparse.block_sparse_attn(q, q, q, idx, cnt, block_size=64)
    t = q.transpose(1, 2)
    vidsparse.block_sparse_attn(t, t, t, idx, cnt, block_size=64)
