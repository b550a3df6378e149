"""The VSA training experiment (``train_vsa``) at tiny size on the CPU: an arm runs and writes its
JSON and PNGs, a fine-tune starts from the dense arm's weights, a resumed arm repeats the
uninterrupted one exactly, the kept-mass metric against a brute-force count, and every bad input
is one line with exit status 2 before anything is written.

In-process runs under the reference backend on one torch thread (the tiny model's ops are too
small for two threads on two shared cores): a few seconds an arm."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from vidsparse.bench import runner  # noqa: E402
from vidsparse.bench.ops import train_vsa  # noqa: E402
from vidsparse.bench.ops.train_vsa_measure import kept_mass, select_tiles  # noqa: E402
from vidsparse.layout import VideoGrid  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_backend", "one_thread")
TINY = ["--tiny", "--device", "cpu"]
# Fields that hold times: they differ between any two runs.
TIMES = {"wall_s", "train_s", "step_ms", "eval_s"}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_arm(out, arm, *args) -> list[dict]:
    return train_vsa.main([*TINY, "--arm", arm, "--out", str(out), *args])


def read(out, arm) -> dict:
    return json.loads((out / f"{arm}.json").read_text())


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMES} for row in rows]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The tiny dense arm (4 steps, evals at 0, 2, 4), run once for the module."""
    out = tmp_path_factory.mktemp("train_vsa")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIDSPARSE_BACKEND", "torch")
        run_arm(out, "dense")
    torch.set_num_threads(threads)
    return out


def test_the_dense_arm_writes_its_json_pngs_and_checkpoint(dense):
    data = read(dense, "dense")
    meta, rows = data["meta"], data["rows"]
    assert meta["benchmark"] == "train_vsa" and meta["arm"] == "dense" and meta["complete"]
    assert meta["gpu"] == "cpu" and "git_commit" in meta and "torch" in meta
    assert meta["tokens_per_sample"] == 4 * 10 * 12 and meta["latent_grid"] == [4, 10, 12]
    assert meta["data"]["train_frames"] == [0, 73] and meta["eval"]["frames"] == [73, 81]
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert [r["tokens_seen"] for r in rows] == [0, 960, 1920]
    assert rows[0]["train_loss"] is None and len(rows[1]["train_losses"]) == 2
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]  # it learns, even in 4 steps
    for row in rows:
        assert row["metric_as_if"] and row["metric_sparsity"] == 0.875 and row["sparsity"] is None
        assert len(row["kept_mass"]) == len(row["attn_rel_l2"]) == 2  # per layer
        assert all(0 < m < 1 for m in row["kept_mass"]) and all(e > 0 for e in row["attn_rel_l2"])
        levels = {"0.25", "0.5", "0.75"}
        assert set(row["eval_loss_by_t"]) == set(row["eval_loss_ema_by_t"]) == levels
    # The EMA starts at the weights, then lags them.
    assert rows[0]["eval_loss_ema"] == rows[0]["eval_loss"]
    assert rows[-1]["eval_loss_ema"] != rows[-1]["eval_loss"]
    for name in ("dense_samples.png", "train_vsa.png", "checkpoints/dense.pt"):
        assert (dense / name).stat().st_size > 0, name


def test_finetune_vsa_starts_dense_from_the_dense_weights(dense, tmp_path):
    rows = run_arm(tmp_path, "finetune-vsa", "--init", str(dense / "checkpoints" / "dense.pt"))
    first, dense_last = rows[0], read(dense, "dense")["rows"][-1]
    # Zero gates at sparsity 0: dense attention, so the dense arm's last eval loss.
    assert first["sparsity"] == 0.0 and not first["metric_as_if"]
    assert first["eval_loss"] == pytest.approx(dense_last["eval_loss"], rel=1e-5)
    assert first["kept_mass"] == pytest.approx([1.0, 1.0]) and max(first["attn_rel_l2"]) < 1e-5
    assert [r["sparsity"] for r in rows] == [0.0, 0.4375, 0.875]  # warmup 1, ramp 2, 2 levels
    assert [r["global_step"] for r in rows] == [4, 6, 8]
    assert read(tmp_path, "finetune-vsa")["meta"]["init"]["step"] == 4


