"""``vidsparse tune``: bad options exit 2 in one line; on a CPU it refuses unless the hidden
``--interpreter`` flag runs the Triton interpreter at tiny sizes, which is how these tests tune
end to end: the file is written, resumed, and then taken by the configs' lookups."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from vidsparse.bench import tune, tune_workloads
from vidsparse.cli import main
from vidsparse.ops.block_sparse_attn import configs
from vidsparse.utils import tuning_file
from vidsparse.utils.device import CPU_INTERPRETER

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU CI")
TINY = ["tune", "--interpreter", "--seq", "128", "--heads", "1", "--head-dim", "16",
        "--blocks", "64x64", "--sparsity", "0.5", "--max-candidates", "2"]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_store():
    tuning_file.reload()
    yield
    tuning_file.reload()


@pytest.fixture
def tuning_path(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning_file.ENV_VAR, str(path))
    return path


# ------------------------------------------------------------------------------ usage


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "wan2.1-1.3b", "--sparsity", "1.5"], "--sparsity must be in [0, 1)"),
        (["--model", "wan2.1-1.3b", "--sparsity", "-0.1"], "--sparsity must be in [0, 1)"),
        (["--model", "wan2.1-1.3b", "--time-budget", "-1"], "--time-budget must be > 0"),
        (["--model", "wan2.1-1.3b", "--time-budget", "0"], "--time-budget must be > 0"),
        (["--model", "wan2.1-1.3b", "--max-candidates", "0"], "--max-candidates must be >= 1"),
        (["--model", "wan9-1b"], "unknown model 'wan9-1b'"),
        (["--model", "wan2.1-1.3b", "--resolution", "1080p"], "not '1080p'"),
        (["--model", "wan2.1-1.3b", "--seq", "4096"], "describe an explicit shape"),
        (["--resolution", "480p", "--seq", "4096"], "--resolution goes with --model"),
        ([], "give --model NAME"),
        (["--heads", "4"], "an explicit shape needs --seq"),
        (["--seq", "100"], "must be a multiple of every block size"),
        (["--seq", "4096", "--head-dim", "48"], "--head-dim must be one of"),
        (["--seq", "4096", "--blocks", "96x64"], "--blocks takes BQxBKV"),
        (["--seq", "4096", "--blocks", "512x512"], "--blocks takes BQxBKV"),
        (["--seq", "4096", "--kernels", "fwd,bogus"], "--kernels: unknown ['bogus']"),
        (["--seq", "4096", "--batch", "0"], "--batch must be >= 1"),
        (["--sparsity", "lots"], "invalid float value"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv, words, capsys):
    try:
        code = main(["tune", *argv])
    except SystemExit as exc:  # argparse's own errors (a value that is not a number)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("vidsparse: error: ") and words in err and err.count("\n") == 1, err


def test_bad_option_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "vidsparse", "tune", "--model", "wan2.1-1.3b", "--sparsity", "2"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "--sparsity" in proc.stderr


@NO_CUDA
def test_refuses_on_a_cpu_without_the_interpreter_flag(capsys, tuning_path):
    assert main(["tune", "--model", "wan2.1-1.3b", "--resolution", "480p"]) == 2
    err = capsys.readouterr().err
    assert "no GPU visible" in err and err.count("\n") == 1
    assert not tuning_path.exists()


@NO_CUDA
def test_show_without_a_gpu_says_so(capsys):
    assert main(["tune", "--show"]) == 0
    assert "no GPU visible" in capsys.readouterr().out


def test_list_models_and_their_grids(capsys):
    assert main(["tune", "--list-models"]) == 0
    out = capsys.readouterr().out
    assert "wan2.1-1.3b" in out and "480p (default), 720p" in out
    # The registry's grids: Wan 2.1 480p 21x30x52; 720p from the latent sizes, 21x45x80.
    assert tune.model_shape("wan2.1-1.3b", None).grid == (21, 30, 52)
    assert tune.model_shape("wan2.1-1.3b", "720p").grid == (21, 45, 80)
    assert tune.model_shape("hunyuanvideo1.5", "480p").grid == (31, 30, 53)


def test_model_jobs_take_vsa_tiles_at_64_and_padded_lengths_at_128():
    shape = tune_workloads.Shape("wan", 1, 12, 128, 0.125, grid=(21, 30, 52))
    jobs = tune.plan_jobs(
        tune.TuneOptions(shape, tune.DEFAULT_BLOCKS, tune_workloads.KERNEL_CHOICES)
    )
    keys = [job.key for job in jobs]
    assert ("engine", "fwd_masked", 64, 64, 128) in keys  # VSA's 4x4x4 tiles mask padding
    assert ("engine", "fwd", 128, 128, 128) in keys
    assert ("vsa", "attn_topk_small", 128) in keys and ("vsa", "pool", 128) in keys
    assert tune_workloads.seq_len(shape, (128, 128)) == 32768  # 32,760 tokens, whole blocks
    assert tune_workloads.seq_len(shape, (64, 64)) == 6 * 8 * 13 * 64  # 624 tiles, padded
    assert len(set(job.job_id for job in jobs)) == len(jobs)


def test_the_default_wins_unless_clearly_faster(monkeypatch):
    """Never a candidate slower than the default: it must beat it by MIN_GAIN in the sweep
    and again when both are timed a second time."""
    again = {}
    monkeypatch.setattr(tune, "_time", lambda session, wl, cfg: again[cfg])
    candidates = ["default", "other"]
    again.update(default=1.0, other=0.5)
    assert tune._confirmed_best(None, None, candidates, {0: 1.0, 1: 0.5}) == 1
    assert tune._confirmed_best(None, None, candidates, {0: 1.0, 1: 0.995}) == 0  # noise
    assert tune._confirmed_best(None, None, candidates, {0: 1.0, 1: 1.2}) == 0
    again.update(default=0.5, other=0.6)  # faster once, not the second time
    assert tune._confirmed_best(None, None, candidates, {0: 1.0, 1: 0.5}) == 0
    assert tune._confirmed_best(None, None, candidates, {0: 1.0, 1: 0.98}) == 0  # 2%: noise


@pytest.mark.parametrize("head_dim, gluon_runs", [(128, True), (64, False)])
def test_a_gluon_forward_row_is_timed_alone_where_gluon_runs(head_dim, gluon_runs):
    """The Gluon forward ignores warps and stages: where it runs (Hopper, D=128) its job has
    one candidate, the default (an H200 run once "tuned" one, 3% faster than itself). Where
    the row's inputs do not fit Gluon (D=64) Triton's TMA kernel runs and is swept."""
    from dataclasses import replace

    from vidsparse.utils.device import Target

    shape = tune_workloads.Shape("wan", 1, 2, head_dim, 0.5, seq=256)
    wl = tune_workloads.EngineWorkload.__new__(tune_workloads.EngineWorkload)
    wl.job, wl.target = tune_workloads.Job("fwd", (128, 128), shape), Target("cuda", 90)
    wl.q, wl.k, wl.v = (torch.zeros(1, 2, 256, head_dim, dtype=torch.bfloat16) for _ in "qkv")
    gluon = replace(configs.KernelConfig(8, 3), use_tma=True, gluon=True)
    wl.default = lambda: gluon
    assert (wl.candidates() == [gluon]) == gluon_runs
    assert len(wl.candidates()) > 1 or gluon_runs


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
@pytest.mark.interpreter
@ON_CPU
def test_tune_writes_resumes_and_is_used(tuning_path, capsys):
    seed = str(random.randrange(1000))
    # 1. Two of the five jobs.
    assert main([*TINY, "--kernels", "fwd,pool", "--seed", seed, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["jobs"], summary["done"], summary["entries"]) == (2, 2, 2)
    first = {tuning_file.entry_key(e): e for e in tuning_file.read_document(tuning_path)["entries"]}
    # 2. All five: the two done are skipped (their entries as they were), the rest tuned.
    assert main([*TINY, "--seed", seed, "--json"]) == 0
    out = capsys.readouterr()
    assert "resuming" in out.err and "2 jobs already done" in out.err
    doc = tuning_file.read_document(tuning_path)
    assert len(doc["entries"]) == 5 and len(doc["done"]) == 5
    entries = {tuning_file.entry_key(e): e for e in doc["entries"]}
    for key, entry in first.items():
        assert entries[key] == entry
    for entry in doc["entries"]:
        assert 1 <= entry["measured"]["passed"] <= entry["measured"]["candidates"] <= 2
    # 3. Taken by the lookups (the file is this process's: target cpu:0, this torch, Triton).
    _assert_lookups_take(doc)
    assert main(["tune", "--interpreter", "--show"]) == 0
    shown = capsys.readouterr().out
    assert "status: in effect" in shown and shown.count(": tuned") == 5


def _assert_lookups_take(doc) -> None:
    tuning_file.reload()
    for entry in doc["entries"]:
        key = tuning_file.entry_key(entry)
        default, effective = tune.configs_for_key(CPU_INTERPRETER, key)
        assert effective == tuning_file.apply_entry(entry, default)[0], key
        assert tuning_file.entry_status(CPU_INTERPRETER, key, default) == (True, "")


@pytest.mark.interpreter
@ON_CPU
def test_tuned_forward_is_picked_up_by_lookup(tuning_path, capsys):
    assert main([*TINY, "--kernels", "fwd", "--seed", str(random.randrange(1000))]) == 0
    assert "1 entries, 1 of 1 jobs done" in capsys.readouterr().out
    doc = tuning_file.read_document(tuning_path)
    _assert_lookups_take(doc)
    # A value no table has: the lookup must show it, and the kernel must run with it.
    doc["entries"][0]["config"]["num_warps"] = 2
    tuning_file.write_document(tuning_path, doc)
    tuning_file.reload()
    assert configs.lookup(CPU_INTERPRETER, "fwd", 64, 64, 16).num_warps == 2
    with tuning_file.suspended():
        assert configs.lookup(CPU_INTERPRETER, "fwd", 64, 64, 16).num_warps != 2


@pytest.mark.interpreter
@ON_CPU
def test_wrong_and_failing_candidates_are_skipped(tuning_path, monkeypatch):
    real = tune_workloads.EngineWorkload.run
    calls = {"n": 0}

    def sabotaged(self, cfg):
        if cfg == self.default():
            return real(self, cfg)
        calls["n"] += 1
        if calls["n"] == 1:
            return tuple(o + 0.5 for o in real(self, cfg))  # wrong
        raise RuntimeError("out of resources: shared memory")  # does not compile

    monkeypatch.setattr(tune_workloads.EngineWorkload, "run", sabotaged)
    argv = [*TINY[:-1], "3", "--kernels", "fwd", "--seed", str(random.randrange(1000))]
    assert main(argv) == 0
    (entry,) = tuning_file.read_document(tuning_path)["entries"]
    measured = entry["measured"]
    assert measured["candidates"] == 3 and measured["passed"] == 1
    whys = [s["why"] for s in measured["skipped"]]
    assert "max abs error" in whys[0] and "RuntimeError: out of resources" in whys[1]
    with tuning_file.suspended():
        default = configs.lookup(CPU_INTERPRETER, "fwd", 64, 64, 16)
    assert entry["config"] == {"num_warps": default.num_warps, "num_stages": default.num_stages}


@pytest.mark.interpreter
@ON_CPU
def test_time_budget_leaves_a_valid_file(tuning_path, capsys):
    assert main([*TINY, "--time-budget", "1e-9"]) == 0
    out = capsys.readouterr().out
    assert "0 of 5 jobs done" in out and "time budget reached" in out
    doc = tuning_file.read_document(tuning_path)
    assert doc["entries"] == [] and doc["done"] == []


@pytest.mark.interpreter
@ON_CPU
def test_a_job_stopped_inside_resumes_at_its_next_candidate(tuning_path, capsys, monkeypatch):
    """A job longer than the time budget (the coarse top-k sweep: 72 candidates) must not
    start over on every run: the candidates timed are in the file, and the next run times
    only the rest."""
    timed = []
    real_time = tune._time
    monkeypatch.setattr(
        tune, "_time", lambda s, wl, cfg: timed.append(cfg) or real_time(s, wl, cfg)
    )
    checks = iter([False, False, True])  # the job starts, candidate 1 runs, then time is up
    monkeypatch.setattr(tune.Session, "over_budget", lambda self: next(checks, False))
    args = [*TINY[:-1], "3", "--kernels", "fwd"]
    assert main(args) == 0
    doc = tuning_file.read_document(tuning_path)
    assert doc["done"] == [] and len(doc["progress"]["times"]) == 1
    first = len(timed)  # the default and candidate 1
    assert main(args) == 0
    assert "resuming after 1 timed and 0 skipped candidates" in capsys.readouterr().err
    doc = tuning_file.read_document(tuning_path)
    assert len(doc["done"]) == 1 and "progress" not in doc
    # the second run times the default again, then candidate 2, not candidate 1
    assert first == 2 and timed[2] == timed[0] and timed[3] not in timed[:2]
    assert doc["entries"][0]["measured"]["candidates"] == 3


def test_a_malformed_progress_record_is_refused():
    doc = tuning_file.new_document(tuning_file.current_identity(CPU_INTERPRETER))
    doc["progress"] = {"job": "x", "times": {"a": -1.0}, "skipped": []}
    with pytest.raises(tuning_file.TuningFileError, match='"progress" must be'):
        tuning_file.parse_document(json.dumps(doc))


@pytest.mark.interpreter
@ON_CPU
def test_a_file_of_another_gpu_is_not_resumed_nor_overwritten(tuning_path, capsys):
    identity = {**tuning_file.current_identity(CPU_INTERPRETER), "gpu": "NVIDIA H200"}
    tuning_file.write_document(tuning_path, tuning_file.new_document(identity))
    before = tuning_path.read_text()
    assert main([*TINY, "--kernels", "pool"]) == 2
    err = capsys.readouterr().err
    assert "made for gpu 'NVIDIA H200'" in err and "--fresh" in err and err.count("\n") == 1
    assert tuning_path.read_text() == before
    assert main([*TINY, "--kernels", "pool", "--fresh", "--max-candidates", "1"]) == 0
    assert tuning_file.read_document(tuning_path)["identity"]["gpu"] == "cpu"
