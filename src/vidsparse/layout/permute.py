"""One-pass Triton kernels for ``VideoGrid.tile`` / ``VideoGrid.untile`` on ``[B, H, S, D]``.

The PyTorch path (``index_select`` with the cached gather index, then ``masked_fill`` of the
padding slots) moves the tensor about three times; at Wan 14B 720p (40 heads, 75,600 tokens,
D = 128, bf16: 774 MB) it costs ~2.9 ms per call on an H200 where one pass takes ~0.55 ms.
These kernels read every real row once and write every output row once:

- ``tile_rows``:   natural ``[B, H, S, D]`` -> tile order ``[B, H, P, D]`` (``P = padded_len``);
  padding slots are written as zeros and never read from the input.
- ``untile_rows``: tile order ``[B, H, P, D]`` -> natural ``[B, H, S, D]``; padding slots are
  never read, so whatever they hold (NaN included) cannot leak.

Both iterate over *output* rows so the stores are contiguous; each program owns ``BLOCK_S``
output rows of one ``(batch, head)`` and computes, per row, where that row lives in the other
order from the grid and tile shapes alone (no index tensor is read: the map is a few integer
divisions per row, against ``D`` elements moved per row). A row of ``D`` elements is contiguous
in the input too whenever its last stride is 1, so the gathered loads are full-row loads.

Map (the one ``VideoGrid`` builds its index tensors from, in ``grid.py``): tile ``(t', h', w')``
covers the box of tokens ``[t'*tT, min(T, (t'+1)*tT)) x ...``; slot ``j`` of the tile holds the
``j``-th token of that box in raster order (``j < box volume``), the remaining slots are padding.

Launch configurations (warps, rows per program) are data in ``configs.py``.

Imported lazily (only when a kernel runs): importing vidsparse must not import Triton.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from vidsparse.layout.configs import MAX_BLOCK_ROWS, MIN_BLOCK_ROWS, row_copy_config
from vidsparse.layout.sizes import padded_len_of
from vidsparse.utils import ceil_div

__all__ = [
    "tile_slot_tokens",
    "copy_rows",
    "copy_rows_supports",
    "tile_rows",
    "untile_rows",
    "tile_rows_from_chunks",
    "untile_rows_to_chunks",
    "block_rows",
    "NUM_WARPS",
    "MIN_BLOCK_ROWS",
    "MAX_BLOCK_ROWS",
]

# The tile kernels' warps (the tunables live in configs.py; the compile-target tests read this).
NUM_WARPS = row_copy_config("tile").num_warps


def block_rows(head_dim: int, element_size: int, kernel: str = "tile") -> int:
    """Output rows per program of ``kernel``: its ``bytes_per_program`` of data, a power of two
    in its ``[min_block_rows, max_block_rows]``."""
    config = row_copy_config(kernel)
    rows = config.bytes_per_program // (head_dim * element_size)
    return max(config.min_block_rows, min(config.max_block_rows, triton.next_power_of_2(rows)))


@triton.jit
def tile_slot_tokens(
    slot, GRID_T, GRID_H, GRID_W, TILES_H, TILES_W,
    TILE_T: tl.constexpr, TILE_H: tl.constexpr, TILE_W: tl.constexpr,
):  # fmt: skip
    """``(token, real)`` of each tile-order slot: the natural index ``t*H*W + h*W + w`` of the
    token it holds (int32), and whether it holds one (False on padding slots and past the last
    tile). The map of the module docstring, a few integer divisions per slot."""
    VOLUME: tl.constexpr = TILE_T * TILE_H * TILE_W
    tile = slot // VOLUME  # constexpr divisor: shifts for power-of-two tiles
    j = slot - tile * VOLUME  # position inside the tile

    # Tile coordinates (t', h', w') and the first token of its box along each axis.
    tw = tile % TILES_W
    th = (tile // TILES_W) % TILES_H
    tt = tile // (TILES_W * TILES_H)
    t0 = tt * TILE_T
    h0 = th * TILE_H
    w0 = tw * TILE_W
    # Box extents: TILE_* inside the grid, less on its far edges. box_h, box_w >= 1 for every
    # slot (th < TILES_H, tw < TILES_W); box_t <= 0 only past the last tile.
    box_t = tl.minimum(GRID_T - t0, TILE_T)
    box_h = tl.minimum(GRID_H - h0, TILE_H)
    box_w = tl.minimum(GRID_W - w0, TILE_W)
    box_hw = box_h * box_w
    real = j < box_t * box_hw

    # Raster position inside the box -> natural token index.
    lt = j // box_hw
    rest = j - lt * box_hw
    lh = rest // box_w
    lw = rest - lh * box_w
    token = ((t0 + lt) * GRID_H + (h0 + lh)) * GRID_W + (w0 + lw)
    return token, real


@triton.jit
def _program_rows(num_blocks, heads):
    """``(bh, blk, b, h)`` of this program of a flat grid of ``B * heads * num_blocks``: its
    (batch, head) pair, its row block in it, and the batch and head (int64, for offsets)."""
    pid = tl.program_id(0)
    bh = pid // num_blocks
    blk = pid - bh * num_blocks
    return bh, blk, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)


@triton.jit
def _tile_rows_kernel(
    X, OUT,  # x [B, H, S, D] (any strides), out [B, H, P, D] contiguous
    stride_xb, stride_xh, stride_xs, stride_xd,
    chunk_len, stride_xc,  # token n lives at chunk n // chunk_len, row n % chunk_len of it
    XS, stride_sb, stride_sh, stride_ss, stride_sd,  # HAS_SELF: chunk self_chunk [B, H, S/C, D]
    self_chunk,  # HAS_SELF: that chunk comes from XS, and X holds the other chunks in order
    heads, num_blocks, padded_len,
    GRID_T, GRID_H, GRID_W, TILES_H, TILES_W,  # grid (T, H, W); tiles along H and W
    TILE_T: tl.constexpr, TILE_H: tl.constexpr, TILE_W: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SELF: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_S consecutive tile-order slots of one (batch, head). The row block is
    # the fast index of the flat grid, so neighbouring programs read neighbouring tiles.
    bh, blk, b, h = _program_rows(num_blocks, heads)

    slot = blk * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] int32 tile-order slot
    token, real = tile_slot_tokens(slot, GRID_T, GRID_H, GRID_W, TILES_H, TILES_W,
                                   TILE_T, TILE_H, TILE_W)  # fmt: skip
    token = tl.where(real, token, 0)  # padding slots: any in-range row (their load is masked)

    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    # Gathered load: one full row per real slot; padding slots are never read, they get 0.
    # The sequence may arrive in chunks (Ulysses' receive buffer: one per rank).
    chunk = token // chunk_len
    local = (token - chunk * chunk_len).to(tl.int64)  # row inside its chunk
    if HAS_SELF:  # Ulysses: this rank's own chunk never went through the exchange
        chunk = chunk - (chunk > self_chunk).to(tl.int32)  # the others, packed in rank order
    row = chunk.to(tl.int64) * stride_xc + local * stride_xs
    src = X + b * stride_xb + h * stride_xh + row[:, None] + offs_d[None, :] * stride_xd
    # src: [BLOCK_S, D]
    if HAS_SELF:
        own = (token // chunk_len == self_chunk)[:, None]  # [BLOCK_S, 1]
        src_own = XS + b * stride_sb + h * stride_sh + local[:, None] * stride_ss
        src = tl.where(own, src_own + offs_d[None, :] * stride_sd, src)
    rows = tl.load(src, mask=real[:, None], other=0.0)

    # Contiguous store of the [BLOCK_S, D] block of output rows.
    dst = OUT + bh.to(tl.int64) * padded_len * HEAD_DIM + slot.to(tl.int64)[:, None] * HEAD_DIM
    tl.store(dst + offs_d[None, :], rows, mask=(slot < padded_len)[:, None])


@triton.jit
def _untile_rows_kernel(
    X, OUT,  # x [B, H, P, D] (any strides), out [B, H, S, D] (unit stride on D)
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_ob, stride_oh, stride_os,
    chunk_len, stride_oc,  # token n goes to chunk n // chunk_len, row n % chunk_len of it
    heads, num_blocks, num_tokens,
    GRID_H, GRID_W, TILES_H, TILES_W,  # grid (H, W) (T is not needed); tiles along H and W
    TILE_T: tl.constexpr, TILE_H: tl.constexpr, TILE_W: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_S consecutive natural tokens of one (batch, head).
    bh, blk, b, h = _program_rows(num_blocks, heads)

    VOLUME: tl.constexpr = TILE_T * TILE_H * TILE_W
    n = blk * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] int32 natural token index
    in_range = n < num_tokens

    # Natural coordinates (t, h, w) of each token, then its tile and place inside the tile.
    plane = GRID_H * GRID_W
    t = n // plane
    rest = n - t * plane
    hh = rest // GRID_W
    w = rest - hh * GRID_W
    tt = t // TILE_T  # constexpr divisors
    th = hh // TILE_H
    tw = w // TILE_W
    lt = t - tt * TILE_T
    lh = hh - th * TILE_H
    lw = w - tw * TILE_W
    # Box extents of that tile (only H and W enter the raster index inside the box).
    box_h = tl.minimum(GRID_H - th * TILE_H, TILE_H)
    box_w = tl.minimum(GRID_W - tw * TILE_W, TILE_W)
    slot = ((tt * TILES_H + th) * TILES_W + tw) * VOLUME + (lt * box_h + lh) * box_w + lw
    slot = tl.where(in_range, slot, 0)  # [BLOCK_S] int32 tile-order slot of each token

    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    # Gathered load of full rows; padding slots are never addressed, so they cannot leak.
    src = (
        X
        + b * stride_xb
        + h * stride_xh
        + slot.to(tl.int64)[:, None] * stride_xs
        + offs_d[None, :] * stride_xd
    )  # [BLOCK_S, D]
    rows = tl.load(src, mask=in_range[:, None], other=0.0)

    # Store of the [BLOCK_S, D] block of natural rows (contiguous unless chunked / strided).
    chunk = n // chunk_len
    row = chunk.to(tl.int64) * stride_oc + (n - chunk * chunk_len).to(tl.int64) * stride_os
    dst = OUT + b * stride_ob + h * stride_oh + row[:, None]
    tl.store(dst + offs_d[None, :], rows, mask=in_range[:, None])


def tile_rows(x: torch.Tensor, shape, tile) -> torch.Tensor:
    """Natural ``[B, H, T*H*W, D]`` -> contiguous tile order ``[B, H, padded_len, D]``.

    The caller (``permute_ops``) has checked dtype, head dim and sizes.
    """
    B, heads, S, D = x.shape
    return _tile(x, (B, heads, S, D), x.stride(), shape, tile, chunk_len=S, stride_xc=0)


def tile_rows_from_chunks(
    x: torch.Tensor, shape, tile, own: torch.Tensor | None = None, own_chunk: int = 0
) -> torch.Tensor:
    """``x [C, B, H, S/C, D]``, the natural sequence in ``C`` consecutive chunks (as Ulysses
    receives it, one per rank) -> contiguous tile order ``[B, H, padded_len, D]``: the
    reassembly of the sequence and the tiling in one pass. With ``own`` (``[B, H, S/C, D]``,
    any strides), chunk ``own_chunk`` is read from it and ``x`` holds the other ``C - 1``
    chunks in order: a rank's own shard need not go through the exchange."""
    C, B, heads, chunk, D = x.shape
    stride_c, *strides = x.stride()
    if own is not None:
        C += 1
        if tuple(own.shape) != (B, heads, chunk, D) or own.dtype != x.dtype:
            raise ValueError(
                f"own chunk {tuple(own.shape)} {own.dtype} does not match the received"
                f" chunks {tuple(x.shape[1:])} {x.dtype}"
            )
    return _tile(x, (B, heads, chunk * C, D), strides, shape, tile, chunk_len=chunk,
                 stride_xc=stride_c, own=own, own_chunk=own_chunk)  # fmt: skip


