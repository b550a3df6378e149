"""vidsparse: sparse attention for video Diffusion Transformers.

Public API (see DESIGN.md): ``VideoGrid``, ``block_sparse_attn``, ``video_sparse_attn``,
``StripeSpec``, ``stripe_block_mask``. Importing this package needs no GPU.
"""

from vidsparse.layout import VideoGrid
from vidsparse.masks.stripe import StripeSpec, stripe_block_mask
from vidsparse.ops.block_sparse_attn import block_sparse_attn
from vidsparse.ops.video_sparse_attn import video_sparse_attn

__version__ = "0.1.0.dev0"

__all__ = [
    "VideoGrid",
    "block_sparse_attn",
    "video_sparse_attn",
    "StripeSpec",
    "stripe_block_mask",
    "__version__",
]
