"""Ulysses sequence parallelism: sequence-sharded in, head-sharded full-sequence attention inside.

With ``P`` ranks, each rank holds a contiguous ``S/P`` slice of the sequence for all ``H`` heads.
Sparse attention needs the whole sequence of a head (VSA's coarse stage, PSA's stripes, any
block list may reach any key), so one all-to-all trades the sequence shard for a head shard::

    rank r:  [B, S/P, H, D]  --all-to-all-->  [B, H/P, S, D]   heads r*H/P .. (r+1)*H/P - 1
             run the single-device op on the rank's heads (per-head plans sliced to them)
             [B, H/P, S, D]  --all-to-all-->  [B, S/P, H, D]

Both exchanges are differentiable: each is a permutation of the elements and the other is its
inverse, so the backward of one is the other applied to the gradient (with the same row-copy
packing as the forward). ``pad_heads=True`` pads a head count the world size does not divide
with zero heads, computed and dropped.

Communication is ``torch.distributed.all_to_all_single`` on one contiguous buffer (q, k, v and a
gate are packed together, so a layer costs one collective in and one out, or ``head_chunks``
of each when the exchange is pipelined; an lse output adds one more). NCCL and gloo (CPU)
both implement it; ``comm="all_gather"`` selects an ``all_gather`` exchange instead, for a
backend that lacks it (``P`` times the traffic and memory; correct, not fast).

Every check that can fail runs before the first collective, so a bad argument raises on every
rank instead of leaving the others waiting in a collective. Shapes that differ *between* ranks
cannot be seen locally; ``check_shards=True`` (or ``VIDSPARSE_ULYSSES_CHECK=1``) all-gathers the
local shapes first and raises the same error on every rank.

The code, by concern: ``shards.py`` (process group, shard geometry, the local checks),
``exchange.py`` (the all-to-all and its packing), ``driver.py`` (the generic driver and the
pipelined / tiled inference exchange), one file per op (``block_sparse_attn.py``,
``video_sparse_attn.py``, ``stripe_attn.py``) and here the handle :class:`UlyssesAttention`;
every public name stays importable from this module.
"""

from __future__ import annotations

# ``X as X``: names of the pieces that stay importable from here, as before the split.
from vidsparse.parallel.block_sparse_attn import ulysses_block_sparse_attn
from vidsparse.parallel.driver import AttnFn, positive_head_chunks, ulysses_attention
from vidsparse.parallel.driver import TiledExchange as TiledExchange
from vidsparse.parallel.driver import check_head_chunks as check_head_chunks
from vidsparse.parallel.exchange import COMM_METHODS as COMM_METHODS
from vidsparse.parallel.exchange import head_to_seq, seq_to_head
from vidsparse.parallel.shards import CHECK_ENV as CHECK_ENV
from vidsparse.parallel.shards import LAYOUTS, resolve_context, shard_sequence
from vidsparse.parallel.shards import ShardContext as ShardContext
from vidsparse.parallel.shards import local_dims as local_dims
from vidsparse.parallel.shards import validate_shards as validate_shards
from vidsparse.parallel.shards import validate_shards_across_ranks as validate_shards_across_ranks
from vidsparse.parallel.stripe_attn import ulysses_stripe_attn
from vidsparse.parallel.video_sparse_attn import ulysses_video_sparse_attn

__all__ = [
    "LAYOUTS",
    "UlyssesAttention",
    "head_to_seq",
    "seq_to_head",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_block_sparse_attn",
    "ulysses_stripe_attn",
    "ulysses_video_sparse_attn",
]


# ---------------------------------------------------------------------------------------------
# a handle for integrations
# ---------------------------------------------------------------------------------------------


class UlyssesAttention:
    """Binds a process group and a layout, for an attention processor to call per layer.

    A diffusers processor receives ``[B, S_local, H, D]`` (``layout="bshd"``) and calls e.g.
    ``self.ulysses.video_sparse_attn(q, k, v, grid, sparsity=0.875, gate=g)``. The group is
    resolved at each call, so the handle can be built before ``init_process_group``.
    ``pad_heads=True``: a world size that does not divide the heads pads them with zero heads
    (see :func:`ulysses_attention`).
    """

    def __init__(
        self,
        group=None,
        *,
        layout: str = "bshd",
        check_shards: bool = False,
        head_chunks: int = 1,
        pad_heads: bool = False,
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(pad_heads, bool):
            raise TypeError(f"pad_heads must be a bool, got {pad_heads!r}")
        self.group = group
        self.layout = layout
        self.check_shards = check_shards
        self.head_chunks = positive_head_chunks(head_chunks)
        self.pad_heads = pad_heads

    def _kw(self) -> dict:
        return {
            "group": self.group,
            "layout": self.layout,
            "check_shards": self.check_shards,
            "head_chunks": self.head_chunks,
            "pad_heads": self.pad_heads,
        }

    @property
    def world_size(self) -> int:
        return resolve_context(self.group, self.layout).world_size

    @property
    def rank(self) -> int:
        return resolve_context(self.group, self.layout).rank

    def __call__(self, attn_fn: AttnFn, q, k, v, *extra):
        """Generic: see :func:`ulysses_attention`."""
        return ulysses_attention(attn_fn, q, k, v, *extra, **self._kw())

    def block_sparse_attn(self, q, k, v, kv_indices, kv_counts, **engine_kwargs):
        return ulysses_block_sparse_attn(
            q, k, v, kv_indices, kv_counts, **self._kw(), **engine_kwargs
        )

    def video_sparse_attn(self, q, k, v, grid, **vsa_kwargs):
        return ulysses_video_sparse_attn(q, k, v, grid, **self._kw(), **vsa_kwargs)

    def stripe_attn(self, q, k, v, grid, specs, **stripe_kwargs):
        return ulysses_stripe_attn(q, k, v, grid, specs, **self._kw(), **stripe_kwargs)

    def __repr__(self) -> str:
        pad = ", pad_heads=True" if self.pad_heads else ""
        return f"UlyssesAttention(group={self.group!r}, layout={self.layout!r}{pad})"
