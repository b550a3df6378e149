"""Launcher of the Hopper Gluon forward (``kernels/fwd_sm90.py``): descriptors, grid, options."""

from __future__ import annotations

import functools
import logging

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE, EngineCall, Epilogue
from vidsparse.ops.block_sparse_attn.grad_rows import GradRows, empty_output, output_map
from vidsparse.ops.block_sparse_attn.kernels.fwd_sm90 import (
    ROWS_PER_CONSUMER,
    block_sparse_attn_fwd_gluon_kernel,
    block_sparse_attn_fwd_gluon_tiles_kernel,
)
from vidsparse.ops.block_sparse_attn.kernels.fwd_sm90_persistent import (
    block_sparse_attn_fwd_gluon_persistent_kernel,
    block_sparse_attn_fwd_gluon_persistent_tiles_kernel,
)
from vidsparse.ops.block_sparse_attn.launch import (
    LOG2E,
    broadcast_strides,
    int32_contiguous,
    list_end_strides,
)
from vidsparse.utils.device import num_sms

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


def _int32_lists(kv_indices, ends) -> bool:
    """Can the persistent kernels, which read the lists with int32 offsets, take these?"""
    return max(kv_indices.numel(), ends.numel()) < 2**31


@functools.cache
def _log_one_block_fallback() -> None:
    """Once a process: the persistent kernels read the lists with int32 offsets."""
    logging.getLogger("vidsparse").warning(
        "vidsparse: GluonOptions.PERSISTENT reads the lists with int32 offsets; these have "
        "2**31 entries or more, so one block a program runs instead")  # fmt: skip


def _descriptors(q, k, v, o, block_kv, tails):
    """TMA descriptors over the [B*H*S, D] views: q, o in 64-row pieces, k, v in key blocks,
    then k, v in boxes of each short walk's rows (``tails``; a walk that does not run gets the
    key blocks' descriptors, never used). A short walk's box fills a [rows, D] tile at the
    start of a ring slot (``kernels/fwd_sm90._key_rows``), in the key blocks' shared layout."""
    D = q.shape[-1]
    rows = ROWS_PER_CONSUMER.value
    dtype = _GL_DTYPES[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([rows, D], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_kv, D], dtype)

    def desc(x, rows, layout):
        x2 = x.view(-1, D)  # [B*H*S, D]
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, D], layout)

    desc_k, desc_v = desc(k, block_kv, kv_layout), desc(v, block_kv, kv_layout)
    short = []
    for tail in tails:
        short += [desc(k, tail, kv_layout), desc(v, tail, kv_layout)] if tail else [desc_k, desc_v]
    return desc(q, rows, q_layout), desc_k, desc_v, desc(o, rows, q_layout), *short


