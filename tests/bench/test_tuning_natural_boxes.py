"""``benchmarks/tuning/try_natural_boxes.py`` keeps working on the CPU: its two layouts agree
with the fp32 reference in the interpreter (edge tiles in every axis), and both compile for
sm_90 without spills (what its GPU timing compares)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tuning" / "try_natural_boxes.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(*args: str, interpret: bool) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=SRC, CUDA_VISIBLE_DEVICES="")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # compiling needs the real JIT
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.interpreter
def test_both_layouts_match_the_reference():
    (check,) = _run("--check", interpret=True)
    assert check["ok"]
    assert set(check["rel_l2_vs_fp32"]) == {"natural", "tiled"}
    assert all(err < 1e-5 for err in check["rel_l2_vs_fp32"].values()), check


def test_both_layouts_compile_for_sm90_without_spills():
    rows = _run("--compile", interpret=False)
    assert [r["arm"] for r in rows] == ["tiled", "natural"]
    assert all(r["spill_bytes"] == 0 and not r["ptxas_warnings"] for r in rows), rows
