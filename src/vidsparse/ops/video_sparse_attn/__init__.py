"""Video Sparse Attention (VSA): trainable coarse-to-fine sparse attention over video tiles."""

from vidsparse.ops.video_sparse_attn.interface import video_sparse_attn
from vidsparse.ops.video_sparse_attn.reference import video_sparse_attn_ref

__all__ = ["video_sparse_attn", "video_sparse_attn_ref"]
