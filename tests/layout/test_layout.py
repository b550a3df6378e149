"""VideoGrid: tile order, padding, round trips, gradients and argument errors."""

import math
import pickle

import pytest
import torch

from vidsparse.layout.grid import VideoGrid

GRIDS = [(21, 30, 52), (5, 7, 9), (1, 1, 1)]
TILES = [(4, 4, 4), (2, 8, 8), (1, 1, 1)]


def _tensor_with_tokens_at(dim: int, num_tokens: int, dtype=torch.float32) -> torch.Tensor:
    """A random tensor whose size along ``dim`` is ``num_tokens`` (other sizes small)."""
    shapes = {-2: (2, 3, num_tokens, 2), 1: (2, num_tokens, 3), 0: (num_tokens, 3)}
    return torch.randn(shapes[dim], dtype=dtype)


def _brute_force_tile_order(shape, tile):
    """Natural token indices in tile order, tile by tile, with a plain python loop."""
    T, H, W = shape
    tT, tH, tW = tile
    tiles = []
    for t0 in range(0, T, tT):
        for h0 in range(0, H, tH):
            for w0 in range(0, W, tW):
                tokens = [
                    t * H * W + h * W + w
                    for t in range(t0, min(t0 + tT, T))
                    for h in range(h0, min(h0 + tH, H))
                    for w in range(w0, min(w0 + tW, W))
                ]
                tiles.append(tokens)
    return tiles


# ---- sizes -------------------------------------------------------------------------------------


def test_sizes_of_wan_480p_grid():
    grid = VideoGrid((21, 30, 52), tile=(4, 4, 4))
    assert grid.shape == (21, 30, 52)
    assert grid.tile_shape == (4, 4, 4)
    assert grid.num_tokens == 32760
    assert grid.tiles == (6, 8, 13)
    assert grid.num_tiles == 624
    assert grid.tile_volume == 64
    assert grid.padded_len == 39936 == grid.num_tiles * grid.tile_volume


def test_default_tile_is_4x4x4():
    assert VideoGrid((8, 8, 8)).tile_shape == (4, 4, 4)


@pytest.mark.parametrize("shape", GRIDS + [(5, 6, 7)])
@pytest.mark.parametrize("tile", TILES + [(2, 4, 4)])
def test_tile_sizes_match_brute_force_count(shape, tile):
    grid = VideoGrid(shape, tile=tile)
    sizes = grid.tile_sizes
    assert sizes.dtype == torch.int32 and sizes.device.type == "cpu"
    assert sizes.shape == (grid.num_tiles,)
    assert int(sizes.sum()) == math.prod(shape)
    expected = [len(tokens) for tokens in _brute_force_tile_order(shape, tile)]
    assert sizes.tolist() == expected


# ---- order -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, tile", [((5, 6, 7), (2, 4, 4)), ((1, 3, 5), (1, 2, 2)), ((3, 1, 4), (2, 1, 3))]
)
def test_tile_order_matches_brute_force(shape, tile):
    grid = VideoGrid(shape, tile=tile)
    natural = torch.arange(grid.num_tokens, dtype=torch.float64).view(-1, 1) + 1  # 1-based
    tiled = grid.tile(natural, dim=0).view(grid.num_tiles, grid.tile_volume)

    for i, tokens in enumerate(_brute_force_tile_order(shape, tile)):
        real = tiled[i, : len(tokens)].long() - 1
        assert real.tolist() == tokens, f"tile {i}"
        assert (tiled[i, len(tokens) :] == 0).all(), f"tile {i} padding"


def test_docstring_example():
    grid = VideoGrid((1, 3, 5), tile=(1, 2, 2))
    tiled = grid.tile(torch.arange(15).view(15, 1) + 100, dim=0).view(6, 4) - 100
    expected = [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9], [10, 11], [12, 13], [14]]
    for row, tokens in zip(tiled.tolist(), expected):
        assert row[: len(tokens)] == tokens
    assert grid.tile_sizes.tolist() == [4, 4, 2, 2, 2, 1]


