"""VSA's fine stage: the engine with VSA's gate combine declared as its epilogue.

::

    o[b, h, tile i, row r] = o_fine[b, h, i, r] + gate[b, h, i, r] * o_coarse[b, h, i]
                             (0 for padding rows when ``q_block_sizes`` is given)

The engine forms ``o_fine`` and the kernels add the coarse term before the one store of ``o``
(``kernels/combine.py``); ``o_fine`` is not kept: the backward's prologue recovers it from
``o`` and forms the combine's gradients from its one read of ``do``. Under autograd, 16-bit
outputs come with an int8 residual (what the store of ``o`` rounded away; the engine keeps it
for the backward as the epilogue's ``saved``): without it the recovered ``o_fine`` would carry
o's rounding into the backward's ``delta``, which dominates dq and dk where softmax is sharp.
Given the coarse stage's tile means (``pooled``), the coarse attention's backward runs between
the prologue and the gradient kernels, which add each tile mean's gradient share to the
tile's real rows: the pooling's backward costs no pass of its own.
"""

from __future__ import annotations

import functools

import torch

from vidsparse.masks.block_sparse import refine_block_sizes
from vidsparse.ops.block_sparse_attn.epilogue import (
    EngineCall,
    Epilogue,
    EpilogueFns,
    FnSpecs,
    gluon_fn,
    register_epilogue,
)
from vidsparse.ops.block_sparse_attn.grad_rows import GradTargets, gather_rows, scatter_rows
from vidsparse.ops.block_sparse_attn.interface import block_sparse_attn_unchecked
from vidsparse.ops.video_sparse_attn.coarse import coarse_attn_bwd, coarse_grad_dtype
from vidsparse.ops.video_sparse_attn.gate import GateProjection, gate_of, projection_grads
from vidsparse.ops.video_sparse_attn.reference import tile_means_bwd
from vidsparse.ops.video_sparse_attn.segments import segments_of


