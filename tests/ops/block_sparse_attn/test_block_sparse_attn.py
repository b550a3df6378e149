"""Block-sparse attention: reference (CPU), Triton in the interpreter (CPU CI), Triton on GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import vidsparse
from helpers import make_lists, make_qkv, masked_dense_attention
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.ops.block_sparse_attn import block_sparse_attn_ref
from vidsparse.testing import assert_error_relative, assert_rel_l2, poison_

# ----------------------------------------------------------------------------- reference


def test_reference_all_blocks_equals_dense_sdpa():
    B, H, S, D, bs = 2, 3, 96, 16, 32
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float64, device="cpu")
    n = S // bs
    idx = torch.arange(n, dtype=torch.int32).expand(1, H, n, n).contiguous()
    cnt = torch.full((1, H, n), n, dtype=torch.int32)
    o, lse = block_sparse_attn_ref(q, k, v, idx, cnt, block_q=bs, block_kv=bs)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert_rel_l2("o", o, ref, 1e-12)
    ref_lse = torch.logsumexp(q @ k.transpose(-1, -2) * D**-0.5, -1)
    assert_rel_l2("lse", lse, ref_lse, 1e-12)


@pytest.mark.parametrize("Bi", [1, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_reference_matches_masked_dense(Bi, padded):
    B, H, Sq, Skv, D, bq, bk = 2, 2, 64, 96, 8, 16, 8
    q, k, v = make_qkv(B, H, Sq, Skv, D, dtype=torch.float64, device="cpu")
    idx, cnt = make_lists(Bi, H, Sq // bq, Skv // bk, density=0.4, device="cpu", empty_rows=1)
    sizes = torch.randint(0, bk + 1, (Skv // bk,), dtype=torch.int32) if padded else None
    o, lse = block_sparse_attn_ref(q, k, v, idx, cnt, block_q=bq, block_kv=bk, kv_block_sizes=sizes)
    ref_o, ref_lse = masked_dense_attention(q, k, v, idx, cnt, bq, bk, sizes)
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    assert (o[:, :, :bq] == 0).all() and torch.isneginf(lse[:, :, :bq]).all()


def test_public_function_torch_backend_gradients(torch_backend):
    B, H, Sq, Skv, D, bq, bk = 1, 2, 32, 48, 8, 16, 8
    q, k, v = make_qkv(B, H, Sq, Skv, D, dtype=torch.float64, device="cpu", requires_grad=True)
    idx, cnt = make_lists(1, H, Sq // bq, Skv // bk, density=0.5, device="cpu", empty_rows=1)
    sizes = torch.randint(1, bk + 1, (Skv // bk,), dtype=torch.int32)
    do = torch.randn(B, H, Sq, D, dtype=torch.float64)
    out = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(bq, bk), kv_block_sizes=sizes)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref, _ = masked_dense_attention(q, k, v, idx, cnt, bq, bk, sizes)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert not torch.isnan(g).any(), name
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=f"d{name}")


@pytest.mark.dynamo
def test_torch_compile_fullgraph_cpu(torch_backend):
    B, H, S, D, bs = 1, 2, 64, 16, 16
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float32, device="cpu", requires_grad=True)
    idx, cnt = random_block_lists(1, H, S // bs, S // bs, density=0.5)

    def f(q, k, v):
        return vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=bs).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    torch.testing.assert_close(out, f(q, k, v))
    out.backward()
    assert q.grad is not None and not torch.isnan(q.grad).any()


# ----------------------------------------------------------------------------- bad input


def _good_args(H=2, S=64, D=16, bs=16, device="cpu"):
    q, k, v = make_qkv(1, H, S, S, D, dtype=torch.float32, device=device)
    idx, cnt = random_block_lists(1, H, S // bs, S // bs, density=0.5, device=device)
    return q, k, v, idx, cnt


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda a: a.__setitem__(0, a[0][..., :8]), ValueError, "k"),
        (lambda a: a.__setitem__(1, a[1].double()), TypeError, "dtype"),
        (lambda a: a.__setitem__(0, a[0][0]), ValueError, "q"),
        (lambda a: a.__setitem__(3, a[3].long()), TypeError, "kv_indices"),
        (lambda a: a[3].__setitem__((0, 0, 0, 0), 99), ValueError, "kv_indices"),
        (lambda a: a[4].__setitem__((0, 0, 0), 99), ValueError, "kv_counts"),
        (lambda a: a.__setitem__(4, a[4][:, :1]), ValueError, "kv_counts"),
        (lambda a: a.__setitem__(0, a[0][:, :, :40]), ValueError, "block"),
    ],
)
def test_bad_input_raises_before_compute(torch_backend, mutate, exc, words):
    args = list(_good_args())
    mutate(args)
    with pytest.raises(exc, match=words):
        vidsparse.block_sparse_attn(*args, block_size=16)


def test_bad_block_sizes_and_scale(torch_backend):
    q, k, v, idx, cnt = _good_args()
    with pytest.raises(ValueError, match="kv_block_sizes"):
        vidsparse.block_sparse_attn(
            q, k, v, idx, cnt, block_size=16, kv_block_sizes=torch.full((4,), 17, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="kv_block_sizes"):
        vidsparse.block_sparse_attn(
            q, k, v, idx, cnt, block_size=16, kv_block_sizes=torch.ones(3, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="block_size"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=0)
    with pytest.raises(TypeError, match="scale"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16, scale="x")


def test_unsupported_head_dim_names_supported(triton_backend, device):
    q, k, v, idx, cnt = _good_args(D=24, device=device)
    with pytest.raises(ValueError, match=r"head_dim 24 .*supported"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)


# ----------------------------------------------------------------------------- Triton kernels


def _check_against_reference(
    device,
    dtype,
    B,
    Bi,
    H,
    Sq,
    Skv,
    D,
    bq,
    bk,
    *,
    density,
    padded,
    empty_rows,
    scale=1.0,
    backward=True,
    noncontiguous=False,
):
    q, k, v = make_qkv(B, H, Sq, Skv, D, dtype=dtype, device=device, scale=scale)
    if noncontiguous:  # [B, S, H, D] storage viewed as [B, H, S, D], as diffusers hands it over
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    for x in (q, k, v):
        x.requires_grad_(backward)
    idx, cnt = make_lists(
        Bi, H, Sq // bq, Skv // bk, density=density, device=device, empty_rows=empty_rows
    )
    sizes = None
    if padded:
        sizes = torch.randint(0, bk + 1, (Skv // bk,), dtype=torch.int32, device=device)
        sizes[0] = bk
    o, lse = vidsparse.block_sparse_attn(
        q, k, v, idx, cnt, block_size=(bq, bk), kv_block_sizes=sizes, return_lse=True
    )
    # fp32 reference, and PyTorch's own error in the low precision as the yardstick.
    ref_o, ref_lse = masked_dense_attention(q, k, v, idx, cnt, bq, bk, sizes)
    low_o, _ = block_sparse_attn_ref(
        q, k, v, idx, cnt, block_q=bq, block_kv=bk, kv_block_sizes=sizes
    )
    if dtype != torch.float32:
        low_o = _lowprec_baseline(q, k, v, idx, cnt, bq, bk, sizes)
    assert_error_relative("o", o, ref_o, low_o, atol=1e-4 if dtype == torch.float32 else 2e-3)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    # lse is accumulated in fp32 from the inputs as given, whatever their dtype
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-4, atol=1e-4)
    if not backward:
        return
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref_o, (q, k, v), do.double())
    low_grads = torch.autograd.grad(
        _lowprec_baseline(q, k, v, idx, cnt, bq, bk, sizes)
        if dtype != torch.float32
        else block_sparse_attn_ref(
            q, k, v, idx, cnt, block_q=bq, block_kv=bk, kv_block_sizes=sizes
        )[0],
        (q, k, v),
        do,
    )
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_error_relative(name, g, r, lo, atol=1e-4 if dtype == torch.float32 else 2e-3)


def _lowprec_baseline(q, k, v, idx, cnt, bq, bk, sizes):
    """PyTorch computing the same masked attention in q's low precision (its own rounding)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    from vidsparse.masks.block_sparse import dense_from_lists

    block_map = dense_from_lists(idx, cnt, Skv // bk).expand(B, H, -1, -1)
    mask = block_map.repeat_interleave(bq, 2).repeat_interleave(bk, 3)
    if sizes is not None:
        slot = torch.arange(Skv, device=q.device) % bk
        mask = mask & (slot < sizes.long().repeat_interleave(bk))
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    return p @ v


INTERPRETER_CASES = [
    # B, Bi, H, Sq, Skv, D, bq, bk, density, padded, empty_rows
    (1, 1, 2, 64, 64, 16, 16, 16, 0.5, False, 1),
    (2, 1, 1, 32, 64, 16, 16, 8, 0.5, True, 1),
    (2, 2, 2, 64, 48, 32, 32, 16, 0.7, True, 0),
    (1, 1, 1, 512, 512, 16, 256, 256, 0.5, True, 1),  # as 128-token sub-blocks
]


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_triton_interpreter_matches_reference(triton_backend, dtype, case):
    B, Bi, H, Sq, Skv, D, bq, bk, density, padded, empty = case
    _check_against_reference(
        "cpu", dtype, B, Bi, H, Sq, Skv, D, bq, bk, density=density, padded=padded, empty_rows=empty
    )


GPU_BLOCKS = [(64, 64), (128, 64), (128, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(256, 256), (256, 64), (64, 256), (512, 128)])
def test_gpu_blocks_above_the_kernels_largest(block):
    """Blocks above 128 tokens run as 128-token sub-blocks (a 256x256 program needs 320 KB of
    shared memory: OutOfResources on an H200 before); forward, lse and gradients."""
    bq, bk = block
    _check_against_reference(
        "cuda", torch.bfloat16, 1, 1, 2, 4 * 256, 2048, 128, bq, bk, density=0.5, padded=True,
        empty_rows=1,
    )  # fmt: skip


def _as_on_a_gpu(monkeypatch):
    """The engine entry's block cap as on an H200 (fp32: 64 tokens), kernels as they are."""
    from vidsparse.ops.block_sparse_attn import interface
    from vidsparse.utils.device import Target

    monkeypatch.setattr(interface, "target_of", lambda device: Target("cuda", 90))


# On a GPU fp32 runs in 64-token blocks: its 128x128 pipelines overflow shared memory.
SUB_BLOCK_CASES = [
    (torch.float16, (128, 128), (1, 1, 4, 2), [128, 128, 128, 72]),
    (torch.float32, (64, 64), (1, 1, 8, 4), [64, 64, 64, 64, 64, 64, 64, 8]),
]


@pytest.mark.parametrize(("dtype", "blocks", "list_shape", "sizes"), SUB_BLOCK_CASES)
def test_blocks_above_the_kernels_largest_launch_as_sub_blocks(
    monkeypatch, triton_backend, dtype, blocks, list_shape, sizes
):
    """The Triton path hands the kernels blocks of at most ``kernel_block_max`` tokens and
    lists refined to them (fp32 as on a GPU: the interpreter keeps 128)."""
    from vidsparse.ops.block_sparse_attn import fwd

    _as_on_a_gpu(monkeypatch)

    seen = []

    def record(q, k, v, idx, cnt, sizes, bq, bk, scale, **kw):
        seen.append((bq, bk, tuple(idx.shape), None if sizes is None else sizes.tolist()))
        return torch.zeros_like(q), q.new_zeros(q.shape[:3], dtype=torch.float32)

    monkeypatch.setattr(fwd, "block_sparse_attn_fwd", record)
    q, k, v = make_qkv(1, 1, 512, 512, 16, dtype=dtype, device="cpu")
    idx = torch.tensor([[[[1], [0]]]], dtype=torch.int32)
    cnt = torch.ones(1, 1, 2, dtype=torch.int32)
    kv_sizes = torch.tensor([256, 200], dtype=torch.int32)
    vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=256, kv_block_sizes=kv_sizes)
    assert seen == [(*blocks, list_shape, sizes)]


