"""The diffusers integration under sequence parallelism (``apply_sparse_attention(...,
ulysses=UlyssesAttention())``), two gloo processes on the CPU.

Each rank shards a tiny model's sequence the way diffusers' context parallelism does, from the
model class's own ``_cp_plan`` (its ``ContextParallelInput`` entries split a module's inputs, or
its outputs with ``split_output=True``, along ``split_dim`` when the tensor has
``expected_dims``; its ``ContextParallelOutput`` entries all-gather a module's outputs along
``gather_dim``), installed as diffusers installs them: ``HookRegistry`` hooks that wrap the
module's ``forward``, so the torch forward pre-hooks (vidsparse's latent-grid hook on the
transformer) still see the whole inputs, as under real context parallelism. diffusers' own
``enable_parallelism`` needs an accelerator, so the CPU test installs the equivalent hooks itself.
The model output is compared with the single-process output of the same method: dense, VSA
(with a non-zero gate projection, so the gate's exchange matters) and PSA.

One exception to the plans: inputs that only the cross-attention consumes
(``encoder_hidden_states``, ``encoder_attention_mask``: LTX-Video's plan splits them) are kept
whole. Under real context parallelism diffusers' attention dispatch gathers them for the
cross-attention (the ``parallel_config`` it sets on the processors); the emulation has no
``parallel_config``, the stock cross-attention then runs locally, and keeping the text whole on
every rank is the same math.

Covered: every class of vidsparse's models table with a ``_cp_plan`` in diffusers 0.42 but
LTX-2 -- Wan (``wan_t2v``), ChronoEdit and LTX-Video -- with the tiny models of
``tiny_models.py``. LTX-2 is left out: its plan shards the video only (``hidden_states`` and the
``rope`` tables), while its audio-video cross-attentions mix the two streams. The
video-to-audio attention takes the video as keys and values, so each rank's (whole) audio would
attend to its own video shard only, and feed that back to the video through the
audio-to-video attention: no sharding of the inputs makes it the single-process model without
the dispatch's ``parallel_config`` gathering the video there. (Before that, the emulated plan
already fails in the audio-to-video attention: the ``cross_attn_rope`` tables, one per video
token, are not in the plan, 240 rows against the 120 video tokens of a shard.)
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("diffusers")

WORLD = 2
METHODS = ("dense", "vsa", "psa")
# The tiny models (tests/integrations/tiny_models.py) run here, and their classes. The token
# counts of the grids divide by WORLD: 3 x 8 x 10 (Wan, LTX-Video) and 2 x 8 x 10 (ChronoEdit).
MODELS = {
    "wan_t2v": "WanTransformer3DModel",
    "chronoedit": "ChronoEditTransformer3DModel",
    "ltx_video": "LTXVideoTransformer3DModel",
}
# Classes with a _cp_plan left out (see the module docstring).
LEFT_OUT = {"LTX2VideoTransformer3DModel": "its video-to-audio attention takes the video as keys"}
# Forward inputs the emulation keeps whole on every rank (see the module docstring).
CROSS_ATTENTION_INPUTS = ("encoder_hidden_states", "encoder_attention_mask")
CASES = tuple(f"{model}-{method}" for model in MODELS for method in METHODS)
XFAIL: dict[str, str] = {}  # case -> reason, for a failure inside vidsparse's integration


# ---------------------------------------------------------------------------------------------
# diffusers' context-parallel plan, emulated on a gloo group (diffusers/hooks/context_parallel.py)
# ---------------------------------------------------------------------------------------------


def _split(x, cpm):
    """``x`` sharded as ``cpm`` says (a list of ``ContextParallelInput``: per item of ``x``):
    this rank's equal chunk along ``split_dim``; unchanged if ``x.dim() != expected_dims``."""
    if isinstance(cpm, (list, tuple)):
        assert len(x) == len(cpm), f"{len(x)} values for {len(cpm)} ContextParallelInputs"
        return type(x)(_split(v, c) for v, c in zip(x, cpm))
    if not torch.is_tensor(x) or (cpm.expected_dims is not None and x.dim() != cpm.expected_dims):
        return x
    size = x.shape[cpm.split_dim]
    assert size % WORLD == 0, f"{tuple(x.shape)}: dim {cpm.split_dim} does not divide by {WORLD}"
    return x.chunk(WORLD, dim=cpm.split_dim)[dist.get_rank()]


def _gather(x: torch.Tensor, cpo) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=cpo.gather_dim)


