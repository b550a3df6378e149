"""Forward launcher of block-sparse flash attention: config, kernel choice, grid.

Three kernels compute the same thing: the pointer-load kernel (any dtype and strides; padding
keys never read), the TMA kernel (Hopper, fp16/bf16) and, where the config asks for it and
the inputs fit, the Gluon kernel (Hopper, ``fwd_sm90.py``). TMA reads whole key blocks, so
inputs with padding keys take it only where the caller vouches them finite. The config's
eviction hints reach the pointer kernel only (TMA loads take none).
"""

from __future__ import annotations

import torch

from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE, EngineCall, Epilogue
from vidsparse.ops.block_sparse_attn.grad_rows import GradRows, empty_output, output_map
from vidsparse.ops.block_sparse_attn.kernels.fwd import (
    block_sparse_attn_fwd_kernel,
    block_sparse_attn_fwd_tma_kernel,
)
from vidsparse.ops.block_sparse_attn.launch import (
    LOG2E,
    broadcast_strides,
    eviction_hints,
    gluon_launcher,
    list_end_strides,
    lists_by_size,
    tensor_descriptor,
    tma_compatible,
    tma_reads_keys,
    walk_operands,
    walk_tails,
)
from vidsparse.utils.device import target_of


def block_sparse_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor | None,
    block_q: int,
    block_kv: int,
    scale: float,
    *,
    padding_finite: bool = False,
    epilogue: Epilogue = NO_EPILOGUE,
    out_rows: GradRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` on inputs the caller has validated; ``lse`` is the engine's own (before
    the epilogue). ``padding_finite``: padding keys (past ``kv_block_sizes``) hold finite
    values, so the TMA kernels may read them (their scores are masked). ``out_rows``: o is
    stored in its q side's order and layout (``GradTargets.output``; lse stays in the
    engine's)."""
    B, H, Sq, D = q.shape
    masked = kv_block_sizes is not None
    cfg = configs.lookup(target_of(q.device), "fwd", block_q, block_kv, D, masked,
                         fp32=q.dtype == torch.float32)  # fmt: skip
    by_size = lists_by_size(kv_indices, kv_counts, kv_block_sizes, block_kv)
    kv_indices, kv_counts, ends, tails, checked = by_size
    call = EngineCall(block_q, block_kv, kv_block_sizes, scale, q.dtype)
    fns = epilogue.fns()
    tma_possible = tma_reads_keys(q.dtype, kv_block_sizes, padding_finite)
    cfg, use_tma = cfg.for_inputs(tma_possible and tma_compatible(q, k, v), block_q)
    if (
        use_tma
        and cfg.gluon
        and fns.forward_sm90 is not None
        and gluon_fits(q, k, v, block_q, block_kv)
    ):
        from vidsparse.ops.block_sparse_attn.fwd_sm90 import block_sparse_attn_fwd_sm90

        return block_sparse_attn_fwd_sm90(
            q, k, v, kv_indices, kv_counts, block_q, block_kv, scale,
            kv_block_sizes=kv_block_sizes, ends=ends if masked else None, tails=tails,
            epilogue=epilogue, out_rows=out_rows,
        )  # fmt: skip
    o = empty_output(q, out_rows)
    o_rows, mapped = output_map(out_rows, o)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    sizes = kv_block_sizes if masked else kv_counts  # dummy pointer when unused
    lists = (kv_indices, kv_counts, sizes, ends, *list_end_strides(ends))
    hook = (fns.forward.fn, epilogue.forward_args(call))
    grid = (Sq // block_q, B * H)
    bounds = (k.shape[2] // block_kv, kv_indices.shape[-1])  # NK, K: the kernels' memory safety
    common = dict(BLOCK_M=block_q, BLOCK_N=block_kv, HEAD_DIM=D, HAS_KV_SIZES=masked,
                  CHECK_LISTS=checked, **walk_tails(cfg, tails),
                  **cfg.launch_kwargs())  # fmt: skip
    if use_tma:
        desc = tensor_descriptor
        # A mapped o is stored by pointers: the q descriptor stands in, never stored through.
        desc_o = desc(q if mapped else o, block_q)
        block_sparse_attn_fwd_tma_kernel[grid](
            desc(q, block_q), desc(k, block_kv), desc(v, block_kv), desc_o, lse,
            (o, o_rows, *o.stride()),
            *walk_operands(k, v, walk_tails(cfg, tails).values(), True), *lists,
            *broadcast_strides(kv_indices), *broadcast_strides(kv_counts),
            *hook, H, Sq, *bounds, scale * LOG2E,
            WARP_SPECIALIZE=cfg.warp_specialize, **common, OUT_MAPPED=mapped,
        )  # fmt: skip
        return o, lse
    block_sparse_attn_fwd_kernel[grid](
        q, k, v, o, lse, o_rows, *lists,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        *broadcast_strides(kv_indices), *broadcast_strides(kv_counts),
        *hook, H, Sq, *bounds, scale * LOG2E,
        DOT_PRECISION=configs.dot_precision(target_of(q.device), q.dtype),
        **eviction_hints(cfg), **common, OUT_MAPPED=mapped,
    )  # fmt: skip
    return o, lse


def gluon_fits(q, k, v, block_q, block_kv) -> bool:
    launcher = gluon_launcher("fwd_sm90", "forward")
    return launcher is not None and launcher.gluon_fits(q, k, v, block_q, block_kv)
