"""The backward's transposed lists in Triton kernels (``lists.transpose_lists``): the same
offsets and indices, to the bit, as the sort in PyTorch (``masks.transpose_block_lists``, the
reference), with and without query groups, on lists in any order and with what no check saw
(counts out of ``[0, K]``, entries out of range, a pair listed twice); through a small config
too (many small programs, several steps of the offsets' loop); on the GPU at Wan's list sizes
and under a CUDA graph."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vidsparse.masks.block_sparse import random_block_lists, transpose_block_lists
from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn import lists as lists_mod
from vidsparse.ops.block_sparse_attn.lists import cached_transpose, transpose_lists

# Many programs at the tests' sizes (a few pairs, one or two columns each) and several steps
# of the offsets' loop (4 columns a step).
SMALL = dataclasses.replace(
    configs.LIST_TRANSPOSE, pair_elements=16, word_elements=2, offsets_step=4
)


def _lists(bi, h, nq, nk, k, seed):
    """Random lists (entries in random order), counts from -1 to K + 1, every fifth entry
    out of ``[0, NK)``."""
    gen = torch.Generator().manual_seed(seed)
    idx, _ = random_block_lists(bi, h, nq, nk, count=min(k, nk), generator=gen)
    idx = idx.gather(-1, torch.rand(idx.shape, generator=gen).argsort(-1))
    flat = idx.flatten()
    flat[::5] = torch.where(torch.arange(flat[::5].numel()) % 2 == 0, -3, nk + 7).to(idx.dtype)
    cnt = torch.randint(-1, idx.shape[-1] + 2, (bi, h, nq), generator=gen)
    return flat.view(idx.shape), cnt.to(torch.int32)


def _groups(nq, num_groups, seed):
    if num_groups == 1:
        return None
    return torch.randint(0, num_groups, (nq,), generator=torch.Generator().manual_seed(seed))


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == torch.int32 and g.shape == w.shape
        assert torch.equal(g, w)


@settings(max_examples=25, deadline=None)
@given(
    bi=st.integers(1, 2),
    h=st.integers(1, 3),
    nq=st.integers(1, 70),
    nk=st.integers(1, 40),
    k=st.integers(1, 12),
    num_groups=st.sampled_from([1, 3]),
    small=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_kernels_give_the_sorts_lists(bi, h, nq, nk, k, num_groups, small, seed):
    idx, cnt = _lists(bi, h, nq, nk, k, seed)
    q_groups = _groups(nq, num_groups, seed)
    with mock.patch.object(lists_mod, "LIST_TRANSPOSE", SMALL if small else configs.LIST_TRANSPOSE):
        got = transpose_lists(idx, cnt, nk, q_groups, num_groups)
    _assert_same(got, transpose_block_lists(idx, cnt, nk, q_groups, num_groups))


def test_strided_lists_and_counts_are_read_through_their_strides():
    idx, cnt = _lists(2, 3, 37, 20, 6, seed=3)
    idx_t = idx.transpose(0, 1).contiguous().transpose(0, 1)  # [Bi, H, ...] in [H, Bi] memory
    cnt_t = cnt.transpose(1, 2).contiguous().transpose(1, 2)
    assert not idx_t.is_contiguous() and not cnt_t.is_contiguous()
    with mock.patch.object(lists_mod, "LIST_TRANSPOSE", SMALL):
        got = transpose_lists(idx_t, cnt_t, 20, _groups(37, 3, 3), 3)
    _assert_same(got, transpose_block_lists(idx, cnt, 20, _groups(37, 3, 3), 3))


def test_a_pair_listed_twice_is_walked_once():
    """Lists changed behind the validation's back may repeat a key block in a row: the
    kernels list that query block once under it (the offsets count set bits, and both copies
    store to the one slot, so no slot of a column is left unwritten)."""
    idx = torch.tensor([[[[2, 2, 0], [1, 2, 1]]]], dtype=torch.int32)  # [1, 1, 2, 3]
    cnt = torch.tensor([[[3, 3]]], dtype=torch.int32)
    q_offsets, q_indices = transpose_lists(idx, cnt, 3)
    assert q_offsets.tolist() == [[[0, 1, 2, 4]]]
    assert q_indices.tolist() == [[[0, 1, 0, 1, 0, 0]]]


def test_empty_lists_give_empty_columns():
    idx = torch.zeros((1, 2, 4, 0), dtype=torch.int32)
    cnt = torch.zeros((1, 2, 4), dtype=torch.int32)
    q_offsets, q_indices = transpose_lists(idx, cnt, 5, _groups(4, 3, 0), 3)
    assert q_offsets.shape == (1, 2, 16) and not q_offsets.any()
    assert q_indices.shape == (1, 2, 0)


def test_the_backward_takes_the_kernels_and_the_sort_under_an_override():
    """``cached_transpose`` builds with the kernels by default and with the sort under
    ``override(transpose_kernels=False)``, each cached apart (an A/B times each arm's own)."""
    idx, cnt = _lists(1, 2, 30, 16, 5, seed=7)
    gen = torch.Generator().manual_seed(7)
    q_rows = torch.randint(1, 65, (30,), dtype=torch.int32, generator=gen)
    with mock.patch.object(lists_mod, "transpose_lists", wraps=transpose_lists) as kernels:
        by_kernels = cached_transpose(idx, cnt, 16, q_rows, 64, (32, 16))
        assert kernels.call_count == 1
        with configs.override(transpose_kernels=False):
            by_sort = cached_transpose(idx, cnt, 16, q_rows, 64, (32, 16))
        assert kernels.call_count == 1
        assert cached_transpose(idx, cnt, 16, q_rows, 64, (32, 16)) is by_kernels
    assert by_sort is not by_kernels
    _assert_same(by_kernels, by_sort)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "h,nq,k,num_groups",
    [(12, 624, 78, 3), (40, 1440, 180, 3), (12, 256, 32, 1), (2, 4100, 70, 1)],
    ids=["wan480p-vsa", "wan14b-720p-vsa", "engine-32k", "long"],
)
def test_gpu_the_kernels_give_the_sorts_lists_at_wans_sizes(h, nq, k, num_groups):
    idx, cnt = _lists(1, h, nq, nq, k, seed=nq)
    q_groups = _groups(nq, num_groups, nq)
    got = transpose_lists(idx.cuda(), cnt.cuda(), nq, None if q_groups is None else q_groups.cuda(),
                          num_groups)  # fmt: skip
    _assert_same([t.cpu() for t in got], transpose_block_lists(idx, cnt, nq, q_groups, num_groups))


