"""The one place where ``VIDSPARSE_BACKEND`` is read.

``auto`` (default): Triton for GPU tensors; for CPU tensors the PyTorch reference, unless
``TRITON_INTERPRET=1`` is set, in which case the Triton kernels run in the interpreter (this is
how CPU CI exercises kernel code). ``triton`` / ``torch`` force one backend.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]
_CHOICES = ("auto", "triton", "torch")


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
        return "triton"
    if on_gpu or triton_interpret_enabled():
        return "triton"
    return "torch"