@pytest.mark.interpreter
@pytest.mark.parametrize(("dtype", "block"), [(torch.float32, 128), (torch.float16, 256)])
def test_sub_blocks_keep_what_unchecked_lists_mean(triton_backend, monkeypatch, dtype, block):
    """Lists no check saw, through sub-blocks: an entry out of range still gets no weight (its
    doubled value, -2**31 + 1 -> 2, would wrap into range) and a count past K still means K
    (doubled, 2**31 - 1 would wrap negative): the GPU fuzz's hostile lists at fp32 128x128."""
    from helpers import lists_without_bad_entries
    from vidsparse.ops.block_sparse_attn.interface import block_sparse_attn_unchecked

    _as_on_a_gpu(monkeypatch)  # fp32's 64-token sub-blocks, run in the interpreter
    q, k, v = make_qkv(1, 1, 4 * block, 4 * block, 16, dtype=dtype, device="cpu")
    wraps = -(2**31) + 1
    idx = torch.tensor([[[[1, wraps, 0], [3, 2, wraps], [wraps, 0, 1], [2, 3, 0]]]],
                       dtype=torch.int32)  # fmt: skip
    cnt = torch.tensor([[[3, 2**31 - 1, 2, -5]]], dtype=torch.int32)
    out, lse = block_sparse_attn_unchecked(q, k, v, idx, cnt, block_q=block, block_kv=block,
                                           kv_block_sizes=None, scale=0.25)  # fmt: skip
    clean_idx, clean_cnt = lists_without_bad_entries(idx, cnt, 4)
    ref, ref_lse = masked_dense_attention(q, k, v, clean_idx, clean_cnt, block, block, None, 0.25)
    assert_rel_l2("o", out.double(), ref, 1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # the row of count -5: empty


def test_fp32_blocks_are_capped_on_gpus_only():
    from vidsparse.ops.block_sparse_attn.configs import kernel_block_max
    from vidsparse.utils.device import CPU_INTERPRETER, Target

    for target in (Target("cuda", 90), Target("cuda", 100), Target("hip", "gfx942")):
        assert kernel_block_max(target, torch.float32) == 64
        assert kernel_block_max(target, torch.bfloat16) == 128
    assert kernel_block_max(CPU_INTERPRETER, torch.float32) == 128


def test_fp32_dots_take_tensor_cores_on_nvidia_and_ieee_elsewhere():
    """fp32's "ieee" dots are FMA loops on NVIDIA (100-260 KB of spills a thread at D=128,
    30-90 s a kernel to compile): tf32x3 there, ieee on AMD and in the interpreter."""
    from vidsparse.ops.block_sparse_attn.configs import dot_precision
    from vidsparse.utils.device import CPU_INTERPRETER, Target

    for arch in (80, 90, 100):
        assert dot_precision(Target("cuda", arch), torch.float32) == "tf32x3"
    assert dot_precision(Target("cuda", 75), torch.float32) == "ieee"
    assert dot_precision(Target("hip", "gfx942"), torch.float32) == "ieee"
    assert dot_precision(CPU_INTERPRETER, torch.float32) == "ieee"
    for dtype in (torch.bfloat16, torch.float16):
        assert dot_precision(Target("cuda", 90), dtype) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", GPU_BLOCKS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
def test_gpu_matches_reference(dtype, block, D, scale):
    bq, bk = block
    _check_against_reference(
        "cuda",
        dtype,
        2,
        1,
        3,
        4 * 128,
        6 * 128,
        D,
        bq,
        bk,
        density=0.4,
        padded=True,
        empty_rows=1,
        scale=scale,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("block", GPU_BLOCKS)
def test_gpu_unpadded_batch_lists_noncontiguous(block):
    bq, bk = block
    _check_against_reference(
        "cuda",
        torch.bfloat16,
        2,
        2,
        4,
        1024,
        512,
        128,
        bq,
        bk,
        density=0.3,
        padded=False,
        empty_rows=2,
        noncontiguous=True,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("block", GPU_BLOCKS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_fp32_is_accurate(block, D, padded):
    """fp32 at every block shape and head dim (128x128 at D=128 overflowed Hopper's shared
    memory with the 16-bit configs' pipeline stages: configs.fit_fp32)."""
    bq, bk = block
    _check_against_reference(
        "cuda", torch.float32, 1, 1, 2, 512, 512, D, bq, bk, density=0.5, padded=padded,
        empty_rows=1,
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_outputs_fully_written_and_deterministic():
    """o, dq, dk, dv of two runs: the same bits, no NaN although the allocator's blocks they
    reuse held NaN before each run (an unwritten element shows), o against fp64."""
    B, H, S, D, bs = 1, 4, 2048, 128, 64
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.25, device="cuda", empty_rows=3)
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        [poison_(torch.empty_like(q)) for _ in range(8)]  # freed: the outputs may reuse them
        o = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=bs)
        runs.append((o, *torch.autograd.grad(o, (q, k, v), do)))
    for a, b in zip(*runs):
        assert not torch.isnan(a).any()
        assert torch.equal(a, b), "not bit-identical across runs"
    ref, _ = masked_dense_attention(q.detach(), k.detach(), v.detach(), idx, cnt, bs, bs)
    assert_rel_l2("o (bf16)", runs[0][0].double(), ref, 1e-2)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    B, H, S, D, bs = 1, 2, 1024, 128, 128
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    idx, cnt = random_block_lists(1, H, S // bs, S // bs, density=0.5, device="cuda")

    def f(q, k, v):
        return vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=bs).float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v)
    out.backward()
    torch.testing.assert_close(out, f(q, k, v), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_kernel_does_not_touch_poisoned_padding():
    """Padding keys hold NaN: they must be neither read nor weighted."""
    B, H, S, D, bs = 1, 2, 512, 64, 64
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.bfloat16, device="cuda")
    sizes = torch.full((S // bs,), 40, dtype=torch.int32, device="cuda")
    pad = (torch.arange(S, device="cuda") % bs) >= 40
    k[:, :, pad] = float("nan")
    v[:, :, pad] = float("nan")
    idx, cnt = random_block_lists(1, H, S // bs, S // bs, density=0.5, device="cuda")
    o = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=bs, kv_block_sizes=sizes)
    assert not torch.isnan(o).any()
    clean_k, clean_v = (x.masked_fill(pad[:, None], 0) for x in (k, v))  # the reference's 0 * NaN
    ref, _ = masked_dense_attention(q, clean_k, clean_v, idx, cnt, bs, bs, sizes)
    assert_rel_l2("o (bf16)", o.double(), ref, 1e-2)


def test_list_values_checked_once_then_again_after_inplace_change(torch_backend):
    q, k, v, idx, cnt = _good_args()
    vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)  # validated and remembered
    vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)  # cached: no re-check needed
    idx[0, 0, 0, 0] = 99  # in-place change bumps the version: must be checked again
    with pytest.raises(ValueError, match="kv_indices"):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)
    fresh_idx = idx.clone()  # a new tensor is never taken for a checked one
    with pytest.raises(ValueError, match="kv_indices"):
        vidsparse.block_sparse_attn(q, k, v, fresh_idx, cnt, block_size=16)


def test_derived_lists_are_cached_per_source_and_version():
    """Transposed and full-first lists are derived once per list tensors: the same tensors hit,
    an in-place change (version bump) derives again, a freed source drops its entry."""
    import gc

    from vidsparse.masks.block_sparse import transpose_block_lists
    from vidsparse.ops.block_sparse_attn.lists import (
        blocks_by_size_ref,
        cached_blocks_by_size,
        cached_transpose,
        derived_lists,
    )

    idx, cnt = random_block_lists(1, 2, 6, 8, density=0.5)
    first = cached_transpose(idx, cnt, 8)
    assert cached_transpose(idx, cnt, 8) is first
    assert cached_transpose(idx, cnt, 9) is not first  # other parameters: another entry
    cnt[0, 0, 0] -= 1  # an in-place change of either source (density 0.5: 4 entries a row)
    again = cached_transpose(idx, cnt, 8)
    assert again is not first
    for got, want in zip(again, transpose_block_lists(idx, cnt, 8)):
        assert torch.equal(got, want)
    sizes = torch.tensor([4, 2, 4, 4, 0, 4, 1, 4], dtype=torch.int32)
    reordered, ends, counts = cached_blocks_by_size(idx, cnt, sizes, 4, (0, 0))
    assert cached_blocks_by_size(idx, cnt, sizes, 4, (0, 0))[0] is reordered
    assert cached_blocks_by_size(idx, cnt, sizes, 4, (2, 0))[0] is not reordered  # other tails
    ref, ref_ends, ref_counts = blocks_by_size_ref(idx, cnt, sizes, 4)
    assert torch.equal(ends, ref_ends) and torch.equal(counts, ref_counts)
    live = torch.arange(idx.shape[-1]) < cnt[..., None]
    assert torch.equal(reordered[live], ref[live])
    before = len(derived_lists)
    del idx, cnt, first, again, reordered, ends, counts
    gc.collect()
    assert len(derived_lists) <= before - 3


def test_inference_mode_lists_are_checked_every_call(torch_backend):
    """Inference tensors carry no version counter: their values are validated on every call
    (an in-place change could not be seen), never cached, and the call works."""
    q, k, v, idx, cnt = _good_args()
    with torch.inference_mode():
        idx, cnt = idx.clone(), cnt.clone()
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)
        idx[0, 0, 0, 0] = 99
        with pytest.raises(ValueError, match="kv_indices"):
            vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=16)


