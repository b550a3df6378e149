"""VSA's gate combine, as the engine's epilogue hooks (host side: ``../fine.py``).

::

    forward    o = o_fine + gate * o_coarse[block]   (gate None: o_fine + o_coarse), fp32,
               padding rows of the block set to 0 (ZERO_PAD_ROWS)
    prologue   o_fine = o - gate * o_coarse; from the same read of do:
               d o_coarse[block] = sum_rows do * gate,  d gate = do * o_coarse[block];
               padding rows get do = 0 and lse2 = +inf (no gradient flows through them)
    dq, dkdv   + d mean_i / size_i on tile i's real rows (the tile-mean pooling's backward;
               query tile sizes Q_SIZES, key tile sizes K_SIZES; key blocks from NK_POOLED on
               were not pooled (exempt text); ADD_POOLED)
"""

import triton
import triton.language as tl


@triton.jit
def _coarse_row(OC, stride_ocb, stride_och, stride_ocm, b, h, q_block, dims):
    """o_coarse[b, h, q_block] ([D] fp32; unit-stride D)."""
    row = OC + b * stride_ocb + h * stride_och + q_block.to(tl.int64) * stride_ocm
    return tl.load(row + dims).to(tl.float32)


@triton.jit
def combine_forward(o, b, h, q_block, rows, local_rows, dims,
                    OC, stride_ocb, stride_och, stride_ocm,
                    GATE, stride_gb, stride_gh, stride_gs, Q_SIZES,
                    HAS_GATE: tl.constexpr, ZERO_PAD_ROWS: tl.constexpr):  # fmt: skip
    oc = _coarse_row(OC, stride_ocb, stride_och, stride_ocm, b, h, q_block, dims)  # [D]
    if HAS_GATE:
        g_ptrs = GATE + b * stride_gb + h * stride_gh + rows[:, None] * stride_gs + dims[None, :]
        o = o + tl.load(g_ptrs).to(tl.float32) * oc[None, :]  # [BM, D]
    else:
        o = o + oc[None, :]
    if ZERO_PAD_ROWS:
        o = tl.where((local_rows < tl.load(Q_SIZES + q_block))[:, None], o, 0.0)
    return o


@triton.jit
def combine_prologue(o, do, lse2, b, h, q_block, rows, local_rows, dims,
                     OC, stride_ocb, stride_och, stride_ocm,
                     GATE, stride_gb, stride_gh, stride_gs, Q_SIZES,
                     DOC, stride_dcb, stride_dch, stride_dcm,
                     DGATE, stride_dgb, stride_dgh, stride_dgs,
                     HAS_GATE: tl.constexpr, ZERO_PAD_ROWS: tl.constexpr):  # fmt: skip
    oc = _coarse_row(OC, stride_ocb, stride_och, stride_ocm, b, h, q_block, dims)  # [D]
    if HAS_GATE:
        g_offs = b * stride_gb + h * stride_gh + rows[:, None] * stride_gs + dims[None, :]
        gate = tl.load(GATE + g_offs).to(tl.float32)  # [BM, D]
        o = o - gate * oc[None, :]  # o_fine
    else:
        o = o - oc[None, :]
    if ZERO_PAD_ROWS:
        real = local_rows < tl.load(Q_SIZES + q_block)  # [BM]
        do = tl.where(real[:, None], do, 0.0)
        lse2 = tl.where(real, lse2, float("inf"))
    if HAS_GATE:
        d_coarse = tl.sum(do * gate, axis=0)  # [D]
        dg_offs = b * stride_dgb + h * stride_dgh + rows[:, None] * stride_dgs + dims[None, :]
        tl.store(DGATE + dg_offs, (do * oc[None, :]).to(DGATE.dtype.element_ty))
    else:
        d_coarse = tl.sum(do, axis=0)  # [D]
    doc_row = DOC + b * stride_dcb + h * stride_dch + q_block.to(tl.int64) * stride_dcm
    tl.store(doc_row + dims, d_coarse)
    return o, do, lse2


@triton.jit
def _pooled_share(DPOOL, which, b, h, tile, dims, size,
                  stride_pt, stride_pb, stride_ph, stride_pn):  # fmt: skip
    """Each real row's share of a tile mean's gradient, ``dpooled[which, b, h, tile] / size``."""
    g = tl.load(DPOOL + which * stride_pt + b * stride_pb + h * stride_ph
                + tile.to(tl.int64) * stride_pn + dims)  # fmt: skip
    return g.to(tl.float32) / tl.maximum(size, 1).to(tl.float32)


@triton.jit
def pooled_dq(dq, b, h, q_block, local_rows, dims,
              DPOOL, stride_pt, stride_pb, stride_ph, stride_pn, Q_SIZES, K_SIZES, NK_POOLED,
              ADD_POOLED: tl.constexpr):  # fmt: skip
    if ADD_POOLED:
        size = tl.load(Q_SIZES + q_block)
        share = _pooled_share(DPOOL, 0, b, h, q_block, dims, size,
                              stride_pt, stride_pb, stride_ph, stride_pn)  # fmt: skip
        dq = dq + tl.where((local_rows < size)[:, None], share[None, :], 0.0)
    return dq


@triton.jit
def pooled_dkdv(dk, dv, b, h, kv_block, dims,
                DPOOL, stride_pt, stride_pb, stride_ph, stride_pn, Q_SIZES, K_SIZES, NK_POOLED,
                ADD_POOLED: tl.constexpr):  # fmt: skip
    if ADD_POOLED:  # noqa: SIM102 - a constexpr test, then a runtime one (Triton)
        if kv_block < NK_POOLED:  # a pooled key tile (exempt text blocks come after them)
            size = tl.load(K_SIZES + kv_block)
            rows_real = (tl.arange(0, dk.shape[0]) < size)[:, None]  # [BN, 1]
            share_k = _pooled_share(DPOOL, 1, b, h, kv_block, dims, size,
                                    stride_pt, stride_pb, stride_ph, stride_pn)  # fmt: skip
            share_v = _pooled_share(DPOOL, 2, b, h, kv_block, dims, size,
                                    stride_pt, stride_pb, stride_ph, stride_pn)  # fmt: skip
            dk = dk + tl.where(rows_real, share_k[None, :], 0.0)
            dv = dv + tl.where(rows_real, share_v[None, :], 0.0)
    return dk, dv
