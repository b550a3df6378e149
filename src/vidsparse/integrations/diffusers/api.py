"""The public functions: patch and unpatch a pipeline or transformer, follow the denoising step,
load trained gates, capture calibration samples."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from torch import nn

from vidsparse.integrations.diffusers.capture import (
    CALIBRATION_SUFFIXES,
    CalibrationCapture,
    CaptureMethod,
    int_set,
)
from vidsparse.integrations.diffusers.gates import (
    CONFIG_KEY,
    apply_saved_config,
    load_gate_state,
    read_gate_source,
)
from vidsparse.integrations.diffusers.hooks import install, uninstall
from vidsparse.integrations.diffusers.methods import describe_methods, make_method
from vidsparse.integrations.diffusers.pipelines import (
    StepCallbackBase,
    is_pipeline,
    pipeline_scheduler,
    split_options,
    transformers_of,
)
from vidsparse.integrations.diffusers.state import logger, state_of


def apply_sparse_attention(pipe_or_transformer, method: str = "vsa", *, ulysses=None, **options):
    """Route the video self-attention of a diffusers pipeline or transformer through vidsparse.

    Args:
        pipe_or_transformer: a diffusers pipeline (every transformer it holds is patched:
            ``transformer`` and ``transformer_2``, e.g. Wan 2.2 A14B's two experts) or one of
            the transformers of ``SUPPORTED_MODELS`` (the exact classes).
        method: a name of ``METHODS`` (``"dense"``, ``"vsa"``, ``"psa"``, ``"sta"``, ...).
        **options: the method's options, listed per method at the end of this help. On a
            pipeline, an option given as a dict keyed by transformer name (``{"transformer":
            ..., "transformer_2": ...}``) sets it per transformer (e.g. one PSA plan each).
        ulysses: a :class:`vidsparse.parallel.UlyssesAttention` for sequence parallelism: the
            attention then receives this rank's sequence shard (``[B, S/P, H, D]``, as
            diffusers' context parallelism hands it) and runs the method over the whole
            sequence through Ulysses all-to-alls. Not with text tokens (HunyuanVideo) yet.

    The model keeps its own processors, projections, norms, RoPE and masks: only the attention
    call of its video self-attention is routed (``dispatch.py``); cross-attention and every
    call a method leaves dense go to diffusers' attention with the backend the user set
    (``set_attention_backend``, ``attention_backend()``). On a pipeline the denoising step (PSA
    plans) comes from its scheduler; on a bare transformer set it with
    :func:`set_denoising_step` or :class:`DenoisingStepCallback`.

    Under ``torch.compile`` the routing traces without a graph break; with regional
    compilation (``transformer.compile_repeated_blocks(fullgraph=True)``) every method compiles
    one graph for all blocks (PSA: one per step bucket).

    Raises ``TypeError`` for an unsupported model (listing the supported ones and why), an
    unknown option name or an option of the wrong type, ``ValueError`` for bad option values,
    a plan for another head count, layer set or transformer, a model already patched, or a
    method the model does not support (``"sta"`` on HunyuanVideo). Nothing is patched then.

    Methods and their options (the methods registry, ``methods.py``):
    """
    targets = transformers_of(pipe_or_transformer)
    per_target = split_options(options, [name for name, _ in targets])
    _install_all(pipe_or_transformer, targets, method, per_target, ulysses)


def _install_all(pipe_or_transformer, targets, method: str, per_target: dict, ulysses=None):
    """Build every target's method (all options checked first), then patch them all; on any
    failure none stays patched."""
    methods = {name: make_method(method, per_target[name]) for name, _ in targets}
    if is_pipeline(pipe_or_transformer):
        for name, built in methods.items():
            built.check_target(name)
    scheduler = pipeline_scheduler(pipe_or_transformer)
    done = []
    try:
        for name, transformer in targets:
            state = install(transformer, lambda spec, name=name: methods[name], ulysses, scheduler)
            state.name = name
            done.append(transformer)
            _record_config(transformer, method, per_target[name])
    except BaseException:
        for transformer in done:
            uninstall(transformer)
            _forget_config(transformer)
        raise


def remove_sparse_attention(pipe_or_transformer) -> None:
    """Undo :func:`apply_sparse_attention`: no hooks, no gate modules, diffusers' own attention
    call again; outputs are bit-identical to the model before it was patched."""
    for _, transformer in transformers_of(pipe_or_transformer):
        uninstall(transformer)
        _forget_config(transformer)


def load_sparse_attention(
    pipe_or_transformer, source, method: str = "vsa", *, ulysses=None, **options
) -> None:
    """Apply VSA with trained gates from ``source`` in one call.

    ``source``: a folder written by ``save_pretrained`` of a patched transformer (its
    safetensors files and its config's ``vidsparse`` entry, which supplies the options not
    given here), a ``.safetensors`` file, or a state dict. Gates are read from
    ``<block>.to_gate_compress.{weight,bias}``: the keys ``save_pretrained`` writes, and those
    of FastVideo's VSA checkpoints of Wan. On a pipeline, ``source`` is the pipeline folder
    (each transformer's subfolder, as ``pipe.save_pretrained`` writes it) or a dict keyed by
    transformer name; a pipeline of one transformer also takes that transformer's own folder,
    file or state dict.

    ``ulysses``: sequence parallelism, as for :func:`apply_sparse_attention`.

    Raises ``ValueError`` for a source without gates, gates for other layers, or of another
    shape (another model), naming the mismatch; nothing stays patched then.
    """
    targets = transformers_of(pipe_or_transformer)
    on_pipeline = not isinstance(pipe_or_transformer, nn.Module)
    sources = read_gate_source(source, [name for name, _ in targets], on_pipeline)
    per_target = {
        name: {**apply_saved_config(sources[name], method, options), "gate": True}
        for name, _ in targets
    }
    _install_all(pipe_or_transformer, targets, method, per_target, ulysses)
    try:
        for name, transformer in targets:
            load_gate_state(transformer, sources[name].state_dict)
    except BaseException:
        remove_sparse_attention(pipe_or_transformer)
        raise
    for name, transformer in targets:
        logger.info(
            "vidsparse: loaded %d VSA gates into %s", len(state_of(transformer).layers), name
        )


def set_denoising_step(transformer: nn.Module, step: int) -> None:
    """Set the denoising step (0-based) that selects a PSA plan's bucket for later calls of a
    transformer patched on its own (a patched pipeline follows its scheduler)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    state = state_of(transformer)
    if state.scheduler is not None:
        raise ValueError(
            "this transformer was patched through its pipeline, whose scheduler gives the step"
        )
    state.step = step


class DenoisingStepCallback(StepCallbackBase):
    """A diffusers ``PipelineCallback`` that advances the denoising step of transformers
    patched on their own (``callback_on_step_end=DenoisingStepCallback(pipe.transformer)``;
    composes with other callbacks through ``MultiPipelineCallbacks``).

    The pipeline calls it after step ``i``; it sets step ``i + 1``, and 0 after the last step,
    so the next generation starts at the plan's first (dense) step again. Not needed when the
    pipeline itself was patched: its scheduler gives the step.
    """

    tensor_inputs: list[str] = []

    def __init__(self, pipe_or_transformer):
        super().__init__()
        self.transformers = [t for _, t in transformers_of(pipe_or_transformer)]
        for transformer in self.transformers:
            state_of(transformer)  # fail now, not inside the pipeline loop

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs) -> dict:
        total = getattr(pipeline, "num_timesteps", None)
        step = step_index + 1
        for transformer in self.transformers:
            state = state_of(transformer)
            if total is not None:
                state.method.check_num_steps(total)
            state.step = 0 if total is not None and step >= total else step
        return callback_kwargs


def denoising_step_callback(pipe_or_transformer) -> Callable:
    """:class:`DenoisingStepCallback` of ``pipe_or_transformer`` (kept for older code)."""
    return DenoisingStepCallback(pipe_or_transformer)


def capture_calibration(
    pipe_or_transformer,
    out_dir: str | os.PathLike,
    *,
    steps: Iterable[int] | None = None,
    layers: Iterable[int] | None = None,
) -> CalibrationCapture:
    """Record calibration samples for the PSA search while the model runs.

    Installs on every video self-attention layer a routing that attends densely (diffusers'
    own attention: outputs equal the stock model's bit for bit) and, for the selected steps
    and layers, writes that call's video q/k/v (``[B, heads, S_video, head_dim]``, CPU copies
    in the model's dtype) with :func:`vidsparse.search.save_calibration_sample`, one layer's
    copy in memory at a time. One file per (step, layer, forward call):
    ``step{s}_layer{l}_call{n}.safetensors`` (``n`` counts repeated forwards of one step, such
    as the two passes of classifier-free guidance; the search pools them). The grid (and on a
    pipeline the number of steps) is recorded in every file: ``vidsparse search`` reads it.
    On a pipeline each transformer writes into its own subfolder of ``out_dir``
    (``transformer/``, ``transformer_2/``) and the step comes from the scheduler; on a bare
    transformer from :func:`set_denoising_step` (0 until then).

    Args:
        pipe_or_transformer: as :func:`apply_sparse_attention` (no sparse attention applied).
        out_dir: a folder, created if missing; it must not hold calibration files yet.
        steps: denoising steps to record (default all).
        layers: attention layer indices to record (default all; HunyuanVideo counts the
            dual-stream blocks, then the single-stream ones).

    Returns a :class:`CalibrationCapture`; use it as a context manager, or call ``remove()``.
    """
    step_set = None if steps is None else int_set("steps", steps)
    if layers is not None:
        int_set("layers", layers)  # fail before touching the folder
    targets = transformers_of(pipe_or_transformer)
    out = Path(out_dir)
    folders = {name: out / name if len(targets) > 1 else out for name, _ in targets}
    for folder in folders.values():
        _check_empty_folder(folder)
    scheduler = pipeline_scheduler(pipe_or_transformer)
    on_pipeline = is_pipeline(pipe_or_transformer)
    captures = []
    try:
        for name, transformer in targets:
            method = CaptureMethod(
                folders[name],
                step_set,
                None if layers is None else list(layers),
                transformer=name if on_pipeline else None,
            )
            folders[name].mkdir(parents=True, exist_ok=True)
            install(transformer, lambda spec, method=method: method, None, scheduler)
            captures.append((transformer, method))
    except BaseException:
        for transformer, _ in captures:
            uninstall(transformer)
        raise
    return CalibrationCapture(captures, out)


def _check_empty_folder(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(p.suffix in CALIBRATION_SUFFIXES for p in out.iterdir()):
        raise ValueError(
            f"out_dir {str(out)!r} already holds calibration files; capture into an empty "
            "folder (the search reads every calibration file of it)"
        )


def _record_config(transformer, method: str, options: dict) -> None:
    """The method and its plain options in the transformer's config, so ``save_pretrained``
    writes them beside the gates (``load_sparse_attention`` reads them back)."""
    saved = {
        k: v for k, v in options.items() if isinstance(v, (bool, int, float, str, list, tuple))
    }
    saved = {k: list(v) if isinstance(v, tuple) else v for k, v in saved.items()}
    if hasattr(transformer, "register_to_config"):
        transformer.register_to_config(**{CONFIG_KEY: {"method": method, **saved}})


def _forget_config(transformer) -> None:
    config = getattr(transformer, "_internal_dict", None)
    if config is not None and CONFIG_KEY in config:
        # FrozenDict: rebuild without our entry
        transformer._internal_dict = type(config)(
            {k: v for k, v in config.items() if k != CONFIG_KEY}
        )


if apply_sparse_attention.__doc__ is not None:  # None under python -OO
    apply_sparse_attention.__doc__ += "\n" + describe_methods(indent="    ") + "\n"