def _tile(x, dims, strides, shape, tile, *, chunk_len: int, stride_xc: int, own=None,
          own_chunk: int = 0):  # fmt: skip
    """Launch over ``x`` seen as ``[B, H, S, D]`` with ``strides`` (b, h, s, d) inside a chunk."""
    B, heads, S, D = dims
    T, H, W = shape
    tT, tH, tW = tile
    Nh, Nw = ceil_div(H, tH), ceil_div(W, tW)
    P = padded_len_of(shape, tile)
    assert S == T * H * W, (S, shape)
    out = torch.empty((B, heads, P, D), dtype=x.dtype, device=x.device)
    block_s = block_rows(D, x.element_size(), "tile")
    num_blocks = ceil_div(P, block_s)
    with _launch_device(x):
        _tile_rows_kernel[(B * heads * num_blocks,)](
            x, out,
            *strides,
            chunk_len, stride_xc,
            x if own is None else own, *((0,) * 4 if own is None else own.stride()),
            own_chunk,
            heads, num_blocks, P,
            T, H, W, Nh, Nw,
            TILE_T=tT, TILE_H=tH, TILE_W=tW, HEAD_DIM=D, BLOCK_S=block_s,
            HAS_SELF=own is not None,
            num_warps=row_copy_config("tile").num_warps,
        )  # fmt: skip
    return out


