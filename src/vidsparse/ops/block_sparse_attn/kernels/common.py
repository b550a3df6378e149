"""``@triton.jit`` helpers shared by the forward and backward kernels."""

import triton
import triton.language as tl


@triton.jit
def walk_ends(KV_ENDS, b, h, pid_m, stride_eb, stride_eh, stride_eq, count,
              HAS_KV_SIZES: tl.constexpr, TAIL1: tl.constexpr, TAIL2: tl.constexpr):
    """Where the kernel's walks of the list end (``lists.blocks_by_size``'s groups): its full
    key blocks, then the partial ones walked with all ``BLOCK_N`` rows, then those walked with
    ``TAIL1`` rows; those walked with ``TAIL2`` rows end at ``count``. A kernel without a
    short walk (``TAIL1`` or ``TAIL2`` 0) walks the groups it would take with the walk before:
    its end is then ``count``. Without key-block sizes every entry is full. Clamped to
    ``count`` (and so to the lists' width), so every walk stays in the list."""
    if HAS_KV_SIZES:
        row = KV_ENDS + b * stride_eb + h * stride_eh + pid_m.to(tl.int64) * stride_eq
        end0 = tl.minimum(tl.load(row), count)
        end1 = count
        end2 = count
        if TAIL1 > 0:
            end1 = tl.minimum(tl.load(row + 1), count)
        if TAIL2 > 0:
            end2 = tl.minimum(tl.load(row + 2), count)
        return end0, end1, end2
    return count, count, count


@triton.jit
def load_rows(ptrs, real, MASKED: tl.constexpr, EVICT: tl.constexpr):
    """A tile of rows by pointers with eviction hint ``EVICT`` ("" none); ``MASKED``: rows whose
    ``real`` [rows] is False are not read (they come back 0)."""
    if MASKED:
        return tl.load(ptrs, mask=real[:, None], other=0.0, eviction_policy=EVICT)
    return tl.load(ptrs, eviction_policy=EVICT)


@triton.jit
def store_mapped_rows(OUT, b, h, rows, offs_d, stride_b, stride_h, stride_s, stride_d, x, real,
                      ROW_MAP):  # fmt: skip
    """Store ``x`` [R, D] (cast to OUT's type) for rows ``rows`` [R] of ``(b, h)`` at the rows
    ``ROW_MAP`` (int32, one entry a row) sends them to; rows whose entry is -1 or whose
    ``real`` is False are not stored (a gradient written in the caller's own row order)."""
    dest = tl.load(ROW_MAP + rows)
    keep = (dest >= 0) & real
    ptrs = OUT + b * stride_b + h * stride_h + dest.to(tl.int64)[:, None] * stride_s + offs_d[None, :] * stride_d
    tl.store(ptrs, x.to(OUT.dtype.element_ty), mask=keep[:, None])
