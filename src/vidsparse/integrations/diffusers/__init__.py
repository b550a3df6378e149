"""vidsparse attention inside diffusers video transformers (diffusers >= 0.36).

::

    from vidsparse.integrations.diffusers import apply_sparse_attention, remove_sparse_attention

    apply_sparse_attention(pipe.transformer, method="vsa", sparsity=0.875)
    video = pipe(prompt, ...).frames[0]
    remove_sparse_attention(pipe.transformer)        # the stock processors again, exactly

The video self-attention processors become ours: q/k/v, norms, RoPE and the output projection
as the stock processor, the attention by the method (``METHODS``: ``"dense"``, ``"vsa"``,
``"psa"``, ``"sta"``; ``help(apply_sparse_attention)`` gives their options); the latent grid
comes from a forward pre-hook. :func:`capture_calibration` writes q/k/v for the PSA search.
``docs/diffusers.md`` shows the call flow, calibration and the modules' layering.
"""

from vidsparse.integrations.diffusers.api import (
    apply_sparse_attention,
    capture_calibration,
    denoising_step_callback,
    remove_sparse_attention,
    set_denoising_step,
)
from vidsparse.integrations.diffusers.capture import CalibrationCapture
from vidsparse.integrations.diffusers.methods import GATE_MODULE_NAME, METHODS
from vidsparse.integrations.diffusers.models import (
    SUPPORTED_MODELS,
    HunyuanVideoSparseAttnProcessor,
    WanSparseAttnProcessor,
)

__all__ = [
    "SUPPORTED_MODELS",
    "METHODS",
    "GATE_MODULE_NAME",
    "apply_sparse_attention",
    "remove_sparse_attention",
    "set_denoising_step",
    "denoising_step_callback",
    "capture_calibration",
    "CalibrationCapture",
    "WanSparseAttnProcessor",
    "HunyuanVideoSparseAttnProcessor",
]
