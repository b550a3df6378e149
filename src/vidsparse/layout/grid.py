"""``VideoGrid``: the map between natural (raster) token order and tile order.

Video DiTs flatten their latent ``(T, H, W)`` grid in raster order, ``n = t*H*W + h*W + w``.
Sparse attention works on 3-D tiles (4x4x4 by default), so every token of a tile must sit in one
contiguous block of ``tile_volume`` slots. ``VideoGrid.tile`` permutes natural order into that
tile order and pads partial edge tiles with zero slots; ``VideoGrid.untile`` is its exact
inverse.

Tile order, for a 2-D picture (T = 1, H = 3, W = 5, tile 1x2x2; ``.`` is a padding slot)::

    natural order (h, w)        tiles (h', w')         tile-order slots
     0  1 |  2  3 |  4          t0   | t1   | t2        t0: [ 0  1  5  6]
     5  6 |  7  8 |  9                                  t1: [ 2  3  7  8]
    ------+-------+---                                  t2: [ 4  9  .  .]
    10 11 | 12 13 | 14          t3   | t4   | t5        t3: [10 11  .  .]
                                                        t4: [12 13  .  .]
                                                        t5: [14  .  .  .]

Tiles are numbered ``(t'*Nh + h')*Nw + w'``; inside a tile its real tokens come first, in raster
order of the tile's own (possibly smaller) box, then the padding slots. So tile 2 above is a
2x1 box holding tokens 4 and 9, and ``tile_sizes == [4, 4, 2, 2, 2, 1]``.

The index tensors behind the permutation are built once per (shape, tile, device) and cached.
Under ``torch.compile`` Dynamo takes them from that cache on the host at trace time (they depend
on Python values only) and puts them into the graph as constants, so ``tile`` and ``untile``
compile without a graph break.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import torch

from vidsparse.layout import permute_ops
from vidsparse.utils import ceil_div
from vidsparse.utils.checks import bshd_hint, check_positive_ints, check_tensor
from vidsparse.utils.dynamo import host_constant

__all__ = ["VideoGrid", "TileIndex", "grid_key", "check_video_qkv"]


class TileIndex(NamedTuple):
    """Precomputed index tensors of one grid on one device (treat them as read-only)."""

    gather_index: torch.Tensor  # int64 [padded_len]: natural index of each tile-order slot
    scatter_index: torch.Tensor  # int64 [num_tokens]: tile-order slot of each natural token
    valid: torch.Tensor  # bool [padded_len]: slot holds a real token
    tile_sizes: torch.Tensor  # int32 [num_tiles]: real tokens in each tile
    token_rows: torch.Tensor  # int32 [padded_len]: natural index of each slot, -1 for padding


def _build_tile_index_cpu(shape: tuple[int, int, int], tile: tuple[int, int, int]) -> TileIndex:
    T, H, W = shape
    tT, tH, tW = tile
    Nt, Nh, Nw = ceil_div(T, tT), ceil_div(H, tH), ceil_div(W, tW)
    volume = tT * tH * tW
    num_tiles = Nt * Nh * Nw

    # Coordinates of every natural token, broadcast as [T, 1, 1], [1, H, 1], [1, 1, W].
    t = torch.arange(T).view(T, 1, 1)
    h = torch.arange(H).view(1, H, 1)
    w = torch.arange(W).view(1, 1, W)
    tile_t, tile_h, tile_w = t // tT, h // tH, w // tW
    local_t, local_h, local_w = t % tT, h % tH, w % tW

    # Extent of the box of the tile each token is in: full tiles have (tH, tW), edge tiles less.
    box_h = (H - tile_h * tH).clamp(max=tH)
    box_w = (W - tile_w * tW).clamp(max=tW)

    tile_id = (tile_t * Nh + tile_h) * Nw + tile_w  # [T, H, W]
    slot_in_tile = (local_t * box_h + local_h) * box_w + local_w  # raster order inside the box
    scatter_index = (tile_id * volume + slot_in_tile).reshape(-1)  # [num_tokens]

    num_tokens = T * H * W
    # Padding slots point at token 0: any valid index works because tile() zeroes them.
    gather_index = torch.zeros(num_tiles * volume, dtype=torch.int64)
    gather_index[scatter_index] = torch.arange(num_tokens)
    valid = torch.zeros(num_tiles * volume, dtype=torch.bool)
    valid[scatter_index] = True
    tile_sizes = torch.bincount(tile_id.reshape(-1), minlength=num_tiles).to(torch.int32)
    token_rows = torch.where(valid, gather_index, -1).to(torch.int32)
    return TileIndex(gather_index, scatter_index, valid, tile_sizes, token_rows)


@functools.lru_cache(maxsize=64)
def _tile_index_cached(
    shape: tuple[int, int, int], tile: tuple[int, int, int], device: torch.device
) -> TileIndex:
    if device.type == "cpu":
        return _build_tile_index_cpu(shape, tile)
    cpu = _tile_index_cached(shape, tile, torch.device("cpu"))
    return TileIndex(*(x.to(device) for x in cpu))


def grid_key(grid: VideoGrid) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(shape, tile_shape)`` of ``grid`` as plain ints, the grid's part of the key of the
    functions that Dynamo runs on the host (``vidsparse.utils.dynamo.host_constant``): they take
    Python constants, not the grid object (a grid built inside a compiled function is no real
    object at trace time). ``operator.index`` makes Dynamo specialize (guard on) each int, so
    a changed grid retraces instead of turning the ints into SymInts."""
    return (
        tuple(operator.index(n) for n in grid.shape),
        tuple(operator.index(n) for n in grid.tile_shape),
    )


