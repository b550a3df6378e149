"""``@triton.jit`` helpers shared by the forward and backward kernels."""

import triton
import triton.language as tl


@triton.jit
def num_full_blocks(KV_FULL, b, h, pid_m, stride_fb, stride_fh, stride_fq, count,
                     HAS_KV_SIZES: tl.constexpr):
    """How many leading entries of the list are full key blocks: all of them without
    key-block sizes, else ``KV_FULL`` (the lists were reordered by ``lists.full_blocks_first``)."""
    if HAS_KV_SIZES:
        return tl.load(KV_FULL + b * stride_fb + h * stride_fh + pid_m.to(tl.int64) * stride_fq)
    return count


@triton.jit
def load_rows(ptrs, real, MASKED: tl.constexpr, EVICT: tl.constexpr):
    """A tile of rows by pointers with eviction hint ``EVICT`` ("" none); ``MASKED``: rows whose
    ``real`` [rows] is False are not read (they come back 0)."""
    if MASKED:
        return tl.load(ptrs, mask=real[:, None], other=0.0, eviction_policy=EVICT)
    return tl.load(ptrs, eviction_policy=EVICT)
