"""The VSA benchmark runs end to end on CPU at tiny size (numbers meaningless, code paths real)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vidsparse.bench import registry

SPARSE = ("ours", "ours-natural", "fastvideo")
MODES = ("fwd", "fwd+bwd")
SPARSITIES = (0.875, 0.9)


def run_tiny(out: Path, *args: str) -> dict:
    env = dict(os.environ, VIDSPARSE_BACKEND="torch", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # the torch backend needs no interpreter
    done = subprocess.run(
        [sys.executable, "-m", "vidsparse.bench", "vsa"]
        + ["--device", "cpu", "--tiny", "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vs cuDNN" in done.stdout  # the table was printed
    assert "note: skipped cudnn" in done.stdout and "CPU timings are not meaningful" in done.stdout
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One tiny run shared by the tests of this module (a subprocess takes a few seconds)."""
    return run_tiny(tmp_path_factory.mktemp("bench_vsa") / "vsa.json")


@pytest.mark.slow
def test_bench_vsa_tiny_cpu(data):
    rows, meta = data["rows"], data["meta"]

    assert meta["benchmark"] == "vsa" and meta["gpu"] == "cpu" and meta["tiny"] is True
    assert meta["modes"] == list(MODES) and meta["sparsities"] == list(SPARSITIES)
    assert meta["env"]["VIDSPARSE_BACKEND"] == "torch"
    assert "git_commit" in meta and "fastvideo" in meta

    # Every sparsity x mode x sparse provider that can run here; no cuDNN on the CPU (a GPU
    # backend), no fastvideo where it is not installed: skipped with a note, no error rows.
    runnable = [p for p in SPARSE if registry.unavailable("vsa", p, torch.device("cpu")) is None]
    keys = {(r["provider"], r["sparsity"], r["mode"]) for r in rows}
    assert keys == {(p, s, m) for p in runnable for s in SPARSITIES for m in MODES}
    assert "cudnn" not in {r["provider"] for r in rows}

    for row in rows:
        assert row["tokens"] == 300 and row["padded_tokens"] == 768 and row["num_tiles"] == 12
        assert "error" not in row, row
        assert row["ms"] > 0 and row["speedup"] is None
        assert row["topk"] == 2  # ceil((1 - s) * 12) for both sparsities


def test_bench_vsa_split_on_ours_fwd(data):
    rows = data["rows"]
    split = [r for r in rows if r["provider"] == "ours" and r["mode"] == "fwd"]
    assert len(split) == len(SPARSITIES)
    for row in split:
        assert row["coarse_ms"] > 0 and row["fine_ms"] > 0, row
        assert row["coarse_share"] == row["coarse_ms"] / row["ms"]
        assert len(row["coarse_ms_all"]) == len(row["fine_ms_all"]) == 3
        assert row["split_timer"] == "eager"  # CUDA graphs on the GPU only
    others = [r for r in rows if r not in split]
    assert all("coarse_ms" not in r for r in others)


@pytest.mark.slow
def test_bench_vsa_rounds_merge_each_case(tmp_path):
    """``--rounds 2``: one row a case, its ms the median of both rounds' (kept beside it); the
    coarse/fine split from the first round only; no speedup where no cuDNN ran."""
    result = run_tiny(
        tmp_path / "vsa.json", "--rounds", "2", "--sparsities", "0.875", "--modes", "fwd"
    )
    assert result["meta"]["rounds"] == 2
    rows = result["rows"]
    assert len({r["provider"] for r in rows}) == len(rows)  # one row a provider
    for row in rows:
        assert row["rounds"] == 2 and len(row["ms_rounds"]) == 2, row
        assert row["ms"] == pytest.approx(sum(row["ms_rounds"]) / 2)
        assert row["speedup"] is None and "speedup_rounds" not in row
    (ours,) = [r for r in rows if r["provider"] == "ours"]
    assert len(ours["coarse_ms_all"]) == 3  # one split, not one a round
