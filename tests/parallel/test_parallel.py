"""Ulysses sequence parallelism (``vidsparse.parallel``) on the CPU.

Multi-process cases: gloo groups of 2 and of 4 processes, each spawned once for the module
(``WORLDS``); every rank builds the same seeded full-size inputs, runs the sharded op on its
sequence slice and compares its output and gradient shards with the single-process result it
computes itself (torch backend, fp32). The same scenarios run at both sizes: head counts and
sequence lengths are chosen (or derived from the world size) to divide by 2 and 4. The parent
test process only reads their verdicts, one pytest case per scenario and world size.

In this process: the error without a process group. The other argument errors that need no
second process are in ``test_parallel_errors.py``.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gloo import spawn_gloo
from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.masks.stripe import StripeSpec
from vidsparse.parallel import (
    UlyssesAttention,
    head_to_seq,
    seq_to_head,
    shard_sequence,
    ulysses_attention,
    ulysses_block_sparse_attn,
    ulysses_stripe_attn,
    ulysses_video_sparse_attn,
)

WORLDS = (2, 4)
FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}
HAS_STRIPE = importlib.util.find_spec("vidsparse.ops.stripe_attn") is not None
STRIPE_SKIP = "vidsparse.ops.stripe_attn is not in this tree yet (written concurrently)"
# Grids whose token counts divide by every world size of WORLDS. VSA: 5 x 6 x 6 = 180 tokens,
# every axis ends in a partial 4 x 4 x 4 tile (padded_len 512); PSA: 192 tokens (+ 8 text).
VSA_GRID = VideoGrid((5, 6, 6), tile=(4, 4, 4))
PSA_GRID = VideoGrid((4, 6, 8), tile=(2, 4, 4))  # block grid 2 x 2 x 2, partial in H
PSA_SPECS = [StripeSpec(1, 0, None, 1, 0, None), StripeSpec(1, 0, 1, 2, 0, 3)]


# ---------------------------------------------------------------------------------------------
# helpers used inside the worker processes
# ---------------------------------------------------------------------------------------------


def _world() -> int:
    return dist.get_world_size()


def _to_layout(x_bhsd: torch.Tensor, layout: str) -> torch.Tensor:
    return x_bhsd.transpose(1, 2) if layout == "bshd" else x_bhsd


def _shard(x_bhsd: torch.Tensor, layout: str) -> torch.Tensor:
    """This rank's sequence slice of a full ``[B, H, S, D]`` tensor, in ``layout``."""
    return shard_sequence(_to_layout(x_bhsd, layout), layout=layout)


class _Mismatches:
    """Collects comparison failures instead of raising at the first one.

    Raising halfway would let this rank skip collectives (the backward's all-to-alls) that the
    other ranks, whose comparison passed, still enter: the ranks would desynchronise and gloo
    would abort the process. So every scenario runs to its end and raises once, at the end.
    """

    def __init__(self):
        self.messages: list[str] = []

    def close(self, name: str, actual, expected, **tol) -> None:
        try:
            torch.testing.assert_close(actual, expected, **(tol or FP32_TOL))
        except AssertionError as exc:
            self.messages.append(f"{name}: {exc}")

    def equal(self, name: str, actual, expected) -> None:
        self.close(name, actual, expected, rtol=0, atol=0)

    def raise_if_any(self) -> None:
        if self.messages:
            raise AssertionError("\n".join(self.messages))


def _sharded_run(sharded_fn, inputs: dict, layout: str, grad_o: torch.Tensor | None):
    """``sharded_fn`` on this rank's shards of ``inputs``; with ``grad_o`` (the full output's
    gradient) also its backward. ``(out, {name: input grad shard})``."""
    local = {n: _shard(x, layout).detach().clone().requires_grad_(True) for n, x in inputs.items()}
    out = sharded_fn(**local)
    o = out[0] if isinstance(out, tuple) else out
    if grad_o is not None:
        (o * _shard(grad_o, layout)).sum().backward()
    return out, {n: x.grad for n, x in local.items()}


