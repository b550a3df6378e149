"""o stored in the caller's own row order (``GradTargets.output``): the forward's kernels store
each output row through the q map, the backward's preprocess reads o and dO through it and
writes the engine-order dO its kernels read. Every arm is compared to the bit with the same
computation in the engine's order and a permutation outside it."""

import pytest
import torch

from helpers import make_lists

_INTERPRETER = [
    pytest.mark.interpreter,
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI"),
]
BACKENDS = ["torch", pytest.param("triton", marks=_INTERPRETER)]


def _natural_problem(device, dtype, *, S, bs, n, sizes: bool, seed: int):
    """Natural q, k, v (``[B, S, H, D]`` storage, n rows) and a map from the engine's S rows
    to them: every natural row once, the rest -1 (with ``sizes``, real rows first in each
    key block, as key-block sizes mask the rest). Returns ``(natural, rows, block_sizes)``."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.full((S,), -1, dtype=torch.int32)
    block_sizes = None
    if sizes:
        counts = [bs if i % 2 == 0 else bs - 7 for i in range(S // bs)]
        slots = torch.cat([torch.arange(i * bs, i * bs + c) for i, c in enumerate(counts)])
        block_sizes = torch.tensor(counts, dtype=torch.int32, device=device)
    else:
        slots = torch.randperm(S, generator=gen)
    slots = slots[:n]
    n = len(slots)
    H, D = 2, 16 if device == "cpu" else 128
    natural = [torch.randn(2, n, H, D, generator=gen).to(device, dtype).transpose(1, 2)
               for _ in range(3)]  # fmt: skip
    rows[slots] = torch.randperm(len(slots), generator=gen).to(torch.int32)
    return natural, rows.to(device), block_sizes


def _arms(device, dtype, *, S=64, bs=16, n=50, sizes=False, seed=5):
    """``(o, dq, dk, dv)`` of the internal entry on natural tensors through ``grads_to``, with
    o stored through the map (``output=True``) and with o in the engine's order, moved to the
    natural rows outside; the same inputs and natural output gradient."""
    from vidsparse.ops.block_sparse_attn.grad_rows import GradTargets
    from vidsparse.ops.block_sparse_attn.interface import block_sparse_attn_unchecked

    natural, rows, block_sizes = _natural_problem(device, dtype, S=S, bs=bs, n=n, sizes=sizes,
                                                  seed=seed)  # fmt: skip
    H, D = natural[0].shape[1], natural[0].shape[-1]
    keep = rows >= 0
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.5, device=device, empty_rows=1)
    kwargs = dict(block_q=bs, block_kv=bs, kv_block_sizes=block_sizes, scale=D**-0.5,
                  padding_finite=True)  # fmt: skip
    do = torch.randn(natural[0].shape, generator=torch.Generator().manual_seed(seed + 1))
    do = do.to(device, dtype)
    arms = []
    for output in (True, False):
        leaves = [x.clone().requires_grad_() for x in natural]
        copies = [x.detach()[:, :, rows.clamp_min(0).long()].masked_fill(~keep[:, None], 0)
                  for x in leaves]  # fmt: skip
        targets = GradTargets(*leaves, rows, rows, output=output)
        o, _ = block_sparse_attn_unchecked(*copies, idx, cnt, **kwargs, grads_to=targets)
        if not output:  # the engine's order: move the real rows to their natural places
            moved = torch.empty_like(natural[0])
            moved[:, :, rows[keep].long()] = o[:, :, keep]
            o = moved
        arms.append((o, *torch.autograd.grad(o, leaves, do)))
    return arms


@pytest.mark.parametrize("sizes", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_output_stored_through_the_q_map_equals_moving_it(backend, sizes, monkeypatch):
    """o written by the forward in q's own order and layout (``[B, S, H, D]`` storage kept),
    and the gradients from a natural dO read through the map: the same bits as the engine's
    order and a move outside it, on both backends."""
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    mapped, moved = _arms("cpu", torch.float16, sizes=sizes)
    for name, a, b in zip(("o", "dq", "dk", "dv"), mapped, moved):
        assert a.shape == b.shape and torch.equal(a, b), name
    o = mapped[0]
    assert o.transpose(1, 2).is_contiguous()  # q's [B, S, H, D] storage


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_rows_op_and_its_fake_agree(backend, monkeypatch):
    """The forward custom op with ``out_rows``: it and its fake give the natural shape and
    strides (``torch.library.opcheck`` on the torch backend)."""
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    import vidsparse.ops.block_sparse_attn.interface  # noqa: F401 - registers the ops
    from vidsparse.ops.block_sparse_attn.epilogue import MAX_TENSORS

    natural, rows, _ = _natural_problem("cpu", torch.float32, S=64, bs=16, n=50, sizes=False,
                                        seed=2)  # fmt: skip
    H, D = natural[0].shape[1], natural[0].shape[-1]
    keep = rows >= 0
    copies = [x[:, :, rows.clamp_min(0).long()].masked_fill(~keep[:, None], 0) for x in natural]
    idx, cnt = make_lists(1, H, 4, 4, density=0.5, device="cpu")
    op = torch.ops.vidsparse.block_sparse_attn_fwd.default
    args = (*copies, idx, cnt, None, 16, 16, D**-0.5, backend, True, "none",
            *[None] * MAX_TENSORS, *natural, rows, rows, True)  # fmt: skip
    o, lse, _ = op(*args)
    assert o.shape == natural[0].shape and o.stride() == natural[0].stride()
    assert lse.shape == copies[0].shape[:3]  # the engine's order
    if backend == "torch":
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs, sizes", [(64, True), (128, False)])
def test_gpu_output_stored_through_the_q_map_equals_moving_it(bs, sizes, dtype):
    """On the GPU: at 64 with key-block sizes (VSA's shape: the Gluon forward of 64-row tiles
    and the Triton backward) and at 128 without (the Gluon forward of 128-row blocks)."""
    S = 32 * bs
    mapped, moved = _arms("cuda", dtype, S=S, bs=bs, n=S - 3 * bs // 2, sizes=sizes)
    for name, a, b in zip(("o", "dq", "dk", "dv"), mapped, moved):
        assert torch.equal(a, b), name


def _saved_bytes_and_grads(device, dtype, regather, *, S=64, bs=16, n=40, seed=7):
    """Bytes of the storages autograd keeps for the backward, and ``(o, dq, dk, dv)``, of the
    internal entry on natural tensors through ``grads_to`` (o in their order too)."""
    from vidsparse.ops.block_sparse_attn.grad_rows import GradTargets
    from vidsparse.ops.block_sparse_attn.interface import block_sparse_attn_unchecked

    torch.manual_seed(seed)  # make_lists draws from the global generator
    natural, rows, block_sizes = _natural_problem(device, dtype, S=S, bs=bs, n=n, sizes=True,
                                                  seed=seed)  # fmt: skip
    H, D = natural[0].shape[1], natural[0].shape[-1]
    keep = rows >= 0
    idx, cnt = make_lists(1, H, S // bs, S // bs, density=0.5, device=device, empty_rows=1)
    leaves = [x.clone().requires_grad_() for x in natural]
    copies = [x.detach()[:, :, rows.clamp_min(0).long()].masked_fill(~keep[:, None], 0)
              for x in leaves]  # fmt: skip
    targets = GradTargets(*leaves, rows, rows, output=True, regather=regather)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = block_sparse_attn_unchecked(*copies, idx, cnt, block_q=bs, block_kv=bs,
                                           kv_block_sizes=block_sizes, scale=D**-0.5,
                                           padding_finite=True, grads_to=targets)  # fmt: skip
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    grads = torch.autograd.grad(o, leaves, do)
    return sum(storages.values()), (o, *grads), copies, leaves


@pytest.mark.parametrize("backend", BACKENDS)
def test_regathered_copies_give_the_same_bits_and_are_not_kept(backend, monkeypatch):
    """``GradTargets.regather``: the backward keeps the natural tensors and gathers the
    engine's copies again (rows mapped to -1 as zeros, as the copies hold them): the same
    bits, and autograd keeps the targets' bytes instead of the longer copies'."""
    monkeypatch.setenv("VIDSPARSE_BACKEND", backend)
    kept, arm, copies, leaves = _saved_bytes_and_grads("cpu", torch.float16, regather=True)
    kept_copies, arm_copies, *_ = _saved_bytes_and_grads("cpu", torch.float16, regather=False)
    for name, a, b in zip(("o", "dq", "dk", "dv"), arm, arm_copies):
        assert torch.equal(a, b), name
    longer = sum(c.nbytes for c in copies) - sum(x.nbytes for x in leaves)
    assert longer > 0 and kept_copies - kept == longer