def test_index_tensors_are_consistent():
    grid = VideoGrid((5, 6, 7), tile=(2, 4, 4))
    index = grid.index_tensors()
    assert index.gather_index.dtype == torch.int64 and index.scatter_index.dtype == torch.int64
    assert index.gather_index.shape == (grid.padded_len,)
    assert index.scatter_index.shape == (grid.num_tokens,)
    assert torch.equal(index.valid, grid.real_token_mask("cpu"))
    assert int(index.valid.sum()) == grid.num_tokens
    # Scatter then gather is the identity on real tokens; padding points at a valid token.
    assert torch.equal(index.gather_index[index.scatter_index], torch.arange(grid.num_tokens))
    assert int(index.gather_index.min()) >= 0
    assert int(index.gather_index.max()) < grid.num_tokens
    # Real slots of tile i are exactly the first tile_sizes[i] slots.
    slots = index.valid.view(grid.num_tiles, grid.tile_volume)
    first = torch.arange(grid.tile_volume) < grid.tile_sizes.view(-1, 1)
    assert torch.equal(slots, first)
    # token_rows: the gather index on real slots, -1 on padding (the engine's gradient rows).
    assert index.token_rows.dtype == torch.int32
    assert torch.equal(index.token_rows[index.valid].long(), index.gather_index[index.valid])
    assert (index.token_rows[~index.valid] == -1).all()


def test_index_tensors_are_cached():
    grid = VideoGrid((5, 6, 7), tile=(2, 4, 4))
    assert grid.index_tensors() is VideoGrid((5, 6, 7), (2, 4, 4)).index_tensors("cpu")
    assert grid.tile_sizes_on("cpu") is grid.tile_sizes


def test_tile_coords():
    grid = VideoGrid((5, 6, 7), tile=(2, 4, 4))
    coords = grid.tile_coords()
    assert coords.dtype == torch.int64 and coords.shape == (grid.num_tiles, 3)
    Nt, Nh, Nw = grid.tiles
    expected = [(t, h, w) for t in range(Nt) for h in range(Nh) for w in range(Nw)]
    assert [tuple(c) for c in coords.tolist()] == expected
    index = (coords[:, 0] * Nh + coords[:, 1]) * Nw + coords[:, 2]
    assert torch.equal(index, torch.arange(grid.num_tiles))


# ---- round trips and padding -------------------------------------------------------------------


@pytest.mark.parametrize("shape", GRIDS)
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dim", [-2, 1, 0])
def test_untile_inverts_tile(shape, tile, dim):
    grid = VideoGrid(shape, tile=tile)
    x = _tensor_with_tokens_at(dim, grid.num_tokens)
    tiled = grid.tile(x, dim=dim)
    expected_shape = list(x.shape)
    expected_shape[dim] = grid.padded_len
    assert list(tiled.shape) == expected_shape
    assert torch.equal(grid.untile(tiled, dim=dim), x)


@pytest.mark.parametrize("dim", [-2, 1, 0])
def test_padding_slots_are_zero(dim):
    grid = VideoGrid((5, 7, 9), tile=(4, 4, 4))
    x = _tensor_with_tokens_at(dim, grid.num_tokens) + 3.0  # nowhere zero
    tiled = grid.tile(x, dim=dim).movedim(dim, 0)  # [padded_len, ...]
    valid = grid.real_token_mask()
    assert (tiled[~valid] == 0).all()
    assert (tiled[valid] != 0).all()


def test_padding_stays_zero_when_token_zero_is_not_finite():
    # Padding slots gather token 0 before they are cleared; an inf or NaN there must not leak.
    grid = VideoGrid((5, 7, 9), tile=(4, 4, 4))
    x = torch.randn(grid.num_tokens, 2)
    x[0, 0], x[0, 1] = float("inf"), float("nan")
    tiled = grid.tile(x, dim=0)
    assert (tiled[~grid.real_token_mask()] == 0).all()


def test_untile_ignores_padding_contents():
    grid = VideoGrid((5, 7, 9), tile=(4, 4, 4))
    x = torch.randn(2, grid.num_tokens, 3)
    tiled = grid.tile(x, dim=1)
    junk = tiled.masked_fill(~grid.real_token_mask().view(1, -1, 1), 7.0)
    assert torch.equal(grid.untile(junk, dim=1), x)


