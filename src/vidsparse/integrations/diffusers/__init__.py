"""vidsparse attention inside diffusers video transformers (diffusers >= 0.36).

::

    from vidsparse.integrations.diffusers import apply_sparse_attention, remove_sparse_attention

    apply_sparse_attention(pipe.transformer, method="vsa", sparsity=0.875)
    video = pipe(prompt, ...).frames[0]
    remove_sparse_attention(pipe.transformer)        # the stock processors again, exactly

How it plugs in::

    transformer(hidden_states [B, C, F, H, W], ...)
      forward pre-hook: grid = (F / p_t, H / p_h, W / p_w) -> state  (processors never see it)
      video self-attention of layer i -> our processor (layer i):
          q, k, v, q/k norms, RoPE: as the stock processor             [B, S, heads, D]
          attention: the method (methods.py): SDPA, VSA, PSA, STA, ...   on [B, heads, S, D]
          output projection: as the stock processor
      everything else (Wan's cross-attention to text, HunyuanVideo's token refiner): untouched

Methods (``method=``): ``"dense"`` (SDPA, bit-identical to the stock processor), ``"vsa"``,
``"psa"``, ``"sta"``; ``METHODS`` lists them. Each is a class in the methods registry
(``methods.py``) whose docstring gives its options; ``help(apply_sparse_attention)`` shows
them all.

Calibration for the PSA search (:func:`capture_calibration`): dense processors (outputs
unchanged) that write each selected layer's video q/k/v at the current denoising step to a
folder as soon as it is computed, one file per (step, layer, forward call), in the format
:func:`vidsparse.search.load_calibration` reads::

    with capture_calibration(pipe.transformer, "calib/", steps=range(10, 50, 10)):
        pipe(prompt, num_inference_steps=50,
             callback_on_step_end=denoising_step_callback(pipe.transformer))
    # vidsparse search calib/ ...   or   vidsparse.search.search("calib/", grid, alpha=...)

All state lives in one ``SparseState`` on the transformer; ``remove_sparse_attention``
puts back the original processor objects, removes the hook and the added gate modules.

Layering (imports point down): ``api`` (the public functions) -> ``capture`` (calibration) ->
``hooks`` (install, uninstall, the grid pre-hook) -> ``methods`` (the registry) and ``models``
(the adapters table and the processors) -> ``state`` (one call, the method interface, the
adapter record, what the processors share).
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
