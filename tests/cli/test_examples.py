"""The diffusers pipeline examples (``examples/wan22_pipeline.py``,
``examples/hunyuanvideo15_pipeline.py``) with ``--tiny``: tiny random-weight pipelines on the
CPU, no downloads.

In-process runs (``main()`` under the reference backend) cover every method, the
per-transformer plans and the calibrate -> ``vidsparse search`` -> plans chain in seconds; the
``slow`` tests run the scripts as a user does, in a fresh interpreter (12-25 s on 2 CPU cores,
most of it importing torch, Triton and diffusers).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

pytest.importorskip("diffusers", minversion="0.36")

from vidsparse.cli import main as vidsparse_main  # noqa: E402
from vidsparse.layout.grid import VideoGrid  # noqa: E402
from vidsparse.masks.stripe import StripeSpec  # noqa: E402
from vidsparse.search.plan import HeadChoice, Plan, PlanBucket, save_plan  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WAN, HUNYUAN = "wan22_pipeline", "hunyuanvideo15_pipeline"
METHODS = ("dense", "vsa", "psa")
STEPS, GRID = 4, (3, 8, 10)  # the tiny pipelines' steps and latent grid in tokens
# What the examples promise: a timed run of the eager pipeline and the decoded video's path.
RUN_LINE = re.compile(r"^run 1: (\w+), 4 steps in \d+\.\d+ s \(\d+ ms/step, eager\)$", re.M)
VIDEO_LINE = re.compile(r"^video: 9 frames of 160x128 -> (.+)$", re.M)


def load_example(name: str):
    return load_script(EXAMPLES / f"{name}.py", f"example_{name}")


@pytest.fixture
def run_in_process(monkeypatch, tmp_path, torch_backend, capsys, caplog):
    """``run(name, *args) -> (stdout, log text)``: the example's ``main()`` with ``args``."""
    levels = {n: logging.getLogger(n).level for n in ("vidsparse", WAN, HUNYUAN)}
    monkeypatch.chdir(tmp_path)

    def run(name: str, *args: str) -> tuple[str, str]:
        module = load_example(name)
        monkeypatch.setattr(sys, "argv", [f"{name}.py", "--tiny", *args])
        caplog.clear()
        with caplog.at_level(logging.INFO):
            module.main()
        return capsys.readouterr().out, caplog.text

    yield run
    for name, level in levels.items():  # main() raises vidsparse's log level
        logging.getLogger(name).setLevel(level)


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The example as a user runs it: a fresh interpreter, the default backend choice (no
    Triton interpreter: the tests' conftest sets it for this process only)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VIDSPARSE_BACKEND")
    }
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--tiny", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def check_video(out: str, folder: Path, method: str) -> Path:
    assert RUN_LINE.search(out).group(1) == method, out
    path = folder / VIDEO_LINE.search(out).group(1)
    assert path.read_bytes()[:4] == b"GIF8"  # decoded frames, written with PIL
    return path


def tiny_plan(dense_steps: int) -> Plan:
    """A plan for the tiny models: 2 layers, 2 heads, the tiny grid, sparse after the dense
    steps."""
    spec = StripeSpec(1, 0, 1, 1, 0, 2)
    choice = tuple(HeadChoice(spec, "block", 0.5, 0.1, 0.9) for _ in range(2))
    return Plan(
        model="tiny",
        grid=VideoGrid(GRID, (1, 4, 4)),
        num_heads=2,
        num_steps=STEPS,
        dense_steps=dense_steps,
        buckets=(PlanBucket(dense_steps, STEPS, {0: choice, 1: choice}),),
        selection={"mode": "alpha", "alpha": 0.05, "target_sparsity": None, "metric": "rel_l2"},
    )


@pytest.mark.parametrize("method", METHODS)
def test_wan22_tiny_patches_both_experts(run_in_process, tmp_path, method):
    out, logs = run_in_process(WAN, "--method", method)
    assert "pipeline: tiny random-weight pipeline (transformer, transformer_2)" in out
    assert f"patched transformer and transformer_2: {method}" in logs
    patched = f"vidsparse: {method} on 2 video self-attention layers of WanTransformer3DModel"
    assert logs.count(patched) == 2
    assert check_video(out, tmp_path, method).name == f"wan22_tiny_{method}.gif"


@pytest.mark.parametrize("method", METHODS)
def test_hunyuanvideo15_tiny(run_in_process, tmp_path, method):
    out, logs = run_in_process(HUNYUAN, "--method", method, "--runs", "2")
    assert "pipeline: tiny random-weight pipeline (transformer)" in out
    assert f"patched transformer: {method}" in logs
    patched = f"vidsparse: {method} on 2 video self-attention layers of HunyuanVideo15Transformer"
    assert logs.count(patched) == 1
    assert f"run 2: {method}, 4 steps in " in out
    assert check_video(out, tmp_path, method).name == f"hunyuanvideo15_tiny_{method}.gif"


def test_wan22_tiny_one_plan_per_expert(run_in_process, tmp_path):
    save_plan(tiny_plan(1), tmp_path / "high.json")
    save_plan(tiny_plan(2), tmp_path / "low.json")
    args = ("--method", "psa", "--plan", "high.json", "--plan-2", "low.json", "--output", "p.gif")
    out, logs = run_in_process(WAN, *args)
    assert "no --plan" not in logs
    assert check_video(out, tmp_path, "psa") == tmp_path / "p.gif"


def test_hunyuanvideo15_tiny_with_a_plan(run_in_process, tmp_path):
    save_plan(tiny_plan(1), tmp_path / "plan.json")
    out, logs = run_in_process(HUNYUAN, "--method", "psa", "--plan", "plan.json")
    assert "no --plan" not in logs
    check_video(out, tmp_path, "psa")


@pytest.mark.slow
@pytest.mark.parametrize("name", (WAN, HUNYUAN))
def test_tiny_example_runs_as_a_script(tmp_path, name):
    done = run_script(name, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    check_video(done.stdout, tmp_path, "vsa")
    assert "vidsparse: vsa on 2 video self-attention layers" in done.stderr
    assert "Traceback" not in done.stderr


WAN_PLANS = ["--plan", "transformer_plan.json", "--plan-2", "transformer_2_plan.json"]
CHAINS = {  # per example: the folders it calibrates into, the plan arguments of its PSA run
    WAN: (["transformer", "transformer_2"], WAN_PLANS),
    HUNYUAN: ([], ["--plan", "plan.json"]),
}


@pytest.mark.parametrize("name", (WAN, HUNYUAN))
def test_tiny_calibrate_search_then_plans(run_in_process, tmp_path, name):
    folders, plan_args = CHAINS[name]
    out, logs = run_in_process(name, "--calibrate", "calib")
    assert "vidsparse: capture on 2 video self-attention layers" in logs
    commands = re.findall(r"^  vidsparse search (.+)$", out, re.M)
    assert len(commands) == max(1, len(folders))
    for command in commands:  # as printed, at a target sparsity (random weights: no alpha)
        argv = command.replace("--alpha 0.05", "--target-sparsity 0.5").split()
        assert vidsparse_main(["search", *argv, "--device", "cpu", "--no-png"]) == 0
    if folders:  # one subfolder per transformer
        assert sorted(p.name for p in (tmp_path / "calib").iterdir()) == folders
    out, logs = run_in_process(name, "--method", "psa", *plan_args)
    assert "no --plan" not in logs
    check_video(out, tmp_path, "psa")
