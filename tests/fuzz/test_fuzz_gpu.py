"""The fuzz harness's properties on a GPU at real sizes: the compiled kernels (Hopper's Gluon
and TMA forwards included) against the fp64 references, and lists no check saw. Marked ``gpu``
(skipped without one); the profiles of ``fuzzing.py`` set the case counts here too."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from fuzzing import block_lists, check_against_dense, count_case, examples, generator
from hypothesis import given
from hypothesis import strategies as st

import vidsparse
from helpers import lists_without_bad_entries, masked_dense_attention
from vidsparse.layout.grid import VideoGrid
from vidsparse.ops.block_sparse_attn import block_sparse_attn_unchecked
from vidsparse.ops.video_sparse_attn import coarse
from vidsparse.ops.video_sparse_attn.reference import video_sparse_attn_ref
from vidsparse.utils.checks import softmax_scale

pytestmark = pytest.mark.gpu

# The engine's block shapes and head dims of the models (docs: FACTS), 16-bit and fp32 inputs.
BLOCKS = [(128, 128), (128, 64), (64, 64)]
GRAD_TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@st.composite
def gpu_problems(draw, *, hostile: bool = False):
    """(q, k, v, kv_indices, kv_counts, block_q, block_kv, kv_block_sizes, scale) on the GPU,
    up to 4,096 queries and keys per head. ``hostile``: entries out of range and counts past
    K in some rows (what a write behind the validation's back leaves)."""
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    d = draw(st.sampled_from([64, 128]))
    bq, bk = draw(st.sampled_from(BLOCKS))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    nq, nk = draw(st.integers(1, 4096 // bq)), draw(st.integers(1, 4096 // bk))
    bi = draw(st.sampled_from([1, b]))
    idx, cnt = draw(block_lists(bi, h, nq, nk, max_k=64))
    g = generator(draw(st.integers(0, 2**31 - 1)))
    if hostile and idx.shape[-1]:
        spoiled = torch.rand(idx.shape, generator=g) < 0.2
        wild = torch.randint(-(2**31), 2**31 - 1, idx.shape, generator=g, dtype=torch.int32)
        idx = torch.where(spoiled, wild, idx)
        cnt = torch.where(torch.rand(cnt.shape, generator=g) < 0.2, 2**31 - 1, cnt)
    scale = draw(st.sampled_from([None, 0.05, 0.3]))
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for n in (nq * bq, nk * bk, nk * bk))
    sizes = None
    if draw(st.booleans()):
        sizes = torch.randint(0, bk + 1, (nk,), generator=g, dtype=torch.int32)
        sizes[torch.rand(nk, generator=g) < 0.7] = bk  # mostly full blocks, as in the models
    cuda = [None if x is None else x.cuda() for x in (q, k, v, idx, cnt, sizes)]
    q, k, v, idx, cnt, sizes = cuda
    return q, k, v, idx, cnt, bq, bk, sizes, scale


@examples(16, shrink=False)  # each case compiles kernels: no shrinking
@given(gpu_problems(), st.booleans())
def test_engine_matches_dense_fp64(problem, backward):
    count_case()
    q, k, v, idx, cnt, bq, bk, sizes, scale = problem
    q, k, v = (x.requires_grad_(backward) for x in (q, k, v))
    out, lse = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(bq, bk),
                                           kv_block_sizes=sizes, scale=scale,
                                           return_lse=True)  # fmt: skip
    if backward:
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    plain = [x.detach() for x in (q, k, v)]
    check_against_dense(out.detach(), lse, *plain, idx, cnt, bq, bk, sizes, scale)
    if not backward:
        return
    ref, _ = masked_dense_attention(q, k, v, idx, cnt, bq, bk, sizes, scale)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for name, grad, want in zip("qkv", grads, ref_grads):
        err = (grad.double() - want).norm() / want.norm().clamp_min(1e-30)
        assert want.norm() == 0 or err <= GRAD_TOL[q.dtype], f"d{name}: {float(err)}"


def _gluon_takes(q, k, v, bq, bk) -> bool:
    from vidsparse.ops.block_sparse_attn.fwd import gluon_fits

    return torch.cuda.get_device_capability(q.device)[0] == 9 and gluon_fits(q, k, v, bq, bk)


@examples(12, shrink=False)  # each case compiles kernels: no shrinking
@given(gpu_problems(hostile=True))
def test_lists_no_check_saw_never_fault(problem):
    """Through the unchecked entry (as after a write behind the validation's back): no CUDA
    error, and every kernel but the Gluon forward without key-block sizes (which reads a
    clamped block instead, documented) gives an entry out of range no weight."""
    count_case()
    q, k, v, idx, cnt, bq, bk, sizes, scale = problem
    scale = softmax_scale(scale, q.shape[-1])
    out, lse = block_sparse_attn_unchecked(q, k, v, idx, cnt, block_q=bq, block_kv=bk,
                                           kv_block_sizes=sizes, scale=scale)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    if sizes is None and _gluon_takes(q, k, v, bq, bk):
        return
    clean_idx, clean_cnt = lists_without_bad_entries(idx, cnt, k.shape[2] // bk)
    check_against_dense(out, lse, q, k, v, clean_idx, clean_cnt, bq, bk, sizes, scale)


@st.composite
def vsa_gpu_problems(draw):
    """Video grids of the models' tile (4, 4, 4), up to 6,144 tokens, fp32."""
    grid = VideoGrid(
        (draw(st.integers(1, 6)), draw(st.integers(1, 32)), draw(st.integers(1, 32))), (4, 4, 4)
    )
    d = draw(st.sampled_from([64, 128]))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    topk = draw(st.integers(1, grid.num_tiles + 2))
    g = generator(draw(st.integers(0, 2**31 - 1)))
    q, k, v = (torch.randn(b, h, grid.num_tokens, d, generator=g).cuda() for _ in range(3))
    gate = torch.rand(b, h, grid.num_tokens, d, generator=g).cuda() if draw(st.booleans()) else None
    return grid, q, k, v, topk, gate


@contextlib.contextmanager
def _ieee_coarse_dots():
    """The coarse stage's dots in full fp32 (its configs take TF32 on NVIDIA: fine for picking
    tiles, but then a score gap within TF32 noise may pick another tile than fp64 does, and
    the coarse output differs by ~1e-4)."""
    pick = coarse.coarse_attn_config

    def ieee(*args, **kwargs):
        return dataclasses.replace(pick(*args, **kwargs), input_precision="ieee")

    with mock.patch.object(coarse, "coarse_attn_config", ieee):
        yield


@examples(10, shrink=False)  # each case compiles kernels: no shrinking
@given(vsa_gpu_problems())
def test_vsa_matches_fp64_reference(problem):
    count_case()
    grid, q, k, v, topk, gate = problem
    with _ieee_coarse_dots():
        out = vidsparse.video_sparse_attn(q, k, v, grid, topk=topk, gate=gate)
    ref = video_sparse_attn_ref(q.double(), k.double(), v.double(), grid,
                                topk=min(topk, grid.num_tiles),
                                gate=None if gate is None else gate.double(),
                                scale=q.shape[-1] ** -0.5)  # fmt: skip
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err <= 1e-4, float(err)
