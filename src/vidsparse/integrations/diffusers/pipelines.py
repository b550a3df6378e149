"""Pipelines: the transformers a diffusers pipeline holds, its scheduler (which gives the
denoising step), per-transformer options, and the base of the step callback."""

from __future__ import annotations

from torch import nn

from vidsparse.integrations.diffusers.state import logger

TRANSFORMER_NAMES = ("transformer", "transformer_2")  # Wan 2.2 A14B: high- and low-noise experts

try:  # the callback composes with diffusers' MultiPipelineCallbacks when it is a PipelineCallback
    from diffusers.callbacks import PipelineCallback as StepCallbackBase
except ImportError:  # pragma: no cover - diffusers is needed to patch anything anyway
    StepCallbackBase = object


def is_pipeline(obj) -> bool:
    return not isinstance(obj, nn.Module) and hasattr(obj, "components")


def transformers_of(pipe_or_transformer) -> list[tuple[str, nn.Module]]:
    """``[(name, transformer)]``: a pipeline's ``transformer`` and ``transformer_2`` (those it
    holds), or ``[("transformer", it)]`` for a model."""
    if isinstance(pipe_or_transformer, nn.Module):
        return [("transformer", pipe_or_transformer)]
    if not is_pipeline(pipe_or_transformer):
        raise TypeError(
            "expected a diffusers pipeline or a transformer (torch.nn.Module), got "
            f"{type(pipe_or_transformer).__name__}"
        )
    found = [
        (name, getattr(pipe_or_transformer, name))
        for name in TRANSFORMER_NAMES
        if isinstance(getattr(pipe_or_transformer, name, None), nn.Module)
    ]
    if not found:
        raise TypeError(
            f"{type(pipe_or_transformer).__name__} holds no transformer (looked for "
            f"{', '.join(TRANSFORMER_NAMES)}); pass the model itself"
        )
    return found


def pipeline_scheduler(pipe_or_transformer):
    """The pipeline's scheduler if it tracks its step index (diffusers' schedulers have
    ``step_index``), else ``None`` (the step then comes from set_denoising_step)."""
    if not is_pipeline(pipe_or_transformer):
        return None
    scheduler = getattr(pipe_or_transformer, "scheduler", None)
    if scheduler is None or not hasattr(scheduler, "step_index"):
        logger.warning(
            "vidsparse: %s's scheduler has no step_index; set the denoising step with "
            "DenoisingStepCallback (PSA plans)",
            type(pipe_or_transformer).__name__,
        )
        return None
    return scheduler


def split_options(options: dict, names: list[str]) -> dict[str, dict]:
    """Per transformer name, its options: a value given as a dict keyed by transformer names
    is that transformer's; any other value is shared."""
    out: dict[str, dict] = {name: {} for name in names}
    for key, value in options.items():
        if isinstance(value, dict) and value and set(value) <= set(TRANSFORMER_NAMES):
            missing = [name for name in names if name not in value]
            extra = sorted(set(value) - set(names))
            if missing or extra:
                raise ValueError(
                    f"option {key!r} is given per transformer for {sorted(value)}, but this "
                    f"pipeline holds {names}"
                )
            for name in names:
                out[name][key] = value[name]
        else:
            for name in names:
                out[name][key] = value
    return out
