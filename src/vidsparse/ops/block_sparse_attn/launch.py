"""Launch helpers shared by the engine's forward and backward launchers."""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn.lists import cached_blocks_by_size, derived_lists

LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: log2(e) joins the scale


def broadcast_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of a per-(batch, head) index tensor, with 0 for a batch dim of size 1."""
    strides = list(x.stride())
    if x.shape[0] == 1:
        strides[0] = 0
    return tuple(strides)


def eviction_hints(cfg: configs.KernelConfig, suffix: str = "") -> dict:
    """The kernels' eviction-hint constexprs from ``cfg``: ``EVICT_STREAMED`` and
    ``EVICT_RESIDENT`` (``configs`` says which loads each names), ``suffix`` appended for one
    half of the fused backward."""
    return {f"EVICT_STREAMED{suffix}": cfg.evict_streamed,
            f"EVICT_RESIDENT{suffix}": cfg.evict_resident}  # fmt: skip


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit stride on the head dim and 16-byte aligned base and strides."""
    for x in tensors:
        if x.stride(-1) != 1 or x.data_ptr() % 16:
            return False
        if any((s * x.element_size()) % 16 for s in x.stride()[:-1]):
            return False
    return True


def tma_reads_keys(dtype: torch.dtype, kv_block_sizes, padding_finite: bool) -> bool:
    """May K and V be read by TMA? Not for fp32 (only the pointer kernels take its dot
    precision, ``configs.dot_precision``), and since TMA reads whole key blocks, padding keys
    only where the caller vouches them finite: pointer loads never read them."""
    return dtype != torch.float32 and (kv_block_sizes is None or padding_finite)


def tensor_descriptor(x: torch.Tensor, rows: int):
    """TMA descriptor over a [B, H, S, D] tensor whose blocks are ``rows`` whole token rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, x.shape[-1]])


def walk_tails(cfg: configs.KernelConfig, tails: tuple[int, int]) -> dict:
    """The kernels' ``TAIL1``, ``TAIL2`` constexprs: the short walks' rows ``tails`` (the
    lists' groups, ``lists_by_size``) where config ``cfg`` takes them, else 0 (the kernel walks
    those groups with all rows, ``kernels/common.walk_ends``)."""
    tail1, tail2 = tails if cfg.key_tails else (0, 0)
    return {"TAIL1": tail1, "TAIL2": tail2}


def walk_operands(a, b, tails, by_tma: bool) -> tuple:
    """A pair of the kernels' operands for their two short walks (``a1, b1, a2, b2``: K, V
    for the walks of partial key blocks, Q, dO for dK/dV's walks of partial query blocks):
    with ``by_tma`` TMA descriptors in boxes of each walk's rows (``tails``, from
    ``walk_tails``), else ``a, b`` themselves (pointer loads). A walk that does not run (0)
    gets the tensors, never read, and so costs no descriptor on the host."""
    if not by_tma:
        return (a, b) * 2
    out = []
    for rows in tails:
        out += [tensor_descriptor(a, rows), tensor_descriptor(b, rows)] if rows else [a, b]
    return tuple(out)


def lists_by_size(kv_indices, kv_counts, kv_block_sizes, block_kv):
    """``(lists, counts, ends, tails, checked)`` for the kernels' walks: without key-block
    sizes the lists as given (every block full; ``kv_counts`` stands in for the ends, which the
    kernels then do not read), else reordered by ``lists.blocks_by_size`` (full blocks, then
    partial ones walked with all rows, ``tails[0]`` and ``tails[1]`` rows; ``ends`` int32
    ``[Bi, H, NQ, 3]``), with their own counts. ``checked``: the kernels must check each entry
    and count against the bounds (the caller's lists, which a write behind the validation's
    back may have spoiled); the reordered lists are valid by construction, so the kernels walk
    them as they are. Tuning can turn the reorder off (``configs.override(full_first=False)``):
    every block then takes the masked walk with all rows."""
    if kv_block_sizes is None:
        return kv_indices, kv_counts, kv_counts, (0, 0), True
    if not configs.active_overrides().full_first:
        width = kv_indices.shape[-1]
        ends = torch.zeros((*kv_counts.shape, 3), device=kv_counts.device, dtype=torch.int32)
        ends[..., 1:] = width  # the kernels clamp ends to the count: all masked, all rows
        return kv_indices, kv_counts, ends, (0, 0), True
    tails = configs.key_tails(block_kv)
    lists, ends, counts = cached_blocks_by_size(kv_indices, kv_counts, kv_block_sizes, block_kv,
                                                tails)  # fmt: skip
    return lists, counts, ends, tails, False


def list_end_strides(ends: torch.Tensor) -> tuple[int, int, int]:
    """The kernels' ``(b, h, query block)`` strides of ``ends`` (a batch of 1 broadcasts)."""
    return broadcast_strides(ends)[:3]


def int32_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous int32, converted once per list tensor (``lists.derived_lists``)."""
    if x.dtype == torch.int32 and x.stride(-1) == 1:
        return x
    return derived_lists.get("int32", (x,), (), lambda: x.to(torch.int32).contiguous())


# The Tritons whose Gluon API the Hopper kernels are written for (compile-checked on 3.6 and
# 3.8: tests/ops/block_sparse_attn/test_gluon_fwd.py, tests/compile/test_compile_bwd_sm90.py).
# Gluon is experimental and moves: Triton 3.9 removed tma.async_copy_shared_to_global, which
# their stores use.
GLUON_TRITONS = ((3, 6), (3, 8))


@functools.cache
def gluon_launcher(module: str, kernel: str):
    """The Gluon launcher module ``module`` of this package (``"fwd_sm90"``, ``"bwd_sm90"``),
    or None where this Triton's Gluon API is not the one it is written for
    (``GLUON_TRITONS``) or it does not import. Then the Triton kernels run instead, and the log
    says why, once per launcher (``kernel`` names it there: "forward", "backward")."""
    from vidsparse.utils.device import triton_version

    version = triton_version()
    shown = ".".join(map(str, version)) if version else "?"
    if version is None or not GLUON_TRITONS[0] <= version <= GLUON_TRITONS[-1]:
        span = "-".join(".".join(map(str, v)) for v in GLUON_TRITONS)
        reason = f"it is written for the Gluon API of Triton {span}"
    else:
        try:
            return importlib.import_module(f"vidsparse.ops.block_sparse_attn.{module}")
        except (ImportError, AttributeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
    logging.getLogger("vidsparse").warning(
        "vidsparse: the Hopper Gluon %s is off with Triton %s (%s); the Triton TMA kernel "
        "runs instead", kernel, shown, reason,
    )  # fmt: skip
    return None
