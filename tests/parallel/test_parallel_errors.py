"""Ulysses' argument errors, in one process: with no process group at all, or with torch's
"fake" process group (a world size of 2 or 4 without the other processes) whose collectives
all fail, so each test also proves that the error came before any communication. The errors
every rank of a real group raises alike, and the error without a process group, are in
``test_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.masks.stripe import StripeSpec
from vidsparse.parallel import (
    UlyssesAttention,
    head_to_seq,
    seq_to_head,
    shard_sequence,
    ulysses_block_sparse_attn,
    ulysses_stripe_attn,
    ulysses_video_sparse_attn,
)


def _to_layout(x_bhsd: torch.Tensor, layout: str) -> torch.Tensor:
    return x_bhsd.transpose(1, 2) if layout == "bshd" else x_bhsd


def _qkv(B, H, S, D, *, seed=0, gate=False) -> dict:
    names = ("q", "k", "v", "gate") if gate else ("q", "k", "v")
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(B, H, S, D, generator=gen) for n in names}


@pytest.fixture
def fake_group(request, monkeypatch):
    """torch's in-process "fake" process group of size ``request.param`` (default 2), with every
    collective replaced by a failure, so a test proves that no communication was attempted."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        pytest.skip("torch's fake process group is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    world = getattr(request, "param", 2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    def no_comm(*args, **kwargs):
        raise AssertionError("a collective was started before the arguments were checked")

    for name in ("all_to_all_single", "all_gather", "all_to_all"):
        monkeypatch.setattr(dist, name, no_comm)
    yield world
    dist.destroy_process_group()


@pytest.mark.parametrize("fake_group", [2, 4], indirect=True)
def test_heads_not_divisible(fake_group):
    world = fake_group
    q = torch.randn(1, 8, 3, 4)  # [B, S/P, H=3, D]
    grid = VideoGrid((2, 2, 4 * world // 2), tile=(1, 2, 2))  # 8 tokens a rank
    padded = 4
    message = (
        rf"3 heads are not divisible by the world size {world}\. Pass pad_heads=True .* "
        rf"with {padded - 3} zero heads to {padded} \({padded // world} a rank"
    )
    with pytest.raises(ValueError, match=message):
        ulysses_video_sparse_attn(q, q, q, grid, topk=1)
    with pytest.raises(ValueError, match=message):
        UlyssesAttention()(lambda heads, q, k, v: q, q, q, q)
    with pytest.raises(ValueError, match="3 heads are not divisible"):
        seq_to_head(q)


def test_pad_heads_must_be_a_bool(fake_group):
    q = torch.randn(1, 8, 3, 4)
    with pytest.raises(TypeError, match="pad_heads must be a bool, got 1"):
        ulysses_video_sparse_attn(q, q, q, VideoGrid((2, 2, 4), tile=(1, 2, 2)), topk=1,
                                  pad_heads=1)  # fmt: skip
    with pytest.raises(TypeError, match="pad_heads must be a bool"):
        UlyssesAttention(pad_heads="yes")
    assert "pad_heads=True" in repr(UlyssesAttention(pad_heads=True))


def test_padded_heads_checks_count_the_real_heads(fake_group):
    """With pad_heads, per-head arguments still describe the model's H heads (the padding is
    internal), and head_chunks divides the padded heads of a rank."""
    grid = VideoGrid((2, 4, 4), tile=(1, 2, 2))  # 32 tokens: 16 per rank
    q = torch.randn(1, 16, 3, 8)  # H = 3, padded to 4: 2 a rank
    with pytest.raises(ValueError, match="one StripeSpec per head \\(H=3\\), got 4"):
        ulysses_stripe_attn(q, q, q, grid, [StripeSpec.dense()] * 4, pad_heads=True)
    idx, cnt = random_block_lists(1, 4, 2, 2, density=0.5)  # block 16: 2 query blocks
    with pytest.raises(ValueError, match="all H=3 heads"):
        ulysses_block_sparse_attn(q, q, q, idx, cnt, block_size=16, pad_heads=True)
    with pytest.raises(ValueError, match=r"head_chunks=4 must divide .* \(H/P = 4/2 = 2\)"):
        ulysses_video_sparse_attn(q, q, q, grid, topk=1, head_chunks=4, pad_heads=True)


def test_head_chunks_must_divide_the_rank_heads(fake_group):
    q = torch.randn(1, 8, 4, 4)  # [B, S/P, H=4, D]: 2 heads per rank
    grid = VideoGrid((2, 2, 4), tile=(1, 2, 2))
    with pytest.raises(ValueError, match=r"head_chunks=3 must divide the heads of a rank"):
        ulysses_video_sparse_attn(q, q, q, grid, topk=1, head_chunks=3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="head_chunks must be a positive int"):
            ulysses_video_sparse_attn(q, q, q, grid, topk=1, head_chunks=bad)
    with pytest.raises(ValueError, match="head_chunks must be a positive int"):
        UlyssesAttention(head_chunks=0)


def test_mismatched_local_shards(fake_group):
    q, k = torch.randn(1, 8, 2, 4), torch.randn(1, 9, 2, 4)
    with pytest.raises(ValueError, match="k must have the same local shape as q"):
        ulysses_block_sparse_attn(q, k, q, torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1))
    gate = torch.randn(1, 8, 2, 5)
    grid = VideoGrid((2, 2, 4), tile=(1, 2, 2))
    with pytest.raises(ValueError, match="gate must have the same local shape"):
        ulysses_video_sparse_attn(q, q, q, grid, topk=1, gate=gate)


def test_sequence_length_against_grid(fake_group):
    grid = VideoGrid((2, 2, 4), tile=(1, 2, 2))  # 16 tokens: 8 per rank
    q = torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match="must hold grid.num_tokens / world size = 8 tokens"):
        ulysses_video_sparse_attn(q, q, q, grid, topk=1)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="exactly one of topk and sparsity"):
        ulysses_video_sparse_attn(q, q, q, grid)


