"""VSA's fine stage with the gate combine fused into the engine's epilogue.

::

    o[b, h, tile i, row r] = o_fine[b, h, i, r] + gate[b, h, i, r] * o_coarse[b, h, i]
                             (0 for padding rows when ``q_block_sizes`` is given)

``o_fine`` is block-sparse attention over the key tiles listed for tile ``i`` (the engine's
forward kernel); the sum is formed in fp32 in the kernel before the one store of ``o``, so the
combine costs no pass over memory of its own, and ``o_fine`` is not kept: the backward is the
engine's backward with ``o_fine = o - gate * o_coarse`` recomputed in its preprocess kernel,
which reads ``do`` anyway and also forms

    d o_coarse[b, h, i] = sum_r do[b, h, i, r] * gate[b, h, i, r]      d gate = do * o_coarse

and gives padding rows (constant 0 in ``o``) no gradient. Given the coarse stage's tile means
(``pooled``), the coarse attention's backward runs here too, between the preprocess and the
two gradient kernels, which add each tile mean's gradient share (``d mean_i / size_i``) to the
tile's real rows: the pooling's backward costs no pass of its own and the two branches'
gradients need no sum.

Registered as custom ops so ``torch.compile`` keeps the call whole.
"""

from __future__ import annotations

import torch

from vidsparse.ops.block_sparse_attn.reference import (
    block_sparse_attn_bwd_ref,
    block_sparse_attn_ref,
)
from vidsparse.ops.video_sparse_attn.coarse import (
    coarse_attn_bwd,
    coarse_grad_dtype,
    tile_mean_pool_bwd_torch,
)
from vidsparse.utils.backend import resolve_backend


def vsa_fine_combined(
    q_t: torch.Tensor,
    k_seq: torch.Tensor,
    v_seq: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor,
    o_coarse: torch.Tensor,
    gate_t: torch.Tensor | None,
    q_block_sizes: torch.Tensor | None,
    block: int,
    scale: float,
    pooled: torch.Tensor | None = None,
) -> torch.Tensor:
    """``o_fine + gate * o_coarse`` over tile-order queries ``q_t [B, H, Nt*V, D]``.

    Lists must be valid (they come from the selection kernel); ``o_coarse [B, H, Nt, D]``
    (fp32); ``gate_t`` like ``q_t`` or None (then ``o_fine + o_coarse``); padding keys must be
    finite (zeros from tiling, or a tiled input's padding rows), their scores are masked.

    ``pooled`` (``[3, B, H, Nt, D]``, the coarse stage's tile means of q_t and the first Nt key
    tiles of k_seq, v_seq, from which ``o_coarse`` was computed) fuses the coarse branch's
    backward into this op's: the gradient through ``o_coarse`` reaches q_t, k_seq and v_seq
    here, inside the engine's kernels, and ``o_coarse`` itself gets none (the coarse stage's
    own backward then never runs). Without it, ``o_coarse`` gets its gradient as usual.
    """
    if pooled is not None:
        # The gradient through o_coarse is formed in this op's backward: cut the coarse stage's
        # own backward out of the graph (a None gradient would be materialised as zeros and
        # still run it).
        o_coarse = o_coarse.detach()
    o, _ = torch.ops.vidsparse.vsa_fine_fwd(
        q_t,
        k_seq,
        v_seq,
        kv_indices,
        kv_counts,
        kv_block_sizes,
        o_coarse,
        None if gate_t is None else gate_t.contiguous(),
        q_block_sizes,
        pooled,
        block,
        scale,
        resolve_backend(q_t.device),
    )
    return o


