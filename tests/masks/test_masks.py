"""Block-sparse index format: conversions, transpose, validation, random lists."""

from __future__ import annotations

import pytest
import torch

from vidsparse.masks.block_sparse import (
    block_density,
    dense_from_lists,
    lists_from_dense,
    random_block_lists,
    refine_block_lists,
    refine_block_sizes,
    transpose_block_lists,
    validate_block_lists,
)


def _random_map(bi, h, nq, nk, p=0.3, seed=0):
    """Random bool map with an empty row, a full row and (NK > 1) an empty column."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(bi, h, nq, nk, generator=g) < p
    m[0, 0, 0] = False  # empty row
    if nk > 1:
        m[0, 0, :, 1] = False  # empty column (of the first batch and head)
    m[-1, -1, -1] = True  # full row (of the last batch and head)
    return m


def _lists_row(kv_indices, kv_counts, b, h, i):
    return kv_indices[b, h, i, : int(kv_counts[b, h, i])].tolist()


# ---------------------------------------------------------------------------------------------
# lists <-> dense
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 3, 7, 5), (2, 3, 4, 9), (2, 1, 1, 1), (1, 2, 16, 16)])
def test_round_trip(shape):
    m = _random_map(*shape, seed=sum(shape))
    kv_indices, kv_counts = lists_from_dense(m)
    assert kv_indices.dtype == torch.int32 and kv_counts.dtype == torch.int32
    assert kv_indices.shape[:3] == shape[:3] and kv_counts.shape == shape[:3]
    assert kv_indices.shape[-1] == max(int(m.sum(-1).max()), 1)
    assert torch.equal(kv_counts, m.sum(-1).int())
    assert torch.equal(dense_from_lists(kv_indices, kv_counts, shape[-1]), m)
    # ascending, and tail entries 0
    bi, h, nq, _ = shape
    for b in range(bi):
        for hh in range(h):
            for i in range(nq):
                row = _lists_row(kv_indices, kv_counts, b, hh, i)
                assert row == sorted(row)
                assert row == m[b, hh, i].nonzero().flatten().tolist()
                assert kv_indices[b, hh, i, len(row) :].eq(0).all()


def test_lists_from_dense_empty_map_and_max_k():
    m = torch.zeros(1, 2, 3, 4, dtype=torch.bool)
    kv_indices, kv_counts = lists_from_dense(m)
    assert kv_indices.shape == (1, 2, 3, 1) and kv_counts.eq(0).all()
    m[0, 1, 2, :3] = True
    kv_indices, kv_counts = lists_from_dense(m, max_k=4)
    assert kv_indices.shape == (1, 2, 3, 4)
    assert kv_indices[0, 1, 2].tolist() == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="max_k"):
        lists_from_dense(m, max_k=2)
    with pytest.raises(TypeError, match="block_map"):
        lists_from_dense(m.int())


@pytest.mark.parametrize("shape", [(1, 2, 3, 0), (1, 1, 0, 0)])
def test_lists_from_dense_without_key_blocks_is_refused(shape):
    with pytest.raises(ValueError, match=r"block_map must have at least one key block"):
        lists_from_dense(torch.zeros(shape, dtype=torch.bool))


def test_lists_from_dense_chunked(monkeypatch):
    import vidsparse.masks.block_sparse as bs

    m = _random_map(2, 3, 11, 13, p=0.5, seed=7)
    expected = lists_from_dense(m)
    monkeypatch.setattr(bs, "_DENSE_CHUNK_ELEMS", 20)  # one or two rows per chunk
    got = lists_from_dense(m)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# ---------------------------------------------------------------------------------------------
# transpose
# ---------------------------------------------------------------------------------------------


def _transpose_brute(kv_indices, kv_counts, nk):
    bi, h, nq, _ = kv_indices.shape
    cols = [[[[] for _ in range(nk)] for _ in range(h)] for _ in range(bi)]
    for b in range(bi):
        for hh in range(h):
            for i in range(nq):
                for j in _lists_row(kv_indices, kv_counts, b, hh, i):
                    cols[b][hh][j].append(i)
    return cols


@pytest.mark.parametrize("bi", [1, 2])
@pytest.mark.parametrize("nq,nk", [(5, 8), (9, 4), (1, 3), (6, 1)])
def test_transpose_matches_brute_force(bi, nq, nk):
    h = 3
    m = _random_map(bi, h, nq, nk, p=0.4, seed=nq * 10 + nk + bi)
    kv_indices, kv_counts = lists_from_dense(m)
    # Garbage past the counts must be ignored.
    valid = torch.arange(kv_indices.shape[-1]) < kv_counts.unsqueeze(-1)
    kv_indices = torch.where(valid, kv_indices, torch.full_like(kv_indices, 99))
    # Shuffle the read entries of each row: the transpose must not rely on ascending input.
    perm = torch.rand(kv_indices.shape).masked_fill(~valid, 2.0).argsort(-1)
    kv_indices = kv_indices.gather(-1, perm)

    q_offsets, q_indices = transpose_block_lists(kv_indices, kv_counts, nk)
    k = kv_indices.shape[-1]
    assert q_offsets.dtype == torch.int32 and q_indices.dtype == torch.int32
    assert q_offsets.shape == (bi, h, nk + 1) and q_indices.shape == (bi, h, nq * k)
    expected = _transpose_brute(kv_indices, kv_counts, nk)
    for b in range(bi):
        for hh in range(h):
            off = q_offsets[b, hh].tolist()
            assert off[0] == 0
            for j in range(nk):
                got = q_indices[b, hh, off[j] : off[j + 1]].tolist()
                assert got == sorted(expected[b][hh][j]), (b, hh, j)
            assert q_indices[b, hh, off[nk] :].eq(0).all()
            assert off[nk] == int(kv_counts[b, hh].sum())


@pytest.mark.parametrize("nq,nk", [(7, 5), (4, 9)])
def test_transpose_by_groups_matches_brute_force(nq, nk):
    """With query groups each key block's query blocks come group by group, each ascending,
    and the offsets mark every (key block, group) span."""
    bi, h, num_groups = 2, 3, 3
    m = _random_map(bi, h, nq, nk, p=0.5, seed=nq + nk)
    kv_indices, kv_counts = lists_from_dense(m)
    q_groups = torch.randint(0, num_groups, (nq,), generator=torch.Generator().manual_seed(nq))
    q_offsets, q_indices = transpose_block_lists(kv_indices, kv_counts, nk, q_groups, num_groups)
    assert q_offsets.shape == (bi, h, nk * num_groups + 1)
    expected = _transpose_brute(kv_indices, kv_counts, nk)
    for b in range(bi):
        for hh in range(h):
            off = q_offsets[b, hh].tolist()
            for j in range(nk):
                for g in range(num_groups):
                    c = j * num_groups + g
                    got = q_indices[b, hh, off[c] : off[c + 1]].tolist()
                    want = sorted(i for i in expected[b][hh][j] if q_groups[i] == g)
                    assert got == want, (b, hh, j, g)
            assert off[-1] == int(kv_counts[b, hh].sum())


def test_transpose_groups_come_with_a_count():
    kv_indices, kv_counts = random_block_lists(1, 1, 4, 4, density=0.5)
    with pytest.raises(ValueError, match="num_groups"):
        transpose_block_lists(kv_indices, kv_counts, 4, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_groups"):
        transpose_block_lists(kv_indices, kv_counts, 4, None, 3)


def test_transpose_deterministic():
    kv_indices, kv_counts = random_block_lists(2, 4, 33, 29, density=0.3)
    a = transpose_block_lists(kv_indices, kv_counts, 29)
    b = transpose_block_lists(kv_indices, kv_counts, 29)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _good_lists():
    # batch 2, heads 3, NQ 4, NK 6, K 3
    kv_indices = torch.tensor([[0, 2, 5], [1, 0, 0], [3, 4, 0], [0, 0, 0]], dtype=torch.int32)
    kv_indices = kv_indices.expand(1, 3, 4, 3).clone()
    kv_counts = torch.tensor([3, 1, 2, 0], dtype=torch.int32).expand(1, 3, 4).clone()
    return kv_indices, kv_counts


def _validate(kv_indices, kv_counts, **over):
    kwargs = dict(batch=2, heads=3, num_q_blocks=4, num_kv_blocks=6, device="cpu")
    kwargs.update(over)
    validate_block_lists(kv_indices, kv_counts, **kwargs)


def test_validate_accepts_good_lists():
    kv_indices, kv_counts = _good_lists()
    _validate(kv_indices, kv_counts)
    _validate(kv_indices.expand(2, -1, -1, -1), kv_counts.expand(2, -1, -1))
    # entries past the count may hold anything
    kv_indices[0, 0, 3] = -7
    kv_indices[0, 0, 1, 1:] = 1
    _validate(kv_indices, kv_counts)


def test_validate_dtype():
    kv_indices, kv_counts = _good_lists()
    with pytest.raises(TypeError, match="kv_indices"):
        _validate(kv_indices.long(), kv_counts)
    with pytest.raises(TypeError, match="kv_counts"):
        _validate(kv_indices, kv_counts.long())


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda i, c: i.__setitem__((0, 1, 2, 1), 6), r"kv_indices.*\[0, num_kv_blocks=6\)"),
        (lambda i, c: i.__setitem__((0, 1, 0, 0), -1), r"kv_indices.*\[0, 1, 0, 0\]"),
        (lambda i, c: i.__setitem__((0, 2, 0, 2), 0), r"kv_indices.*distinct.*positions \[0, 2\]"),
        (lambda i, c: c.__setitem__((0, 1, 3), 4), r"kv_counts.*\[0, K=3\].*\[0, 1, 3\]"),
        (lambda i, c: c.__setitem__((0, 0, 1), -1), r"kv_counts.*\[0, 0, 1\] = -1"),
    ],
    ids=["index-too-large", "index-negative", "duplicate", "count-gt-K", "count-negative"],
)
def test_validate_values(mutate, match):
    kv_indices, kv_counts = _good_lists()
    mutate(kv_indices, kv_counts)
    with pytest.raises(ValueError, match=match):
        _validate(kv_indices, kv_counts)
    _validate(kv_indices, kv_counts, check_values=False)  # structure alone is fine


def test_validate_shapes():
    kv_indices, kv_counts = _good_lists()
    with pytest.raises(ValueError, match="kv_indices.*heads=4"):
        _validate(kv_indices, kv_counts, heads=4)
    with pytest.raises(ValueError, match="kv_indices.*batch=2"):
        _validate(kv_indices.expand(3, -1, -1, -1), kv_counts.expand(3, -1, -1))
    with pytest.raises(ValueError, match="kv_indices.*num_q_blocks=5"):
        _validate(kv_indices, kv_counts, num_q_blocks=5)
    with pytest.raises(ValueError, match="kv_counts.*shape"):
        _validate(kv_indices, kv_counts[:, :, :3])
    with pytest.raises(ValueError, match="kv_indices.*4 dimensions"):
        _validate(kv_indices[0], kv_counts)


def test_validate_device():
    kv_indices, kv_counts = _good_lists()
    with pytest.raises(ValueError, match="kv_indices.*cpu"):
        _validate(kv_indices.to("meta"), kv_counts.to("meta"))
    with pytest.raises(ValueError, match="kv_counts.*kv_indices"):
        _validate(kv_indices, kv_counts.to("meta"))
    # values are not inspected on meta
    _validate(kv_indices.to("meta"), kv_counts.to("meta"), device="meta")


# ---------------------------------------------------------------------------------------------
# random lists, density
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 5, 12])
def test_random_block_lists(count):
    g = torch.Generator().manual_seed(count)
    kv_indices, kv_counts = random_block_lists(2, 3, 10, 12, count=count, generator=g)
    assert kv_indices.shape == (2, 3, 10, max(count, 1)) and kv_indices.dtype == torch.int32
    assert kv_counts.eq(count).all() and kv_counts.dtype == torch.int32
    _validate(kv_indices, kv_counts, heads=3, num_q_blocks=10, num_kv_blocks=12)
    if count >= 2:
        assert (kv_indices[..., 1:] > kv_indices[..., :-1]).all()  # ascending, distinct
    # rows differ from one another (independent picks)
    if 0 < count < 12:
        assert len({tuple(r) for r in kv_indices.reshape(-1, count).tolist()}) > 1


def test_random_block_lists_density_and_ragged():
    kv_indices, kv_counts = random_block_lists(1, 2, 8, 16, density=0.25)
    assert kv_counts.eq(4).all()
    assert block_density(kv_counts, 16) == pytest.approx(0.25)
    assert random_block_lists(1, 1, 2, 16, density=0.01)[1].eq(1).all()  # at least 1

    counts = torch.tensor([0, 1, 3, 7], dtype=torch.int32)
    kv_indices, kv_counts = random_block_lists(2, 2, 4, 7, count=counts)
    assert kv_indices.shape == (2, 2, 4, 7)
    assert torch.equal(kv_counts, counts.expand(2, 2, 4))
    _validate(kv_indices, kv_counts, heads=2, num_kv_blocks=7)
    m = dense_from_lists(kv_indices, kv_counts, 7)
    assert torch.equal(m.sum(-1).int(), kv_counts)

    with pytest.raises(ValueError, match="exactly one"):
        random_block_lists(1, 1, 2, 4)
    with pytest.raises(ValueError, match="count"):
        random_block_lists(1, 1, 2, 4, count=5)
    with pytest.raises(ValueError, match="density"):
        random_block_lists(1, 1, 2, 4, density=1.5)


def test_block_density():
    assert block_density(torch.tensor([[[0, 2, 4]]], dtype=torch.int32), 4) == pytest.approx(0.5)


@pytest.mark.parametrize("ratio, kv_ratio", [(1, 2), (2, 1), (2, None), (2, 4), (4, 1)])
def test_refine_block_lists_is_the_upsampled_map(ratio, kv_ratio):
    """Refined lists give the block map with each block replaced by its sub-blocks."""
    nq, nk = 3, 4
    idx, cnt = random_block_lists(2, 2, nq, nk, count=torch.tensor([0, 1, 3]))
    fine_idx, fine_cnt = refine_block_lists(idx, cnt, ratio, kv_ratio)
    rk = ratio if kv_ratio is None else kv_ratio
    coarse = dense_from_lists(idx, cnt, nk)
    expected = coarse.repeat_interleave(ratio, dim=2).repeat_interleave(rk, dim=3)
    assert torch.equal(dense_from_lists(fine_idx, fine_cnt, nk * rk), expected)
    assert fine_idx.dtype == idx.dtype and fine_cnt.dtype == cnt.dtype


def test_refine_block_sizes_splits_real_tokens_first():
    sizes = torch.tensor([256, 173, 79, 0], dtype=torch.int32)
    assert refine_block_sizes(sizes, 2, 128).tolist() == [128, 128, 128, 45, 79, 0, 0, 0]
