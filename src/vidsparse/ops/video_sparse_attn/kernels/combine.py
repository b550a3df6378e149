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

``GATE_MAPPED``: the gate is in the caller's (natural) row order, ``GATE_ROWS[r]`` its row for
the engine's row r (-1: a padding row, whose gate is 0); the forward reads it and the prologue
stores d gate through that map, so the gate needs no tile-order copy.

The residual (``KEEP_RESIDUAL``, fine.py turns it on under autograd): what storing o in
``OUT_DTYPE`` rounds away, as int8 steps of ``2^e * u / 127`` (``2^e <= |o_low| < 2^(e+1)``, u
the unit roundoff, so ``|o - o_low| <= 2^e * u``: a step is 1/254 of an ulp), written by the
forward and added back by the prologue. Without it the recovered o_fine carries o's rounding
into ``delta = rowsum(o_fine * do)``, and where softmax is sharp (large inputs) ``dP - delta``
cancels to almost nothing, so that rounding dominates dq and dk. FlashAttention does not see
it there: a one-hot row's o_fine is a row of v, which its store keeps exactly.
"""

import triton
import triton.language as tl


@triton.jit
def _coarse_row(OC, stride_ocb, stride_och, stride_ocm, b, h, q_block, dims):
    """o_coarse[b, h, q_block] ([D] fp32; unit-stride D)."""
    row = OC + b * stride_ocb + h * stride_och + q_block.to(tl.int64) * stride_ocm
    return tl.load(row + dims).to(tl.float32)


@triton.jit
def _gate_rows(rows, GATE_ROWS, GATE_MAPPED: tl.constexpr):
    """The gate's rows for the engine's rows, and which exist (``GATE_MAPPED``: by the map)."""
    if GATE_MAPPED:
        mapped = tl.load(GATE_ROWS + rows)
        return tl.maximum(mapped, 0).to(tl.int64), mapped >= 0
    return rows, rows >= 0


@triton.jit
def _load_gate(GATE, stride_gb, stride_gh, stride_gs, GATE_ROWS, b, h, rows, dims,
               GATE_MAPPED: tl.constexpr):  # fmt: skip
    """The gate's ``[BM, D]`` block for the engine's rows (fp32; 0 on unmapped rows)."""
    if GATE_MAPPED:
        g_rows, real = _gate_rows(rows, GATE_ROWS, GATE_MAPPED)
        g_ptrs = GATE + b * stride_gb + h * stride_gh + g_rows[:, None] * stride_gs + dims[None, :]
        return tl.load(g_ptrs, mask=real[:, None], other=0.0).to(tl.float32)
    g_ptrs = GATE + b * stride_gb + h * stride_gh + rows[:, None] * stride_gs + dims[None, :]
    return tl.load(g_ptrs).to(tl.float32)


@triton.jit
def _binade_bits(x):
    """The exponent bits of fp32 ``x``: as fp32 they are ``2^e <= |x| < 2^(e+1)``."""
    return x.to(tl.int32, bitcast=True) & 0x7F800000


@triton.jit
def _store_residual(o, b, h, rows, dims, RES, stride_rb, stride_rh, stride_rs,
                    OUT_DTYPE: tl.constexpr):  # fmt: skip
    """int8 ``127 * (o - o_low) / (2^e * u)`` for o about to be stored as o_low in
    ``OUT_DTYPE`` (``|o - o_low| <= 2^e * u``, u its unit roundoff; exact fp32 difference);
    0 where o_low is 0, inf or NaN. Bit operations and multiplies: no division."""
    o_low = o.to(OUT_DTYPE).to(tl.float32)  # the engine's store rounds the same way
    bits = _binade_bits(o_low)
    inv_binade = (0x7F000000 - bits).to(tl.float32, bitcast=True)  # 2^-e
    if tl.bfloat16 == OUT_DTYPE:
        ratio = (o - o_low) * inv_binade * (127.0 * 256.0)  # u = 2^-8
    else:
        ratio = (o - o_low) * inv_binade * (127.0 * 2048.0)  # fp16: u = 2^-11
    ratio = tl.where((bits > 0) & (bits < 0x7F800000), ratio, 0.0)
    steps = tl.floor(tl.minimum(tl.maximum(ratio, -127.0), 127.0) + 0.5)
    r_ptrs = RES + b * stride_rb + h * stride_rh + rows[:, None] * stride_rs + dims[None, :]
    tl.store(r_ptrs, steps.to(tl.int8))


@triton.jit
def _residual_step(o_low, OUT_DTYPE: tl.constexpr):
    """What one int8 step of ``_store_residual`` is worth for the stored fp32 ``o_low``:
    ``2^e * u / 127`` (0 where o_low is inf or NaN; the steps are 0 there and at 0)."""
    bits = _binade_bits(o_low)
    if tl.bfloat16 == OUT_DTYPE:
        step = bits.to(tl.float32, bitcast=True) * (1.0 / (127.0 * 256.0))
    else:
        step = bits.to(tl.float32, bitcast=True) * (1.0 / (127.0 * 2048.0))
    return tl.where(bits < 0x7F800000, step, 0.0)


@triton.jit
def combine_forward(o, b, h, q_block, rows, local_rows, dims,
                    OC, stride_ocb, stride_och, stride_ocm,
                    GATE, stride_gb, stride_gh, stride_gs, GATE_ROWS, Q_SIZES,
                    RES, stride_rb, stride_rh, stride_rs,
                    HAS_GATE: tl.constexpr, ZERO_PAD_ROWS: tl.constexpr,
                    KEEP_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr,
                    GATE_MAPPED: tl.constexpr):  # fmt: skip
    oc = _coarse_row(OC, stride_ocb, stride_och, stride_ocm, b, h, q_block, dims)  # [D]
    if HAS_GATE:
        gate = _load_gate(GATE, stride_gb, stride_gh, stride_gs, GATE_ROWS, b, h, rows, dims,
                          GATE_MAPPED)  # fmt: skip
        o = o + gate * oc[None, :]  # [BM, D]
    else:
        o = o + oc[None, :]
    if ZERO_PAD_ROWS:
        o = tl.where((local_rows < tl.load(Q_SIZES + q_block))[:, None], o, 0.0)
    if KEEP_RESIDUAL:
        _store_residual(o, b, h, rows, dims, RES, stride_rb, stride_rh, stride_rs, OUT_DTYPE)
    return o


@triton.jit
def combine_prologue(o, do, lse2, b, h, q_block, rows, local_rows, dims,
                     OC, stride_ocb, stride_och, stride_ocm,
                     GATE, stride_gb, stride_gh, stride_gs, GATE_ROWS, Q_SIZES,
                     RES, stride_rb, stride_rh, stride_rs,
                     DOC, stride_dcb, stride_dch, stride_dcm,
                     DGATE, stride_dgb, stride_dgh, stride_dgs,
                     HAS_GATE: tl.constexpr, ZERO_PAD_ROWS: tl.constexpr,
                     KEEP_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     GATE_MAPPED: tl.constexpr):  # fmt: skip
    oc = _coarse_row(OC, stride_ocb, stride_och, stride_ocm, b, h, q_block, dims)  # [D]
    if KEEP_RESIDUAL:  # o as the forward had it in fp32, before the store rounded it
        r_ptrs = RES + b * stride_rb + h * stride_rh + rows[:, None] * stride_rs + dims[None, :]
        o = o + tl.load(r_ptrs).to(tl.float32) * _residual_step(o, OUT_DTYPE)
    if HAS_GATE:
        gate = _load_gate(GATE, stride_gb, stride_gh, stride_gs, GATE_ROWS, b, h, rows, dims,
                          GATE_MAPPED)  # [BM, D]
        o = o - gate * oc[None, :]  # o_fine
    else:
        o = o - oc[None, :]
    if ZERO_PAD_ROWS:
        real = local_rows < tl.load(Q_SIZES + q_block)  # [BM]
        do = tl.where(real[:, None], do, 0.0)
        lse2 = tl.where(real, lse2, float("inf"))
    if HAS_GATE:
        d_coarse = tl.sum(do * gate, axis=0)  # [D]
        g_rows, real = _gate_rows(rows, GATE_ROWS, GATE_MAPPED)
        dg_offs = b * stride_dgb + h * stride_dgh + g_rows[:, None] * stride_dgs + dims[None, :]
        dgate = (do * oc[None, :]).to(DGATE.dtype.element_ty)
        if GATE_MAPPED:  # padding rows have no gate row
            tl.store(DGATE + dg_offs, dgate, mask=real[:, None])
        else:
            tl.store(DGATE + dg_offs, dgate)
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
