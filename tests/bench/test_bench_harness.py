"""The block-sparse benchmark runs end to end on the CPU (reference backend, tiny sizes) and
writes the JSON its readers expect; the harness helpers count and format as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vidsparse.bench import harness

META_KEYS = {
    "gpu",
    "torch",
    "triton",
    "python",
    "git_commit",
    "git_dirty",
    "date_utc",
    "command",
    "timer",
    "flops_convention",
}


def _run_bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "vidsparse.bench", "block_sparse", "--device", "cpu", "--tiny"]
    cmd += ["--out", str(out), *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "cpu-dry-run" in done.stdout  # the table says its timings mean nothing
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_block_sparse_cpu_dry_run(tmp_path):
    result = _run_bench(
        tmp_path,
        "--providers", "ours",
        "--modes", "fwd,fwd+bwd",
        "--densities", "1,0.5",
        "--no-plot",
    )  # fmt: skip
    meta, rows = result["meta"], result["rows"]
    assert meta.keys() >= META_KEYS
    assert meta["complete"] is True
    assert meta["timer"].startswith("cpu-dry-run")
    assert meta["env"]["VIDSPARSE_BACKEND"] == "torch"

    # 3 default block sizes x 2 densities x 2 modes, all of them ours.
    assert len(rows) == 12
    got = {(r["provider"], r["block"], r["density"], r["mode"]) for r in rows}
    want = {
        ("ours", block, density, mode)
        for block in ("128x64", "128x128", "64x64")
        for density in (1.0, 0.5)
        for mode in ("fwd", "fwd+bwd")
    }
    assert got == want
    for r in rows:
        assert not r.get("error"), r
        assert r["shape"] == "tiny" and r["head_dim"] == 64 and r["seq_len"] == 512
        assert r["ms"] > 0 and r["tflops"] > 0
        block_q, block_kv = map(int, r["block"].split("x"))
        nk = 512 // block_kv
        count = max(1, round(r["density"] * nk))
        # Every row of every head lists `count` key blocks of block_q x block_kv pairs.
        assert r["pairs"] == 1 * 2 * (512 // block_q) * count * block_q * block_kv
        factor = {"fwd": 1.0, "fwd+bwd": 3.5}[r["mode"]]
        assert r["flops"] == pytest.approx(4 * 64 * r["pairs"] * factor)
        assert r["time_vs_density1"] > 0
    halves = [r for r in rows if r["density"] == 0.5]
    assert all(r["effective_density"] == pytest.approx(0.5) for r in halves)


@pytest.mark.slow
def test_bench_block_sparse_cpu_all_providers_survive_errors(tmp_path):
    """Every provider on a padded video shape: dense SDPA, flex (eager on the CPU, checked
    against the reference) and ours; flex's CPU backward is unsupported and must be recorded
    as an error row, not end the run."""
    result = _run_bench(
        tmp_path,
        "--shapes", "real",
        "--providers", "ours,cudnn,flex,flex64",
        "--modes", "fwd,bwd",
        "--densities", "0.5",
        "--block-sizes", "128x64",
        "--check",
        "--no-plot",
    )  # fmt: skip
    rows = result["rows"]
    by_key = {(r["provider"], r["block"], r["mode"]): r for r in rows}
    assert set(by_key) == {
        ("cudnn", "dense", "fwd"),
        ("cudnn", "dense", "bwd"),
        ("ours", "128x64", "fwd"),
        ("ours", "128x64", "bwd"),
        ("flex", "128x128", "fwd"),
        ("flex", "128x128", "bwd"),
        ("flex64", "64x64", "fwd"),
        ("flex64", "64x64", "bwd"),
    }
    for key in [("cudnn", "dense", "fwd"), ("ours", "128x64", "fwd"), ("flex", "128x128", "fwd")]:
        assert not by_key[key].get("error"), by_key[key]
    assert "backward" in by_key[("flex", "128x128", "bwd")]["error"]
    # Dense rows run on the 300 real tokens; block-sparse rows on the 768 tile-ordered slots,
    # with FLOPs counted on real pairs only.
    dense = by_key[("cudnn", "dense", "fwd")]
    assert dense["seq_len"] == 300 and dense["pairs"] == 2 * 300 * 300
    ours = by_key[("ours", "128x64", "fwd")]
    assert ours["seq_len"] == 768 and ours["padding_masked"] is True
    assert 0 < ours["pairs"] < 2 * 300 * 300
    assert ours["vs_cudnn"] == pytest.approx(ours["tflops"] / dense["tflops"])
    # At 128-token key blocks a block holds two tiles: padding cannot be masked by
    # kv_block_sizes, and the row says so.
    assert by_key[("flex", "128x128", "fwd")]["padding_masked"] is False


def test_harness_flops_table_and_json(tmp_path):
    assert harness.attention_flops(10, 128, "fwd") == 4 * 128 * 10
    assert harness.attention_flops(10, 128, "bwd") == pytest.approx(2.5 * 4 * 128 * 10)
    assert harness.attention_flops(10, 128, "fwd+bwd") == pytest.approx(3.5 * 4 * 128 * 10)
    assert harness.slug("NVIDIA H200") == "nvidia-h200"

    rows = [
        {"name": "a", "ms": 1.5, "tflops": float("nan")},
        {"name": "bb", "ms": None, "error": "OutOfMemoryError: boom"},
    ]
    text = harness.format_table(
        rows, [harness.Column("name", "name"), harness.Column("ms", "ms", ".2f")]
    )
    assert "1.50" in text and "ERROR OutOfMemoryError: boom" in text

    path = harness.write_results(tmp_path / "sub" / "r.json", {"gpu": "cpu"}, rows)
    loaded = json.loads(path.read_text())
    assert loaded["rows"][0]["tflops"] is None  # NaN written as null

    def boom(case):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    row = harness.run_case(
        harness.Provider("x", boom), None, device=torch.device("cpu"), flops=1.0, row={}
    )
    assert row["provider"] == "x" and row["error"].startswith("OutOfMemoryError")


def test_mode_callable_times_the_right_thing():
    calls = {"fwd": 0}

    def forward(x):
        calls["fwd"] += 1
        return (x * 2).sum(dim=-1)

    x = torch.randn(4, 3)
    fwd = harness.mode_callable(forward, (x,), "fwd")
    assert fwd().requires_grad is False
    calls["fwd"] = 0
    bwd = harness.mode_callable(forward, (x,), "bwd")
    assert calls["fwd"] == 1  # the forward runs once, outside the timed function
    (grad,) = bwd()
    (grad_again,) = bwd()  # the graph is retained between timed calls
    assert calls["fwd"] == 1
    assert torch.equal(grad, grad_again)
    both = harness.mode_callable(forward, (x,), "fwd+bwd")
    before = calls["fwd"]
    both()
    assert calls["fwd"] == before + 1


def test_git_commit_given_in_the_environment_wins(monkeypatch):
    """A tree copied to a GPU machine may hold a stale .git: the commit passed in wins."""
    monkeypatch.setenv("VIDSPARSE_GIT_COMMIT", "abc1234")
    assert harness.git_info()["git_commit"] == "abc1234"
    monkeypatch.delenv("VIDSPARSE_GIT_COMMIT")
    assert harness.git_info()["git_commit"] != "abc1234"


def test_results_go_to_the_checkouts_results_folder():
    root = harness.repo_root()
    assert root is not None and (root / "benchmarks" / "results").is_dir()
    assert harness.results_dir() == root / "benchmarks" / "results"