def test_dtypes_are_kept():
    grid = VideoGrid((3, 5, 6), tile=(2, 4, 4))
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool):
        x = torch.ones(grid.num_tokens, 2, dtype=dtype)
        tiled = grid.tile(x, dim=0)
        assert tiled.dtype == dtype
        assert torch.equal(grid.untile(tiled, dim=0), x)


# ---- gradients ---------------------------------------------------------------------------------


def test_tile_gradient_is_untile_of_weights():
    grid = VideoGrid((5, 7, 9), tile=(4, 4, 4))
    x = torch.randn(2, 3, grid.num_tokens, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 3, grid.padded_len, 4, dtype=torch.float64)
    (grid.tile(x) * weights).sum().backward()
    assert torch.equal(x.grad, grid.untile(weights))


def test_untile_gradient_is_tile_of_weights():
    grid = VideoGrid((5, 7, 9), tile=(4, 4, 4))
    y = torch.randn(2, grid.padded_len, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, grid.num_tokens, 4, dtype=torch.float64)
    (grid.untile(y, dim=1) * weights).sum().backward()
    # Padding slots do not reach the output, so their gradient is zero.
    assert torch.equal(y.grad, grid.tile(weights, dim=1))


def test_gradcheck():
    grid = VideoGrid((3, 3, 5), tile=(2, 2, 4))
    x = torch.randn(grid.num_tokens, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(grid.padded_len, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: grid.tile(t, dim=0), (x,))
    assert torch.autograd.gradcheck(lambda t: grid.untile(t, dim=0), (y,))


# ---- identity, hashing, repr -------------------------------------------------------------------


def test_equality_hash_repr_and_immutability():
    a = VideoGrid((5, 6, 7), tile=(2, 4, 4))
    b = VideoGrid([5, 6, 7], tile=[2, 4, 4])
    c = VideoGrid((5, 6, 7))
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    assert a != (5, 6, 7)
    text = repr(a)
    assert "VideoGrid" in text and "(5, 6, 7)" in text and "(2, 4, 4)" in text
    with pytest.raises(AttributeError):
        a.shape = (1, 1, 1)
    with pytest.raises(AttributeError):
        a.anything = 1
    assert pickle.loads(pickle.dumps(a)) == a


# ---- argument errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(shape=(0, 4, 4)), ValueError, "shape"),
        (dict(shape=(4, -1, 4)), ValueError, "shape"),
        (dict(shape=(4, 4)), ValueError, "shape"),
        (dict(shape=(4, 4, 4, 4)), ValueError, "shape"),
        (dict(shape=(4.0, 4, 4)), TypeError, "shape"),
        (dict(shape=(True, 4, 4)), TypeError, "shape"),
        (dict(shape=4), TypeError, "shape"),
        (dict(shape=(4, 4, 4), tile=(4, 0, 4)), ValueError, "tile"),
        (dict(shape=(4, 4, 4), tile=(4, 4)), ValueError, "tile"),
        (dict(shape=(4, 4, 4), tile=(4, 4, "4")), TypeError, "tile"),
    ],
)
def test_bad_grid_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        VideoGrid(**kwargs)


def test_wrong_sequence_length_names_argument_and_expected_size():
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    with pytest.raises(ValueError, match=r"x.*num_tokens=210"):
        grid.tile(torch.zeros(1, 2, 211, 8))
    with pytest.raises(ValueError, match=r"x.*padded_len=512"):
        grid.untile(torch.zeros(1, 2, 210, 8))
    with pytest.raises(ValueError, match=r"x.*num_tokens=210"):
        grid.tile(torch.zeros(210, 8), dim=1)  # right size, wrong dim


def test_bad_dim():
    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))
    x = torch.zeros(2, 210, 3)
    with pytest.raises(ValueError, match="dim"):
        grid.tile(x, dim=3)
    with pytest.raises(ValueError, match="dim"):
        grid.untile(x, dim=-4)
    with pytest.raises(TypeError, match="dim"):
        grid.tile(x, dim=1.0)
    with pytest.raises(TypeError, match="x"):
        grid.tile(x.numpy(), dim=1)
    with pytest.raises(ValueError, match="x"):
        grid.tile(torch.tensor(1.0))
