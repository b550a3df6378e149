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


def _write_calibration(folder, steps=(0, 1, 2, 3, 4), layers=(0, 1)):
    from vidsparse import StripeSpec, VideoGrid
    from vidsparse.search import (
        CalibrationSample,
        Candidate,
        planted_stripe_heads,
        save_calibration_sample,
    )

    grid = VideoGrid((4, 8, 8), tile=(1, 4, 4))
    planted = [Candidate(StripeSpec(1, 0, None, 1, 0, None)), Candidate(StripeSpec.dense())]
    for step in steps:
        for layer in layers:
            syn = planted_stripe_heads(grid, planted, head_dim=16, seed=10 * step + layer)
            sample = CalibrationSample(step, layer, syn.q, syn.k, syn.v)
            save_calibration_sample(sample, folder / f"s{step}_l{layer}.pt", grid=grid)
    return grid


def test_search_then_inspect(tmp_path, torch_backend, capsys):
    calib = tmp_path / "calib"
    calib.mkdir()
    _write_calibration(calib)
    plan, table = tmp_path / "plan.json", tmp_path / "losses.pt"
    argv = [
        "search",
        str(calib),
        "--grid",
        "4",
        "8",
        "8",
        "--tile",
        "1",
        "4",
        "4",
        "--alpha",
        "0.05",
        "--num-steps",
        "5",
        "--device",
        "cpu",
        "--out",
        str(plan),
        "--table",
        str(table),
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan.exists() and table.exists()
    assert main(["inspect", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    # re-plan from the saved losses at a target sparsity, without attention
    replan = tmp_path / "plan2.json"
    argv = ["search", "--from-table", str(table), "--target-sparsity", "0.5", "--out", str(replan)]
    assert main(argv) == 0
    assert replan.exists()


def test_inspect_rejects_bad_plan_with_exit_2(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"format": "something-else"}')
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", "inspect", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "format" in proc.stderr
