"""The engine's two entries and its custom ops.

``block_sparse_attn`` (public) validates everything, lists included; ``block_sparse_attn_unchecked``
(for ops inside vidsparse whose lists are valid by construction) checks nothing and takes a
declared epilogue (``epilogue.py``). Both pick a backend (``VIDSPARSE_BACKEND``) and call one
``torch.library`` custom-op pair, so ``torch.compile`` sees one opaque, differentiable op.
"""

from __future__ import annotations

import sys

import torch

from vidsparse.masks.block_sparse import (
    refine_block_lists,
    refine_block_sizes,
    validate_block_lists,
)
from vidsparse.ops.block_sparse_attn.configs import (
    REFERENCE_DTYPES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    kernel_block_max,
)
from vidsparse.ops.block_sparse_attn.epilogue import (
    MAX_TENSORS,
    NO_EPILOGUE,
    EngineCall,
    Epilogue,
    epilogue_from,
    padded_tensors,
)
from vidsparse.ops.block_sparse_attn.grad_rows import (
    GradRows,
    GradTargets,
    empty_grads,
    empty_output,
    gather_rows,
    scatter_grads,
    scatter_rows,
)
from vidsparse.ops.block_sparse_attn.interpreter import interpreter_computes_bf16
from vidsparse.ops.block_sparse_attn.reference import (
    block_sparse_attn_bwd_ref,
    block_sparse_attn_ref,
)
from vidsparse.utils.backend import resolve_backend
from vidsparse.utils.checks import (
    bshd_hint,
    check_bool,
    check_head_dim,
    check_positive_int,
    check_qkv,
    check_same_device,
    check_tensor,
    is_bshd_view,
    softmax_scale,
)
from vidsparse.utils.device import target_of
from vidsparse.utils.tensor_cache import TensorCache


def block_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    block_size: int | tuple[int, int] = 64,
    kv_block_sizes: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    validate: bool = False,
    deterministic: bool = True,
):
    """Attention of each query block over its own list of key blocks.

    ::

        query blocks x key blocks (block_size tokens each), one map per (batch, head)

                 k0 k1 k2 k3        kv_indices[b, h]     kv_counts[b, h]
            q0 [ x  .  x  . ]       [[0, 2, *],          [2,
            q1 [ .  x  x  x ]        [1, 2, 3],           3,
            q2 [ .  .  .  . ]        [*, *, *]]           0]   <- empty row: o = 0, lse = -inf

    Args:
        q: ``[B, H, Sq, D]``; k, v: ``[B, H, Skv, D]``; fp16/bf16 (fp32 too; fp64 on CPU).
        kv_indices: int32 ``[B or 1, H, Sq // block_q, K]``; the first ``kv_counts`` entries of
            each row are read and must be distinct key-block indices.
        kv_counts: int32 ``[B or 1, H, Sq // block_q]``, each in ``[0, K]``.
        block_size: ``block`` or ``(block_q, block_kv)``, powers of two (the Triton kernels'
            tile widths; checked on every backend); ``Sq % block_q == Skv % block_kv == 0``.
            Blocks above 128 tokens run as 128-token sub-blocks of the same lists.
        kv_block_sizes: optional int32 ``[Skv // block_kv]``: real keys at the start of each key
            block; the rest are padding and get no weight, whatever they hold (NaN too).
        scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return the fp32 natural-log log-sum-exp ``[B, H, Sq]``.
        validate: check the lists' values even if these tensors passed before unchanged.
        deterministic: the backward gives the same bits every run (the default). ``False``
            allows a faster backward whose dQ sums arrive in no fixed order: on Hopper at
            128x128 blocks (bf16/fp16, D=128, no ``kv_block_sizes``) one pass computes dK, dV
            and dQ, adding dQ by TMA reductions (dK, dV are the same bits either way).
            Elsewhere the deterministic backward runs (the log says why, once).

    Returns ``o`` (q's dtype), or ``(o, lse)``. Differentiable in q, k, v. Empty problems
    (``B``, ``H`` or ``Sq`` of 0) give empty results; ``Skv = 0`` needs every count 0 (o = 0,
    lse = -inf), the same on every backend.

    **List checks and memory safety.** The lists' values (counts in ``[0, K]``, entries in
    ``[0, Skv // block_kv)``, distinct) are checked once per list tensor (a GPU sync), and
    again when the tensor changes in place (its version counter), or its data pointer, shape or
    strides change. Writes that bypass the version counter (through ``.numpy()``, ``.data``,
    DLPack) are not seen: pass ``validate=True`` after such writes. Lists that escape the check
    are still memory-safe: every kernel clamps counts to ``K`` and never reads or writes out
    of bounds for an entry out of range, which contributes nothing (the torch path and the
    Triton kernels skip it; the Hopper Gluon forward, on lists without ``kv_block_sizes``,
    reads a clamped block instead); the result is then unspecified, but no fault.
    """
    block_q, block_kv = _normalize_block_size(block_size)
    check_bool("validate", validate)
    device = _validate(
        q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, force=validate
    )
    check_bool("return_lse", return_lse)
    check_bool("deterministic", deterministic)
    scale = softmax_scale(scale, q.shape[-1])
    if resolve_backend(device) == "triton":
        check_triton_supported(q)
    o, lse = block_sparse_attn_unchecked(
        q, k, v, kv_indices, kv_counts, block_q=block_q, block_kv=block_kv,
        kv_block_sizes=kv_block_sizes, scale=scale, deterministic=deterministic,
    )  # fmt: skip
    return (o, lse) if return_lse else o


