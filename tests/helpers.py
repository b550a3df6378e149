"""Shared helpers of the tests: builders for the block-sparse attention tests, and a repository
script (``benchmarks/``, ``examples/``) loaded as a module."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

from vidsparse.masks.block_sparse import dense_from_lists, random_block_lists

REPO = Path(__file__).resolve().parents[1]


def load_script(path: Path | str, name: str | None = None):
    """The file at ``path`` (absolute, or relative to the repository) run as module ``name``
    (its stem by default), registered in ``sys.modules`` (dataclasses look their module up
    there)."""
    path = REPO / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_qkv(B, H, Sq, Skv, D, *, dtype, device, scale=1.0, requires_grad=False):
    g = [
        torch.randn(B, H, s, D, device=device, dtype=torch.float32) * scale for s in (Sq, Skv, Skv)
    ]
    return [x.to(dtype).requires_grad_(requires_grad) for x in g]


def make_lists(Bi, H, NQ, NK, *, density, device, empty_rows=0):
    idx, cnt = random_block_lists(Bi, H, NQ, NK, density=density, device=device)
    if empty_rows:
        cnt[..., :empty_rows] = 0  # first rows attend to nothing
    if empty_rows < NQ:
        cnt[..., -1] = torch.clamp(cnt[..., -1], max=1)  # last row: at most one block
    return idx, cnt


def masked_dense_attention(
    q, k, v, kv_indices, kv_counts, block_q, block_kv, kv_block_sizes=None, scale=None
):
    """Brute force in fp64: a token-level mask expanded from the block map. Returns (o, lse)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    mask = token_mask(kv_indices, kv_counts, block_q, block_kv, Skv, kv_block_sizes)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    o = torch.einsum("bhqk,bhkd->bhqd", p, v.double())
    return o, lse


def token_mask(kv_indices, kv_counts, block_q, block_kv, Skv, kv_block_sizes=None):
    """The block lists as a token-level mask [B or 1, H, Sq, Skv] (padding keys masked)."""
    block_map = dense_from_lists(kv_indices, kv_counts, Skv // block_kv)
    mask = block_map.repeat_interleave(block_q, 2).repeat_interleave(block_kv, 3)
    if kv_block_sizes is not None:
        slot = torch.arange(Skv, device=mask.device) % block_kv
        mask = mask & (slot < kv_block_sizes.long().repeat_interleave(block_kv))
    return mask


def flash_gradients_fp32(q, k, v, do, kv_indices, kv_counts, block_q, block_kv,
                         kv_block_sizes=None, scale=None):  # fmt: skip
    """dq, dk, dv as FlashAttention's backward computes them, in fp32 PyTorch: base-2
    exponent with the softmax scale folded into ``log2(e)``, ``p`` from the log-sum-exp,
    ``delta = rowsum(o * do)``. The precision baseline of a kernel that works this way: its
    rounding grows with the logits (``|s| * eps`` in every ``p``) and with the cancellation
    in ``dp - delta``, which the autograd of plain softmax does not share."""
    q, k, v, do = (x.detach().float() for x in (q, k, v, do))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = token_mask(kv_indices, kv_counts, block_q, block_kv, k.shape[2], kv_block_sizes)
    s2 = (q @ k.transpose(-1, -2) * (scale * math.log2(math.e))).masked_fill(~mask, float("-inf"))
    m = s2.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    lse2 = m + torch.log2(torch.exp2(s2 - m).sum(-1, keepdim=True))
    p = torch.exp2(s2 - lse2).nan_to_num(0.0)  # rows that attend to nothing: p = 0
    o = p @ v
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (o * do).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do


def gradient_term_magnitudes(q, k, v, do, kv_indices, kv_counts, block_q, block_kv,
                             kv_block_sizes=None, scale=None):  # fmt: skip
    """dq, dk, dv's sums of absolute terms in fp64 (``|p| (|dp| + |delta|)`` for ``ds``): the
    size a relative rounding error in ``p`` reaches in each gradient element, cancellation
    or not (a gradient element that cancels to zero still carries it)."""
    q, k, v, do = (x.detach().double() for x in (q, k, v, do))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = token_mask(kv_indices, kv_counts, block_q, block_kv, k.shape[2], kv_block_sizes)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    dp = do @ v.transpose(-1, -2)
    terms = p * (dp.abs() + (p * dp).sum(-1, keepdim=True).abs())
    return (
        terms @ k.abs() * scale,
        terms.transpose(-1, -2) @ q.abs() * scale,
        p.transpose(-1, -2) @ do.abs(),
    )


def lists_without_bad_entries(kv_indices, kv_counts, num_kv_blocks):
    """The lists as the kernels walk them whatever they hold: counts clamped to ``[0, K]``,
    entries out of ``[0, num_kv_blocks)`` dropped (the rest kept in order)."""
    width = kv_indices.shape[-1]
    slots = torch.arange(width, device=kv_indices.device)
    live = (slots < kv_counts.clamp(0, width)[..., None]) & (kv_indices >= 0)
    live &= kv_indices < num_kv_blocks
    order = torch.sort((~live).int(), dim=-1, stable=True).indices
    clean = torch.where(live, kv_indices, 0).gather(-1, order)
    return clean.contiguous(), live.sum(-1).to(torch.int32)


# Backend fixtures of tests/conftest.py: an error must be the same on both.
BACKENDS = ["torch_backend", "triton_backend"]

# (argument, how to spoil it, error class, words of the message) for the video ops' q, k, v.
BAD_TENSOR_CASES = [
    ("k", lambda x: x[:, :, :-1], ValueError, "same shape"),
    ("v", lambda x: x.double(), TypeError, "dtype"),
    ("q", lambda x: x[0], ValueError, "q"),
    ("q", lambda x: x.int(), TypeError, "q"),
    ("v", lambda x: x.to("meta"), ValueError, "device"),
]


def forbid_calls(monkeypatch, module, *names):
    """Make ``module.<name>`` fail the test when called: the error under test must come
    before any compute."""

    def called(*args, **kwargs):
        raise AssertionError(f"{module.__name__} computed before the error")

    for name in names:
        monkeypatch.setattr(module, name, called)
