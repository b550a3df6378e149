"""Pure-PyTorch block-sparse attention: the oracle for the kernels and the CPU path.

Computes in fp32 (fp64 when the inputs are fp64) and is chunked over query blocks, so memory is
``O(chunk * K * block_kv * D)``: a 32k-token input never materialises an ``S x S`` tensor.
Differentiable by autograd (used as the backward of the torch backend).
"""

from __future__ import annotations

import math

import torch

# Upper bound on gathered key elements per chunk (B*H*C*K*block_kv*D), ~256 MB in fp32.
_GATHER_BUDGET = 64 * 1024 * 1024


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gather_key_blocks(xb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """xb [B, H, NK, bk, D], idx [B, H, C, K] -> [B, H, C, K * bk, D]."""
    B, H, C, K = idx.shape
    b = torch.arange(B, device=idx.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=idx.device).view(1, H, 1, 1)
    g = xb[b, h, idx]  # [B, H, C, K, bk, D]
    return g.flatten(3, 4)


def _masked_softmax_with_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of scores holding -inf for masked keys.

    Rows with no live key give p = 0 and lse = -inf. Written so that autograd never multiplies
    a zero gradient by an infinity (which logsumexp of an all -inf row would do).
    No key slot at all (lists of width K = 0) is the same: every row attends to nothing.
    """
    if s.shape[-1] == 0:
        return s * 0, s.new_full(s.shape[:-1], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()  # stabiliser only
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    live = denom > 0
    denom = torch.where(live, denom, torch.ones_like(denom))
    lse = torch.where(live, m + torch.log(denom), torch.full_like(denom, float("-inf")))
    return e / denom, lse.squeeze(-1)


class _ChunkPlan:
    """Index bookkeeping shared by the reference forward and backward.

    Gathers each query block's listed key blocks, masks slots past the count and padding keys,
    and splits the query blocks into chunks that fit the gather budget.
    """

    def __init__(self, q, k, kv_indices, kv_counts, block_q, block_kv, kv_block_sizes, scale):
        B, H, Sq, D = q.shape
        self.B, self.H, self.D = B, H, D
        self.NQ, self.NK = Sq // block_q, k.shape[2] // block_kv
        self.block_q, self.block_kv = block_q, block_kv
        self.scale = 1.0 / math.sqrt(D) if scale is None else scale
        self.cdt = _compute_dtype(q)
        K = kv_indices.shape[-1]
        idx = kv_indices.long().expand(B, H, self.NQ, K)
        counts = kv_counts.long().expand(B, H, self.NQ)
        slot_ok = torch.arange(K, device=q.device) < counts[..., None]  # [B, H, NQ, K]
        # An entry out of [0, NK) (lists changed behind the validation's back) contributes
        # nothing, as in the kernels: never an index error.
        slot_ok = slot_ok & (idx >= 0) & (idx < self.NK)
        self.idx = torch.where(slot_ok, idx, torch.zeros_like(idx))
        # A key is live if its slot is within the count and it is a real (non-padding) token.
        key_ok = slot_ok[..., None].expand(B, H, self.NQ, K, block_kv)  # [B, H, NQ, K, bk]
        if kv_block_sizes is not None:
            sizes = kv_block_sizes.long()[self.idx][..., None]
            key_ok = key_ok & (torch.arange(block_kv, device=q.device) < sizes)
        self.key_ok = key_ok.flatten(3, 4)  # [B, H, NQ, K * bk]
        per_block = B * H * max(K, 1) * block_kv * D
        self.chunk = max(1, min(self.NQ, _GATHER_BUDGET // max(per_block, 1)))

    def blocks(self, x):  # [B, H, Sq, D] -> [B, H, NQ, bq, D]
        return x.to(self.cdt).view(self.B, self.H, self.NQ, self.block_q, x.shape[-1])

    def kv_blocks(self, x):  # [B, H, Skv, D] -> [B, H, NK, bk, D]
        return x.to(self.cdt).view(self.B, self.H, self.NK, self.block_kv, x.shape[-1])

    def chunks(self):
        return [slice(s, s + self.chunk) for s in range(0, self.NQ, self.chunk)]

    def gather(self, xb, sl):
        """Listed key blocks of the query blocks in ``sl``: [B, H, C, K*bk, D]. Dead slots
        (past the count, or padding keys) are zeroed so that whatever they hold (even NaN)
        cannot leak through a zero probability."""
        g = _gather_key_blocks(xb, self.idx[:, :, sl])
        return g.masked_fill(~self.key_ok[:, :, sl, :, None], 0)

    def scores(self, q_chunk, kg, sl):
        s = torch.einsum("bhcqd,bhckd->bhcqk", q_chunk, kg) * self.scale
        return s.masked_fill(~self.key_ok[:, :, sl, None, :], float("-inf"))


def block_sparse_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    block_q: int,
    block_kv: int,
    kv_block_sizes: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``vidsparse.block_sparse_attn``; returns ``(o, lse)``.

    q [B, H, Sq, D], k/v [B, H, Skv, D], kv_indices int [Bi, H, NQ, K], kv_counts [Bi, H, NQ],
    kv_block_sizes [NK] or None. ``o`` has q's dtype; ``lse`` [B, H, Sq] is fp32 (fp64 for fp64
    inputs), natural log; rows that attend to nothing give ``o = 0`` and ``lse = -inf``.
    """
    plan = _ChunkPlan(q, k, kv_indices, kv_counts, block_q, block_kv, kv_block_sizes, scale)
    qb, kb, vb = plan.blocks(q), plan.kv_blocks(k), plan.kv_blocks(v)
    outs, lses = [], []
    for sl in plan.chunks():
        kg, vg = plan.gather(kb, sl), plan.gather(vb, sl)  # [B, H, C, K*bk, D]
        s = plan.scores(qb[:, :, sl], kg, sl)  # [B, H, C, bq, K*bk], -inf where masked
        p, lse = _masked_softmax_with_lse(s)
        outs.append(torch.einsum("bhcqk,bhckd->bhcqd", p, vg))
        lses.append(lse)
    B, H, Sq, D = q.shape
    o = torch.cat(outs, dim=2).reshape(B, H, Sq, D)
    lse = torch.cat(lses, dim=2).reshape(B, H, Sq)
    return o.to(q.dtype), lse


def block_sparse_attn_bwd_ref(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    block_q: int,
    block_kv: int,
    kv_block_sizes: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``block_sparse_attn_ref`` given the forward output ``o``, FlashAttention style.

    The probabilities are recomputed exactly from the scores (not from a saved fp32 lse), so
    fp64 inputs give fp64-accurate gradients.

    ``p = exp(s - lse)``, ``dv = p^T do``, ``ds = p * (do v^T - rowsum(do * o))``,
    ``dq = ds k * scale``, ``dk = ds^T q * scale``; dK/dV are scatter-added per listed block.
    """
    plan = _ChunkPlan(q, k, kv_indices, kv_counts, block_q, block_kv, kv_block_sizes, scale)
    B, H, NK, bk = plan.B, plan.H, plan.NK, block_kv
    qb, dob = plan.blocks(q), plan.blocks(do)
    kb, vb = plan.kv_blocks(k), plan.kv_blocks(v)
    delta = (dob * plan.blocks(o)).sum(-1)  # [B, H, NQ, bq]
    dq = torch.zeros_like(qb)
    dk = torch.zeros(B * H * NK, bk, kb.shape[-1], dtype=plan.cdt, device=q.device)
    dv = torch.zeros(B * H * NK, bk, vb.shape[-1], dtype=plan.cdt, device=q.device)
    head_base = (torch.arange(B * H, device=q.device) * NK).view(B, H, 1, 1)
    for sl in plan.chunks():
        idx = plan.idx[:, :, sl]  # [B, H, C, K]
        kg, vg = plan.gather(kb, sl), plan.gather(vb, sl)  # [B, H, C, K*bk, D]
        s = plan.scores(qb[:, :, sl], kg, sl)  # [B, H, C, bq, K*bk]
        p, _ = _masked_softmax_with_lse(s)
        dp = torch.einsum("bhcqd,bhckd->bhcqk", dob[:, :, sl], vg)
        ds = p * (dp - delta[:, :, sl, :, None])
        dq[:, :, sl] = torch.einsum("bhcqk,bhckd->bhcqd", ds, kg) * plan.scale
        dkg = torch.einsum("bhcqk,bhcqd->bhckd", ds, qb[:, :, sl]) * plan.scale
        dvg = torch.einsum("bhcqk,bhcqd->bhckd", p, dob[:, :, sl])
        target = (head_base + idx).flatten()  # one row of dk per (b, h, key block)
        dk.index_add_(0, target, dkg.reshape(-1, bk, dkg.shape[-1]))
        dv.index_add_(0, target, dvg.reshape(-1, bk, dvg.shape[-1]))
    dq = dq.reshape(q.shape).to(q.dtype)
    return dq, dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)
