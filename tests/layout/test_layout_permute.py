"""One-pass tile / untile kernels (``vidsparse.layout.permute``) against the PyTorch path.

``VideoGrid.tile`` / ``untile`` take the kernels for 4-D ``[B, H, S, D]`` tensors along
``dim=2`` on the Triton backend (the interpreter on CPU machines); the PyTorch path
(``VIDSPARSE_BACKEND=torch``) is the reference, and the kernels must match it bit for bit:
they only copy rows.
"""

from __future__ import annotations

import pytest
import torch

from vidsparse.layout import permute_ops
from vidsparse.layout.grid import VideoGrid

# Partial edge tiles on every axis, (2, 8, 8)-style flat tiles scaled down, and full tiles.
CASES = [
    ((5, 6, 7), (4, 4, 4)),
    ((5, 6, 7), (2, 4, 4)),
    ((3, 5, 9), (1, 4, 8)),
    ((4, 4, 4), (2, 2, 2)),
]
B, H = 2, 3


def _need_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("runs the Triton interpreter on CPU tensors")
    from vidsparse.utils.backend import triton_interpret_enabled

    if not triton_interpret_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on CPU machines)")


@pytest.fixture
def kernel_calls(monkeypatch, triton_backend):
    """Counts launches of the two kernels' launchers (proves the kernel path was taken)."""
    _need_interpreter()
    from vidsparse.layout import permute

    calls = {"tile": 0, "untile": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(permute, "tile_rows", counted("tile", permute.tile_rows))
    monkeypatch.setattr(permute, "untile_rows", counted("untile", permute.untile_rows))
    return calls


def _reference(monkeypatch, fn, *args):
    """``fn(*args)`` on the PyTorch path."""
    with monkeypatch.context() as m:
        m.setenv("VIDSPARSE_BACKEND", "torch")
        return fn(*args)


def _bhsd(seq, dim, dtype, layout):
    """A ``[B, H, seq, dim]`` tensor in one of several memory layouts."""
    if layout == "contiguous":
        return torch.randn(B, H, seq, dim).to(dtype)
    if layout == "bshd":  # [B, S, H, D] seen as [B, H, S, D]: the usual DiT projection layout
        return torch.randn(B, seq, H, dim).to(dtype).transpose(1, 2)
    if layout == "strided_d":  # every other element of a twice-as-wide head dim
        return torch.randn(B, H, seq, 2 * dim).to(dtype)[..., ::2]
    if layout == "expanded":  # stride 0 over the batch
        return torch.randn(1, H, seq, dim).to(dtype).expand(B, H, seq, dim)
    raise ValueError(layout)


_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _assert_bitwise(got, want):
    """Same shape, dtype and bits (``torch.equal`` would let -0.0 match 0.0)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.view(_BITS[got.dtype]), want.contiguous().view(_BITS[want.dtype]))


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("shape, tile", CASES, ids=[f"{s}-{t}" for s, t in CASES])
@pytest.mark.parametrize(
    "dtype, dim, layout",
    [
        (torch.float32, 16, "bshd"),
        (torch.float16, 32, "contiguous"),
        (torch.float16, 16, "strided_d"),
        (torch.float32, 32, "expanded"),
    ],
    ids=["fp32-d16-bshd", "fp16-d32", "fp16-d16-strided-d", "fp32-d32-expanded"],
)
def test_tile_untile_match_torch_bitwise(
    monkeypatch, kernel_calls, shape, tile, dtype, dim, layout
):
    grid = VideoGrid(shape, tile)
    x = _bhsd(grid.num_tokens, dim, dtype, layout)
    tiled = grid.tile(x)  # [B, H, P, D]
    assert tiled.is_contiguous()
    _assert_bitwise(tiled, _reference(monkeypatch, grid.tile, x))

    # Tile-order input whose padding slots hold NaN: untile must drop them, not read them.
    y = _bhsd(grid.padded_len, dim, dtype, layout).clone()
    y[:, :, ~grid.real_token_mask()] = float("nan")
    natural = grid.untile(y)  # [B, H, S, D]
    assert not natural.isnan().any() and natural.is_contiguous()
    _assert_bitwise(natural, _reference(monkeypatch, grid.untile, y))
    assert kernel_calls == {"tile": 1, "untile": 1}

    assert torch.equal(grid.untile(tiled), x)  # exact round trip


@pytest.mark.interpreter
def test_tile_padding_is_zero_whatever_the_tokens_hold(monkeypatch, kernel_calls):
    """Padding slots are written, not gathered: non-finite tokens (token 0, which the PyTorch
    path gathers into padding before zeroing it) cannot leak into them."""
    grid = VideoGrid((5, 6, 7), (4, 4, 4))
    x = torch.randn(B, H, grid.num_tokens, 16)
    x[:, :, 0] = float("nan")
    x[:, :, 1] = float("inf")
    tiled = grid.tile(x, dim=2)
    pad = ~grid.real_token_mask()
    assert torch.equal(tiled[:, :, pad], torch.zeros_like(tiled[:, :, pad]))
    assert torch.equal(tiled.nan_to_num(), _reference(monkeypatch, grid.tile, x).nan_to_num())
    assert tiled.isnan().sum() == x.isnan().sum()
    assert kernel_calls["tile"] == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("shape, tile", CASES[:2], ids=[f"{s}-{t}" for s, t in CASES[:2]])
def test_gradients_match_torch(monkeypatch, kernel_calls, shape, tile):
    """tile's gradient is untile (padding grads dropped); untile's is tile (zero padding)."""
    grid = VideoGrid(shape, tile)
    x = _bhsd(grid.num_tokens, 16, torch.float32, "bshd").detach().requires_grad_()
    y = torch.randn(B, H, grid.padded_len, 16, requires_grad=True)
    w_tiled = torch.randn(B, H, grid.padded_len, 16)  # nonzero on padding slots too
    w_natural = torch.randn(B, H, grid.num_tokens, 16)

    def loss():
        return (grid.tile(x) * w_tiled).sum() + (grid.untile(y) * w_natural).sum()

    got = torch.autograd.grad(loss(), (x, y))
    assert kernel_calls == {"tile": 2, "untile": 2}  # forward and backward of each
    want = torch.autograd.grad(_reference(monkeypatch, loss), (x, y))
    for g, w in zip(got, want):
        _assert_bitwise(g, w)
    assert (got[1][:, :, ~grid.real_token_mask()] == 0).all()


@pytest.mark.interpreter
def test_expanded_input_and_double_backward(kernel_calls):
    grid = VideoGrid((3, 5, 9), (1, 4, 8))
    base = torch.randn(1, H, grid.num_tokens, 16, dtype=torch.float64).float()
    x = base.expand(B, H, grid.num_tokens, 16).detach().requires_grad_()
    (g,) = torch.autograd.grad(grid.tile(x).square().sum(), x, create_graph=True)
    torch.testing.assert_close(g, 2 * x, rtol=0, atol=0)
    (gg,) = torch.autograd.grad(g.sum(), x)  # the backward op is differentiable too
    assert torch.equal(gg, torch.full_like(gg, 2.0))


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "make, dim",
    [
        (lambda s: torch.randn(2, 3, s, 8), -2),  # head dim 8: below the kernel's range
        (lambda s: torch.randn(2, 3, s, 24), -2),  # head dim not a power of two
        (lambda s: torch.randn(2, 3, s, 16, dtype=torch.float64), -2),  # fp64
        (lambda s: torch.randn(2, s, 3, 16), 1),  # tokens on another dim
        (lambda s: torch.randn(3, s, 16), -2),  # 3-D
        (lambda s: torch.randn(0, 3, s, 16), -2),  # empty
    ],
    ids=["d8", "d24", "fp64", "dim1", "3d", "empty"],
)
def test_unsupported_inputs_keep_the_torch_path(monkeypatch, kernel_calls, make, dim):
    grid = VideoGrid((5, 6, 7), (4, 4, 4))
    x = make(grid.num_tokens)
    assert torch.equal(grid.tile(x, dim=dim), _reference(monkeypatch, grid.tile, x, dim))
    y = grid.tile(x, dim=dim)
    assert torch.equal(grid.untile(y, dim=dim), _reference(monkeypatch, grid.untile, y, dim))
    assert kernel_calls == {"tile": 0, "untile": 0}


def test_torch_backend_and_plain_cpu_keep_the_torch_path(monkeypatch):
    grid = VideoGrid((5, 6, 7), (4, 4, 4))
    x = torch.randn(B, H, grid.num_tokens, 16)
    monkeypatch.setenv("VIDSPARSE_BACKEND", "torch")
    assert not permute_ops.kernel_supports(x, 2, grid.padded_len)
    monkeypatch.setenv("VIDSPARSE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # CPU without the interpreter: PyTorch path, no error from resolve_backend.
    assert not permute_ops.kernel_supports(x, 2, grid.padded_len)
    assert grid.untile(grid.tile(x)).equal(x)


@pytest.mark.dynamo
@pytest.mark.interpreter
def test_fullgraph_compile(kernel_calls):
    """The custom ops keep ``torch.compile(fullgraph=True)`` to one graph, forward and back."""
    grid = VideoGrid((5, 6, 7), (2, 4, 4))
    x = torch.randn(1, 2, grid.num_tokens, 16, requires_grad=True)

    def f(x):
        tiled = grid.tile(x, dim=-2)  # [1, 2, P, 16]
        return grid.untile(tiled * 2 + 1, dim=-2)

    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(f)(x)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        got = compiled(x)
        (grad,) = torch.autograd.grad(got.square().sum(), x)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, x * 2 + 1)
    assert torch.equal(grad, 2 * (x * 2 + 1) * 2)
    assert kernel_calls["tile"] >= 2 and kernel_calls["untile"] >= 2


@pytest.mark.dynamo
@pytest.mark.interpreter
def test_untile_into_bshd_storage_is_untile_and_its_fake_agrees(kernel_calls):
    """``untile_op(..., bshd=True)``: untile's values and gradient, stored as [B, S, H, D] (so
    ``transpose(1, 2).flatten(2)`` is a view), its fake tensor with the same strides."""
    grid = VideoGrid((5, 6, 7), (2, 4, 4))
    y = torch.randn(2, 3, grid.padded_len, 16, requires_grad=True)
    key = (grid.shape, grid.tile_shape)
    got = permute_ops.untile_op(y, *key, bshd=True)
    assert got.shape == (2, 3, grid.num_tokens, 16)
    assert got.transpose(1, 2).is_contiguous()
    _assert_bitwise(got, grid.untile(y.detach()))
    do = torch.randn_like(got)
    (grad,) = torch.autograd.grad(got, y, do)
    _assert_bitwise(grad, grid.tile(do))

    # The fake (what torch.compile traces with) has the real op's strides, and the rest of
    # the custom op's registration holds.
    args = (y, list(grid.shape), list(grid.tile_shape), True)
    torch.library.opcheck(torch.ops.vidsparse.video_grid_untile.default, args)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, tile", [((21, 30, 52), (4, 4, 4)), ((21, 30, 52), (2, 8, 8)), ((13, 23, 41), (4, 4, 4))]
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_bf16_matches_torch(monkeypatch, shape, tile, head_dim):
    monkeypatch.setenv("VIDSPARSE_BACKEND", "auto")
    grid = VideoGrid(shape, tile)
    heads = 5
    x = torch.randn(2, grid.num_tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    x = x.transpose(1, 2).detach().requires_grad_()  # [B, H, S, D] view of [B, S, H, D]
    assert permute_ops.kernel_supports(x, 2, grid.padded_len)
    tiled = grid.tile(x)
    assert tiled.is_contiguous()
    _assert_bitwise(tiled, _reference(monkeypatch, grid.tile, x))

    y = torch.randn(2, heads, grid.padded_len, head_dim, device="cuda", dtype=torch.bfloat16)
    y[:, :, ~grid.real_token_mask("cuda")] = float("nan")
    y.requires_grad_()
    natural = grid.untile(y)
    _assert_bitwise(natural, _reference(monkeypatch, grid.untile, y))
    assert torch.equal(grid.untile(tiled), x)

    w_t, w_n = torch.randn_like(tiled), torch.randn_like(natural)
    got = torch.autograd.grad((tiled * w_t).sum() + (natural * w_n).sum(), (x, y))

    def loss():
        return (grid.tile(x) * w_t).sum() + (grid.untile(y) * w_n).sum()

    want = torch.autograd.grad(_reference(monkeypatch, loss), (x, y))
    for g, w in zip(got, want):
        _assert_bitwise(g, w)


@pytest.mark.interpreter
@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_tile_from_chunks_and_untile_to_chunks(triton_backend, chunks):
    """Ulysses' fused exchange: the sequence in rank chunks -> tile order, and back."""
    from vidsparse.layout.permute import tile_rows_from_chunks, untile_rows_to_chunks

    grid = VideoGrid((5, 6, 7), tile=(4, 4, 4))  # 210 tokens: 1, 2 or 5 equal chunks
    B, H, D, S = 2, 3, 16, grid.num_tokens
    x = torch.randn(B, H, S, D)
    in_chunks = x.reshape(B, H, chunks, S // chunks, D).permute(2, 0, 1, 3, 4).contiguous()
    tiled = tile_rows_from_chunks(in_chunks, grid.shape, grid.tile_shape)
    index = grid.index_tensors("cpu")  # the PyTorch path's gather, as the reference
    ref = x.index_select(2, index.gather_index).masked_fill(~index.valid.view(1, 1, -1, 1), 0)
    torch.testing.assert_close(tiled, ref, rtol=0, atol=0)
    tiled[:, :, ~grid.real_token_mask("cpu")] = float("nan")  # padding is never read back
    out = untile_rows_to_chunks(tiled, grid.shape, grid.tile_shape, chunks)
    torch.testing.assert_close(out, in_chunks, rtol=0, atol=0)


# ----------------------------------------------------------------------------- copy_rows


def _exchange_views(device, dtype):
    """The views Ulysses copies: a [B, S, H, D] shard split into [P, B, H/P, S, D] head chunks
    (into one slot of a stacked send buffer), and a received [P, B, h, S, D] buffer written
    into a [B, S, P, chunks, h, D] output view."""
    x = torch.randn(2, 37, 6, 16, device=device, dtype=dtype)
    chunks = x.reshape(2, 37, 2, 3, 16).permute(2, 0, 3, 1, 4)  # [P, B, H/P, S, D]
    recv = torch.randn(2, 2, 3, 37, 16, device=device, dtype=dtype)
    out = torch.zeros(2, 37, 2, 2, 3, 16, device=device, dtype=dtype)
    return [
        (torch.empty(3, 2, 2, 3, 37, 16, device=device, dtype=dtype)[1], chunks),
        (out[:, :, :, 1], recv.permute(1, 3, 0, 2, 4)),
        (torch.empty(37, 6, 16, device=device, dtype=dtype), x[1]),  # fewer dims
    ]


def _check_copy_rows(device, dtype):
    from vidsparse.layout.permute import copy_rows

    for dst, src in _exchange_views(device, dtype):
        assert copy_rows(dst, src) is dst
        assert torch.equal(dst, src)


@pytest.mark.interpreter
def test_copy_rows_equals_copy_for_the_exchange_views():
    _need_interpreter()
    _check_copy_rows("cpu", torch.float32)


def test_copy_rows_refuses_what_it_cannot_copy():
    pytest.importorskip("triton")
    from vidsparse.layout.permute import copy_rows

    x = torch.randn(4, 8)
    for dst, src in ((torch.empty(4, 4), x), (torch.empty(8, 4), x.t()),
                     (torch.empty(4, 6), torch.randn(4, 6))):  # fmt: skip
        with pytest.raises(ValueError, match="copy_rows takes"):
            copy_rows(dst, src)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_copy_rows_equals_copy(dtype):
    _check_copy_rows("cuda", dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("own_chunk", [0, 1, 2])
def test_tile_rows_from_chunks_reads_the_own_chunk_in_place(own_chunk):
    """Ulysses keeps a rank's own chunk out of the exchange: the kernel reads it from the
    rank's (strided) input and the other chunks from the receive buffer, in rank order."""
    _need_interpreter()
    from vidsparse.layout.permute import tile_rows_from_chunks

    grid = VideoGrid((3, 5, 8), (2, 4, 4))  # 120 tokens in 3 chunks of 40
    chunks = torch.randn(3, 1, 2, 40, 16)  # [C, B, H, S/C, D]
    want = tile_rows_from_chunks(chunks, grid.shape, grid.tile_shape)
    others = torch.cat([chunks[:own_chunk], chunks[own_chunk + 1 :]])
    own = chunks[own_chunk].transpose(1, 2).contiguous().transpose(1, 2)  # a strided view
    got = tile_rows_from_chunks(others, grid.shape, grid.tile_shape, own, own_chunk)
    assert torch.equal(got, want)
