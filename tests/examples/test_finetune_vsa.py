"""``examples/finetune_vsa.py`` at tiny size on the CPU: the loss falls, a resumed run repeats
the uninterrupted run's losses and weights exactly, and each bad input stops before training
with exit status 2, its problem named, nothing written.

In-process runs of ``main()`` under the reference backend, one torch thread (the tiny model's
ops are so small that two threads on the two shared CI cores spend a step ten times longer
waiting for each other): about 0.1 s a step. The ``slow`` test runs the script as a user does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script

pytest.importorskip("diffusers", minversion="0.36")
pytest.importorskip("accelerate")

from safetensors.torch import load_file, save_file  # noqa: E402

from vidsparse.integrations.diffusers import (  # noqa: E402
    load_sparse_attention,
    remove_sparse_attention,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_vsa.py"
pytestmark = pytest.mark.usefixtures("torch_backend", "one_thread", "nothing_left_patched")
# Sparsity changes across the checkpoint of the resume tests (step 3): 1/6, 1/3, then 0.5.
RAMP = ["--warmup-steps", "2", "--ramp-steps", "3", "--num-levels", "3"]


def load_recipe():
    return load_script(EXAMPLE)


recipe = load_recipe()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def nothing_left_patched():
    """The later tests of the session see diffusers' own attention call again."""
    yield
    assert not routed_modules()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("clips")
    recipe.make_tiny_data(folder, 8)
    return folder


def finetune(data: Path, output: Path, *args: str) -> int:
    return recipe.main(
        ["--tiny", "--data", str(data), "--output", str(output), "--no-progress", *args]
    )


def logged(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "loss.jsonl").read_text().splitlines()]


def losses(output: Path) -> list[tuple[int, float, float]]:
    """``(step, loss, sparsity)`` per logged step (the timings differ from run to run)."""
    return [(s["step"], s["loss"], s["sparsity"]) for s in logged(output)]


def snapshot(*folders: Path) -> dict:
    """Every file under ``folders`` with its size and modification time."""
    files = {}
    for folder in folders:
        for path in folder.rglob("*"):
            stat = path.stat()
            files[path] = (stat.st_size, stat.st_mtime_ns)
    return files


def trained_model(folder: Path):
    """The result as a user loads it: stock ``from_pretrained``, then the gates."""
    model = recipe.MODEL_CLASS.from_pretrained(folder)
    load_sparse_attention(model, folder)
    return model.eval()


def initial_model():
    """What the recipe starts from at ``--seed 0``: the tiny model, zero gates."""
    torch.manual_seed(0)
    model = recipe.MODEL_CLASS(**recipe.TINY_TRANSFORMER)
    recipe.apply_sparse_attention(model, "vsa", sparsity=0.5, gate=True)
    return model.eval()


@torch.no_grad()
def eval_loss(model, data: Path) -> float:
    """The flow-matching loss over every clip at three fixed noise levels and fixed noise."""
    clips = recipe.scan_clips(data)
    latents, text = recipe.load_batch(clips, list(range(len(clips.files))), "cpu")
    generator = torch.Generator().manual_seed(123)
    losses = []
    for level in (0.25, 0.5, 0.75):
        noise = torch.randn(latents.shape, generator=generator)
        t = torch.full((latents.shape[0],), level)
        losses.append(recipe.flow_matching_loss(model, latents, text, t, noise).item())
    remove_sparse_attention(model)  # the routing is process-wide while a model is patched
    return sum(losses) / len(losses)


def routed_modules() -> list[str]:
    """The diffusers modules whose attention call vidsparse's shim replaces now."""
    import diffusers.models.transformers.transformer_wan as transformer_wan

    return [
        m.__name__
        for m in (transformer_wan,)
        if hasattr(m.dispatch_attention_fn, "_vidsparse_shim")
    ]


def test_the_loss_falls_through_the_schedule(tmp_path, data):
    assert finetune(data, tmp_path / "run") == 0  # --tiny: 20 steps, dense -> 0.5 by step 6
    steps = logged(tmp_path / "run")
    assert [s["step"] for s in steps] == list(range(20))
    assert [s["sparsity"] for s in steps[:7]] == [0.0, 0.0, 0.25, 0.25, 0.25, 0.25, 0.5]
    losses = [s["loss"] for s in steps]
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
    # On held-out noise at fixed levels, the saved result against the model it started from.
    before = eval_loss(initial_model(), data)
    after = eval_loss(trained_model(tmp_path / "run" / "final" / "transformer"), data)
    assert after < 0.8 * before, (before, after)
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step-000010", "step-000020"]