def untile_rows(x: torch.Tensor, shape, tile, bshd: bool = False) -> torch.Tensor:
    """Tile order ``[B, H, padded_len, D]`` -> natural ``[B, H, T*H*W, D]``: contiguous, or
    (``bshd``) stored as a contiguous ``[B, T*H*W, H, D]``."""
    B, heads, _, D = x.shape
    S = math.prod(shape)
    if bshd:
        out = torch.empty((B, S, heads, D), dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        out = torch.empty((B, heads, S, D), dtype=x.dtype, device=x.device)
    _untile(x, shape, tile, out, *out.stride()[:3], chunk_len=out.shape[2], stride_oc=0)
    return out


def untile_rows_to_chunks(x: torch.Tensor, shape, tile, chunks: int) -> torch.Tensor:
    """Tile order ``[B, H, padded_len, D]`` -> natural order cut into ``chunks`` consecutive
    pieces, contiguous ``[chunks, B, H, S/chunks, D]`` (Ulysses' send buffer: piece ``r`` goes
    to rank ``r``): the untiling and the packing in one pass."""
    B, heads, _, D = x.shape
    S = math.prod(shape)
    out = torch.empty((chunks, B, heads, S // chunks, D), dtype=x.dtype, device=x.device)
    _untile(x, shape, tile, out, *out.stride()[1:4], chunk_len=S // chunks,
            stride_oc=out.stride(0))  # fmt: skip
    return out


def _untile(x, shape, tile, out, stride_ob, stride_oh, stride_os, *, chunk_len, stride_oc):
    B, heads, P, D = x.shape
    T, H, W = shape
    tT, tH, tW = tile
    Nh, Nw = ceil_div(H, tH), ceil_div(W, tW)
    S = T * H * W
    assert padded_len_of(shape, tile) == P, (P, shape, tile)
    block_s = block_rows(D, x.element_size(), "untile")
    num_blocks = ceil_div(S, block_s)
    with _launch_device(x):
        _untile_rows_kernel[(B * heads * num_blocks,)](
            x, out,
            *x.stride(),
            stride_ob, stride_oh, stride_os,
            chunk_len, stride_oc,
            heads, num_blocks, S,
            H, W, Nh, Nw,
            TILE_T=tT, TILE_H=tH, TILE_W=tW, HEAD_DIM=D, BLOCK_S=block_s,
            num_warps=row_copy_config("untile").num_warps,
        )  # fmt: skip
    return out


@triton.jit
def _copy_rows_kernel(
    SRC, DST,  # two views of one shape [N0, N1, N2, N3, D], unit-stride D
    n1, n2, n3, num_rows,
    stride_s0, stride_s1, stride_s2, stride_s3,
    stride_d0, stride_d1, stride_d2, stride_d3,
    HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_ROWS consecutive rows of the flat (N0, N1, N2, N3) index, D contiguous
    # elements each on both sides (full-row vector loads and stores whatever the permutation).
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [R]
    live = r < num_rows
    i3 = r % n3
    i2 = (r // n3) % n2
    i1 = (r // (n3 * n2)) % n1
    i0 = r // (n3 * n2 * n1)
    src = i0 * stride_s0 + i1 * stride_s1 + i2 * stride_s2 + i3 * stride_s3  # [R]
    dst = i0 * stride_d0 + i1 * stride_d1 + i2 * stride_d2 + i3 * stride_d3
    offs_d = tl.arange(0, HEAD_DIM)
    rows = tl.load(SRC + src[:, None] + offs_d[None, :], mask=live[:, None])  # [R, D]
    tl.store(DST + dst[:, None] + offs_d[None, :], rows, mask=live[:, None])


def copy_rows_supports(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether :func:`copy_rows` takes these views: one shape and dtype, at most 5 dims, the
    last one unit-stride on both sides and a power of two long."""
    D = src.shape[-1] if src.dim() else 0
    return (
        src.shape == dst.shape
        and src.dtype == dst.dtype
        and 1 <= src.dim() <= 5
        and src.stride(-1) == 1
        and dst.stride(-1) == 1
        and D > 0
        and D & (D - 1) == 0
    )


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for two GPU views :func:`copy_rows_supports` takes, as a Triton
    kernel moving whole rows: the layout changes of Ulysses' exchange (heads <-> sequence) at
    the memory bandwidth, where PyTorch's generic strided copy runs at about a third of it.
    Returns ``dst``."""
    if not copy_rows_supports(dst, src):
        raise ValueError(
            "copy_rows takes two views of one shape and dtype (<= 5 dims) with unit-stride rows"
            f" of a power-of-two length, got {tuple(src.shape)} {src.dtype} stride"
            f" {src.stride()} and {tuple(dst.shape)} {dst.dtype} stride {dst.stride()}"
        )
    if src.numel() == 0:
        return dst
    pad = 5 - src.dim()
    shape = (1,) * pad + tuple(src.shape)
    s_strides = (0,) * pad + tuple(src.stride())
    d_strides = (0,) * pad + tuple(dst.stride())
    D = shape[-1]
    num_rows = math.prod(shape[:-1])
    config = row_copy_config("copy_rows")
    block = block_rows(D, src.element_size(), "copy_rows")
    with _launch_device(src):
        _copy_rows_kernel[(ceil_div(num_rows, block),)](
            src, dst, shape[1], shape[2], shape[3], num_rows,
            *s_strides[:4], *d_strides[:4],
            HEAD_DIM=D, BLOCK_ROWS=block, num_warps=config.num_warps,
        )  # fmt: skip
    return dst


def _launch_device(x: torch.Tensor):
    """Launch on ``x``'s GPU even when another one is current; nothing to do on the CPU."""
    if x.device.type == "cuda":
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()
