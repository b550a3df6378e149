"""Hostile input to the engine (issue 22): refused before any launch, the same class and message
on every backend, or a correct result where the input is legal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import vidsparse
from helpers import (
    BACKENDS,
    forbid_calls,
    lists_without_bad_entries,
    make_qkv,
    masked_dense_attention,
)
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.ops.block_sparse_attn import fwd as fwd_module
from vidsparse.ops.block_sparse_attn import interface


@pytest.fixture
def no_launch(monkeypatch):
    """Any forward on either backend fails the test: the error must come first."""
    forbid_calls(monkeypatch, interface, "block_sparse_attn_ref")
    forbid_calls(monkeypatch, fwd_module, "block_sparse_attn_fwd")


def _args(S=64, D=16, bs=16, H=2):
    q, k, v = make_qkv(1, H, S, S, D, dtype=torch.float32, device="cpu")
    idx, cnt = random_block_lists(1, H, S // bs, S // bs, density=0.5)
    return q, k, v, idx, cnt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0, -1.0])
def test_bad_scale_refused_before_any_launch(request, no_launch, backend, scale):
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        vidsparse.block_sparse_attn(*_args(), block_size=16, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flag", ["no", 1, None])
def test_return_lse_must_be_a_bool(request, no_launch, backend, flag):
    request.getfixturevalue(backend)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        vidsparse.block_sparse_attn(*_args(), block_size=16, return_lse=flag)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_head_dim_names_head_dim(request, no_launch, backend):
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match=r"head_dim .* must be positive"):
        vidsparse.block_sparse_attn(*_args(D=0), block_size=16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [48, (48, 16), (16, 48)])
def test_block_sizes_not_powers_of_two_refused_on_every_backend(request, no_launch, backend,
                                                                 block):  # fmt: skip
    """``tl.arange`` takes powers of two only: refused before the launch, naming block_size
    (it was an ``InterpreterError`` from inside the kernel), on the torch path too (which
    accepted 48)."""
    request.getfixturevalue(backend)
    block_q, block_kv = (block, block) if isinstance(block, int) else block
    q, k, v = make_qkv(1, 2, 96, 96, 16, dtype=torch.float32, device="cpu")
    idx, cnt = random_block_lists(1, 2, 96 // block_q, 96 // block_kv, density=0.5)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=block)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lists_of_width_zero_attend_to_nothing(request, backend):
    """Lists ``[.., NQ, 0]``: every row is empty, so o = 0, lse = -inf, zero gradients."""
    request.getfixturevalue(backend)
    q, k, v = make_qkv(1, 2, 64, 64, 16, dtype=torch.float32, device="cpu", requires_grad=True)
    idx = torch.zeros(1, 2, 4, 0, dtype=torch.int32)
    cnt = torch.zeros(1, 2, 4, dtype=torch.int32)
    o, lse = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, return_lse=True)
    assert o.shape == q.shape and (o == 0).all()
    assert lse.dtype == torch.float32 and torch.isneginf(lse).all()
    for name, g in zip("qkv", torch.autograd.grad(o.sum(), (q, k, v))):
        assert g.shape == q.shape and (g == 0).all(), name


# ----------------------------------------------------------------------------- zero-size dims


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dim", ["B", "H", "Sq"])
def test_empty_problems_give_empty_results(request, backend, dim):
    """B, H or Sq of 0: an empty ``o`` and ``lse`` and empty gradients on every backend (they
    were "batch must be positive" errors, unlike VSA which returned the empty result)."""
    request.getfixturevalue(backend)
    B, H, Sq = {"B": (0, 2, 64), "H": (1, 0, 64), "Sq": (1, 2, 0)}[dim]
    q = torch.randn(B, H, Sq, 64, requires_grad=True)
    k = torch.randn(B, H, 64, 64, requires_grad=True)
    v = torch.randn(B, H, 64, 64, requires_grad=True)
    idx = torch.zeros(max(B, 1) if dim != "B" else 1, H, Sq // 16, 2, dtype=torch.int32)
    cnt = torch.ones(idx.shape[:3], dtype=torch.int32)
    o, lse = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, return_lse=True)
    assert o.shape == q.shape and lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    assert [tuple(g.shape) for g in grads] == [tuple(x.shape) for x in (q, k, v)]
    assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_key_blocks_with_empty_rows_attends_to_nothing(request, backend):
    """Skv = 0: legal when every row is empty (o = 0, lse = -inf, as any empty row), the same
    on every backend; a row that lists a block is refused, naming kv_indices."""
    request.getfixturevalue(backend)
    q = torch.randn(1, 2, 32, 64, requires_grad=True)
    k = torch.randn(1, 2, 0, 64, requires_grad=True)
    v = torch.randn(1, 2, 0, 64, requires_grad=True)
    idx = torch.zeros(1, 2, 2, 1, dtype=torch.int32)
    cnt = torch.zeros(1, 2, 2, dtype=torch.int32)
    o, lse = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, return_lse=True)
    assert (o == 0).all() and torch.isneginf(lse).all()
    dq, dk, dv = torch.autograd.grad(o.sum(), (q, k, v))
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape
    with pytest.raises(ValueError, match=r"kv_indices must lie in \[0, num_kv_blocks=0\)"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt + 1, block_size=16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_must_be_a_bool(request, no_launch, backend):
    request.getfixturevalue(backend)
    with pytest.raises(TypeError, match="validate must be a bool"):
        vidsparse.block_sparse_attn(*_args(), block_size=16, validate="yes")


# ----------------------------------------------------------------------------- lists changed
# behind the validation cache's back (issue 22): never a fault, validate=True sees it


def _mutated_behind_the_cache(kv_block_sizes=None):
    """A first call validates (and caches) the lists, then writes through ``.numpy()`` (no
    version bump) put entries out of range and a count past K."""
    q, k, v = make_qkv(1, 2, 64, 64, 16, dtype=torch.float32, device="cpu", requires_grad=True)
    idx, cnt = random_block_lists(1, 2, 4, 4, count=3, generator=torch.Generator().manual_seed(1))
    vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, kv_block_sizes=kv_block_sizes)
    version = idx._version
    idx.numpy()[0, 0, 0, 0] = 10**6
    idx.numpy()[0, 1, 2, 1] = -5
    cnt.numpy()[0, 1, 3] = 99
    assert idx._version == version  # the cache cannot see it
    return q, k, v, idx, cnt


@pytest.mark.parametrize("backend", BACKENDS)
def test_lists_mutated_behind_the_cache_are_safe_and_skip_bad_entries(request, backend):
    """The interpreter died with SIGSEGV, the torch path raised IndexError from inside the
    reference: now an entry out of range contributes nothing and counts clamp to K, on
    every backend (forward and backward), and ``validate=True`` refuses the lists."""
    request.getfixturevalue(backend)
    q, k, v, idx, cnt = _mutated_behind_the_cache()
    o, lse = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, return_lse=True)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    clean_idx, clean_cnt = lists_without_bad_entries(idx, cnt, 4)
    ref, ref_lse = masked_dense_attention(q, k, v, clean_idx, clean_cnt, 16, 16)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r.float(), rtol=1e-4, atol=1e-4, msg=f"d{name}")
    with pytest.raises(ValueError, match=r"kv_counts must lie in \[0, K=3\]"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, validate=True)


def test_lists_mutated_behind_the_cache_with_key_block_sizes_never_fault(triton_backend):
    """With key-block sizes the kernels read lists reordered from the first call's (cached,
    valid) values: a stale but safe result, finite; ``validate=True`` drops that cache too."""
    sizes = torch.tensor([16, 16, 9, 16], dtype=torch.int32)
    q, k, v, idx, cnt = _mutated_behind_the_cache(sizes)
    o = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, kv_block_sizes=sizes)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)
    cnt.numpy()[0, 1, 3] = 3
    with pytest.raises(ValueError, match=r"kv_indices must lie in \[0, num_kv_blocks=4\)"):
        vidsparse.block_sparse_attn(
            q, k, v, idx, cnt, block_size=16, kv_block_sizes=sizes, validate=True
        )


_SEGFAULT_REPRODUCER = """
import os, torch, vidsparse
from vidsparse.masks.block_sparse import random_block_lists
q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
idx, cnt = random_block_lists(1, 2, 4, 4, count=2)
vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)
idx.numpy()[0, 0, 0, 0] = 10**6
idx.numpy()[0, 1, 3, 0] = -(2**31)
cnt.numpy()[0, 0, 1] = 2**31 - 1
o = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)
assert torch.isfinite(o).all()
print("ok")
"""


@pytest.mark.interpreter
def test_issue_reproducer_no_longer_kills_the_interpreter():
    """The issue's reproducer, in its own process (a fault there must fail this test, not end
    the test run): entries of 10**6 and -2**31 and a count of 2**31 - 1 after a first call."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "VIDSPARSE_BACKEND": "triton"}
    proc = subprocess.run([sys.executable, "-c", _SEGFAULT_REPRODUCER], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.parametrize("how", ["data", "set_"])
def test_cache_sees_a_new_data_pointer(torch_backend, how):
    """``idx.data = other`` or ``idx.set_(other)`` replaces the storage: the cached verdict no
    longer applies and the bad values are refused."""
    q, k, v, idx, cnt = _args()
    vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)
    bad = idx.clone()
    bad[0, 0, 0, 0] = 99
    if how == "data":
        idx.data = bad
    else:
        with torch.no_grad():
            idx.set_(bad.untyped_storage(), bad.storage_offset(), bad.shape, bad.stride())
    with pytest.raises(ValueError, match="kv_indices must lie in"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)


