"""Multi-GPU sequence parallelism for vidsparse's attention ops (Ulysses, over torch.distributed).

See ``docs/parallel.md``. Importing this package starts no communication and needs no GPU.
"""

from vidsparse.parallel.ulysses import (
    LAYOUTS,
    UlyssesAttention,
    head_to_seq,
    seq_to_head,
    shard_sequence,
    ulysses_attention,
    ulysses_block_sparse_attn,
    ulysses_stripe_attn,
    ulysses_video_sparse_attn,
)

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
