"""vidsparse: sparse attention for video Diffusion Transformers.

Public API (see DESIGN.md): ``VideoGrid``, ``block_sparse_attn``, ``video_sparse_attn``,
``StripeSpec``, ``stripe_block_mask``, ``stripe_attn``; the PSA search lives in
``vidsparse.search``. Importing this package needs no GPU, and the names are
resolved lazily so that ``import vidsparse`` stays cheap (no Triton import until a kernel runs).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "VideoGrid": "vidsparse.layout",
    "block_sparse_attn": "vidsparse.ops.block_sparse_attn",
    "video_sparse_attn": "vidsparse.ops.video_sparse_attn",
    "StripeSpec": "vidsparse.masks.stripe",
    "stripe_block_mask": "vidsparse.masks.stripe",
    "stripe_attn": "vidsparse.ops.stripe_attn",
}

__all__ = [*_EXPORTS, "__version__"]


_SUBMODULES = ("integrations", "layout", "masks", "nn", "ops", "search", "parallel", "testing")


def __getattr__(name: str):
    if name in _SUBMODULES:  # `vidsparse.search.load_plan(...)` without importing it first
        return importlib.import_module(f"vidsparse.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vidsparse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
