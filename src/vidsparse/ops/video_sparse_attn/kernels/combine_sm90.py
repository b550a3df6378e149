"""VSA's forward combine for the engine's Hopper Gluon forward (see ``combine.py``)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def combine_forward_sm90(o, b, h, q_block, rows, local_rows, dims,
                         OC, stride_ocb, stride_och, stride_ocm,
                         GATE, stride_gb, stride_gh, stride_gs, Q_SIZES,
                         HAS_GATE: gl.constexpr, ZERO_PAD_ROWS: gl.constexpr):  # fmt: skip
    """``o + gate * o_coarse[block]`` on o [64, D] fp32 (rows and dims in o's slice layouts),
    rows at or past the block's real size zeroed."""
    oc_row = OC + b * stride_ocb + h * stride_och + q_block.to(gl.int64) * stride_ocm
    oc = gl.expand_dims(gl.load(oc_row + dims).to(gl.float32), 0)  # [1, D]
    if HAS_GATE:
        row_offs = gl.expand_dims(rows.to(gl.int64) * stride_gs, 1)  # [64, 1]
        gate_rows = GATE + b * stride_gb + h * stride_gh
        gate = gl.load(gate_rows + row_offs + gl.expand_dims(dims, 0))  # [64, D]
        o = o + gate.to(gl.float32) * oc
    else:
        o = o + oc
    if ZERO_PAD_ROWS:
        o = gl.where(gl.expand_dims(local_rows < gl.load(Q_SIZES + q_block), 1), o, 0.0)
    return o
