"""``benchmarks/tuning/bench_with_override.py`` runs a bench command under
``configs.override(...)`` and records the overrides in the JSON it writes; a field that
``configs.Overrides`` lacks is refused before anything runs."""

import json
import os
import subprocess
import sys
from dataclasses import replace
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


def test_a_gluon_option_is_an_override_too():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_with_override

    from vidsparse.ops.block_sparse_attn import configs

    parsed = bench_with_override.parse_overrides(["gluon.PERSISTENT=true", "regather=true"])
    assert parsed == {"gluon.PERSISTENT": True, "regather": True}
    kwargs = bench_with_override.as_override_kwargs(parsed)
    assert kwargs == {"regather": True, "gluon": replace(configs.GLUON, PERSISTENT=True)}


def test_an_unknown_override_is_refused():
    done = _run("no_such_knob=true", "--", "vsa", "--device", "cpu", "--tiny")
    assert done.returncode != 0
    assert "not a configs.Overrides field" in done.stderr


def test_a_word_value_stays_a_word():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_with_override

    parsed = bench_with_override.parse_overrides(["one_pass=ordered", "overlap=none"])
    assert parsed == {"one_pass": "ordered", "overlap": None}


def _run_recorded(monkeypatch, module, name: str, argv: list[str], rc: int):
    """``(rc, args, overrides)``: the script's exit code on ``argv`` with ``module.name`` (the
    command it hands over to) replaced by a recorder that returns ``rc``, the arguments that
    command got and the overrides active while it ran; the defaults are active again after."""
    from helpers import load_script
    from vidsparse.ops.block_sparse_attn import configs

    script = load_script(SCRIPT)
    seen = []

    def command(args):
        seen.append((args, configs.active_overrides()))
        return rc

    monkeypatch.setattr(module, name, command)
    code = script.main(argv)
    assert configs.active_overrides() == configs.Overrides()
    ((args, active),) = seen
    return code, args, active


def test_the_command_runs_under_the_overrides(monkeypatch):
    """The bench command sees the overrides as the active ones, and the defaults after."""
    from vidsparse.bench import runner

    argv = ["out_rows=false", "one_pass=tma", "--", "vsa", "--tiny"]
    code, args, active = _run_recorded(monkeypatch, runner, "main", argv, 0)
    assert code == 0 and args == ["vsa", "--tiny"]
    assert (active.out_rows, active.one_pass) == (False, "tma")


def test_a_pytest_command_runs_its_tests_under_the_overrides(monkeypatch):
    """``... -- pytest ARGS``: pytest's exit code, with the overrides active while it runs."""
    import pytest

    argv = ["tile_pool=false", "--", "pytest", "-q", "tests/x.py"]
    code, args, active = _run_recorded(monkeypatch, pytest, "main", argv, 5)
    assert code == 5 and args == ["-q", "tests/x.py"] and active.tile_pool is False
