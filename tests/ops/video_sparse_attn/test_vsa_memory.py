"""VSA's Triton path never materialises a quadratic tensor.

The issue's memory rule: beyond q/k/v/o/gate, index tensors are O(B*H*num_tiles*topk); no
S x S tensor and no num_tiles x num_tiles tensor. Every tensor any op creates during a forward
and backward is recorded (a ``TorchDispatchMode`` sees the outputs of every aten op, the
launchers' allocations for the Triton kernels included) and checked by shape: no tensor may
have two sequence-long dims (tiles, tokens or padded slots).

Runs in the interpreter on CPU (small grid) and compiled on a GPU (Wan 480p grid).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import vidsparse
from vidsparse.ops.video_sparse_attn.topk import resolve_topk

HAS_GPU = torch.cuda.is_available()


class _ShapeRecorder(TorchDispatchMode):
    """Shapes of every tensor produced by an aten op while active."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _quadratic(shape, grid) -> bool:
    """Two sequence-long dims (tiles, tokens or padded slots) in one tensor: tiles x tiles,
    tokens x tokens, or tiles x tokens. The grids used keep those sizes distinct from the
    head dim, the tile volume, the head count and top-k."""
    long = {grid.num_tiles, grid.num_tokens, grid.padded_len}
    return sum(1 for size in shape if size in long) >= 2


def _run_recorded(grid, heads: int, head_dim: int, sparsity: float, device, dtype):
    shape = (1, heads, grid.num_tokens, head_dim)
    q, k, v, gate = (
        torch.randn(shape, device=device, dtype=dtype).requires_grad_(True) for _ in range(4)
    )
    recorder = _ShapeRecorder()
    with recorder:
        o = vidsparse.video_sparse_attn(q, k, v, grid, sparsity=sparsity, gate=gate)
        torch.autograd.grad(o, (q, k, v, gate), torch.randn_like(o))
    return recorder.shapes


def _check(shapes, grid, topk: int) -> None:
    num_tiles = grid.num_tiles
    assert topk < num_tiles, "pick a sparsity that leaves topk < num_tiles"
    offenders = [(op, s) for op, s in shapes if _quadratic(s, grid)]
    assert not offenders, f"quadratic tensors (num_tiles={num_tiles}): {offenders[:8]}"
    # The index tensors are there, at top-k width: [B, H, num_tiles, topk].
    assert any(s[-2:] == (num_tiles, topk) for _, s in shapes), "no top-k wide index tensor"


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(HAS_GPU, reason="interpreter tests run on CPU CI")
def test_vsa_triton_path_allocates_nothing_quadratic_interpreter(triton_backend):
    grid = vidsparse.VideoGrid((5, 9, 11))  # 2x3x3 = 18 partial tiles, 495 tokens
    sparsity = 0.75
    shapes = _run_recorded(grid, 2, 16, sparsity, "cpu", torch.float32)
    _check(shapes, grid, resolve_topk(grid.num_tiles, sparsity=sparsity))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_vsa_gpu_allocates_nothing_quadratic_at_wan_480p():
    grid = vidsparse.VideoGrid((21, 30, 52))  # 624 tiles, 32,760 tokens
    sparsity = 0.875
    shapes = _run_recorded(grid, 2, 128, sparsity, "cuda", torch.bfloat16)
    _check(shapes, grid, resolve_topk(grid.num_tiles, sparsity=sparsity))


def test_recorder_sees_a_quadratic_tensor(torch_backend):
    """The check can fail: the PyTorch reference computes the coarse tiles x tiles scores."""
    grid = vidsparse.VideoGrid((5, 9, 11))
    shapes = _run_recorded(grid, 2, 16, 0.75, "cpu", torch.float64)
    assert any(_quadratic(s, grid) for _, s in shapes)
