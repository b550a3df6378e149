"""The order in which the persistent dK/dV and dQ kernels walk their blocks
(``lists.snake_order``, ``lists.banded_order``, ``lists.cached_dkdv_walk``): permutations
whose programs' totals stay within one block's length (snake) or two (banded, each wave among
neighbours); and the launches (``bwd_sm90.kernel_args`` on meta tensors). On the CPU (the
kernels themselves: ``test_gluon_bwd.py``, on a Hopper GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helpers import make_lists
from vidsparse.ops.block_sparse_attn.lists import (
    banded_order,
    cached_dkdv_walk,
    cached_transpose,
    snake_order,
)
from vidsparse.testing import reading_methods_watched


def _totals(lengths: torch.Tensor, order: torch.Tensor, programs: int) -> torch.Tensor:
    """Each program's total length when program p takes entries p, p + programs, ..."""
    walked = lengths.flatten()[order.long()]
    owner = torch.arange(order.numel()) % programs
    return torch.zeros(programs, dtype=walked.dtype).index_add_(0, owner, walked)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=400),
    programs=st.integers(1, 140),
)
def test_snake_order_is_a_permutation_with_totals_within_one_block(lengths, programs):
    lengths = torch.tensor(lengths)
    order = snake_order(lengths, programs)
    assert order.dtype == torch.int32
    assert torch.equal(torch.sort(order).values, torch.arange(lengths.numel(), dtype=torch.int32))
    totals = _totals(lengths, order, min(programs, lengths.numel()))
    # Sorted waves dealt alternately forwards and backwards: the spread of each wave is at
    # most its first length minus its last, and those spans do not overlap.
    assert int(totals.max() - totals.min()) <= int(lengths.max())


def test_launch_order_would_not_balance_where_the_snake_does():
    """The order matters: ragged lengths walked in launch order leave a program far behind."""
    lengths = torch.tensor([100, 1, 100, 1, 100, 1, 100, 1])
    programs = 2
    in_launch_order = _totals(lengths, torch.arange(8, dtype=torch.int32), programs)
    snake = _totals(lengths, snake_order(lengths, programs), programs)
    assert int(in_launch_order.max() - in_launch_order.min()) == 396
    assert int(snake.max() - snake.min()) <= 100


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=400),
    programs=st.integers(1, 140),
)
def test_banded_order_keeps_waves_among_neighbours_and_programs_balanced(lengths, programs):
    """``banded_order``: a permutation whose every wave holds flat indices of one band of
    ``2 * programs`` neighbours, and programs whose totals differ by at most two blocks'
    lengths (pairs dealt to the programs furthest behind, band by band)."""
    lengths = torch.tensor(lengths)
    n = lengths.numel()
    order = banded_order(lengths, programs)
    assert order.dtype == torch.int32
    assert torch.equal(torch.sort(order).values, torch.arange(n, dtype=torch.int32))
    band = 2 * programs
    for start in range(0, n, programs):
        wave = order[start : start + programs].long()
        assert int(wave.min()) // band == int(wave.max()) // band == start // band
    totals = _totals(lengths, order, min(programs, n))
    assert int(totals.max() - totals.min()) <= 2 * int(lengths.max())


