"""Launcher of the Hopper Gluon forward (``kernels/fwd_sm90.py``): descriptors, grid, options."""

from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE, EngineCall, Epilogue
from vidsparse.ops.block_sparse_attn.kernels.fwd_sm90 import (
    ROWS_PER_CONSUMER,
    block_sparse_attn_fwd_gluon_kernel,
    block_sparse_attn_fwd_gluon_tiles_kernel,
)
from vidsparse.ops.block_sparse_attn.launch import LOG2E, broadcast_strides, int32_contiguous

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def gluon_fits(q, k, v, block_q: int, block_kv: int) -> bool:
    """Can the Gluon kernel take these inputs? Square blocks of ``configs.GLUON_BLOCKS``, its
    head dims and dtypes, and q, k, v contiguous with 16-byte aligned bases (the TMA
    descriptors view them as [B*H*S, D])."""
    return (
        block_q == block_kv
        and block_q in configs.GLUON_BLOCKS
        and q.shape[-1] in configs.GLUON_HEAD_DIMS
        and q.dtype in configs.GLUON_DTYPES
        and all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (q, k, v))
    )


def _descriptors(q, k, v, o, block_kv):
    """TMA descriptors over the [B*H*S, D] views: q, o in 64-row pieces, k, v in key blocks."""
    D = q.shape[-1]
    rows = ROWS_PER_CONSUMER.value
    dtype = _GL_DTYPES[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([rows, D], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_kv, D], dtype)

    def desc(x, rows, layout):
        x2 = x.view(-1, D)  # [B*H*S, D]
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, D], layout)

    return (desc(q, rows, q_layout), desc(k, block_kv, kv_layout), desc(v, block_kv, kv_layout),
            desc(o, rows, q_layout))  # fmt: skip


def kernel_args(q, k, v, o, lse, kv_indices, kv_counts, block_q, block_kv, scale,
                kv_block_sizes=None, full_counts=None, epilogue: Epilogue = NO_EPILOGUE,
                options: configs.GluonOptions | None = None):  # fmt: skip
    """``(kernel, grid, args, kwargs)`` of one launch (also used to compile for sm_90 without
    a GPU). With ``kv_block_sizes``, ``kv_indices`` must list each row's full blocks first and
    ``full_counts`` count them (``lists.blocks_by_size``: its first end)."""
    B, H, Sq, D = q.shape
    nq = Sq // block_q
    has_sizes = kv_block_sizes is not None
    sizes = kv_block_sizes if has_sizes else kv_counts  # dummy pointers when unused
    full = full_counts if has_sizes else kv_counts
    call = EngineCall(block_q, block_kv, kv_block_sizes, scale, q.dtype)
    hook = (epilogue.fns().forward_sm90.fn, epilogue.forward_args(call))
    if block_q == 2 * ROWS_PER_CONSUMER.value:
        kernel, grid = block_sparse_attn_fwd_gluon_kernel, (nq, B * H)
    else:
        kernel, grid = block_sparse_attn_fwd_gluon_tiles_kernel, ((nq + 1) // 2, B * H)
    args = (*_descriptors(q, k, v, o, block_kv), lse, kv_indices, kv_counts, sizes, full,
            *broadcast_strides(kv_indices), *broadcast_strides(kv_counts),
            *broadcast_strides(full), *hook, H, Sq, k.shape[2], nq, kv_indices.shape[-1],
            scale * LOG2E)  # fmt: skip
    opts = (options or configs.gluon_options()).as_kwargs()
    kwargs = dict(BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D, HAS_KV_SIZES=has_sizes,
                  **opts, num_warps=4)  # fmt: skip
    return kernel, grid, args, kwargs


def block_sparse_attn_fwd_sm90(q, k, v, kv_indices, kv_counts, block_q=128, block_kv=128,
                               scale=None, *, kv_block_sizes=None, full_counts=None,
                               epilogue: Epilogue = NO_EPILOGUE):  # fmt: skip
    """Block-sparse attention forward (Gluon, Hopper); returns ``(o, lse)``.

    Inputs as ``gluon_fits`` says; lists int32 (converted once per list tensor otherwise),
    with ``kv_block_sizes`` reordered full blocks first and counted by ``full_counts``. The
    launcher (``fwd.py``) has checked the rest; this raises only on what would make the
    kernel misread memory."""
    B, H, Sq, D = q.shape
    if not gluon_fits(q, k, v, block_q, block_kv):
        raise ValueError("block_sparse_attn_fwd_sm90: needs square 64 or 128 blocks, head_dim "
                         "128, bf16/fp16 and contiguous 16-byte aligned q, k, v")  # fmt: skip
    if (kv_block_sizes is None) != (full_counts is None):
        raise ValueError("kv_block_sizes and full_counts go together (lists.blocks_by_size)")
    kv_indices = int32_contiguous(kv_indices)
    if kv_counts.dtype != torch.int32:
        kv_counts = int32_contiguous(kv_counts)
    if scale is None:
        scale = D**-0.5
    o = torch.empty_like(q)  # [B, H, Sq, D]
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)  # [B, H, Sq]
    kernel, grid, args, kwargs = kernel_args(q, k, v, o, lse, kv_indices, kv_counts, block_q,
                                             block_kv, scale, kv_block_sizes, full_counts,
                                             epilogue)  # fmt: skip
    kernel[grid](*args, **kwargs)
    return o, lse
