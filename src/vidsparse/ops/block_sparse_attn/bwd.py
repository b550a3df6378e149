"""Backward launcher of block-sparse flash attention: configs, TMA choice, one or two launches.

Preprocess, then the dK/dV and dQ kernels (``kernels/bwd.py``), as two launches or one fused
launch where both configs say ``fused`` and launch alike: the gradients are bit-identical
either way. Each kernel reads its loop's tiles by TMA where its config and the inputs allow.
On Hopper, dK/dV and dQ each run in a Gluon kernel (``bwd_sm90.py``: FlashAttention-3's
structure) where its config says ``gluon`` and the inputs and epilogue fit it; the two are
then separate launches. Two launches on a GPU run concurrently where both configs say
``overlap`` (dQ on a side stream, ``overlapped``). No kernel uses atomics: the gradients are
the same bits on every run. Only where the caller gives that up (``deterministic=False``) does
the Hopper backward run in one pass, dQ added by TMA reductions in whatever order the
programs reach them (``configs.NONDETERMINISTIC_ONE_PASS``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import replace

import torch

from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn.configs import KernelConfig
from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE, EngineCall, Epilogue
from vidsparse.ops.block_sparse_attn.grad_rows import GradRows, empty_grads
from vidsparse.ops.block_sparse_attn.kernels import no_epilogue
from vidsparse.ops.block_sparse_attn.kernels.bwd import (
    block_sparse_attn_bwd_dkdv_kernel,
    block_sparse_attn_bwd_dq_kernel,
    block_sparse_attn_bwd_fused_kernel,
    block_sparse_attn_bwd_kv_bounds_kernel,
    block_sparse_attn_bwd_preprocess_kernel,
)
from vidsparse.ops.block_sparse_attn.launch import (
    LOG2E,
    broadcast_strides,
    eviction_hints,
    gluon_launcher,
    int32_contiguous,
    list_end_strides,
    lists_by_size,
    tensor_descriptor,
    tma_compatible,
    tma_reads_keys,
    walk_operands,
    walk_tails,
)
from vidsparse.ops.block_sparse_attn.lists import cached_transpose
from vidsparse.utils.device import target_of


def block_sparse_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor | None,
    block_q: int,
    block_kv: int,
    scale: float,
    *,
    padding_finite: bool = False,
    epilogue: Epilogue = NO_EPILOGUE,
    grad_rows: GradRows | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` given the forward's stored ``o`` and ``lse``, on validated inputs; the
    epilogue's own gradients are left in ``epilogue``. ``padding_finite`` as in the forward;
    ``grad_rows``: ``GradRows`` (``out``: o, do too); ``deterministic``: ``_one_pass_mode``."""
    B, H, Sq, D = q.shape
    num_kv_blocks = k.shape[2] // block_kv
    call = EngineCall(block_q, block_kv, kv_block_sizes, scale, q.dtype)
    fns = epilogue.fns()
    has_sizes, mapped = kv_block_sizes is not None, grad_rows is not None
    choose = functools.partial(_kernels_and_mode, q, k, v, kv_block_sizes, block_q, block_kv,
                               padding_finite, epilogue, grad_rows, deterministic)  # fmt: skip
    chosen = None if mapped and grad_rows.out else choose(do)  # do as the kernels read it
    fixed = chosen is not None and configs.one_pass_is_fixed(chosen[-1])
    delta, lse2, do, dq_fix = _preprocess(
        do, o, lse, block_q, fns, epilogue.prologue_args(call, do), grad_rows,
        dq_fixed_of=(k, v, scale, kv_block_sizes, block_kv) if fixed else None)  # fmt: skip
    kv_cfg, kv_tma, q_cfg, q_tma, gluon_dkdv, gluon_dq, mode = chosen or choose(do)
    grad_hooks = (fns.dq.fn, fns.dkdv.fn, epilogue.grad_args(call))
    kv_in, q_keys = _loop_inputs(q, k, v, do, block_kv, kv_cfg.sub_m, kv_tma and not gluon_dkdv,
                                 q_tma and not gluon_dq)  # fmt: skip
    q_offsets, q_indices, query_in, query_walks = _transposed_lists(
        kv_cfg, epilogue.quiet_rows(call), q, do, kv_indices, kv_counts, num_kv_blocks,
        block_q, gluon_dkdv, kv_tma,
    )  # fmt: skip
    if mode is not None:
        return _one_pass(mode, q, k, v, do, lse2, delta, q_offsets, q_indices, kv_indices,
                         kv_counts, block_kv, scale, kv_block_sizes, dq_fix)  # fmt: skip
    dq_lists, dq_counts, tails, checked, list_strides, ends_args = _dq_lists(
        kv_indices, kv_counts, kv_block_sizes, block_kv, gluon_dq)  # fmt: skip
    sizes = kv_block_sizes if has_sizes else dq_counts  # dummy pointer when unused
    transposed_strides = (*broadcast_strides(q_offsets)[:2], *broadcast_strides(q_indices)[:2])
    common = dict(BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D, HAS_KV_SIZES=has_sizes,
                  DOT_PRECISION=configs.dot_precision(target_of(q.device), q.dtype))  # fmt: skip
    # K, V for the short walks: their own TMA boxes, or the tensors for pointer loads.
    kv_walks, dq_walks = walk_tails(kv_cfg, tails), walk_tails(q_cfg, tails)
    kv_tails = walk_operands(k, v, kv_walks.values(), kv_tma)
    same = (q_tma, dq_walks) == (kv_tma, kv_walks)
    dq_tails = kv_tails if same else walk_operands(k, v, dq_walks.values(), q_tma)
    scales = (scale * LOG2E, scale)
    row_maps, q_layout, kv_layout = _row_maps(grad_rows, dq_counts)
    (dq,) = empty_grads(q_layout, q)  # on this stream, whichever stream dQ runs on

    if not (gluon_dkdv or gluon_dq) and fused_launch(
        kv_cfg, q_cfg, configs.active_overrides().fused
    ):
        dk, dv = empty_grads(kv_layout, k, v)
        num_dq_programs = Sq // q_cfg.sub_m * B * H
        block_sparse_attn_bwd_fused_kernel[(num_kv_blocks * B * H + num_dq_programs,)](
            *kv_in, q, *q_keys, do, *kv_tails, *dq_tails, *query_in, dq, dk, dv, lse2, delta,
            q_offsets, q_indices, dq_lists, dq_counts, sizes, *ends_args, *row_maps,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *dq.stride(), *dk.stride(), *dv.stride(),
            *transposed_strides, *list_strides, *grad_hooks,
            H, Sq, Sq // block_q, num_kv_blocks, B * H, dq_lists.shape[-1], *scales,
            SUB_M_DKDV=kv_cfg.sub_m, SUB_M_DQ=q_cfg.sub_m,
            # one pair for both halves: the short walks where both configs take them
            **walk_tails(replace(kv_cfg, key_tails=kv_cfg.key_tails and q_cfg.key_tails), tails),
            **query_walks,
            USE_TMA_DKDV=kv_tma, USE_TMA_DQ=q_tma, CHECK_LISTS=checked, **common,
            **eviction_hints(kv_cfg, "_DKDV"), **eviction_hints(q_cfg, "_DQ"),
            **kv_cfg.launch_kwargs(),  # both halves': fused_launch checked they agree
            GRAD_ROWS=mapped,
        )  # fmt: skip
        return dq, dk, dv

    with _dq_beside_dkdv(overlapped(kv_cfg, q_cfg, q.device), q.device) as dq_stream:
        if gluon_dkdv:
            dk, dv = gluon_launcher("bwd_sm90", "backward").dkdv_gluon(
                q, k, v, do, lse2, delta, q_offsets, q_indices, block_kv, scale,
                kv_block_sizes=kv_block_sizes, epilogue=epilogue, grad_args=grad_hooks[2],
            )  # fmt: skip
        else:
            dk, dv = empty_grads(kv_layout, k, v)
            block_sparse_attn_bwd_dkdv_kernel[(num_kv_blocks, B * H)](
                *kv_in, dk, dv, lse2, delta, *kv_tails, *query_in,
                q_offsets, q_indices, sizes, row_maps[1],
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
                *transposed_strides, *grad_hooks,
                H, Sq, Sq // block_q, *scales,
                SUB_M=kv_cfg.sub_m, USE_TMA=kv_tma, **eviction_hints(kv_cfg), **common,
                **kv_walks, **query_walks,
                **kv_cfg.launch_kwargs(), GRAD_ROWS=mapped,
            )  # fmt: skip
        with torch.cuda.stream(dq_stream):  # None: this stream
            if gluon_dq:
                gluon_launcher("bwd_sm90", "backward").dq_gluon(
                    q, k, v, do, lse2, delta, dq_lists, dq_counts, block_q, scale,
                    kv_block_sizes=kv_block_sizes, epilogue=epilogue, grad_args=grad_hooks[2],
                    out=dq,
                )  # fmt: skip
            else:
                block_sparse_attn_bwd_dq_kernel[(Sq // q_cfg.sub_m, B * H)](
                    q, *q_keys, do, dq, lse2, delta, *dq_tails,
                    dq_lists, dq_counts, sizes, *ends_args, row_maps[0],
                    *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
                    *list_strides, *grad_hooks,
                    H, Sq, num_kv_blocks, dq_lists.shape[-1], *scales,
                    SUB_M=q_cfg.sub_m, USE_TMA=q_tma, CHECK_LISTS=checked,
                    **eviction_hints(q_cfg), **dq_walks,
                    **common, **q_cfg.launch_kwargs(), GRAD_ROWS=mapped,
                )  # fmt: skip
    return dq, dk, dv


def _kernels_and_mode(q, k, v, kv_block_sizes, block_q, block_kv, padding_finite, epilogue,
                      grad_rows, deterministic, do):  # fmt: skip
    """``(kv_cfg, kv_tma, q_cfg, q_tma, gluon_dkdv, gluon_dq, one-pass mode)`` for ``do`` as
    the gradient kernels will read it (``_configs``, ``_gluon_kernels``, ``_one_pass_mode``).
    Chosen before the preprocess where it hands do back as it is: the fixed-point one pass
    needs the preprocess's row multipliers."""
    kv_cfg, kv_tma, q_cfg, q_tma = _configs(q, k, v, do, kv_block_sizes, block_q, block_kv,
                                            padding_finite, grad_rows is not None)  # fmt: skip
    gluon_dkdv, gluon_dq = _gluon_kernels(kv_cfg.gluon and kv_tma, q_cfg.gluon and q_tma,
                                          q, k, v, do, block_q, block_kv, epilogue)  # fmt: skip
    mode = _one_pass_mode(deterministic, gluon_dkdv and gluon_dq, block_kv, epilogue, grad_rows)
    return kv_cfg, kv_tma, q_cfg, q_tma, gluon_dkdv, gluon_dq, mode


def _dq_lists(kv_indices, kv_counts, kv_block_sizes, block_kv, gluon_dq):
    """``(lists, counts, tails, checked, their strides, (ends, its strides))`` the dQ kernels
    walk (``lists_by_size``), int32 for the Gluon kernel: converted here, not on dQ's side
    stream (once per list tensor: cached)."""
    dq_lists, dq_counts, ends, tails, checked = lists_by_size(kv_indices, kv_counts,
                                                              kv_block_sizes, block_kv)  # fmt: skip
    if gluon_dq:
        dq_lists, dq_counts = int32_contiguous(dq_lists), int32_contiguous(dq_counts)
    list_strides = (*broadcast_strides(dq_lists), *broadcast_strides(dq_counts))
    return dq_lists, dq_counts, tails, checked, list_strides, (ends, *list_end_strides(ends))


def _one_pass_mode(deterministic, both_gluon, block, epilogue, grad_rows) -> str | None:
    """The one-pass Hopper backward's mode (``configs.ONE_PASS_MODES``) for this call, or None
    for the two kernels: ``configs.override(one_pass=...)``'s (tuning; ``ONE_PASS_OFF``: None),
    else ``configs.DETERMINISTIC_ONE_PASS`` (the same bits every run) or, where the caller
    allows any order, ``configs.NONDETERMINISTIC_ONE_PASS``, where it applies (both Gluon
    kernels chosen, 128-row blocks, no epilogue, the engine's row order). Where the caller
    gave up determinism and it does not apply, the log says why, once."""
    mode = configs.active_overrides().one_pass
    if mode not in (None, configs.ONE_PASS_OFF, *configs.ONE_PASS_MODES):
        raise ValueError(f"one_pass={mode!r}: one of {tuple(configs.ONE_PASS_MODES)}, "
                         f"{configs.ONE_PASS_OFF!r} or None")  # fmt: skip
    if mode == configs.ONE_PASS_OFF:
        return None
    if mode is None:
        mode = (configs.DETERMINISTIC_ONE_PASS if deterministic
                else configs.NONDETERMINISTIC_ONE_PASS)  # fmt: skip
    if mode is None:
        return None
    fns = epilogue.fns()
    missing = [why for why, ok in (
        ("the Hopper Gluon dK/dV and dQ kernels", both_gluon),
        ("128-token blocks", block == 128),
        ("no epilogue", fns.dkdv.fn is no_epilogue.dkdv_identity
         and fns.dq.fn is no_epilogue.dq_identity),
        ("the engine's row order", grad_rows is None),
    ) if not ok]  # fmt: skip
    if missing and not deterministic:  # an override's mode is tuning: no note
        _note_deterministic_backward(", ".join(missing))
    return None if missing else mode


@functools.cache  # once per reason
def _note_deterministic_backward(missing: str) -> None:
    logging.getLogger("vidsparse").info(
        "vidsparse: deterministic=False: the one-pass backward needs %s; the deterministic "
        "backward runs", missing,
    )  # fmt: skip


def _one_pass(mode, q, k, v, do, lse2, delta, q_offsets, q_indices, kv_indices, kv_counts,
              block, scale, kv_block_sizes, dq_fix):  # fmt: skip
    """``(dq, dk, dv)`` by ``bwd_sm90.dkdvdq_gluon``, dQ's adds in key-block order, by TMA
    reductions and in fixed point (with the preprocess's ``dq_fix``) as ``mode`` says
    (``configs.ONE_PASS_MODES``)."""
    how = configs.ONE_PASS_MODES[mode]
    dk, dv, dq = gluon_launcher("bwd_sm90", "backward").dkdvdq_gluon(
        q, k, v, do, lse2, delta, q_offsets, q_indices, block, scale,
        kv_block_sizes=kv_block_sizes,
        ordered_by=(kv_indices, kv_counts) if how.ordered else None, by_tma=how.by_tma,
        dq_fix=dq_fix if how.fixed else None,
    )  # fmt: skip
    return dq, dk, dv


def _row_maps(grad_rows: GradRows | None, dummy: torch.Tensor):
    """``((q map, kv map), q layout, kv layout)`` for the kernels and ``empty_grads``: the
    maps of ``grad_rows``, or ``dummy`` pointers and no layouts without them."""
    if grad_rows is None:
        return (dummy, dummy), None, None
    return (grad_rows.q_rows, grad_rows.kv_rows), *grad_rows.layouts()


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def _dq_beside_dkdv(overlap: bool, device: torch.device):
    """dQ's stream (None: the current one) for the block that launches dK/dV, then dQ. With
    ``overlap`` a side stream (one per device) made to wait for the current stream's work so
    far (the preprocess) before dK/dV is enqueued, so dQ runs beside dK/dV; on leaving, the
    current stream waits for it. Every tensor dQ touches was allocated on the current stream
    and is freed there after that wait, so the caching allocator needs no ``record_stream``;
    CUDA graph capture takes the fork and the join."""
    if not overlap:
        yield None
        return
    current = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(current)
    try:
        yield side
    finally:
        current.wait_stream(side)


def overlapped(dkdv: KernelConfig, dq: KernelConfig, device: torch.device) -> bool:
    """Does dQ's launch run on a side stream beside dK/dV's? On a GPU, where both configs ask
    (``KernelConfig.overlap``) or an override says so (``configs.override(overlap=...)``).
    The fused launch never gets here."""
    if device.type != "cuda":
        return False
    forced = configs.active_overrides().overlap
    return (dkdv.overlap and dq.overlap) if forced is None else forced


def _gluon_kernels(dkdv_asked, dq_asked, q, k, v, do, block_q, block_kv,
                   epilogue) -> tuple[bool, bool]:  # fmt: skip
    """``(dK/dV, dQ)``: does each run in its Hopper Gluon kernel (``bwd_sm90.py``)? Where its
    config asks for it on top of TMA (``*_asked``: the inputs allow TMA reads, padding keys
    included), the inputs fit the kernels, the epilogue has that kernel's Gluon hook, and this
    Triton's Gluon is the one the kernels are written for (else the Triton kernels run, and
    the log says why, once)."""
    if not (dkdv_asked or dq_asked):
        return False, False
    launcher = gluon_launcher("bwd_sm90", "backward")
    if launcher is None or not launcher.gluon_bwd_fits(q, k, v, do, block_q, block_kv):
        return False, False
    return (
        dkdv_asked and launcher.dkdv_hook_fits(epilogue, block_kv),
        dq_asked and launcher.dq_hook_fits(epilogue),
    )


def _loop_inputs(q, k, v, do, block_kv, sub_m, dkdv_tma, dq_tma) -> tuple[tuple, tuple]:
    """``(q, k, v, do)`` of the Triton dK/dV kernel and ``(k, v)`` of its dQ kernel: TMA
    descriptors of their loads' boxes where each reads by TMA, else the tensors."""
    desc = tensor_descriptor
    kv_in = (q, k, v, do)
    if dkdv_tma:
        kv_in = (desc(q, sub_m), desc(k, block_kv), desc(v, block_kv), desc(do, sub_m))
    q_keys = (desc(k, block_kv), desc(v, block_kv)) if dq_tma else (k, v)
    return kv_in, q_keys


def _transposed_lists(kv_cfg, quiet_rows, q, do, kv_indices, kv_counts, num_kv_blocks,
                      block_q, gluon_dkdv, kv_tma):  # fmt: skip
    """dK/dV's transposed lists (``lists.cached_transpose``), in three query groups a key
    block where it takes the short query walks (``_query_walks``), the Q, dO those walks read
    (their own TMA boxes, or the tensors) and the walks' constexprs (``QTAIL1``, ``QTAIL2``)."""
    q_rows, q_tails = _query_walks(kv_cfg, quiet_rows, q.shape[2] // block_q, block_q,
                                   gluon_dkdv)  # fmt: skip
    lists = cached_transpose(kv_indices, kv_counts, num_kv_blocks, q_rows, block_q, q_tails)
    query_in = walk_operands(q, do, q_tails, kv_tma)
    return (*lists, query_in, {"QTAIL1": q_tails[0], "QTAIL2": q_tails[1]})


def _query_walks(cfg: KernelConfig, quiet_rows, num_q_blocks: int, block_q: int,
                 gluon_dkdv: bool) -> tuple[torch.Tensor | None, tuple[int, int]]:  # fmt: skip
    """``(rows, tails)`` for the Triton dK/dV kernel's short query walks: each query block's
    gradient-carrying rows (the epilogue's ``quiet_rows``, its first ``num_q_blocks``
    entries read) and the walks' rows
    (``configs.key_tails(block_q)``), where its config takes them (``query_tails``, one step a
    block); else ``(None, (0, 0))``: every listed query block is walked with all rows."""
    off = None, (0, 0)
    if quiet_rows is None or gluon_dkdv or not cfg.query_tails or cfg.sub_m != block_q:
        return off
    if quiet_rows.shape[0] < num_q_blocks:
        raise ValueError(
            f"the epilogue's quiet_rows covers {quiet_rows.shape[0]} query blocks, not "
            f"{num_q_blocks}"
        )
    tails = configs.key_tails(block_q)
    return (quiet_rows, tails) if tails[0] else off


def _preprocess(do, o, lse, block_q, fns, prologue_args, grad_rows: GradRows | None = None,
                dq_fixed_of=None):  # fmt: skip
    """``(delta, lse2, do, dq_fix)``: the preprocess kernel, with the epilogue's prologue.
    Where ``grad_rows`` says o and do are in the q side's order (``GradRows.out``) they are
    read through its q map and the do returned is the engine-order copy the kernel writes
    (zeros on unmapped rows); else do itself. ``dq_fixed_of``: ``(k, v, scale,
    kv_block_sizes, block_kv)`` of the call, for each query row's fixed-point multiplier of
    the one pass's dQ (``dq_fix``, fp32 [B, H, Sq]; else None)."""
    B, H, Sq = lse.shape
    D = o.shape[-1]
    delta = torch.empty((B, H, Sq), device=o.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    mapped, fixed = {}, {}
    if grad_rows is not None and grad_rows.out:
        do_t = do.new_empty((B, H, Sq, D))
        warps = (configs.active_overrides().preprocess_warps
                 or configs.preprocess_mapped_warps(target_of(o.device)))  # fmt: skip
        mapped = dict(IN_ROWS=grad_rows.q_rows, DO_T=do_t, IN_MAPPED=True, num_warps=warps)
    if dq_fixed_of is not None:
        k, v, scale, kv_block_sizes, block_kv = dq_fixed_of
        fixed = dict(DQ_FIX=torch.empty_like(delta), scale=scale, DQ_FIXED=True,
                     KV_BOUNDS=kv_bounds(k, v, kv_block_sizes, block_kv))  # fmt: skip
    block_sparse_attn_bwd_preprocess_kernel[(Sq // block_q, B * H)](
        o, do, lse, delta, lse2, *o.stride(), *do.stride(),
        fns.prologue.fn, prologue_args, H, Sq,
        BLOCK_M=block_q, HEAD_DIM=D, **mapped, **fixed,
    )  # fmt: skip
    return delta, lse2, mapped.get("DO_T", do), fixed.get("DQ_FIX")


def kv_bounds(k, v, kv_block_sizes, block_kv) -> torch.Tensor:
    """fp32 ``[B*H, 2]``: each head's largest ``|k|`` and largest row norm of v over its key
    rows (padding rows that ``kv_block_sizes`` masks left out; infinite where k or v is not
    finite), for the fixed-point dQ's row bounds (``kernels/bwd.py``, ``dq_row_bound``)."""
    B, H, Skv, D = k.shape
    bounds = torch.zeros((B * H, 2), device=k.device, dtype=torch.float32)
    has_sizes = kv_block_sizes is not None
    block_sparse_attn_bwd_kv_bounds_kernel[(Skv // block_kv, B * H)](
        k, v, kv_block_sizes if has_sizes else bounds, bounds, *k.stride(), *v.stride(), H,
        BLOCK_N=block_kv, HEAD_DIM=D, HAS_KV_SIZES=has_sizes,
    )  # fmt: skip
    return bounds


def _configs(q, k, v, do, kv_block_sizes, block_q, block_kv, padding_finite, mapped=False):
    """Each gradient kernel's config as the inputs allow, and whether it reads by TMA: the
    dK/dV kernel reads q, do (its loop's tiles) and k, v by TMA or all by pointers; the dQ
    kernel reads k, v (its loop's) by TMA or not. ``mapped`` (``GradRows``): not the Gluon
    kernels, whose TMA stores write whole blocks in the engine's order."""
    target, D, masked = target_of(q.device), q.shape[-1], kv_block_sizes is not None
    fp32 = q.dtype == torch.float32
    keys_by_tma = tma_reads_keys(q.dtype, kv_block_sizes, padding_finite) and tma_compatible(k, v)
    kv_cfg = configs.lookup(target, "bwd_dkdv", block_q, block_kv, D, masked, fp32)
    kv_cfg, kv_tma = kv_cfg.for_inputs(keys_by_tma and tma_compatible(q, do), block_q)
    q_cfg = configs.lookup(target, "bwd_dq", block_q, block_kv, D, masked, fp32)
    q_cfg, q_tma = q_cfg.for_inputs(keys_by_tma, block_q)
    if mapped:
        kv_cfg, q_cfg = replace(kv_cfg, gluon=False), replace(q_cfg, gluon=False)
    return kv_cfg, kv_tma, q_cfg, q_tma


def fused_launch(dkdv: KernelConfig, dq: KernelConfig, fused: bool | None = None) -> bool:
    """Do the dK/dV and dQ programs of configs ``dkdv`` and ``dq`` (as resolved for the
    inputs) run in one launch? ``fused`` None: where both configs ask for it and launch alike;
    True: one launch, which needs the same launch options; False: two launches.

    One launch has one ``num_warps``, ``num_stages`` and vendor options, so it forces one value
    on both kernels: it is taken only where their rows already agree, never by overriding one
    with the other's. Eviction hints are constexprs: each half keeps its own."""
    alike = dkdv.launch_kwargs() == dq.launch_kwargs()
    if fused is None:
        return dkdv.fused and dq.fused and alike
    if fused and not alike:
        raise ValueError(
            "a fused backward launch needs the dK/dV and dQ configs to launch alike, got "
            f"{dkdv.launch_kwargs()} and {dq.launch_kwargs()}"
        )
    return bool(fused)
