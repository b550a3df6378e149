"""``benchmarks/tuning/try_schedule_steps.py`` keeps working: at ``--tiny`` size on the CPU its
scheduled arm with dynamo's floats specialised runs in its own process and comes back as rows
(the other two variants differ only in their arguments, and each process costs a minute)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tuning" / "try_schedule_steps.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.slow
def test_the_specialised_scheduled_arm_runs_at_tiny_size(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--variants", "scheduled-specialized"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "try_schedule_steps.json").read_text())
    (rows,) = results.values()
    assert list(results) == ["scheduled-specialized"]
    assert [(r["step"], r["sparsity"]) for r in rows] == [(0, 0.0), (2, 0.4375), (4, 0.875)]
    assert all(r["step_ms"] > 0 for r in rows[1:])
