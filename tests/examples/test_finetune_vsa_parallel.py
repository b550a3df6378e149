"""``examples/finetune_vsa.py --sequence-parallel 2`` on two gloo processes, at tiny size: each
clip's tokens are sharded over both processes (``apply_sequence_parallel`` from the model's
``_cp_plan``, the self-attention through Ulysses) and the run's losses equal the one-process
run's within fp32 tolerance: VSA (through the sparsity schedule, with checkpoints), the dense
baseline, and VSA with plain SGD and no clipping, whose steps scale with the gradient (AdamW's
barely do), so a gradient off by a factor shows; resuming the sequence-parallel run from its
checkpoint repeats its losses exactly. Four processes: sequence x data parallel, and padded
heads (tiny Wan's 2 heads on 4 ranks).

The two processes are spawned once for the module and run the recipe's ``main()`` for each
run (``accelerate`` takes the gloo group they set up first, as it sets one up itself under
``ACCELERATE_USE_CPU=1 torchrun``); the one-process runs are in-process here, as in
``test_finetune_vsa.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from pathlib import Path

import pytest
import torch

from gloo import spawn_gloo
from helpers import load_script

pytest.importorskip("diffusers", minversion="0.36")
pytest.importorskip("accelerate")

WORLD = 2
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_vsa.py"
# 6 steps, sparsity 0, 0, 1/6, 1/3, 0.5, 0.5; a checkpoint after step 3 (resumed below).
VSA = ["--max-steps", "6", "--checkpoint-every", "3", "--warmup-steps", "2", "--ramp-steps", "3",
       "--num-levels", "3"]  # fmt: skip
DENSE = ["--method", "dense", "--max-steps", "3"]
SGD = ["--max-steps", "3", "--warmup-steps", "1", "--ramp-steps", "0", "--lr", "0.05",
       "--max-grad-norm", "0"]  # fmt: skip
RUNS = {"vsa": VSA, "dense": DENSE, "sgd": SGD}


@contextlib.contextmanager
def sgd_for_adamw(active: bool):
    """The recipe's ``torch.optim.AdamW(params, lr=..., weight_decay=...)`` gives plain SGD."""
    adamw = torch.optim.AdamW
    if active:
        torch.optim.AdamW = lambda params, lr, weight_decay: torch.optim.SGD(
            params, lr=lr, weight_decay=weight_decay
        )
    try:
        yield
    finally:
        torch.optim.AdamW = adamw


def load_recipe():
    return load_script(EXAMPLE)


def finetune(recipe, data: Path, output: Path, *args: str) -> int:
    return recipe.main(
        ["--tiny", "--data", str(data), "--output", str(output), "--no-progress", *args]
    )


def losses(output: Path) -> list[tuple[int, float, float]]:
    lines = (output / "loss.jsonl").read_text().splitlines()
    return [(s["step"], s["loss"], s["sparsity"]) for s in map(json.loads, lines)]


def _runs(rank: int, world: int, tmp: str, runs: dict) -> dict:
    """``main()`` for each of ``runs`` (name -> (folder, args)), one after the other, on one
    process of ``world``; ``{name: exit code or traceback}``."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})  # as torchrun sets them
    recipe, root, codes = load_recipe(), Path(tmp), {}
    for name, (folder, args) in runs.items():
        try:
            with sgd_for_adamw(name.startswith("sgd")):
                codes[name] = finetune(recipe, root / "data", root / folder, *args)
        except Exception:  # noqa: BLE001 - reported to the parent
            codes[name] = traceback.format_exc()
            break  # a later run would start collectives the other ranks are not in
    return codes


def check_exit_codes(codes: list[dict], name: str) -> None:
    """Every rank's ``main()`` of run ``name`` returned 0 (else its output, in full)."""
    found = [c.get(name, "not run: an earlier run failed") for c in codes]
    bad = {rank: code for rank, code in enumerate(found) if code != 0}
    assert not bad, "\n".join(f"rank {rank}: {code}" for rank, code in bad.items())


def spawn(tmp: Path, world: int, runs: dict) -> list[dict]:
    """Run ``runs`` on ``world`` gloo processes; each rank's ``{name: exit code}``."""
    job = f"job{len(list(tmp.glob('job*-rank0.pt')))}"  # a fresh store file for every spawn
    return spawn_gloo(_runs, world, tmp, job, str(tmp), runs, env=_accelerate_env(world))