def test_vsa_warmup_starts_from_scratch_dense_then_ramps_to_its_target(dense, tmp_path):
    rows = run_arm(tmp_path, "vsa0.875-warmup")
    # The dense arm's init and data, attended densely (zero gates at sparsity 0) at step 0.
    assert rows[0]["sparsity"] == 0.0 and rows[0]["global_step"] == 0
    assert rows[0]["eval_loss"] == pytest.approx(read(dense, "dense")["rows"][0]["eval_loss"],
                                                 rel=1e-5)  # fmt: skip
    assert [r["sparsity"] for r in rows] == [0.0, 0.4375, 0.875]  # warmup 1, ramp 2, 2 levels
    assert read(tmp_path, "vsa0.875-warmup")["meta"]["init"] is None


def test_the_ema_follows_the_weights_with_a_warmup_decay_and_swaps_back():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    w0 = [p.detach().clone() for p in model.parameters()]
    ema = train_vsa.make_ema(model, 0.99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    w1 = [p.detach().clone() for p in model.parameters()]
    train_vsa.update_ema(ema, model, 0.99, 0)  # d = min(0.99, 1 / 10)
    for e, a, b in zip(ema, w0, w1):
        torch.testing.assert_close(e, a + 0.9 * (b - a))
    before = [e.clone() for e in ema]
    train_vsa.update_ema(ema, model, 0.5, 1000)  # d = 0.5 once past the warmup
    for e, a, b in zip(ema, before, w1):
        torch.testing.assert_close(e, 0.5 * a + 0.5 * b)
    run = type("R", (), {"model": model, "ema": ema})()
    with train_vsa.ema_weights(run):
        for p, e in zip(model.parameters(), ema):
            assert torch.equal(p, e)
    for p, b in zip(model.parameters(), w1):
        assert torch.equal(p, b)
    assert train_vsa.make_ema(model, 0.0) is None


def test_a_resumed_arm_repeats_the_uninterrupted_run(tmp_path):
    whole = run_arm(tmp_path / "whole", "vsa0.875", "--no-plot")
    first = run_arm(tmp_path / "split", "vsa0.875", "--no-plot", "--stop-at", "3")
    assert [r["step"] for r in first] == [0, 2]
    assert not read(tmp_path / "split", "vsa0.875")["meta"]["complete"]
    resumed = run_arm(tmp_path / "split", "vsa0.875", "--no-plot", "--resume")
    # Step 3 ran in the first call, step 4 (the next) in the second: the same losses.
    assert untimed(resumed) == untimed(whole)
    meta = read(tmp_path / "split", "vsa0.875")["meta"]
    assert meta["complete"] and [c["end_step"] for c in meta["calls"]] == [3, 4]


def test_how_often_it_evaluates_leaves_the_training_as_it_is(tmp_path):
    """Evals draw no training randomness: evaluating every step or only at the end trains the
    same weights (the per-step losses and the last eval agree exactly)."""
    often = run_arm(tmp_path / "often", "vsa0.875", "--no-plot", "--eval-every", "1")
    rarely = run_arm(tmp_path / "rarely", "vsa0.875", "--no-plot", "--eval-every", "4")
    assert [r["step"] for r in often] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in rarely] == [0, 4]
    assert [x for r in often for x in r["train_losses"]] == rarely[-1]["train_losses"]
    assert rarely[-1]["eval_loss"] == often[-1]["eval_loss"]
    assert rarely[-1]["eval_loss_ema"] == often[-1]["eval_loss_ema"]


