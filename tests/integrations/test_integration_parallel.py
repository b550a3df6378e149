"""The diffusers integration under sequence parallelism (``apply_sparse_attention(...,
ulysses=UlyssesAttention())``), two gloo processes on the CPU.

Each rank shards a tiny Wan transformer's sequence the way diffusers' context parallelism does
for Wan (its ``_cp_plan``: the rotary tables and the first block's hidden states split along
the sequence, ``proj_out``'s output gathered) and compares the model output with the
single-process output of the same method: dense, VSA (with a non-zero gate projection, so the
gate's exchange matters) and PSA. diffusers' own ``enable_parallelism`` needs an accelerator, so
the CPU test installs the equivalent hooks itself.
"""

from __future__ import annotations

import datetime
import importlib
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("diffusers")

WORLD = 2
CASES = ("dense", "vsa", "psa")


def _shard(x: torch.Tensor) -> torch.Tensor:
    rank, n = dist.get_rank(), x.shape[1] // WORLD
    return x[:, rank * n : (rank + 1) * n]


def _first_block_pre_hook(module, args, kwargs):
    if args:
        return (_shard(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": _shard(kwargs["hidden_states"])}


def _gather_sequence(module, args, out):
    parts = [torch.empty_like(out) for _ in range(WORLD)]
    dist.all_gather(parts, out.contiguous())
    return torch.cat(parts, dim=1)


def _shard_like_diffusers_cp(model) -> None:
    model.rope.register_forward_hook(lambda m, a, out: tuple(_shard(t) for t in out))
    model.blocks[0].register_forward_pre_hook(_first_block_pre_hook, with_kwargs=True)
    model.proj_out.register_forward_hook(_gather_sequence)


def _options(method: str) -> dict:
    from vidsparse import StripeSpec

    if method == "vsa":
        return {"sparsity": 0.5}
    if method == "psa":
        specs = [StripeSpec(1, 0, None, 1, 0, None), StripeSpec(1, 0, 2, 2, 1, None)]
        return {"specs": specs, "tile": (1, 4, 4)}
    return {}


def _randomise_gates(model) -> None:
    from vidsparse.integrations.diffusers import GATE_MODULE_NAME

    gen = torch.Generator().manual_seed(5)
    for module in model.modules():
        gate = getattr(module, GATE_MODULE_NAME, None)
        if gate is not None:
            for p in gate.parameters():
                p.data.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _case(method: str) -> float:
    from test_integration_diffusers import tiny_wan, wan_inputs

    from vidsparse.integrations.diffusers import apply_sparse_attention
    from vidsparse.parallel import UlyssesAttention

    outputs = []
    for parallel in (False, True):
        torch.manual_seed(0)
        model = tiny_wan()
        if parallel:
            _shard_like_diffusers_cp(model)
        ulysses = {"ulysses": UlyssesAttention()} if parallel else {}
        apply_sparse_attention(model, method, **ulysses, **_options(method))
        _randomise_gates(model)
        with torch.no_grad():
            outputs.append(model(**wan_inputs())[0])
    single, sharded = outputs
    return float((sharded - single).abs().max() / single.abs().max())


def _worker(rank: int, store: str, out_dir: str) -> None:
    os.environ["VIDSPARSE_BACKEND"] = "torch"
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # before the group (tests/parallel/test_parallel.py)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    verdicts = {}
    for method in CASES:
        try:
            verdicts[method] = _case(method)
        except Exception as exc:  # noqa: BLE001 - reported to the parent per case
            verdicts[method] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    dist.destroy_process_group()
    torch.save(verdicts, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    # The workers import the tiny models from test_integration_diffusers (tests/ on the path).
    saved = os.environ.get("PYTHONPATH")
    tests_dir = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, saved) if p)
    try:
        mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=True)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("method", CASES)
def test_sequence_parallel_model_equals_single_process(verdicts, method):
    for rank, v in enumerate(verdicts):
        assert isinstance(v[method], float), f"rank {rank}: {v[method]}"
        assert v[method] <= 1e-5, f"rank {rank}: relative max error {v[method]:.2e}"


def test_ulysses_option_is_checked():
    from test_integration_diffusers import tiny_hunyuan, tiny_wan

    from vidsparse.integrations.diffusers import apply_sparse_attention
    from vidsparse.parallel import UlyssesAttention

    with pytest.raises(ValueError, match="not supported on HunyuanVideo"):
        apply_sparse_attention(tiny_hunyuan(), "psa", specs=[], ulysses=UlyssesAttention())
    model = tiny_wan()
    with pytest.raises(TypeError, match="ulysses must be a vidsparse.parallel.UlyssesAttention"):
        apply_sparse_attention(model, "vsa", sparsity=0.5, ulysses="yes")
    with pytest.raises(ValueError, match="layout='bshd'"):
        apply_sparse_attention(model, "vsa", sparsity=0.5, ulysses=UlyssesAttention(layout="bhsd"))
    assert not hasattr(model, "_vidsparse_state") or model._vidsparse_state is None
    # diffusers' context parallelism marks the stock processors: only ulysses= may take them
    for block in model.blocks:
        block.attn1.processor._parallel_config = object()
    with pytest.raises(ValueError, match="pass ulysses="):
        apply_sparse_attention(model, "vsa", sparsity=0.5)
    apply_sparse_attention(model, "vsa", sparsity=0.5, ulysses=UlyssesAttention())