def test_derived_lists_bypass_the_cache_in_inference_mode():
    from vidsparse.ops.block_sparse_attn.lists import cached_transpose

    with torch.inference_mode():
        idx, cnt = random_block_lists(1, 1, 4, 4, density=0.5)
        assert cached_transpose(idx, cnt, 4) is not cached_transpose(idx, cnt, 4)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("padded", [False, True])
def test_tma_forward_kernel_in_interpreter(padded):
    """The Hopper TMA forward (picked by configs on sm_90) against the reference; padding keys
    hold NaN to prove they get no weight even though TMA reads whole blocks."""
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig, override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

    B, H, S, D, bs = 2, 2, 64, 16, 16
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float16, device="cpu")
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.5, device="cpu", empty_rows=1)
    sizes = None
    if padded:
        sizes = torch.tensor([16, 9, 0, 5], dtype=torch.int32)
        pad = (torch.arange(S) % bs) >= sizes.long().repeat_interleave(bs)
        k[:, :, pad] = float("nan")
        v[:, :, pad] = float("nan")
    with override(fwd=KernelConfig(4, 1, use_tma=True)):
        o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, D**-0.5)
    ref_o, ref_lse = masked_dense_attention(
        q.nan_to_num(0), k.nan_to_num(0), v.nan_to_num(0), idx, cnt, bs, bs, sizes
    )
    assert_rel_l2("o", o, ref_o, 2e-3)  # fp16 inputs
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=0, atol=1e-2)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("padding", ["none", "finite", "nan"])
def test_tma_backward_kernels_in_interpreter(padding):
    """Both backward kernels with a TMA config (Hopper) against the fp64 autograd reference.
    Padding keys vouched finite are read by TMA; NaN padding (not vouched) must send the
    kernels back to masked pointer loads, where the NaN cannot leak into any gradient."""
    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig, override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

    B, H, S, D, bs = 2, 2, 64, 16, 16
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float16, device="cpu")
    do = torch.randn_like(q)
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.5, device="cpu", empty_rows=1)
    sizes = None if padding == "none" else torch.tensor([16, 9, 1, 5], dtype=torch.int32)
    pad = torch.zeros(S, dtype=torch.bool)
    if sizes is not None:
        pad = (torch.arange(S) % bs) >= sizes.long().repeat_interleave(bs)
    if padding == "nan":
        k[:, :, pad], v[:, :, pad] = float("nan"), float("nan")
    o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, D**-0.5)
    tma = KernelConfig(4, 1, sub_m=8, use_tma=True, pointer_sub_m=4)
    with override(bwd_dkdv=tma, bwd_dq=tma):
        grads = block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, sizes, bs, bs, D**-0.5,
                                      padding_finite=padding != "nan")  # fmt: skip
    q64, k64, v64 = (x.double().nan_to_num(0).requires_grad_() for x in (q, k, v))
    ref_o, _ = masked_dense_attention(q64, k64, v64, idx, cnt, bs, bs, sizes)
    ref = torch.autograd.grad(ref_o, (q64, k64, v64), do.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        g = g.clone()
        if name != "dq":
            g[:, :, pad] = 0  # the gradient of a padding key is not defined
        assert_rel_l2(name, g, r, 3e-3)  # fp16 inputs


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("guard", [False, True])
def test_tma_dkdv_of_key_blocks_no_query_lists(monkeypatch, guard):
    """dK/dV by TMA of key blocks that no query block lists (an empty walk), with and without
    the branch that skips it (``kernels.bwd.GUARD_EMPTY_WALK``, on from Triton 3.7): zeros
    for those blocks, the fp64 reference elsewhere."""
    import triton.language as tl

    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig, override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd
    from vidsparse.ops.block_sparse_attn.kernels import bwd as kernels

    monkeypatch.setattr(kernels, "GUARD_EMPTY_WALK", tl.constexpr(guard))
    B, H, S, D, bs = 1, 2, 64, 16, 16
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float16, device="cpu")
    do = torch.randn_like(q)
    # key block 1 in no list; key block 3 only in head 1's
    idx = torch.tensor([[[0, 2], [2, 0], [0, -1], [2, 0]], [[0, 2], [3, 0], [2, 0], [0, -1]]],
                       dtype=torch.int32)[None]  # fmt: skip
    cnt = torch.tensor([[2, 2, 1, 2], [2, 2, 2, 1]], dtype=torch.int32)[None]
    o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, None, bs, bs, D**-0.5)
    tma = KernelConfig(4, 1, sub_m=8, use_tma=True)
    with override(bwd_dkdv=tma, bwd_dq=tma):
        grads = block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, None, bs, bs, D**-0.5)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref_o, _ = masked_dense_attention(q64, k64, v64, idx, cnt, bs, bs)
    ref = torch.autograd.grad(ref_o, (q64, k64, v64), do.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert_rel_l2(name, g, r, 3e-3)  # fp16 inputs
    for g in grads[1:]:
        assert not g[:, :, bs : 2 * bs].any() and not g[:, 0, 3 * bs :].any()


def test_reference_ignores_nan_in_padding_and_unread_blocks(torch_backend):
    B, H, S, D, bs = 1, 2, 64, 8, 16
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float64, device="cpu", requires_grad=False)
    sizes = torch.tensor([16, 9, 3, 16], dtype=torch.int32)
    pad = (torch.arange(S) % bs) >= sizes.long().repeat_interleave(bs)
    k[:, :, pad], v[:, :, pad] = float("nan"), float("nan")
    for x in (q, k, v):
        x.requires_grad_(True)
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.5, device="cpu", empty_rows=1)
    o = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=bs, kv_block_sizes=sizes)
    grads = torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert not torch.isnan(o).any()
    assert not any(torch.isnan(g[:, :, ~pad]).any() for g in grads)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tails", [(0, 0), (4, 0), (4, 2)])
