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


def _run_bench(tmp_path: Path, *args: str, stdout: list | None = None) -> dict:
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "vidsparse.bench", "block_sparse", "--device", "cpu", "--tiny"]
    cmd += ["--out", str(out), *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert harness.CPU_CAVEAT in done.stdout  # the run says its timings mean nothing
    if stdout is not None:
        stdout.append(done.stdout)
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
def test_bench_block_sparse_cpu_skips_what_cannot_run_there(tmp_path):
    """Every provider asked for on a padded video shape, on the CPU: cuDNN and flash (GPU
    backends of SDPA) and flex's backward (FlexAttention has none there) are skipped with a
    note each, so no row is an error and none is a cuDNN or flash row; flex's forward (eager,
    checked against the reference) and ours run."""
    printed: list[str] = []
    result = _run_bench(
        tmp_path,
        "--shapes", "real",
        "--providers", "ours,cudnn,flash,flex,flex64",
        "--modes", "fwd,bwd",
        "--densities", "0.5",
        "--block-sizes", "128x64",
        "--check",
        "--no-plot",
        stdout=printed,
    )  # fmt: skip
    rows = result["rows"]
    by_key = {(r["provider"], r["block"], r["mode"]): r for r in rows}
    assert set(by_key) == {
        ("ours", "128x64", "fwd"),
        ("ours", "128x64", "bwd"),
        ("flex", "128x128", "fwd"),
        ("flex64", "64x64", "fwd"),
    }
    assert not any(r.get("error") for r in rows), rows
    notes = [line for line in printed[0].splitlines() if line.startswith("note: skipped")]
    assert len(notes) == 4, notes
    for words in ("cudnn: cuDNN is a GPU backend", "flash: flash is a GPU backend",
                  "flex bwd: FlexAttention has no backward on the CPU",
                  "flex64 bwd: FlexAttention has no backward"):  # fmt: skip
        assert any(words in n for n in notes), (words, notes)
    # Block-sparse rows run on the 768 tile-ordered slots, with FLOPs counted on real pairs.
    ours = by_key[("ours", "128x64", "fwd")]
    assert ours["seq_len"] == 768 and ours["padding_masked"] is True
    assert 0 < ours["pairs"] < 2 * 300 * 300
    assert ours.get("vs_cudnn") is None  # no dense reference on the CPU
    # At 128-token key blocks a block holds two tiles: padding cannot be masked by
    # kv_block_sizes, and the row says so.
    assert by_key[("flex", "128x128", "fwd")]["padding_masked"] is False


def test_the_nondeterministic_provider_runs_only_where_it_changes_the_backward():
    """``ours-nondet`` and ``ours-fixed`` are planned at 128x128 only (``NONDET_BLOCKS``: the
    one-pass backward's blocks); ``ours`` at every block size asked for."""
    from vidsparse.bench.ops import block_sparse as bench

    (shape,) = bench.build_shapes("default", True)
    blocks = [(128, 64), (128, 128), (64, 64)]
    arms = ["ours", "ours-nondet", "ours-fixed"]
    cases = bench.plan_cases([shape], arms, ["fwd+bwd"], [0.5], blocks)
    planned = {(c.provider, c.block) for c in cases}
    one_pass = {("ours-nondet", (128, 128)), ("ours-fixed", (128, 128))}
    assert planned == {("ours", b) for b in blocks} | one_pass


def test_the_fixed_point_arm_times_its_calls_under_the_override(monkeypatch):
    """``ours-fixed``'s wrapper (``harness.under_overrides``) runs each timed call inside
    ``configs.override(one_pass="fixed")``, and only there."""
    from vidsparse.bench import harness
    from vidsparse.ops.block_sparse_attn import configs

    seen = []
    run = harness.under_overrides(lambda: seen.append(configs.active_overrides().one_pass),
                                  one_pass="fixed")  # fmt: skip
    run()
    assert seen == ["fixed"] and configs.active_overrides().one_pass is None


def test_dense_rows_count_real_tokens():
    """Dense rows (a GPU's cuDNN and flash) run on the real tokens: 300 of the padded shape."""
    from vidsparse.bench.ops import block_sparse as bench

    (shape,) = bench.build_shapes("real", True)
    settings = bench.Settings(torch.device("cpu"), torch.float32, 0, False, False)
    case = bench.Case(shape, "cudnn", "fwd")
    assert bench.base_row(case, settings)["seq_len"] == 300
    assert bench.case_pairs(case) == 2 * 300 * 300


def test_plot_lines_differ_and_keep_their_colour_across_panels(tmp_path):
    """One style per provider over all panels: no two series alike in colour or style."""
    rows = [{"provider": p, "block": "64x64", "density": d, "mode": m, "tflops": 1.0 + d}
            for p in ("ours", "flex", "flex64") for d in (0.25, 0.5)
            for m in ("fwd", "fwd+bwd")]  # fmt: skip
    rows += [{"provider": "cudnn", "block": "dense", "density": 1.0, "mode": m, "tflops": 3.0}
             for m in ("fwd", "fwd+bwd")]  # fmt: skip
    styles = harness.series_styles(rows, ("provider",))
    assert len({s["color"] for s in styles.values()}) == len(styles) == 4
    assert len({str(s["linestyle"]) for s in styles.values()}) == 4
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    saved = pyplot.savefig
    figures = []
    pyplot_close = pyplot.close
    try:
        pyplot.close = lambda fig=None: figures.append(fig)
        path = harness.plot(tmp_path / "p.png", rows, x="density", y="tflops",
                            series=("provider",), panels=("mode",),
                            reference=lambda r: r["block"] == "dense")  # fmt: skip
    finally:
        pyplot.close, pyplot.savefig = pyplot_close, saved
    assert path.is_file()
    (fig,) = figures
    colours = []
    for ax in fig.axes:
        by_label = {line.get_label(): line.get_color() for line in ax.get_lines()}
        colours.append(by_label)
        assert len(set(by_label.values())) == len(by_label) == 4
    assert colours[0] == colours[1]  # each provider one colour in every panel
    pyplot_close(fig)


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


def test_a_tuning_scripts_rows_go_to_out_with_the_runs_metadata(tmp_path, monkeypatch, capsys):
    """``emit_tuning_rows``: ``$OUT/<file>`` holds the rows under the run's metadata (named
    benchmark and extras); each row is printed as JSON, and nothing is written without OUT."""
    seen = {}

    def metadata(device, **extra):
        seen.update(device=device, **extra)
        return {"gpu": "stub", **extra}

    monkeypatch.setattr(harness, "collect_metadata", metadata)
    rows = [{"arm": "a", "ms": 1.25}, {"arm": "b", "ms": float("nan")}]
    monkeypatch.delenv("OUT", raising=False)
    harness.emit_tuning_rows("try_x.json", rows, "try_x")
    assert seen == {} and not list(tmp_path.iterdir())
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [{"arm": "a", "ms": 1.25}, {"arm": "b", "ms": None}]

    monkeypatch.setenv("OUT", str(tmp_path))
    harness.emit_tuning_rows("try_x.json", rows, "try_x", study="s")
    written = json.loads((tmp_path / "try_x.json").read_text())
    assert written["meta"] == {"gpu": "stub", "benchmark": "try_x", "study": "s"}
    assert written["rows"][0] == rows[0] and written["rows"][1]["ms"] is None
    assert seen["device"] == torch.device("cuda")


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


def test_recorded_command_names_no_folder_of_the_machine(tmp_path):
    """Result files are committed: their command line is the one a reader would type."""
    from vidsparse.bench.harness import portable_command

    main = "/opt/env/lib/python3.12/site-packages/vidsparse/bench/__main__.py"
    out = str(tmp_path / "results" / "e2e.json")
    assert portable_command([main, "e2e", "--out", out], cwd=str(tmp_path)) == (
        "python -m vidsparse.bench e2e --out results/e2e.json"
    )
    assert portable_command(["/usr/bin/vidsparse", "bench", "--out", "/root/x.json"],
                            cwd=str(tmp_path)) == "vidsparse bench --out x.json"  # fmt: skip
    script = str(tmp_path / "benchmarks" / "tune.py")
    assert portable_command([script, "--tiny"], cwd=str(tmp_path)) == (
        "python benchmarks/tune.py --tiny"
    )


def test_alternating_ms_takes_the_arms_in_turn_each_round():
    import contextlib

    order = []

    @contextlib.contextmanager
    def enter(arm):
        order.append(arm)
        yield

    times = harness.alternating_ms(("a", "b"), enter, lambda: (lambda: None),
                                   device=torch.device("cpu"), rounds=2)  # fmt: skip
    assert order == ["a", "b", "a", "b"]
    assert set(times) == {"a", "b"} and all(len(t) == 2 for t in times.values())


def test_rounds_merge_to_medians_with_ratios_taken_within_each_round():
    """``--rounds``: each case's ms is the median over the rounds and each ratio the median of
    the ratios taken inside each round (not a ratio of medians); every round's figures are
    kept; a case that failed in any round reports that error, not a median of the rest."""
    from vidsparse.bench.ops import block_sparse as bench

    def rows(ours_ms, cudnn_ms, flex_ms, error=None):
        base = {"shape": "s", "density": 0.125, "mode": "fwd", "flops": 1e12}
        made = [
            dict(base, provider="cudnn", block="dense", density=1.0, ms=cudnn_ms * 8),
            dict(base, provider="ours", block="128x128", ms=ours_ms),
            dict(base, provider="flex", block="128x128", ms=flex_ms),
            dict(base, provider="ours-nondet", block="128x128", ms=1.0, error=error),
        ]
        for row in made:
            row["tflops"] = harness.tflops(row["flops"], row["ms"])
            if row["block"] == "dense":  # the dense row's FLOPs cover every pair
                row["tflops"] *= 8
        bench.add_ratios(made)
        return made

    rounds = [rows(1.0, 1.0, 1.5), rows(1.2, 1.3, 1.56), rows(1.1, 1.0, 1.32, error="Boom: once")]
    merged = harness.merge_rounds(rounds, bench.RATIOS)
    cudnn, ours, flex, nondet = merged
    assert ours["ms"] == pytest.approx(1.1) and ours["ms_rounds"] == [1.0, 1.2, 1.1]
    assert ours["ms_spread"] == pytest.approx(0.2)
    assert ours["tflops"] == pytest.approx(harness.tflops(1e12, 1.1))
    assert ours["rounds"] == 3
    # Within the rounds: flex/ours 1.5, 1.3, 1.2 (median 1.3); cuDNN/ours 1.0, 1.083, 0.909.
    assert ours["ours_over_flex_rounds"] == pytest.approx([1.5, 1.3, 1.2])
    assert ours["ours_over_flex"] == pytest.approx(1.3)
    assert ours["vs_cudnn"] == pytest.approx(1.0)
    # The ratio of the medians would be 1.5 / 1.1 = 1.364, not what the rounds say.
    assert flex["ms"] / ours["ms"] != pytest.approx(ours["ours_over_flex"])
    assert cudnn["ms_rounds"] == [8.0, pytest.approx(10.4), 8.0] and "vs_cudnn" not in cudnn
    assert nondet["error"] == "Boom: once" and "ms_rounds" not in nondet


@pytest.mark.slow
def test_bench_block_sparse_rounds_on_the_cpu(tmp_path):
    result = _run_bench(
        tmp_path,
        "--providers", "ours",
        "--modes", "fwd",
        "--densities", "1,0.5",
        "--block-sizes", "128x128",
        "--rounds", "2",
        "--no-plot",
    )  # fmt: skip
    assert result["meta"]["rounds"] == 2 and result["meta"]["complete"] is True
    rows = result["rows"]
    assert [(r["density"], r["rounds"]) for r in rows] == [(1.0, 2), (0.5, 2)]
    for r in rows:
        assert len(r["ms_rounds"]) == 2 and r["ms"] == pytest.approx(sum(r["ms_rounds"]) / 2)
        assert len(r["time_vs_density1_rounds"]) == 2


def test_rounds_must_be_positive(capsys):
    from vidsparse.bench.ops import block_sparse, vsa

    for parse in (lambda: block_sparse.parse_args(["--dry-run", "--rounds", "0"]),
                  lambda: vsa.parse_args(["--rounds", "0"])):  # fmt: skip
        with pytest.raises(SystemExit):
            parse()
        assert "--rounds: must be at least 1, got 0" in capsys.readouterr().err
    assert vsa.parse_args(["--rounds", "3"]).rounds == 3