def test_the_cosine_lr_warms_up_then_decays_to_its_floor_at_the_last_step():
    args = train_vsa.parse_args(["--arm", "dense", "--steps", "600", "--lr-warmup", "50"])
    assert args.lr_schedule == "cosine"
    lrs = [train_vsa.lr_at(args, step) for step in range(args.steps)]
    assert lrs[0] == pytest.approx(args.lr / 50) and lrs[49] == lrs[50] == args.lr
    decay = lrs[50:]
    assert all(a >= b for a, b in zip(decay, decay[1:])) and decay[0] > decay[-1]
    assert decay[-1] == pytest.approx(train_vsa.LR_FLOOR * args.lr)
    middle = 50 + (args.steps - 1 - 50) // 2
    assert lrs[middle] == pytest.approx(args.lr * (1 + train_vsa.LR_FLOOR) / 2, rel=1e-2)
    constant = train_vsa.parse_args(["--arm", "dense", "--lr-schedule", "constant"])
    assert {train_vsa.lr_at(constant, step) for step in range(50, 600)} == {constant.lr}


def test_the_cosine_can_reach_its_floor_before_the_last_step():
    """``--lr-decay-steps``: the same cosine over fewer steps, then the floor to the end."""
    argv = ["--arm", "dense", "--steps", "1200", "--lr-warmup", "50"]
    early = train_vsa.parse_args([*argv, "--lr-decay-steps", "600"])
    short = train_vsa.parse_args(["--arm", "dense", "--steps", "600", "--lr-warmup", "50"])
    lrs = [train_vsa.lr_at(early, step) for step in range(early.steps)]
    assert lrs[:600] == [train_vsa.lr_at(short, step) for step in range(600)]
    assert all(lr == pytest.approx(train_vsa.LR_FLOOR * early.lr) for lr in lrs[599:])
    whole = train_vsa.parse_args(argv)
    assert train_vsa.lr_at(whole, 599) > 2 * lrs[599]  # without it, the cosine spans all 1,200


def test_a_cosine_arm_resumes_only_with_its_steps(tmp_path, capsys):
    """The cosine spans the arm's steps: a resume with others is refused, nothing written."""
    run_arm(tmp_path, "dense", "--no-plot", "--stop-at", "2")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert runner.main(bench(tmp_path, "--arm", "dense", "--resume", "--steps", "8")) == 2
    assert "lr_steps 4 there, 8 here" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["vsa0.875", "vsa0.875-warmup"])
def test_compiled_blocks_train_as_the_eager_arm(tmp_path, arm):
    """``--compile blocks``: the training steps run compiled blocks (checkpointed, through
    VSA's gate; the scheduled arm through dense, then two sparsities), the evals eagerly; the
    losses and metrics are the eager arm's."""
    eager = run_arm(tmp_path / "eager", arm, "--no-plot")
    compiled = run_arm(tmp_path / "compiled", arm, "--no-plot", "--compile", "blocks")
    assert read(tmp_path / "compiled", arm)["meta"]["compile"] == "blocks"
    assert [r["step"] for r in compiled] == [r["step"] for r in eager] == [0, 2, 4]
    for ours, theirs in zip(compiled, eager):
        for key in ("train_loss", "eval_loss", "kept_mass_mean", "attn_rel_l2_mean"):
            if theirs[key] is not None:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-3), (ours["step"], key)


def test_kept_mass_is_one_at_sparsity_zero():
    grid = VideoGrid((3, 5, 6), (2, 2, 4))  # partial tiles along every axis
    q, k = torch.randn(2, 2, grid.num_tokens, 8), torch.randn(2, 2, grid.num_tokens, 8)
    assert kept_mass(q, k, grid, *select_tiles(q, k, grid, 0.0)) == pytest.approx(1.0)