@torch.library.custom_op("vidsparse::vsa_fine_fwd", mutates_args=())
def _vsa_fine_fwd_op(
    q_t: torch.Tensor,
    k_seq: torch.Tensor,
    v_seq: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor,
    o_coarse: torch.Tensor,
    gate_t: torch.Tensor | None,
    q_block_sizes: torch.Tensor | None,
    pooled: torch.Tensor | None,
    block: int,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(o, lse)`` (``lse`` of the fine attention). ``pooled`` is only kept for the
    backward, which recomputes ``o_fine`` from ``o``: no copy of it is stored."""
    if backend != "triton":
        return _combined_torch(
            q_t, k_seq, v_seq, kv_indices, kv_counts, kv_block_sizes, o_coarse, gate_t,
            q_block_sizes, block, scale,
        )  # fmt: skip
    from vidsparse.ops.block_sparse_attn.fwd import CoarseCombine, block_sparse_attn_fwd_combined

    combine = CoarseCombine(o_coarse.contiguous(), gate_t, q_block_sizes)
    return block_sparse_attn_fwd_combined(
        q_t,
        k_seq,
        v_seq,
        kv_indices,
        kv_counts,
        kv_block_sizes,
        block,
        block,
        scale,
        combine,
        padding_finite=True,
    )


def _combined_torch(q_t, k_seq, v_seq, kv_indices, kv_counts, sizes, o_coarse, gate_t, q_sizes,
                    block, scale):  # fmt: skip
    """The same on the engine's PyTorch reference (CPU, ``VIDSPARSE_BACKEND=torch``)."""
    o_fine, lse = block_sparse_attn_ref(
        q_t, k_seq, v_seq, kv_indices, kv_counts, block_q=block, block_kv=block,
        kv_block_sizes=sizes, scale=scale,
    )  # fmt: skip
    o = o_fine.float() + _coarse_term(o_coarse, gate_t, block, torch.float32)
    if q_sizes is not None:
        o = o.masked_fill(_padding_rows(q_sizes, block), 0)
    return torch.empty_like(q_t).copy_(o), lse.float()  # strides as the Triton path


def _coarse_term(o_coarse, gate_t, block: int, dtype) -> torch.Tensor:
    """``gate * o_coarse`` broadcast over each block's rows ([B, H, S, D], in ``dtype``)."""
    coarse = o_coarse.to(dtype).repeat_interleave(block, dim=2)
    return coarse if gate_t is None else gate_t.to(dtype) * coarse


def _padding_rows(q_sizes: torch.Tensor, block: int) -> torch.Tensor:
    """Bool ``[1, 1, S, 1]``: the rows past each block's real size."""
    real = torch.arange(block, device=q_sizes.device) < q_sizes.view(-1, 1)  # [NQ, V]
    return ~real.view(1, 1, -1, 1)


@_vsa_fine_fwd_op.register_fake
def _(q_t, k_seq, v_seq, kv_indices, kv_counts, sizes, o_coarse, gate_t, q_sizes, pooled, block,
      scale, backend):  # fmt: skip
    B, H, S, _ = q_t.shape
    return torch.empty_like(q_t), q_t.new_empty((B, H, S), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    (q_t, k_seq, v_seq, kv_indices, kv_counts, sizes, o_coarse, gate_t, q_sizes, pooled, block,
     scale, backend) = inputs  # fmt: skip
    o, lse = output
    ctx.save_for_backward(
        q_t, k_seq, v_seq, o, lse, kv_indices, kv_counts, sizes, o_coarse, gate_t, q_sizes, pooled
    )
    ctx.meta = (block, scale, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    (q_t, k_seq, v_seq, o, lse, kv_indices, kv_counts, sizes, o_coarse, gate_t, q_sizes,
     pooled) = ctx.saved_tensors  # fmt: skip
    block, scale, backend = ctx.meta
    dq, dk, dv, d_coarse, d_gate = torch.ops.vidsparse.vsa_fine_bwd(
        do, q_t, k_seq, v_seq, o, lse, kv_indices, kv_counts, sizes, o_coarse, gate_t,
        q_sizes, pooled, block, scale, backend,
    )  # fmt: skip
    # With pooled, the coarse branch's gradient is already in dq, dk, dv (see vsa_fine_combined).
    d_oc = None if pooled is not None else d_coarse.to(o_coarse.dtype)
    return (dq, dk, dv, None, None, None, d_oc, None if gate_t is None else d_gate, None, None,
            None, None, None)  # fmt: skip


@torch.library.custom_op("vidsparse::vsa_fine_bwd", mutates_args=())
def _vsa_fine_bwd_op(
    do: torch.Tensor,
    q_t: torch.Tensor,
    k_seq: torch.Tensor,
    v_seq: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor,
    o_coarse: torch.Tensor,
    gate_t: torch.Tensor | None,
    q_block_sizes: torch.Tensor | None,
    pooled: torch.Tensor | None,
    block: int,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv, d_o_coarse fp32, d_gate)`` (``d_gate`` empty without a gate),
    given the forward's combined output ``o`` and fine ``lse``.

    Triton: the engine's backward, with the combine's gradients formed in its preprocess kernel
    from the one read of ``do`` (padding rows carry no gradient: they are constant 0). With
    ``pooled``, the coarse attention's backward runs between the preprocess and the two
    gradient kernels, which add each tile mean's gradient share to the tile's real rows."""
    pooled_grad = None
    if pooled is not None:
        low = coarse_grad_dtype(q_t.dtype)

        def pooled_grad(d_coarse):
            return coarse_attn_bwd(d_coarse, pooled[0], pooled[1], pooled[2], scale, low)

    if backend != "triton":
        return _combined_bwd_torch(
            do, q_t, k_seq, v_seq, o, kv_indices, kv_counts, kv_block_sizes, o_coarse,
            gate_t, q_block_sizes, block, scale, pooled_grad,
        )  # fmt: skip
    from vidsparse.ops.block_sparse_attn.bwd import CoarseGrad, block_sparse_attn_bwd_combined

    dq, dk, dv, d_coarse, d_gate = block_sparse_attn_bwd_combined(
        do, q_t, k_seq, v_seq, o, lse, kv_indices, kv_counts, kv_block_sizes, block, block,
        scale, CoarseGrad(o_coarse, gate_t, q_block_sizes, pooled_grad), padding_finite=True,
    )  # fmt: skip
    return dq, dk, dv, d_coarse, (d_gate if d_gate is not None else do.new_empty(0))


def _combined_bwd_torch(do, q_t, k_seq, v_seq, o, kv_indices, kv_counts, sizes, o_coarse,
                        gate_t, q_sizes, block, scale, pooled_grad):  # fmt: skip
    """The same on the engine's PyTorch reference; the combine's sums in fp32 (fp64 for fp64)."""
    B, H, S, D = q_t.shape
    acc = torch.promote_types(do.dtype, torch.float32)
    num_tiles = S // block
    o_fine = o.to(acc) - _coarse_term(o_coarse, gate_t, block, acc)
    if q_sizes is not None:  # padding rows of o are constant zero: no gradient flows back
        do = do.masked_fill(_padding_rows(q_sizes, block), 0)
    dq, dk, dv = block_sparse_attn_bwd_ref(
        do, q_t, k_seq, v_seq, o_fine, kv_indices, kv_counts, block_q=block, block_kv=block,
        kv_block_sizes=sizes, scale=scale,
    )  # fmt: skip
    do5 = do.to(acc).view(B, H, num_tiles, block, D)
    if gate_t is None:
        d_coarse, d_gate = do5.sum(-2), do.new_empty(0)
    else:
        d_coarse = (do5 * gate_t.to(acc).view(B, H, num_tiles, block, D)).sum(-2)
        d_gate = (do5 * o_coarse.to(acc).unsqueeze(-2)).to(gate_t.dtype).view(B, H, S, D)
    if pooled_grad is not None:  # the tile-mean pooling's backward, added to the fine grads
        shares = tile_mean_pool_bwd_torch(pooled_grad(d_coarse), sizes[:num_tiles], S, acc)
        dq = (dq.to(acc) + shares[0]).to(dq.dtype)
        dk, dv = (g.clone() for g in (dk, dv))
        for g, share in zip((dk, dv), shares[1:]):
            g[:, :, :S] = (g[:, :, :S].to(acc) + share).to(g.dtype)
    return dq, dk, dv, d_coarse, d_gate


@_vsa_fine_bwd_op.register_fake
def _(do, q_t, k_seq, v_seq, o, lse, kv_indices, kv_counts, sizes, o_coarse, gate_t,
      q_sizes, pooled, block, scale, backend):  # fmt: skip
    B, H, S, D = q_t.shape
    acc = torch.promote_types(do.dtype, torch.float32)  # fp32 as the kernel; fp64 on torch
    d_coarse = q_t.new_empty((B, H, S // block, D), dtype=acc)
    d_gate = torch.empty_like(gate_t) if gate_t is not None else do.new_empty(0)
    return torch.empty_like(q_t), torch.empty_like(k_seq), torch.empty_like(v_seq), d_coarse, d_gate


_vsa_fine_fwd_op.register_autograd(_backward, setup_context=_setup_context)