def test_blocks_by_size_groups_each_list_stably(index_dtype, tails):
    """The kernels' list reorder (lists.py) against its Python reference: full key blocks
    first, then the partial ones walked with all rows, with tails[0] and with tails[1] rows,
    each group in list order; the groups' ends; strided int64 lists with K not a power of two,
    more rows than one program takes, empty rows."""
    from vidsparse.ops.block_sparse_attn.lists import blocks_by_size, blocks_by_size_ref

    bk, nk = 8, 23
    idx, cnt = make_lists(2, 3, 40, nk, density=0.3, device="cpu", empty_rows=2)  # K = 7
    idx = torch.cat([idx, torch.full_like(idx, -1)], -1)[..., : idx.shape[-1]]  # strided view
    idx = idx.to(index_dtype)
    sizes = torch.randint(0, bk + 1, (nk,), dtype=torch.int32)
    sizes[::3] = bk
    sizes[1:3] = torch.tensor([2, 5], dtype=torch.int32)  # a block of each group
    got, got_ends, got_counts = blocks_by_size(idx, cnt, sizes, bk, tails)
    ref, ref_ends, ref_counts = blocks_by_size_ref(idx, cnt, sizes, bk, tails)
    assert torch.equal(got_ends, ref_ends) and torch.equal(got_counts, cnt)
    assert torch.equal(ref_counts, cnt)
    live = torch.arange(idx.shape[-1]) < cnt[..., None]
    assert torch.equal(got[live], ref[live])
    group_sizes = torch.diff(ref_ends, dim=-1, prepend=torch.zeros_like(ref_ends[..., :1]))
    group_sizes = torch.cat([group_sizes, (ref_counts - ref_ends[..., 2])[..., None]], -1)
    present = (group_sizes.sum((0, 1, 2)) > 0).tolist()
    # Full blocks, then every group the tails make, occur; a group no tail makes stays empty.
    assert present == [True, True, bool(tails[0]), bool(tails[1])]
    # Lists no check saw: counts past K clamp, entries out of [0, NK) are dropped.
    idx[0, 0, 5, 0], idx[1, 2, 7, 1], cnt[0, 1, 3] = nk, -3, 99
    got, got_ends, got_counts = blocks_by_size(idx, cnt, sizes, bk, tails)
    ref, ref_ends, ref_counts = blocks_by_size_ref(idx, cnt, sizes, bk, tails)
    assert torch.equal(got_ends, ref_ends) and torch.equal(got_counts, ref_counts)
    live = torch.arange(idx.shape[-1]) < ref_counts[..., None]
    assert torch.equal(got[live], ref[live])
    assert int(ref_counts[0, 1, 3]) <= idx.shape[-1]


def test_size_groups_follow_the_key_tails():
    """``configs.key_tails``: a quarter and a half of the block, none under 16 rows, none when
    tuning turns them off; ``lists.size_group`` puts each size in the shortest walk that
    holds it, full blocks apart."""
    from vidsparse.ops.block_sparse_attn.configs import key_tails, override
    from vidsparse.ops.block_sparse_attn.lists import size_group

    assert key_tails(128) == (64, 32) and key_tails(64) == (32, 16)
    assert key_tails(32) == (16, 0) and key_tails(16) == (0, 0)
    with override(key_tails=False):
        assert key_tails(64) == (0, 0)
    groups = {n: size_group(n, 64, (32, 16)) for n in (64, 63, 33, 32, 17, 16, 1, 0)}
    assert groups == {64: 0, 63: 1, 33: 1, 32: 2, 17: 2, 16: 3, 1: 3, 0: 3}
    assert size_group(16, 64, (0, 0)) == 1 and size_group(16, 32, (16, 0)) == 2