def _compare_with_single_process(full_fn, sharded_fn, inputs: dict, layout: str) -> None:
    """Forward and backward of ``full_fn`` on the full inputs and of ``sharded_fn`` on this
    rank's shards; the output shard and every gradient shard must match (fp32 tolerance).

    ``inputs``: name -> full ``[B, H, S, D]`` tensor (q, k, v, gate ...). Both functions return
    ``o`` or ``(o, lse)``; ``lse`` is compared too (it carries no gradient).
    """
    full = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()}
    ref = full_fn(**full)
    ref_o = ref[0] if isinstance(ref, tuple) else ref
    grad_o = torch.randn(ref_o.shape, generator=torch.Generator().manual_seed(7))
    (ref_o * grad_o).sum().backward()
    out, grads = _sharded_run(sharded_fn, inputs, layout, grad_o)
    check = _Mismatches()
    _check_outputs(check, out, ref, layout)
    for name in inputs:
        check.close(f"d{name}", grads[name], _shard(full[name].grad, layout))
    check.raise_if_any()


def _compare_forward_only(full_fn, sharded_fn, inputs: dict, layout: str) -> None:
    """Inference (no autograd): the output (and lse) shard equals the single-process result."""
    with torch.no_grad():
        ref = full_fn(**inputs)
        out = sharded_fn(**{n: _shard(x, layout) for n, x in inputs.items()})
    check = _Mismatches()
    _check_outputs(check, out, ref, layout)
    check.raise_if_any()


def _check_outputs(check: _Mismatches, out, ref, layout: str) -> None:
    """Compare ``o`` (and ``lse``) shards with the full result."""
    ref_o, ref_lse = ref if isinstance(ref, tuple) else (ref, None)
    o, lse = out if isinstance(out, tuple) else (out, None)
    check.close("o", o, _shard(ref_o, layout))
    if ref_lse is not None:
        # lse [B, H, S] travels as a D = 1 tensor: [B, S/P, H] (bshd) or [B, H, S/P] (bhsd).
        check.close("lse", lse, _shard(ref_lse.unsqueeze(-1), layout).squeeze(-1))


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qkv(B, H, S, D, *, seed=0, gate=False) -> dict:
    names = ("q", "k", "v", "gate") if gate else ("q", "k", "v")
    return {n: _randn(B, H, S, D, seed=seed + i) for i, n in enumerate(names)}


def _psa_specs(H: int) -> list:
    return [PSA_SPECS[h % 2] if h % 3 else StripeSpec.dense() for h in range(H)]


# ---------------------------------------------------------------------------------------------
# multi-process scenarios (each runs on every rank; raise on failure)
# ---------------------------------------------------------------------------------------------


def _heads(pad: bool) -> int:
    """4 heads (1 or 2 a rank); with ``pad``, one more than the world size (3 heads padded to
    4 at world 2; 5 padded to 8 at world 4, where the last rank holds padding heads only)."""
    return _world() + 1 if pad else 4


def _block_sparse_case(
    layout: str, batch_lists: int, block_size, return_lse: bool, pad: bool = False
) -> None:
    from vidsparse.ops.block_sparse_attn import block_sparse_attn

    B, H, S, D = 2, _heads(pad), 128, 16
    block_q, block_kv = (block_size, block_size) if isinstance(block_size, int) else block_size
    NQ, NK = S // block_q, S // block_kv
    gen = torch.Generator().manual_seed(11)
    # Ragged per-head lists, empty rows included, different for every (batch, head).
    counts = torch.randint(0, NK + 1, (batch_lists, H, NQ), generator=gen)
    kv_indices, kv_counts = random_block_lists(batch_lists, H, NQ, NK, count=counts, generator=gen)
    kv_block_sizes = torch.randint(1, block_kv + 1, (NK,), generator=gen, dtype=torch.int32)
    engine = {"block_size": block_size, "kv_block_sizes": kv_block_sizes, "return_lse": return_lse}

    def full_fn(q, k, v):
        return block_sparse_attn(q, k, v, kv_indices, kv_counts, **engine)

    def sharded_fn(q, k, v):
        return ulysses_block_sparse_attn(
            q, k, v, kv_indices, kv_counts, layout=layout, pad_heads=pad, **engine
        )

    _compare_with_single_process(full_fn, sharded_fn, _qkv(B, H, S, D), layout)


