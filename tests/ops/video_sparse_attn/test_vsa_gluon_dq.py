"""VSA's backward with its dQ in the engine's Hopper Gluon kernel: VSA's Gluon hook
(``kernels/combine_sm90.py``'s ``pooled_dq_sm90``) put into its epilogue's functions and the
kernel forced through ``configs.override``, since neither is the library's (at 64x64 the
Gluon dQ kernel was 3% faster, and only tile-order inputs could take it). Its gradients
must match those of the Triton dQ kernel. On a Hopper GPU only (the kernel's sm_90 compile
check, VSA's hook included, is ``tests/compile/test_compile_bwd_sm90.py``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import vidsparse
from vidsparse.testing import rel_l2


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _hopper(), reason="the Gluon dQ kernel is Hopper's"),
]


def test_gpu_vsa_gradients_with_the_gluon_dq_kernel_match_triton(monkeypatch):
    from vidsparse.ops.block_sparse_attn import bwd_sm90, configs
    from vidsparse.ops.block_sparse_attn.epilogue import FnSpecs
    from vidsparse.ops.video_sparse_attn import fine
    from vidsparse.ops.video_sparse_attn.kernels.combine_sm90 import pooled_dq_sm90
    from vidsparse.utils.device import target_of

    with_hook = replace(fine._kernel_fns(), dq_sm90=FnSpecs("vsa_combine", pooled_dq_sm90))
    monkeypatch.setattr(fine, "_kernel_fns", lambda: with_hook)

    torch.manual_seed(0)
    grid = vidsparse.VideoGrid((9, 14, 22))  # 72 tiles, partial along every axis
    B, H, D = 2, 4, 128
    q, k, v, gate, do = (torch.randn(B, H, grid.num_tokens, D, device="cuda",
                                     dtype=torch.bfloat16) for _ in range(5))  # fmt: skip
    calls = []
    real = bwd_sm90.dq_gluon
    monkeypatch.setattr(bwd_sm90, "dq_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    row = configs.lookup(target_of(q.device), "bwd_dq", 64, 64, D, masked=True)

    def grads(gluon: bool):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gate)]
        # Tile-order copies (grad_rows=False): gradients stored through row maps never take
        # the Gluon kernels, whose TMA stores write whole blocks.
        with configs.override(bwd_dq=replace(row, gluon=gluon, use_tma=True), grad_rows=False):
            o = vidsparse.video_sparse_attn(*leaves[:3], grid, topk=9, gate=leaves[3])
            return torch.autograd.grad(o, leaves, do)

    triton = grads(False)
    assert not calls
    gluon = grads(True)
    assert len(calls) == 1, "VSA's backward did not take the Gluon dQ kernel"
    for name, a, b in zip(("dq", "dk", "dv", "dgate"), gluon, triton):
        assert not torch.isnan(a).any(), name
        assert rel_l2(a, b) < 1e-3, (name, rel_l2(a, b))
