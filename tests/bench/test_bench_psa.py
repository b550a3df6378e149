"""The PSA benchmark runs end to end on CPU at tiny size (numbers meaningless, code paths real)."""

import json
import os
import subprocess
import sys


def test_bench_psa_tiny_cpu(tmp_path):
    env = dict(os.environ, VIDSPARSE_BACKEND="torch", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "psa.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vidsparse.bench",
            "psa",
            "--device",
            "cpu",
            "--tiny",
            "--out",
            str(out),
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(out.read_text())
    providers = {r["provider"] for r in data["rows"]}
    assert providers == {"ours", "search"}  # no cuDNN on the CPU: skipped with a note
    assert all("error" not in r for r in data["rows"])
    assert data["meta"]["benchmark"] == "psa"
