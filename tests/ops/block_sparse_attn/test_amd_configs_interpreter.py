"""The engine with AMD's configs (``configs.AMD_CDNA``: launch options, per-pass stages, query
steps, eviction hints) in the Triton interpreter, against the reference: CPU CI runs the code
paths an MI300 / MI350 takes. The rows are forced with ``configs.override`` (the interpreter
runs on CPU tensors, whose target is the interpreter's); each launch is spied on to check that
the AMD hints reached the kernels. fp32, so the tolerances are those of the IEEE-exact dots.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import vidsparse  # noqa: E402
from helpers import make_lists, make_qkv, masked_dense_attention  # noqa: E402
from vidsparse.ops.block_sparse_attn import block_sparse_attn_ref, bwd, configs, fwd  # noqa: E402
from vidsparse.testing import assert_error_relative  # noqa: E402
from vidsparse.utils.device import Target  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI"),
]

KERNELS = {  # the table's kernel -> its jit function's name
    "fwd": "block_sparse_attn_fwd_kernel",
    "bwd_dkdv": "block_sparse_attn_bwd_dkdv_kernel",
    "bwd_dq": "block_sparse_attn_bwd_dq_kernel",
}
CASES = [
    # arch, (block_q, block_kv), head_dim, key-block sizes: the AMD rows of each kernel
    ("gfx942", (64, 64), 32, False),  # ("fwd", 64, ...), 64-row backward steps
    ("gfx950", (64, 64), 64, True),
    ("gfx942", (128, 64), 32, True),  # ("fwd", 128, ...): 8 warps
    ("gfx950", (128, 128), 128, True),  # ("fwd", 128, 128, 128); dK/dV in 32-row steps
]


def _amd_configs(arch, bq, bk, head_dim, masked):
    """The AMD table's row of each kernel, as ``lookup`` picks it (with its step fitted)."""
    target = Target("hip", arch)
    return {k: configs._table_lookup(target, k, bq, bk, head_dim, masked) for k in KERNELS}


class _Spy:
    """Wraps a jit kernel: launches run, their keyword arguments are kept."""

    def __init__(self, kernel, sink):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.kernel.__name__, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _spy_on_launches(monkeypatch):
    sink = []
    for module, name in ((fwd, "block_sparse_attn_fwd_kernel"),
                         (bwd, "block_sparse_attn_bwd_dkdv_kernel"),
                         (bwd, "block_sparse_attn_bwd_dq_kernel"),
                         (bwd, "block_sparse_attn_bwd_fused_kernel")):  # fmt: skip
        monkeypatch.setattr(module, name, _Spy(getattr(module, name), sink))
    return sink


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, block, head_dim, padded", CASES,
    ids=[f"{a}-{b[0]}x{b[1]}-D{d}-{'sizes' if p else 'full'}" for a, b, d, p in CASES],
)  # fmt: skip
def test_amd_configs_match_reference(triton_backend, monkeypatch, arch, block, head_dim, padded):
    bq, bk = block
    B, H, Sq, Skv = 1, 2, 4 * 128, 3 * 128
    cfgs = _amd_configs(arch, bq, bk, head_dim, padded)
    assert all(cfg.evict_streamed == "evict_first" for cfg in cfgs.values()), cfgs
    q, k, v = make_qkv(B, H, Sq, Skv, head_dim, dtype=torch.float32, device="cpu",
                       requires_grad=True)  # fmt: skip
    idx, cnt = make_lists(1, H, Sq // bq, Skv // bk, density=0.5, device="cpu", empty_rows=1)
    sizes = None
    if padded:
        sizes = torch.randint(0, bk + 1, (Skv // bk,), dtype=torch.int32)
        sizes[0] = bk
    do = torch.randn(B, H, Sq, head_dim)
    launches = _spy_on_launches(monkeypatch)
    with configs.override(**cfgs):
        o = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=block, kv_block_sizes=sizes)
        grads = torch.autograd.grad(o, (q, k, v), do)

    # The hints reached the kernels, and the AMD backward's two launches ran (no fused one).
    kwargs = dict(launches)
    assert sorted(kwargs) == sorted(KERNELS.values()), list(kwargs)
    for kernel, name in KERNELS.items():
        cfg = cfgs[kernel]
        assert kwargs[name]["EVICT_STREAMED"] == cfg.evict_streamed, name
        assert kwargs[name]["EVICT_RESIDENT"] == cfg.evict_resident, name
        assert kwargs[name]["num_warps"] == cfg.num_warps, name

    # fp64 dense reference; PyTorch's own fp32 reference as the yardstick of rounding error.
    ref_o, _ = masked_dense_attention(q, k, v, idx, cnt, bq, bk, sizes)
    low_o, _ = block_sparse_attn_ref(q, k, v, idx, cnt, block_q=bq, block_kv=bk,
                                     kv_block_sizes=sizes)  # fmt: skip
    assert_error_relative("o", o, ref_o, low_o, atol=1e-4)
    ref_grads = torch.autograd.grad(ref_o, (q, k, v), do.double())
    low_grads = torch.autograd.grad(low_o, (q, k, v), do)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_error_relative(name, g, r, lo, atol=1e-4)