@pytest.mark.parametrize("train", ["all", "gates"])
def test_resume_repeats_the_uninterrupted_run(tmp_path, data, train):
    args = ["--max-steps", "6", "--checkpoint-every", "3", "--train", train, *RAMP]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert finetune(data, whole, *args) == 0
    checkpoint = whole / "checkpoints" / "step-000003"
    assert finetune(data, resumed, *args, "--resume", str(checkpoint)) == 0
    assert losses(resumed) == losses(whole)[3:]  # bit for bit
    weights = [
        load_file(run / "final" / "transformer" / "diffusion_pytorch_model.safetensors")
        for run in (whole, resumed)
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    if train == "gates":  # the stock weights did not move; the checkpoint holds the gates
        model = initial_model()
        stock = model.state_dict()
        remove_sparse_attention(model)
        assert all(torch.equal(v, weights[0][k]) for k, v in stock.items() if "gate" not in k)
        assert not any(torch.equal(v, weights[0][k]) for k, v in stock.items() if "gate" in k)
        assert (checkpoint / "gates.safetensors").is_file()


def test_resume_into_its_own_folder_rewrites_the_later_steps(tmp_path, data):
    args = ["--max-steps", "6", "--checkpoint-every", "3", *RAMP]
    run = tmp_path / "run"
    assert finetune(data, run, *args) == 0
    before = losses(run)
    assert finetune(data, run, *args, "--resume", str(run / "checkpoints" / "step-000003")) == 0
    assert losses(run) == before


def test_the_dense_baseline_with_logit_normal_levels(tmp_path, data):
    args = ["--method", "dense", "--timestep-sampling", "logit-normal", "--batch-size", "3"]
    assert finetune(data, tmp_path / "run", *args, "--max-steps", "2") == 0
    assert [(step, sparsity) for step, _, sparsity in losses(tmp_path / "run")] == [
        (0, 0.0),
        (1, 0.0),
    ]
    final = tmp_path / "run" / "final" / "transformer"
    weights = load_file(final / "diffusion_pytorch_model.safetensors")
    assert weights.keys() == recipe.MODEL_CLASS(**recipe.TINY_TRANSFORMER).state_dict().keys()


@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_run(tmp_path, data):
    """``--compile``: the same losses through the schedule (compiled blocks, checkpointed,
    through VSA's gates), and a result that loads into the stock model."""
    args = ["--max-steps", "6", *RAMP]
    assert finetune(data, tmp_path / "eager", *args) == 0
    assert finetune(data, tmp_path / "compiled", *args, "--compile") == 0
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert [(s, p) for s, _, p in compiled] == [(s, p) for s, _, p in eager]
    assert [loss for _, loss, _ in compiled] == pytest.approx([loss for _, loss, _ in eager],
                                                              rel=1e-3)  # fmt: skip
    weights = load_file(tmp_path / "compiled" / "final" / "transformer" /
                        "diffusion_pytorch_model.safetensors")  # fmt: skip
    assert weights.keys() == load_file(tmp_path / "eager" / "final" / "transformer" /
                                       "diffusion_pytorch_model.safetensors").keys()  # fmt: skip


def test_compile_refuses_sequence_parallelism(tmp_path, data, capsys):
    with pytest.raises(SystemExit) as info:
        finetune(data, tmp_path / "run", "--compile", "--sequence-parallel", "2")
    assert info.value.code == 2
    assert "--compile does not take --sequence-parallel" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data) -> Path:
    """A 2-step VSA run with a checkpoint at step 2, for the resume errors."""
    run = tmp_path_factory.mktemp("finished") / "run"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VIDSPARSE_BACKEND", "torch")
        torch.set_num_threads(1)
        args = ["--max-steps", "2", "--warmup-steps", "0", "--ramp-steps", "0"]
        assert finetune(data, run, *args) == 0
    torch.set_num_threads(threads)
    return run


def mismatched_clips(folder: Path, data: Path) -> Path:
    for path in sorted(data.iterdir())[:3]:
        (folder / path.name).write_bytes(path.read_bytes())
    clip = load_file(folder / "clip_00001.safetensors")
    clip["latents"] = torch.zeros(4, 3, 16, 24)
    save_file(clip, folder / "clip_00001.safetensors")
    return folder