def test_query_groups_and_when_dkdv_walks_them():
    """``lists.query_groups``: each query block in the shortest query walk that holds its
    gradient-carrying rows (full blocks, and partial ones over half, walk all rows); dK/dV
    takes the walks only with an epilogue's ``quiet_rows``, a config that asks (``query_tails``)
    and one step a block, and refuses quiet rows that do not cover every query block."""
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn.bwd import _query_walks
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig
    from vidsparse.ops.block_sparse_attn.lists import query_groups

    rows = torch.tensor([64, 63, 33, 32, 17, 16, 1, 0], dtype=torch.int32)
    assert query_groups(rows, 64, (32, 16)).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert query_groups(rows, 64, (32, 0)).tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    cfg = KernelConfig(sub_m=64, query_tails=True)
    got_rows, tails = _query_walks(cfg, rows, 8, 64, False)
    assert got_rows is rows and tails == (32, 16)
    for off in [(cfg, None, 8, 64, False), (replace(cfg, query_tails=False), rows, 8, 64, False),
                (replace(cfg, sub_m=32), rows, 8, 64, False), (cfg, rows, 8, 64, True),
                (replace(cfg, sub_m=16), rows, 8, 16, False)]:  # fmt: skip
        assert _query_walks(*off) == (None, (0, 0))
    with pytest.raises(ValueError, match="quiet_rows"):
        _query_walks(cfg, rows, 9, 64, False)


def test_short_walks_per_target():
    """Which configs take the short walks (``KernelConfig.key_tails``): Hopper's masked rows
    and the interpreter's (what the next GPU round times, what CPU CI tests); not the AMD or
    other NVIDIA rows (untimed, and spilling with them). A config without them gets TAIL1 =
    TAIL2 = 0 (its kernel walks those groups with all rows)."""
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig, lookup
    from vidsparse.ops.block_sparse_attn.launch import walk_tails
    from vidsparse.utils.device import CPU_INTERPRETER, Target

    def takes(target, kernel, block):
        return lookup(target, kernel, block, block, 128, masked=True).key_tails

    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        assert takes(Target("cuda", 90), kernel, 64) and takes(CPU_INTERPRETER, kernel, 64)
        for other in (Target("cuda", 100), Target("cuda", 80), Target("hip", "gfx942")):
            assert not takes(other, kernel, 64) and not takes(other, kernel, 128)
    assert walk_tails(KernelConfig(), (32, 16)) == {"TAIL1": 32, "TAIL2": 16}
    assert walk_tails(KernelConfig(key_tails=False), (32, 16)) == {"TAIL1": 0, "TAIL2": 0}


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("use_tma", [False, True])
def test_full_first_walk_equals_masking_every_block(use_tma):
    """The forward's two walks (full blocks unmasked, then partial ones masked) give what
    masking every listed block gives, up to the summation order; padding keys get no weight
    (NaN for pointer loads, which never read them; large finite values for TMA, which reads
    them and is only taken where the caller vouches them finite)."""
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig, override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

    B, H, S, D, bs = 1, 2, 96, 16, 16
    q, k, v = make_qkv(B, H, S, S, D, dtype=torch.float16, device="cpu")
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.7, device="cpu", empty_rows=1)
    sizes = torch.tensor([16, 9, 16, 0, 16, 5], dtype=torch.int32)
    pad = (torch.arange(S) % bs) >= sizes.long().repeat_interleave(bs)
    k[:, :, pad] = 1e4 if use_tma else float("nan")
    v[:, :, pad] = 1e4 if use_tma else float("nan")
    cfg = KernelConfig(4, 1, use_tma=use_tma)
    args = (q, k, v, idx, cnt, sizes, bs, bs, D**-0.5)
    with override(fwd=cfg, full_first=True):
        o, lse = block_sparse_attn_fwd(*args, padding_finite=use_tma)
    with override(fwd=cfg, full_first=False):
        o_all, lse_all = block_sparse_attn_fwd(*args, padding_finite=use_tma)
    ref_o, _ = masked_dense_attention(q, k.nan_to_num(0), v.nan_to_num(0), idx, cnt, bs, bs, sizes)
    assert_rel_l2("o", o, ref_o, 2e-3)  # fp16 inputs
    torch.testing.assert_close(o.float(), o_all.float(), rtol=0, atol=2e-3)
    torch.testing.assert_close(lse, lse_all, rtol=0, atol=1e-5)


def _engine_fwd_bwd(args, do):
    """``(o, dq, dk, dv)`` of the engine's launchers on ``args`` (q, k, v, lists, sizes, blocks,
    scale; padding keys finite) and output gradient ``do``."""
    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

    o, lse = block_sparse_attn_fwd(*args, padding_finite=True)
    grads = block_sparse_attn_bwd(do, *args[:3], o, lse, *args[3:], padding_finite=True)
    return (o, *grads)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("use_tma", [False, True])
