"""The one place where ``VIDSPARSE_BACKEND`` is read.

``auto`` (default): Triton for GPU tensors; for CPU tensors the PyTorch reference, unless
``TRITON_INTERPRET=1`` is set, in which case the Triton kernels run in the interpreter (this is
how CPU CI exercises kernel code). ``triton`` / ``torch`` force one backend.

Triton is not a requirement of vidsparse (a GPU torch brings its own; a CPU-only torch none):
where it is not installed, ``auto`` takes the PyTorch reference and says so once in the log,
and ``triton`` is refused with a message saying why.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]
_CHOICES = ("auto", "triton", "torch")
logger = logging.getLogger("vidsparse")


# Looked up once at import (found, not imported: importing Triton costs seconds). A module
# constant, not a cached call: torch.compile traces resolve_backend and cannot trace find_spec.
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether a Triton is installed."""
    return _TRITON_FOUND


@functools.cache
def _note_no_triton() -> None:
    logger.warning(
        "vidsparse: Triton is not installed, so its kernels cannot run; the PyTorch reference "
        "runs instead (a GPU build of torch brings Triton; on a CPU: pip install triton)"
    )


def triton_interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def requested_backend() -> str:
    """The value of ``VIDSPARSE_BACKEND`` (lower case), validated."""
    value = os.environ.get("VIDSPARSE_BACKEND", "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"VIDSPARSE_BACKEND must be one of {_CHOICES}, got {value!r}")
    return value


def resolve_backend(device: torch.device) -> Backend:
    """Pick the backend for tensors living on ``device``."""
    choice = requested_backend()
    if choice == "torch":
        return "torch"
    on_gpu = device.type == "cuda"
    if choice == "triton":
        if not on_gpu and not triton_interpret_enabled():
            raise ValueError(
                "VIDSPARSE_BACKEND=triton needs GPU tensors, or TRITON_INTERPRET=1 for CPU tensors"
            )
        if not triton_available():
            raise ValueError(
                "VIDSPARSE_BACKEND=triton but Triton is not installed (a CPU-only torch brings "
                "none: pip install triton, or use VIDSPARSE_BACKEND=auto)"
            )
        return "triton"
    if on_gpu or triton_interpret_enabled():
        if triton_available():
            return "triton"
        _note_no_triton()
    return "torch"