def clips_without_text(folder: Path, data: Path) -> Path:
    for path in sorted(data.iterdir())[:2]:
        clip = load_file(path)
        if path.name == "clip_00001.safetensors":
            del clip["text_embeds"]
        save_file(clip, folder / path.name)
    return folder


@pytest.mark.parametrize(
    ("make_data", "args", "message"),
    [
        (mismatched_clips, [], "clip clip_00001.safetensors has latents of shape [4, 3, 16, 24]"),
        (clips_without_text, [], "clip clip_00001.safetensors has no text_embeds tensor"),
        (None, ["--max-steps", "5"], "reaches its target 0.5 at step 6, outside the step"),
        (None, ["--target-sparsity", "1.0"], "sparsity schedule: target must be in [0, 1)"),
    ],
    ids=["mismatched-shapes", "no-text-embeds", "schedule-too-long", "bad-target"],
)
def test_bad_data_or_schedule(tmp_path, data, capsys, make_data, args, message):
    if make_data is not None:
        (tmp_path / "bad").mkdir()
        data = make_data(tmp_path / "bad", data)
    before = snapshot(tmp_path, data)
    assert finetune(data, tmp_path / "run", *args) == 2
    assert message in capsys.readouterr().err
    assert snapshot(tmp_path, data) == before  # no output folder, the data untouched


def test_an_output_folder_holding_a_run_is_refused(tmp_path, data, finished_run, capsys):
    before = snapshot(finished_run)
    args = ["--max-steps", "4", "--warmup-steps", "0", "--ramp-steps", "0"]
    assert finetune(data, finished_run, *args) == 2
    assert "holds files already: resume it with --resume" in capsys.readouterr().err
    assert snapshot(finished_run) == before


@pytest.mark.parametrize(
    ("change", "args", "message"),
    [
        ("layers", [], "another model config (config.num_layers: 2 there, 3 here)"),
        (None, ["--method", "dense"], "another method (method: 'vsa' there, 'dense' here;"),
        (None, ["--target-sparsity", "0.25"], "another method (sparsity: 0.5 there, 0.25 here)"),
        (None, ["--warmup-steps", "1"], "another sparsity schedule (warmup_steps: 0 there, 1 "),
        (None, ["--seed", "1"], "another data set, batch size, seed or process count (seed: 0"),
        ("not-a-checkpoint", [], "is not a checkpoint of this recipe (no training_state.json)"),
    ],
    ids=["model-config", "method", "sparsity", "schedule", "seed", "not-a-checkpoint"],
)
def test_a_checkpoint_of_another_run_is_refused(
    tmp_path, data, finished_run, capsys, monkeypatch, change, args, message
):
    checkpoint = finished_run / "checkpoints" / "step-000002"
    if change == "layers":  # the command's model has one layer more than the checkpoint's
        monkeypatch.setitem(recipe.TINY_TRANSFORMER, "num_layers", 3)
    if change == "not-a-checkpoint":
        checkpoint = finished_run / "final"
    if "--warmup-steps" not in args:
        args = [*args, "--warmup-steps", "0"]
    before = snapshot(finished_run)
    args = [*args, "--max-steps", "4", "--ramp-steps", "0", "--resume", str(checkpoint)]
    assert finetune(data, tmp_path / "run", *args) == 2
    assert message in capsys.readouterr().err
    assert snapshot(finished_run) == before
    assert not (tmp_path / "run").exists()


def test_make_tiny_data_refuses_a_folder_with_clips(data, capsys):
    before = snapshot(data)
    assert recipe.main(["--make-tiny-data", str(data), "2"]) == 2
    assert "holds .safetensors clips already" in capsys.readouterr().err
    assert snapshot(data) == before


@pytest.mark.slow
def test_as_a_script(tmp_path):
    """As a user runs it: a fresh interpreter, the default backend (no Triton interpreter)."""
    unset = ("TRITON_INTERPRET", "VIDSPARSE_BACKEND")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["OMP_NUM_THREADS"] = "1"
    for args in (
        ["--make-tiny-data", "data", "4"],
        ["--tiny", "--data", "data", "--output", "run", "--max-steps", "8"],
    ):
        done = subprocess.run(
            [sys.executable, str(EXAMPLE), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
    assert "vidsparse: vsa on 2 video self-attention layers" in done.stderr
    assert "done: step 8" in done.stdout
    assert len(logged(tmp_path / "run")) == 8