def test_banded_order_balances_the_engines_ragged_key_blocks():
    """At the engine's 1/8 case (12 heads of 256 key blocks, each walked by Binomial(256, 1/8)
    query blocks, 132 programs), the banded walk's slowest program runs less than 3% past the
    mean (one program walks 24 blocks where most walk 23), where launch order leaves it
    several times further behind."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.binomial(torch.full((12 * 256,), 256.0), torch.full((12 * 256,), 0.125),
                             generator=gen).to(torch.int32)  # fmt: skip
    programs = 132
    banded = _totals(lengths, banded_order(lengths, programs), programs)
    launch = _totals(lengths, torch.arange(lengths.numel(), dtype=torch.int32), programs)
    mean = lengths.sum().item() / programs
    assert banded.max().item() / mean < 1.03
    assert (launch.max().item() / mean - 1) > 3 * (banded.max().item() / mean - 1)


# Ops whose output's shape depends on the values: on a GPU each waits for the device.
_DATA_SHAPED = ("aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique",
                "aten.repeat_interleave.Tensor", "aten.bincount")  # fmt: skip
# Tensor methods that read values to the host without going through the dispatcher (item,
# bool and int do: aten._local_scalar_dense).
_UNDISPATCHED_READS = ("tolist", "numpy")


class _HostInputs(TorchDispatchMode):
    """Records the ops that take a tensor which came from neither the inputs nor an earlier
    op (a Python number or list made a tensor on the host: a copy to the device on a GPU),
    that read a value back to the host (``item``, ``bool``, ``tolist``, ``numpy``), or whose
    output's shape depends on the values (``nonzero``, ...): what a CUDA graph capture
    refuses."""

    def __init__(self, inputs):
        super().__init__()
        self.made = list(inputs)  # kept alive, so their ids stay theirs
        self.known = {id(t) for t in inputs}
        self.found = []
        self.watched = reading_methods_watched(
            lambda name, _: self.found.append(f"Tensor.{name}"), _UNDISPATCHED_READS
        )

    def __enter__(self):
        self.watched.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self.watched.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        taken = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default or str(func).startswith(_DATA_SHAPED):
            self.found.append(str(func))
        self.found += [str(func) for t in taken if id(t) not in self.known]
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.made += made
        self.known.update(id(t) for t in made)
        return out


def test_the_walks_take_nothing_from_the_host():
    """Both walks are built from the lengths by tensor ops alone, so on a GPU they build
    inside a CUDA graph capture (``derived_lists`` is bypassed there); the check itself
    catches a Python 0 set by tensor index, a read back and a value-shaped op."""
    lengths = torch.randint(0, 40, (3 * 200,), dtype=torch.int32)
    for build in (banded_order, snake_order):
        with _HostInputs([lengths]) as mode:
            build(lengths, 132)
        assert mode.found == [], build.__name__
    flags, where = torch.ones(4, dtype=torch.int64), torch.arange(2)
    tolist = torch.Tensor.tolist
    with _HostInputs([flags, where]) as mode:
        flags[where] = 0
        flags.tolist()
        bool(flags.any())
        flags.nonzero()
    assert mode.found == ["aten.lift_fresh.default", "Tensor.tolist",
                          "aten._local_scalar_dense.default", "aten.nonzero.default"]  # fmt: skip
    assert torch.Tensor.tolist is tolist  # restored


@pytest.mark.gpu
def test_gpu_banded_order_is_built_on_the_device_and_captured_by_a_cuda_graph():
    """The walk of lengths on the GPU is built there (no copy to the host, which a CUDA graph
    capture refuses) and is the walk the CPU builds from the same lengths."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 40, (3 * 200,), generator=gen, dtype=torch.int32)
    on_gpu = lengths.cuda()
    banded_order(on_gpu, 132)  # warm-up outside the capture (allocator, kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = banded_order(on_gpu, 132)
    graph.replay()
    torch.cuda.synchronize()
    assert captured.device == on_gpu.device
    assert torch.equal(captured.cpu(), banded_order(lengths, 132))


def test_cached_dkdv_walk_covers_the_batch_of_broadcast_lists_and_is_cached():
    """Lists broadcast over the batch (``Bi = 1``): the walk covers every (b, h, key block),
    each batch entry's blocks as long as the lists say, and the second call is the same
    tensor; the banded walk and the snake are cached apart."""
    torch.manual_seed(0)
    B, H, nq, nk = 3, 2, 6, 5
    idx, cnt = make_lists(1, H, nq, nk, density=0.5, device="cpu", empty_rows=1)
    q_offsets, _ = cached_transpose(idx, cnt, nk)
    order = cached_dkdv_walk(q_offsets, B, 4, banded=False)
    assert order is cached_dkdv_walk(q_offsets, B, 4, banded=False)
    assert torch.equal(torch.sort(order).values, torch.arange(B * H * nk, dtype=torch.int32))
    lengths = q_offsets.diff(dim=-1).expand(B, -1, -1).flatten()
    walked = lengths[order.long()]
    assert torch.equal(walked, torch.sort(walked, descending=True).values[_snake_positions(
        B * H * nk, 4)])  # fmt: skip
    banded = cached_dkdv_walk(q_offsets, B, 4, banded=True)
    assert banded is cached_dkdv_walk(q_offsets, B, 4, banded=True)
    assert torch.equal(banded, banded_order(lengths, 4))


