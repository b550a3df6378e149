"""The Gluon dK/dV and dQ kernels (Hopper, ``ops/block_sparse_attn/kernels/bwd_sm90.py``):
called directly (``bwd_sm90.dkdv_gluon`` at both block sizes and ``bwd_sm90.dq_gluon`` at
128x128, with the preprocess's ``delta`` / ``lse2`` and the lists the Triton backward uses),
and through the engine's backward, which takes both at 128x128 (``configs.py``). On a GPU
only (their sm_90 compile check is ``tests/compile/test_compile_bwd_sm90.py``; which kernels
a Hopper launches is checked on the CPU by ``test_target_paths.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_block_sparse_attn import _lowprec_baseline  # same folder

from helpers import make_lists, make_qkv, masked_dense_attention
from vidsparse.testing import assert_error_relative


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _hopper(), reason="the Gluon dK/dV kernel is Hopper's"),
]

D = 128


def _problem(bs, dtype, padded, *, B=2, H=3, nq=7, nk=9, density=0.5, seed=0, scale=1.0):
    """Sq != Skv (an odd number of key blocks: the 64-row kernel's last program has one),
    lists broadcast over the batch with an empty row and a one-block row; with key-block sizes,
    blocks of every size whose padding keys hold large finite values (read by TMA, masked)."""
    torch.manual_seed(seed)
    Sq, Skv = nq * bs, nk * bs
    q, k, v = make_qkv(B, H, Sq, Skv, D, dtype=dtype, device="cuda", scale=scale)
    do = torch.randn_like(q)
    idx, cnt = make_lists(1, H, nq, nk, density=density, device="cuda", empty_rows=1)
    sizes = None
    if padded:
        pattern = [bs, 37, bs, 0, 1, bs, 32, bs, bs - 1] * (nk // 9 + 1)
        sizes = torch.tensor(pattern[:nk], dtype=torch.int32, device="cuda")
        pad = (torch.arange(Skv, device="cuda") % bs) >= sizes.long().repeat_interleave(bs)
        k[:, :, pad] = 300.0
        v[:, :, pad] = -300.0
    return q, k, v, do, idx, cnt, sizes


def _gluon_and_triton(q, k, v, do, idx, cnt, sizes, bs):
    """``(dk, dv)`` of the Gluon kernel and ``(dk, dv)`` of the Triton backward, from the same
    forward, preprocess and transposed lists."""
    from vidsparse.ops.block_sparse_attn import bwd, bwd_sm90, fwd
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE
    from vidsparse.ops.block_sparse_attn.lists import cached_transpose

    scale = D**-0.5
    o, lse = fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, scale,
                                       padding_finite=True)  # fmt: skip
    delta, lse2, _, _ = bwd._preprocess(do, o, lse, bs, NO_EPILOGUE.fns(), ())
    q_offsets, q_indices = cached_transpose(idx, cnt, k.shape[2] // bs)

    def gluon(**kwargs):
        return bwd_sm90.dkdv_gluon(q, k, v, do, lse2, delta, q_offsets, q_indices, bs, scale,
                                   kv_block_sizes=sizes, **kwargs)  # fmt: skip

    _, dk_t, dv_t = bwd.block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, sizes, bs, bs,
                                              scale, padding_finite=True)  # fmt: skip
    return gluon, (dk_t, dv_t)


def _reference_grads(q, k, v, do, idx, cnt, sizes, bs):
    """``(dk, dv)`` in fp64 (autograd through ``masked_dense_attention``) and in q's low
    precision (autograd through the PyTorch baseline), padding keys' rows zeroed in both."""
    k64 = k.detach().double().requires_grad_()
    v64 = v.detach().double().requires_grad_()
    o_ref, _ = masked_dense_attention(q.double(), k64, v64, idx, cnt, bs, bs, sizes)
    dk64, dv64 = torch.autograd.grad(o_ref, (k64, v64), do.double())
    k_low = k.detach().clone().requires_grad_()
    v_low = v.detach().clone().requires_grad_()
    o_low = _lowprec_baseline(q, k_low, v_low, idx, cnt, bs, bs, sizes)
    dk_low, dv_low = torch.autograd.grad(o_low, (k_low, v_low), do)
    return (dk64, dv64), (dk_low, dv_low)


def _padding_rows(k, sizes, bs):
    if sizes is None:
        return torch.zeros(k.shape[2], dtype=torch.bool, device=k.device)
    return (torch.arange(k.shape[2], device=k.device) % bs) >= sizes.long().repeat_interleave(bs)


def _check_dq(dq, q, k, v, do, idx, cnt, sizes, bs, other, other_name):
    """dq: no NaN, 0 on the empty query rows, and against fp64 as close as PyTorch in low
    precision and as ``other`` (another kernel's dq) are."""
    assert not torch.isnan(dq).any()
    empty = (cnt.expand(q.shape[0], -1, -1) == 0).repeat_interleave(bs, dim=2)  # [B, H, Sq]
    assert empty.any() and (dq[empty] == 0).all()
    q64 = q.detach().double().requires_grad_()
    o_ref, _ = masked_dense_attention(q64, k.double(), v.double(), idx, cnt, bs, bs, sizes)
    (dq64,) = torch.autograd.grad(o_ref, (q64,), do.double())
    q_low = q.detach().clone().requires_grad_()
    (dq_low,) = torch.autograd.grad(_lowprec_baseline(q_low, k, v, idx, cnt, bs, bs, sizes),
                                    (q_low,), do)  # fmt: skip
    assert_error_relative("dq", dq, dq64, dq_low, atol=2e-3)
    assert_error_relative(f"dq (vs {other_name})", dq, dq64, other, atol=2e-3)


@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("bs", [128, 64])
def test_gpu_gluon_dkdv_matches_reference_and_triton(dtype, padded, bs, scale):
    """Partial key blocks (``padded``) and input scales 1, 4 and 16 (sharp softmax rows)."""
    q, k, v, do, idx, cnt, sizes = _problem(bs, dtype, padded, scale=scale)
    gluon, (dk_t, dv_t) = _gluon_and_triton(q, k, v, do, idx, cnt, sizes, bs)
    dk, dv = gluon()
    (dk64, dv64), (dk_low, dv_low) = _reference_grads(q, k, v, do, idx, cnt, sizes, bs)
    pad = _padding_rows(k, sizes, bs)
    for name, got, ref, low, tri in (
        ("dk", dk, dk64, dk_low, dk_t),
        ("dv", dv, dv64, dv_low, dv_t),
    ):
        assert (got[:, :, pad] == 0).all(), f"{name}: padding keys got a gradient"
        real = ~pad
        got, ref, low, tri = (x[:, :, real] for x in (got, ref, low, tri))
        assert_error_relative(name, got, ref, low, atol=2e-3)  # vs PyTorch in low precision
        assert_error_relative(f"{name} (vs Triton)", got, ref, tri, atol=2e-3)


@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("bs", [128, 64])
def test_gpu_gluon_dq_matches_reference_and_triton(dtype, padded, bs, scale):
    """dQ: Sq != Skv (an odd number of query blocks: the 64-row kernel's last program has
    one), lists broadcast over the batch with an empty row (dQ = 0 there) and a one-block row,
    partial key blocks whose padding holds large finite values (``padded``), input scales 1,
    4 and 16; the output poisoned beforehand."""
    from vidsparse.ops.block_sparse_attn import bwd, bwd_sm90, fwd
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE

    q, k, v, do, idx, cnt, sizes = _problem(bs, dtype, padded, scale=scale, seed=5)
    sc = D**-0.5
    o, lse = fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, sc, padding_finite=True)
    delta, lse2, _, _ = bwd._preprocess(do, o, lse, bs, NO_EPILOGUE.fns(), ())
    dq_t, _, _ = bwd.block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, sizes, bs, bs, sc,
                                           padding_finite=True)  # fmt: skip
    torch.full_like(q, float("nan"))  # freed: the launcher's torch.empty_like may reuse it
    dq = bwd_sm90.dq_gluon(q, k, v, do, lse2, delta, idx, cnt, bs, sc, kv_block_sizes=sizes)
    _check_dq(dq, q, k, v, do, idx, cnt, sizes, bs, dq_t, "Triton")