def vsa_fine_combined(
    q_t: torch.Tensor,
    k_seq: torch.Tensor,
    v_seq: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    kv_block_sizes: torch.Tensor,
    o_coarse: torch.Tensor,
    gate_t: torch.Tensor | GateProjection | None,
    q_block_sizes: torch.Tensor | None,
    block: int,
    scale: float,
    pooled: torch.Tensor | None = None,
    segments: tuple[int, ...] = (),
    fine_only: bool = False,
    rows_dropped: bool = False,
    grads_to: GradTargets | None = None,
    gate_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``o_fine + gate * o_coarse`` over tile-order queries ``q_t [B, H, Nt*V, D]``.

    Lists must be valid (they come from the selection kernel); ``o_coarse [B, H, Nt, D]``
    (fp32); ``gate_t`` like ``q_t`` or None (then ``o_fine + o_coarse``); padding keys must be
    finite (zeros from tiling, or a tiled input's padding rows), their scores are masked.

    ``pooled`` (``[3, B, H, Nt, D]``, the tile means of q_t and of the first Nt key tiles of
    k_seq, v_seq, from which ``o_coarse`` was computed) fuses the coarse branch's backward
    into the engine's: the gradient through ``o_coarse`` reaches q_t, k_seq and v_seq inside
    the engine's kernels, and ``o_coarse`` itself gets none (the coarse stage's own backward
    then never runs). ``segments``: the plan's flat segments (``segments.py``), required with
    a plan's ``q_info``: that backward runs per segment on its own tiles.

    ``fine_only``: ``o_fine`` alone (``gate_t`` must be None; ``o_coarse`` and ``pooled`` are
    not used, so the coarse branch has no backward). The combine adds zeros, so the kernels and
    the padding rows' handling stay those of VSA, and o needs no rounding residual: what it
    stores is ``o_fine`` itself, as in any flash attention.

    ``rows_dropped``: the caller drops o's padding rows (untiling), so their gradient arrives
    zero and the backward may skip them (``CoarseCombine.quiet_rows``), as it may where
    ``q_block_sizes`` zeroes them.

    ``grads_to``: q_t, k_seq, v_seq are tile-order copies of these natural tensors; the engine
    writes their gradients in natural order (``GradTargets``).

    ``gate_rows`` (int32, one per row of q_t: the gate's row, -1 for padding): ``gate_t`` is in
    its own (natural) row order, read and its gradient written through the map: no copy. Only
    then may ``gate_t`` be a :class:`GateProjection` (``gate.py``): formed where the hooks read
    it, never kept.
    """
    if fine_only:
        if gate_t is not None:
            raise ValueError("fine_only takes no gate_t")
        o_coarse, pooled = torch.zeros_like(o_coarse, dtype=torch.float32), None
    if pooled is not None:
        # Its gradient is formed in the engine's backward: cut the coarse stage's own backward
        # out of the graph (a None gradient would be materialised as zeros and still run it).
        o_coarse = o_coarse.detach()
    projection = gate_t if isinstance(gate_t, GateProjection) else None
    if projection is not None and gate_rows is None:
        raise ValueError("a GateProjection is read through gate_rows (natural order) only")
    if projection is None and gate_t is not None and gate_t.stride(-1) != 1:
        gate_t = gate_t.contiguous()  # the hooks read rows of unit stride
    # (gate,) or a projection's (hidden states, weight, bias): the epilogue's gate slots
    gate_parts = (None,) if gate_t is None else tuple(projection or (gate_t,))
    if q_block_sizes is not None and q_block_sizes.ndim == 2 and not segments:
        raise ValueError("a plan's q_info comes with the plan's segments")
    # A backward will run: keep o's rounding residual for it (a plain bool under compile).
    targets = () if grads_to is None else grads_to[:3]
    residual = (
        not fine_only
        and torch.is_grad_enabled()
        and any(
            t is not None and t.requires_grad
            for t in (q_t, k_seq, v_seq, o_coarse, *gate_parts, *targets)
        )  # fmt: skip
    )
    spec = combine_spec(segments, residual, rows_dropped)
    gate_in, *weights = gate_parts
    epilogue = CoarseCombine(o_coarse.contiguous(), gate_in, q_block_sizes, pooled,
                             None if gate_t is None else gate_rows, *weights,
                             spec=spec)  # fmt: skip
    o, _ = block_sparse_attn_unchecked(
        q_t, k_seq, v_seq, kv_indices, kv_counts, block_q=block, block_kv=block,
        kv_block_sizes=kv_block_sizes, scale=scale, padding_finite=True, epilogue=epilogue,
        grads_to=grads_to,
    )  # fmt: skip
    return o


@functools.cache
def _kernel_fns() -> EpilogueFns:
    from vidsparse.ops.video_sparse_attn.kernels import combine

    return EpilogueFns(
        forward=FnSpecs("vsa_combine", combine.combine_forward),
        prologue=FnSpecs("vsa_combine", combine.combine_prologue),
        dq=FnSpecs("vsa_combine", combine.pooled_dq),
        dkdv=FnSpecs("vsa_combine", combine.pooled_dkdv),
        forward_sm90=gluon_fn(
            "vsa_combine", "vidsparse.ops.video_sparse_attn.kernels.combine_sm90",
            "combine_forward_sm90",
        ),
    )  # fmt: skip


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    return tuple(x.stride()[:3])


# The epilogue's spec: "r:" (keep the residual), "d:" (the caller drops the padding rows),
# then the plan's flat segments, if any.
_RESIDUAL_FLAG = "r:"
_DROPPED_FLAG = "d:"


def combine_spec(segments: tuple[int, ...], residual: bool, rows_dropped: bool = False) -> str:
    """``CoarseCombine``'s spec: the plan's flat segments (``()``: one grid), whether the
    forward keeps o's int8 rounding residual for the backward, and whether the caller drops
    o's padding rows (``vsa_fine_combined``)."""
    flags = (_RESIDUAL_FLAG if residual else "") + (_DROPPED_FLAG if rows_dropped else "")
    return flags + ",".join(map(str, segments))


# 1 / u of the 16-bit outputs (u: unit roundoff; kernels/combine.py's residual steps).
_INV_UNIT_ROUNDOFF = {torch.float16: 2048.0, torch.bfloat16: 256.0}


def _binade(x: torch.Tensor) -> torch.Tensor:
    """``2^e <= |x| < 2^(e+1)`` of fp32 ``x``, from its exponent bits (inf / NaN: inf)."""
    return (x.view(torch.int32) & 0x7F800000).view(torch.float32)


def _residual_int8(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels/combine.py``'s ``_store_residual``: int8 steps of ``o - o.to(dtype)``."""
    o_low = o.to(dtype).float()
    binade = _binade(o_low)
    ok = (binade > 0) & (binade < float("inf"))
    scale = 127.0 * _INV_UNIT_ROUNDOFF[dtype] / torch.where(ok, binade, 1.0)  # a power of two
    ratio = torch.where(ok, (o - o_low) * scale, 0.0)
    return torch.floor(ratio.clamp(-127.0, 127.0) + 0.5).to(torch.int8)


def _residual_step(o_low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels/combine.py``'s ``_residual_step`` (fp32 ``o_low`` stored in ``dtype``)."""
    binade = _binade(o_low)
    step = binade / (127.0 * _INV_UNIT_ROUNDOFF[dtype])
    return torch.where(binade < float("inf"), step, 0.0)


@register_epilogue
class CoarseCombine(Epilogue):
    """VSA's combine as the engine's epilogue; tensors ``(o_coarse, gate, q_block_sizes,
    pooled, gate_rows, gate_weight, gate_bias)``, all but ``o_coarse`` optional. ``o_coarse``
    and ``gate`` get gradients; with ``gate_rows`` the gate is in its own row order
    (``vsa_fine_combined``); with ``gate_weight`` the gate slot holds a :class:`GateProjection`'s
    hidden states, and they, the weight and the bias get the gradients."""

    name = "vsa_combine"

    def __init__(self, o_coarse, gate=None, q_block_sizes=None, pooled=None, gate_rows=None,
                 gate_weight=None, gate_bias=None, *, spec=""):  # fmt: skip
        super().__init__(o_coarse, gate, q_block_sizes, pooled, gate_rows, gate_weight, gate_bias)
        self.o_coarse, self.gate, self.q_sizes, self.pooled = o_coarse, gate, q_block_sizes, pooled
        self.gate_rows = gate_rows
        # With a weight, the gate slot holds the projection's hidden states (gate.py): the
        # gate is formed where a hook reads it and not kept.
        self.projection = None if gate_weight is None else GateProjection(
            gate, gate_weight, gate_bias)  # fmt: skip
        self.spec = spec  # [_RESIDUAL_FLAG][_DROPPED_FLAG] + the plan's flat segments
        self._residual = spec.startswith(_RESIDUAL_FLAG)
        rest = spec.removeprefix(_RESIDUAL_FLAG)
        self._rows_dropped = rest.startswith(_DROPPED_FLAG)
        flat = rest.removeprefix(_DROPPED_FLAG)
        self._segments = segments_of(tuple(int(x) for x in flat.split(","))) if flat else ()
        self._d_coarse = self._d_gate = self._q_blocks = None

    def fns(self) -> EpilogueFns:
        return _kernel_fns()

    def forward_saved(self, q: torch.Tensor) -> torch.Tensor | None:
        """The int8 residual of o (fp32 outputs store exactly: none)."""
        if not self._residual or q.dtype not in _INV_UNIT_ROUNDOFF:
            return None
        return torch.empty(q.shape, device=q.device, dtype=torch.int8)

    def quiet_rows(self, call: EngineCall) -> torch.Tensor | None:
        """The padding rows carry no gradient: with query block sizes the prologue zeroes
        their do (ZERO_PAD_ROWS); where the caller drops them (one grid) it arrives zero."""
        if self.q_sizes is not None:
            return self._q_block_sizes(call)
        return call.kv_block_sizes if self._rows_dropped else None

    # --- Triton
    def forward_args(self, call: EngineCall) -> tuple:
        return (*self._inputs(call, self._gate_tensor()), *self._residual_args(),
                *self._flags(call))  # fmt: skip

    def prologue_args(self, call: EngineCall, do: torch.Tensor) -> tuple:
        B, H, _, D = do.shape
        num_q_blocks = self.o_coarse.shape[2]
        self._d_coarse = torch.empty((B, H, num_q_blocks, D), device=do.device,
                                     dtype=torch.float32)  # fmt: skip
        gate = self._gate_tensor()  # (a projection's: formed again here, not kept)
        self._d_gate = None if gate is None else torch.empty_like(gate)
        dgate = (self._d_coarse, 0, 0, 0) if self._d_gate is None else (
            self._d_gate, *_strides3(self._d_gate))  # fmt: skip
        return (*self._inputs(call, gate), *self._residual_args(), self._d_coarse,
                *_strides3(self._d_coarse), *dgate, *self._flags(call))  # fmt: skip

    def _inputs(self, call: EngineCall, gate: torch.Tensor | None) -> tuple:
        """Both hooks' first arguments: o_coarse, the gate, its row map and the query block
        sizes."""
        oc, dummy = self.o_coarse, self.o_coarse
        gate_args = (dummy, 0, 0, 0) if gate is None else (gate, *_strides3(gate))
        rows = dummy if self.gate_rows is None else self.gate_rows
        sizes = dummy if self.q_sizes is None else self._q_block_sizes(call)
        return (oc, *_strides3(oc), *gate_args, rows, sizes)

    def _residual_args(self) -> tuple:
        """``(RES, strides)``: the saved residual, or a dummy pointer without one."""
        res = self.saved
        return (self.o_coarse, 0, 0, 0) if res is None else (res, *_strides3(res))

    def _flags(self, call: EngineCall) -> tuple:
        """HAS_GATE, ZERO_PAD_ROWS, KEEP_RESIDUAL, OUT_DTYPE, GATE_MAPPED (the hooks'
        constexprs)."""
        import triton.language as tl

        out = tl.bfloat16 if call.dtype == torch.bfloat16 else tl.float16
        keep = self.saved is not None
        mapped = self.gate_rows is not None
        flags = (self.gate is not None, self.q_sizes is not None, keep, out, mapped)
        return tuple(map(_constexpr, flags))

    def grad_args(self, call: EngineCall) -> tuple:
        if self.pooled is None:
            dummy = self.o_coarse
            return (dummy, 0, 0, 0, 0, dummy, dummy, 0, _constexpr(False))
        dpool = self._pooled_grad(self._d_coarse, call, kernel=True).float()  # [3,B,H,n,D]
        q_sizes = self._q_block_sizes(call)
        pooled_blocks = self._pooled_keys() * self._split
        return (dpool, *dpool.stride()[:4], q_sizes, call.kv_block_sizes, pooled_blocks,
                _constexpr(True))  # fmt: skip

    @property
    def _segmented(self) -> bool:
        """Query and key tiles apart (``segments.py``): ``q_block_sizes`` is the plan's
        ``q_info [4, Nq]`` (per tile) and ``pooled`` is ``[B, H, Nq + 2 Nk, D]``. The engine's
        blocks may then be a ``split`` of each tile (``o_coarse`` holds one row per block)."""
        return self.q_sizes is not None and self.q_sizes.ndim == 2

    @property
    def _split(self) -> int:
        return self.o_coarse.shape[2] // self.q_sizes.shape[1] if self._segmented else 1

    def _q_block_sizes(self, call: EngineCall) -> torch.Tensor:
        """Real rows per engine query block (formed once per call: every hook asks)."""
        if not self._segmented:
            return call.kv_block_sizes  # one grid: query tile i is key tile i
        if self._q_blocks is None:
            self._q_blocks = refine_block_sizes(self.q_sizes[0], self._split, call.block_q)
        return self._q_blocks

    def _pooled_keys(self) -> int:
        """Key tiles that were pooled (exempt text blocks after them were not)."""
        if not self._segmented:
            return self.o_coarse.shape[2]
        return (self.pooled.shape[2] - self.q_sizes.shape[1]) // 2

    def _pooled_grad(self, d_coarse, call: EngineCall, kernel: bool = False):
        """``dpooled [3, B, H, n, D]`` per engine block (``n`` covers both sides' blocks);
        ``kernel``: :func:`coarse_attn_bwd`'s (the Triton hooks' caller: True)."""
        p, low = self.pooled, coarse_grad_dtype(call.dtype)
        if not self._segmented:
            return coarse_attn_bwd(d_coarse, p[0], p[1], p[2], call.scale, low, kernel=kernel)
        nq, nk, split = self.q_sizes.shape[1], self._pooled_keys(), self._split
        qc, kc, vc = p[:, :, :nq], p[:, :, nq : nq + nk], p[:, :, nq + nk :]
        if split > 1:  # the coarse term is per tile: its gradient sums the tile's blocks
            B, H, _, D = d_coarse.shape
            d_coarse = d_coarse.view(B, H, nq, split, D).sum(3)
        dpool = _coarse_bwd_per_segment(d_coarse, qc, kc, vc, self._segments, call.scale, low,
                                        kernel)  # fmt: skip
        if split == 1:
            return dpool
        return _dpool_per_block(dpool, self.q_sizes[0], call.kv_block_sizes[: nk * split],
                                nq, nk, split, call.block_q)  # fmt: skip

    # --- PyTorch
    def forward_torch(self, o_fine, call: EngineCall) -> torch.Tensor:
        o = o_fine.float() + self._coarse_term(call.block_q, torch.float32, self._gate_tensor())
        if self.q_sizes is not None:
            o = o.masked_fill(_padding_rows(self._q_block_sizes(call), call.block_q), 0)
        if self.saved is not None:
            self.saved.copy_(_residual_int8(o, call.dtype))
        return o

    def prologue_torch(self, o, do, call: EngineCall):
        """The combine's sums in fp32 (fp64 for fp64)."""
        acc = torch.promote_types(do.dtype, torch.float32)
        block = call.block_q
        o = o.to(acc)
        if self.saved is not None:  # o as the forward had it before the store rounded it
            o = o + self.saved.to(acc) * _residual_step(o, call.dtype)
        gate = self._gate_tensor()
        o_fine = o - self._coarse_term(block, acc, gate)
        if self.q_sizes is not None:  # padding rows of o are constant zero: no gradient
            do = do.masked_fill(_padding_rows(self._q_block_sizes(call), block), 0)
        B, H, S, D = do.shape
        do5 = do.to(acc).view(B, H, S // block, block, D)
        if gate is None:
            self._d_coarse = do5.sum(-2)
        else:
            rows_gate = self._engine_rows_gate(gate, acc)
            self._d_coarse = (do5 * rows_gate.view(B, H, S // block, block, D)).sum(-2)
            d_gate = do5 * self.o_coarse.to(acc).unsqueeze(-2)
            self._d_gate = self._to_gate_rows(d_gate.to(gate.dtype).view(B, H, S, D), gate)
        return o_fine, do

    def grads_torch(self, dq, dk, dv, call: EngineCall):
        if self.pooled is None:
            return dq, dk, dv
        acc = torch.promote_types(dq.dtype, torch.float32)
        nq, nk, block = self.o_coarse.shape[2], self._pooled_keys() * self._split, call.block_q
        dpool = self._pooled_grad(self._d_coarse, call)
        (q_share,) = tile_means_bwd(dpool[:1, :, :, :nq], self._q_block_sizes(call)[:nq],
                                    nq * block, acc)  # fmt: skip
        kv_shares = tile_means_bwd(dpool[1:, :, :, :nk], call.kv_block_sizes[:nk], nk * block, acc)
        dq = (dq.to(acc) + q_share).to(dq.dtype)
        dk, dv = (g.clone() for g in (dk, dv))
        rows = nk * block
        for g, share in zip((dk, dv), kv_shares):
            g[:, :, :rows] = (g[:, :, :rows].to(acc) + share).to(g.dtype)
        return dq, dk, dv

    # --- gradients of (o_coarse, gate, q_block_sizes, pooled, gate_rows, weight, bias)
    def gradients(self):
        # With pooled, o_coarse's gradient already reached q, k, v through the tile means.
        d_oc = None if self.pooled is not None else self._d_coarse.to(self.o_coarse.dtype)
        if self.projection is None:
            return d_oc, self._d_gate, None, None
        dx, dw, db = projection_grads(self.projection, self._d_gate)
        self._d_gate = None
        return d_oc, dx, None, None, None, dw, db

    def fake_gradients(self):
        d_oc = None if self.pooled is not None else torch.empty_like(self.o_coarse)
        if self.projection is not None:
            dx, dw, db = (None if t is None else torch.empty_like(t) for t in self.projection)
            return d_oc, dx, None, None, None, dw, db
        d_gate = None if self.gate is None else torch.empty_like(self.gate)
        return d_oc, d_gate, None, None

    def _gate_tensor(self) -> torch.Tensor | None:
        """The gate ``[B, H, S, D]`` (formed from the projection when given as one), or None."""
        if self.projection is None:
            return self.gate
        _, H, _, D = self.o_coarse.shape
        return gate_of(self.projection, H, D)

    def _coarse_term(self, block: int, dtype, gate) -> torch.Tensor:
        """``gate * o_coarse`` broadcast over each block's rows ([B, H, S, D], in ``dtype``)."""
        coarse = self.o_coarse.to(dtype).repeat_interleave(block, dim=2)
        return coarse if gate is None else self._engine_rows_gate(gate, dtype) * coarse

    def _engine_rows_gate(self, gate, dtype) -> torch.Tensor:
        """The gate in the engine's rows (through ``gate_rows``: 0 on padding rows)."""
        if self.gate_rows is None:
            return gate.to(dtype)
        return gather_rows(gate.to(dtype), self.gate_rows)

    def _to_gate_rows(self, d_gate: torch.Tensor, gate) -> torch.Tensor:
        """d gate from the engine's rows to the gate's (padding rows have none)."""
        if self.gate_rows is None:
            return d_gate
        return scatter_rows(torch.empty_like(gate), d_gate, self.gate_rows,
                            self.gate_rows >= 0)  # fmt: skip


def _coarse_bwd_per_segment(d_coarse, qc, kc, vc, segments, scale, low,
                            kernel: bool = False) -> torch.Tensor:  # fmt: skip
    """:func:`coarse_attn_bwd` of each segment on its own query and key tiles (the masked form
    over every tile pair costs the packed sequence's square). ``dpooled [3, B, H, n, D]``."""
    B, H, nq, D = qc.shape
    nk = kc.shape[2]
    dpool = torch.zeros((3, B, H, max(nq, nk), D), device=qc.device, dtype=qc.dtype)
    for seg in segments:
        rows, keys = slice(seg.q_start, seg.q_stop), slice(seg.k_start, seg.k_start + seg.k_count)
        part = coarse_attn_bwd(d_coarse[:, :, rows], qc[:, :, rows], kc[:, :, keys],
                               vc[:, :, keys], scale, low, kernel=kernel)  # fmt: skip
        dpool[0, :, :, rows] = part[0, :, :, : seg.q_stop - seg.q_start]
        dpool[1:, :, :, keys] += part[1:, :, :, : seg.k_count]
    return dpool


def _dpool_per_block(dpool, q_tile_sizes, k_block_sizes, nq, nk, split, block):
    """Per-tile ``dpooled`` as the per-block hooks take it: they add ``dpool[block] /
    size[block]`` to a block's real rows, and every row of a tile must get ``dpool[tile] /
    size[tile]``, so block b of tile t carries ``dpool[t] * size[b] / size[t]``."""
    q_blocks = refine_block_sizes(q_tile_sizes, split, block)
    k_tile_sizes = k_block_sizes.view(nk, split).sum(1)
    sides = [(dpool[0, :, :, :nq], q_tile_sizes, q_blocks)]
    sides += [(dpool[i, :, :, :nk], k_tile_sizes, k_block_sizes) for i in (1, 2)]
    B, H, _, D = dpool.shape[1:]
    out = dpool.new_zeros(3, B, H, max(nq, nk) * split, D)
    for i, (tiles, tile_sizes, block_sizes) in enumerate(sides):
        share = block_sizes.view(-1, split).to(tiles.dtype) / tile_sizes.clamp(min=1).view(-1, 1)
        per_block = (tiles.unsqueeze(3) * share.view(1, 1, -1, split, 1)).flatten(2, 3)
        out[i, :, :, : per_block.shape[2]] = per_block
    return out


def _constexpr(value):
    import triton.language as tl

    return tl.constexpr(value)


def _padding_rows(q_sizes: torch.Tensor, block: int) -> torch.Tensor:
    """Bool ``[1, 1, S, 1]``: the rows past each block's real size."""
    real = torch.arange(block, device=q_sizes.device) < q_sizes.view(-1, 1)  # [NQ, V]
    return ~real.view(1, 1, -1, 1)