def _vsa_case(
    layout: str, tiled: bool, gate: bool = True, pad: bool = False, fine_only: bool = False
) -> None:
    """``fine_only``: ``gate=0`` on both sides (no gate tensor travels)."""
    from vidsparse.ops.video_sparse_attn import video_sparse_attn

    grid = VSA_GRID
    inputs = _qkv(2, _heads(pad), grid.num_tokens, 16, seed=20, gate=gate)
    if tiled:  # tile order, padding slots zero, as grid.tile makes it
        inputs = {n: grid.tile(x, dim=-2) for n, x in inputs.items()}
    vsa = {"sparsity": 0.5, "tiled": tiled}

    def full_fn(q, k, v, gate=None):
        return video_sparse_attn(q, k, v, grid, gate=0 if fine_only else gate, **vsa)

    def sharded_fn(q, k, v, gate=None):
        return ulysses_video_sparse_attn(
            q, k, v, grid, gate=0 if fine_only else gate, layout=layout, pad_heads=pad, **vsa
        )

    _compare_with_single_process(full_fn, sharded_fn, inputs, layout)


def _stripe_case(layout: str, pad: bool = False) -> None:
    from vidsparse.ops.stripe_attn import stripe_attn

    text_tokens, H = 8, _heads(pad)
    specs = _psa_specs(H)
    kwargs = {"spatial_unit": "row", "text_tokens": text_tokens, "return_lse": True}

    def full_fn(q, k, v):
        return stripe_attn(q, k, v, PSA_GRID, specs, **kwargs)

    def sharded_fn(q, k, v):
        return ulysses_stripe_attn(q, k, v, PSA_GRID, specs, layout=layout, pad_heads=pad, **kwargs)

    inputs = _qkv(1, H, PSA_GRID.num_tokens + text_tokens, 16, seed=30)
    _compare_with_single_process(full_fn, sharded_fn, inputs, layout)