@pytest.mark.gpu
def test_gpu_a_cuda_graph_captures_the_kernels():
    idx, cnt = (t.cuda() for t in _lists(1, 12, 624, 624, 78, seed=1))
    q_groups = _groups(624, 3, 1).cuda()
    transpose_lists(idx, cnt, 624, q_groups, 3)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = transpose_lists(idx, cnt, 624, q_groups, 3)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, transpose_block_lists(idx, cnt, 624, q_groups, 3))


def test_the_query_groups_are_derived_once_per_rows_tensor():
    """VSA's lists are new every call, its grid's rows are not: the groups come from the
    cache after the first call, and again from the rows after an in-place change."""
    gen = torch.Generator().manual_seed(11)
    q_rows = torch.randint(1, 65, (30,), dtype=torch.int32, generator=gen)
    with mock.patch.object(lists_mod, "query_groups", wraps=lists_mod.query_groups) as groups:
        for seed in (1, 2):
            idx, cnt = _lists(1, 2, 30, 16, 5, seed=seed)
            got = cached_transpose(idx, cnt, 16, q_rows, 64, (32, 16))
        assert groups.call_count == 1
        q_rows[0] = 64 if q_rows[0] < 64 else 8
        got = cached_transpose(idx, cnt, 16, q_rows, 64, (32, 16))
        assert groups.call_count == 2
    want_groups = lists_mod.query_groups(q_rows, 64, (32, 16))
    _assert_same(got, transpose_block_lists(idx, cnt, 16, want_groups, 3))