def _split_hook(plan: dict):
    """A ``ModelHook`` splitting the named inputs of ``plan`` before the forward and the
    outputs of its integer keys (``split_output=True``) after it (ContextParallelSplitHook)."""
    from diffusers.hooks import ModelHook

    class Split(ModelHook):
        def initialize_hook(self, module):
            self.names = list(inspect.signature(type(module).forward).parameters)[1:]
            return module

        def pre_forward(self, module, *args, **kwargs):
            args = list(args)
            for name, cpm in plan.items():
                if isinstance(name, int) or getattr(cpm, "split_output", False):
                    continue
                if name in kwargs:
                    kwargs[name] = _split(kwargs[name], cpm)
                elif self.names.index(name) < len(args):
                    index = self.names.index(name)
                    args[index] = _split(args[index], cpm)
            return tuple(args), kwargs

        def post_forward(self, module, output):
            outputs = {k: cpm for k, cpm in plan.items() if isinstance(k, int) and cpm.split_output}
            if not outputs:
                return output
            single = torch.is_tensor(output)
            split = [output] if single else list(output)
            for index, cpm in outputs.items():
                split[index] = _split(split[index], cpm)
            return split[0] if single else type(output)(split)

    return Split()


def _gather_hook(plan: list):
    """A ``ModelHook`` all-gathering the module's outputs (ContextParallelGatherHook)."""
    from diffusers.hooks import ModelHook

    class Gather(ModelHook):
        def post_forward(self, module, output):
            single = torch.is_tensor(output)
            output = [output] if single else list(output)
            assert len(output) == len(plan), f"{len(output)} outputs for {len(plan)} entries"
            output = [x if cpo is None else _gather(x, cpo) for x, cpo in zip(output, plan)]
            return output[0] if single else tuple(output)

    return Gather()


def _submodules(module, name: str) -> list:
    """The modules ``name`` denotes (``""``: ``module``; ``*`` once: every item of a list)."""
    if not name:
        return [module]
    first, _, rest = name.partition(".")
    if first == "*":
        return [m for item in module for m in _submodules(item, rest)]
    return _submodules(getattr(module, first), rest)


def cp_plan(model) -> dict:
    """``type(model)._cp_plan`` without the cross-attention inputs (module docstring)."""
    plan = {}
    for module_id, entry in type(model)._cp_plan.items():
        if isinstance(entry, dict):
            entry = {k: v for k, v in entry.items() if k not in CROSS_ATTENTION_INPUTS}
            if not entry:
                continue
        plan[module_id] = entry
    return plan


def shard_like_diffusers_cp(model) -> None:
    """Install ``model``'s context-parallel plan on the default process group."""
    from diffusers.hooks import HookRegistry
    from diffusers.models._modeling_parallel import ContextParallelOutput

    for module_id, entry in cp_plan(model).items():
        if isinstance(entry, ContextParallelOutput):
            entry = [entry]
        for m in _submodules(model, module_id):  # a hook object per module, as diffusers
            hook = _split_hook(entry) if isinstance(entry, dict) else _gather_hook(list(entry))
            HookRegistry.check_if_exists_or_initialize(m).register_hook(
                hook, f"vidsparse-test-cp---{module_id}"
            )


# ---------------------------------------------------------------------------------------------
# the cases, in two processes
# ---------------------------------------------------------------------------------------------


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


def _case(case: str) -> float:
    from tiny_models import TINY_MODELS, first_output

    from vidsparse.integrations.diffusers import apply_sparse_attention
    from vidsparse.parallel import UlyssesAttention

    name, method = case.rsplit("-", 1)
    outputs = []
    for parallel in (False, True):
        model, inputs = TINY_MODELS[name]()
        assert type(model).__name__ == MODELS[name]
        if parallel:
            shard_like_diffusers_cp(model)
        ulysses = {"ulysses": UlyssesAttention()} if parallel else {}
        apply_sparse_attention(model, method, **ulysses, **_options(method))
        _randomise_gates(model)
        with torch.no_grad():  # return_dict=False, as diffusers' pipelines call it
            outputs.append(first_output(model(**inputs, return_dict=False)))
    # An unsharded sequence would not pass unnoticed: the patched attention checks its
    # shards' tokens times the world size against the grid, and the output must be gathered.
    single, sharded = outputs
    assert sharded.shape == single.shape, f"{tuple(sharded.shape)} != {tuple(single.shape)}"
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
    for case in CASES:
        try:
            verdicts[case] = _case(case)
        except Exception as exc:  # noqa: BLE001 - reported to the parent per case
            verdicts[case] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    dist.destroy_process_group()
    torch.save(verdicts, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    # The workers import tiny_models (tests/integrations/ on the path).
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


def _param(case: str):
    if case in XFAIL:
        return pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=XFAIL[case]))
    return case


@pytest.mark.slow
@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_sequence_parallel_model_equals_single_process(verdicts, case):
    for rank, v in enumerate(verdicts):
        assert isinstance(v[case], float), f"rank {rank}: {v[case]}"
        assert v[case] <= 1e-5, f"rank {rank}: relative max error {v[case]:.2e}"


def test_every_model_with_a_cp_plan_is_covered():
    """A class of the models table that gains a ``_cp_plan`` in diffusers joins MODELS (or
    LEFT_OUT, with the reason in the module docstring)."""
    import diffusers

    from vidsparse.integrations.diffusers import SUPPORTED_MODELS

    with_plan = {n for n in SUPPORTED_MODELS if getattr(getattr(diffusers, n), "_cp_plan", None)}
    assert with_plan == set(MODELS.values()) | set(LEFT_OUT)


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
