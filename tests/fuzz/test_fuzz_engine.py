"""Fuzz the engine (``block_sparse_attn``) against the fp64 dense reference: shapes, dtypes,
block sizes, list contents (valid, invalid, and lists no check saw), on the torch backend and
in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from fuzzing import (
    backend,
    block_lists,
    check_against_dense,
    check_gradients,
    count_case,
    examples,
    generator,
)
from hypothesis import given
from hypothesis import strategies as st

import vidsparse
from helpers import lists_without_bad_entries
from vidsparse.ops.block_sparse_attn import block_sparse_attn_unchecked


@st.composite
def problems(draw, *, triton: bool):
    """(q, k, v, kv_indices, kv_counts, block_q, block_kv, kv_block_sizes, scale)."""
    if triton:  # the interpreter: Triton's head dims, 16-row blocks at least (tl.dot)
        dtype = torch.float32
        d = draw(st.sampled_from([16, 32]))
        bq, bk = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
        b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
        nq, nk = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    else:
        dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
        d = draw(st.integers(1, 24))
        bq, bk = (draw(st.sampled_from([1, 2, 4, 8, 16])) for _ in range(2))
        b, h = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        nq, nk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    bi = draw(st.sampled_from([1, b]))
    idx, cnt = draw(block_lists(bi, h, nq, nk))
    g = generator(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([None, 0.05, 0.3, 1.0, 3.0]))
    amp = draw(st.sampled_from([0.1, 1.0, 4.0]))
    q = (amp * torch.randn(b, h, nq * bq, d, generator=g)).to(dtype)
    k = (amp * torch.randn(b, h, nk * bk, d, generator=g)).to(dtype)
    v = torch.randn(b, h, nk * bk, d, generator=g).to(dtype)
    sizes = None
    if draw(st.booleans()):
        sizes = torch.randint(0, bk + 1, (nk,), generator=g, dtype=torch.int32)
    return q, k, v, idx, cnt, bq, bk, sizes, scale


@examples(150)
@given(problems(triton=False))
def test_torch_backend_matches_dense_fp64(problem):
    count_case()
    q, k, v, idx, cnt, bq, bk, sizes, scale = problem
    with backend("torch"):
        out, lse = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(bq, bk),
                                               kv_block_sizes=sizes, scale=scale,
                                               return_lse=True)  # fmt: skip
    check_against_dense(out, lse, q, k, v, idx, cnt, bq, bk, sizes, scale)


@pytest.mark.interpreter
@examples(12)
@given(problems(triton=True), st.booleans())
def test_interpreter_matches_dense_fp64(problem, backward):
    count_case()
    q, k, v, idx, cnt, bq, bk, sizes, scale = problem
    q, k, v = (x.requires_grad_(backward) for x in (q, k, v))
    with backend("triton"):
        out, lse = vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(bq, bk),
                                               kv_block_sizes=sizes, scale=scale,
                                               return_lse=True)  # fmt: skip
        if backward:
            grads = torch.autograd.grad(out.sum(), (q, k, v))
    check_against_dense(out.detach(), lse, q.detach(), k.detach(), v.detach(), idx, cnt, bq, bk,
                         sizes, scale)  # fmt: skip
    if backward:
        check_gradients(grads, q, k, v, idx, cnt, bq, bk, sizes, scale)


# ---- invalid input: the same class on every backend, before any launch -----------------------


def _spoil(draw, args):
    """One spoiled argument of a valid call: (name of the spoiled thing, args)."""
    q, k, v, idx, cnt, bq, bk, sizes, scale = args
    how = draw(st.sampled_from([
        "index past NK", "negative index", "duplicate", "count past K", "negative count",
        "index dtype", "count shape", "k length", "qkv dtype", "scale", "block", "sizes",
        "return_lse", "device",
    ]))  # fmt: skip
    nk = k.shape[2] // bk
    kw = {}
    idx, cnt = idx.clone(), cnt.clone()
    row = tuple(draw(st.integers(0, n - 1)) for n in cnt.shape)
    if how in ("index past NK", "negative index", "duplicate") and not idx.shape[-1]:
        how = "no-op"  # lists of width 0 hold no entry to spoil
    if how in ("index past NK", "negative index", "duplicate") and idx.shape[-1]:
        cnt[row] = idx.shape[-1]
        slot = draw(st.integers(0, idx.shape[-1] - 1))
        if how == "duplicate" and idx.shape[-1] >= 2:
            idx[row] = torch.arange(idx.shape[-1], dtype=torch.int32) % nk
            idx[(*row, slot)] = idx[(*row, (slot + 1) % idx.shape[-1])]
        elif how == "negative index":
            idx[(*row, slot)] = draw(st.integers(-(2**31), -1))
        else:
            idx[(*row, slot)] = draw(st.integers(nk, 2**31 - 1))
        if how == "duplicate" and idx.shape[-1] < 2:
            how = "no-op"
    elif how == "count past K":
        cnt[row] = draw(st.integers(idx.shape[-1] + 1, 2**31 - 1))
    elif how == "negative count":
        cnt[row] = draw(st.integers(-(2**31), -1))
    elif how == "index dtype":
        idx = idx.to(draw(st.sampled_from([torch.int64, torch.int16, torch.float32])))
    elif how == "count shape":
        cnt = cnt[..., :-1]
    elif how == "k length":
        k, v = k[:, :, :-1], v[:, :, :-1]
        if k.shape[2] % bk == 0:
            how = "no-op"
    elif how == "qkv dtype":
        v = v.to(torch.float64 if v.dtype != torch.float64 else torch.float32)
    elif how == "scale":
        scale = draw(st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, "x", True]))
    elif how == "block":
        bq = draw(st.sampled_from([0, -16, 48, 3]))
    elif how == "sizes":
        sizes = torch.full((nk,), bk + 1, dtype=torch.int32)
    elif how == "return_lse":
        kw["return_lse"] = draw(st.sampled_from(["no", 1, None]))
    elif how == "device":
        cnt = cnt.to("meta")
    return how, (q, k, v, idx, cnt, bq, bk, sizes, scale), kw


@st.composite
def spoiled(draw):
    return _spoil(draw, draw(problems(triton=True)))


@examples(60)
@given(spoiled())
def test_invalid_input_same_error_on_every_backend(case):
    """A spoiled argument gives a ValueError or TypeError (never another exception, never a
    result) on the torch path and the Triton path alike, with the same message."""
    count_case()
    how, (q, k, v, idx, cnt, bq, bk, sizes, scale), kw = case
    errors = []
    for name in ("torch", "triton"):
        with backend(name):
            try:
                vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(bq, bk),
                                            kv_block_sizes=sizes, scale=scale, **kw)  # fmt: skip
            except (ValueError, TypeError) as exc:
                errors.append((type(exc), str(exc)))
            else:
                errors.append(None)
    if how == "no-op":
        return
    assert errors[0] is not None, how
    assert errors[0] == errors[1], (how, errors)


# ---- lists that no check saw: memory-safe, out-of-range entries contribute nothing ----------


@st.composite
def hostile(draw, *, triton: bool):
    q, k, v, idx, cnt, bq, bk, sizes, scale = draw(problems(triton=triton))
    nk, width = k.shape[2] // bk, idx.shape[-1]
    g = generator(draw(st.integers(0, 2**31 - 1)))
    idx, cnt = idx.clone(), cnt.clone()
    if width:
        bad = torch.rand(idx.shape, generator=g) < draw(st.sampled_from([0.1, 0.5]))
        junk = torch.randint(-(2**31), 2**31 - 1, idx.shape, generator=g, dtype=torch.int32)
        junk = torch.where(junk.abs() < nk, junk + nk, junk)  # out of [0, nk)
        idx = torch.where(bad, junk, idx)
    if draw(st.booleans()):
        cnt = torch.where(torch.rand(cnt.shape, generator=g) < 0.3, 2**31 - 1, cnt)
        cnt = cnt.to(torch.int32)
    return q, k, v, idx, cnt, bq, bk, sizes, scale


def _hostile_case(problem, name):
    q, k, v, idx, cnt, bq, bk, sizes, scale = problem
    scale = vidsparse.utils.checks.softmax_scale(scale, q.shape[-1])
    with backend(name):
        out, lse = block_sparse_attn_unchecked(q, k, v, idx, cnt, block_q=bq, block_kv=bk,
                                               kv_block_sizes=sizes, scale=scale)  # fmt: skip
    clean_idx, clean_cnt = lists_without_bad_entries(idx, cnt, k.shape[2] // bk)
    check_against_dense(out, lse, q, k, v, clean_idx, clean_cnt, bq, bk, sizes, scale)


@examples(60)
@given(hostile(triton=False))
def test_torch_path_gives_out_of_range_entries_no_weight(problem):
    count_case()
    _hostile_case(problem, "torch")


@pytest.mark.interpreter
@examples(10)
@given(hostile(triton=True))
def test_kernels_give_out_of_range_entries_no_weight(problem):
    count_case()
    _hostile_case(problem, "triton")
