"""Whether Triton's CPU interpreter computes bfloat16 (``TRITON_INTERPRET=1``).

Triton 3.6-3.8's interpreter keeps bf16 as its raw 16 bits and its ``tl.dot`` multiplies those
bits, so a kernel's result is off by ~1e10 with no error of its own (Triton does not support
bf16 there). The ops refuse bf16 CPU tensors on that path unless this probe finds a ``tl.dot``
that computes: a Triton that fixed it, or a test's shim of the interpreter.
"""

from __future__ import annotations

import torch

from vidsparse.utils.dynamo import host_constant

_PROBED: dict = {}  # {the interpreter's dot and cast implementations: it computes bf16}


@host_constant
def interpreter_computes_bf16() -> bool:
    """Run a 16x16 bf16 ``tl.dot`` of small integers (exact in bf16 and fp32) in the
    interpreter and compare; cached per interpreter implementation (a patched ``create_dot``
    is probed again)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    key = (builder.create_dot, builder.cast_impl)
    if key not in _PROBED:
        _PROBED[key] = _probe()
    return _PROBED[key]


def _probe() -> bool:
    from vidsparse.ops.block_sparse_attn.kernels.interpreter_probe import dot_kernel

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (16, 16), generator=gen).to(torch.bfloat16)
    y = torch.empty(16, 16, dtype=torch.float32)
    dot_kernel[(1,)](x, y, 16)
    return torch.equal(y, x.float() @ x.float())
