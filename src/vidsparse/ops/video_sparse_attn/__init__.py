"""Video Sparse Attention (VSA): trainable coarse-to-fine sparse attention over video tiles,
and its coarse-stage primitives (``block_mean``, ``topk_lists``) for composing other methods."""

from vidsparse.ops.video_sparse_attn.gate import GateProjection
from vidsparse.ops.video_sparse_attn.interface import video_sparse_attn
from vidsparse.ops.video_sparse_attn.primitives import block_mean, topk_lists
from vidsparse.ops.video_sparse_attn.reference import video_sparse_attn_ref

__all__ = [
    "video_sparse_attn",
    "GateProjection",
    "video_sparse_attn_ref",
    "block_mean",
    "topk_lists",
]