def block_sparse_attn_unchecked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    block_q: int,
    block_kv: int,
    kv_block_sizes: torch.Tensor | None,
    scale: float,
    padding_finite: bool = False,
    epilogue: Epilogue = NO_EPILOGUE,
    grads_to: GradTargets | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's internal entry, for callers inside vidsparse that built the lists
    themselves (top-k selections, stripes, windows): ``(o, lse)``, differentiable in
    q, k, v and the epilogue's tensors, through the same custom ops as ``block_sparse_attn``.

    No argument checks, so no GPU sync reading the lists back: the caller guarantees what
    ``block_sparse_attn`` would have checked, and with ``padding_finite`` that padding keys
    hold finite values (so the TMA kernels may read them). Blocks above ``configs.kernel_block_max``
    run as sub-blocks of it, as in ``block_sparse_attn`` (not with an epilogue, whose hooks
    see the caller's blocks: an error). ``epilogue``: a registered
    :class:`~vidsparse.ops.block_sparse_attn.epilogue.Epilogue` fused into the kernels
    (``lse`` stays the engine's own). ``grads_to``: q, k, v are copies of other tensors in
    another row order (``GradTargets``); the gradients go to those, written in their order by
    the backward's kernels, and q, k, v get none; with ``grads_to.output`` o comes in q's
    order and layout too (the kernels store it there). ``deterministic`` as in
    ``block_sparse_attn``."""
    backend = resolve_backend(q.device)
    cap = kernel_block_max(target_of(q.device), q.dtype)
    if backend == "triton" and max(block_q, block_kv) > cap:
        if epilogue is not NO_EPILOGUE:  # its hooks see the caller's blocks
            raise ValueError(
                f"an epilogue's blocks must be at most {cap} tokens for {q.dtype} on the"
                f" Triton path, got ({block_q}, {block_kv}): hand the engine sub-blocks of them"
            )
        kv_indices, kv_counts, kv_block_sizes, block_q, block_kv = _kernel_blocks(
            kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, cap, k.shape[2] // block_kv
        )
    targets = () if grads_to is None else (*grads_to.tensors(), grads_to.output,
                                           grads_to.regather)  # fmt: skip
    o, lse, _ = torch.ops.vidsparse.block_sparse_attn_fwd(
        q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale, backend,
        padding_finite, epilogue.call_name, *padded_tensors(epilogue), *targets,
        deterministic=deterministic,
    )  # fmt: skip
    return o, lse


def _kernel_blocks(kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, cap, num_kv_blocks):
    """The same lists over blocks a kernel program can tile: a block larger than ``cap``
    (``configs.kernel_block_max``) becomes ``cap``-token sub-blocks (same result, as each
    sub-block of a query block attends to every sub-block of its listed key blocks; lists
    no check saw keep their meaning: ``refine_block_lists``)."""
    q_ratio = max(1, block_q // cap)
    kv_ratio = max(1, block_kv // cap)
    if q_ratio == kv_ratio == 1:
        return kv_indices, kv_counts, kv_block_sizes, block_q, block_kv
    kv_indices, kv_counts = refine_block_lists(kv_indices, kv_counts, q_ratio, kv_ratio,
                                               num_kv_blocks)  # fmt: skip
    if kv_block_sizes is not None:
        kv_block_sizes = refine_block_sizes(kv_block_sizes, kv_ratio, block_kv // kv_ratio)
    return kv_indices, kv_counts, kv_block_sizes, block_q // q_ratio, block_kv // kv_ratio


# --------------------------------------------------------------------------- validation


def _normalize_block_size(block_size) -> tuple[int, int]:
    """``(block_q, block_kv)``: positive powers of two on every backend (the Triton kernels'
    tile widths), so that an input runs on the torch path only if it runs on the Triton one."""
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        block_size = (block_size, block_size)
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise TypeError(f"block_size must be an int or (block_q, block_kv), got {block_size!r}")
    block_q = check_positive_int("block_size", block_size[0])
    block_kv = check_positive_int("block_size", block_size[1])
    check_triton_blocks(block_q, block_kv)
    return block_q, block_kv


def _validate(
    q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, *, force: bool = False
) -> torch.device:
    check_qkv(q, k, v, REFERENCE_DTYPES)
    check_head_dim(q)
    check_tensor("kv_indices", kv_indices)
    check_tensor("kv_counts", kv_counts)
    if kv_block_sizes is not None:
        check_tensor("kv_block_sizes", kv_block_sizes, ndim=1, dtypes=(torch.int32,))
    device = check_same_device(
        q=q, k=k, v=v, kv_indices=kv_indices, kv_counts=kv_counts, kv_block_sizes=kv_block_sizes
    )
    B, H, Sq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, H={H}, Skv, D={D}] to match q, got {tuple(k.shape)}")
    Skv = k.shape[2]
    if Sq % block_q:
        hint = bshd_hint("q", q) if Sq < H and not H % block_q else ""  # [B, S, H, D]?
        raise ValueError(
            f"q's sequence length {Sq} is not a multiple of block_q={block_q} (block_size)" + hint
        )
    if Skv % block_kv:
        raise ValueError(
            f"k's sequence length {Skv} is not a multiple of block_kv={block_kv} (block_size)"
        )
    num_kv_blocks = Skv // block_kv
    # Value checks read the lists back (a GPU sync); do them once per list tensor and version.
    lists, params = (kv_indices, kv_counts, kv_block_sizes), (num_kv_blocks, block_kv)
    check_values = not torch.compiler.is_compiling() and (
        force or not _values_checked.contains("valid", lists, params)
    )
    derived = sys.modules.get("vidsparse.ops.block_sparse_attn.lists")  # imports Triton
    if force and derived is not None:  # lists derived from these (reordered, transposed) too
        derived.forget_derived(lists)
    validate_block_lists(
        kv_indices,
        kv_counts,
        batch=B,
        heads=H,
        num_q_blocks=Sq // block_q,
        num_kv_blocks=num_kv_blocks,
        device=device,
        check_values=check_values,
    )
    if kv_block_sizes is not None:
        if kv_block_sizes.shape[0] != num_kv_blocks:
            raise ValueError(
                f"kv_block_sizes must have Skv // block_kv = {num_kv_blocks} entries,"
                f" got {kv_block_sizes.shape[0]}"
            )
        if check_values and kv_block_sizes.numel():
            lo, hi = int(kv_block_sizes.min()), int(kv_block_sizes.max())
            if lo < 0 or hi > block_kv:
                raise ValueError(
                    f"kv_block_sizes must lie in [0, block_kv={block_kv}],"
                    f" got values in [{lo}, {hi}]"
                )
    if check_values:
        _values_checked.put("valid", lists, params, True)
    return device


# List tensors whose values passed validation (reading them back costs a GPU sync per call;
# lists are usually built once and reused): checked again after an in-place change.
_values_checked = TensorCache()


def check_triton_supported(q: torch.Tensor) -> None:
    """Refuse, before any launch, a head dim or dtype the Triton kernels do not take (every op
    on the engine calls this)."""
    D = q.shape[-1]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {D} is not supported by the Triton kernels; supported: {SUPPORTED_HEAD_DIMS}"
            " (set VIDSPARSE_BACKEND=torch for the reference path)"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the Triton kernels take fp16, bf16 or fp32 inputs, got {q.dtype}")
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not interpreter_computes_bf16():
        raise TypeError(
            "the Triton interpreter (TRITON_INTERPRET=1, CPU tensors) does not compute "
            "bfloat16 (its tl.dot multiplies the raw bits): pass float16 or float32 on the CPU, "
            "or set VIDSPARSE_BACKEND=torch"
        )


def check_triton_blocks(block_q: int, block_kv: int) -> None:
    """Refuse, before any launch, block sizes the Triton kernels cannot tile (``tl.arange``
    widths are powers of two): ``block_sparse_attn`` checks it on every backend. The video ops
    check their tile volume on the Triton path instead (``check_triton_tile``)."""
    for block in (block_q, block_kv):
        if block & (block - 1):
            raise ValueError(
                f"block_size must be a power of two (the Triton kernels' tile widths, checked"
                f" on every backend), got (block_q, block_kv) = ({block_q}, {block_kv})"
            )


# --------------------------------------------------------------------------- custom ops
# The epilogue travels as its registered name and MAX_TENSORS optional tensors (e0..e6); the
# tensor it keeps for the backward (Epilogue.forward_saved) is a third forward output, empty
# where it keeps none.


def _forward_saved(ep: Epilogue, q: torch.Tensor) -> torch.Tensor:
    saved = ep.forward_saved(q)
    if saved is None:
        return q.new_empty(0)
    ep.saved = saved  # (never on the shared NO_EPILOGUE: it keeps nothing)
    return saved


def _with_saved(ep: Epilogue, saved: torch.Tensor) -> Epilogue:
    if saved.numel():
        ep.saved = saved
    return ep


@torch.library.custom_op("vidsparse::block_sparse_attn_fwd", mutates_args=())
def _block_sparse_attn_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor | None,
    block_q: int,
    block_kv: int,
    scale: float,
    backend: str,
    padding_finite: bool,
    epilogue: str,
    e0: torch.Tensor | None,
    e1: torch.Tensor | None,
    e2: torch.Tensor | None,
    e3: torch.Tensor | None,
    e4: torch.Tensor | None,
    e5: torch.Tensor | None,
    e6: torch.Tensor | None,
    gq: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    q_rows: torch.Tensor | None = None,
    kv_rows: torch.Tensor | None = None,
    out_rows: bool = False,
    regather: bool = False,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, lse, the epilogue's saved tensor)``. ``gq`` .. ``kv_rows``: ``GradTargets``
    (read by the backward only); ``out_rows``: o in gq's order and layout
    (``GradTargets.output``); ``regather``: the backward keeps gq, gk, gv instead of q, k, v
    (``GradTargets.regather``); ``deterministic``: read by the backward only."""
    ep = epilogue_from(epilogue, (e0, e1, e2, e3, e4, e5, e6))
    saved = _forward_saved(ep, q)
    out_to = _output_rows(gq, gk, q_rows, kv_rows, out_rows)
    if _nothing_to_attend(q, k, block_kv, epilogue):
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        return empty_output(q, out_to).zero_(), lse, saved
    if backend == "triton":
        from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

        o, lse = block_sparse_attn_fwd(
            q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale,
            padding_finite=padding_finite, epilogue=ep, out_rows=out_to,
        )  # fmt: skip
        return o, lse, saved
    o, lse = block_sparse_attn_ref(
        q, k, v, kv_indices, kv_counts, block_q=block_q, block_kv=block_kv,
        kv_block_sizes=kv_block_sizes, scale=scale,
    )  # fmt: skip
    o = ep.forward_torch(o, EngineCall(block_q, block_kv, kv_block_sizes, scale, q.dtype))
    if out_to is not None:
        return scatter_rows(empty_output(q, out_to), o, q_rows, q_rows >= 0), lse.float(), saved
    return torch.empty_like(q).copy_(o), lse.float(), saved  # q's strides, as the Triton path


def _output_rows(gq, gk, q_rows, kv_rows, out_rows: bool) -> GradRows | None:
    """Where the forward stores o with ``out_rows`` (``GradTargets.output``): the targets'
    row maps and layouts; None for the engine's own order."""
    if not out_rows:
        return None
    if gq is None:
        raise ValueError("out_rows needs the GradTargets (gq .. kv_rows) it stores o by")
    return GradRows(q_rows, kv_rows, *_target_layout(gq, gk), out=True)


def _target_layout(gq, gk) -> list[int]:
    """``[q_len, kv_len, q_bshd, kv_bshd]`` of the targets (``GradRows``' layout fields)."""
    return [gq.shape[2], gk.shape[2], int(is_bshd_view(gq)), int(is_bshd_view(gk))]


@_block_sparse_attn_fwd_op.register_fake
def _(q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale, backend,
      padding_finite, epilogue, e0, e1, e2, e3, e4, e5, e6, gq=None, gk=None, gv=None,
      q_rows=None, kv_rows=None, out_rows=False, regather=False, deterministic=True):  # fmt: skip
    B, H, Sq, _ = q.shape
    saved = _forward_saved(epilogue_from(epilogue, (e0, e1, e2, e3, e4, e5, e6)), q)
    o = empty_output(q, _output_rows(gq, gk, q_rows, kv_rows, out_rows))
    return o, q.new_empty((B, H, Sq), dtype=torch.float32), saved


@torch.library.custom_op("vidsparse::block_sparse_attn_bwd", mutates_args=())
def _block_sparse_attn_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    saved: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor | None,
    block_q: int,
    block_kv: int,
    scale: float,
    backend: str,
    padding_finite: bool,
    epilogue: str,
    e0: torch.Tensor | None,
    e1: torch.Tensor | None,
    e2: torch.Tensor | None,
    e3: torch.Tensor | None,
    e4: torch.Tensor | None,
    e5: torch.Tensor | None,
    e6: torch.Tensor | None,
    q_rows: torch.Tensor | None = None,
    kv_rows: torch.Tensor | None = None,
    grad_layout: list[int] | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``(dq, dk, dv, [gradient of e0, e1, ...])``; an empty tensor where there is none.
    With ``q_rows``, ``kv_rows`` the gradients come in the caller's row order (``GradRows``;
    ``grad_layout``: q_len, kv_len, q_bshd, kv_bshd and, optionally, out: o and do are in
    the q side's order too). ``deterministic``: as ``block_sparse_attn``'s (the reference
    path is deterministic either way)."""
    ep = _with_saved(epilogue_from(epilogue, (e0, e1, e2, e3, e4, e5, e6)), saved)
    grad_rows = _grad_rows(q_rows, kv_rows, grad_layout)
    if _nothing_to_attend(q, k, block_kv, epilogue):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), _slots((), do)
    if backend == "triton":
        from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd

        dq, dk, dv = block_sparse_attn_bwd(
            do, q, k, v, o, lse, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv,
            scale, padding_finite=padding_finite, epilogue=ep, grad_rows=grad_rows,
            deterministic=deterministic,
        )  # fmt: skip
    else:
        if grad_rows is not None and grad_rows.out:  # o and do to the engine's rows
            o, do = gather_rows(o, q_rows), gather_rows(do, q_rows)
        dq, dk, dv = _backward_torch(do, q, k, v, o, kv_indices, kv_counts, kv_block_sizes,
                                     block_q, block_kv, scale, ep)  # fmt: skip
        if grad_rows is not None:
            dq, dk, dv = scatter_grads((dq, dk, dv), grad_rows, kv_block_sizes, block_kv)
    return dq, dk, dv, _slots(ep.gradients(), do)


def _grad_rows(q_rows, kv_rows, grad_layout) -> GradRows | None:
    if q_rows is None:
        return None
    q_len, kv_len, q_bshd, kv_bshd, *out = grad_layout
    return GradRows(q_rows, kv_rows, q_len, kv_len, bool(q_bshd), bool(kv_bshd),
                    bool(out and out[0]))  # fmt: skip


def _nothing_to_attend(q, k, block_kv, epilogue: str) -> bool:
    """An empty output (B, H or Sq of 0) or no key block (Skv = 0, every count 0, as the
    public entry checked): o = 0, lse = -inf and zero gradients on every backend, no launch.
    Without an epilogue only (the internal callers never pass empty inputs)."""
    return epilogue == NO_EPILOGUE.name and (q.numel() == 0 or k.shape[2] // block_kv == 0)


def _backward_torch(do, q, k, v, o, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv,
                    scale, ep):  # fmt: skip
    call = EngineCall(block_q, block_kv, kv_block_sizes, scale, q.dtype)
    o, do = ep.prologue_torch(o, do, call)
    dq, dk, dv = block_sparse_attn_bwd_ref(
        do, q, k, v, o, kv_indices, kv_counts, block_q=block_q, block_kv=block_kv,
        kv_block_sizes=kv_block_sizes, scale=scale,
    )  # fmt: skip
    return ep.grads_torch(dq, dk, dv, call)


def _slots(grads, like: torch.Tensor) -> list[torch.Tensor]:
    padded = [*grads, *([None] * (MAX_TENSORS - len(grads)))]
    return [like.new_empty(0) if g is None else g for g in padded]


@_block_sparse_attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, saved, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv,
      scale, backend, padding_finite, epilogue, e0, e1, e2, e3, e4, e5, e6, q_rows=None,
      kv_rows=None, grad_layout=None, deterministic=True):  # fmt: skip
    ep = epilogue_from(epilogue, (e0, e1, e2, e3, e4, e5, e6))
    grads = _slots(ep.fake_gradients(), do)
    grad_rows = _grad_rows(q_rows, kv_rows, grad_layout)
    q_layout, kv_layout = (None, None) if grad_rows is None else grad_rows.layouts()
    return (*empty_grads(q_layout, q), *empty_grads(kv_layout, k, v), grads)


def _setup_context(ctx, inputs, output):
    (q, k, v, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv, scale, backend,
     finite, epilogue, *rest, deterministic) = inputs  # fmt: skip
    tensors, targets = rest[:MAX_TENSORS], _targets(rest[MAX_TENSORS:])
    gq, gk, gv, q_rows, kv_rows, out_rows, regather = targets
    o, lse, saved = output
    ctx.regather = regather and gq is not None
    kept = (gq, gk, gv) if ctx.regather else (q, k, v)  # the copies are gathered again
    ctx.save_for_backward(*kept, o, lse, saved, kv_indices, kv_counts, kv_block_sizes,
                          q_rows, kv_rows, *tensors)  # fmt: skip
    # The targets' layouts (and, with regather, the targets in place of q, k, v): nothing
    # more is kept alive for the backward.
    ctx.grad_layout = None if gq is None else [*_target_layout(gq, gk), int(out_rows)]
    ctx.meta = (block_q, block_kv, scale, backend, finite, epilogue)
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse, saved)


# The forward op's GradTargets inputs: its five tensors, then out_rows and regather.
_TARGET_ARGS = len(GradTargets._fields)
_TARGET_FLAGS = 2


def _targets(rest) -> tuple:
    """The forward op's ``GradTargets`` inputs (Nones where the call passed none), then
    ``out_rows`` and ``regather``."""
    padded = (*rest, *([None] * (_TARGET_ARGS - len(rest))))
    flags = padded[-_TARGET_FLAGS:]
    return (*padded[:-_TARGET_FLAGS], *(bool(f) for f in flags))


def _backward(ctx, do, _dlse, _dsaved):
    (q, k, v, o, lse, saved, kv_indices, kv_counts, kv_block_sizes, q_rows, kv_rows,
     *tensors) = ctx.saved_tensors  # fmt: skip
    block_q, block_kv, scale, backend, padding_finite, epilogue = ctx.meta
    if ctx.regather:  # the engine's copies, from the targets kept instead
        q, k, v = gather_rows(q, q_rows), gather_rows(k, kv_rows), gather_rows(v, kv_rows)
    mapped = ctx.grad_layout is not None
    maps = (q_rows, kv_rows, ctx.grad_layout) if mapped else ()
    dq, dk, dv, grads = torch.ops.vidsparse.block_sparse_attn_bwd(
        do, q, k, v, o, lse, saved, kv_indices, kv_counts, kv_block_sizes, block_q, block_kv,
        scale, backend, padding_finite, epilogue, *tensors, *maps,
        deterministic=ctx.deterministic,
    )  # fmt: skip
    # Only tensors that took part get a gradient (an empty slot means none).
    tensor_grads = [
        g if t is not None and g.shape == t.shape else None for g, t in zip(grads, tensors)
    ]
    if mapped:  # the gradients are the targets': q, k, v get none
        flags = [None] * _TARGET_FLAGS
        return (None, None, None, *([None] * 9), *tensor_grads, dq, dk, dv, None, None, *flags,
                None)  # fmt: skip
    return (dq, dk, dv, *([None] * 9), *tensor_grads, *([None] * _TARGET_ARGS), None)


_block_sparse_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)