@pytest.mark.parametrize("bs", [128, 64])
def test_gpu_gluon_dkdv_bit_identical_and_unlisted_blocks_zero(bs):
    """Two runs give the same bits (no atomics); a key block no query block lists gets
    dK = dV = 0 (its program's list is empty but it still stores)."""
    q, k, v, do, idx, cnt, sizes = _problem(bs, torch.bfloat16, True, density=0.3, seed=1)
    idx = torch.where(idx == 2, 0, idx)  # key block 2: listed by nobody (0 may repeat: drop)
    idx = torch.sort(idx, dim=-1).values
    cnt = torch.minimum(cnt, torch.ones_like(cnt))  # keep each row's list duplicate-free
    gluon, _ = _gluon_and_triton(q, k, v, do, idx, cnt, sizes, bs)
    first, second = gluon(), gluon()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
        assert not torch.isnan(a).any()
    rows = slice(2 * bs, 3 * bs)
    assert (first[0][:, :, rows] == 0).all() and (first[1][:, :, rows] == 0).all()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # 54 key blocks: fewer than the SMs, one a program
        dict(B=1, H=1, nq=3, nk=2, density=0.9),  # two programs
        dict(B=2, H=12, nq=24, nk=40, density=0.2),  # 960 blocks: ~7 a program
        dict(B=3, H=16, nq=40, nk=48, density=0.125, scale=4.0),  # 2,304: ~17 a program
    ],
)
def test_gpu_persistent_dkdv_gives_the_one_block_kernels_bits(padded, shape):
    """The persistent dK/dV kernel (128 rows, ``persistent=True``) against one block a
    program: the same bits whether a program walks one key block or many (its ring position
    and K/V phases carried from block to block), with lists broadcast over the batch, an empty
    row, unlisted key blocks (dK = dV = 0) and key-block sizes."""
    q, k, v, do, idx, cnt, sizes = _problem(128, torch.bfloat16, padded, seed=21, **shape)
    gluon, _ = _gluon_and_triton(q, k, v, do, idx, cnt, sizes, 128)
    one_block = gluon(persistent=False)
    persistent = gluon(persistent=True)
    for name, a, b in zip(("dk", "dv"), persistent, one_block):
        assert not torch.isnan(a).any(), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("walk", ["banded", "longest_first"])
