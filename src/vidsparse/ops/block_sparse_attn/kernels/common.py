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