@pytest.mark.interpreter
@pytest.mark.parametrize("padded", [False, True])
def test_kernels_give_out_of_range_entries_no_weight(triton_backend, padded):
    """The Triton kernels on lists that no check saw (the internal entry): entries of 10**6,
    -1 and a count past K, with and without key-block sizes (the full-blocks-first reorder and
    the masked walk): the result of the lists without those entries, forward and backward."""
    from vidsparse.ops.block_sparse_attn import block_sparse_attn_unchecked

    q, k, v = make_qkv(1, 2, 64, 80, 16, dtype=torch.float32, device="cpu", requires_grad=True)
    idx, cnt = random_block_lists(1, 2, 4, 5, count=3, generator=torch.Generator().manual_seed(2))
    idx[0, 0, 1, 0], idx[0, 1, 0, 2], cnt[0, 1, 2] = 10**6, -1, 2**31 - 1
    sizes = torch.tensor([16, 5, 16, 0, 16], dtype=torch.int32) if padded else None
    o, lse = block_sparse_attn_unchecked(q, k, v, idx, cnt, block_q=16, block_kv=16,
                                         kv_block_sizes=sizes, scale=0.25)  # fmt: skip
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    clean_idx, clean_cnt = lists_without_bad_entries(idx, cnt, 5)
    ref, ref_lse = masked_dense_attention(q, k, v, clean_idx, clean_cnt, 16, 16, sizes, 0.25)
    torch.testing.assert_close(o, ref.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-4, atol=1e-5)
    for name, g, r in zip("qkv", grads, torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(g, r.float(), rtol=1e-4, atol=1e-4, msg=f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, block, with_sizes",
    [(torch.bfloat16, 128, False), (torch.float32, 64, False), (torch.bfloat16, 128, True)],
    ids=["gluon-or-tma-fwd", "pointer-fwd", "key-block-sizes"],
)
def test_lists_mutated_through_data_1000_runs_never_fault_on_gpu(dtype, block, with_sizes):
    """Issue 22 on the GPU: lists validated once, then spoiled 1,000 times through ``.data``
    (no version bump: the cache cannot see it) with entries anywhere in int32 and counts past
    K, run forward (and backward every tenth call): no CUDA error, and the same process then
    computes the correct result of the repaired lists."""
    heads, seq = 4, 4096
    nk = seq // block
    q, k, v = make_qkv(1, heads, seq, seq, 128, dtype=dtype, device="cuda", requires_grad=True)
    gen = torch.Generator(device="cuda").manual_seed(22)
    good_idx, good_cnt = random_block_lists(1, heads, nk, nk, count=nk // 4, generator=gen,
                                            device="cuda")  # fmt: skip
    idx, cnt = good_idx.clone(), good_cnt.clone()
    sizes = None
    if with_sizes:
        sizes = torch.full((nk,), block, dtype=torch.int32, device="cuda")
        sizes[-1] = block // 3
    call = dict(block_size=block, kv_block_sizes=sizes)
    vidsparse.block_sparse_attn(q, k, v, idx, cnt, **call)  # validated and cached here
    version = (idx._version, cnt._version)
    for run in range(1000):
        wild = torch.randint(-(2**31), 2**31 - 1, idx.shape, device="cuda", dtype=torch.int32,
                             generator=gen)  # fmt: skip
        spoil = torch.rand(idx.shape, device="cuda", generator=gen) < 0.1
        idx.data.copy_(torch.where(spoil, wild, good_idx))
        past_k = torch.rand(cnt.shape, device="cuda", generator=gen) < 0.1
        cnt.data.copy_(torch.where(past_k, 2**31 - 1, good_cnt))
        o = vidsparse.block_sparse_attn(q, k, v, idx, cnt, **call)
        if run % 10 == 0:
            o.float().sum().backward()
    torch.cuda.synchronize()  # an illegal access would raise here at the latest
    assert (idx._version, cnt._version) == version  # the cache never saw a change

    idx.data.copy_(good_idx)
    cnt.data.copy_(good_cnt)
    q.grad = k.grad = v.grad = None
    o = vidsparse.block_sparse_attn(q, k, v, idx, cnt, validate=True, **call)
    o.float().square().sum().backward()
    ref, _ = masked_dense_attention(q, k, v, good_idx, good_cnt, block, block, sizes)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-4
    err = (o.double() - ref).norm() / ref.norm()
    assert err <= tol, float(err)
    for name, grad, want in zip("qkv", (q.grad, k.grad, v.grad), ref_grads):
        err = (grad.double() - want).norm() / want.norm()
        assert err <= tol, f"d{name}: {float(err)}"


def test_an_unknown_one_pass_mode_is_refused_before_any_launch():
    """``configs.override(one_pass=...)`` takes a mode of ``configs.ONE_PASS_MODES`` or None,
    whatever the caller's ``deterministic``."""
    from vidsparse.ops.block_sparse_attn import bwd, configs
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE

    for deterministic in (True, False):
        with configs.override(one_pass="sorted"), pytest.raises(ValueError, match="one_pass"):
            bwd._one_pass_mode(deterministic, True, 128, NO_EPILOGUE, None)
