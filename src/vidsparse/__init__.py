"""vidsparse: sparse attention for video Diffusion Transformers.

Public API: ``VideoGrid``, ``StripeSpec``, ``stripe_block_mask``, one function per op of
``vidsparse.ops`` (``block_sparse_attn``, ``video_sparse_attn``, ``stripe_attn``, ...) and VSA's
primitives ``block_mean`` and ``topk_lists``; the PSA
search lives in ``vidsparse.search``. Importing this package needs no GPU, and the names are
resolved lazily so that ``import vidsparse`` stays cheap (no Triton import until a kernel runs).
"""

from __future__ import annotations

import importlib
import os
import pkgutil

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "VideoGrid": "vidsparse.layout",
    "StripeSpec": "vidsparse.masks.stripe",
    "stripe_block_mask": "vidsparse.masks.stripe",
    "GateProjection": "vidsparse.ops.video_sparse_attn",  # VSA's gate, formed in the op
    # VSA's coarse-stage primitives, for composing other methods
    "block_mean": "vidsparse.ops.video_sparse_attn",
    "topk_lists": "vidsparse.ops.video_sparse_attn",
}


def _op_names() -> list[str]:
    """The ops, by declaration: every public module of ``vidsparse.ops`` (helpers start with
    ``_``) is an op exporting a function of its own name (``vidsparse.ops.stripe_attn`` has
    ``stripe_attn``), so a new op is public without an edit here. Read from the folder, so
    nothing is imported."""
    folder = os.path.join(os.path.dirname(__file__), "ops")
    return sorted(m.name for m in pkgutil.iter_modules([folder]) if not m.name.startswith("_"))


_EXPORTS.update({name: f"vidsparse.ops.{name}" for name in _op_names()})

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
