"""VSA's hooks for the engine's Hopper Gluon kernels (see ``combine.py``): the forward combine,
and the tile means' share of dQ (``pooled_dq_sm90``). The latter is not in VSA's
``EpilogueFns``: at 64x64 the Gluon dQ kernel was only 3% faster than Triton's, and natural
order, which stores gradients through row maps, cannot take it. So VSA's backward runs
Triton's dQ kernel; ``tests/ops/video_sparse_attn/test_vsa_gluon_dq.py`` puts the hook in to
check it on the GPU."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _store_residual_sm90(o, b, h, rows, dims, RES, stride_rb, stride_rh, stride_rs,
                         OUT_DTYPE: gl.constexpr):  # fmt: skip
    """``combine.py``'s ``_store_residual``, the same arithmetic in o's layout."""
    o_low = o.to(OUT_DTYPE).to(gl.float32)  # the engine's store rounds the same way
    bits = o_low.to(gl.int32, bitcast=True) & 0x7F800000  # 2^e <= |o_low| < 2^(e+1)
    inv_binade = (0x7F000000 - bits).to(gl.float32, bitcast=True)  # 2^-e
    if gl.bfloat16 == OUT_DTYPE:
        ratio = (o - o_low) * inv_binade * (127.0 * 256.0)  # u = 2^-8
    else:
        ratio = (o - o_low) * inv_binade * (127.0 * 2048.0)  # fp16: u = 2^-11
    ratio = gl.where((bits > 0) & (bits < 0x7F800000), ratio, 0.0)
    steps = gl.floor(gl.minimum(gl.maximum(ratio, -127.0), 127.0) + 0.5)
    row_offs = gl.expand_dims(rows.to(gl.int64) * stride_rs, 1)  # [64, 1]
    gl.store(RES + b * stride_rb + h * stride_rh + row_offs + gl.expand_dims(dims, 0),
             steps.to(gl.int8))  # fmt: skip


@gluon.jit
def combine_forward_sm90(o, b, h, q_block, rows, local_rows, dims,
                         OC, stride_ocb, stride_och, stride_ocm,
                         GATE, stride_gb, stride_gh, stride_gs, GATE_ROWS, Q_SIZES,
                         RES, stride_rb, stride_rh, stride_rs,
                         HAS_GATE: gl.constexpr, ZERO_PAD_ROWS: gl.constexpr,
                         KEEP_RESIDUAL: gl.constexpr, OUT_DTYPE: gl.constexpr,
                         GATE_MAPPED: gl.constexpr):  # fmt: skip
    """``o + gate * o_coarse[block]`` on o [64, D] fp32 (rows and dims in o's slice layouts),
    rows at or past the block's real size zeroed; with ``KEEP_RESIDUAL`` the int8 residual of
    storing it in ``OUT_DTYPE``; ``GATE_MAPPED``: the gate read through ``GATE_ROWS``
    (``combine.py``)."""
    oc_row = OC + b * stride_ocb + h * stride_och + q_block.to(gl.int64) * stride_ocm
    oc = gl.expand_dims(gl.load(oc_row + dims).to(gl.float32), 0)  # [1, D]
    if HAS_GATE:
        gate_rows = GATE + b * stride_gb + h * stride_gh
        if GATE_MAPPED:  # a padding row (-1) reads row 0 and zeroes it
            mapped = gl.load(GATE_ROWS + rows)
            row_offs = gl.expand_dims(gl.maximum(mapped, 0).to(gl.int64) * stride_gs, 1)
            gate = gl.load(gate_rows + row_offs + gl.expand_dims(dims, 0))  # [64, D]
            gate = gl.where(gl.expand_dims(mapped >= 0, 1), gate.to(gl.float32), 0.0)
        else:
            row_offs = gl.expand_dims(rows.to(gl.int64) * stride_gs, 1)  # [64, 1]
            gate = gl.load(gate_rows + row_offs + gl.expand_dims(dims, 0))  # [64, D]
        o = o + gate.to(gl.float32) * oc
    else:
        o = o + oc
    if ZERO_PAD_ROWS:
        o = gl.where(gl.expand_dims(local_rows < gl.load(Q_SIZES + q_block), 1), o, 0.0)
    if KEEP_RESIDUAL:
        _store_residual_sm90(o, b, h, rows, dims, RES, stride_rb, stride_rh, stride_rs,
                             OUT_DTYPE)  # fmt: skip
    return o


@gluon.jit
def pooled_dq_sm90(dq, b, h, q_block, local_rows, dims,
                   DPOOL, stride_pt, stride_pb, stride_ph, stride_pn, Q_SIZES, K_SIZES,
                   NK_POOLED, ADD_POOLED: gl.constexpr):  # fmt: skip
    """``combine.py``'s ``pooled_dq`` on dq [64, D] fp32 (local_rows and dims in its slice
    layouts): each real row of query tile ``q_block`` gets ``dpooled[0, b, h, q_block] /
    size``."""
    if ADD_POOLED:
        size = gl.load(Q_SIZES + q_block)
        g = gl.load(DPOOL + b * stride_pb + h * stride_ph + q_block.to(gl.int64) * stride_pn
                    + dims)  # fmt: skip
        share = gl.expand_dims(g.to(gl.float32) / gl.maximum(size, 1).to(gl.float32), 0)
        dq = dq + gl.where(gl.expand_dims(local_rows < size, 1), share, 0.0)
    return dq
