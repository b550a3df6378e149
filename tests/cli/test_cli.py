"""The command-line tool: exit codes, outputs, help."""

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

from vidsparse.cli import main


@pytest.mark.slow
def test_demo_writes_report(tmp_path, torch_backend, capsys):
    assert main(["demo", "--out", str(tmp_path), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    methods = [r["method"] for r in report["results"]]
    assert methods[0].startswith("dense") and methods[1].startswith("VSA")
    assert methods[2].startswith("PSA")
    assert report["workload"]["reduced"] is True
    vsa, psa = report["results"][1], report["results"][2]
    assert 0 < vsa["rel_l2"] < 0.5  # sparse output close to dense on video-like inputs
    assert math.isfinite(psa["rel_l2"]) and 0 < psa["rel_l2"] < 0.5
    assert 0 < psa["sparsity"] < 1 and psa["psa"]["search"]["seconds"] > 0
    # Figures are named relative to the output folder, so the folder can be moved.
    assert "psa_masks.png" in report["figures"] or not report["figures"]
    for name in report["figures"]:
        assert "/" not in name and (tmp_path / name).is_file()
    out = capsys.readouterr().out
    assert "reduced grid" in out and "PSA search:" in out
    assert any(line.startswith("PSA target 0.75") for line in out.splitlines())


@pytest.mark.slow
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


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@pytest.mark.parametrize(
    "argv, words",
    [
        pytest.param(["demo", "--device", "cuda"], "--device is 'cuda' but", marks=NO_CUDA),
        (["search", "calib", "--grid", "4", "8", "8", "--alpha", "0.05", "--device", "bogus"],
         "--device must be one of cpu, cuda, got 'bogus'"),
        pytest.param(["search", "--from-table", "t.pt", "--alpha", "0.05", "--device", "cuda"],
                     "--device is 'cuda' but", marks=NO_CUDA),
    ],
)  # fmt: skip
def test_unusable_device_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidsparse: error: ") and words in err and err.count("\n") == 1


def test_demo_unknown_device_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", "demo", "--device", "bogus"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "--device" in proc.stderr


# A SIGINT while torch is being imported: a meta-path finder sends it when `torch` is looked
# up, i.e. in the middle of the first heavy import `vidsparse demo` makes.
_INTERRUPT_AT_TORCH_IMPORT = """
import os, signal, sys

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None

from vidsparse.cli import main
assert "torch" not in sys.modules, "the CLI module must not import torch itself"
sys.meta_path.insert(0, Interrupt())
sys.exit(main(sys.argv[1:]))
"""


def _sigint_as_in_a_terminal() -> None:
    """In the child before it starts: SIGINT's default disposition. A suite run as a
    background job of a script (CI runs two side by side) inherits SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler, so the signal would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_during_torch_import_is_one_line_and_exit_130(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_AT_TORCH_IMPORT, "demo", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, preexec_fn=_sigint_as_in_a_terminal,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "vidsparse: interrupted\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_sigint_during_a_run_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C while the demo runs (its first line printed): the exit code the CLI documents."""
    from vidsparse import cli

    assert "130 interrupted" in cli.__doc__ and cli.EXIT_INTERRUPTED == 130
    proc = subprocess.Popen(
        [sys.executable, "-m", "vidsparse", "demo", "--out", str(tmp_path / "demo")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_sigint_as_in_a_terminal,
    )  # fmt: skip
    try:
        assert proc.stdout.readline()  # torch imported, the run under way
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err == "vidsparse: interrupted\n"
    assert not (tmp_path / "demo" / "report.json").exists()


def test_inspect_deeply_nested_plan_exits_2(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text("[" * 100_000)
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nests too deeply" in err


def test_help_has_examples():
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", "demo", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "example" in proc.stdout


def _write_calibration(
    folder, steps=(0, 1, 2, 3, 4), layers=(0, 1), suffix=".pt", num_steps=None, shape=(4, 8, 8)
):
    from vidsparse import StripeSpec, VideoGrid
    from vidsparse.search import (
        CalibrationSample,
        Candidate,
        planted_stripe_heads,
        save_calibration_sample,
    )

    grid = VideoGrid(shape or (4, 8, 8), tile=(1, 4, 4))
    planted = [Candidate(StripeSpec(1, 0, None, 1, 0, None)), Candidate(StripeSpec.dense())]
    for step in steps:
        for layer in layers:
            syn = planted_stripe_heads(grid, planted, head_dim=16, seed=10 * step + layer)
            sample = CalibrationSample(step, layer, syn.q, syn.k, syn.v, num_steps=num_steps)
            path = folder / f"s{step}_l{layer}{suffix}"
            save_calibration_sample(sample, path, grid=None if shape is None else grid)
    return grid


@pytest.mark.slow
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


def test_search_reads_grid_and_steps_from_the_files(tmp_path, torch_backend, capsys):
    calib = tmp_path / "calib"
    calib.mkdir()
    _write_calibration(calib, steps=(0, 3), layers=(0,), suffix=".safetensors", num_steps=5)
    plan = tmp_path / "plan.json"
    tail = ["--tile", "1", "4", "4", "--alpha", "0.05", "--device", "cpu", "--no-png", "--json"]
    assert main(["search", str(calib), *tail, "--out", str(plan)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from vidsparse.search import load_plan

    loaded = load_plan(plan)
    assert (loaded.grid.shape, loaded.num_steps, loaded.dense_steps) == ((4, 8, 8), 5, 1)
    # the same values given explicitly: the same plan
    given = ["--grid", "4", "8", "8", "--num-steps", "5", "--out", str(tmp_path / "p2.json")]
    assert main(["search", str(calib), *tail, *given]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary


def _search_error(capsys, calib, *extra) -> str:
    argv = ["search", str(calib), "--tile", "1", "4", "4", "--alpha", "0.05", "--device", "cpu"]
    assert main([*argv, "--no-png", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidsparse: error: ") and err.count("\n") == 1
    return err


def test_search_grid_or_steps_that_do_not_match_the_files_exit_2(tmp_path, capsys):
    calib = tmp_path / "calib"
    calib.mkdir()
    _write_calibration(calib, steps=(0, 3), layers=(0,), suffix=".safetensors", num_steps=5)
    err = _search_error(capsys, calib, "--grid", "4", "8", "9")
    assert "--grid 4 8 9 does not match the grid 4 8 8 recorded in" in err
    assert "s0_l0.safetensors" in err
    err = _search_error(capsys, calib, "--num-steps", "6")
    assert "--num-steps 6 does not match the 5 denoising steps recorded in" in err
    assert "s0_l0.safetensors" in err


@pytest.mark.parametrize(
    "second, words",
    [
        ({"shape": (4, 8, 12)}, "disagree on grid_shape"),
        ({"num_steps": 7}, "disagree on num_steps"),
    ],
)
def test_search_files_that_disagree_exit_2_naming_two(tmp_path, capsys, second, words):
    calib = tmp_path / "calib"
    calib.mkdir()
    _write_calibration(calib, steps=(0,), layers=(0,), suffix=".safetensors", num_steps=5)
    options = {"num_steps": 5, **second}
    _write_calibration(calib, steps=(1,), layers=(0,), suffix=".safetensors", **options)
    err = _search_error(capsys, calib)
    assert words in err and "s0_l0.safetensors" in err and "s1_l0.safetensors" in err


def test_search_old_files_without_a_grid_need_grid(tmp_path, capsys):
    calib = tmp_path / "calib"
    calib.mkdir()
    _write_calibration(calib, steps=(0, 1), layers=(0,), shape=None)  # .pt, no grid recorded
    err = _search_error(capsys, calib)
    assert "records its latent grid" in err and "give --grid T H W" in err


@pytest.mark.slow
def test_inspect_rejects_bad_plan_with_exit_2(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"format": "something-else"}')
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", "inspect", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "format" in proc.stderr


# ---- pictures ---------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def _search_argv(calib, plan, *extra):
    grid = ["--grid", "4", "8", "8", "--tile", "1", "4", "4"]
    rule = ["--alpha", "0.05", "--num-steps", "2", "--device", "cpu"]
    return ["search", str(calib), *grid, *rule, "--out", str(plan), *extra]


@pytest.fixture
def small_calibration(tmp_path):
    calib = tmp_path / "calib"
    calib.mkdir()
    _write_calibration(calib, steps=(0, 1), layers=(0,))
    return calib


@pytest.mark.slow
def test_search_draws_png_next_to_plan_and_inspect_png(
    tmp_path, small_calibration, torch_backend, capsys
):
    plan = tmp_path / "plan.json"
    assert main(_search_argv(small_calibration, plan)) == 0
    assert _is_png(tmp_path / "plan.png")  # default: next to --out
    assert "picture written to" in capsys.readouterr().out
    masks = tmp_path / "pics" / "masks.png"
    assert main(["inspect", str(plan), "--png", str(masks)]) == 0
    assert _is_png(masks)


@pytest.mark.slow
def test_search_png_path_and_no_png(tmp_path, small_calibration, torch_backend, capsys):
    plan, png = tmp_path / "plan.json", tmp_path / "attn.png"
    assert main(_search_argv(small_calibration, plan, "--png", str(png), "--json")) == 0
    assert _is_png(png) and not (tmp_path / "plan.png").exists()
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # stdout stays JSON
    plan2 = tmp_path / "plan2.json"
    assert main(_search_argv(small_calibration, plan2, "--no-png")) == 0
    assert plan2.exists() and not (tmp_path / "plan2.png").exists()


@pytest.mark.slow
def test_missing_matplotlib_is_a_note_not_a_failure(
    tmp_path, small_calibration, torch_backend, monkeypatch, capsys
):
    plan = tmp_path / "plan.json"
    assert main(_search_argv(small_calibration, plan, "--no-png")) == 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["inspect", str(plan), "--png", str(tmp_path / "m.png")]) == 0
    assert "note: matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "m.png").exists()


# ---- bench ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_tiny_engine_runs_on_cpu(tmp_path, torch_backend, capsys):
    start = time.perf_counter()
    assert main(["bench", "engine", "--tiny", "--out", str(tmp_path), "--json"]) == 0
    assert time.perf_counter() - start < 90  # CI runs two suites side by side on 2 cores
    out, err = capsys.readouterr()
    printed = json.loads(out.strip().splitlines()[-1])  # progress: stderr
    (result,) = printed["results"]
    assert result["target"] == "engine" and result["rows"]
    # What cannot run on a CPU is skipped with a note: no error rows, no cuDNN or flash rows.
    assert not any(r.get("error") for r in result["rows"]), result["rows"]
    assert {r["provider"] for r in result["rows"]} <= {"ours", "flex", "flex64"}
    assert "note: skipped cudnn" in err and "note: skipped flash" in err
    assert "CPU timings are not meaningful" in err
    written = json.loads((tmp_path / "engine.json").read_text())
    assert len(written["rows"]) == len(result["rows"])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_bench_full_size_on_cpu_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", "bench", "engine"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "--tiny" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_lists_its_ops(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for op in ("block_sparse", "vsa", "psa", "sta", "e2e", "parallel"):
        assert op in out


def test_bench_passes_unknown_options_to_one_op(capsys):
    # An op's own option with `all` is refused; with one op, the op's parser judges it.
    assert main(["bench", "--tiny", "--shapes=real"]) == 2
    assert "name one benchmark" in capsys.readouterr().err
    assert main(["bench", "vsa", "--tiny", "--no-such-option"]) == 2
    assert "bad options" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(SystemExit) as info:  # other commands still refuse them
        main(["demo", "--no-such-option"])
    assert info.value.code == 2


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["bench", "nope"], ["bench", "--bogus"]])
def test_bench_bad_usage_exits_2(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", [[], ["demo"], ["search"], ["inspect"], ["bench"]])
def test_every_command_help_has_examples(command):
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", *command, "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "example" in proc.stdout
