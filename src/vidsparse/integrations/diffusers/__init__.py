"""vidsparse attention inside diffusers video pipelines and transformers (diffusers >= 0.36).

::

    from vidsparse.integrations.diffusers import apply_sparse_attention, remove_sparse_attention

    apply_sparse_attention(pipe, method="vsa", sparsity=0.875)   # every transformer of pipe
    video = pipe(prompt, ...).frames[0]
    remove_sparse_attention(pipe)                                # the stock models, exactly

The models keep their own processors: only the attention call of their video self-attention
is routed to the method (``METHODS``: ``"dense"``, ``"vsa"``, ``"psa"``, ``"sta"``;
``help(apply_sparse_attention)`` gives their options); the latent grid comes from a forward
pre-hook, the denoising step from the pipeline's scheduler. :func:`load_sparse_attention`
loads trained VSA gates (ours or FastVideo's), :func:`capture_calibration` writes q/k/v for the
PSA search, :func:`apply_sequence_parallel` shards a model's sequence over a process group
(with ``ulysses=`` for its self-attention), :func:`compile_for_training` compiles its blocks
for a training step. ``docs/diffusers.md`` shows the call flow and the
modules' layering.
"""

from vidsparse.integrations.diffusers.api import (
    DenoisingStepCallback,
    apply_sparse_attention,
    capture_calibration,
    denoising_step_callback,
    load_sparse_attention,
    remove_sparse_attention,
    set_denoising_step,
)
from vidsparse.integrations.diffusers.capture import CalibrationCapture
from vidsparse.integrations.diffusers.compile import compile_for_training
from vidsparse.integrations.diffusers.methods import GATE_MODULE_NAME, METHODS
from vidsparse.integrations.diffusers.models import SUPPORTED_MODELS, UNSUPPORTED_MODELS
from vidsparse.integrations.diffusers.sequence_parallel import (
    SequenceParallel,
    apply_sequence_parallel,
)

__all__ = [
    "SUPPORTED_MODELS",
    "UNSUPPORTED_MODELS",
    "METHODS",
    "GATE_MODULE_NAME",
    "apply_sparse_attention",
    "remove_sparse_attention",
    "load_sparse_attention",
    "set_denoising_step",
    "DenoisingStepCallback",
    "denoising_step_callback",
    "capture_calibration",
    "CalibrationCapture",
    "SequenceParallel",
    "apply_sequence_parallel",
    "compile_for_training",
]
