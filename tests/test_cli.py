"""The command-line tool: exit codes, outputs, help."""

import json
import subprocess
import sys

import pytest

from vidsparse.cli import main


def test_demo_writes_report(tmp_path, torch_backend, capsys):
    assert main(["demo", "--out", str(tmp_path), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    methods = [r["method"] for r in report["results"]]
    assert methods[0].startswith("dense") and methods[1].startswith("VSA")
    assert report["workload"]["reduced"] is True
    vsa = report["results"][1]
    assert 0 < vsa["rel_l2"] < 0.5  # sparse output close to dense on video-like inputs
    assert "reduced grid" in capsys.readouterr().out


def test_demo_json_on_stdout(tmp_path, torch_backend, capsys):
    assert main(["demo", "--out", str(tmp_path), "--device", "cpu", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["results"][0]["speedup"] == 1.0


@pytest.mark.parametrize(
    "argv", [["frobnicate"], ["demo", "--bogus"], ["demo", "--sparsity", "1.5"], []]
)
def test_bad_usage_exits_2_without_traceback(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_help_has_examples():
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", "demo", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "example" in proc.stdout
