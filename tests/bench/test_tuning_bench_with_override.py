"""``benchmarks/tuning/bench_with_override.py`` runs a bench command under
``configs.override(...)`` and records the overrides in the JSON it writes; a field that
``configs.Overrides`` lacks is refused before anything runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tuning" / "bench_with_override.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC, VIDSPARSE_BACKEND="torch", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # the torch backend needs no interpreter
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_the_bench_json_names_its_overrides(tmp_path):
    out = tmp_path / "vsa.json"
    done = _run("out_rows=true", "grad_rows=false", "--", "vsa", "--device", "cpu", "--tiny",
                "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads(out.read_text())["meta"]
    assert meta["overrides"] == {"out_rows": True, "grad_rows": False}


def test_an_unknown_override_is_refused():
    done = _run("no_such_knob=true", "--", "vsa", "--device", "cpu", "--tiny")
    assert done.returncode != 0
    assert "not a configs.Overrides field" in done.stderr
