"""The interpreter probe's kernel (``interpreter.py`` beside it): one ``tl.dot`` of an N x N tile."""

import triton
import triton.language as tl


@triton.jit
def dot_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    x = tl.load(X + offs)
    tl.store(Y + offs, tl.dot(x, x))