def test_block_lists_must_cover_all_heads(fake_group):
    q = torch.randn(1, 32, 4, 8)  # S = 64 over 2 ranks, H = 4
    idx, cnt = random_block_lists(1, 4, 4, 4, density=0.5)  # block 16: 4 query blocks
    with pytest.raises(ValueError, match="all H=4 heads"):
        ulysses_block_sparse_attn(q, q, q, idx[:, :2], cnt[:, :2], block_size=16)
    with pytest.raises(ValueError, match="S // block_q = 2 query-block rows"):
        ulysses_block_sparse_attn(q, q, q, idx, cnt, block_size=32)
    with pytest.raises(ValueError, match="not a multiple of block_q=48"):
        ulysses_block_sparse_attn(q, q, q, idx, cnt, block_size=48)


@pytest.mark.parametrize("block_size", [0, -16, (0, 16), (16, 0)])
def test_block_size_not_positive_is_refused_before_any_exchange(fake_group, block_size):
    q = torch.randn(1, 32, 4, 8)  # S = 64 over 2 ranks, H = 4
    idx, cnt = random_block_lists(1, 4, 4, 4, density=0.5)
    with pytest.raises(ValueError, match="block_size must be positive"):
        ulysses_block_sparse_attn(q, q, q, idx, cnt, block_size=block_size)


def test_specs_must_cover_all_heads(fake_group):
    grid = VideoGrid((2, 4, 4), tile=(1, 2, 2))  # 32 tokens: 16 per rank
    q = torch.randn(1, 16, 4, 8)
    with pytest.raises(ValueError, match="one StripeSpec per head \\(H=4\\), got 2"):
        ulysses_stripe_attn(q, q, q, grid, [StripeSpec.dense()] * 2)
    with pytest.raises(ValueError, match="text_tokens"):
        ulysses_stripe_attn(q, q, q, grid, [StripeSpec.dense()] * 4, text_tokens=3)


def test_sequence_not_divisible_by_the_world_size(fake_group):
    with pytest.raises(ValueError, match="sequence length 9 is not divisible by world size 2"):
        head_to_seq(torch.randn(1, 2, 9, 4))
    with pytest.raises(ValueError, match="sequence length 9 is not divisible by world size 2"):
        shard_sequence(torch.randn(1, 9, 2, 4))


def test_bad_layout_and_comm(fake_group):
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        seq_to_head(q, layout="bsh")
    with pytest.raises(ValueError, match="layout must be one of"):
        UlyssesAttention(layout="sbhd")
    with pytest.raises(ValueError, match="comm must be one of"):
        seq_to_head(q, comm="ring")


@pytest.mark.parametrize("fake_group", [1], indirect=True)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_world_size_one_is_the_plain_op(fake_group, layout, torch_backend):
    """A group of one exchanges nothing: the wrapper is the op, in the caller's layout."""
    from vidsparse.ops.video_sparse_attn import video_sparse_attn

    grid = VideoGrid((3, 4, 5), tile=(2, 2, 2))
    q, k, v, gate = _qkv(1, 2, grid.num_tokens, 8, seed=60, gate=True).values()
    ref = video_sparse_attn(q, k, v, grid, topk=3, gate=gate)
    args = [_to_layout(x, layout) for x in (q, k, v)]
    out = ulysses_video_sparse_attn(
        *args, grid, topk=3, gate=_to_layout(gate, layout), layout=layout
    )
    torch.testing.assert_close(out, _to_layout(ref, layout), rtol=0, atol=0)
