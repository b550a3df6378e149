"""``benchmarks/tuning/try_schedule_steps.py`` keeps working: at ``--tiny`` size on the CPU its
scheduled arm with dynamo's floats specialised runs in its own process and comes back as rows
(the other variants differ only in their arguments, and each process costs a minute; the
round-robin of `--repeats` is tested with the arm stubbed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tuning" / "try_schedule_steps.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.slow
def test_the_specialised_scheduled_arm_runs_at_tiny_size(tmp_path):
    # The reference backend: the script's plumbing is what is under test here (the Triton
    # path in the interpreter made this one test take ~2 minutes of CI per toolchain;
    # train_vsa's own tests run it there).
    env = dict(os.environ, PYTHONPATH=SRC, OUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="",
               VIDSPARSE_BACKEND="torch")  # fmt: skip
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--variants", "scheduled-specialized"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "out" / "try_schedule_steps.json").read_text())
    results = saved["arms"]
    assert saved["meta"]["device"] == "cpu" and "torch" in saved["meta"]
    (rows,) = results.values()
    assert list(results) == ["scheduled-specialized"]
    assert [(r["step"], r["sparsity"]) for r in rows] == [(0, 0.0), (2, 0.4375), (4, 0.875)]
    assert all(r["step_ms"] > 0 for r in rows[1:])


def test_repeats_run_the_variants_in_turn_under_numbered_labels(tmp_path, monkeypatch):
    script = load_script(SCRIPT)
    calls = []

    def fake_run(label, argv, specialize, out_dir, size):
        calls.append((label, argv[1]))
        return [{"step": 0, "sparsity": 0.0, "step_ms": float(len(calls))}]

    monkeypatch.setattr(script, "run", fake_run)
    monkeypatch.setenv("OUT", str(tmp_path))
    script.main(["--tiny", "--variants", "dense,scheduled", "--repeats", "2", "--json", "t.json"])
    assert calls == [("dense#1", "dense"), ("scheduled#1", "vsa0.875-warmup"),
                     ("dense#2", "dense"), ("scheduled#2", "vsa0.875-warmup")]  # fmt: skip
    results = json.loads((tmp_path / "t.json").read_text())["arms"]
    assert list(results) == ["dense#1", "scheduled#1", "dense#2", "scheduled#2"]
    assert [rows[0]["step_ms"] for rows in results.values()] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--variants", "dense,bogus"]])
def test_bad_arguments_stop_before_any_arm_runs(argv, monkeypatch):
    script = load_script(SCRIPT)
    monkeypatch.setattr(script, "run", lambda *a: pytest.fail("an arm ran"))
    with pytest.raises(SystemExit) as stop:
        script.main(["--tiny", *argv])
    assert stop.value.code == 2
