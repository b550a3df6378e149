"""The diffusers integration under sequence parallelism (``apply_sparse_attention(...,
ulysses=UlyssesAttention())``), two gloo processes on the CPU.

Each rank shards a tiny model's sequence with ``apply_sequence_parallel``: the model class's own
``_cp_plan`` installed as diffusers' context parallelism installs it (``HookRegistry`` hooks
that wrap the module's ``forward``, so the torch forward pre-hooks, vidsparse's latent-grid hook
on the transformer, still see the whole inputs), the inputs only the cross-attention reads kept
whole on every rank (the stock cross-attention then runs locally on the rank's queries against
the whole text: the same math). diffusers' own ``enable_parallelism`` needs an accelerator. The
model output is compared with the single-process output of the same method: dense, VSA (with a
non-zero gate projection, so the gate's exchange matters) and PSA.

Covered: every class of vidsparse's models table with a ``_cp_plan`` in diffusers 0.42 but
LTX-2 -- Wan (``wan_t2v``), ChronoEdit and LTX-Video -- with the tiny models of
``tiny_models.py``. LTX-2 is refused by ``apply_sequence_parallel`` (its ``UNSHARDABLE``): its
plan shards the video only (``hidden_states`` and the ``rope`` tables), while its audio-video
cross-attentions mix the two streams. The video-to-audio attention takes the video as keys and
values, so each rank's (whole) audio would attend to its own video shard only, and feed that
back to the video through the audio-to-video attention: no sharding of the inputs makes it the
single-process model without the dispatch's ``parallel_config`` gathering the video there.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch

from gloo import spawn_gloo

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
# Classes with a _cp_plan left out: those apply_sequence_parallel refuses (its UNSHARDABLE).
LEFT_OUT = ("LTX2VideoTransformer3DModel",)
CASES = tuple(f"{model}-{method}" for model in MODELS for method in METHODS)
XFAIL: dict[str, str] = {}  # case -> reason, for a failure inside vidsparse's integration


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

    from vidsparse.integrations.diffusers import apply_sequence_parallel, apply_sparse_attention
    from vidsparse.parallel import UlyssesAttention

    name, method = case.rsplit("-", 1)
    outputs = []
    for parallel in (False, True):
        model, inputs = TINY_MODELS[name]()
        assert type(model).__name__ == MODELS[name]
        if parallel:
            apply_sequence_parallel(model)
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


def _all_cases(rank: int, world: int) -> dict:
    verdicts = {}
    for case in CASES:
        try:
            verdicts[case] = _case(case)
        except Exception as exc:  # noqa: BLE001 - reported to the parent per case
            verdicts[case] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return verdicts


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    # The workers import tiny_models (tests/integrations/ on the path).
    saved = os.environ.get("PYTHONPATH")
    tests_dir = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, saved) if p)
    try:
        return spawn_gloo(_all_cases, WORLD, tmp, "cases")
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


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
    from vidsparse.integrations.diffusers.sequence_parallel import UNSHARDABLE

    with_plan = {n for n in SUPPORTED_MODELS if getattr(getattr(diffusers, n), "_cp_plan", None)}
    assert with_plan == set(MODELS.values()) | set(LEFT_OUT)
    assert set(LEFT_OUT) == set(UNSHARDABLE)


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
