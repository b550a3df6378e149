"""Argument validation shared by the public interfaces.

Every check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape,
range or device) naming the argument and what was expected, before any compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, x, *, ndim: int | None = None, dtypes=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {x.dtype}")
    return x


def check_qkv(q, k, v, dtypes) -> None:
    """q, k, v are 4-D tensors of one of ``dtypes``, all three of the same dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4, dtypes=dtypes)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def bshd_hint(name: str, x: torch.Tensor) -> str:
    """The sentence to add when ``x`` looks like ``[B, S, H, D]`` where ``[B, H, S, D]`` is
    expected (the caller has judged that dim 2 is wrong and dim 1 would fit as S)."""
    return (
        f"; {name} of shape {tuple(x.shape)} looks like [B, S, H, D]: vidsparse takes "
        f"[B, H, S, D] tensors, as SDPA does (pass {name}.transpose(1, 2))"
    )


def is_bshd_view(x: torch.Tensor) -> bool:
    """Is ``[B, H, S, D]`` tensor ``x`` stored ``[B, S, H, D]`` (diffusers' processors pass
    q, k, v so, as ``transpose(1, 2)`` views)? One head or fewer says nothing: False."""
    return x.shape[1] > 1 and x.stride(1) < x.stride(2)


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"{name} is on {dev} but {first_name} is on {first}; all inputs must share a device"
            )
    return first


def check_positive_ints(name: str, values: Sequence[int], length: int | None = None) -> tuple:
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {values!r}") from None
    if length is not None and len(values) != length:
        raise ValueError(f"{name} must have {length} entries, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints, got {values!r}")
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {values!r}")
    return values


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` must be a bool (not a truthy string or int); the error names ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_scale(scale) -> float | None:
    """A softmax ``scale``: ``None`` (the op's default) or a positive finite number, returned
    as a float. The one scale check of every op (engine, VSA, PSA, STA, the VSA module)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return float(scale)


def softmax_scale(scale, head_dim: int) -> float:
    """``check_scale(scale)``, defaulting to ``1 / sqrt(head_dim)``."""
    scale = check_scale(scale)
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def check_head_dim(q: torch.Tensor) -> int:
    """The head dim ``D`` (q's last dimension) must be positive: an empty one has no softmax
    scale (``1 / sqrt(0)``) and no attention to compute."""
    head_dim = q.shape[-1]
    if head_dim <= 0:
        raise ValueError(
            f"head_dim (the last dimension of q, k, v) must be positive, got q of shape"
            f" {tuple(q.shape)}"
        )
    return head_dim


def check_device(name: str, device, types: Sequence[str] = ("cpu", "cuda")) -> torch.device:
    """``device`` (a string or ``torch.device``) as a ``torch.device`` of one of ``types`` that
    this process can use: a ``ValueError`` naming ``name`` otherwise (an unknown device, or
    CUDA on a torch without it or with no GPU visible)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be one of {', '.join(types)}, got {device!r}") from None
    if dev.type not in types:
        raise ValueError(f"{name} must be one of {', '.join(types)}, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda is not None or torch.version.hip is not None
            why = "no GPU is visible" if built else f"torch {torch.__version__} has no CUDA"
            raise ValueError(f"{name} is {device!r} but {why}; use cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"{name} is {device!r} but only {count} GPU(s) are visible")
    return dev