@host_constant
def _tile_index(
    shape: tuple[int, int, int], tile: tuple[int, int, int], device: torch.device | str | None
) -> TileIndex:
    """The cached index tensors of the grid ``shape`` / ``tile`` on ``device``.

    Under ``torch.compile`` Dynamo runs this on the host at trace time instead of tracing it
    (the build uses ``bincount``, whose output shape depends on data, and the cache is an
    ``lru_cache``): the tensors enter the graph as constants. That is sound because they depend
    only on the Python values of the arguments, which Dynamo guards on.
    """
    return _tile_index_cached(shape, tile, _canonical_device(device))


def _canonical_device(device: torch.device | str | None) -> torch.device:
    """``cuda`` and ``cuda:0`` must share one cache entry, so always carry an explicit index."""
    device = torch.device("cpu" if device is None else device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return device


def _normalize_dim(dim, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"dim must be in [{-ndim}, {ndim}) for a tensor with {ndim} dims, got {dim}"
        )
    return dim % ndim


class VideoGrid:
    """A ``(T, H, W)`` latent video grid cut into ``tile``-shaped tiles.

    Immutable, hashable and comparable by ``(shape, tile_shape)``, so it can key caches and be
    passed to compiled code as a constant.

    Args:
        shape: ``(T, H, W)`` tokens along time, height and width.
        tile: ``(tT, tH, tW)`` tile shape; the grid need not be a multiple of it (edge tiles are
            partial and padded).
    """

    __slots__ = ("_shape", "_tile_shape")

    def __init__(self, shape, tile=(4, 4, 4)):
        object.__setattr__(self, "_shape", check_positive_ints("shape", shape, length=3))
        object.__setattr__(self, "_tile_shape", check_positive_ints("tile", tile, length=3))

    def __setattr__(self, name, value):
        raise AttributeError(f"VideoGrid is immutable; cannot set {name!r}")

    def __delattr__(self, name):
        raise AttributeError(f"VideoGrid is immutable; cannot delete {name!r}")

    def __eq__(self, other) -> bool:
        if not isinstance(other, VideoGrid):
            return NotImplemented
        return self._shape == other._shape and self._tile_shape == other._tile_shape

    def __hash__(self) -> int:
        return hash((VideoGrid, self._shape, self._tile_shape))

    def __repr__(self) -> str:
        return (
            f"VideoGrid(shape={self._shape}, tile={self._tile_shape}, tiles={self.tiles}, "
            f"num_tokens={self.num_tokens}, padded_len={self.padded_len})"
        )

    def __reduce__(self):
        return (VideoGrid, (self._shape, self._tile_shape))

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(T, H, W)``."""
        return self._shape

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """``(tT, tH, tW)``."""
        return self._tile_shape

    @property
    def num_tokens(self) -> int:
        """``T * H * W``: real tokens, the sequence length in natural order."""
        T, H, W = self._shape
        return T * H * W

    @property
    def tiles(self) -> tuple[int, int, int]:
        """``(Nt, Nh, Nw) = (ceil(T/tT), ceil(H/tH), ceil(W/tW))``."""
        return tuple(ceil_div(n, t) for n, t in zip(self._shape, self._tile_shape))

    @property
    def num_tiles(self) -> int:
        Nt, Nh, Nw = self.tiles
        return Nt * Nh * Nw

    @property
    def tile_volume(self) -> int:
        """Slots per tile, ``tT * tH * tW``."""
        tT, tH, tW = self._tile_shape
        return tT * tH * tW

    @property
    def padded_len(self) -> int:
        """Sequence length in tile order: ``num_tiles * tile_volume``."""
        return self.num_tiles * self.tile_volume

    @property
    def tile_sizes(self) -> torch.Tensor:
        """int32 ``[num_tiles]`` on the CPU: real tokens in each tile (read-only, cached)."""
        return self.tile_sizes_on("cpu")

    # ---- index tensors ---------------------------------------------------------------------

    def index_tensors(self, device: torch.device | str | None = None) -> TileIndex:
        """The cached gather / scatter / valid / tile_sizes tensors on ``device`` (read-only)."""
        return _tile_index(*grid_key(self), device)

    def tile_sizes_on(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 ``[num_tiles]`` real tokens per tile, on ``device`` (cached, read-only)."""
        return self.index_tensors(device).tile_sizes

    def real_token_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """bool ``[padded_len]``: True where a tile-order slot holds a real token (read-only)."""
        return self.index_tensors(device).valid

    def tile_coords(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 ``[num_tiles, 3]``: ``(t', h', w')`` of each tile, in tile order."""
        Nt, Nh, Nw = self.tiles
        index = torch.arange(self.num_tiles, device=_canonical_device(device))
        return torch.stack((index // (Nh * Nw), (index // Nw) % Nh, index % Nw), dim=-1)

    # ---- permutations ----------------------------------------------------------------------

    def tile(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Natural order -> tile order along ``dim`` (size ``num_tokens`` -> ``padded_len``).

        Padding slots hold zeros. Differentiable: the gradient of a padding slot is dropped.
        """
        check_tensor("x", x)
        dim = self._check_dim_size(x, dim, self.num_tokens, "num_tokens")
        if permute_ops.kernel_supports(x, dim, self.padded_len):
            # [B, H, S, D] on the Triton backend: one pass (gather + zero padding) in a kernel.
            return permute_ops.tile_op(x, *grid_key(self))
        index = self.index_tensors(x.device)
        tiled = x.index_select(dim, index.gather_index)
        # Padding slots gathered token 0; zero them out-of-place so autograd sees a plain op.
        # masked_fill (not a multiply) keeps them exactly zero even if token 0 is inf or NaN.
        pad_shape = [1] * x.ndim
        pad_shape[dim] = self.padded_len
        return tiled.masked_fill(~index.valid.view(pad_shape), 0)

    def untile(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Tile order -> natural order along ``dim`` (size ``padded_len`` -> ``num_tokens``).

        Exact inverse of :meth:`tile`; padding slots are dropped whatever they hold.
        """
        check_tensor("x", x)
        dim = self._check_dim_size(x, dim, self.padded_len, "padded_len")
        if permute_ops.kernel_supports(x, dim, self.padded_len):
            # [B, H, P, D] on the Triton backend: one pass that never reads padding slots.
            return permute_ops.untile_op(x, *grid_key(self))
        return x.index_select(dim, self.index_tensors(x.device).scatter_index)

    def _check_dim_size(self, x: torch.Tensor, dim, expected: int, what: str) -> int:
        if x.ndim == 0:
            raise ValueError("x must have at least one dimension, got a 0-d tensor")
        dim = _normalize_dim(dim, x.ndim)
        if x.shape[dim] != expected:
            raise ValueError(
                f"x must have size {what}={expected} along dim {dim} for {self!r}, "
                f"got shape {tuple(x.shape)}"
            )
        return dim


def check_video_qkv(grid, q, k, v, dtypes) -> None:
    """The shared checks of the video ops: a VideoGrid, and q, k, v as [B, H, S, D] tensors of
    one dtype and one shape."""
    if not isinstance(grid, VideoGrid):
        raise TypeError(f"grid must be a vidsparse.VideoGrid, got {type(grid).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4, dtypes=dtypes)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must have the same shape [B, H, S, D], got {tuple(q.shape)},"
            f" {tuple(k.shape)}, {tuple(v.shape)}"
        )
    # A [B, S, H, D] tensor: its dim 1 holds the video's tokens, its dim 2 fewer than that.
    if q.shape[1] >= grid.num_tokens > q.shape[2]:
        raise ValueError(
            f"q's sequence length (dim 2) {q.shape[2]} is shorter than the grid's "
            f"{grid.num_tokens} tokens{bshd_hint('q', q)}"
        )