def test_short_walks_of_partial_key_blocks(use_tma):
    """Partial 64-key blocks walked with 32 or 16 key rows where they fit (``key_tails``), in
    the forward, dQ and dK/dV (its programs of a short block run with that many rows and zero
    the block's other rows): against the fp64 masked reference, and against every partial
    block walked with all 64 rows (``override(key_tails=False)``). Blocks of every group:
    full, 63 and 33 keys (64 rows), 32 and 17 (32), 16, 1 and 0 (16); padding keys hold NaN
    for pointer loads, which never read them, and large finite values for TMA."""
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig, override

    bs, D = 64, 16
    sizes = torch.tensor([64, 63, 32, 17, 16, 1, 0, 33], dtype=torch.int32)
    S = bs * len(sizes)
    q, k, v = make_qkv(1, 1, S, S, D, dtype=torch.float16, device="cpu")
    idx, cnt = make_lists(1, 1, S // bs, len(sizes), density=0.9, device="cpu", empty_rows=1)
    pad = (torch.arange(S) % bs) >= sizes.long().repeat_interleave(bs)
    k[:, :, pad] = 1e4 if use_tma else float("nan")
    v[:, :, pad] = 1e4 if use_tma else float("nan")
    do = torch.randn_like(q)
    cfg = KernelConfig(4, 1, use_tma=use_tma, sub_m=32)
    args = (q, k, v, idx, cnt, sizes, bs, bs, D**-0.5)

    def run():
        with override(fwd=cfg, bwd_dkdv=cfg, bwd_dq=cfg, fused=False):
            return _engine_fwd_bwd(args, do)

    got = run()
    with override(key_tails=False):
        full_rows = run()
    qr, kr, vr = (x.nan_to_num(0).double().requires_grad_() for x in (q, k, v))
    ref_o, _ = masked_dense_attention(qr, kr, vr, idx, cnt, bs, bs, sizes)
    ref_o.backward(do.double())
    refs = (ref_o.detach(), qr.grad, kr.grad, vr.grad)
    for name, a, b, ref in zip(("o", "dq", "dk", "dv"), got, full_rows, refs):
        assert_rel_l2(name, a, ref, 5e-3)  # fp16 inputs
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-3)
    assert (got[2][:, :, pad] == 0).all() and (got[3][:, :, pad] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
@pytest.mark.parametrize("bs", [64, 128])
def test_gpu_short_walks_match_reference_and_all_rows(dtype, scale, bs):
    """The short walks with the GPU's own configs (on Hopper: Triton's backward, and the Gluon
    forward where ``GluonOptions.KEY_TAILS`` is on): forward and gradients at D=128 against
    the fp64 reference (error-relative to the same computation in plain low-precision
    PyTorch) and against every partial block walked with all rows. Blocks of every group:
    full, all rows, half, quarter, empty; padding keys large and finite (read by TMA, masked)."""
    from vidsparse.ops.block_sparse_attn.configs import override

    D, half, quarter = 128, bs // 2, bs // 4
    sizes = [bs, bs - 1, half + 1, half, quarter + 1, quarter, 1, 0, bs, half]
    sizes = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    S = bs * len(sizes)
    q, k, v = make_qkv(2, 3, S, S, D, dtype=dtype, device="cuda", scale=scale)
    idx, cnt = make_lists(1, 3, S // bs, len(sizes), density=0.7, device="cuda", empty_rows=1)
    pad = (torch.arange(S, device="cuda") % bs) >= sizes.long().repeat_interleave(bs)
    k[:, :, pad], v[:, :, pad] = 300.0, -300.0
    do = torch.randn_like(q)
    args = (q, k, v, idx, cnt, sizes, bs, bs, D**-0.5)

    got = _engine_fwd_bwd(args, do)
    with override(key_tails=False):
        all_rows = _engine_fwd_bwd(args, do)
    real_k, real_v = (x.masked_fill(pad[:, None], 0.0) for x in (k, v))
    leaves = [x.double().requires_grad_() for x in (q, real_k, real_v)]
    ref_o, _ = masked_dense_attention(*leaves, idx, cnt, bs, bs, sizes)
    ref_o.backward(do.double())
    low = [x.detach().requires_grad_() for x in (q, real_k, real_v)]
    low_o = _lowprec_baseline(*low, idx, cnt, bs, bs, sizes)
    low_o.backward(do)
    refs = (ref_o.detach(), *(x.grad for x in leaves))
    lows = (low_o.detach(), *(x.grad for x in low))
    for name, a, b, ref, base in zip(("o", "dq", "dk", "dv"), got, all_rows, refs, lows):
        assert_error_relative(name, a, ref, base, atol=2e-3)
        assert_error_relative(name + " (all rows)", b, ref, base, atol=2e-3)
    assert (got[2][:, :, pad] == 0).all() and (got[3][:, :, pad] == 0).all()


# ----------------------------------------------------------------------------- fused backward

FUSED_CASES = {
    # B, Bi, H, Sq, Skv, D, bq, bk, padded
    "plain": (1, 1, 2, 64, 64, 16, 16, 16, False),
    "kv_sizes": (1, 1, 2, 64, 64, 16, 16, 16, True),
    "sq_ne_skv": (1, 1, 2, 32, 64, 16, 16, 8, True),
    "batch": (2, 2, 2, 64, 48, 32, 32, 16, False),
    "key_tails": (1, 1, 1, 128, 256, 16, 64, 64, True),  # 64-key blocks: short walks
}


def _fused_vs_two_launches(dtype, case, config_pairs):
    """The backward's two launches and its fused one, for each (dK/dV, dQ) config pair:
    bit-identical gradients. Every list leaves out the last key block (an empty transposed
    list: its dK, dV are 0) and the first query block is empty (its dQ is 0)."""
    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.configs import override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

    B, Bi, H, Sq, Skv, D, bq, bk, padded = case
    q, k, v = make_qkv(B, H, Sq, Skv, D, dtype=dtype, device="cpu")
    do = torch.randn_like(q)
    idx, cnt = make_lists(Bi, H, Sq // bq, Skv // bk - 1, density=0.5, device="cpu",
                          empty_rows=1)  # fmt: skip
    sizes = None
    if padded:
        sizes = torch.randint(0, bk + 1, (Skv // bk,), dtype=torch.int32)
        sizes[0] = bk
    o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bq, bk, D**-0.5)
    for dkdv_cfg, dq_cfg in config_pairs:
        args = (do, q, k, v, o, lse, idx, cnt, sizes, bq, bk, D**-0.5)
        with override(bwd_dkdv=dkdv_cfg, bwd_dq=dq_cfg, fused=False):
            two = block_sparse_attn_bwd(*args, padding_finite=True)
        with override(bwd_dkdv=dkdv_cfg, bwd_dq=dq_cfg, fused=True):
            one = block_sparse_attn_bwd(*args, padding_finite=True)
        for name, a, b in zip(("dq", "dk", "dv"), two, one):
            assert torch.equal(a, b), f"{name} differs with {dkdv_cfg}, {dq_cfg}"
        dq, dk, dv = one
        assert (dq[:, :, :bq] == 0).all()
        assert (dk[:, :, -bk:] == 0).all() and (dv[:, :, -bk:] == 0).all()
        assert not any(torch.isnan(g).any() for g in one)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(FUSED_CASES.values()), ids=list(FUSED_CASES))
def test_fused_backward_equals_two_launches(dtype, case):
    """One launch of both gradient kernels (``fused=True``) against two: the interpreter's
    configs, then each half with its own step and its own loads (TMA in one half, pointers
    in the other: fp16 only, fp32 keeps pointer loads)."""
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig

    bq = case[6]
    tma, pointer = KernelConfig(4, 1, use_tma=True), KernelConfig(4, 1)
    pairs = [
        (None, None),  # the table's (the whole query block a step)
        (replace(tma, sub_m=bq // 2), replace(pointer, sub_m=bq // 4)),
        (replace(pointer, sub_m=bq // 4), replace(tma, sub_m=bq // 2)),
    ]
    _fused_vs_two_launches(dtype, case, pairs)


def test_fused_backward_policy():
    """Which backward launches fuse (configs.py, ``KernelConfig.fused``): Hopper's 128x128
    pair, with TMA loads or without; not its masked-key configs nor 64x64 (not flagged);
    the interpreter's (so CPU CI runs it). ``fused=True`` needs configs that launch alike."""
    from vidsparse.ops.block_sparse_attn.bwd import fused_launch
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig, lookup
    from vidsparse.utils.device import CPU_INTERPRETER, Target

    def fuses(target, block, masked=False, tma=True, fused=None):
        cfgs = [lookup(target, f"bwd_{kernel}", block, block, 128, masked)
                for kernel in ("dkdv", "dq")]  # fmt: skip
        return fused_launch(*(cfg.for_inputs(tma, block)[0] for cfg in cfgs), fused)

    hopper = Target("cuda", 90)
    assert fuses(hopper, 128) and fuses(hopper, 128, tma=False)
    assert not fuses(hopper, 128, masked=True) and not fuses(hopper, 64)
    assert fuses(hopper, 128, masked=True, fused=True)  # forced: the masked pair launches alike
    assert not fuses(hopper, 128, fused=False)
    assert fuses(CPU_INTERPRETER, 16)
    assert not fuses(Target("hip", "gfx942"), 128)
    with pytest.raises(ValueError, match="launch alike"):
        fused_launch(KernelConfig(8, 2, fused=True), KernelConfig(4, 2, fused=True), True)
    assert not fused_launch(KernelConfig(8, 2, fused=True), KernelConfig(4, 2, fused=True))


def _gpu_problem(S: int, bs: int, padded: bool):
    """``(q, k, v, do, lists, counts, key-block sizes)``: B=2, H=4, D=128, bf16 on the GPU,
    lists of density 1/4 broadcast over the batch with two empty rows; random sizes where
    ``padded``."""
    q, k, v = make_qkv(2, 4, S, S, 128, dtype=torch.bfloat16, device="cuda")
    idx, cnt = make_lists(1, 4, S // bs, S // bs, density=0.25, device="cuda", empty_rows=2)
    sizes = None
    if padded:
        sizes = torch.randint(1, bs + 1, (S // bs,), dtype=torch.int32, device="cuda")
    return q, k, v, torch.randn_like(q), idx, cnt, sizes


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("tma", [True, False])
def test_gpu_fused_backward_is_bit_identical(padded, tma, monkeypatch):
    """On the GPU, the Triton backward in one launch against two (Hopper: the 128x128 configs
    fuse by default; its Gluon kernels, which never fuse, are switched off here), and the
    fused kernel is seen to launch in the one-launch arm only."""
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import bwd
    from vidsparse.ops.block_sparse_attn.configs import lookup, override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd
    from vidsparse.utils.device import target_of

    D, bs = 128, 128
    q, k, v, do, idx, cnt, sizes = _gpu_problem(2048, bs, padded)
    o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, D**-0.5, padding_finite=tma)
    # Configs that launch alike (the masked 128x128 entries are not flagged fused, but do).
    dkdv, dq = (replace(lookup(target_of(q.device), f"bwd_{kernel}", bs, bs, D, padded),
                        gluon=False) for kernel in ("dkdv", "dq"))  # fmt: skip
    if dkdv.launch_kwargs() != dq.launch_kwargs():
        pytest.skip(f"this GPU's configs do not launch alike: {dkdv}, {dq}")
    fused_grids = []
    kernel = bwd.block_sparse_attn_bwd_fused_kernel

    class Counted:  # the fused kernel, its launches recorded
        def __getitem__(self, grid):
            fused_grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(bwd, "block_sparse_attn_bwd_fused_kernel", Counted())
    args = (do, q, k, v, o, lse, idx, cnt, sizes, bs, bs, D**-0.5)
    with override(bwd_dkdv=dkdv, bwd_dq=dq, fused=False):
        two = bwd.block_sparse_attn_bwd(*args, padding_finite=tma)
    assert fused_grids == []
    with override(bwd_dkdv=dkdv, bwd_dq=dq, fused=True):
        one = bwd.block_sparse_attn_bwd(*args, padding_finite=tma)
    assert len(fused_grids) == 1
    for name, a, b in zip(("dq", "dk", "dv"), two, one):
        assert torch.equal(a, b), name


def _mapped_grads(q, k, v, do, idx, cnt, sizes, bq, bk, *, bshd, fused, seed=0):
    """The backward twice, in the engine's row order and written through random row maps
    (``GradRows``: every real key row and a random subset of query rows sent to a random row
    of a shorter natural tensor; dq stored [B, S, H, D] when ``bshd``, dk and dv when not);
    returns both, and the maps."""
    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.configs import override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd
    from vidsparse.ops.block_sparse_attn.grad_rows import GradRows

    gen = torch.Generator().manual_seed(seed)
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bq, bk, D**-0.5, padding_finite=True)
    real_k = torch.ones(Skv, dtype=torch.bool)
    if sizes is not None:
        real_k = (torch.arange(Skv) % bk) < sizes.cpu().long().repeat_interleave(bk)
    real_q = torch.rand(Sq, generator=gen) < 0.8  # the rest: quiet rows sent nowhere

    def row_map(real):
        rows = torch.full(real.shape, -1, dtype=torch.int32)
        rows[real] = torch.randperm(int(real.sum()), generator=gen).to(torch.int32)
        return rows.to(q.device)

    q_rows, kv_rows = row_map(real_q), row_map(real_k)

    maps = GradRows(q_rows, kv_rows, int(real_q.sum()), int(real_k.sum()), bshd, not bshd)
    args = (do, q, k, v, o, lse, idx, cnt, sizes, bq, bk, D**-0.5)
    with override(fused=fused, overlap=False):
        plain = block_sparse_attn_bwd(*args, padding_finite=True)
        mapped = block_sparse_attn_bwd(*args, padding_finite=True, grad_rows=maps)
    return plain, mapped, maps


def _check_mapped(plain, mapped, maps):
    """Each mapped gradient row is the engine-order row sent there, to the bit; the layout is
    the one asked for."""
    (q_len, q_bshd), (kv_len, kv_bshd) = maps.layouts()
    for name, a, b, rows, n, bshd in zip(("dq", "dk", "dv"), plain, mapped,
                                         (maps.q_rows, maps.kv_rows, maps.kv_rows),
                                         (q_len, kv_len, kv_len),
                                         (q_bshd, kv_bshd, kv_bshd)):  # fmt: skip
        B, H, _, D = a.shape
        assert b.shape == (B, H, n, D), name
        assert b.transpose(1, 2).is_contiguous() if bshd else b.is_contiguous(), name
        keep = rows >= 0
        assert torch.equal(b[:, :, rows[keep].long()], a[:, :, keep]), name


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", ["kv_sizes", "key_tails", "batch"])
def test_gradients_written_through_row_maps(case, fused):
    """``GradRows``: the Triton kernels store each gradient row at the row its map gives, in
    the layout asked for, and nothing else changes (two launches and the fused one)."""
    B, Bi, H, Sq, Skv, D, bq, bk, padded = FUSED_CASES[case]
    q, k, v = make_qkv(B, H, Sq, Skv, D, dtype=torch.float16, device="cpu")
    do = torch.randn_like(q)
    idx, cnt = make_lists(Bi, H, Sq // bq, Skv // bk, density=0.5, device="cpu", empty_rows=1)
    sizes = None
    if padded:
        sizes = torch.randint(0, bk + 1, (Skv // bk,), dtype=torch.int32)
        sizes[0] = bk
    for bshd in (False, True):
        _check_mapped(*_mapped_grads(q, k, v, do, idx, cnt, sizes, bq, bk, bshd=bshd,
                                     fused=fused))  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_op_takes_row_maps_on_every_backend(backend, request):
    """The backward custom op with ``q_rows``, ``kv_rows``: the same rows as its engine-order
    gradients, moved, on both backends (padding keys' rows sent nowhere); its fake agrees
    (``torch.library.opcheck``)."""
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU CI")
    import vidsparse.ops.block_sparse_attn.interface  # noqa: F401 - registers the ops
    from vidsparse.ops.block_sparse_attn.epilogue import MAX_TENSORS
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

    gen = torch.Generator().manual_seed(3)
    H, S, D, bs = 2, 64, 16, 16
    q, k, v = make_qkv(1, H, S, S, D, dtype=torch.float32, device="cpu")
    do = torch.randn_like(q)
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.5, device="cpu", empty_rows=1)
    sizes = torch.tensor([bs, 5, bs, 9], dtype=torch.int32)
    o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, D**-0.5)
    real = (torch.arange(S) % bs) < sizes.long().repeat_interleave(bs)
    q_rows = torch.randperm(S, generator=gen).to(torch.int32)
    kv_rows = torch.full((S,), -1, dtype=torch.int32)
    kv_rows[real] = torch.randperm(int(real.sum()), generator=gen).to(torch.int32)
    op = torch.ops.vidsparse.block_sparse_attn_bwd.default
    args = (do, q, k, v, o, lse, q.new_empty(0), idx, cnt, sizes, bs, bs, D**-0.5, backend,
            True, "none", *[None] * MAX_TENSORS)  # fmt: skip
    plain = op(*args)[:3]
    layout = [S, int(real.sum()), 1, 0]
    mapped = op(*args, q_rows, kv_rows, layout)[:3]
    assert mapped[0].transpose(1, 2).is_contiguous()  # q_bshd
    for a, b, rows, keep in ((plain[0], mapped[0], q_rows, q_rows >= 0),
                             (plain[1], mapped[1], kv_rows, kv_rows >= 0),
                             (plain[2], mapped[2], kv_rows, kv_rows >= 0)):  # fmt: skip
        assert torch.equal(b[:, :, rows[keep].long()], a[:, :, keep])
    if backend == "torch":
        torch.library.opcheck(op, (*args, q_rows, kv_rows, layout),
                              test_utils=("test_schema", "test_faketensor"))  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("sizes", [False, True])
def test_internal_entry_sends_gradients_to_their_targets(sizes):
    """``grads_to``: the engine's q, k, v are a row permutation of natural tensors (stored
    [B, S, H, D]) with padding rows; the gradients reach the natural tensors, in their layout,
    equal to autograd through the permutation (the same rows moved: to the bit), and the copies
    get none. On this machine's backend (the interpreter where ``TRITON_INTERPRET`` is set)."""
    from vidsparse.ops.block_sparse_attn.grad_rows import GradTargets
    from vidsparse.ops.block_sparse_attn.interface import block_sparse_attn_unchecked

    gen = torch.Generator().manual_seed(5)
    H, S, D, bs, n = 2, 64, 16, 16, 50
    natural = [torch.randn(1, n, H, D, generator=gen).transpose(1, 2).requires_grad_()
               for _ in range(3)]  # fmt: skip
    rows = torch.full((S,), -1, dtype=torch.int32)
    slots = torch.randperm(S, generator=gen)[:n]
    rows[slots] = torch.arange(n, dtype=torch.int32)
    block_sizes = None
    if sizes:  # real rows first in each block: key-block sizes mask the rest
        slots = torch.cat([torch.arange(i * bs, i * bs + c) for i, c in enumerate((16, 9, 16, 9))])
        rows = torch.full((S,), -1, dtype=torch.int32)
        rows[slots] = torch.randperm(n, generator=gen).to(torch.int32)
        block_sizes = torch.tensor([16, 9, 16, 9], dtype=torch.int32)
    pad = rows < 0

    def copy_of(x):
        return x[:, :, rows.clamp_min(0).long()].masked_fill(pad[:, None], 0.0)

    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.5, device="cpu", empty_rows=1)
    kwargs = dict(block_q=bs, block_kv=bs, kv_block_sizes=block_sizes, scale=D**-0.5,
                  padding_finite=True)  # fmt: skip
    o_ref, _ = block_sparse_attn_unchecked(*map(copy_of, natural), idx, cnt, **kwargs)
    do = torch.randn(o_ref.shape, generator=gen)
    expected = torch.autograd.grad(o_ref, natural, do)
    copies = [copy_of(x.detach()).requires_grad_() for x in natural]
    o, _ = block_sparse_attn_unchecked(*copies, idx, cnt, **kwargs,
                                       grads_to=GradTargets(*natural, rows, rows))  # fmt: skip
    assert torch.equal(o, o_ref)
    got = torch.autograd.grad(o, [*natural, *copies], do, allow_unused=True)
    for a, b, x in zip(got[:3], expected, natural):
        assert a.stride() == x.stride() and torch.equal(a, b)
    assert got[3:] == (None, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [64, 128])
def test_gpu_gradients_written_through_row_maps(bs):
    """On the GPU: at 64 with key-block sizes (VSA's Triton pair, TMA loads), at 128 without
    (where the Gluon kernels would run: mapped gradients take the Triton ones)."""
    q, k, v, do, idx, cnt, sizes = _gpu_problem(2048, bs, padded=bs == 64)
    for bshd in (False, True):
        _check_mapped(*_mapped_grads(q, k, v, do, idx, cnt, sizes, bs, bs, bshd=bshd,
                                     fused=None))  # fmt: skip


def test_overlap_policy():
    """Where dQ runs on a side stream beside dK/dV (``bwd.overlapped``): on a GPU where both
    configs ask or an override says so; never off a GPU (no streams), whatever is asked."""
    from vidsparse.ops.block_sparse_attn.bwd import overlapped
    from vidsparse.ops.block_sparse_attn.configs import KernelConfig, override

    on, off = KernelConfig(overlap=True), KernelConfig()
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert overlapped(on, on, cuda)
    assert not overlapped(on, off, cuda) and not overlapped(off, on, cuda)
    assert not overlapped(on, on, cpu)
    with override(overlap=True):
        assert overlapped(off, off, cuda) and not overlapped(on, on, cpu)
    with override(overlap=False):
        assert not overlapped(on, on, cuda)

    from vidsparse.ops.block_sparse_attn.configs import lookup
    from vidsparse.utils.device import CPU_INTERPRETER, Target

    def table(target, block, masked):
        return [lookup(target, f"bwd_{kernel}", block, block, 128, masked)
                for kernel in ("dkdv", "dq")]  # fmt: skip

    hopper = Target("cuda", 90)
    assert overlapped(*table(hopper, 128, False), cuda)  # the Gluon pair
    assert overlapped(*table(hopper, 64, True), cuda)  # VSA's pair
    assert not overlapped(*table(Target("cuda", 80), 128, False), cuda)  # not timed there
    assert not overlapped(*table(CPU_INTERPRETER, 64, True), cpu)


# (block, key-block sizes, TMA): the Gluon kernels (128x128), the Triton ones at 64x64 with
# padding keys (VSA's), the Triton 128x128 pair as two launches (pointer loads).
OVERLAP_CASES = {"gluon128": (128, False, True), "triton64_sizes": (64, True, True),
                 "triton128_pointers": (128, False, False)}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(OVERLAP_CASES.values()), ids=list(OVERLAP_CASES))
def test_gpu_overlapped_backward_is_bit_identical(case):
    """dQ on a side stream beside dK/dV against one stream: the same bits, eagerly and replayed
    from a CUDA graph (the fork and join captured), with fresh do between replays."""
    from vidsparse.ops.block_sparse_attn.bwd import block_sparse_attn_bwd
    from vidsparse.ops.block_sparse_attn.configs import override
    from vidsparse.ops.block_sparse_attn.fwd import block_sparse_attn_fwd

    bs, padded, tma = case
    D = 128
    q, k, v, do, idx, cnt, sizes = _gpu_problem(4096, bs, padded)
    o, lse = block_sparse_attn_fwd(q, k, v, idx, cnt, sizes, bs, bs, D**-0.5, padding_finite=tma)
    args = (q, k, v, o, lse, idx, cnt, sizes, bs, bs, D**-0.5)
    with override(fused=False, overlap=False):
        one = block_sparse_attn_bwd(do, *args, padding_finite=tma)
    with override(fused=False, overlap=True):
        two = block_sparse_attn_bwd(do, *args, padding_finite=tma)
        for name, a, b in zip(("dq", "dk", "dv"), one, two):
            assert torch.equal(a, b), f"{name} differs on two streams"
        static_do = do.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as capture asks
            block_sparse_attn_bwd(static_do, *args, padding_finite=tma)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = block_sparse_attn_bwd(static_do, *args, padding_finite=tma)
    for _ in range(2):
        static_do.copy_(torch.randn_like(do))
        graph.replay()
        with override(fused=False, overlap=False):
            eager = block_sparse_attn_bwd(static_do, *args, padding_finite=tma)
        for name, a, b in zip(("dq", "dk", "dv"), eager, replayed):
            assert torch.equal(a, b), f"{name} differs replayed from a graph on two streams"


@pytest.mark.parametrize(("dtype", "block", "cap"), [(torch.float16, 256, 128),
                                                     (torch.float32, 128, 64)])  # fmt: skip
def test_an_epilogue_with_blocks_above_the_kernels_largest_is_refused(
    triton_backend, monkeypatch, dtype, block, cap
):
    """Sub-blocks would change the blocks an epilogue's hooks see: a clear error, no launch."""
    from vidsparse.ops.block_sparse_attn.epilogue import Epilogue
    from vidsparse.ops.block_sparse_attn.interface import block_sparse_attn_unchecked

    _as_on_a_gpu(monkeypatch)

    q, k, v = make_qkv(1, 1, block, block, 16, dtype=dtype, device="cpu")
    idx, cnt = torch.zeros(1, 1, 1, 1, dtype=torch.int32), torch.ones(1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"epilogue's blocks must be at most {cap} tokens"):
        block_sparse_attn_unchecked(
            q, k, v, idx, cnt, block_q=block, block_kv=block, kv_block_sizes=None, scale=0.25,
            epilogue=Epilogue(),
        )  # fmt: skip
