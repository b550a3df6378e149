"""Launchers of the Hopper Gluon backward kernels (``kernels/bwd_sm90.py``): descriptors, grid,
options. The engine's backward (``bwd.py``) takes each where its config asks for it
(``KernelConfig.gluon``) and the inputs and the epilogue fit (``gluon_bwd_fits``;
``dkdv_hook_fits``, ``dq_hook_fits``)."""

from __future__ import annotations

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE, EngineCall, Epilogue
from vidsparse.ops.block_sparse_attn.fwd_sm90 import gluon_fits
from vidsparse.ops.block_sparse_attn.kernels import no_epilogue
from vidsparse.ops.block_sparse_attn.kernels.bwd import block_sparse_attn_bwd_dq_from_fixed_kernel
from vidsparse.ops.block_sparse_attn.kernels.bwd_sm90 import (
    ROWS_PER_CONSUMER,
    STEP_M,
    block_sparse_attn_bwd_dkdv_gluon_kernel,
    block_sparse_attn_bwd_dkdv_gluon_tiles_kernel,
    block_sparse_attn_bwd_dq_gluon_kernel,
    block_sparse_attn_bwd_dq_gluon_tiles_kernel,
)
from vidsparse.ops.block_sparse_attn.kernels.bwd_sm90_fused import (
    block_sparse_attn_bwd_dkdvdq_gluon_kernel,
    block_sparse_attn_bwd_dkdvdq_ordered_gluon_kernel,
)
from vidsparse.ops.block_sparse_attn.kernels.bwd_sm90_persistent import (
    block_sparse_attn_bwd_dkdv_gluon_persistent_kernel,
    block_sparse_attn_bwd_dq_gluon_persistent_kernel,
)
from vidsparse.ops.block_sparse_attn.launch import LOG2E, broadcast_strides, int32_contiguous
from vidsparse.ops.block_sparse_attn.lists import cached_dkdv_walk, cached_dq_walk
from vidsparse.utils.device import num_sms

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
              torch.int32: gl.int32}  # fmt: skip


def gluon_bwd_fits(q, k, v, do, block_q: int, block_kv: int) -> bool:
    """Can the Gluon dK/dV and dQ kernels take these inputs? The Gluon forward's rule
    (``fwd_sm90.gluon_fits``), and ``do`` like q. With key-block sizes too: the caller vouches
    the padding finite, as for any TMA read of keys."""
    return (
        gluon_fits(q, k, v, block_q, block_kv)
        and do.dtype == q.dtype
        and do.shape == q.shape
        and do.is_contiguous()
        and do.data_ptr() % 16 == 0
    )


def dkdv_hook_fits(epilogue: Epilogue, block: int) -> bool:
    """Does ``epilogue`` have a Gluon dK/dV hook this kernel can call at ``block``? Its
    ``dkdv_sm90``; a client's own hook (not the identity) only at 64-row blocks: the 128-row
    kernel hands the hook each 64-row half of a key block apart, and the contract
    (``dk, dv = f(dk, dv, b, h, kv_block, dims)``) has no rows argument."""
    fns = epilogue.fns()
    if fns.dkdv_sm90 is None:
        return False
    return fns.dkdv.fn is no_epilogue.dkdv_identity or block == ROWS_PER_CONSUMER.value


def dkdv_hook(epilogue: Epilogue, block: int):
    """The Gluon dK/dV hook of ``epilogue`` (``dkdv_hook_fits`` says where there is one)."""
    if not dkdv_hook_fits(epilogue, block):
        raise ValueError(
            f"epilogue {epilogue.name!r} has no Gluon dK/dV hook for {block}-row key blocks"
            " (EpilogueFns.dkdv_sm90; a client's own only at 64 rows)"
        )
    return epilogue.fns().dkdv_sm90.fn


def dq_hook_fits(epilogue: Epilogue) -> bool:
    """Does ``epilogue`` have a Gluon dQ hook (``EpilogueFns.dq_sm90``)? Each consumer hands
    it its 64 rows with their ``local_rows``, as the contract says."""
    return epilogue.fns().dq_sm90 is not None