def test_the_walk_is_banded_by_default_and_an_unknown_walk_is_refused():
    """``configs.persistent_walk_is_banded``: ``PERSISTENT_ORDER`` ("banded"), the override's
    ``persistent_order`` where set, and a ValueError naming the walks for anything else."""
    from vidsparse.ops.block_sparse_attn import configs

    assert configs.persistent_walk_is_banded()
    with configs.override(persistent_order="longest_first"):
        assert not configs.persistent_walk_is_banded()
    with configs.override(persistent_order="spiral"), pytest.raises(ValueError, match="banded"):
        configs.persistent_walk_is_banded()


def _snake_positions(n: int, programs: int) -> torch.Tensor:
    """Where entry t of a snake order sits in the descending sort (the docstring's deal)."""
    positions = []
    for wave_start in range(0, n, programs):
        width = min(programs, n - wave_start)
        lanes = list(range(width))
        if (wave_start // programs) % 2:
            lanes.reverse()
        positions += [wave_start + lane for lane in lanes]
    return torch.tensor(positions)


def test_the_persistent_dkdv_launch_at_128_rows_only(monkeypatch):
    """``persistent=True``: at 128 rows one program per SM (or per key block, if fewer) with
    the walking order and its two counts as the last arguments; at 64 rows the tiles kernel
    (no persistent one there); left to ``configs.Overrides.persistent_dkdv`` otherwise."""
    from vidsparse.ops.block_sparse_attn import bwd_sm90, configs

    monkeypatch.setattr(bwd_sm90, "num_sms", lambda device: 132)
    meta = torch.device("meta")
    B, H, S, D = 2, 3, 2048, 128
    q = torch.empty(B, H, S, D, dtype=torch.bfloat16, device=meta)
    lse2 = torch.empty(B, H, S, device=meta)
    for block, programs in ((128, 2 * 3 * 16), (64, None)):
        nk = S // block
        offsets = torch.empty(1, H, nk + 1, dtype=torch.int32, device=meta)
        indices = torch.empty(1, H, nk * 4, dtype=torch.int32, device=meta)
        kernel, grid, args, _ = bwd_sm90.kernel_args(
            q, q, q, q, q, q, lse2, lse2, offsets, indices, block, D**-0.5, persistent=True
        )  # fmt: skip
        assert ("persistent" in kernel.fn.__name__) == (programs is not None)
        if programs is not None:
            assert grid == (min(programs, 132),)
            assert args[-2:] == (programs, min(programs, 132))
            assert args[-3].shape == (programs,) and args[-3].dtype == torch.int32
        else:
            assert len(grid) == 2
    offsets = torch.empty(1, H, S // 128 + 1, dtype=torch.int32, device=meta)
    indices = torch.empty(1, H, 64, dtype=torch.int32, device=meta)
    for asked in (False, True):
        with configs.override(persistent_dkdv=asked):
            kernel = bwd_sm90.kernel_args(q, q, q, q, q, q, lse2, lse2, offsets, indices, 128,
                                          D**-0.5)[0]  # fmt: skip
        assert ("persistent" in kernel.fn.__name__) == asked


def test_the_persistent_dq_launch_walks_query_blocks_by_their_counts(monkeypatch):
    """``dq_kernel_args(..., persistent=True)`` at 128 rows: one program per SM (or per query
    block), the query blocks in the banded order of their counts (the default walk; counts
    clamped into the lists' width, as the kernels read them); at 64 rows the tiles kernel."""
    from vidsparse.ops.block_sparse_attn import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "num_sms", lambda device: 4)
    B, H, S, D = 2, 3, 1024, 128
    q = torch.zeros(B, H, S, D, dtype=torch.bfloat16)
    lse2 = torch.zeros(B, H, S)
    for block in (128, 64):
        nq = S // block
        idx = torch.zeros(1, H, nq, 5, dtype=torch.int32)
        cnt = torch.randint(-1, 8, (1, H, nq), dtype=torch.int32)  # some past the width
        kernel, grid, args, _ = bwd_sm90.dq_kernel_args(q, q, q, q, q, lse2, lse2, idx, cnt,
                                                        block, D**-0.5,
                                                        persistent=True)  # fmt: skip
        assert ("persistent" in kernel.fn.__name__) == (block == 128)
        if block == 128:
            assert grid == (4,) and args[-2:] == (B * H * nq, 4)
            lengths = cnt.clamp(0, 5).expand(B, -1, -1).flatten()
            assert torch.equal(args[-3], banded_order(lengths, 4))  # the default
