"""Calibration capture for the PSA search: dense attention that writes the video q/k/v of the
selected (step, layer) calls to a folder (``capture_calibration`` in ``api.py`` installs it),
one ``.safetensors`` file each that records the grid and, on a pipeline, the step count."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from vidsparse.integrations.diffusers.hooks import uninstall
from vidsparse.integrations.diffusers.state import STATE_ATTR, Method
from vidsparse.search.calibration import (
    CALIBRATION_SUFFIXES,
    CalibrationSample,
    save_calibration_sample,
)

# CALIBRATION_SUFFIXES (".pt", ".safetensors"): the suffixes of calibration files; a
# capture's folder must hold none yet, since the search reads every such file of it.
__all__ = [
    "CALIBRATION_SUFFIXES",
    "CaptureMethod",
    "CalibrationCapture",
    "int_set",
    "scheduler_steps",
]


class CaptureMethod(Method):
    """Dense attention (diffusers' own, as "dense") that first writes the video q/k/v of the
    selected (step, layer) calls to ``out_dir``: one layer's CPU copy in memory at a time."""

    name = "capture"
    uses_step = True

    def __init__(
        self,
        out_dir: Path,
        steps: frozenset[int] | None,
        layers: Sequence | None,
        transformer: str | None = None,
    ):
        self.out_dir, self.steps, self.raw_layers = out_dir, steps, layers
        self.transformer = transformer  # the pipeline member, recorded in every file
        self.layers: frozenset[int] | None = None
        self.paths: list[Path] = []
        self._calls: dict[tuple[int, int], int] = {}  # forward calls seen per (step, layer)
        self._scheduler = None  # the pipeline's scheduler (the state's), if a pipeline was patched

    def check_model(self, num_layers, heads):
        if self.raw_layers is None:
            return
        layers = int_set("layers", self.raw_layers)
        unknown = sorted(i for i in layers if i >= num_layers)
        if unknown:
            raise ValueError(
                f"layers {unknown} do not exist: the model has {num_layers} attention layers "
                f"(0 .. {num_layers - 1})"
            )
        self.layers = layers

    def before_forward(self, state, device):
        self._scheduler = state.scheduler

    def attend(self, q, k, v, call):
        if (self.steps is None or call.step in self.steps) and (
            self.layers is None or call.layer in self.layers
        ):
            self._save(q, k, v, call)
        return call.dense(q, k, v)

    @torch.compiler.disable  # file I/O: under torch.compile, a graph break here, run eagerly
    def _save(self, q, k, v, call):
        # The search works on the video grid: HunyuanVideo's text tokens are left out (all
        # video keys are real, so its text padding mask does not matter here either).
        video = q.shape[2] - call.text_tokens
        q, k, v = (x[:, :, :video].detach().to("cpu").contiguous() for x in (q, k, v))
        key = (call.step, call.layer)
        n = self._calls[key] = self._calls.get(key, -1) + 1  # CFG runs a step several times
        name = f"step{call.step:05d}_layer{call.layer:04d}_call{n:03d}.safetensors"
        num_steps = scheduler_steps(self._scheduler)
        if num_steps is not None and call.step >= num_steps:
            num_steps = None  # a step outside the schedule: record no step count
        sample = CalibrationSample(
            call.step,
            call.layer,
            q,
            k,
            v,
            grid_shape=call.shape,
            num_steps=num_steps,
            transformer=self.transformer,
        )
        save_calibration_sample(sample, self.out_dir / name)
        self.paths.append(self.out_dir / name)


def scheduler_steps(scheduler) -> int | None:
    """The denoising steps of a scheduler's schedule (``len(scheduler.timesteps)`` after the
    pipeline's ``set_timesteps``, on the scale of its ``step_index``), or ``None`` if unknown."""
    timesteps = getattr(scheduler, "timesteps", None)
    # diffusers' schedulers hold the training timesteps until set_timesteps, which also sets
    # num_inference_steps (None or absent before)
    if timesteps is None or getattr(scheduler, "num_inference_steps", None) is None:
        return None
    try:
        count = len(timesteps)
    except TypeError:  # a 0-d tensor or an object without a length
        return None
    return count if count > 0 else None


def int_set(name: str, values) -> frozenset[int]:
    """``values`` as a set of ints >= 0 (``TypeError``/``ValueError`` naming ``name``)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be an iterable of ints >= 0 or None, got {values!r}")
    values = list(values)
    bad = [x for x in values if isinstance(x, bool) or not isinstance(x, int) or x < 0]
    if bad or not values:
        raise ValueError(f"{name} must be a non-empty iterable of ints >= 0, got {values!r}")
    return frozenset(values)


class CalibrationCapture:
    """What :func:`capture_calibration` returns: a handle on the installed capture (one per
    transformer of a pipeline), and a context manager that removes it on exit.

    ``paths``: the files written so far, in the order they were written. ``remove()`` puts the
    models back as they were (the same as :func:`remove_sparse_attention`).
    """

    def __init__(self, captures: list[tuple[nn.Module, CaptureMethod]], out_dir: Path):
        self._captures, self.out_dir = captures, out_dir

    @property
    def paths(self) -> list[Path]:
        return [path for _, method in self._captures for path in method.paths]

    @property
    def active(self) -> bool:
        return any(self._applied(t, m) for t, m in self._captures)

    @staticmethod
    def _applied(transformer, method) -> bool:
        state = getattr(transformer, STATE_ATTR, None)
        return state is not None and state.method is method

    def remove(self) -> None:
        if not self.active:
            raise ValueError("this calibration capture is no longer applied to the transformer")
        for transformer, method in self._captures:
            if self._applied(transformer, method):
                uninstall(transformer)

    def __enter__(self) -> CalibrationCapture:
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            self.remove()