def _tiles(*xs, cols: int | None = None):
    """TMA descriptors of [B, H, S, D] tensors as [B*H*S, D] views in 64-row tiles of ``cols``
    columns (all D by default; the one-pass kernel's fp32 dQ reductions take D / 2)."""
    D = xs[0].shape[-1]
    block = [ROWS_PER_CONSUMER.value, cols or D]
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[xs[0].dtype])
    views = [x.view(-1, D) for x in xs]
    return tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)
                 for x in views)  # fmt: skip


def _steps(*xs):
    """TMA descriptors of fp32 [B, H, Sq] tensors as [B*H*Sq] views in 64-row steps."""
    layout = gl.NVMMASharedLayout.get_default_for([STEP_M.value], gl.float32)
    return tuple(TensorDescriptor(x.view(-1), [x.numel()], [1], [STEP_M.value], layout)
                 for x in xs)  # fmt: skip


def kernel_args(q, k, v, do, dk, dv, lse2, delta, q_offsets, q_indices, block, scale,
                kv_block_sizes=None, epilogue: Epilogue = NO_EPILOGUE, grad_args=None,
                options: configs.GluonBwdOptions | None = None,
                persistent: bool | None = None):  # fmt: skip
    """``(kernel, grid, args, kwargs)`` of one launch (also used to compile for sm_90 without
    a GPU). ``q_offsets``, ``q_indices``: the transposed lists (``lists.cached_transpose``);
    ``lse2``, ``delta``: the preprocess's outputs (``bwd._preprocess``); ``grad_args``: the
    epilogue's (``epilogue.grad_args``, asked for here when None); ``persistent``: at 128 rows,
    the persistent kernel (None: ``configs.Overrides.persistent_dkdv``)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    has_sizes = kv_block_sizes is not None
    sizes = kv_block_sizes if has_sizes else q_offsets  # dummy pointer when unused
    if grad_args is None:
        grad_args = epilogue.grad_args(EngineCall(block, block, kv_block_sizes, scale, q.dtype))
    nk = Skv // block
    shared_block = block == 2 * ROWS_PER_CONSUMER.value  # split over the consumers, or one each
    asked = configs.active_overrides().persistent_dkdv if persistent is None else persistent
    order = _persistent_walk(
        asked and shared_block,
        B * H * nk,
        q.device,
        lambda n, banded: cached_dkdv_walk(q_offsets, B, n, banded),
    )
    persistent = bool(order)
    if persistent:
        kernel, grid = block_sparse_attn_bwd_dkdv_gluon_persistent_kernel, (order[-1],)
    elif shared_block:
        kernel, grid = block_sparse_attn_bwd_dkdv_gluon_kernel, (nk, B * H)
    else:
        kernel, grid = block_sparse_attn_bwd_dkdv_gluon_tiles_kernel, ((nk + 1) // 2, B * H)
    args = (*_tiles(q, k, v, do, dk, dv), *_steps(lse2, delta), q_offsets, q_indices, sizes,
            *broadcast_strides(q_offsets)[:2], *broadcast_strides(q_indices)[:2],
            dkdv_hook(epilogue, block), grad_args, H, Sq, Skv, Sq // block - 1, nk,
            q_indices.shape[-1], scale * LOG2E, scale, *order)  # fmt: skip
    table = configs.GLUON_DKDV_PERSISTENT if persistent else configs.GLUON_DKDV
    opts = (options or table[block]).as_kwargs()
    kwargs = dict(BLOCK_M=block, BLOCK_N=block, HEAD_DIM=D, HAS_KV_SIZES=has_sizes, **opts,
                  num_warps=4)  # fmt: skip
    return kernel, grid, args, kwargs


def _persistent_walk(runs: bool, blocks: int, device, walk_of) -> tuple:
    """The persistent kernel's three more arguments, ``(walk, blocks, programs)``, or ``()``
    where the one-block kernel runs (``runs`` false). One program per SM, or per block where
    fewer; ``walk_of(programs, banded)`` is the cached walk, banded as
    ``configs.persistent_walk_is_banded`` says."""
    if not runs:
        return ()
    programs = min(blocks, num_sms(device))
    return walk_of(programs, configs.persistent_walk_is_banded()), blocks, programs


def dkdv_gluon(q, k, v, do, lse2, delta, q_offsets, q_indices, block=128, scale=None, *,
               kv_block_sizes=None, epilogue: Epilogue = NO_EPILOGUE, grad_args=None,
               options: configs.GluonBwdOptions | None = None,
               persistent: bool | None = None):  # fmt: skip
    """``(dk, dv)`` of the block-sparse attention backward by the Gluon kernel (Hopper).

    Inputs as ``gluon_bwd_fits`` says; ``lse2``, ``delta`` fp32 [B, H, Sq] from the
    backward's preprocess; the transposed lists int32 (``lists.cached_transpose``). With
    ``kv_block_sizes``, padding keys are read by TMA and their gradients are 0 whatever they
    hold. ``persistent``: at 128 rows, one program per SM over the key blocks, walked as
    ``configs.persistent_walk_is_banded`` says (the same bits; None:
    ``configs.Overrides.persistent_dkdv``). Raises only on what would make the kernel misread
    memory."""
    _check_inputs("dkdv_gluon", q, k, v, do, lse2, delta, kv_block_sizes, block)
    _check_transposed_lists("dkdv_gluon", q_offsets, q_indices, k, block)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    kernel, grid, args, kwargs = kernel_args(q, k, v, do, dk, dv, lse2, delta, q_offsets,
                                             q_indices, block, scale, kv_block_sizes, epilogue,
                                             grad_args, options, persistent)  # fmt: skip
    kernel[grid](*args, **kwargs)
    return dk, dv


def _check_inputs(launcher, q, k, v, do, lse2, delta, kv_block_sizes, block) -> None:
    """What both launchers need of their inputs (``gluon_bwd_fits``; the preprocess's outputs; the
    key-block sizes), else a ValueError naming ``launcher``."""
    if not gluon_bwd_fits(q, k, v, do, block, block):
        raise ValueError(f"{launcher}: needs square 64 or 128 blocks, head_dim 128, bf16/fp16 "
                         "and contiguous 16-byte aligned q, k, v, do")  # fmt: skip
    for name, x in (("lse2", lse2), ("delta", delta)):
        if x.dtype != torch.float32 or x.shape != q.shape[:3] or not x.is_contiguous():
            raise ValueError(f"{launcher}: {name} must be contiguous fp32 [B, H, Sq]")
    if kv_block_sizes is not None and (
        kv_block_sizes.dtype != torch.int32 or kv_block_sizes.numel() < k.shape[2] // block
    ):
        raise ValueError(f"{launcher}: kv_block_sizes must be int32 [NK]")


def dq_kernel_args(q, k, v, do, dq, lse2, delta, kv_indices, kv_counts, block, scale,
                   kv_block_sizes=None, epilogue: Epilogue = NO_EPILOGUE, grad_args=None,
                   options: configs.GluonBwdOptions | None = None,
                   persistent: bool | None = None):  # fmt: skip
    """``(kernel, grid, args, kwargs)`` of one dQ launch (also used to compile for sm_90 without
    a GPU). ``lse2``, ``delta``: the preprocess's outputs; the lists int32 with a unit last
    stride; ``grad_args``: the epilogue's (asked for here when None); ``persistent``: at 128
    rows, the persistent kernel (None: ``configs.Overrides.persistent_dq``)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    has_sizes = kv_block_sizes is not None
    sizes = kv_block_sizes if has_sizes else kv_counts  # dummy pointer when unused
    if grad_args is None:
        grad_args = epilogue.grad_args(EngineCall(block, block, kv_block_sizes, scale, q.dtype))
    if not dq_hook_fits(epilogue):
        raise ValueError(f"epilogue {epilogue.name!r} has no Gluon dQ hook (EpilogueFns.dq_sm90)")
    nq = Sq // block
    shared_block = block == 2 * ROWS_PER_CONSUMER.value  # split over the consumers, or one each
    asked = configs.active_overrides().persistent_dq if persistent is None else persistent
    width = kv_indices.shape[-1]
    order = _persistent_walk(
        asked and shared_block,
        B * H * nq,
        q.device,
        lambda n, banded: cached_dq_walk(kv_counts, width, B, n, banded),
    )
    persistent = bool(order)
    lists = (kv_indices, kv_counts, sizes, *broadcast_strides(kv_indices),
             *broadcast_strides(kv_counts))  # fmt: skip
    args = (*_tiles(q, k, v, do, dq), lse2, delta, *lists, epilogue.fns().dq_sm90.fn, grad_args,
            H, Sq, Skv, nq, kv_indices.shape[-1], scale * LOG2E, scale, *order)  # fmt: skip
    table = configs.GLUON_DQ_PERSISTENT if persistent else configs.GLUON_DQ
    opts = (options or table[block]).as_kwargs()
    kwargs = dict(BLOCK_M=block, BLOCK_N=block, HEAD_DIM=D, HAS_KV_SIZES=has_sizes, **opts,
                  num_warps=4)  # fmt: skip
    if persistent:
        return block_sparse_attn_bwd_dq_gluon_persistent_kernel, (order[-1],), args, kwargs
    if shared_block:
        return block_sparse_attn_bwd_dq_gluon_kernel, (nq, B * H), args, kwargs
    return block_sparse_attn_bwd_dq_gluon_tiles_kernel, ((nq + 1) // 2, B * H), args, kwargs


def dq_gluon(q, k, v, do, lse2, delta, kv_indices, kv_counts, block=128, scale=None, *,
             kv_block_sizes=None, epilogue: Epilogue = NO_EPILOGUE, grad_args=None,
             options: configs.GluonBwdOptions | None = None,
             out: torch.Tensor | None = None, persistent: bool | None = None):  # fmt: skip
    """``dq`` of the block-sparse attention backward by the Gluon kernel (Hopper), written
    into ``out`` where given (a contiguous tensor like q).

    Inputs as ``gluon_bwd_fits`` says; ``lse2``, ``delta`` fp32 [B, H, Sq] from the
    backward's preprocess; the lists [Bi, H, NQ, K] and [Bi, H, NQ] (int32 with a unit last
    stride, converted once per list tensor otherwise). With ``kv_block_sizes``, padding keys
    are read by TMA and get no weight whatever they hold (finite). ``persistent``: at 128 rows,
    one program per SM over the query blocks, walked as ``configs.persistent_walk_is_banded``
    says (the same bits; None: ``configs.Overrides.persistent_dq``). Raises only on what would
    make the kernel misread memory."""
    _check_inputs("dq_gluon", q, k, v, do, lse2, delta, kv_block_sizes, block)
    if out is not None and not (out.shape == q.shape and out.dtype == q.dtype
                                and out.is_contiguous()):  # fmt: skip
        raise ValueError("dq_gluon: out must be a contiguous tensor of q's shape and dtype")
    kv_indices, kv_counts = int32_contiguous(kv_indices), int32_contiguous(kv_counts)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dq = torch.empty_like(q) if out is None else out
    kernel, grid, args, kwargs = dq_kernel_args(q, k, v, do, dq, lse2, delta, kv_indices,
                                                kv_counts, block, scale, kv_block_sizes,
                                                epilogue, grad_args, options,
                                                persistent)  # fmt: skip
    kernel[grid](*args, **kwargs)
    return dq


def dkdvdq_kernel_args(q, k, v, do, dk, dv, dq_acc, lse2, delta, q_offsets, q_indices, block,
                       scale, kv_block_sizes=None,
                       options: configs.GluonBwdOptions | None = None,
                       order=None, by_tma: bool = False, dq_fix=None):  # fmt: skip
    """``(kernel, grid, args, kwargs)`` of the one-pass backward (also used to compile for sm_90
    without a GPU): the dK/dV kernel's arguments and ``dq_acc``, fp32 [B, H, Sq, D] (int32
    with ``dq_fix``). ``order``: None (unordered adds), or ``(kv_indices, kv_counts,
    semaphores, ticket)``, the forward lists (int32, unit last stride) and zeroed int32
    ``[B*H*NQ*2]`` and ``[1]``: the ordered kernel. ``by_tma``: either kernel adding by TMA
    reductions; ``dq_fix`` (by TMA, unordered): the rows' fixed-point multipliers, fp32
    [B, H, Sq]."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    has_sizes = kv_block_sizes is not None
    sizes = kv_block_sizes if has_sizes else q_offsets  # dummy pointer when unused
    nk = Skv // block
    ordering, kernel = (), block_sparse_attn_bwd_dkdvdq_gluon_kernel
    table = configs.GLUON_DKDVDQ_TMA if by_tma else configs.GLUON_DKDVDQ
    dq_target = _tiles(dq_acc, cols=D // 2)[0] if by_tma else dq_acc
    if order is not None:
        kv_indices, kv_counts, semaphores, ticket = order
        ordering = (kv_indices, kv_counts, kv_indices.shape[-1],
                    *broadcast_strides(kv_indices)[:3], *broadcast_strides(kv_counts),
                    semaphores, ticket)  # fmt: skip
        kernel = block_sparse_attn_bwd_dkdvdq_ordered_gluon_kernel
        table = configs.GLUON_DKDVDQ_ORDERED
    fixed = dict(DQ_FIXED=dq_fix is not None) if order is None else {}
    fix_arg = (_steps(dq_fix)[0] if dq_fix is not None else dq_acc,) if order is None else ()
    args = (*_tiles(q, k, v, do, dk, dv), *_steps(lse2, delta), dq_target, *fix_arg, q_offsets,
            q_indices, sizes, *broadcast_strides(q_offsets)[:2],
            *broadcast_strides(q_indices)[:2], *ordering, H, Sq, Skv, Sq // block - 1, nk,
            q_indices.shape[-1], scale * LOG2E, scale)  # fmt: skip
    opts = (options or table[block]).as_kwargs()
    kwargs = dict(BLOCK_M=block, BLOCK_N=block, HEAD_DIM=D, HAS_KV_SIZES=has_sizes, **opts,
                  DQ_BY_TMA=by_tma, **fixed, num_warps=4)  # fmt: skip
    return kernel, (nk, B * H), args, kwargs


def dkdvdq_gluon(q, k, v, do, lse2, delta, q_offsets, q_indices, block=128, scale=None, *,
                 kv_block_sizes=None, options: configs.GluonBwdOptions | None = None,
                 ordered_by=None, by_tma: bool = False, dq_fix=None):  # fmt: skip
    """``(dk, dv, dq)`` in one pass (Hopper, 128-row blocks, no epilogue): dK and dV the dK/dV
    kernel's bits, dQ added from every key block's step into an fp32 accumulator by atomics
    (``kernels/bwd_sm90_fused.py``). Unordered, dq's last bits vary from run to run;
    ``ordered_by=(kv_indices, kv_counts)``, the forward lists the transposed ones came from,
    adds each query step's in key-block order, so dq is the same bits on every run (they must
    be the lists ``q_offsets``, ``q_indices`` were transposed from: lists that disagree can
    leave the kernel waiting forever). ``by_tma``: each step's dQ tiles added by TMA bulk
    reductions from shared memory instead of atomics (ordered: by the writer warp, which waits
    for them to land before it counts the step). ``dq_fix`` (by TMA, unordered): dQ summed as
    int32 fixed point, each query row scaled by its multiplier (fp32 [B, H, Sq], the
    preprocess's ``dq_fix`` for this call's k, v and scale), so dq is the same bits on every
    run at the unordered kernel's traffic. Inputs as ``dkdv_gluon``'s. The engine's backward
    takes it, unordered and by TMA (``configs.NONDETERMINISTIC_ONE_PASS``), for
    ``deterministic=False``, and any variant under ``configs.override(one_pass=...)``; by
    atomics, and ordered either way, it is slower than the two kernels
    (``benchmarks/NOTES.md``)."""
    _check_inputs("dkdvdq_gluon", q, k, v, do, lse2, delta, kv_block_sizes, block)
    if block not in configs.GLUON_DKDVDQ:
        raise ValueError(f"dkdvdq_gluon: block {block} not supported; "
                         f"supported: {sorted(configs.GLUON_DKDVDQ)}")  # fmt: skip
    _check_transposed_lists("dkdvdq_gluon", q_offsets, q_indices, k, block)
    _check_fixed_point(dq_fix, q, ordered_by, by_tma)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    acc_dtype = torch.float32 if dq_fix is None else torch.int32
    dq_acc = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    order = None
    if ordered_by is not None:
        kv_indices, kv_counts = (int32_contiguous(x) for x in ordered_by)
        steps = q.shape[0] * q.shape[1] * (q.shape[2] // STEP_M.value)
        semaphores = torch.zeros(steps + 1, dtype=torch.int32, device=q.device)
        order = (kv_indices, kv_counts, semaphores[1:], semaphores[:1])  # one zeroing for both
    kernel, grid, args, kwargs = dkdvdq_kernel_args(q, k, v, do, dk, dv, dq_acc, lse2, delta,
                                                    q_offsets, q_indices, block, scale,
                                                    kv_block_sizes, options, order,
                                                    by_tma, dq_fix)  # fmt: skip
    kernel[grid](*args, **kwargs)
    if dq_fix is None:
        return dk, dv, dq_acc.to(q.dtype)
    return dk, dv, dq_from_fixed_point(dq_acc, dq_fix, q.dtype)


def dq_from_fixed_point(acc: torch.Tensor, dq_fix: torch.Tensor, dtype) -> torch.Tensor:
    """dq in ``dtype`` from the one pass's int32 sums ``acc`` [B, H, Sq, D] and the rows'
    multipliers ``dq_fix`` [B, H, Sq] (``kernels/bwd.py``)."""
    dq = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    rows, D = acc.numel() // acc.shape[-1], acc.shape[-1]
    block = configs.DQ_FROM_FIXED_ROWS
    block_sparse_attn_bwd_dq_from_fixed_kernel[(triton.cdiv(rows, block),)](
        acc, dq_fix, dq, rows, BLOCK_M=block, HEAD_DIM=D,
    )  # fmt: skip
    return dq


def _check_fixed_point(dq_fix, q, ordered_by, by_tma) -> None:
    """What ``dkdvdq_gluon``'s fixed point needs: TMA reductions in any order, and one fp32
    multiplier a query row."""
    if dq_fix is None:
        return
    if ordered_by is not None or not by_tma:
        raise ValueError("dkdvdq_gluon: dq_fix (fixed point) needs by_tma=True and no ordered_by")
    if dq_fix.dtype != torch.float32 or dq_fix.shape != q.shape[:3] or not dq_fix.is_contiguous():
        raise ValueError("dkdvdq_gluon: dq_fix must be contiguous fp32 [B, H, Sq]")


def _check_transposed_lists(launcher, q_offsets, q_indices, k, block) -> None:
    for name, x in (("q_offsets", q_offsets), ("q_indices", q_indices)):
        if x.dtype != torch.int32 or x.stride(-1) != 1:
            raise ValueError(f"{launcher}: {name} must be int32 with a unit last stride")
    if q_offsets.shape[-1] != k.shape[2] // block + 1:
        raise ValueError(f"{launcher}: q_offsets must hold NK + 1 bounds per (batch, head)")
