"""Dense ``scaled_dot_product_attention`` pinned to one backend: the reference providers.

Pinned (``sdpa_kernel`` with a single backend), SDPA raises rather than silently falling back
to another kernel, which would change the reference. On the CPU neither fused backend exists;
the dense providers then run SDPA's math backend (a dry run: its timings mean nothing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "math": "MATH"}


class BackendRefused(RuntimeError):
    """The pinned SDPA backend cannot run this call (shape, dtype, GPU)."""


def dense_sdpa(provider: str, device: torch.device) -> Callable[..., torch.Tensor]:
    """``forward(q, k, v, attn_mask=None)`` running SDPA on ``provider``'s backend (``cudnn``,
    ``flash``; ``math`` on the CPU whatever the provider)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name = provider if device.type == "cuda" else "math"
    backend = getattr(SDPBackend, BACKENDS[name])

    def forward(q, k, v, attn_mask=None):
        try:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        except RuntimeError as exc:
            if "No available kernel" not in str(exc):
                raise
            raise BackendRefused(
                f"SDPA's {name} backend refused {tuple(q.shape)} {q.dtype} on {device}"
                " (see torch's warnings for why)"
            ) from None

    return forward