def brute_force_kept_mass(q, k, grid, kv_indices, kv_counts) -> float:
    """Token by token in natural order, each token's tile from its coordinates."""
    (T, H, W), (tt, th, tw) = grid.shape, grid.tile_shape
    _, nh, nw = grid.tiles
    tile_of = [((t // tt) * nh + h // th) * nw + w // tw
               for t in range(T) for h in range(H) for w in range(W)]  # fmt: skip
    probs = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    total = 0.0
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i, tile in enumerate(tile_of):
                chosen = set(kv_indices[b, h, tile, : kv_counts[b, h, tile]].tolist())
                total += sum(float(probs[b, h, i, j]) for j, kt in enumerate(tile_of)
                             if kt in chosen)  # fmt: skip
    return total / (q.shape[0] * q.shape[1] * len(tile_of))


def test_kept_mass_equals_a_brute_force_count():
    grid = VideoGrid((3, 5, 6), (2, 2, 4))  # 2 x 3 x 2 tiles, most of them partial
    q, k = torch.randn(2, 2, grid.num_tokens, 8), torch.randn(2, 2, grid.num_tokens, 8)
    kv_indices, kv_counts = select_tiles(q, k, grid, 0.6)
    assert kv_counts.min() == 5  # ceil(0.4 * 12): real selections, not everything
    expected = brute_force_kept_mass(q, k, grid, kv_indices, kv_counts)
    assert 0.3 < expected < 0.9
    # Tiny chunks: one query tile at a time, as a 32k-token layer goes on a GPU.
    for chunk in (1, 2**27):
        got = kept_mass(q, k, grid, kv_indices, kv_counts, chunk=chunk)
        assert got == pytest.approx(expected, rel=1e-5)


def bench(out, *args) -> list[str]:
    return ["train_vsa", *TINY, "--out", str(out), *args]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--arm", "sparse"], "unknown arm 'sparse'; choose from dense, vsa0.875"),
        (["--arm", "finetune-vsa"], "continues a dense checkpoint: .*dense.pt does not exist"),
        (["--arm", "finetune-dense", "--init", "nowhere.pt"], "nowhere.pt does not exist"),
        (["--arm", "vsa0.9", "--resume"], "--resume: .*vsa0.9.pt does not exist"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--ema-decay", "1"], r"--ema-decay must be in \[0, 1\), got 1.0"),
        (["--steps", "8", "--lr-decay-steps", "9"], "--lr-decay-steps must be above --lr-warmup"),
        (
            ["--arm", "vsa0.875-warmup", "--schedule-warmup", "2"],
            r"never reaches sparsity 0.875: --schedule-warmup \(2\) \+ --schedule-ramp \(2\)",
        ),
        (
            ["--arm", "vsa0.875", "--schedule-ramp", "2"],
            "--schedule-ramp sets a sparsity schedule, which only vsa0.875-warmup and finetune-vsa",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, match, tmp_path, capsys):
    out = tmp_path / "out"
    assert runner.main(bench(out, *args)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("vidsparse bench: error: ")
    assert re.search(match, err), err
    assert not out.exists()  # nothing written


def test_checkpoints_of_another_arm_or_config_are_refused(dense, tmp_path, capsys):
    before = {p: p.stat().st_mtime_ns for p in dense.rglob("*")}
    cases = [
        (bench(dense, "--arm", "dense"), "holds a run of arm dense already"),
        (bench(dense, "--arm", "dense", "--resume", "--lr", "0.1"),
         "another run: lr 0.002 there, 0.1 here"),
        (bench(tmp_path, "--arm", "finetune-dense", "--seed", "1", "--init",
               str(dense / "checkpoints" / "dense.pt")), "another config: seed 0 there, 1 here"),
    ]  # fmt: skip
    other = torch.load(dense / "checkpoints" / "dense.pt", weights_only=True)
    other["identity"]["arm"] = "vsa0.9"
    torch.save(other, tmp_path / "vsa0.9.pt")
    init = ["--init", str(tmp_path / "vsa0.9.pt")]
    cases.append((bench(tmp_path, "--arm", "finetune-vsa", *init), "of arm 'vsa0.9', not of the"))
    del other["rows"]
    torch.save(other, tmp_path / "incomplete.pt")
    init = ["--init", str(tmp_path / "incomplete.pt")]
    cases.append((bench(tmp_path, "--arm", "finetune-vsa", *init), "incomplete train_vsa"))
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    cases.append((bench(tmp_path, "--arm", "finetune-vsa", "--init", str(tmp_path / "junk.pt")),
                  "junk.pt is not a train_vsa checkpoint"))  # fmt: skip
    for argv, match in cases:
        assert runner.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and match in err, err
    assert {p: p.stat().st_mtime_ns for p in dense.rglob("*")} == before  # nothing overwritten
    assert not (tmp_path / "finetune-dense.json").exists()
