"""The runner: ops by name, their own options passed through, failures as one line, tiny
smoke runs on the CPU."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from vidsparse.bench import harness, registry, runner

pytestmark = pytest.mark.usefixtures("torch_backend")

ENGINE_FAST = ["--providers", "ours", "--modes", "fwd", "--block-sizes", "128x64", "--no-plot"]


def test_run_an_op_with_its_own_options(tmp_path, capsys):
    out = tmp_path / "engine.json"
    rows = runner.run("engine", ["--tiny", "--densities", "0.5", "--out", str(out), *ENGINE_FAST])
    assert [(r["provider"], r["block"], r["mode"]) for r in rows] == [("ours", "128x64", "fwd")]
    assert not rows[0].get("error") and rows[0]["ms"] > 0
    written = json.loads(out.read_text())
    assert written["meta"]["benchmark"] == "block_sparse" and len(written["rows"]) == 1
    assert "cpu-dry-run" in capsys.readouterr().out


def test_run_targets_files_each_target_and_restores_the_backend(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VIDSPARSE_BACKEND", "auto")
    results = runner.run_targets(
        ["engine"], tmp_path, tiny=True, extra=["--densities", "1", *ENGINE_FAST], quiet=True
    )
    (result,) = results
    assert result["target"] == "engine" and result["json"] == str(tmp_path / "engine.json")
    assert json.loads(Path(result["json"]).read_text())["rows"] == json.loads(
        json.dumps(result["rows"])
    )
    assert os.environ["VIDSPARSE_BACKEND"] == "auto"  # the op's CPU choice was undone
    assert capsys.readouterr().out == ""  # quiet: the op's output went to stderr


def test_all_targets_are_registered_ops():
    assert runner.ALL_TARGETS == ("engine", "vsa", "psa", "sta")
    for target in runner.ALL_TARGETS:
        assert registry.get(target).in_all


@pytest.mark.parametrize(
    ("name", "argv", "match"),
    [
        ("nope", [], "unknown benchmark"),
        ("vsa", ["--no-such-option"], "bad options"),
        ("parallel", ["--dry-run"], "torchrun"),
    ],
)
def test_usage_errors_are_one_line(name, argv, match, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(runner.BenchUsageError, match=match) as info:
        runner.run(name, argv)
    assert "\n" not in str(info.value)


def test_an_op_without_a_smoke_run_says_so(tmp_path):
    with pytest.raises(runner.BenchUsageError, match="needs GPUs"):
        runner.run_targets(["e2e_ulysses"], tmp_path, tiny=True)


def test_a_failing_op_is_a_bench_error(monkeypatch):
    module = registry.get("psa").load()

    def boom(argv):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(module, "main", boom)
    with pytest.raises(runner.BenchError, match="bench psa failed: RuntimeError: kernel exploded"):
        runner.run("psa", [])


def test_module_entry_lists_and_refuses(capsys):
    assert runner.main(["--list"]) == 0
    assert "sta" in capsys.readouterr().out
    assert runner.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark" in err and len(err.strip().splitlines()) == 1
    assert runner.main([]) == 2


def test_the_scripts_left_in_benchmarks_name_registered_ops():
    """benchmarks/bench_*.py are thin wrappers of the runner (read, not imported)."""
    root = harness.repo_root()
    scripts = sorted((root / "benchmarks").glob("bench_*.py"))
    assert scripts
    for script in scripts:
        text = script.read_text()
        (name,) = re.findall(r'script_main\("(\w+)"\)', text)
        registry.get(name)
        assert len(text.splitlines()) < 20, script