@pytest.mark.parametrize("programs", [1, 5])
def test_gpu_persistent_dkdv_with_few_programs(monkeypatch, programs, walk):
    """One program, or five, walking all 54 key blocks of the small problem (every K/V phase
    and ring position across many blocks, empty lists among them), in either walk: the same
    bits."""
    from vidsparse.ops.block_sparse_attn import bwd_sm90, configs

    monkeypatch.setattr(bwd_sm90, "num_sms", lambda device: programs)
    q, k, v, do, idx, cnt, sizes = _problem(128, torch.bfloat16, True, seed=23, density=0.3)
    gluon, _ = _gluon_and_triton(q, k, v, do, idx, cnt, sizes, 128)
    with configs.override(persistent_order=walk):
        persistent = gluon(persistent=True)
    for a, b in zip(persistent, gluon(persistent=False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("walk", ["banded", "longest_first"])
@pytest.mark.parametrize("programs", [None, 1, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_persistent_dq_gives_the_one_block_kernels_bits(monkeypatch, padded, programs, walk):
    """The persistent dQ kernel (128 rows, ``persistent=True``) against one block a program:
    the same bits with one program per SM (or per query block), and with one or five walking
    all 42 query blocks (Q's phases and ring positions carried over; an empty list and a
    one-block list among them), lists broadcast over the batch, key-block sizes, either walk."""
    from vidsparse.ops.block_sparse_attn import bwd, bwd_sm90, configs, fwd
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE

    if programs is not None:
        monkeypatch.setattr(bwd_sm90, "num_sms", lambda device: programs)
    q, k, v, do, idx, cnt, sizes = _problem(128, torch.bfloat16, padded, seed=24)
    scale = D**-0.5
    o, lse = fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, 128, 128, scale,
                                       padding_finite=True)  # fmt: skip
    delta, lse2, _, _ = bwd._preprocess(do, o, lse, 128, NO_EPILOGUE.fns(), ())

    def dq(persistent):
        return bwd_sm90.dq_gluon(q, k, v, do, lse2, delta, idx, cnt, 128, scale,
                                 kv_block_sizes=sizes, persistent=persistent)  # fmt: skip

    with configs.override(persistent_order=walk):
        persistent = dq(True)
    one_block = dq(False)
    assert not torch.isnan(persistent).any()
    assert torch.equal(persistent, one_block)


def test_gpu_engine_backward_takes_the_persistent_dkdv_kernel_where_asked(monkeypatch):
    """``configs.override(persistent_dkdv=True)`` (and ``persistent_dq``): the engine's
    two-kernel backward at 128x128 orders its key blocks (query blocks) for the persistent
    kernels, and its gradients are the one-block kernels' bits."""
    from vidsparse.ops.block_sparse_attn import bwd_sm90, configs

    q, k, v, do, idx, cnt, _ = _problem(128, torch.bfloat16, False, nq=16, nk=16, seed=22)
    orders = []
    for name in ("cached_dkdv_walk", "cached_dq_walk"):
        real = getattr(bwd_sm90, name)
        monkeypatch.setattr(bwd_sm90, name,
                            lambda *a, n=name, f=real: orders.append(n) or f(*a))  # fmt: skip
    off = configs.ONE_PASS_OFF  # the two kernels, which these replace
    with configs.override(one_pass=off):
        default = _engine_grads(q, k, v, do, idx, cnt, 128)
    assert not orders
    with configs.override(persistent_dkdv=True, one_pass=off):
        asked = _engine_grads(q, k, v, do, idx, cnt, 128)
    with configs.override(persistent_dkdv=True, persistent_dq=True, one_pass=off):
        both = _engine_grads(q, k, v, do, idx, cnt, 128)
    assert orders == ["cached_dkdv_walk", "cached_dkdv_walk", "cached_dq_walk"], orders
    for a, b, c in zip(asked, both, default):
        assert torch.equal(a, c) and torch.equal(b, c)


def _engine_grads(q, k, v, do, idx, cnt, bs, **kw):
    """``(dq, dk, dv)`` of the public op's backward (autograd); ``kw``: its other arguments."""
    import vidsparse

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = vidsparse.block_sparse_attn(*leaves, idx, cnt, block_size=bs, **kw)
    return torch.autograd.grad(o, leaves, do)


@pytest.fixture
def gluon_calls(monkeypatch):
    """The engine's calls of the Gluon backward launchers, by name."""
    from vidsparse.ops.block_sparse_attn import bwd_sm90

    calls = []

    def counted(name, real):
        return lambda *args, **kwargs: calls.append(name) or real(*args, **kwargs)

    for name in ("dkdv_gluon", "dq_gluon"):
        monkeypatch.setattr(bwd_sm90, name, counted(name, getattr(bwd_sm90, name)))
    one_pass = bwd_sm90.dkdvdq_gluon

    def counted_one_pass(*args, **kwargs):
        calls.append("dkdvdq_gluon" + (":fixed" if kwargs.get("dq_fix") is not None else ""))
        return one_pass(*args, **kwargs)

    monkeypatch.setattr(bwd_sm90, "dkdvdq_gluon", counted_one_pass)
    return calls


@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("one_pass", [None, "fixed"])
def test_gpu_engine_backward_takes_gluon_kernels_and_matches_reference(
    gluon_calls, dtype, scale, one_pass
):
    """The public op at 128x128, D=128: its backward runs in the Gluon kernels, by default dK/dV
    and dQ apart, with ``one_pass="fixed"`` the one pass with dQ in fixed point, and dq, dk,
    dv are within the error of PyTorch in the same low precision (fp64 reference)."""
    from vidsparse.ops.block_sparse_attn import configs

    bs = 128
    q, k, v, do, idx, cnt, _ = _problem(bs, dtype, False, scale=scale, seed=3)
    with configs.override(one_pass=one_pass):
        got = _engine_grads(q, k, v, do, idx, cnt, bs)
    expected = ["dkdvdq_gluon:fixed"] if one_pass else ["dkdv_gluon", "dq_gluon"]
    assert gluon_calls == expected, gluon_calls
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, _ = masked_dense_attention(*exact, idx, cnt, bs, bs)
    ref = torch.autograd.grad(o_ref, exact, do.double())
    low = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    base = torch.autograd.grad(_lowprec_baseline(*low, idx, cnt, bs, bs, None), low, do)
    for name, g, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert not torch.isnan(g).any(), name
        assert_error_relative(name, g, r, b, atol=2e-3)


@pytest.mark.parametrize("one_pass", [None, "fixed"])
def test_gpu_engine_backward_is_bit_identical_across_runs(gluon_calls, one_pass):
    """Deterministic by construction (the one pass's dQ adds integers; the two kernels use no
    atomics): two backward passes of the same inputs give the same bits, at the engine's timed
    block size."""
    from vidsparse.ops.block_sparse_attn import configs

    bs = 128
    q, k, v, do, idx, cnt, _ = _problem(bs, torch.bfloat16, False, nq=16, nk=16, seed=4)
    with configs.override(one_pass=one_pass):
        first = _engine_grads(q, k, v, do, idx, cnt, bs)
        second = _engine_grads(q, k, v, do, idx, cnt, bs)
    expected = ["dkdvdq_gluon:fixed"] if one_pass else ["dkdv_gluon", "dq_gluon"]
    assert gluon_calls == expected * 2
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _one_pass_case(dtype, padded, scale, seed):
    """``(problem, one_pass, (dk, dv, dq))``: a 128x128 problem (``_problem``),
    ``one_pass(**kw)`` calling ``dkdvdq_gluon`` on its forward's preprocess and transposed
    lists, and the dK/dV and dQ kernels' gradients from the same."""
    from vidsparse.ops.block_sparse_attn import bwd, bwd_sm90, fwd
    from vidsparse.ops.block_sparse_attn.epilogue import NO_EPILOGUE
    from vidsparse.ops.block_sparse_attn.lists import cached_transpose

    bs, sc = 128, D**-0.5
    problem = _problem(bs, dtype, padded, scale=scale, seed=seed)
    q, k, v, do, idx, cnt, sizes = problem
    o, lse = fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, sc, padding_finite=True)
    delta, lse2, _, dq_fix = bwd._preprocess(do, o, lse, bs, NO_EPILOGUE.fns(), (),
                                             dq_fixed_of=(k, v, sc, sizes, bs))  # fmt: skip
    q_offsets, q_indices = cached_transpose(idx, cnt, k.shape[2] // bs)
    lists = (lse2, delta, q_offsets, q_indices, bs, sc)

    def one_pass(fixed=False, **kw):  # fixed: in int32 fixed point, by TMA
        fix = dict(dq_fix=dq_fix, by_tma=True) if fixed else {}
        return bwd_sm90.dkdvdq_gluon(q, k, v, do, *lists, kv_block_sizes=sizes, **kw, **fix)

    dk, dv = bwd_sm90.dkdv_gluon(q, k, v, do, *lists, kv_block_sizes=sizes)
    dq = bwd_sm90.dq_gluon(q, k, v, do, lse2, delta, idx, cnt, bs, sc, kv_block_sizes=sizes)
    return problem, one_pass, (dk, dv, dq)


@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("by_tma", [False, True])
def test_gpu_one_pass_backward_matches_reference_and_both_kernels(dtype, padded, scale, by_tma):
    """``dkdvdq_gluon`` (dQ from the dK/dV walk, added by the consumers' atomics or, ``by_tma``,
    by TMA reductions): dK and dV the dK/dV kernel's bits; dQ against fp64, the low-precision
    baseline and the dQ kernel, 0 on the empty query row; partial key blocks with large finite
    padding (``padded``), input scales 1, 4 and 16."""
    problem, one_pass, (dk_2, dv_2, dq_2) = _one_pass_case(dtype, padded, scale, 11)
    q, k, v, do, idx, cnt, sizes = problem
    dk, dv, dq = one_pass(by_tma=by_tma)
    assert torch.equal(dk, dk_2) and torch.equal(dv, dv_2)
    _check_dq(dq, q, k, v, do, idx, cnt, sizes, 128, dq_2, "the dQ kernel")
    # adds in any order: another run differs in the fp32 sum's last bits only
    torch.testing.assert_close(one_pass(by_tma=by_tma)[2], dq, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_fixed_point_one_pass_is_bit_identical_and_as_accurate(dtype, padded, scale):
    """``dkdvdq_gluon(dq_fix=...)`` (dQ's adds as int32 fixed point, by TMA in any order): dq
    the same bits on three runs; against fp64 as close as PyTorch in low precision and as the
    dQ kernel, 0 on the empty query row; within 1e-3 of the fp32 adds' dq; dK, dV the dK/dV
    kernel's bits; partial key blocks with large finite padding (left out of the bounds),
    input scales 1, 4 and 16."""
    problem, one_pass, (dk_2, dv_2, dq_2) = _one_pass_case(dtype, padded, scale, 23)
    q, k, v, do, idx, cnt, sizes = problem
    runs = [one_pass(fixed=True) for _ in range(3)]
    dk, dv, dq = runs[0]
    assert torch.equal(dk, dk_2) and torch.equal(dv, dv_2)
    assert all(torch.equal(again[2], dq) for again in runs[1:])
    _check_dq(dq, q, k, v, do, idx, cnt, sizes, 128, dq_2, "the dQ kernel")
    torch.testing.assert_close(dq, one_pass(by_tma=True)[2], rtol=1e-2, atol=1e-3)


@pytest.mark.timeout(300, method="thread")  # a semaphore wait that never ends: fail, not hang
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("by_tma", [False, True])
def test_gpu_ordered_one_pass_backward_is_bit_identical_across_runs(padded, by_tma):
    """``dkdvdq_gluon(ordered_by=...)``: dQ's adds in key-block order (by the writer warp's
    atomics or, ``by_tma``, its TMA reductions), so dq is the same bits on every run (three;
    2 * 3 heads of 9 key blocks, lists with an empty row), and equal in value to the unordered
    kernel's; dK, dV the dK/dV kernel's bits."""
    problem, one_pass, (dk_2, dv_2, _) = _one_pass_case(torch.bfloat16, padded, 4.0, 13)
    idx, cnt = problem[4:6]
    dq_unordered = one_pass()[2]
    runs = [one_pass(ordered_by=(idx, cnt), by_tma=by_tma) for _ in range(3)]
    dk, dv, dq = runs[0]
    assert torch.equal(dk, dk_2) and torch.equal(dv, dv_2)
    assert not torch.isnan(dq).any()
    for _, _, dq_again in runs[1:]:
        assert torch.equal(dq_again, dq)
    torch.testing.assert_close(dq, dq_unordered, rtol=1e-2, atol=1e-3)


def _one_pass_spy(monkeypatch) -> list:
    """``configs.OnePassMode`` of each call of ``dkdvdq_gluon``, which still runs."""
    from vidsparse.ops.block_sparse_attn import bwd_sm90, configs

    calls, real = [], bwd_sm90.dkdvdq_gluon

    def spy(*args, **kwargs):
        calls.append(configs.OnePassMode(kwargs.get("ordered_by") is not None,
                                         kwargs.get("by_tma", False),
                                         kwargs.get("dq_fix") is not None))  # fmt: skip
        return real(*args, **kwargs)

    monkeypatch.setattr(bwd_sm90, "dkdvdq_gluon", spy)
    return calls


@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("mode", ["ordered", "unordered", "tma", "ordered_tma", "fixed"])
def test_gpu_engine_backward_takes_the_one_pass_kernel_where_asked(monkeypatch, mode):
    """``configs.override(one_pass=mode)``: the engine's backward at 128x128 without an
    epilogue runs ``dkdvdq_gluon`` (ordered: with the forward lists; tma: by TMA reductions;
    fixed: in fixed point, with the preprocess's multipliers) and its gradients match the
    two-kernel backward's (dK, dV to the bit); ordered or fixed, the same bits on a second
    run."""
    from vidsparse.ops.block_sparse_attn import configs

    how = configs.ONE_PASS_MODES[mode]
    q, k, v, do, idx, cnt, _ = _problem(128, torch.bfloat16, False, scale=4.0, seed=17)
    calls = _one_pass_spy(monkeypatch)
    dq_2, dk_2, dv_2 = _engine_grads(q, k, v, do, idx, cnt, 128)
    with configs.override(one_pass=mode):
        first = _engine_grads(q, k, v, do, idx, cnt, 128)
        second = _engine_grads(q, k, v, do, idx, cnt, 128)
    assert calls == [how] * 2
    dq, dk, dv = first
    assert torch.equal(dk, dk_2) and torch.equal(dv, dv_2)
    torch.testing.assert_close(dq, dq_2, rtol=1e-2, atol=1e-3)
    if how.ordered or how.fixed:
        assert torch.equal(second[0], dq)


@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_nondeterministic_engine_backward_is_the_one_pass_by_tma(monkeypatch, dtype, scale):
    """``block_sparse_attn(..., deterministic=False)`` at 128x128: its backward is one pass
    (``configs.NONDETERMINISTIC_ONE_PASS``: dQ by TMA reductions); dK, dV the default
    backward's bits, dQ against fp64 as close as PyTorch in low precision and as the default's
    dQ, at input scales 1, 4, 16. Where it does not apply (64x64 blocks; key-block sizes,
    whose padding the public entry may not read by TMA) the same call runs the default
    backward, to the bit. The kernel on partial key blocks: the tests above."""
    from vidsparse.ops.block_sparse_attn import configs

    q, k, v, do, idx, cnt, _ = _problem(128, dtype, False, scale=scale, seed=19)
    exact = _engine_grads(q, k, v, do, idx, cnt, 128)
    calls = _one_pass_spy(monkeypatch)
    dq, dk, dv = _engine_grads(q, k, v, do, idx, cnt, 128, deterministic=False)
    assert calls == [configs.ONE_PASS_MODES[configs.NONDETERMINISTIC_ONE_PASS]]
    assert torch.equal(dk, exact[1]) and torch.equal(dv, exact[2])
    _check_dq(dq, q, k, v, do, idx, cnt, None, 128, exact[0], "the default backward")
    for bs, padded in ((64, False), (128, True)):
        q, k, v, do, idx, cnt, sizes = _problem(bs, dtype, padded, scale=scale, seed=19)
        kw = dict(kv_block_sizes=sizes)
        fast = _engine_grads(q, k, v, do, idx, cnt, bs, deterministic=False, **kw)
        assert all(torch.equal(a, b) for a, b in zip(fast, _engine_grads(q, k, v, do, idx, cnt,
                                                                         bs, **kw)))  # fmt: skip
    assert len(calls) == 1