def kernel_args(q, k, v, o, lse, kv_indices, kv_counts, block_q, block_kv, scale,
                kv_block_sizes=None, ends=None, tails=(0, 0),
                epilogue: Epilogue = NO_EPILOGUE,
                options: configs.GluonOptions | None = None,
                out_rows: GradRows | None = None):  # fmt: skip
    """``(kernel, grid, args, kwargs)`` of one launch (also used to compile for sm_90 without
    a GPU). With ``kv_block_sizes``, ``kv_indices`` must come ordered by
    ``lists.blocks_by_size`` with short walks of ``tails`` rows, and ``ends`` its ends; the
    kernel walks partial blocks with that many rows where the schedule says so
    (``GluonOptions.KEY_TAILS``), else with all rows. ``out_rows``: o (in its q side's layout,
    ``GradTargets.output``) is stored by pointers through its map, not by TMA."""
    B, H, Sq, D = q.shape
    nq = Sq // block_q
    has_sizes = kv_block_sizes is not None
    opts = options or configs.gluon_options()
    tails = tuple(tails) if has_sizes and opts.KEY_TAILS else (0, 0)
    sizes = kv_block_sizes if has_sizes else kv_counts  # dummy pointers when unused
    ends = ends if has_sizes else kv_counts
    call = EngineCall(block_q, block_kv, kv_block_sizes, scale, q.dtype)
    hook = (epilogue.fns().forward_sm90.fn, epilogue.forward_args(call))
    shared_block = block_q == 2 * ROWS_PER_CONSUMER.value  # split over the consumers, or one each
    per_head = nq if shared_block else (nq + 1) // 2  # a (b, h)'s blocks, or pairs of them
    persistent = ()  # the persistent kernels' two more arguments: tiles, programs
    persistent_fits = _int32_lists(kv_indices, ends)
    wants_persistent = opts.PERSISTENT if shared_block else opts.PERSISTENT_TILES
    if wants_persistent and not persistent_fits:
        _log_one_block_fallback()
    if wants_persistent and persistent_fits:
        programs = min(B * H * per_head, num_sms(q.device))
        kernel = (block_sparse_attn_fwd_gluon_persistent_kernel if shared_block
                  else block_sparse_attn_fwd_gluon_persistent_tiles_kernel)  # fmt: skip
        grid, persistent = (programs,), (B * H * per_head, programs)
    elif shared_block:
        kernel, grid = block_sparse_attn_fwd_gluon_kernel, (nq, B * H)
    else:
        kernel, grid = block_sparse_attn_fwd_gluon_tiles_kernel, (per_head, B * H)
    o_rows, mapped = output_map(out_rows, o)
    # A mapped o is stored by pointers: the q descriptor stands in for o's, never stored through.
    descs = _descriptors(q, k, v, q if mapped else o, block_kv, tails)
    args = (*descs, lse, (o, o_rows, *o.stride()), kv_indices, kv_counts, sizes, ends,
            *broadcast_strides(kv_indices), *broadcast_strides(kv_counts),
            *list_end_strides(ends), *hook, H, Sq, k.shape[2], nq, kv_indices.shape[-1],
            scale * LOG2E, *persistent)  # fmt: skip
    kwargs = dict(BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D, HAS_KV_SIZES=has_sizes,
                  TAIL1=tails[0], TAIL2=tails[1], **opts.as_kwargs(), OUT_MAPPED=mapped,
                  num_warps=4)  # fmt: skip
    return kernel, grid, args, kwargs


def block_sparse_attn_fwd_sm90(q, k, v, kv_indices, kv_counts, block_q=128, block_kv=128,
                               scale=None, *, kv_block_sizes=None, ends=None, tails=(0, 0),
                               epilogue: Epilogue = NO_EPILOGUE,
                               out_rows: GradRows | None = None):  # fmt: skip
    """Block-sparse attention forward (Gluon, Hopper); returns ``(o, lse)``.

    Inputs as ``gluon_fits`` says; lists int32 (converted once per list tensor otherwise),
    with ``kv_block_sizes`` ordered by ``lists.blocks_by_size`` (short walks of ``tails``
    rows) and ``ends`` its ends; ``out_rows``: o in its q side's order and layout
    (``GradTargets.output``). The launcher (``fwd.py``) has checked the rest; this raises
    only on what would make the kernel misread memory."""
    B, H, Sq, D = q.shape
    if not gluon_fits(q, k, v, block_q, block_kv):
        raise ValueError("block_sparse_attn_fwd_sm90: needs square 64 or 128 blocks, head_dim "
                         "128, bf16/fp16 and contiguous 16-byte aligned q, k, v")  # fmt: skip
    if (kv_block_sizes is None) != (ends is None):
        raise ValueError("kv_block_sizes and ends go together (lists.blocks_by_size)")
    if ends is not None and (ends.dtype != torch.int32 or ends.shape[-1] != 3
                             or ends.stride(-1) != 1):  # fmt: skip
        raise ValueError("ends: int32 [..., 3] with a unit last stride (lists.blocks_by_size)")
    kv_indices = int32_contiguous(kv_indices)
    if kv_counts.dtype != torch.int32:
        kv_counts = int32_contiguous(kv_counts)
    if scale is None:
        scale = D**-0.5
    o = empty_output(q, out_rows)  # [B, H, Sq, D], or the q side's rows of out_rows
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)  # [B, H, Sq]
    kernel, grid, args, kwargs = kernel_args(q, k, v, o, lse, kv_indices, kv_counts, block_q,
                                             block_kv, scale, kv_block_sizes, ends, tails,
                                             epilogue, out_rows=out_rows)  # fmt: skip
    kernel[grid](*args, **kwargs)
    return o, lse