def _accelerate_env(world: int) -> dict:
    """What ``torchrun`` would set for ``accelerate`` on every rank (``_runs`` sets the rank's
    own)."""
    return {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "true",
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("finetune_sp")
    load_recipe().make_tiny_data(tmp / "data", 4)
    return tmp


@pytest.fixture(scope="module")
def runs(data):
    """``(tmp folder, each rank's exit codes)`` after the runs of ``RUNS`` (and a resumed VSA
    run) with ``--sequence-parallel 2`` on two processes, in ``tmp/sp-<name>``, and on one
    process in ``tmp/single-<name>``."""
    recipe = load_recipe()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("VIDSPARSE_BACKEND", "torch")
            for name, args in RUNS.items():
                with sgd_for_adamw(name == "sgd"):
                    assert finetune(recipe, data / "data", data / f"single-{name}", *args) == 0
    finally:
        torch.set_num_threads(threads)
    sp = ["--sequence-parallel", str(WORLD)]
    checkpoint = str(data / "sp-vsa" / "checkpoints" / "step-000003")
    parallel = {name: (f"sp-{name}", [*args, *sp]) for name, args in RUNS.items()}
    parallel["resumed"] = ("sp-resumed", [*VSA, *sp, "--resume", checkpoint])
    return data, spawn(data, WORLD, parallel)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_sequence_parallel_losses_equal_one_process(runs, name):
    tmp, codes = runs
    check_exit_codes(codes, name)
    state = json.loads((tmp / f"sp-{name}/checkpoints/step-000003/training_state.json").read_text())
    assert state["identity"]["data"]["sequence_parallel"] == WORLD
    single, parallel = losses(tmp / f"single-{name}"), losses(tmp / f"sp-{name}")
    assert [s[::2] for s in parallel] == [s[::2] for s in single]  # steps and sparsity
    torch.testing.assert_close(
        torch.tensor([s[1] for s in parallel]),
        torch.tensor([s[1] for s in single]),
        rtol=1e-4,
        atol=1e-6,
    )


@pytest.mark.slow
def test_sequence_parallel_resume_repeats_the_run(runs):
    tmp, codes = runs
    check_exit_codes(codes, "resumed")
    assert losses(tmp / "sp-resumed") == losses(tmp / "sp-vsa")[3:]  # bit for bit


def test_sequence_parallel_must_divide_the_processes(tmp_path, capsys, monkeypatch):
    """One process, ``--sequence-parallel 2``: refused before training, nothing written."""
    monkeypatch.setenv("VIDSPARSE_BACKEND", "torch")
    recipe = load_recipe()
    recipe.make_tiny_data(tmp_path / "data", 1)
    args = ["--sequence-parallel", "2", "--max-steps", "1", "--warmup-steps", "0"]
    assert finetune(recipe, tmp_path / "data", tmp_path / "run", *args, "--ramp-steps", "0") == 2
    assert "--sequence-parallel 2 does not divide the 1 processes" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_four_processes(runs):
    """Four processes: ``--sequence-parallel 2`` makes two data-parallel groups of two, whose
    losses equal those of two data-parallel processes (the same clips and noise per group);
    ``--sequence-parallel 4`` pads the tiny model's 2 heads to 4 (``pad_heads``) and its
    losses equal the one-process run's."""
    data, _ = runs
    args = ["--batch-size", "2", *SGD]
    dp = spawn(data, 2, {"sgd": ("dp2", args)})
    four = spawn(data, 4, {"sgd": ("sp2-dp2", [*args, "--sequence-parallel", "2"]),
                           "sgd_padded": ("sp4", [*SGD, "--sequence-parallel", "4"])})  # fmt: skip
    check_exit_codes(dp + four, "sgd")
    check_exit_codes(four, "sgd_padded")
    for single, parallel in (("dp2", "sp2-dp2"), ("single-sgd", "sp4")):
        expected, found = losses(data / single), losses(data / parallel)
        assert [s[::2] for s in found] == [s[::2] for s in expected]
        torch.testing.assert_close(
            torch.tensor([s[1] for s in found]), torch.tensor([s[1] for s in expected]),
            rtol=1e-4, atol=1e-6,
        )  # fmt: skip
