"""The public functions: patch and unpatch a transformer, drive the denoising step, capture
calibration samples."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from torch import nn

from vidsparse.integrations.diffusers.capture import CalibrationCapture, CaptureMethod, int_set
from vidsparse.integrations.diffusers.hooks import install, uninstall
from vidsparse.integrations.diffusers.methods import describe_methods, make_method
from vidsparse.integrations.diffusers.state import state_of


def apply_sparse_attention(
    transformer: nn.Module, method: str = "vsa", *, ulysses=None, **options
) -> None:
    """Route the video self-attention of ``transformer`` through vidsparse.

    Args:
        transformer: a diffusers ``WanTransformer3DModel`` or ``HunyuanVideoTransformer3DModel``
            (the exact classes; see ``SUPPORTED_MODELS``).
        method: a name of ``METHODS`` (``"dense"``, ``"vsa"``, ``"psa"``, ``"sta"``, ...).
        **options: the method's options, listed per method at the end of this help.
        ulysses: a :class:`vidsparse.parallel.UlyssesAttention` for sequence parallelism: the
            processors then receive this rank's sequence shard (``[B, S/P, H, D]``, as
            diffusers' context parallelism hands it, e.g. after
            ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))``)
            and run the method over the whole sequence through Ulysses all-to-alls; the latent
            grid still comes from the full input. Not with text tokens (HunyuanVideo) yet.

    Under ``torch.compile`` the processors trace without a graph break. With regional
    compilation (``transformer.compile_repeated_blocks(fullgraph=True)`` after this call) every
    method compiles one graph for all blocks (PSA: one per step bucket; its lists reach the
    blocks as buffers, see ``_PSA.before_forward``). Compiling the whole transformer makes
    PSA's per-layer specs constants, one graph per (layer, step bucket): set
    ``torch._dynamo.config.recompile_limit`` to at least that many there, or the layers past
    torch's limit (8 by default) run eagerly.

    Raises ``TypeError`` for an unsupported model class (listing the supported ones), an
    unknown option name or an option of the wrong type (``gate``, ``plan``, ``specs``),
    ``ValueError`` for bad option values, a plan for another head count or layer set, a model
    already patched, a method the model does not support (``"sta"`` on HunyuanVideo), or a
    stock processor that was replaced by something we do not know.

    Methods and their options (the methods registry, ``methods.py``):
    """
    install(transformer, lambda adapter: make_method(method, options), ulysses)


def remove_sparse_attention(transformer: nn.Module) -> None:
    """Undo :func:`apply_sparse_attention`: the original processor objects, no hook, no gate
    modules; outputs are bit-identical to the model before it was patched."""
    uninstall(transformer)


def set_denoising_step(transformer: nn.Module, step: int) -> None:
    """Set the denoising step (0-based) that selects a PSA plan's bucket for later calls."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    state_of(transformer).step = step


def denoising_step_callback(transformer: nn.Module) -> Callable:
    """A ``callback_on_step_end`` for diffusers pipelines that advances the step.

    The pipeline calls it after step ``i``; it sets step ``i + 1``, and 0 after the last step
    so the next generation starts at the plan's first (dense) step again. With classifier-free
    guidance the transformer runs twice per step, so counting forward calls would not work.
    """
    state_of(transformer)  # fail now, not inside the pipeline loop

    def callback(pipe, i: int, t, callback_kwargs: dict) -> dict:
        total = getattr(pipe, "num_timesteps", None)
        if total is not None:
            state_of(transformer).method.check_num_steps(total)
        step = i + 1
        set_denoising_step(transformer, 0 if total is not None and step >= total else step)
        return callback_kwargs

    return callback


def capture_calibration(
    transformer: nn.Module,
    out_dir: str | os.PathLike,
    *,
    steps: Iterable[int] | None = None,
    layers: Iterable[int] | None = None,
) -> CalibrationCapture:
    """Record calibration samples for the PSA search while the transformer runs.

    Installs, on every video self-attention layer, a processor that attends densely (the
    outputs equal the stock processor's bit for bit) and, for the selected steps and layers,
    writes that call's video q/k/v (``[B, heads, S_video, head_dim]``, CPU copies in the
    model's dtype) with :func:`vidsparse.search.save_calibration_sample` before moving on, so
    memory holds one layer's copy at a time. One file per (step, layer, forward call):
    ``step{s}_layer{l}_call{n}.pt`` (``n`` counts repeated forwards of one step, such as the
    two passes of classifier-free guidance; the search pools them). The grid is recorded in
    every file and checked by the search.

    The step is the one set by :func:`set_denoising_step`, or by
    :func:`denoising_step_callback` in a pipeline (0 until then). HunyuanVideo: only the video
    tokens are saved (the search works on the video grid).

    Args:
        transformer: as :func:`apply_sparse_attention` (no sparse attention applied).
        out_dir: a folder, created if missing; it must not hold ``.pt`` files yet (the search
            reads every ``.pt`` file of the folder).
        steps: denoising steps to record (default all).
        layers: attention layer indices to record (default all; HunyuanVideo counts the
            dual-stream blocks, then the single-stream ones).

    Returns a :class:`CalibrationCapture`; use it as a context manager, or call ``remove()``.
    """
    step_set = None if steps is None else int_set("steps", steps)
    if layers is not None:
        int_set("layers", layers)  # fail before touching the folder
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(p.suffix == ".pt" for p in out.iterdir()):
        raise ValueError(
            f"out_dir {str(out)!r} already holds .pt files; capture into an empty folder (the "
            "search reads every .pt file of it)"
        )
    method = CaptureMethod(out, step_set, None if layers is None else list(layers))
    out.mkdir(parents=True, exist_ok=True)
    install(transformer, lambda adapter: method)
    return CalibrationCapture(transformer, out, method)


if apply_sparse_attention.__doc__ is not None:  # None under python -OO
    apply_sparse_attention.__doc__ += "\n" + describe_methods(indent="    ") + "\n"