def _generic_case(layout: str, pad: bool = False) -> None:
    """Any attention function composes: SDPA with a per-token bias on v (an extra tensor,
    sharded like q), through the UlyssesAttention handle (shapes all-gathered and checked)."""
    H = _heads(pad)
    ulysses = UlyssesAttention(layout=layout, check_shards=True, pad_heads=pad)
    seen = []

    def attn(heads, q, k, v, bias):
        seen.append(heads)
        return F.scaled_dot_product_attention(q, k, v + bias)

    def full_fn(q, k, v, bias):
        return attn(slice(0, H), q, k, v, bias)

    def sharded_fn(q, k, v, bias):
        return ulysses(attn, q, k, v, bias)

    inputs = {**_qkv(1, H, 8, 8), "bias": _randn(1, H, 8, 8, seed=3)}
    _compare_with_single_process(full_fn, sharded_fn, inputs, layout)
    per_rank = -(-H // _world())  # the padded range: rank r computes heads r*h .. (r+1)*h - 1
    rank = dist.get_rank()
    assert seen[1] == slice(rank * per_rank, (rank + 1) * per_rank), seen


def _comm_case(layout: str) -> None:
    """The exchanges alone: all_to_all and all_gather both give exactly this rank's heads of
    the full tensor, round-trip exactly, and equal the packing by ``torch.stack`` and autograd
    all-to-all (what the training path did before the row-copy Functions), forward and
    backward, bit for bit."""
    P, rank = _world(), dist.get_rank()
    x_full = _randn(2, 2 * P, 12, 3, seed=40)  # [B, H, S, D]: 2 heads a rank
    heads = slice(rank * 2, rank * 2 + 2)
    grad = _randn(2, 2, 12, 3, seed=41 + rank)  # a different upstream gradient on every rank
    check = _Mismatches()
    results = {}
    for comm in ("all_to_all", "all_gather", "stack"):
        x = _shard(x_full, layout).clone().requires_grad_(True)
        if comm == "stack":
            y = _stack_exchange(x, layout)
        else:
            y = seq_to_head(x, layout=layout, comm=comm)  # [B, H/P, S, D]
            check.equal(f"{comm} round trip", head_to_seq(y, layout=layout, comm=comm), x)
        check.equal(f"{comm} seq_to_head", y, x_full[:, heads])
        (y * grad).sum().backward()
        results[comm] = x.grad
    # d/dx sum(seq_to_head(x) * g) is head_to_seq(g): every rank's g scattered back.
    expected = torch.zeros_like(x_full)
    expected[:, heads] = grad
    dist.all_reduce(expected)  # every rank's heads
    for comm, g in results.items():
        check.equal(f"{comm} grad", g, _shard(expected, layout))
    check.raise_if_any()


def _stack_exchange(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The former training path of ``seq_to_head``: ``[P, B, H/P, S/P, D]`` chunks by a
    permuted view and a copy, torch's differentiable all-to-all, a reshape copy out."""
    from torch.distributed.nn.functional import all_to_all_single

    P = _world()
    B, S, H, D = x.shape if layout == "bshd" else x.transpose(1, 2).shape
    bhsd = x.transpose(1, 2) if layout == "bshd" else x
    send = bhsd.reshape(B, P, H // P, S, D).transpose(0, 1).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // P, P * S, D)


def _mixed_dtypes_case(layout: str) -> None:
    """Extras of another dtype (one buffer and collective per dtype) and extras that need no
    gradient (theirs does not travel back) through one call: outputs and gradients."""
    inputs = _qkv(1, 4, 8, 8, seed=80)
    weight = _randn(1, 4, 8, 8, seed=84)  # float32, no gradient: travels with q, k, v
    bias = _randn(1, 4, 8, 8, seed=85).double()  # float64: a buffer of its own

    def attn(heads, q, k, v, weight, bias):
        return F.scaled_dot_product_attention(q, k, v * weight) + bias.float()

    full = {n: x.clone().requires_grad_(True) for n, x in inputs.items()}
    ref = attn(None, **full, weight=weight, bias=bias)
    grad_o = _randn(*ref.shape, seed=86)
    (ref * grad_o).sum().backward()
    local = {n: _shard(x, layout).clone().requires_grad_(True) for n, x in inputs.items()}
    extra = (_shard(weight, layout), _shard(bias, layout))
    out = ulysses_attention(attn, *local.values(), *extra, layout=layout)
    (out * _shard(grad_o, layout)).sum().backward()
    check = _Mismatches()
    check.close("o", out, _shard(ref, layout))
    for n in inputs:
        check.close(f"d{n}", local[n].grad, _shard(full[n].grad, layout))
    check.raise_if_any()


def _row_kernel_case(layout: str) -> None:
    """Training through the exchange with the Triton row copy (the GPU's packing) forced in
    the interpreter: outputs and gradients (VSA: q, k, v, gate; the engine: lse too, a D = 1
    row) equal those of the ``copy_`` packing bit for bit, and the single-process result."""
    from vidsparse.ops.block_sparse_attn import block_sparse_attn
    from vidsparse.ops.video_sparse_attn import video_sparse_attn

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("this scenario needs TRITON_INTERPRET=1 (set by conftest)")
    grid = VSA_GRID
    idx, cnt = random_block_lists(1, 4, 8, 8, density=0.5, generator=torch.Generator())
    engine = {"block_size": 16, "return_lse": True}
    cases = [
        (
            lambda q, k, v, gate: video_sparse_attn(q, k, v, grid, gate=gate, sparsity=0.5),
            lambda q, k, v, gate: ulysses_video_sparse_attn(
                q, k, v, grid, gate=gate, sparsity=0.5, layout=layout
            ),
            _qkv(1, 4, grid.num_tokens, 16, seed=90, gate=True),
        ),
        (
            lambda q, k, v: block_sparse_attn(q, k, v, idx, cnt, **engine),
            lambda q, k, v: ulysses_block_sparse_attn(q, k, v, idx, cnt, layout=layout, **engine),
            _qkv(1, 4, 128, 16, seed=92),
        ),
    ]
    check = _Mismatches()
    for full_fn, sharded_fn, inputs in cases:
        grad_o = _randn(*inputs["q"].shape, seed=91)
        kernel_out, kernel_grads = _with_row_kernel(
            _sharded_run, sharded_fn, inputs, layout, grad_o
        )
        out, grads = _sharded_run(sharded_fn, inputs, layout, grad_o)
        check.equal("o (row kernel vs copy_)", kernel_out, out)
        for n in inputs:
            check.equal(f"d{n} (row kernel vs copy_)", kernel_grads[n], grads[n])
        _compare_with_single_process(full_fn, sharded_fn, inputs, layout)
    check.raise_if_any()


def _with_row_kernel(fn, *args):
    """``fn(*args)`` with the exchange's copies made by the Triton row copy on the CPU (the
    interpreter); checks that they were."""
    from vidsparse.layout import permute
    from vidsparse.parallel import exchange

    launches = []
    applies, copy_rows = exchange._row_kernel_applies, permute.copy_rows

    def counting(dst, src):
        launches.append(1)
        return copy_rows(dst, src)

    exchange._row_kernel_applies, permute.copy_rows = (lambda dst: True), counting
    try:
        result = fn(*args)
    finally:
        exchange._row_kernel_applies, permute.copy_rows = applies, copy_rows
    assert launches, "the exchange did not pack by row copies"
    return result


def _overlapped_case(layout: str, grad: bool, pad: bool = False) -> None:
    """head_chunks=2: the pipelined exchange (inference) or, with autograd recording, the
    one-shot one; VSA with a gate, the engine with lse, PSA, all against one process. Two
    heads a rank per chunk group (or, with ``pad``, ``P + 1`` heads padded to ``2P``)."""
    from vidsparse.parallel import driver

    compare = _compare_with_single_process if grad else _compare_forward_only
    calls = []
    pipelined = driver.run_overlapped

    def counting(*args, **kwargs):
        calls.append(1)
        return pipelined(*args, **kwargs)

    driver.run_overlapped = counting
    try:
        _overlapped_scenarios(compare, layout, _world() + 1 if pad else 2 * _world(), pad)
    finally:
        driver.run_overlapped = pipelined
    # inference takes the pipelined exchange (3 ops); with autograd recording it never does
    assert len(calls) == (0 if grad else 3), f"pipelined path ran {len(calls)} times"


def _overlapped_scenarios(compare, layout: str, H: int, pad: bool) -> None:
    from vidsparse.ops.block_sparse_attn import block_sparse_attn
    from vidsparse.ops.stripe_attn import stripe_attn
    from vidsparse.ops.video_sparse_attn import video_sparse_attn

    grid, vsa = VSA_GRID, {"sparsity": 0.5}
    split = {"layout": layout, "head_chunks": 2, "pad_heads": pad}

    def vsa_full(q, k, v, gate):
        return video_sparse_attn(q, k, v, grid, gate=gate, **vsa)

    def vsa_sharded(q, k, v, gate):
        return ulysses_video_sparse_attn(q, k, v, grid, gate=gate, **split, **vsa)

    compare(vsa_full, vsa_sharded, _qkv(1, H, grid.num_tokens, 16, seed=60, gate=True), layout)

    gen = torch.Generator().manual_seed(61)
    counts = torch.randint(0, 9, (1, H, 8), generator=gen)
    kv_indices, kv_counts = random_block_lists(1, H, 8, 8, count=counts, generator=gen)
    engine = {"block_size": 16, "return_lse": True}

    def bsa_full(q, k, v):
        return block_sparse_attn(q, k, v, kv_indices, kv_counts, **engine)

    def bsa_sharded(q, k, v):
        return ulysses_block_sparse_attn(q, k, v, kv_indices, kv_counts, **split, **engine)

    compare(bsa_full, bsa_sharded, _qkv(2, H, 128, 16, seed=62), layout)
    specs = _psa_specs(H)

    def psa_full(q, k, v):
        return stripe_attn(q, k, v, PSA_GRID, specs)

    def psa_sharded(q, k, v):
        return ulysses_stripe_attn(q, k, v, PSA_GRID, specs, **split)

    compare(psa_full, psa_sharded, _qkv(1, H, PSA_GRID.num_tokens, 16, seed=63), layout)


def _tiled_exchange_case(layout: str, pad: bool = False) -> None:
    """Natural-order VSA and PSA in inference on the Triton path (here the interpreter): the
    exchange tiles on the way in and untiles on the way out, fused (``TiledExchange``)."""
    from vidsparse.ops.stripe_attn import stripe_attn
    from vidsparse.ops.video_sparse_attn import video_sparse_attn
    from vidsparse.parallel import ulysses

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("this scenario needs TRITON_INTERPRET=1 (set by conftest)")
    grid, H = VSA_GRID, _heads(pad)
    calls = []
    unpack = ulysses.TiledExchange.unpack

    def counting(self, recv, own, own_chunk):
        calls.append(1)
        assert recv.shape[0] == _world() - 1, "the own chunk should stay home"
        return unpack(self, recv, own, own_chunk)

    specs = _psa_specs(H)
    os.environ["VIDSPARSE_BACKEND"] = "auto"  # Triton in the interpreter
    ulysses.TiledExchange.unpack = counting
    try:
        _compare_forward_only(
            lambda q, k, v, gate: video_sparse_attn(q, k, v, grid, gate=gate, sparsity=0.5),
            lambda q, k, v, gate: ulysses_video_sparse_attn(
                q, k, v, grid, gate=gate, sparsity=0.5, layout=layout, pad_heads=pad
            ),
            _qkv(1, H, grid.num_tokens, 16, seed=70, gate=True),
            layout,
        )
        _compare_forward_only(
            lambda q, k, v: stripe_attn(q, k, v, PSA_GRID, specs),
            lambda q, k, v: ulysses_stripe_attn(
                q, k, v, PSA_GRID, specs, layout=layout, pad_heads=pad
            ),
            _qkv(1, H, PSA_GRID.num_tokens, 16, seed=71),
            layout,
        )
    finally:
        ulysses.TiledExchange.unpack = unpack
        os.environ["VIDSPARSE_BACKEND"] = "torch"
    assert len(calls) == 7, f"fused unpack ran {len(calls)} times (VSA q, k, v, gate; PSA q, k, v)"


# Bad input seen by every rank: every rank must raise the same error, and none may hang.


def _err_heads_case() -> None:
    q = _shard(_randn(1, 3, 8, 4, seed=50), "bshd")  # 3 heads on 2 or 4 ranks
    ulysses_video_sparse_attn(q, q, q, VideoGrid((2, 2, 4), tile=(1, 2, 2)), topk=1)


def _err_natural_length_case() -> None:
    grid = VideoGrid((3, 5, 7), tile=(4, 4, 4))  # 105 tokens: no equal split over 2 or 4 ranks
    q = torch.randn(1, 52, 4, 4)
    ulysses_video_sparse_attn(q, q, q, grid, sparsity=0.5)


def _err_uneven_shards_case() -> None:
    # Rank r holds r tokens more: only the opt-in all_gather of shapes can see it.
    q = torch.randn(1, 8 + dist.get_rank(), 4, 4)
    UlyssesAttention(check_shards=True)(lambda h, q, k, v: q, q, q, q)


SCENARIOS = {
    "bsa_bshd_batch_lists_lse": lambda: _block_sparse_case("bshd", 2, 16, True),
    "bsa_bhsd_shared_lists_rect_blocks": lambda: _block_sparse_case("bhsd", 1, (32, 16), False),
    "vsa_natural_bshd": lambda: _vsa_case("bshd", tiled=False),
    "vsa_natural_bhsd": lambda: _vsa_case("bhsd", tiled=False),
    "vsa_no_gate_bshd": lambda: _vsa_case("bshd", tiled=False, gate=False),
    "vsa_fine_only_bhsd": lambda: _vsa_case("bhsd", tiled=False, gate=False, fine_only=True),
    "vsa_tiled_bshd": lambda: _vsa_case("bshd", tiled=True),
    "vsa_tiled_bhsd": lambda: _vsa_case("bhsd", tiled=True),
    "generic_bshd": lambda: _generic_case("bshd"),
    "generic_bhsd": lambda: _generic_case("bhsd"),
    "mixed_dtypes_bshd": lambda: _mixed_dtypes_case("bshd"),
    "comm_bshd": lambda: _comm_case("bshd"),
    "comm_bhsd": lambda: _comm_case("bhsd"),
    "row_kernel_bshd": lambda: _row_kernel_case("bshd"),
    "row_kernel_bhsd": lambda: _row_kernel_case("bhsd"),
    # pad_heads=True: P + 1 heads (the last rank of world 4 holds padding heads only)
    "padded_bsa_bshd_lse": lambda: _block_sparse_case("bshd", 2, 16, True, pad=True),
    "padded_bsa_bhsd": lambda: _block_sparse_case("bhsd", 1, 16, False, pad=True),
    "padded_vsa_bshd": lambda: _vsa_case("bshd", tiled=False, pad=True),
    "padded_vsa_tiled_bhsd": lambda: _vsa_case("bhsd", tiled=True, pad=True),
    "padded_vsa_no_gate_bhsd": lambda: _vsa_case("bhsd", tiled=False, gate=False, pad=True),
    "padded_generic_bshd": lambda: _generic_case("bshd", pad=True),
    "err_heads": _err_heads_case,
    "err_natural_length": _err_natural_length_case,
    "err_uneven_shards": _err_uneven_shards_case,
}
if HAS_STRIPE:
    SCENARIOS["stripe_bshd"] = lambda: _stripe_case("bshd")
    SCENARIOS["stripe_bhsd"] = lambda: _stripe_case("bhsd")
    SCENARIOS["padded_stripe_bshd"] = lambda: _stripe_case("bshd", pad=True)
    SCENARIOS["overlapped_inference_bshd"] = partial(_overlapped_case, "bshd", False)
    SCENARIOS["overlapped_inference_bhsd"] = partial(_overlapped_case, "bhsd", False)
    SCENARIOS["overlapped_with_grad_bshd"] = partial(_overlapped_case, "bshd", True)
    SCENARIOS["padded_overlapped_inference_bhsd"] = partial(_overlapped_case, "bhsd", False, True)
    SCENARIOS["padded_overlapped_with_grad_bshd"] = partial(_overlapped_case, "bshd", True, True)
    SCENARIOS["tiled_exchange_bshd"] = lambda: _tiled_exchange_case("bshd")
    SCENARIOS["tiled_exchange_bhsd"] = lambda: _tiled_exchange_case("bhsd")
    SCENARIOS["padded_tiled_exchange_bshd"] = lambda: _tiled_exchange_case("bshd", pad=True)


def _all_scenarios(rank: int, world: int) -> dict:
    verdicts = {}
    for name, scenario in SCENARIOS.items():
        try:
            scenario()
            verdicts[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the parent per scenario
            verdicts[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return verdicts


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"world{world}")
def verdicts(request, tmp_path_factory):
    """Spawn the ranks of one world size once; ``{scenario: [verdict of each rank]}``."""
    world = request.param
    tmp = tmp_path_factory.mktemp(f"ulysses{world}")
    per_rank = spawn_gloo(_all_scenarios, world, tmp, "scenarios")
    return {name: [v[name] for v in per_rank] for name in SCENARIOS}


OK_SCENARIOS = [n for n in SCENARIOS if not n.startswith("err_")]


@pytest.mark.slow
@pytest.mark.parametrize("name", OK_SCENARIOS)
def test_ranks_match_single_process(verdicts, name):
    for rank, verdict in enumerate(verdicts[name]):
        assert verdict == "ok", f"rank {rank}: {verdict}"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_STRIPE, reason=STRIPE_SKIP)
def test_stripe_scenarios_ran(verdicts):
    assert {"stripe_bshd", "stripe_bhsd", "padded_stripe_bshd"} <= set(verdicts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, expected",
    [
        ("err_heads", "ValueError: Ulysses splits heads over the ranks: 3 heads"),
        ("err_natural_length", "ValueError: grid.num_tokens=105"),
        ("err_uneven_shards", "ValueError: sequence shards differ across ranks"),
    ],
)
def test_ranks_raise_the_same_error(verdicts, name, expected):
    world = len(verdicts[name])
    for rank, verdict in enumerate(verdicts[name]):
        assert verdict.startswith(expected), f"rank {rank}: {verdict}"
        assert verdict.split("\n")[0] == verdicts[name][0].split("\n")[0], "differs by rank"
    first = verdicts[name][0]
    if name == "err_heads":
        assert f"not divisible by the world size {world}. Pass pad_heads=True" in first
    if name == "err_natural_length":
        assert f"is not divisible by the world size {world}" in first and "tiled=True" in first
    if name == "err_uneven_shards":
        assert all(f"rank {r}: k=(1, {8 + r}, 4, 4)" in first for r in range(world)), first


# Unmarked, in this process: no group at all.


def test_no_process_group_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(RuntimeError, match="initialised process group"):
        ulysses_video_sparse_attn(q, q, q, VideoGrid((2, 2, 2), tile=(1, 2, 2)), topk=1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        seq_to_head(q)
    with pytest.raises(RuntimeError, match="initialised process group"):
        _ = UlyssesAttention().world_size
